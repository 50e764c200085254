"""Ray overhead on the tiny default config, measured side by side in one run.

1. 1 Ray Train worker vs the plain single-process trainer: steady-state epoch time (median of epochs 2..N
   of sampling + scoring + training, as each reports it), target <= 1.1. Worker start-up (wall time of the
   run minus its epochs) is reported separately.
2. 2 workers vs 1 on this machine, same samples per optimizer step (2 workers x 8 per micro-batch = the single
   worker's 16): on 2 cores each worker gets 1 core, so expect little or no gain here; the number is printed as
   measured.

    python tests/benchmarks/bench_ray.py [--epochs N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
os.environ["MLFLOW_TRACKING_URI"] = ""  # tracking is measured by bench_tracking.py

from components.trainer.training_run import train
from pipeline.config import TINY_CONFIG, load_config

TARGET = 1.1
EPOCH_KEYS = ("time/sampling", "time/scoring", "time/training")


def _run(output: Path, epochs: int, workers: int, *overrides: str) -> tuple[float, float]:
    """(median steady-state epoch seconds, seconds outside the epochs)."""
    config = load_config(TINY_CONFIG, [f"train.epochs={epochs}", "tracking.registered_model=null", *overrides])
    start = time.perf_counter()
    result = train(config, output, log=lambda _m: None, workers=workers)
    wall = time.perf_counter() - start
    per_epoch = [sum(row[k] for k in EPOCH_KEYS) for row in result.history]
    if workers:
        import ray

        ray.shutdown()
    return statistics.median(per_epoch[1:]), wall - sum(per_epoch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=8)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        os.environ["FLOWGRPO_CACHE_DIR"] = str(root / "cache")
        single, single_rest = _run(root / "single", args.epochs, 0)
        one, one_rest = _run(root / "one", args.epochs, 1)
        two, two_rest = _run(root / "two", args.epochs, 2, "train.batch_size_per_worker=8")
    print(f"steady-state epoch: single process {single:.3f} s, 1 Ray worker {one:.3f} s, 2 Ray workers {two:.3f} s")
    print(f"outside the epochs (start-up, checkpoints, final LoRA): single {single_rest:.1f} s, "
          f"1 worker {one_rest:.1f} s, 2 workers {two_rest:.1f} s")
    ratio = one / single
    print(f"Ray overhead: 1 worker / single process = {ratio:.3f} "
          f"({'meets' if ratio <= TARGET else 'misses'} the target <= {TARGET})")
    print(f"2 workers / 1 worker epoch time = {two / one:.3f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    sys.exit(main())
