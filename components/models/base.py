"""The model adapter: what the trainer needs from a text-to-image (or text-to-video) flow-matching pipeline.

The trainer only talks to this interface; each model family implements it in a folder of its own, registered in
``families.py`` (docs/MODELS.md).
"""

from __future__ import annotations

import contextlib
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch
from peft import LoraConfig
from peft.tuners.lora import LoraLayer
from peft.utils import get_peft_model_state_dict

from components.errors import ModelLoadError
from components.models.config import LoRAConfig
from components.models.families import GuidanceMode

T = TypeVar("T")
ADAPTER_NAME = "default"
TEXT_ENCODERS = ("text_encoder", "text_encoder_2", "text_encoder_3")


@dataclass
class PromptEmbeddings:
    """Text conditioning as named tensors whose first dimension is the batch."""

    tensors: dict[str, torch.Tensor]
    _memo: dict[str, object] = field(default_factory=dict, repr=False, compare=False)

    def cached(self, key: str, compute: Callable[[], T]) -> T:
        """``compute()`` once per embedding object: what the forwards derive from it at every step (the CFG
        batch, the negative prompt repeated to a batch, whether a mask pads anything) is derived once, and a
        test read of a device tensor syncs once."""
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]  # type: ignore[return-value]

    def __len__(self) -> int:
        return next(iter(self.tensors.values())).shape[0]

    def select(self, index: torch.Tensor) -> PromptEmbeddings:
        return PromptEmbeddings({k: v.index_select(0, index.to(v.device)) for k, v in self.tensors.items()})

    def expand_to(self, n: int) -> PromptEmbeddings:
        """Repeat a single-row embedding to ``n`` rows (used for the shared negative prompt)."""
        return PromptEmbeddings({k: v.expand(n, *v.shape[1:]) for k, v in self.tensors.items()})

    @staticmethod
    def cat(parts: list[PromptEmbeddings]) -> PromptEmbeddings:
        """Rows of several embeddings; sequences of different lengths are right-padded with zeros, as the
        pipelines pad a batch of prompts (their masks, padded with zeros too, mark the padding)."""
        out = {}
        for key in parts[0].tensors:
            tensors = [p.tensors[key] for p in parts]
            if tensors[0].dim() > 1 and len({t.shape[1] for t in tensors}) > 1:
                length = max(t.shape[1] for t in tensors)
                tensors = [torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, length - t.shape[1]))
                           for t in tensors]
            out[key] = torch.cat(tensors)
        return PromptEmbeddings(out)

    def rows(self) -> list[PromptEmbeddings]:
        """One embedding per prompt, each a copy in host memory."""
        return [PromptEmbeddings({k: v[i:i + 1].to("cpu", copy=True) for k, v in self.tensors.items()})
                for i in range(len(self))]

    def nbytes(self) -> int:
        return sum(v.numel() * v.element_size() for v in self.tensors.values())

    def to(self, device: torch.device) -> PromptEmbeddings:
        return PromptEmbeddings({k: v.to(device) for k, v in self.tensors.items()})


# The joint (text + image) attention of the MMDiT families (SD3, FLUX, Qwen-Image) and upstream flow_grpo's
# LoRA targets for all three.
JOINT_ATTENTION_TARGETS = ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                           "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out")


