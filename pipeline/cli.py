"""``flowgrpo``: the command line. Errors the user can fix print one line and exit 2."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from components.console import status_line
from components.errors import ConfigError, FlowGRPOError
from pipeline.config import DEFAULT_CONFIG, load_config

EXIT_USER_ERROR = 2


def _quiet_libraries() -> None:
    """Keep library chatter (torchvision fallbacks, dtype notes) out of the progress output."""
    import logging

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
    for name in ("transformers", "diffusers", "peft", "mlflow"):
        logging.getLogger(name).setLevel(logging.ERROR)


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", type=Path, default=DEFAULT_CONFIG,
                   help=f"experiment YAML (default: {DEFAULT_CONFIG.relative_to(DEFAULT_CONFIG.parents[2])})")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value",
                   help="override config values, e.g. train.epochs=5 sampling.group_size=4")


def _default_output(config_path: Path) -> Path:
    return Path("runs") / f"{config_path.stem}-{time.strftime('%Y%m%d-%H%M%S')}"


def cmd_train(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.overrides)
    _quiet_libraries()
    from components.trainer.loop import train

    output = args.output or _default_output(args.config)
    status_line(f"training {args.config} -> {output}")
    if args.ray_workers < 0:
        raise ConfigError(f"--ray-workers must be 0 or more, got {args.ray_workers}")
    result = train(config, output, resume=args.resume, parent_run_id=args.mlflow_parent_run_id,
                   workers=args.ray_workers)
    s = result.learning_summary()
    print(
        f"first epoch reward mean {s['first_mean']:.6g} (per-sample std {s['first_std']:.3g}); "
        f"last 3 epochs mean {s['last3_mean']:.6g}; "
        f"{'LEARNED' if s['learned'] else 'did not learn'}: last-3 mean "
        f"{'>' if s['learned'] else '<='} first mean + std/2 = {s['threshold']:.6g}"
    )
    print(f"LoRA: {result.lora_uri}  metrics: {result.metrics_uri}")
    if result.mlflow_run_url:
        print(f"MLflow run: {result.mlflow_run_url}")
    return 0


def _training_history(lora: str, metrics: str | None) -> list[dict]:
    """The run's metrics.jsonl: --metrics, else the one beside a run's lora/ folder when it is there."""
    import json

    from components import storage

    if metrics is None:
        if not lora.rstrip("/").endswith("/lora"):
            return []
        metrics = storage.join(lora.rstrip("/")[: -len("/lora")], "metrics.jsonl")
        if not storage.exists(metrics):
            return []
    return [json.loads(line) for line in storage.get_bytes(metrics).decode().splitlines() if line.strip()]


def cmd_evaluate(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.overrides)
    name, _, version = (args.registered_model or "").rpartition("/")
    if args.registered_model and not (name and version):
        raise ConfigError(f"--registered-model must be NAME/VERSION, got {args.registered_model!r}")
    _quiet_libraries()
    from components.evaluate.evaluate import evaluate
    from components.tracking.registry import apply_gate
    from components.tracking.tracker import open_tracker

    history = _training_history(args.lora, args.metrics)
    tracker = open_tracker(config.tracking.experiment, "evaluate", parent_run_id=args.mlflow_parent_run_id,
                           system_metrics=False, log=status_line)
    status = "FAILED"
    try:
        result = evaluate(config, config.evaluation_rewards(), config.eval, args.lora, Path(args.output),
                          history=history, log=status_line)
        for key, row in result.summary["rewards"].items():
            tracker.log_metrics({f"eval/{key}/{k}": v for k, v in row.items()}, step=0)
            print(f"{key}: base {row['base_mean']:.4g} -> LoRA {row['lora_mean']:.4g} (delta {row['delta']:+.4g}, "
                  f"{row['ci_level']:.0%} CI [{row['ci_low']:+.4g}, {row['ci_high']:+.4g}], n {row['n']})")
        gate = result.summary["gate"]
        tracker.set_tags({"flowgrpo.gate": "promoted" if gate["promoted"] else "refused",
                          "flowgrpo.gate_reason": gate["reason"]})
        for path in (result.eval_path, result.report_path):
            tracker.log_artifact(path)
        for warning in result.summary["warnings"]:
            print(f"warning: {warning}")
        print(f"gate: {'PROMOTE' if gate['promoted'] else 'REFUSE'}: {gate['reason']}")
        if args.registered_model:
            apply_gate(name, version, gate["promoted"], gate["reason"], gate["alias"], log=status_line)
        print(f"eval: {result.eval_path}  report: {result.report_path}")
        status = "FINISHED"
    finally:
        tracker.close(status)
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.overrides)
    n = config.sampling.prompts_per_epoch * config.sampling.group_size
    print(f"{args.config}: valid ({config.model.kind}, {config.train.epochs} epochs, {n} images per epoch)")
    return 0


def cmd_rayjob(args: argparse.Namespace) -> int:
    from components.trainer.rayjob import build_rayjob, default_run_id, to_yaml

    config = load_config(args.config, args.overrides)
    run_id = args.run_id or default_run_id(config, args.config.stem)
    output = args.output or f"s3://flowgrpo/runs/{run_id}"
    manifest = build_rayjob(config, run_id=run_id, output=output, parent_run_id=args.mlflow_parent_run_id)
    sys.stdout.write(to_yaml(manifest))
    return 0


def cmd_reward_server(args: argparse.Namespace) -> int:
    from components.reward_server.settings import load_settings
    from components.rewards.registry import check_spec

    settings = load_settings(args.config, args.rewards)
    for i, spec in enumerate(settings.rewards):
        check_spec(spec, f"rewards.{i}")
    _quiet_libraries()
    import uvicorn

    from components.reward_server.app import create_app

    keys = ", ".join(s.key for s in settings.rewards)
    status_line(f"reward server on http://{args.host}:{args.port} serving {keys}")
    uvicorn.run(create_app(settings), host=args.host, port=args.port, log_level=args.log_level)
    return 0


def cmd_prepare_dataset(args: argparse.Namespace) -> int:
    from components.dataset.prepare import BUILTIN_PREFIX, prepare_dataset

    source = f"{BUILTIN_PREFIX}{args.builtin}" if args.builtin else args.input
    result = prepare_dataset(source, args.output, kind=args.kind, test_fraction=args.test_fraction, seed=args.seed,
                             max_prompt_tokens=args.max_prompt_tokens,
                             progress=status_line)
    rows = result.manifest["rows"]
    print(f"{source}: kept {rows['kept']} of {rows['input']} rows ({rows['train']} train, {rows['test']} test)")
    print(f"rejected {rows['rejected']}: {result.rejections.summary()}")
    print(f"train: {result.train_uri}\ntest: {result.test_uri}\nmanifest: {result.manifest_uri} "
          f"(content sha256 {result.manifest['content_sha256']})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flowgrpo",
        description="FlowGRPO: online RL fine-tuning of flow-matching text-to-image models with image rewards.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("train", help="train a LoRA in this process",
                       description="Train a LoRA with FlowGRPO (in this process, or on Ray with --ray-workers); "
                                   "writes config.yaml, metrics.jsonl, "
                                   "samples/, checkpoints/ and the final lora/ under --output (a directory or "
                                   "s3://BUCKET/PREFIX; S3 endpoint and keys come from the AWS_* environment). "
                                   "Logs to MLflow when MLFLOW_TRACKING_URI is set.")
    _add_config_args(p)
    p.add_argument("--output", default=None, metavar="DIR_OR_S3_URI",
                   help="run directory or s3:// prefix (default: runs/<config name>-<timestamp>)")
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
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("reward-server", help="serve rewards over HTTP",
                       description="Serve rewards over HTTP for trainers (POST /v1/score) and Flow-Factory clients "
                                   "(POST /compute). Either --rewards with default options or --config with "
                                   "per-reward options, limits and batching.")
    p.add_argument("--rewards", default=None, metavar="NAME[,NAME...]",
                   help="rewards to serve with default options, e.g. jpeg_compressibility,ocr")
    p.add_argument("--config", type=Path, default=None,
                   help="YAML with `rewards:` (name, label, weight, args, timeout_s), `limits:` and `batching:`")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8600, help="port (default 8600)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.set_defaults(func=cmd_reward_server)

    p = sub.add_parser("validate", help="check a config and exit",
                       description="Load and validate a config with its overrides; nothing else runs.")
    _add_config_args(p)
    p.set_defaults(func=cmd_validate)

    p = sub.add_parser("evaluate", help="compare a trained LoRA with its base model",
                       description="Sample the eval prompts (the prepared dataset's test split, else the training "
                                   "prompts) with ODE steps and fixed seeds, with and without the LoRA, score them "
                                   "with eval_rewards, and write eval.json (per reward: base mean, LoRA mean, delta, "
                                   "bootstrap CI, n) and report.html to --output. Applies the promotion gate.")
    _add_config_args(p)
    p.add_argument("--lora", required=True, metavar="DIR_OR_S3_URI", help="the LoRA folder (diffusers format)")
    p.add_argument("--output", required=True, type=Path, metavar="DIR", help="where eval.json and report.html go")
    p.add_argument("--metrics", default=None, metavar="PATH_OR_S3_URI",
                   help="the training run's metrics.jsonl (default: beside --lora when it is a run's lora/)")
    p.add_argument("--registered-model", default=None, metavar="NAME/VERSION",
                   help="model version the gate's verdict is recorded on (alias eval.gate.alias when promoted)")
    p.add_argument("--mlflow-parent-run-id", default=None, metavar="RUN_ID",
                   help="log the evaluation as a child of this MLflow run")
    p.set_defaults(func=cmd_evaluate)

    p = sub.add_parser("rayjob", help="print the KubeRay RayJob of a cluster training run",
                       description="Print the KubeRay RayJob (ray.io/v1) that trains the config on the cluster "
                                   "described by its `cluster:` section, as YAML for `kubectl apply -f -`. Contacts "
                                   "no cluster. The config travels inside the RayJob; credentials come from the "
                                   "Secrets it names.")
    _add_config_args(p)
    p.add_argument("--output", default=None, metavar="S3_URI",
                   help="s3:// prefix the run writes to (default: s3://flowgrpo/runs/<run id>)")
    p.add_argument("--run-id", default=None, metavar="ID",
                   help="names the RayJob (default: <config name>-<config hash>, so the same config gives the "
                        "same RayJob)")
    p.add_argument("--mlflow-parent-run-id", default=None, metavar="RUN_ID",
                   help="log the run as a child of this MLflow run")
    p.set_defaults(func=cmd_rayjob)

    p = sub.add_parser("prepare-dataset", help="validate, split and write a prompt dataset",
                       description="Read prompts from JSONL, CSV or Parquet (a path or s3:// URI; a `prompt` column, "
                                   "other columns become metadata) or a built-in set, reject bad rows (reported "
                                   "with line numbers), split train/test by seed and write train.parquet, "
                                   "test.parquet and manifest.json to --output. Train on it with data.path=OUTPUT.")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--input", metavar="PATH_OR_S3_URI", help="a .jsonl, .csv or .parquet file")
    source.add_argument("--builtin", choices=["ocr", "aesthetic", "compositional"],
                        help="a prompt set shipped with flowgrpo")
    p.add_argument("--output", required=True, metavar="DIR_OR_S3_URI", help="folder or s3:// prefix to write")
    p.add_argument("--kind", choices=["ocr", "generic"], default=None,
                   help="ocr: also reject rows with no quoted text and no ground_truth (default: ocr for "
                        "--builtin ocr, else generic)")
    p.add_argument("--test-fraction", type=float, default=0.1, help="share of rows in the test split (default 0.1)")
    p.add_argument("--seed", type=int, default=0, help="seed of the train/test split (default 0)")
    p.add_argument("--max-prompt-tokens", type=int, default=256,
                   help="reject prompts estimated longer than this many T5 tokens (default 256)")
    p.set_defaults(func=cmd_prepare_dataset)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except FlowGRPOError as exc:
        print(f"flowgrpo {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print(f"flowgrpo {args.command}: interrupted; checkpoints written so far are kept", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
