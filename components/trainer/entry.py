"""The trainer's entry point (``python -m components.trainer``): what a RayJob runs. ``flowgrpo train`` shares its
options and its run; the only difference is where the config comes from (here: the trainer's own sections of an
experiment YAML, a file or ``env:NAME``; there: the whole experiment, with ``key=value`` overrides)."""

from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from components import environ
from components.config_base import read_yaml_mapping
from components.console import quiet_libraries, status_line
from components.errors import ConfigError, exit_status
from components.trainer.config import TrainingJobConfig
from components.trainer.ray_train import WorkersLostError

DESCRIPTION = ("Train a LoRA with FlowGRPO (in this process, or on Ray with --ray-workers); writes config.yaml, "
               "metrics.jsonl, samples/, checkpoints/ and the final lora/ under --output (a directory or "
               "s3://BUCKET/PREFIX; S3 endpoint and keys come from the AWS_* environment). Logs to MLflow when "
               "MLFLOW_TRACKING_URI is set.")


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    """Every option of a training run but the config."""
    p.add_argument("--output", default=None, metavar="DIR_OR_S3_URI",
                   help="run directory or s3:// prefix: new, empty, or an earlier run's (it holds run.json); anything "
                        "else is refused (default: runs/<config name>-<timestamp>)")
    resume = p.add_mutually_exclusive_group()
    resume.add_argument("--resume", action="store_const", const=True, default=False,
                        help="continue from the newest complete checkpoint under --output")
    resume.add_argument("--auto-resume", dest="resume", action="store_const", const="auto",
                        help="continue when --output holds a checkpoint, else start (for jobs that are retried)")
    p.add_argument("--mlflow-parent-run-id", default=None, metavar="RUN_ID",
                   help="log as a child of this MLflow run (default: $FLOWGRPO_MLFLOW_PARENT_RUN_ID, else a "
                        "top-level run)")
    p.add_argument("--ray-workers", type=int, default=0, metavar="N",
                   help="train on N data-parallel Ray Train workers (joins $RAY_ADDRESS, else starts a local "
                        "Ray); 0 (default) trains in this process")


def run(config: TrainingJobConfig, args: argparse.Namespace, *, record: dict[str, Any] | None = None) -> int:
    """Train as ``args`` say and print the outcome; ``record``: the whole experiment, kept with the run."""
    quiet_libraries()
    from components.trainer.metrics import describe_learning
    from components.trainer.training_run import train

    if args.ray_workers < 0:
        raise ConfigError(f"--ray-workers must be 0 or more, got {args.ray_workers}")
    output = args.output or Path("runs") / f"{Path(str(args.config)).stem}-{time.strftime('%Y%m%d-%H%M%S')}"
    status_line(f"training {args.config} -> {output}")
    try:
        result = train(config, output, resume=args.resume, parent_run_id=args.mlflow_parent_run_id,
                       workers=args.ray_workers, record=record)
    except WorkersLostError as exc:
        raise WorkersLostError(f"{exc}; to continue from it once the cause is gone (the nodes back, a bug fixed), "
                               f"run `{resume_command(sys.orig_argv)}` (in a RayJob: submit it again with the same "
                               "run id; its entrypoint resumes)") from None
    print(describe_learning(result.learning_summary()))
    print(f"LoRA: {result.lora_uri}  metrics: {result.metrics_uri}")
    if result.mlflow_run_url:
        print(f"MLflow run: {result.mlflow_run_url}")
    return 0


def resume_command(argv: list[str]) -> str:
    """``argv`` (this process's command line) continuing its run: ``--resume`` in place of any resume option."""
    words = [Path(argv[0]).name if Path(argv[0]).name.startswith("python") else argv[0], *argv[1:]]
    return shlex.join([w for w in words if w not in ("--resume", "--auto-resume")] + ["--resume"])


def _train(args: argparse.Namespace) -> int:
    environ.check_settings()  # before the config is read or anything written
    data = read_yaml_mapping(Path(args.config))
    return run(TrainingJobConfig.from_sections(data, str(args.config)), args, record=data)


def main(argv: list[str] | None = None) -> int:
    environ.apply_settings()
    parser = argparse.ArgumentParser(prog="python -m components.trainer", description=DESCRIPTION)
    parser.add_argument("--config", required=True, metavar="FILE_OR_ENV",
                        help="experiment YAML, or env:NAME to read it from a variable "
                             "(a RayJob: env:FLOWGRPO_EXPERIMENT_CONFIG)")
    add_run_arguments(parser)
    args = parser.parse_args(argv)
    return exit_status("trainer", lambda: _train(args))
