"""The memory settings on the tiny twins of every family: activation checkpointing changes neither the
first ratio nor a gradient, offloaded text encoders change no embedding, and neither changes what is trained."""

from pathlib import Path

import pytest
import torch
from metric_rows import without_timing
from rescoring import assert_ratio_is_one
from safetensors.torch import load_file
from tiny_families import recipe, text_twins

from components.algorithms.flow_grpo import FlowGRPO
from components.dataset.prepared import PromptRow
from components.errors import ConfigError
from components.flow_rl.prompt_cache import PromptEncoder
from components.flow_rl.rollout import sample_rollout, step_log_prob
from components.models.base import TEXT_ENCODERS
from components.models.loading import load_model
from components.trainer import checkpoint as ckpt
from components.trainer.loop import Trainer
from pipeline.config import load_config

FAMILIES = {kind: recipe(kind) for kind in text_twins()}
SMALL = ["train.epochs=2", "sampling.prompts_per_epoch=2", "sampling.group_size=4", "sampling.batch_size_per_worker=8",
         "train.batch_size_per_worker=4", "sampling.num_steps=4", "train.checkpoint_every=1", "train.beta=0.04",
         "tracking.system_metrics=false"]
# prompts of different token lengths, so Qwen-Image's padded text (and its mask) is exercised
PROMPTS = ["a cat", "a lighthouse on a cliff at dusk, oil painting"]


def _quiet(_msg: str) -> None:
    pass


def _config(kind: str, *overrides: str):
    return load_config(FAMILIES[kind], [*SMALL, *overrides])


def _lora(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(str(directory / ckpt.LORA_FILE))


@pytest.mark.parametrize("kind", FAMILIES)
def test_gradient_checkpointing_recomputes_every_block_and_changes_no_ratio_and_no_gradient(kind):
    config = _config(kind)
    model = load_model(config.model, 0)
    torch.manual_seed(0)
    params = model.add_lora(config.model.lora)
    with torch.no_grad():  # a LoRA away from its zero init, so every LoRA matrix gets a gradient
        for p in params:
            p.add_(0.01 * torch.randn_like(p))
    algorithm = FlowGRPO(config, model, params)
    settings = algorithm.sampler_settings(torch.Generator().manual_seed(0), 0)
    guidance = algorithm.training_guidance()
    rollout = sample_rollout(model, PROMPTS, 4, 8, settings, torch.Generator().manual_seed(1))
    advantages = torch.linspace(-1, 1, len(rollout))
    idx = torch.randperm(len(rollout), generator=torch.Generator().manual_seed(2))[:4]
    blocks = model.blocks()
    assert blocks

    def training_step() -> tuple[list[torch.Tensor], int]:
        calls = [0]
        hooks = [b.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1)) for b in blocks]
        for p in params:
            p.grad = None
        for t in range(len(settings.train_steps)):
            log_prob, _, _ = step_log_prob(model, rollout, idx, t, settings, guidance)
            ratio = torch.exp(log_prob - rollout.log_probs[idx, t])
            assert_ratio_is_one(ratio, t)  # the training forward equals the sampling one
            (-(advantages[idx] * ratio).mean()).backward()
        for h in hooks:
            h.remove()
        return [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in params], calls[0]

    plain, plain_calls = training_step()
    model.transformer.enable_gradient_checkpointing()
    checkpointed, checkpointed_calls = training_step()
    assert checkpointed_calls == 2 * plain_calls  # every block ran again in the backward pass
    # nearly every LoRA matrix has a gradient (a last block's unused text queries get none)
    assert sum(bool(g.abs().sum() > 0) for g in plain) >= 0.8 * len(plain)
    assert all(torch.equal(a, b) for a, b in zip(plain, checkpointed, strict=True))
    with torch.no_grad():  # sampling is untouched: no recomputation without gradients
        calls = [0]
        hook = blocks[0].register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        sample_rollout(model, PROMPTS[:1], 2, 2, settings, torch.Generator().manual_seed(1))
        hook.remove()
    assert calls[0] == settings.num_steps * (2 if kind == "tiny-qwenimage" else 1)  # true CFG: 2 forwards


