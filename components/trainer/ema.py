"""Exponential moving average of the LoRA weights, used for saving and evaluation."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class LoRAEMA:
    def __init__(self, params: list[torch.nn.Parameter], decay: float, update_every: int) -> None:
        self.decay = decay
        self.update_every = update_every
        self.shadow = [p.detach().clone() for p in params]

    @torch.no_grad()
    def step(self, params: list[torch.nn.Parameter], optimizer_step: int) -> None:
        """Fold the current weights in every ``update_every`` optimizer steps."""
        if optimizer_step % self.update_every:
            return
        for s, p in zip(self.shadow, params, strict=True):
            s.mul_(self.decay).add_(p.detach(), alpha=1 - self.decay)

    @contextlib.contextmanager
    def applied(self, params: list[torch.nn.Parameter]) -> Iterator[None]:
        """Swap the EMA weights into ``params`` for the duration of the block."""
        backup = [p.detach().clone() for p in params]
        with torch.no_grad():
            for s, p in zip(self.shadow, params, strict=True):
                p.copy_(s)
        try:
            yield
        finally:
            with torch.no_grad():
                for b, p in zip(backup, params, strict=True):
                    p.copy_(b)

    def state_dict(self) -> dict:
        return {"shadow": [s.cpu() for s in self.shadow]}

    def load_state_dict(self, state: dict) -> None:
        for s, loaded in zip(self.shadow, state["shadow"], strict=True):
            s.copy_(loaded)
