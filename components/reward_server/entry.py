"""The reward server's entry point (``python -m components.reward_server``; ``flowgrpo reward-server`` is the same):
what a local run's process and a cluster's Deployment start."""

from __future__ import annotations

import argparse
from pathlib import Path

from components import environ
from components.console import quiet_libraries, status_line
from components.errors import exit_status

DESCRIPTION = ("Serve rewards over HTTP for trainers (POST /v1/score) and Flow-Factory clients (POST /compute). Either "
               "--rewards with default options or --config with per-reward options, limits and batching.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rewards", default=None, metavar="NAME[,NAME...]",
                   help="rewards to serve with default options, e.g. jpeg_compressibility,ocr")
    p.add_argument("--config", type=Path, default=None,
                   help="YAML with `rewards:` (name, label, weight, args, timeout_s), `limits:` and `batching:`")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8600, help="port (default 8600)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def serve(args: argparse.Namespace) -> int:
    """Check every reward's options, then serve until stopped."""
    from components.reward_server.settings import load_settings
    from components.rewards.registry import check_spec

    settings = load_settings(args.config, args.rewards)
    for i, spec in enumerate(settings.rewards):
        check_spec(spec, f"rewards.{i}")
    quiet_libraries()
    import uvicorn

    from components.reward_server.app import create_app
    from components.reward_server.protocol import h11_protocol

    keys = ", ".join(s.key for s in settings.rewards)
    status_line(f"reward server on http://{args.host}:{args.port} serving {keys}")
    uvicorn.run(create_app(settings), host=args.host, port=args.port, log_level=args.log_level,
                http=h11_protocol(settings.limits))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m components.reward_server", description=DESCRIPTION)
    add_arguments(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    environ.apply_settings()
    args = build_parser().parse_args(argv)

    def run() -> int:
        environ.check_settings()  # before the settings are read or a port bound (`flowgrpo reward-server`: the CLI's)
        return serve(args)

    return exit_status("reward-server", run)
