"""GRPO advantages from per-sample rewards (docs/ALGORITHM.md sections 4 and 5). Imports only torch."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

# What divides the centred rewards: the batch's std, the group's own, or nothing (Dr.GRPO).
AdvantageStd = Literal["global", "group", "none"]


def _group_index(group_ids: torch.Tensor | Sequence, n: int) -> torch.Tensor:
    ids = torch.as_tensor(group_ids) if not isinstance(group_ids, torch.Tensor) else group_ids
    if ids.shape != (n,):
        raise ValueError(f"group_ids must have shape ({n},), got {tuple(ids.shape)}")
    return torch.unique(ids.cpu(), return_inverse=True)[1]


def _group_sums(values: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(int(index.max()) + 1, dtype=values.dtype)
    return out.index_add_(0, index, values)


def compute_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor | Sequence,
    *,
    std: AdvantageStd = "global",
    eps: float = 1e-4,
    clip: float = 5.0,
) -> torch.Tensor:
    """``A_i = (r_i - mean_group) / (std + eps)``, clipped to ``[-clip, clip]``.

    ``std`` is the population std of all valid rewards ("global") or of the group's
    own ("group"); "none" leaves the centred reward undivided (Dr.GRPO). Non-finite
    rewards are left out of every statistic and get 0; so does every sample of a
    group with fewer than two valid rewards.
    """
    if rewards.ndim != 1:
        raise ValueError(f"rewards must be one scalar per sample (1-D), got shape {tuple(rewards.shape)}")
    n = rewards.shape[0]
    if n == 0:
        return rewards.new_zeros(0)
    index = _group_index(group_ids, n)
    r = rewards.detach().cpu().double()
    valid = torch.isfinite(r)
    r_valid = torch.where(valid, r, torch.zeros_like(r))

    count = _group_sums(valid.double(), index)
    mean_g = _group_sums(r_valid, index) / count.clamp(min=1)
    centred = torch.where(valid, r - mean_g[index], torch.zeros_like(r))

    if std == "none":
        adv = centred
    elif std == "global":
        scale = r[valid].std(unbiased=False) if valid.any() else torch.zeros((), dtype=torch.float64)
        adv = centred / (scale + eps)
    elif std == "group":
        var_g = _group_sums(centred**2, index) / count.clamp(min=1)
        adv = centred / (var_g.sqrt()[index] + eps)
    else:
        raise ValueError(f"std must be one of global, group, none; got {std!r}")
    adv = torch.where(valid & (count[index] >= 2), adv, torch.zeros_like(adv))
    return adv.clamp(-clip, clip).to(dtype=rewards.dtype if rewards.is_floating_point() else torch.float32,
                                     device=rewards.device)


def gdpo_advantages(
    rewards: dict[str, torch.Tensor],
    weights: dict[str, float],
    group_ids: torch.Tensor | Sequence,
    *,
    reward_std: Literal["group", "global"] = "group",
    eps: float = 1e-4,
    clip: float = 5.0,
) -> torch.Tensor:
    """GDPO: ``sum_k w_k A_k`` with each reward normalised per group, then batch-normalised and clipped to
    ``[-clip, clip]`` (as Flow-Factory clamps every advantage in its loss).

    A sample whose reward failed for any k gets 0 and is left out of the batch statistics.
    """
    names = list(rewards)
    per_reward = torch.stack([compute_advantages(rewards[k], group_ids, std=reward_std, eps=eps, clip=clip)
                              for k in names])
    total = sum(weights[k] * per_reward[i] for i, k in enumerate(names))
    valid = torch.stack([torch.isfinite(rewards[k]) for k in names]).all(dim=0)
    # a sample no reward tells apart from its group stays exactly 0 (the batch mean it would be shifted by is 0
    # up to round-off), so train.skip_zero_advantage leaves it out as under `sum`
    informative = valid & (per_reward != 0).any(dim=0)
    if valid.sum() < 2:
        return torch.zeros_like(total)
    sel = total[valid].double()
    normed = ((total.double() - sel.mean()) / sel.std(unbiased=False).clamp(min=1e-6)).clamp(-clip, clip)
    return torch.where(informative, normed, torch.zeros_like(normed)).to(total.dtype)


def group_statistics(rewards: torch.Tensor, group_ids: torch.Tensor | Sequence) -> dict[str, float]:
    """Fraction of failed (non-finite) rewards and of groups whose valid rewards all agree."""
    n = rewards.shape[0]
    index = _group_index(group_ids, n)
    r = rewards.detach().cpu().double()
    valid = torch.isfinite(r)
    n_groups = int(index.max()) + 1 if n else 0
    zero_std = 0
    for g in range(n_groups):
        vals = r[(index == g) & valid]
        if vals.numel() < 2 or bool((vals == vals[0]).all()):
            zero_std += 1
    return {
        "failed_fraction": float((~valid).double().mean()) if n else 0.0,
        "zero_std_group_fraction": zero_std / n_groups if n_groups else 0.0,
    }