class _ComputeInInputDtype(torch.nn.Linear):
    """A LoRA factor whose float32 weight is cast to its input's dtype for the matmul: the LoRA runs in the
    model's dtype (bf16 tensor cores) while the optimizer keeps float32 weights, and gradients reach them through
    the cast. peft's own path casts the activations up to float32 instead, a float32 matmul and two copies of the
    activations per adapted layer."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return torch.nn.functional.linear(x, self.weight.to(x.dtype), bias)


class FlowMatchingModel(ABC):
    """A diffusers pipeline seen through the operations FlowGRPO needs."""

    guidance_mode: GuidanceMode = "cfg"
    batch_cfg = True  # the negative pass shares the prompt's forward (same text length in the batch)
    linear_sigmas = False  # the pipeline hands the scheduler np.linspace(1, 1/N, N) (FLUX, Qwen-Image)
    lora_targets: tuple[str, ...] = JOINT_ATTENTION_TARGETS  # named in error messages
    default_max_sequence_length = 128  # text tokens per prompt when model.max_sequence_length is null
    text_tokenizer = "tokenizer"  # the tokenizer whose limit caps the text length
    video = False  # latents with a time axis, decoded to frames (B, F, 3, H, W)
    # input images each prompt comes with (editing, image-to-video): 0 for a text-to-image family; a family that takes
    # them reads them in ``encode_prompts`` and keeps what it derives from them in the embedding (docs/MODELS.md)
    input_images = 0
    # the embedding's tensors derived from the input images: a CFG negative row takes them from its prompt's row
    condition_keys: tuple[str, ...] = ()

    def __init__(self, pipeline, device: torch.device, dtype: torch.dtype, negative_prompt: str = "",
                 max_sequence_length: int | None = None, num_frames: int = 1) -> None:
        self.pipeline = pipeline
        self.device = device
        self.dtype = dtype
        self.negative_prompt = negative_prompt
        if num_frames != 1 and not self.video:
            raise ModelLoadError(f"model.num_frames is {num_frames}, but {type(pipeline).__name__} makes images; "
                                 "set model.num_frames: 1 (only video families read it)")
        self.num_frames = num_frames
        self.lora_config: LoraConfig | None = None
        self._negative: PromptEmbeddings | None = None
        limit = getattr(pipeline, self.text_tokenizer).model_max_length
        if max_sequence_length is not None and max_sequence_length > limit:
            raise ModelLoadError(f"model.max_sequence_length {max_sequence_length} is over the limit of the model's "
                                 f"text tokenizer ({self.text_tokenizer}: {limit} tokens)")
        # the family default, or the (tiny) tokenizer's limit if shorter
        self.max_sequence_length = max_sequence_length or min(self.default_max_sequence_length, limit)

    @classmethod
    def pipeline_components(cls, root: Path) -> dict:
        """Components the loader builds itself for the pipeline saved in ``root``, in place of those its
        model_index.json names (one this environment cannot build as named)."""
        return {}

    def pipeline_call_kwargs(self, guidance_scale: float) -> dict:
        """Arguments of the pipeline's own ``__call__`` that make it guide as ``predict_velocity`` does."""
        return {"guidance_scale": guidance_scale, "negative_prompt": self.negative_prompt}

    def pipeline_inputs(self, prompts: list[str], guidance_scale: float, images: list[list] | None = None) -> dict:
        """Keyword arguments of the pipeline's ``__call__`` on ``prompts`` (with each prompt's input images, PIL,
        for a family that takes them), guided as ``predict_velocity`` guides."""
        return {"prompt": prompts, **self.pipeline_call_kwargs(guidance_scale)}

    def training_guidance_scale(self, guidance_scale: float, train_cfg: bool) -> float:
        """The scale the training forward uses: embedded guidance is part of every forward, CFG only if asked."""
        return guidance_scale if train_cfg or self.guidance_mode == "embedded" else 1.0

    @property
    def transformer(self) -> torch.nn.Module:
        return self.pipeline.transformer

    def to_device(self, *components: str, device: torch.device | None = None) -> None:
        """Move these pipeline components (``transformer``, ``vae``, ...) to ``device`` (the model's by default);
        components the pipeline lacks or has released are skipped."""
        for name in components:
            module = getattr(self.pipeline, name, None)
            if module is not None:
                module.to(device or self.device)

    def move_text_encoders(self, device: torch.device) -> None:
        self.to_device(*TEXT_ENCODERS, device=device)

    def release_text_encoders(self) -> None:
        """Drop the text encoders: every embedding the run needs has been computed."""
        for name in TEXT_ENCODERS:
            if getattr(self.pipeline, name, None) is not None:
                setattr(self.pipeline, name, None)

    def blocks(self) -> list[torch.nn.Module]:
        """The transformer's repeated blocks (the units of sharding and activation checkpointing)."""
        kinds = set(getattr(self.transformer, "_no_split_modules", None) or ())
        # by the class or its bases: FSDP swaps each sharded block's class for a subclass (FSDP<name>)
        return [m for m in self.transformer.modules() if any(c.__name__ in kinds for c in type(m).__mro__)]

    def compile_blocks(self) -> int:
        """Compile each repeated transformer block in place (regional compilation: the blocks share one compiled
        graph); returns how many. Sampling, training and the KL reference then all run the compiled blocks."""
        blocks = self.blocks()
        for block in blocks:
            block.compile()
        return len(blocks)

    def trim_embedding(self, row: PromptEmbeddings) -> PromptEmbeddings:
        """One prompt's embedding without the padding its batch added (families with masks trim it)."""
        return row

    @abstractmethod
    def encode_prompts(self, prompts: list[str], images: torch.Tensor | None = None) -> PromptEmbeddings:
        """Conditional embeddings, one row per prompt. ``images``: each prompt's input images, (B, N, 3, R, R)
        float32 in [-1, 1] at the model's resolution R with N = ``input_images``; None for a text-to-image
        family (``check_input_images`` refuses a mismatch before this is called)."""

    def encode_input_images(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        """What the forwards read of each prompt's input images (``images`` as ``encode_prompts`` takes them), by
        the pipeline's own encoding: tensors with one row per prompt, among the embedding's ``condition_keys``. A
        family that takes input images implements it; ``encode_prompts`` adds its tensors to the text's."""
        raise NotImplementedError(f"{type(self.pipeline).__name__} takes no input images")

    def check_input_images(self, count: int, where: str) -> None:
        """Refuse rows carrying ``count`` input images each when this family takes another number."""
        family = type(self.pipeline).__name__
        if count == self.input_images:
            return
        if not self.input_images:
            raise ModelLoadError(f"{where}: the rows carry {count} input image(s), but {family} makes images from "
                                 "text alone; train an editing or image-to-video family on them (docs/MODELS.md)")
        raise ModelLoadError(f"{where}: {family} takes {self.input_images} input image(s) per prompt, but the rows "
                             f"carry {count}; give every row `images` with {self.input_images} (docs/DATASETS.md)")

    @abstractmethod
    def latent_shape(self, resolution: int) -> tuple[int, ...]:
        """Shape of one latent (no batch dimension) for a square image of ``resolution`` px."""

    @abstractmethod
    def image_seq_len(self, resolution: int) -> int:
        """Image tokens the transformer sees; sets the dynamic schedule shift."""

    @abstractmethod
    def _forward(self, latents: torch.Tensor, sigma: float, embeds: PromptEmbeddings, guidance: float) -> torch.Tensor:
        """One transformer forward: the velocity at noise level ``sigma`` (``guidance``: embedded scale)."""

    def shift_mu(self, num_steps: int, resolution: int) -> float:
        """The resolution-dependent shift the pipeline hands a ``use_dynamic_shifting`` scheduler."""
        from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift

        c = self.pipeline.scheduler.config
        return calculate_shift(
            self.image_seq_len(resolution), c.get("base_image_seq_len", 256), c.get("max_image_seq_len", 4096),
            c.get("base_shift", 0.5), c.get("max_shift", 1.16),
        )

    def sigmas(self, num_steps: int, resolution: int) -> torch.Tensor:
        """The pipeline's noise levels, float32 on CPU, shape (num_steps + 1,), from 1 down to 0."""
        scheduler = self.pipeline.scheduler
        kwargs = {}
        if scheduler.config.get("use_dynamic_shifting", False):
            kwargs["mu"] = self.shift_mu(num_steps, resolution)
        if self.linear_sigmas:
            scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), device="cpu", **kwargs)
        else:
            scheduler.set_timesteps(num_steps, device="cpu", **kwargs)
        return scheduler.sigmas.detach().float().cpu().clone()

    def _unpack(self, latents: torch.Tensor) -> torch.Tensor:
        """Latents as the VAE takes them."""
        return latents

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Images in [0, 1], float32, shape (B, 3, H, W); a video family's frames, (B, F, 3, H, W)."""
        vae = self.pipeline.vae
        z = self._unpack(latents).to(vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
        image = vae.decode(z, return_dict=False)[0]
        return (image.float() / 2 + 0.5).clamp(0, 1)

    def negative_embeddings(self) -> PromptEmbeddings:
        """The negative-prompt text embedding used for CFG, computed once (LoRA never touches the text encoders).
        A family with input images encodes the text alone here (``encode_prompts(..., None)``); ``negative_for``
        adds each row's image conditioning."""
        if self._negative is None:
            self._negative = self.encode_prompts([self.negative_prompt])
        return self._negative

    def negative_for(self, cond: PromptEmbeddings) -> PromptEmbeddings:
        """The CFG negative rows for the prompt rows ``cond``: the negative text for each, with the row's input
        image conditioning (its ``condition_keys``)."""
        rows = self.negative_embeddings().expand_to(len(cond))
        carried = {k: cond.tensors[k] for k in self.condition_keys if k in cond.tensors}
        if not carried:
            return rows
        return PromptEmbeddings({**{k: v for k, v in rows.tensors.items() if k not in carried}, **carried})

    def combine_cfg(self, uncond: torch.Tensor, cond: torch.Tensor, scale: float) -> torch.Tensor:
        return uncond + scale * (cond - uncond)

    def predict_velocity(
        self, latents: torch.Tensor, sigma: float, cond: PromptEmbeddings, guidance_scale: float,
        uncond_grad: bool = True,
    ) -> torch.Tensor:
        """Velocity under the family's guidance at ``guidance_scale`` (CFG only when > 1); float32.

        With ``uncond_grad`` false the negative-prompt branch runs on its own without autograd (a cheaper
        backward, a different gradient: ``train.cfg_uncond_grad``)."""
        x = latents.to(self.dtype)
        if guidance_scale == 1.0 or self.guidance_mode in ("embedded", "none"):
            return self._forward(x, sigma, cond, guidance_scale).float()
        negative = cond.cached("negative", lambda: self.negative_for(cond))
        if not uncond_grad and torch.is_grad_enabled():
            cond_v = self._forward(x, sigma, cond, guidance_scale).float()
            with torch.no_grad():
                uncond_v = self._forward(x, sigma, negative, guidance_scale).float()
        elif self.batch_cfg:
            both = cond.cached("cfg_batch", lambda: PromptEmbeddings.cat([negative, cond]))
            uncond_v, cond_v = self._forward(torch.cat([x, x]), sigma, both, guidance_scale).float().chunk(2)
        else:
            cond_v = self._forward(x, sigma, cond, guidance_scale).float()
            uncond_v = self._forward(x, sigma, negative, guidance_scale).float()
        return self.combine_cfg(uncond_v, cond_v, guidance_scale)

    def add_lora(self, config: LoRAConfig) -> list[torch.nn.Parameter]:
        """Attach a LoRA adapter to the transformer; returns its trainable parameters (float32)."""
        names = [n for n, _ in self.transformer.named_modules()]
        unmatched = [t for t in config.target_modules if not any(n == t or n.endswith("." + t) for n in names)]
        if unmatched:
            raise ValueError(
                f"model.lora.target_modules: {', '.join(unmatched)} match no module of the "
                f"{type(self.transformer).__name__}; this family's attention targets are {', '.join(self.lora_targets)}"
            )
        self.lora_config = LoraConfig(
            r=config.rank, lora_alpha=config.alpha, init_lora_weights=config.init,
            target_modules=config.target_modules,
        )
        try:
            self.transformer.add_adapter(self.lora_config, adapter_name=ADAPTER_NAME)
        except ValueError as exc:
            raise ValueError(f"model.lora.target_modules: {exc}") from exc
        params = [p for n, p in self.transformer.named_parameters() if "lora_" in n]
        for p in params:
            p.data = p.data.float()
            p.requires_grad_(True)
        for layer in self.transformer.modules():
            if isinstance(layer, LoraLayer):
                layer.cast_input_dtype_enabled = False
                for factor in (*layer.lora_A.values(), *layer.lora_B.values()):
                    if type(factor) is torch.nn.Linear:
                        factor.__class__ = _ComputeInInputDtype
        return params

    @contextlib.contextmanager
    def adapter_disabled(self) -> Iterator[None]:
        """The reference model: the same weights with the LoRA switched off."""
        self.transformer.disable_adapters()
        try:
            yield
        finally:
            self.transformer.enable_adapters()

    def lora_state_dict(self) -> dict[str, torch.Tensor]:
        # from the LoRA parameters alone: a sharded transformer's full state_dict would be needed on every worker
        lora = {n: p for n, p in self.transformer.named_parameters() if "lora_" in n}
        state = get_peft_model_state_dict(self.transformer, state_dict=lora)
        return {k: v.detach().cpu().clone() for k, v in state.items()}

    def save_lora(self, directory: Path, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """Write the LoRA in diffusers format, loadable with ``pipe.load_lora_weights(directory)``."""
        if self.lora_config is None:
            raise RuntimeError("no LoRA adapter attached")
        type(self.pipeline).save_lora_weights(
            str(directory),
            transformer_lora_layers=state_dict if state_dict is not None else self.lora_state_dict(),
            transformer_lora_adapter_metadata=self.lora_config.to_dict(),
            safe_serialization=True,
        )


def same_images(a: Sequence, b: Sequence) -> bool:
    """Whether two rows of input images (uint8 arrays or PIL images) are the same images in the same order."""
    return len(a) == len(b) and all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a, b, strict=True))


