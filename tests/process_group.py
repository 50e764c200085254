"""Run a function on N local processes joined in one gloo process group: what Ray Train gives its CPU workers,
without the minute Ray takes to start them."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from servers import free_port


def _entry(rank: int, fn: Callable[..., None], world: int, port: int, args: tuple[Any, ...]) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(1)  # N workers share the machine's cores, as Ray gives each worker its share
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        fn(rank, *args)
    finally:
        dist.destroy_process_group()


def run_in_process_group(fn: Callable[..., None], world: int, *args: Any) -> None:
    """``fn(rank, *args)`` on ``world`` spawned processes; raises if any of them raised. ``fn`` must be importable
    (a module-level function) and its arguments picklable."""
    mp.start_processes(_entry, args=(fn, world, free_port(), args), nprocs=world, start_method="spawn")


def train_tiny(rank: int, overrides: list[str], output: str) -> None:
    """One worker of a tiny-model run with ``overrides`` into ``output``: what a Ray Train worker runs."""
    from components.trainer.collective import TorchCollective
    from components.trainer.loop import run_worker
    from components.trainer.run_output import RunOutput
    from pipeline.config import TINY_CONFIG, load_config

    run_worker(load_config(TINY_CONFIG, overrides), RunOutput(output), log=lambda _: None,
               collective=TorchCollective())
