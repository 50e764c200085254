"""Tracking + checkpoint overhead: epoch time of the tiny default config with MLflow and S3 on vs off.

"On" = --output on a real SeaweedFS and MLflow tracking to a real `mlflow server` (sqlite, artifacts in
that S3): per-epoch metrics, sample grids and S3 checkpoints at the default intervals, system metrics on.
"Off" = a local output directory and no tracking. Epoch time is measured between the progress lines of
epoch 1 and the last epoch, so the one-time start (imports, run creation) and the final model
registration are not in it, and the checkpoints and sample grids inside that span are. Target <= 1.05.

    python tests/benchmarks/bench_tracking.py [--repeats N] [--epochs N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import uuid
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")

from components.environ import patched_environ
from components.trainer.training_run import train
from pipeline.config import TINY_CONFIG, load_config
from pipeline.services.mlflow_server import running_mlflow
from pipeline.services.seaweed import running_seaweed

TARGET = 1.05


def _epoch_seconds(output: str, epochs: int, tracking_env: dict[str, str]) -> float:
    """Seconds per epoch between the progress lines of epoch 1 and epoch ``epochs``."""
    stamps: dict[int, float] = {}

    def log(message: str) -> None:
        if message.startswith("epoch "):
            stamps[int(message.split()[1].split("/")[0])] = time.perf_counter()

    with patched_environ(tracking_env):
        config = load_config(TINY_CONFIG, [f"train.epochs={epochs}", "tracking.registered_model=null",
                                    f"tracking.experiment=bench-{uuid.uuid4().hex[:6]}"])
        train(config, output, log=log)
    return (stamps[epochs] - stamps[1]) / (epochs - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=11, help="11 spans the default checkpoint and sample "
                                                                 "interval (10) once")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        os.environ["FLOWGRPO_CACHE_DIR"] = str(root / "cache")
        with running_seaweed(root / "s3") as s3, running_mlflow(root / "mlflow", s3=s3) as mlflow:
            os.environ.update(s3.env())  # S3 credentials are needed for the "on" output only, harmless off
            on_env = {**mlflow.env()}
            off, on = [], []
            for i in range(args.repeats):  # alternate so drift on a shared machine hits both sides
                off.append(_epoch_seconds(str(root / f"off-{i}"), args.epochs, {"MLFLOW_TRACKING_URI": ""}))
                on.append(_epoch_seconds(f"s3://{s3.bucket}/bench/on-{i}", args.epochs, on_env))
                print(f"repeat {i + 1}: off {off[-1]:.3f} s/epoch, on {on[-1]:.3f} s/epoch, "
                      f"ratio {on[-1] / off[-1]:.3f}", flush=True)
    ratio = statistics.median(on) / statistics.median(off)
    verdict = "meets" if ratio <= TARGET else "misses"
    print(f"tracking + S3 checkpoint overhead (tiny default config, {args.epochs} epochs, median of "
          f"{args.repeats}): on/off epoch time = {ratio:.3f} ({verdict} the target <= {TARGET})")


if __name__ == "__main__":
    main()
