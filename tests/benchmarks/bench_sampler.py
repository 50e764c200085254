"""Benchmark: our SDE rollout (with log-probs) against the diffusers pipeline's own ``__call__``.

Both run on the same tiny model with the same LoRA attached, the same prompts, batch and
step count, the family's guidance as its tiny config sets it, and both decode to images.
Runs alternate so machine noise hits both alike; the median of the per-pair ratios is
printed per family, side by side (target <= 1.15; never a failure). Then a short training
run prints the share of an epoch spent sampling, scoring and training.

    python tests/benchmarks/bench_sampler.py [--family tiny-flux ...] [--repeats N] [--batch B] [--steps S]
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

from components.flow_rl.rollout import SamplerSettings, plan_steps, sample_rollout
from components.models.loading import load_model
from components.trainer.training_run import train
from pipeline.config import CONFIG_DIR, TINY_CONFIG, load_config

FAMILIES = {"tiny-sd3": "tiny-cpu.yaml", "tiny-flux": "tiny-flux-cpu.yaml", "tiny-qwenimage": "tiny-qwenimage-cpu.yaml"}


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def sampler_ratio(kind: str, repeats: int, batch: int, steps: int) -> dict[str, float]:
    config = load_config(CONFIG_DIR / FAMILIES[kind])
    model = load_model(config.model, seed=0)
    model.add_lora(config.model.lora)
    g = config.sampling.guidance_scale
    prompts = [f"prompt number {i}" for i in range(batch)]  # both sides encode the same prompts
    sde, train_steps = plan_steps(steps, 0.99, None)
    settings = SamplerSettings(steps, g, 0.7, "sde", 32, sde, train_steps)

    def ours():
        sample_rollout(model, prompts, 1, batch, settings, torch.Generator().manual_seed(0))

    def diffusers_call():
        with torch.no_grad():
            model.pipeline(prompts, num_inference_steps=steps, height=32, width=32,
                           generator=torch.Generator().manual_seed(0), output_type="pt",
                           **model.pipeline_call_kwargs(g))

    ours(), diffusers_call()  # warm-up
    ratios, t_ours, t_ref = [], [], []
    for _ in range(repeats):
        a, b = _timed(ours), _timed(diffusers_call)
        t_ours.append(a)
        t_ref.append(b)
        ratios.append(a / b)
    return {"guidance": g, "ours": statistics.median(t_ours), "diffusers": statistics.median(t_ref),
            "ratio": statistics.median(ratios), "min": min(ratios), "max": max(ratios)}


def print_ratios(results: dict[str, dict[str, float]], repeats: int, batch: int, steps: int) -> None:
    print(f"sampler: {batch} images x {steps} steps, {repeats} alternating pairs; "
          "ours = SDE + log-probs + trajectory, diffusers = the pipeline's __call__; target ratio <= 1.15")
    print(f"  {'family':<16}{'guidance':>9}{'ours s':>9}{'diff. s':>9}{'ratio':>8}{'min':>7}{'max':>7}")
    for kind, r in results.items():
        print(f"  {kind:<16}{r['guidance']:>9.1f}{r['ours']:>9.3f}{r['diffusers']:>9.3f}{r['ratio']:>8.3f}"
              f"{r['min']:>7.3f}{r['max']:>7.3f}")


def epoch_shares(epochs: int) -> None:
    config = load_config(TINY_CONFIG, [f"train.epochs={epochs}", f"train.checkpoint_every={epochs}"])
    with tempfile.TemporaryDirectory() as out:
        result = train(config, out, log=lambda _m: None)
    rows = result.history[1:] or result.history  # the first epoch pays one-off warm-up
    parts = {k: statistics.fmean(r[f"time/{k}"] for r in rows) for k in ("sampling", "scoring", "training")}
    total = sum(parts.values())
    shares = ", ".join(f"{k} {v / total:.0%}" for k, v in parts.items())
    print(f"epoch (tiny-cpu default, mean of {len(rows)} epochs, {total:.2f}s): {shares}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", action="append", choices=list(FAMILIES),
                        help="model kind to measure (repeatable); default: all three")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--epochs", type=int, default=4, help="epochs of the share measurement")
    args = parser.parse_args()
    families = args.family or list(FAMILIES)
    results = {kind: sampler_ratio(kind, args.repeats, args.batch, args.steps) for kind in families}
    print_ratios(results, args.repeats, args.batch, args.steps)
    epoch_shares(args.epochs)


if __name__ == "__main__":
    main()
