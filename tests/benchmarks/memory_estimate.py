"""Peak accelerator memory of one FlowGRPO worker at real shape, estimated on CPU without memory or compute.

The family's pipeline is built on the meta device (``real_shapes``) and wrapped in the trainer's own adapter
(``components.models``), the LoRA attached by ``add_lora``; then every parameter and buffer of the
transformer and the VAE is replaced by a fake tensor (``FakeTensorMode``: shapes and dtypes, no storage, no
arithmetic). The text encoders stay on the meta device and never run: the prompt and negative-prompt embeddings
are fakes of the shapes ``encode_prompts`` returns. The trainer's own code then runs: a sampler step as
``rollout.sample_rollout`` takes it (``predict_velocity``, ``sde_step_with_logprob``), ``decode``, and one
timestep of ``FlowGRPO.loss`` (``step_log_prob`` on a rollout of fakes, the KL reference with the adapter
disabled, ``flow_grpo_loss``, backward), while a ``TorchDispatchMode`` adds up the bytes of every live storage.
``torch.distributed._tools.mem_tracker.MemTracker`` fails on frozen parameters and ``module.to()`` cannot swap
fake tensors in, hence the hand-made replacement.

No ``FakeTensorMode`` is active while the trainer's code runs: the fakes carry it, and what the adapters build
from numbers (timesteps, sigmas, RoPE positions, Qwen-Image's all-ones text mask, which ``_forward`` reads as a
bool) stays real and small, so reading a value back works as on an accelerator.

Attention runs as PyTorch's fused scaled-dot-product kernel (the CPU flash kernel under fake tensors, flash /
memory-efficient on a GPU): no sequence x sequence matrix is stored, as on an accelerator. Not counted: the
CUDA context and caching-allocator slack (add ~1-3 GiB), the text encoders' activations while encoding, and the
rollout's stored latents and embeddings (a few MB).
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # real_shapes, beside this file (tests/ is no package)

import numpy as np
import real_shapes
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from components.algorithms.flow_grpo import flow_grpo_loss
from components.flow_rl.rollout import Rollout, SamplerSettings, step_log_prob
from components.flow_rl.sde import sde_step_with_logprob
from components.models.base import JOINT_ATTENTION_TARGETS, FlowMatchingModel, PromptEmbeddings
from components.models.config import LoRAConfig
from components.models.families import load, pipelines
from components.models.qwenimage.adapter import QwenImageModel
from components.models.qwenimage.edit import QwenImageEditModel
from components.models.wan.adapter import WanModel
from components.models.zimage.adapter import ZImageModel

GIB = 2**30
SIGMA, SIGMA_NEXT = 0.7, 0.6  # any step: activation memory does not depend on the noise level
GUIDANCE_SCALE = 4.5  # any scale above 1: only whether the family guides changes the work
NOISE_LEVEL = 0.7


@dataclass(frozen=True)
class Family:
    """What the adapter cannot tell: the default text lengths, in tokens."""

    text_tokens: int  # SD3: 77 CLIP + 128 T5; FLUX.1: the T5 length (128); Qwen-Image: the prompt's own length;
    # FLUX.2 klein: the padded Qwen3 length (512)
    negative_tokens: int  # the negative prompt's text length (Qwen-Image: " " after the template, 6 tokens)


FAMILIES: dict[str, Family] = {
    "sd35-medium": Family(77 + 128, 77 + 128),
    "sd35-large": Family(77 + 128, 77 + 128),
    "flux1-dev": Family(128, 0),  # embedded guidance: no negative prompt
    "qwen-image": Family(100, 6),
    "flux2-klein": Family(512, 512),  # every prompt, the empty negative too, padded to the Qwen3 length
    "z-image": Family(100, 8),  # the prompt's own length; the empty negative is the chat template's 8 tokens
    "wan21-1.3b": Family(226, 226),  # every prompt, the empty negative too, padded to the UMT5 length
    "flux1-kontext": Family(128, 0),  # FLUX.1-dev's; the input image's tokens are in the embedding (fake_embeds)
    "wan21-i2v-14b": Family(226, 226),
    "flux2-klein-base": Family(512, 512),  # as the distilled klein
    # the prompt and the negative " " each with the input picture: "Picture 1: " and its 196 vision tokens (384 px,
    # 14 px patches merged 2x2) between vision start / end
    "qwen-image-edit": Family(100 + 202, 6 + 202),
}


# --- live-storage accounting ---

class LiveBytes(TorchDispatchMode):
    """Bytes of the storages alive right now, and the peak since ``reset_peak``; each storage counted once."""

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self._seen: WeakIdKeyDictionary = WeakIdKeyDictionary()

    def add(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        if storage in self._seen:
            return
        size = storage.nbytes()
        self._seen[storage] = size
        self.current += size
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, size)

    def _free(self, size: int) -> None:
        self.current -= size

    def reset_peak(self) -> int:
        """Start a new peak at the current level; returns that level."""
        self.peak = self.current
        return self.current

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.add(t)
        return out


@contextlib.contextmanager
def _measure(live: LiveBytes, result: dict[str, int], key: str) -> Iterator[None]:
    """``result[key]``: the peak above the level on entry, of what runs inside."""
    start = live.reset_peak()
    with live:
        yield
    result[key] = live.peak - start


@contextlib.contextmanager
def _forward_rows(transformer: torch.nn.Module) -> Iterator[list[int]]:
    """The batch rows of each transformer forward run inside (the adapters pass ``hidden_states``, Z-Image's a
    list ``x``)."""
    rows: list[int] = []

    def count(_module: torch.nn.Module, _args: tuple, kwargs: dict) -> None:
        rows.append(len(kwargs["x"]) if "x" in kwargs else kwargs["hidden_states"].shape[0])

    handle = transformer.register_forward_pre_hook(count, with_kwargs=True)
    try:
        yield rows
    finally:
        handle.remove()


# --- the fake model ---

def _fakeify(module: torch.nn.Module, lora_dtype: torch.dtype) -> None:
    """Replace every parameter and buffer by an empty tensor of its shape (call inside a ``FakeTensorMode``).

    LoRA parameters become ``lora_dtype`` and trainable, the rest keep their dtype and stay frozen. Plain tensor
    attributes left on the meta device (Qwen-Image's RoPE tables) become fakes too: meta cannot move to a device.
    """
    for prefix, m in module.named_modules():
        for name, p in list(m._parameters.items()):
            if p is not None:
                lora = "lora_" in f"{prefix}.{name}"
                m._parameters[name] = torch.nn.Parameter(
                    torch.empty(p.shape, dtype=lora_dtype if lora else p.dtype, device="cpu"), requires_grad=lora)
        for name, b in list(m._buffers.items()):
            if b is not None:
                m._buffers[name] = torch.empty(b.shape, dtype=b.dtype, device="cpu")
        for name, t in list(vars(m).items()):
            if isinstance(t, torch.Tensor) and t.is_meta:
                setattr(m, name, torch.empty(t.shape, dtype=t.dtype, device="cpu"))


def _empty(mode: FakeTensorMode, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A fake tensor of ``mode``."""
    with mode:
        return torch.empty(shape, dtype=dtype)


@dataclass(frozen=True)
class LoRA:
    """The adapter as ``FlowMatchingModel.add_lora`` attaches it: float32 parameters beside the frozen weights."""

    rank: int = 32
    alpha: float = 64.0
    targets: tuple[str, ...] = JOINT_ATTENTION_TARGETS
    dtype: torch.dtype = torch.float32


def adapter_class(pipeline) -> type[FlowMatchingModel]:
    """The trainer's adapter for this pipeline (the family registry's, as ``load_model`` picks it)."""
    return load(pipelines()[type(pipeline).__name__].adapter)


def fake_model(family: str, lora: LoRA, mode: FakeTensorMode, dtype: torch.dtype = torch.bfloat16,
               transformer_layers: int | None = None, num_frames: int = 1) -> FlowMatchingModel:
    """The family's adapter on the real-shape pipeline (``transformer_layers`` blocks; None = real depth), LoRA
    attached, transformer and VAE fakes of ``mode``; a video family's of ``num_frames`` frames.

    Built and adapted on the meta device first: casting or moving fake parameters fails ("Couldn't swap").
    """
    pipeline = real_shapes.BUILDERS[family](device="meta", dtype=dtype, transformer_layers=transformer_layers)
    model = adapter_class(pipeline)(pipeline, torch.device("cpu"), dtype, "", num_frames=num_frames)
    model.add_lora(LoRAConfig(rank=lora.rank, alpha=lora.alpha, init="gaussian", target_modules=list(lora.targets)))
    with mode:
        # and the image encoder (Wan I2V's), which encode_input_images runs; counted with the text encoders
        for module in (pipeline.transformer, pipeline.vae, getattr(pipeline, "image_encoder", None)):
            if module is not None:
                _fakeify(module, lora.dtype)
    return model


def fake_embeds(model: FlowMatchingModel, mode: FakeTensorMode, rows: int, tokens: int, resolution: int = 512,
                input_images: int | None = None) -> PromptEmbeddings:
    """Embeddings as the adapter's ``encode_prompts`` returns them: the text states in the model's dtype, with
    the pooled CLIP projection (SD3, FLUX.1), the text mask (Qwen-Image, Z-Image) or nothing else (FLUX.2 klein,
    Wan); with ``input_images`` per prompt (None: the adapter's number; 0: the text alone, as the negative the CFG
    negative rows complete with each row's), what the adapter's own ``encode_input_images`` derives from them at
    ``resolution``, run on the fake VAE and image encoder (their shapes, as the trainer's forwards see them; the
    pixels are real zeros, which the pipelines' image processors read), and Qwen-Image-Edit's each row's
    negative, whose text carries the input picture as the prompt's does.

    The mask is real and all ones: nothing padded, so ``_forward`` takes the unmasked path, as for one prompt.
    """
    count = model.input_images if input_images is None else input_images
    config = model.transformer.config
    if isinstance(model, ZImageModel):  # captions of cap_feat_dim, their lengths in the mask
        text = {"prompt_embeds": _empty(mode, (rows, tokens, config.cap_feat_dim), model.dtype),
                "prompt_embeds_mask": torch.ones(rows, tokens, dtype=torch.long)}
    elif isinstance(model, WanModel):  # UMT5 states of text_dim, padded with zeros, no mask
        text = {"prompt_embeds": _empty(mode, (rows, tokens, config.text_dim), model.dtype)}
    elif isinstance(model, QwenImageModel):
        text = {"prompt_embeds": _empty(mode, (rows, tokens, config.joint_attention_dim), model.dtype),
                "prompt_embeds_mask": torch.ones(rows, tokens, dtype=torch.long)}
        if isinstance(model, QwenImageEditModel) and count:
            negative = FAMILIES["qwen-image-edit"].negative_tokens
            text.update(negative_prompt_embeds=_empty(mode, (rows, negative, config.joint_attention_dim), model.dtype),
                        negative_prompt_embeds_mask=torch.ones(rows, negative, dtype=torch.long))
    else:  # SD3 and FLUX.1 with the pooled projection; FLUX.2 klein has none
        text = {"prompt_embeds": _empty(mode, (rows, tokens, config.joint_attention_dim), model.dtype)}
        if "pooled_projection_dim" in config:
            text["pooled_projections"] = _empty(mode, (rows, config.pooled_projection_dim), model.dtype)
    if count:
        text.update(model.encode_input_images(torch.zeros(rows, count, 3, resolution, resolution)))
    return PromptEmbeddings(text)


def fake_rollout(model: FlowMatchingModel, mode: FakeTensorMode, prompts: int, batch: int, resolution: int,
                 text_tokens: int, input_images: int = 0) -> Rollout:
    """A rollout of ``batch`` samples with one stored step, one prompt each; the latents, log-probs and
    embeddings fakes, the indices and sigmas real (``step_log_prob`` reads the sigmas as numbers). Each prompt
    comes with ``input_images`` input images at ``resolution`` (0: the adapter's number)."""
    return Rollout(
        prompts=[""] * prompts, embeds=fake_embeds(model, mode, prompts, text_tokens, resolution, input_images or None),
        prompt_index=torch.arange(batch), sigmas=torch.tensor([SIGMA]), sigmas_next=torch.tensor([SIGMA_NEXT]),
        trajectory=_empty(mode, (batch, 2, *model.latent_shape(resolution))), log_probs=_empty(mode, (batch, 1)),
        images=np.zeros((batch, 0, 0, 3), dtype=np.uint8),
    )


def lora_params(model: FlowMatchingModel) -> list[torch.nn.Parameter]:
    """The adapter's parameters (what the optimizer steps)."""
    return [p for n, p in model.transformer.named_parameters() if "lora_" in n]


def _bytes(tensors) -> int:
    """Bytes of ``tensors`` (numel x element size)."""
    return sum(t.numel() * t.element_size() for t in tensors)


def weight_bytes(model: FlowMatchingModel) -> dict[str, int]:
    """Frozen weights by where FSDP puts them: the repeated blocks, the rest (root), buffers (never sharded)."""
    block = [_bytes(p for n, p in b.named_parameters() if "lora_" not in n) for b in model.blocks()]
    transformer = model.transformer
    frozen = _bytes(p for n, p in transformer.named_parameters() if "lora_" not in n)
    return {"blocks": sum(block), "largest_block": max(block, default=0), "root": frozen - sum(block),
            "buffers": _bytes(transformer.buffers())}


def sharded_weight_bytes(w: dict[str, int], world: int) -> int:
    """A worker's frozen weights while computing under FSDP2 over ``world`` workers.

    1/world of the blocks, plus the one block all-gathered at a time; the root's parameters gathered for the whole
    forward / backward; buffers replicated. ``world`` 1: everything, unsharded.
    """
    if world <= 1:
        return w["blocks"] + w["root"] + w["buffers"]
    return w["blocks"] // world + w["largest_block"] + w["root"] + w["buffers"]


# --- the trainer's phases, run by its own code ---

@dataclass(frozen=True)
class Workload:
    """What one worker runs: the batch of each phase, whether it guides, the text lengths, the memory settings."""

    resolution: int
    text_tokens: int
    negative_tokens: int
    sample_batch: int
    sample_cfg: bool
    train_batch: int
    train_cfg: bool
    checkpointing: bool
    beta: float
    num_frames: int = 1
    input_images: int = 0  # per prompt (editing): what the adapter derives from them joins every forward

    def sampler(self) -> SamplerSettings:
        """One SDE step, stored for training; the sampling scale only when it guides."""
        return SamplerSettings(num_steps=1, guidance_scale=GUIDANCE_SCALE if self.sample_cfg else 1.0,
                               noise_level=NOISE_LEVEL, sde_type="sde", resolution=self.resolution,
                               sde_steps=(0,), train_steps=(0,))


def _sampling(model: FlowMatchingModel, mode: FakeTensorMode, rollout: Rollout, batch: int,
              settings: SamplerSettings) -> None:
    """One step of ``rollout.sample_rollout`` on ``batch`` samples, no grad."""
    with torch.no_grad():
        cond = rollout.embeds.select(torch.arange(batch))
        x = _empty(mode, (batch, *model.latent_shape(settings.resolution)))
        v = model.predict_velocity(x, SIGMA, cond, settings.guidance_scale)
        sde_step_with_logprob(v, SIGMA, SIGMA_NEXT, x, noise_level=settings.noise_level, sde_type=settings.sde_type)


def _training(model: FlowMatchingModel, rollout: Rollout, settings: SamplerSettings, guidance_scale: float,
              beta: float, live: LiveBytes, result: dict[str, int]) -> list[int]:
    """``FlowGRPO.loss`` for one timestep of the rollout: graph forward, the KL reference forward
    (beta > 0), backward. Returns the rows of the graph's transformer forwards."""
    idx = torch.arange(len(rollout))
    with _forward_rows(model.transformer) as rows:
        log_prob, mean, std_dev_t = step_log_prob(model, rollout, idx, 0, settings, guidance_scale)
    ref_mean = None
    if beta > 0:
        outer_peak = live.peak
        start = live.reset_peak()
        with torch.no_grad(), model.adapter_disabled():
            _, ref_mean, _ = step_log_prob(model, rollout, idx, 0, settings, guidance_scale)
        result["kl_reference"] = live.peak - start  # transient, on top of the held training graph
        live.peak = max(outer_peak, live.peak)
    loss, _ = flow_grpo_loss(log_prob, rollout.log_probs[idx, 0], torch.ones(len(idx)), clip_range=0.2,
                             adv_clip_max=5.0, mean=mean, ref_mean=ref_mean, std_dev_t=std_dev_t, beta=beta)
    loss.backward()
    return rows


def _resident(model: FlowMatchingModel, rollout: Rollout) -> Iterator[torch.Tensor]:
    """What stays allocated through every phase: the transformer and the VAE, the cached negative embedding,
    the rollout."""
    for module in (model.transformer, model.pipeline.vae):
        yield from module.parameters()
        yield from module.buffers()
    yield from model.negative_embeddings().tensors.values()
    yield from rollout.embeds.tensors.values()
    yield from (rollout.trajectory, rollout.log_probs)


def _prepare_training(model: FlowMatchingModel, live: LiveBytes, checkpointing: bool) -> None:
    """The trainer's state before a backward: activation checkpointing as ``train.gradient_checkpointing`` sets
    it (``loop.Trainer``), and the LoRA's gradients, which accumulate over timesteps: they exist before every
    backward but the first."""
    if checkpointing:
        model.transformer.enable_gradient_checkpointing()
    for p in lora_params(model):
        p.grad = torch.zeros_like(p)
        live.add(p.grad)


def _activations(model: FlowMatchingModel, mode: FakeTensorMode, work: Workload) -> dict[str, int]:
    """Activation peaks (bytes above the resident tensors) of sampling, decoding and training, and the rows of
    their transformer forwards."""
    result: dict[str, int] = {}
    # what negative_embeddings() caches
    model._negative = fake_embeds(model, mode, 1, work.negative_tokens, input_images=0)
    rollout = fake_rollout(model, mode, max(work.sample_batch, work.train_batch), work.train_batch,
                           work.resolution, work.text_tokens, work.input_images)
    settings = work.sampler()
    live = LiveBytes()
    for t in _resident(model, rollout):
        live.add(t)
    with _measure(live, result, "sampling"), _forward_rows(model.transformer) as sample_rows:
        _sampling(model, mode, rollout, work.sample_batch, settings)
    with _measure(live, result, "decode"), torch.no_grad():
        model.decode(_empty(mode, (work.sample_batch, *model.latent_shape(work.resolution))))
    _prepare_training(model, live, work.checkpointing)
    guidance = model.training_guidance_scale(GUIDANCE_SCALE, work.train_cfg)
    with _measure(live, result, "training"):
        train_rows = _training(model, rollout, settings, guidance, work.beta, live, result)
    result.update(sample_rows=sample_rows[0], train_rows=train_rows[0], train_forwards=len(train_rows))
    return result


# --- the estimate ---

def text_encoder_bytes(family: str, dtype: torch.dtype = torch.bfloat16, layers: int | None = None) -> int:
    """The family's text encoders in ``dtype``: their real size, or ``layers`` deep (as in a run that reduced
    them) at real width and vocabulary."""
    return sum(real_shapes.text_encoder_param_counts(family, layers).values()) * dtype.itemsize


def vae_bytes(family: str, dtype: torch.dtype = torch.bfloat16) -> int:
    """The family's real VAE weights in ``dtype``."""
    return real_shapes.vae_param_count(family) * dtype.itemsize


def _phases(w: dict[str, int], lora: int, act: dict[str, int], text: int, vae: int, *,
            shard_world: int, offload_text_encoders: bool) -> dict[str, int]:
    """Bytes by item and phase: what stays resident, plus each phase's activation peak on top of it."""
    weights = sharded_weight_bytes(w, shard_world)
    adam = 2 * lora  # AdamW exp_avg + exp_avg_sq, in the LoRA's dtype
    held = 0 if offload_text_encoders else text
    resident = weights + lora + adam + vae + held  # from the first optimizer step on, sampling included
    figures = {
        "transformer_weights": weights, "transformer_weights_unsharded": sharded_weight_bytes(w, 1),
        "lora_params": lora, "lora_grads": lora, "adam_state": adam, "lora_optimizer": lora + adam,
        "text_encoders_real": text, "text_encoders_resident": held, "vae": vae,
        "resident_sampling": resident, "resident_training": resident + lora,  # gradients accumulate over steps
        "sampling_transformer_activations": act["sampling"], "vae_decode_activations": act["decode"],
        "training_activations": act["training"], "kl_reference_activations": act.get("kl_reference", 0),
        # offloaded, every prompt is encoded before anything else is placed (Trainer._place_model); a prompt set
        # over model.prompt_cache_gib brings the encoders back each epoch, beside the resident model
        "encode_peak": text if offload_text_encoders else resident,
        "epoch_encode_peak": resident - held + text,
        "sampling_peak": resident + max(act["sampling"], act["decode"]),
        "training_peak": resident + lora + act["training"],
    }
    figures["steady_peak"] = max(figures["sampling_peak"], figures["training_peak"])
    figures["peak"] = max(figures["encode_peak"], figures["steady_peak"])
    return figures


def estimate(
    family: str, *, sample_batch: int, train_batch: int, sample_cfg: bool = True, train_cfg: bool = False,
    resolution: int = 512, text_tokens: int | None = None, negative_tokens: int | None = None,
    lora_rank: int = 32, lora_alpha: float = 64.0, lora_targets: tuple[str, ...] = JOINT_ATTENTION_TARGETS,
    gradient_checkpointing: bool = False, offload_text_encoders: bool = False, shard_world: int = 1,
    beta: float = 0.0, dtype: torch.dtype = torch.bfloat16, lora_dtype: torch.dtype = torch.float32,
    text_layers: int | None = None, transformer_layers: int | None = None, num_frames: int = 1,
    input_images: int = 0,
) -> dict[str, float]:
    """Peak memory of one worker in GiB (``*_gib`` keys), by item and phase, plus the rows of each forward.

    ``sample_batch`` / ``train_batch``: images per sampling / training forward on the worker. ``sample_cfg``:
    guidance scale > 1 while sampling; ``train_cfg``: CFG repeated in the training forward (``train.train_cfg``);
    both ignored for FLUX.1-dev, whose guidance is embedded. ``text_tokens`` / ``negative_tokens``: the prompt's /
    negative prompt's text length (defaults in ``FAMILIES``). ``shard_world``: FSDP workers sharding the frozen
    transformer weights (1 = none). ``offload_text_encoders``: released after encoding, they count only in
    ``encode_peak_gib``. ``beta`` > 0 adds the KL reference forward (no grad, transient, while the training graph
    is held). ``lora_dtype``: the trainer's float32, with which peft casts each adapted layer's input to float32
    (copies the backward keeps). ``text_layers``: text encoders of that depth (as in a measured run that reduced
    them) instead of their real size; ``transformer_layers``: that many blocks (a reduced run) instead of all.
    ``num_frames``: frames per video of a video family (Wan). ``input_images``: input images per prompt at
    ``resolution`` (editing; FLUX.2 klein's references lengthen every forward's sequence).
    ``steady_peak_gib``: sampling or training; ``peak_gib``: encoding too.
    The fake-tensor pass is cached, so variants that differ only in sharding, offload or text encoders are free.
    """
    spec = FAMILIES[family]
    work = Workload(resolution, text_tokens or spec.text_tokens,
                    spec.negative_tokens if negative_tokens is None else negative_tokens,
                    sample_batch, sample_cfg, train_batch, train_cfg, gradient_checkpointing, beta, num_frames,
                    input_images)
    weights, lora, act = _fake_pass(family, LoRA(lora_rank, lora_alpha, tuple(lora_targets), lora_dtype), work,
                                    dtype, transformer_layers)
    figures = _phases(weights, lora, act, text_encoder_bytes(family, dtype, text_layers), vae_bytes(family, dtype),
                      shard_world=shard_world, offload_text_encoders=offload_text_encoders)
    out: dict[str, float] = {f"{k}_gib": v / GIB for k, v in figures.items()}
    out.update({k: act[k] for k in ("sample_rows", "train_rows", "train_forwards")})
    return out


@cache
def _fake_pass(family: str, lora: LoRA, work: Workload, dtype: torch.dtype,
               transformer_layers: int | None) -> tuple[dict[str, int], int, dict[str, int]]:
    """(frozen weight bytes by FSDP placement, LoRA bytes, activation peaks) of one fake-tensor run."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    model = fake_model(family, lora, mode, dtype, transformer_layers, work.num_frames)
    return weight_bytes(model), _bytes(lora_params(model)), _activations(model, mode, work)
