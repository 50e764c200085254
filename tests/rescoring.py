"""The exact-rescoring check every model family passes: re-scoring a stored trajectory, in any micro-batch, gives
a ratio of 1 to within two float32 steps, and moved weights change the log-prob (so the check can fail)."""

from __future__ import annotations

import torch

from components.flow_rl.rollout import Rollout, SamplerSettings, step_log_prob

# Two float32 steps of 1.0 (1.19e-7 up, 5.96e-8 down). A matrix product's rounding can depend on the batch size on
# some CPUs: an AVX-512/AMX Xeon re-scores a row in a micro-batch of 4 one step away from the same row sampled
# among 8 (measured: ratios off by 5.96e-8 and 1.19e-7 in 5 of 93 checks), where other CPUs give it bit for bit.
RATIO_TOLERANCE = 2.5e-7


def assert_ratio_is_one(ratio: torch.Tensor, where: object) -> None:
    """The ratio is 1 up to the rounding of a batch-size-dependent matrix kernel."""
    worst = (ratio - 1).abs().max().item()
    assert worst <= RATIO_TOLERANCE, (where, worst)


def assert_rescoring_is_exact(model, params: list[torch.nn.Parameter], rollout: Rollout, settings: SamplerSettings,
                              guidance: float) -> None:
    n = len(rollout)
    shuffled = torch.randperm(n, generator=torch.Generator().manual_seed(1))
    for idx in (torch.arange(n), shuffled, shuffled[: n // 2]):
        for t in range(len(settings.train_steps)):
            log_prob, _, _ = step_log_prob(model, rollout, idx, t, settings, guidance)
            ratio = torch.exp(log_prob - rollout.log_probs[idx, t])
            assert_ratio_is_one(ratio, (idx.tolist(), t))
    with torch.no_grad():
        for p in params:
            p.add_(0.05)
    log_prob, _, _ = step_log_prob(model, rollout, torch.arange(n), 0, settings, guidance)
    assert not torch.equal(log_prob, rollout.log_probs[:, 0])