@pytest.mark.parametrize("kind", FAMILIES)
def test_offloaded_text_encoders_are_released_and_the_run_is_unchanged(kind, tmp_path):
    # every epoch samples all 8 prompts, so the plain run encodes the same batch of prompts as the cache does
    # (prompts encoded in other batches differ by float summation order, ~2e-7); one epoch: the cache is filled
    # and the encoders released before it, so it already samples and trains from the cache alone
    every_prompt = ("sampling.prompts_per_epoch=8", "sampling.batch_size_per_worker=16",
                    "train.batch_size_per_worker=8", "train.epochs=1")
    plain = Trainer(_config(kind, *every_prompt), tmp_path / "plain", log=_quiet)
    lines: list[str] = []
    offloaded = Trainer(_config(kind, *every_prompt, "model.offload_text_encoders=true",
                                "train.gradient_checkpointing=true"), tmp_path / "offloaded", log=lines.append)
    present = [n for n in TEXT_ENCODERS if getattr(plain.model.pipeline, n, None) is not None]
    assert present and all(getattr(offloaded.model.pipeline, n, None) is None for n in present)
    assert set(offloaded.prompts.cache) == {r.key for r in offloaded.rows}
    assert any(line.startswith(f"text encoders released: {len(offloaded.rows)} prompt embeddings cached")
               for line in lines)
    a, b = plain.fit(), offloaded.fit()
    assert without_timing(b.history) == without_timing(a.history)
    la, lb = _lora(a.lora_dir), _lora(b.lora_dir)
    assert la.keys() == lb.keys() and all(torch.equal(la[k], lb[k]) for k in la)


def test_a_prompt_set_over_the_cache_budget_is_encoded_each_epoch_with_the_encoders_in_host_memory(tmp_path):
    config = _config("tiny-sd3", "model.offload_text_encoders=true", "model.prompt_cache_gib=0")
    lines: list[str] = []
    trainer = Trainer(config, tmp_path / "run", log=lines.append)
    assert trainer.prompts.cache is None and trainer.model.pipeline.text_encoder_3 is not None
    assert any("exceed model.prompt_cache_gib (0)" in line for line in lines)
    moves: list[str] = []
    original = trainer.model.move_text_encoders
    trainer.model.move_text_encoders = lambda device: (moves.append(torch.device(device).type), original(device))
    result = trainer.fit()
    # in for each epoch's prompts and out; once more for the sample grids' held-out prompts, encoded once
    assert moves == [trainer.model.device.type, "cpu"] * (config.train.epochs + 1)
    reference = Trainer(_config("tiny-sd3"), tmp_path / "reference", log=_quiet).fit()
    assert [r["reward/mean"] for r in result.history] == pytest.approx([r["reward/mean"] for r in reference.history],
                                                                      rel=1e-5)


@pytest.mark.parametrize("kind", ["tiny-sd3", "tiny-qwenimage"])
def test_cached_embeddings_equal_encoding_the_prompts_together(kind):
    """Cached one prompt at a time (Qwen-Image's trimmed to its tokens), then batched again with zero padding:
    what the pipeline itself gives for the same prompts encoded together."""
    config = _config(kind)
    model = load_model(config.model, 0)
    direct = model.encode_prompts([PROMPTS[1], PROMPTS[0], PROMPTS[1]])
    rows = [PromptRow(p) for p in PROMPTS]
    encoder = PromptEncoder(model, rows, resolution=config.model.resolution, offload=True, cache_gib=1.0, log=_quiet)
    cached = encoder([rows[1], rows[0], rows[1]])
    assert cached.tensors.keys() == direct.tensors.keys()
    for key, value in direct.tensors.items():
        assert cached.tensors[key].shape == value.shape, key
        assert torch.allclose(cached.tensors[key].float(), value.float(), atol=1e-6), key
    if kind == "tiny-qwenimage":  # the short prompt is padded, and its mask says so
        mask = cached.tensors["prompt_embeds_mask"]
        assert mask[1].sum() < mask[0].sum() == mask.shape[1]


def test_sharding_without_data_parallel_workers_is_refused_before_training(tmp_path):
    with pytest.raises(ConfigError, match=r"train.sharding is 'fsdp' but this process has no process group.*"
                                          r"--ray-workers N"):
        Trainer(_config("tiny-sd3", "train.sharding=fsdp"), tmp_path / "run", log=_quiet)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_the_trainer_says_how_an_epoch_is_split_and_how_many_samples_make_an_optimizer_step(tmp_path):
    lines: list[str] = []
    Trainer(_config("tiny-sd3", "train.gradient_accumulation_steps=2"), tmp_path / "run", log=lines.append)
    assert ("batches: 1 worker(s), each 8 images per epoch in 1 sampling batches of 8; 1 optimizer step(s) per "
            "epoch, each 8 samples = 4 per worker x 2 accumulation x 1 worker(s)") in lines
