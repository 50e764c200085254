"""What the shipped demo learns: `flowgrpo run --local` (the embedded default, shapes-cpu) once per seed, each in
its own work directory, then one table: wall time, the held-out gain on every eval reward with its 95% CI, the
training reward's trend per epoch with its CI, and the sample grid's held-out reward at epoch 0 and at the end.
These are the figures README and docs/MODELS.md state.

    python tests/benchmarks/bench_demo_learning.py [--seeds 0 1 2] [--workdir DIR] [--config shapes-edit-cpu]
        [key.sub=value ...]

``--config`` measures another demo the same way (the editing demo, shapes-edit-cpu).

A full run takes about 4.5 minutes a seed on 2 cores; `--smoke` (what CI runs, so the script cannot rot) trains
2 epochs and evaluates 10 prompts: its figures mean nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from components.trainer.metrics import learning_summary  # noqa: E402

SMOKE = ["train.epochs=2", "eval.max_prompts=10", "eval.images_per_prompt=1", "tracking.sample_every=1"]


def run_seed(seed: int, workdir: Path, overrides: list[str], config: str | None = None) -> dict:
    """One `run --local` (of ``config``, else the embedded default) in ``workdir``; its eval.json, metrics rows and
    wall seconds."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli", "run", "--local", "--workdir", str(workdir),
                           *(["--config", config] if config else []), f"seed={seed}", *overrides],
                          cwd=REPO, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.exit(f"seed {seed}: run --local failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return read_run(seed, workdir, wall)


def read_run(seed: int, workdir: Path, wall: float = float("nan")) -> dict:
    """A finished `run --local`'s eval.json and metrics rows from its work directory."""
    (eval_json,) = workdir.glob("runs/*/eval/eval.json")
    rows = [json.loads(line) for line in (eval_json.parent.parent / "metrics.jsonl").read_text().splitlines()]
    return {"seed": seed, "wall": wall, "eval": json.loads(eval_json.read_text()), "history": rows}


def _ci(row: dict) -> str:
    return f"{row['delta']:+.3f} [{row['ci_low']:+.3f}, {row['ci_high']:+.3f}]"


def report(results: list[dict]) -> None:
    keys = list(results[0]["eval"]["rewards"])
    print("| seed | wall | " + " | ".join(f"{k}: base -> LoRA, delta [95% CI]" for k in keys)
          + " | training trend /epoch [95% CI] | grid held-out epoch 0 -> last | gate |")
    print("|---" * (len(keys) + 5) + "|")
    for r in results:
        s = learning_summary(r["history"])
        grid = next((f"{s[k]:.3f} -> {s[k[:-5] + '/last']:.3f}" for k in s
                     if k.startswith("heldout/") and k.endswith("/base")), "-")
        cells = [f"{r['eval']['rewards'][k]['base_mean']:.3f} -> {r['eval']['rewards'][k]['lora_mean']:.3f}, "
                 f"{_ci(r['eval']['rewards'][k])}" for k in keys]
        gate = "promote" if r["eval"]["gate"]["promoted"] else "hold"
        print(f"| {r['seed']} | {r['wall'] / 60:.1f} min | " + " | ".join(cells)
              + f" | {s['slope']:+.4f} [{s['slope_low']:+.4f}, {s['slope_high']:+.4f}] | {grid} | {gate} |")
    for k in keys:
        deltas = [r["eval"]["rewards"][k]["delta"] for r in results]
        spread = f" (std {statistics.stdev(deltas):.3f})" if len(deltas) > 1 else ""
        print(f"{k}: mean delta over {len(deltas)} seed(s) {statistics.fmean(deltas):+.3f}{spread}; "
              f"CI lower bound above 0 in {sum(r['eval']['rewards'][k]['ci_low'] > 0 for r in results)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--workdir", type=Path, help="keep each seed's work directory under this folder")
    parser.add_argument("--smoke", action="store_true", help="2 epochs, 10 eval prompts: checks the script runs")
    parser.add_argument("--config", help="the config `run --local` runs (a file, or a shipped config's name); "
                                         "default: the embedded default, the shapes demo")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value")
    args = parser.parse_args()
    overrides = [*SMOKE, *args.overrides] if args.smoke else args.overrides
    root = args.workdir or Path(tempfile.mkdtemp(prefix="bench-demo-"))
    results = []
    for seed in args.seeds:
        print(f"seed {seed}: flowgrpo run --local seed={seed} {' '.join(overrides)}", flush=True)
        results.append(run_seed(seed, root / f"seed-{seed}", overrides, args.config))
        print(f"seed {seed}: {results[-1]['wall'] / 60:.1f} min", flush=True)
    report(results)


if __name__ == "__main__":
    main()
