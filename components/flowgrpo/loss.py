"""Clipped FlowGRPO policy loss with optional KL to the reference model (docs/ALGORITHM.md section 6).

Imports only torch.
"""

from __future__ import annotations

import torch


def _per_sample_mean(x: torch.Tensor) -> torch.Tensor:
    return x.mean(dim=tuple(range(1, x.ndim))) if x.ndim > 1 else x


def flow_grpo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_range: float,
    mean: torch.Tensor | None = None,
    ref_mean: torch.Tensor | None = None,
    std_dev_t: torch.Tensor | None = None,
    beta: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-style clipped loss on per-sample log-probs of one timestep.

    ``kl = mean_CHW((mean - ref_mean)**2) / (2 * std_dev_t**2)``, averaged over the
    batch, is added with weight ``beta`` when ``beta > 0``. Metrics are detached.
    """
    adv = advantages.to(log_prob.dtype)
    log_ratio = log_prob - old_log_prob.detach()
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    policy_loss = torch.maximum(unclipped, clipped).mean()

    if beta > 0:
        if mean is None or ref_mean is None or std_dev_t is None:
            raise ValueError("beta > 0 needs mean, ref_mean and std_dev_t")
        std = _per_sample_mean(std_dev_t.float())
        kl = (_per_sample_mean((mean.float() - ref_mean.float()) ** 2) / (2 * std**2)).mean()
    else:
        kl = torch.zeros((), dtype=policy_loss.dtype, device=policy_loss.device)
    loss = policy_loss + beta * kl

    with torch.no_grad():
        metrics = {
            "policy_loss": policy_loss.detach(),
            "kl": kl.detach(),
            "approx_kl": 0.5 * (log_ratio.detach() ** 2).mean(),
            "clipfrac": ((ratio - 1.0).abs() > clip_range).float().mean(),
            "clipfrac_high": (ratio > 1.0 + clip_range).float().mean(),
            "clipfrac_low": (ratio < 1.0 - clip_range).float().mean(),
            "ratio_mean": ratio.detach().mean(),
        }
    return loss, metrics
