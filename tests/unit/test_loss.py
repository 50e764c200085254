"""Clipped policy loss and KL (docs/ALGORITHM.md section 6) on hand-made ratios and closed forms."""

import math

import pytest
import torch

from components.flowgrpo.loss import flow_grpo_loss


def test_clipping_and_clipfrac_by_hand():
    ratios = torch.tensor([0.5, 1.0, 1.5, 1.05])
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    log_prob = ratios.log().requires_grad_(True)
    loss, m = flow_grpo_loss(log_prob, torch.zeros(4), adv, clip_range=0.2)
    # per sample max(-A r, -A clip(r)): -0.5, 1.0, -1.2, 1.05
    assert loss.item() == pytest.approx((-0.5 + 1.0 - 1.2 + 1.05) / 4, rel=1e-6)
    assert m["clipfrac"].item() == pytest.approx(0.5)
    assert m["clipfrac_high"].item() == pytest.approx(0.25)
    assert m["clipfrac_low"].item() == pytest.approx(0.25)
    assert m["approx_kl"].item() == pytest.approx(0.5 * float((ratios.log() ** 2).mean()), rel=1e-6)
    loss.backward()
    grad = log_prob.grad
    assert grad[2].item() == 0.0  # clipped branch: no gradient
    assert grad[0].item() == pytest.approx(-1.0 * 0.5 / 4, rel=1e-6)  # d(-A r)/dlogp = -A r
    assert grad[3].item() == pytest.approx(1.0 * 1.05 / 4, rel=1e-5)


def test_ratio_one_gives_minus_mean_advantage():
    adv = torch.tensor([0.3, -1.2, 2.0])
    lp = torch.tensor([-1.0, 2.0, 0.5])
    loss, m = flow_grpo_loss(lp, lp.clone(), adv, clip_range=1e-4)
    assert loss.item() == pytest.approx(-adv.mean().item(), rel=1e-6)
    assert m["clipfrac"].item() == 0.0 and m["approx_kl"].item() == 0.0


def test_kl_matches_gaussian_kl_closed_form():
    g = torch.Generator().manual_seed(0)
    mean = torch.randn(3, 4, 6, 6, generator=g)
    ref = mean + 0.1 * torch.randn(3, 4, 6, 6, generator=g)
    std = torch.tensor([0.2, 0.5, 1.3]).view(3, 1, 1, 1)
    beta = 0.04
    lp = torch.zeros(3)
    loss, m = flow_grpo_loss(lp, lp, torch.zeros(3), clip_range=0.2, mean=mean, ref_mean=ref, std_dev_t=std,
                             beta=beta)
    closed = torch.distributions.kl_divergence(
        torch.distributions.Normal(mean.double(), std.double().expand_as(mean)),
        torch.distributions.Normal(ref.double(), std.double().expand_as(mean)),
    ).flatten(1).mean(1).mean()
    assert m["kl"].item() == pytest.approx(closed.item(), rel=1e-5)
    assert loss.item() == pytest.approx(beta * closed.item(), rel=1e-5)


def test_kl_gradient_pulls_mean_toward_reference():
    mean = torch.ones(2, 1, 2, 2, requires_grad=True)
    ref = torch.zeros(2, 1, 2, 2)
    loss, _ = flow_grpo_loss(torch.zeros(2), torch.zeros(2), torch.zeros(2), clip_range=0.2, mean=mean,
                             ref_mean=ref, std_dev_t=torch.ones(2, 1, 1, 1), beta=1.0)
    loss.backward()
    # d/dm mean_b(mean_chw((m - 0)^2) / 2) = m / (B * CHW)
    assert torch.allclose(mean.grad, torch.full_like(mean, 1 / 8))


def test_beta_without_means_is_an_error():
    with pytest.raises(ValueError, match="beta > 0"):
        flow_grpo_loss(torch.zeros(2), torch.zeros(2), torch.zeros(2), clip_range=0.2, beta=0.1)


def test_metrics_are_detached_and_finite():
    lp = torch.tensor([0.1, -0.1], requires_grad=True)
    _, m = flow_grpo_loss(lp, torch.zeros(2), torch.tensor([1.0, -1.0]), clip_range=0.2)
    assert all(not v.requires_grad and math.isfinite(v.item()) for v in m.values())
