"""The exact-rescoring check every model family passes: re-scoring a stored trajectory, in any micro-batch, gives
a ratio of exactly 1, and moved weights change the log-prob (so the check can fail)."""

from __future__ import annotations

import torch

from components.flowgrpo.rollout import Rollout, SamplerSettings, step_log_prob


def assert_rescoring_is_exact(model, params: list[torch.nn.Parameter], rollout: Rollout, settings: SamplerSettings,
                              guidance: float) -> None:
    n = len(rollout)
    shuffled = torch.randperm(n, generator=torch.Generator().manual_seed(1))
    for idx in (torch.arange(n), shuffled, shuffled[: n // 2]):
        for t in range(len(settings.train_steps)):
            log_prob, _, _ = step_log_prob(model, rollout, idx, t, settings, guidance)
            ratio = torch.exp(log_prob - rollout.log_probs[idx, t])
            assert torch.equal(ratio, torch.ones_like(ratio)), (idx.tolist(), t)
    with torch.no_grad():
        for p in params:
            p.add_(0.05)
    log_prob, _, _ = step_log_prob(model, rollout, torch.arange(n), 0, settings, guidance)
    assert not torch.equal(log_prob, rollout.log_probs[:, 0])