def input_pixels(images: torch.Tensor) -> torch.Tensor:
    """Input images as the adapters take them (``model_input``: float in [-1, 1]) -> the uint8 pixels they were
    made of, in the same layout."""
    return ((images.float() + 1) * 127.5).round().clamp(0, 255).to(torch.uint8)


def wan_latent_stats(vae, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-channel latents_mean and latents_std of Wan's causal 3D VAE, shaped (1, C, 1, 1, 1)."""
    shape = (1, vae.config.z_dim, 1, 1, 1)
    return (torch.tensor(vae.config.latents_mean, device=device, dtype=dtype).view(shape),
            torch.tensor(vae.config.latents_std, device=device, dtype=dtype).view(shape))


def decode_wan_vae(vae, z: torch.Tensor) -> torch.Tensor:
    """Pixels in [0, 1], float32, (B, 3, F, H, W), of normalised latents (B, C, T, H, W) of Wan's causal 3D VAE
    (Wan, and Qwen-Image's one frame): each channel un-normalised by the VAE's latents_mean / latents_std."""
    z = z.to(vae.dtype)
    mean, std = wan_latent_stats(vae, z.device, z.dtype)
    video = vae.decode(z * std + mean, return_dict=False)[0]
    return (video.float() / 2 + 0.5).clamp(0, 1)


class PackedLatentModel(FlowMatchingModel):
    """Families whose transformer takes 2x2 latent patches as tokens (FLUX.1, Qwen-Image).

    Latents live packed, (tokens, 4 x VAE channels): noise drawn in that shape has the same law as the
    pipeline's packed noise, and the pipeline's own ``_unpack_latents`` turns them back for the VAE.
    """

    linear_sigmas = True

    def grid(self, resolution: int) -> int:
        """Tokens per side."""
        return resolution // (self.pipeline.vae_scale_factor * 2)

    def latent_shape(self, resolution: int) -> tuple[int, ...]:
        return (self.grid(resolution) ** 2, self.transformer.config.in_channels)

    def image_seq_len(self, resolution: int) -> int:
        return self.grid(resolution) ** 2

    def _resolution(self, latents: torch.Tensor) -> int:
        return math.isqrt(latents.shape[1]) * self.pipeline.vae_scale_factor * 2

    def _unpack(self, latents: torch.Tensor) -> torch.Tensor:
        side = self._resolution(latents)
        return self.pipeline._unpack_latents(latents, side, side, self.pipeline.vae_scale_factor)

    def _timestep(self, latents: torch.Tensor, sigma: float) -> torch.Tensor:
        # the pipelines pass scheduler timestep / 1000, i.e. sigma
        return torch.full((latents.shape[0],), sigma, device=latents.device, dtype=torch.float32)
