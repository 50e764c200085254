"""Benchmark: our SDE rollout (with log-probs) against the diffusers pipeline's own ``__call__``.

Both run on the same tiny model with the same LoRA attached, the same prompts, batch and
step count, and both decode to images. Runs alternate so machine noise hits both alike;
the median of the per-pair ratios is printed (target <= 1.15). Then a short training run
prints the share of an epoch spent sampling, scoring and training.

    python tests/benchmarks/bench_sampler.py [--repeats N] [--batch B] [--steps S]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")

import torch

from components.trainer.config import LoRAConfig, ModelConfig
from components.trainer.loop import train
from components.trainer.models import load_model
from components.trainer.rollout import SamplerSettings, plan_steps, sample_rollout
from pipeline.config import load_config


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def sampler_ratio(repeats: int, batch: int, steps: int) -> None:
    model = load_model(ModelConfig(), seed=0)
    model.add_lora(LoRAConfig())
    prompts = [f"prompt number {i}" for i in range(batch)]  # both sides encode the same 16 prompts
    sde, train_steps = plan_steps(steps, 0.99, None)
    settings = SamplerSettings(steps, 1.0, 0.7, "sde", 32, sde, train_steps)

    def ours():
        sample_rollout(model, prompts, 1, batch, settings, torch.Generator().manual_seed(0))

    def diffusers_call():
        with torch.no_grad():
            model.pipeline(prompts, num_inference_steps=steps, guidance_scale=1.0, height=32, width=32,
                           generator=torch.Generator().manual_seed(0), output_type="pt", max_sequence_length=32)

    ours(), diffusers_call()  # warm-up
    ratios, t_ours, t_ref = [], [], []
    for _ in range(repeats):
        a, b = _timed(ours), _timed(diffusers_call)
        t_ours.append(a)
        t_ref.append(b)
        ratios.append(a / b)
    print(f"sampler: {batch} images x {steps} steps, {repeats} alternating pairs")
    print(f"  ours (SDE + log-probs + trajectory) median {statistics.median(t_ours):.3f}s; "
          f"diffusers __call__ median {statistics.median(t_ref):.3f}s")
    print(f"  ratio ours/diffusers: median {statistics.median(ratios):.3f} "
          f"(min {min(ratios):.3f}, max {max(ratios):.3f}); target <= 1.15")


def epoch_shares(epochs: int) -> None:
    config = load_config(None, [f"train.epochs={epochs}", f"train.checkpoint_every={epochs}"])
    with tempfile.TemporaryDirectory() as out:
        result = train(config, out, log=lambda _m: None)
    rows = result.history[1:] or result.history  # the first epoch pays one-off warm-up
    parts = {k: statistics.fmean(r[f"time/{k}"] for r in rows) for k in ("sampling", "scoring", "training")}
    total = sum(parts.values())
    shares = ", ".join(f"{k} {v / total:.0%}" for k, v in parts.items())
    print(f"epoch (tiny-cpu default, mean of {len(rows)} epochs, {total:.2f}s): {shares}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--epochs", type=int, default=4, help="epochs of the share measurement")
    args = parser.parse_args()
    sampler_ratio(args.repeats, args.batch, args.steps)
    epoch_shares(args.epochs)


if __name__ == "__main__":
    main()
