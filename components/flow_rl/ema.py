"""Exponential moving average of the LoRA weights, used for saving and evaluation; swapping weights in and out."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


class LoRAEMA:
    """Upstream's schedule (flow_grpo ``flow_grpo/ema.py``): at optimizer step ``s`` (steps taken so far), fold
    the weights in when ``(s + 1) % update_every == 0``, with the decay warmed up as
    ``min(decay, (1 + s) / (10 + s))`` so the random initial LoRA is forgotten within the first updates."""

    def __init__(self, params: list[torch.nn.Parameter], decay: float, update_every: int) -> None:
        self.decay = decay
        self.update_every = update_every
        self.shadow = [p.detach().clone() for p in params]

    def decay_at(self, optimizer_step: int) -> float:
        return min(self.decay, (1 + optimizer_step) / (10 + optimizer_step))

    @torch.no_grad()
    def step(self, params: list[torch.nn.Parameter], optimizer_step: int) -> None:
        if (optimizer_step + 1) % self.update_every:
            return
        decay = self.decay_at(optimizer_step)
        for s, p in zip(self.shadow, params, strict=True):
            s.mul_(decay).add_(p.detach(), alpha=1 - decay)

    def applied(self, params: list[torch.nn.Parameter]) -> contextlib.AbstractContextManager[None]:
        """Swap the EMA weights into ``params`` for the duration of the block."""
        return weights_applied(params, self.shadow)

    def state_dict(self) -> dict:
        return {"shadow": [s.cpu() for s in self.shadow]}

    def load_state_dict(self, state: dict) -> None:
        for s, loaded in zip(self.shadow, state["shadow"], strict=True):
            s.copy_(loaded)


@contextlib.contextmanager
def weights_applied(params: list[torch.nn.Parameter], weights: list[torch.Tensor]) -> Iterator[None]:
    """``weights`` copied into ``params`` for the duration of the block, the params' own values restored after."""
    backup = [p.detach().clone() for p in params]
    with torch.no_grad():
        for w, p in zip(weights, params, strict=True):
            p.copy_(w)
    try:
        yield
    finally:
        with torch.no_grad():
            for b, p in zip(backup, params, strict=True):
                p.copy_(b)
