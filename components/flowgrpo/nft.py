"""DiffusionNFT's maths (docs/ALGORITHM.md section 9): rewards as optimality probabilities, the implicit positive
and negative policies on forward-noised clean samples, and the soft update of the old policy. Imports only torch."""

from __future__ import annotations

import torch

WEIGHT_FLOOR = 1e-5  # the adaptive weight's lower bound (NVlabs' clip(min=0.00001))


def optimality_probability(advantages: torch.Tensor, clip: float) -> torch.Tensor:
    """``r = clamp(clamp(A, -C, C) / C / 2 + 0.5, 0, 1)``: a sample's probability of being optimal, 0.5 for the
    group's mean."""
    return (advantages.clamp(-clip, clip) / clip / 2 + 0.5).clamp(0, 1)


def forward_noise(x0: torch.Tensor, noise: torch.Tensor, sigma: float) -> torch.Tensor:
    """``x_t = (1 - t) x0 + t eps``: the flow-matching forward process at noise level ``sigma``."""
    return (1 - sigma) * x0 + sigma * noise


def _weighted_x0_error(x0_pred: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
    """Per sample ``mean((x0_pred - x0)^2) / w`` with the adaptive weight ``w = max(mean|x0_pred - x0|, 1e-5)``
    computed in float64 and detached."""
    dims = tuple(range(1, x0.ndim))
    with torch.no_grad():
        weight = (x0_pred.double() - x0.double()).abs().mean(dim=dims, keepdim=True).clamp(min=WEIGHT_FLOOR)
    return ((x0_pred - x0) ** 2 / weight.to(x0_pred.dtype)).mean(dim=dims)


def nft_loss(
    v_theta: torch.Tensor,
    v_old: torch.Tensor,
    x_t: torch.Tensor,
    x0: torch.Tensor,
    sigma: float,
    r: torch.Tensor,
    *,
    beta: float,
    clip: float,
    v_ref: torch.Tensor | None = None,
    kl_weight: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The DiffusionNFT loss of one micro-batch at one noise level.

    ``v+ = beta v_theta + (1 - beta) v_old`` and ``v- = (1 + beta) v_old - beta v_theta``; each predicts
    ``x0 = x_t - sigma v``; the loss is ``C * mean_i [r_i L+_i + (1 - r_i) L-_i] / beta`` with ``L`` the adaptively
    weighted squared x0 error, plus ``kl_weight * mean (v_theta - v_ref)^2`` when ``v_ref`` is given. Gradients
    flow only through ``v_theta``. Returns the loss and detached metrics."""
    v_old = v_old.detach()
    positive = beta * v_theta + (1 - beta) * v_old
    negative = (1 + beta) * v_old - beta * v_theta
    positive_loss = _weighted_x0_error(x_t - sigma * positive, x0)
    negative_loss = _weighted_x0_error(x_t - sigma * negative, x0)
    policy_loss = (clip * (r * positive_loss + (1 - r) * negative_loss) / beta).mean()
    metrics = {"policy_loss": policy_loss.detach(), "nft/positive_loss": positive_loss.mean().detach(),
               "nft/negative_loss": negative_loss.mean().detach(),
               "nft/old_gap": ((v_theta - v_old) ** 2).mean().detach()}
    loss = policy_loss
    if v_ref is not None:
        kl = ((v_theta - v_ref.detach()) ** 2).mean(dim=tuple(range(1, v_theta.ndim))).mean()
        loss = loss + kl_weight * kl
        metrics["kl"] = kl.detach()
    return loss, metrics


def old_policy_decay(step: int, flat: int, rate: float, max_decay: float) -> float:
    """The old policy's decay after ``step`` optimizer steps: 0 for the first ``flat`` steps, then
    ``min((step - flat) * rate, max_decay)`` (NVlabs' ``return_decay``)."""
    return 0.0 if step < flat else min((step - flat) * rate, max_decay)


@torch.no_grad()
def soft_update(old: list[torch.Tensor], current: list[torch.Tensor], decay: float) -> None:
    """``old <- decay old + (1 - decay) current``, in place."""
    for o, c in zip(old, current, strict=True):
        o.mul_(decay).add_(c.detach().to(o.dtype), alpha=1 - decay)
