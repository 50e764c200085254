"""``flowgrpo``: the command line. Errors the user can fix print one line and exit 2."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from components.errors import FlowGRPOError
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
    print(f"training {args.config} -> {output}", file=sys.stderr, flush=True)
    result = train(config, output, resume=args.resume, parent_run_id=args.mlflow_parent_run_id)
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


def cmd_validate(args: argparse.Namespace) -> int:
    config = load_config(args.config, args.overrides)
    n = config.sampling.prompts_per_epoch * config.sampling.group_size
    print(f"{args.config}: valid ({config.model.kind}, {config.train.epochs} epochs, {n} images per epoch)")
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
    print(f"reward server on http://{args.host}:{args.port} serving {keys}", file=sys.stderr, flush=True)
    uvicorn.run(create_app(settings), host=args.host, port=args.port, log_level=args.log_level)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flowgrpo",
        description="FlowGRPO: online RL fine-tuning of flow-matching text-to-image models with image rewards.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("train", help="train a LoRA in this process",
                       description="Train a LoRA with FlowGRPO in this process; writes config.yaml, metrics.jsonl, "
                                   "samples/, checkpoints/ and the final lora/ under --output (a directory or "
                                   "s3://BUCKET/PREFIX; S3 endpoint and keys come from the AWS_* environment). "
                                   "Logs to MLflow when MLFLOW_TRACKING_URI is set.")
    _add_config_args(p)
    p.add_argument("--output", default=None, metavar="DIR_OR_S3_URI",
                   help="run directory or s3:// prefix (default: runs/<config name>-<timestamp>)")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest complete checkpoint under --output")
    p.add_argument("--mlflow-parent-run-id", default=None, metavar="RUN_ID",
                   help="log as a child of this MLflow run (default: $FLOWGRPO_MLFLOW_PARENT_RUN_ID, else a "
                        "top-level run)")
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
