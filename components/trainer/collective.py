"""What the trainer needs from its peers when it runs as one of N data-parallel workers.

One process is the world of size 1 and every operation is the identity, so the single-process trainer
and a one-worker Ray run execute the same code and give the same numbers.
"""

from __future__ import annotations

from typing import Any

import torch


class Collective:
    """The single-process world."""

    rank = 0
    world_size = 1

    @property
    def is_main(self) -> bool:
        """Rank 0 writes outputs, checkpoints and tracking for everyone."""
        return self.rank == 0

    def all_gather(self, obj: Any) -> list[Any]:
        """Every worker's ``obj``, in rank order."""
        return [obj]

    def average_(self, tensors: list[torch.Tensor]) -> None:
        """Replace each tensor by its mean over the workers, in place."""

    def mean(self, values: dict[str, float]) -> dict[str, float]:
        return values


class TorchCollective(Collective):
    """Over an initialised ``torch.distributed`` process group (gloo on CPU, NCCL on GPU; Ray Train sets
    it up). Gradients go as one flat buffer: one all-reduce per optimizer step, whatever the LoRA size."""

    def __init__(self) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("TorchCollective needs an initialised torch.distributed process group")
        self._dist = dist
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        # NCCL reduces only CUDA tensors
        cuda = dist.get_backend() == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

    def all_gather(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        self._dist.all_gather_object(out, obj)
        return out

    def average_(self, tensors: list[torch.Tensor]) -> None:
        if not tensors:
            return
        flat = torch.cat([t.reshape(-1) for t in tensors])
        self._dist.all_reduce(flat)
        flat /= self.world_size
        offset = 0
        for t in tensors:
            t.copy_(flat[offset:offset + t.numel()].view_as(t))
            offset += t.numel()

    def mean(self, values: dict[str, float]) -> dict[str, float]:
        keys = sorted(values)
        buf = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=self.device)
        self._dist.all_reduce(buf)
        return dict(zip(keys, (buf / self.world_size).tolist(), strict=True))
