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


def _guard_setup(seed: int = 0):
    """One SDE step sampled with an old velocity, re-scored with a new one: (old, new) log-probs and means, the
    drawn noise eps, the step's noise std s and |dt|."""
    from components.flowgrpo.sde import sde_step_with_logprob

    g = torch.Generator().manual_seed(seed)
    x, v_old = torch.randn(3, 4, 6, 6, generator=g), torch.randn(3, 4, 6, 6, generator=g)
    v_new = v_old + 0.05 * torch.randn(3, 4, 6, 6, generator=g)
    sigma, sigma_next = 0.7, 0.55
    x_next, lp_old, mean_old, std_dev_t = sde_step_with_logprob(v_old, sigma, sigma_next, x, noise_level=0.7,
                                                                generator=g)
    _, lp_new, mean_new, _ = sde_step_with_logprob(v_new, sigma, sigma_next, x, noise_level=0.7, prev_sample=x_next)
    s = std_dev_t * math.sqrt(sigma - sigma_next)
    eps = (x_next - mean_old) / s
    return lp_old, lp_new, mean_old, mean_new, eps, s, sigma - sigma_next


def test_grpo_guard_log_ratio_is_the_noise_projected_on_the_mean_shift():
    """s (logp - logp_old) + mse / (2 s) = mean_CHW(eps * (mu - mu_old)): centred where the plain log-ratio is
    shifted by -mse / (2 s^2); exactly 0 when the means agree."""
    from components.flowgrpo.loss import GuardTerms, guard_log_ratio

    lp_old, lp_new, mean_old, mean_new, eps, s, dt = _guard_setup()
    guard = GuardTerms(old_mean=mean_old, noise_std=s, dt=dt)
    got = guard_log_ratio(lp_new, lp_old, mean_new, guard)
    expected = (eps * (mean_new - mean_old)).mean(dim=(1, 2, 3))
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-6)
    plain = lp_new - lp_old
    mse = ((mean_new - mean_old) ** 2).mean(dim=(1, 2, 3))
    torch.testing.assert_close(plain, expected / s.flatten() - mse / (2 * s.flatten() ** 2), rtol=1e-3, atol=1e-5)
    assert torch.equal(guard_log_ratio(lp_old, lp_old, mean_old, guard), torch.zeros(3))


def test_grpo_guard_divides_the_policy_loss_by_dt_but_not_the_kl():
    from components.flowgrpo.loss import GuardTerms, guard_log_ratio

    lp_old, lp_new, mean_old, mean_new, _, s, dt = _guard_setup(1)
    adv = torch.tensor([1.0, -0.5, 2.0])
    guard = GuardTerms(old_mean=mean_old, noise_std=s, dt=dt)
    ref = mean_old + 0.01
    loss, metrics = flow_grpo_loss(lp_new, lp_old, adv, clip_range=1e-3, mean=mean_new, ref_mean=ref, std_dev_t=s,
                                   beta=0.5, guard=guard)
    ratio = torch.exp(guard_log_ratio(lp_new, lp_old, mean_new, guard))
    policy = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - 1e-3, 1 + 1e-3)).mean() / dt
    kl = (((mean_new - ref) ** 2).mean(dim=(1, 2, 3)) / (2 * s.flatten() ** 2)).mean()
    assert loss.item() == pytest.approx(policy.item() + 0.5 * kl.item(), rel=1e-5)
    assert metrics["ratio_mean"].item() == pytest.approx(ratio.mean().item(), rel=1e-6)
