"""What every algorithm's update uses (its loop: components/algorithms/base.py, `Algorithm.update`): the
micro-batches of an inner epoch, the metric means and the optimizer step (docs/ALGORITHM.md section 6)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from components.flow_rl.ema import LoRAEMA


def micro_batches(advantages: torch.Tensor, batch_size: int, skip_zero_advantage: bool,
                  generator: torch.Generator) -> list[torch.Tensor]:
    """One inner epoch's micro-batches: sample indices in a random order, ``ceil(n / batch_size)`` of them.

    With ``skip_zero_advantage`` the samples whose advantage is exactly 0 (zero-std groups, failed rewards) are
    left out and the rest spread evenly over the same number of micro-batches, so every worker takes the same
    forwards and optimizer steps whatever its share of zeros. As upstream, zero-advantage samples chosen at
    random pad the kept ones to a multiple of that number (equal micro-batches, none empty).
    """
    n = advantages.shape[0]
    order = torch.randperm(n, generator=generator)
    if not skip_zero_advantage:
        return list(order.split(batch_size))
    count = -(-n // batch_size)
    nonzero = advantages.cpu()[order] != 0
    kept, zeros = order[nonzero], order[~nonzero]  # each in the random order
    target = min(n, max(count, -(-len(kept) // count) * count))
    return list(torch.cat([kept, zeros[:target - len(kept)]]).tensor_split(count))


def noise_generator(generator: torch.Generator, device: torch.device) -> torch.Generator:
    """A generator on ``device`` for an update's noises, seeded by one draw from the epoch's ``generator``."""
    return torch.Generator(device).manual_seed(int(torch.randint(2**62, (1,), generator=generator)))


class MetricMeans:
    """Running means of an update's metrics, kept as tensors (no device sync per forward) and read once."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor | float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)

    def add(self, key: str, value: torch.Tensor | float) -> None:
        self.sums[key] = self.sums[key] + value
        self.counts[key] += 1

    def result(self) -> dict[str, float]:
        keys = list(self.sums)  # one host read for every metric, not one per key
        totals = torch.stack([torch.as_tensor(self.sums[k]) for k in keys]).double().cpu().tolist() if keys else []
        return {k: total / self.counts[k] for k, total in zip(keys, totals, strict=True)}


@dataclass
class Optimization:
    """What every algorithm's update needs of the trainer: the optimizer over the LoRA ``params``, the optimizer
    steps taken so far, the EMA, and (with data-parallel workers) the gradient average over them."""

    optimizer: torch.optim.Optimizer
    params: list[torch.nn.Parameter]
    max_grad_norm: float
    step: int = 0
    ema: LoRAEMA | None = None
    average_grads: Callable[[list[torch.Tensor]], None] | None = None

    def apply(self, means: MetricMeans) -> None:
        """One optimizer step on the accumulated gradients, averaged over the workers first (when
        ``average_grads``) and clipped to ``max_grad_norm``, then the EMA's; adds the norm before clipping to
        ``means`` as grad_norm."""
        if self.average_grads is not None:
            for p in self.params:  # every worker must reduce the same tensors
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            self.average_grads([p.grad for p in self.params])
        means.add("grad_norm", torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm).detach())
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None:
            self.ema.step(self.params, self.step + 1)
        self.step += 1
