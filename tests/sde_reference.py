"""An independent float64 transcription of Flow-GRPO's SDE transition (flow_grpo ``sde_step_with_logprob``), for the
model-family tests that compare a family's stored step log-probs with their own velocity computation."""

from __future__ import annotations

import math

import torch


def sde_transition(x: torch.Tensor, prev: torch.Tensor, v: torch.Tensor, s: float, s_next: float,
                   noise_level: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, per-sample mean log-prob of ``prev``) of the step from ``x`` at sigma ``s`` to ``s_next``."""
    std_dev_t = noise_level * math.sqrt(s / (1 - (s_next if s == 1 else s)))
    dt = s_next - s
    mean = x * (1 + std_dev_t**2 / (2 * s) * dt) + v * (1 + std_dev_t**2 * (1 - s) / (2 * s)) * dt
    noise_std = std_dev_t * math.sqrt(s - s_next)
    return mean, torch.distributions.Normal(mean, noise_std).log_prob(prev).flatten(1).mean(1)
