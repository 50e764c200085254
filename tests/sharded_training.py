"""What each worker of the sharding tests runs (spawned processes import it by name; see process_group.py).

Per family, on 2 workers: a plain (unsharded) and an FSDP run of 2 epochs; then each is resumed for a third
epoch the other way (FSDP from the plain checkpoint, plain from the FSDP one), and the plain run is continued
as the reference. Rank 0 also records how the FSDP run's transformer is laid out.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch.distributed as dist
from torch.distributed.tensor import DTensor

from components.trainer.collective import TorchCollective
from components.trainer.loop import Trainer, run_worker
from components.trainer.run_output import RunOutput
from pipeline.config import CONFIG_DIR, load_config

# the runs: a family's tiny config and overrides; DiffusionNFT on the SD3 twin (its old policy swapped in and out
# of the sharded transformer's LoRA); FlowGRPO sampling with Dance-SDE and a group's shared initial noise on it
FAMILIES = {"tiny-sd3": (CONFIG_DIR / "tiny-cpu.yaml", []), "tiny-flux": (CONFIG_DIR / "tiny-flux-cpu.yaml", []),
            "tiny-qwenimage": (CONFIG_DIR / "tiny-qwenimage-cpu.yaml", []),
            "tiny-sd3-nft": (CONFIG_DIR / "tiny-cpu.yaml",
                             ["train.algorithm=diffusion_nft", "train.diffusion_nft.decay_rate=0.5"]),
            "tiny-sd3-dance": (CONFIG_DIR / "tiny-cpu.yaml", ["sampling.sde_type=dance", "sampling.noise_level=0.3",
                                                             "sampling.same_initial_noise=true"])}
# 2 workers x 4 images each, micro-batches of 2: 2 optimizer steps per epoch; KL and EMA on, so the reference
# forward (adapter disabled) and the EMA copy run under sharding too
RUN = ["sampling.prompts_per_epoch=2", "sampling.group_size=4", "sampling.batch_size_per_worker=4",
       "train.batch_size_per_worker=2", "sampling.num_steps=4", "train.checkpoint_every=1", "train.beta=0.04",
       "train.ema.enabled=true", "train.ema.update_every=1", "tracking.system_metrics=false", "tracking.sample_every=0"]
LAYOUT_FILE = "layout.json"


def _quiet(_msg: str) -> None:
    pass


def _config(kind: str, epochs: int, sharding: str, *extra: str):
    path, overrides = FAMILIES[kind]
    return load_config(path, [*RUN, *overrides, f"train.epochs={epochs}", f"train.sharding={sharding}", *extra])


def _run(kind: str, out: Path, epochs: int, sharding: str, *extra: str) -> None:
    run_worker(_config(kind, epochs, sharding, *extra), RunOutput(out), log=_quiet, collective=TorchCollective())


def _layout(trainer: Trainer) -> dict:
    """Which transformer parameters are sharded, and how much of each this worker holds."""
    lora = {id(p) for p in trainer.params}
    base = [(n, p) for n, p in trainer.model.transformer.named_parameters() if id(p) not in lora]
    return {
        "base_sharded": all(isinstance(p, DTensor) for _, p in base),
        "base_local_fraction": sum(p.to_local().numel() for _, p in base) / sum(p.numel() for _, p in base),
        "largest_local_fraction": max(p.to_local().numel() / math.ceil(p.numel() / 2) for _, p in base),
        "lora_plain": all(not isinstance(p, DTensor) for p in trainer.params),
    }


def plain_and_sharded_runs(rank: int, root: str, kinds: list[str]) -> None:
    for kind in kinds:
        work = Path(root) / kind
        trainer = Trainer(_config(kind, 2, "fsdp"), RunOutput(work / "fsdp"), log=_quiet,
                          collective=TorchCollective())
        if rank == 0:
            (work / LAYOUT_FILE).write_text(json.dumps(_layout(trainer)))
        trainer.fit()
        _run(kind, work / "plain", 2, "none")
        if rank == 0:
            shutil.copytree(work / "plain", work / "plain-then-fsdp")
            shutil.copytree(work / "fsdp", work / "fsdp-then-plain")
        dist.barrier()
        _run(kind, work / "plain-then-fsdp", 3, "fsdp")
        _run(kind, work / "fsdp-then-plain", 3, "none")
        _run(kind, work / "plain", 3, "none")


COMPILED = ["train.compile=true", "train.gradient_checkpointing=true"]


def compiled_sharded_run(rank: int, root: str, kind: str) -> None:
    """``train.compile`` with FSDP and gradient checkpointing, 2 epochs (compared with the plain eager run of
    ``plain_and_sharded_runs``)."""
    _run(kind, Path(root) / kind / "fsdp-compiled", 2, "fsdp", *COMPILED)
