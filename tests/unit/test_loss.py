"""Clipped policy loss and KL (docs/ALGORITHM.md section 6) on hand-made ratios and closed forms."""

import math

import pytest
import torch

from components.algorithms.flow_grpo import flow_grpo_loss

C = 5.0  # train.adv_clip_max's default


def test_clipping_and_clipfrac_by_hand():
    ratios = torch.tensor([0.5, 1.0, 1.5, 1.05])
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0])
    log_prob = ratios.log().requires_grad_(True)
    loss, m = flow_grpo_loss(log_prob, torch.zeros(4), adv, clip_range=0.2, adv_clip_max=C)
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
    loss, m = flow_grpo_loss(lp, lp.clone(), adv, clip_range=1e-4, adv_clip_max=C)
    assert loss.item() == pytest.approx(-adv.mean().item(), rel=1e-6)
    assert m["clipfrac"].item() == 0.0 and m["approx_kl"].item() == 0.0


def test_kl_matches_gaussian_kl_closed_form():
    g = torch.Generator().manual_seed(0)
    mean = torch.randn(3, 4, 6, 6, generator=g)
    ref = mean + 0.1 * torch.randn(3, 4, 6, 6, generator=g)
    std = torch.tensor([0.2, 0.5, 1.3]).view(3, 1, 1, 1)
    beta = 0.04
    lp = torch.zeros(3)
    loss, m = flow_grpo_loss(lp, lp, torch.zeros(3), clip_range=0.2, adv_clip_max=C, mean=mean, ref_mean=ref,
                             std_dev_t=std, beta=beta)
    closed = torch.distributions.kl_divergence(
        torch.distributions.Normal(mean.double(), std.double().expand_as(mean)),
        torch.distributions.Normal(ref.double(), std.double().expand_as(mean)),
    ).flatten(1).mean(1).mean()
    assert m["kl"].item() == pytest.approx(closed.item(), rel=1e-5)
    assert loss.item() == pytest.approx(beta * closed.item(), rel=1e-5)


def test_kl_gradient_pulls_mean_toward_reference():
    mean = torch.ones(2, 1, 2, 2, requires_grad=True)
    ref = torch.zeros(2, 1, 2, 2)
    loss, _ = flow_grpo_loss(torch.zeros(2), torch.zeros(2), torch.zeros(2), clip_range=0.2, adv_clip_max=C, mean=mean,
                             ref_mean=ref, std_dev_t=torch.ones(2, 1, 1, 1), beta=1.0)
    loss.backward()
    # d/dm mean_b(mean_chw((m - 0)^2) / 2) = m / (B * CHW)
    assert torch.allclose(mean.grad, torch.full_like(mean, 1 / 8))


def test_beta_without_means_is_an_error():
    with pytest.raises(ValueError, match="beta > 0"):
        flow_grpo_loss(torch.zeros(2), torch.zeros(2), torch.zeros(2), clip_range=0.2, adv_clip_max=C, beta=0.1)


def test_metrics_are_detached_and_finite():
    lp = torch.tensor([0.1, -0.1], requires_grad=True)
    _, m = flow_grpo_loss(lp, torch.zeros(2), torch.tensor([1.0, -1.0]), clip_range=0.2, adv_clip_max=C)
    assert all(not v.requires_grad and math.isfinite(v.item()) for v in m.values())


def _guard_setup(seed: int = 0):
    """One SDE step sampled with an old velocity, re-scored with a new one: (old, new) log-probs and means, the
    drawn noise eps, the step's noise std s and |dt|."""
    from components.flow_rl.sde import sde_step_with_logprob

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
    from components.algorithms.flow_grpo import GuardTerms, guard_log_ratio

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
    from components.algorithms.flow_grpo import GuardTerms, guard_log_ratio

    lp_old, lp_new, mean_old, mean_new, _, s, dt = _guard_setup(1)
    adv = torch.tensor([1.0, -0.5, 2.0])
    guard = GuardTerms(old_mean=mean_old, noise_std=s, dt=dt)
    ref = mean_old + 0.01
    loss, metrics = flow_grpo_loss(lp_new, lp_old, adv, clip_range=1e-3, adv_clip_max=C, mean=mean_new, ref_mean=ref,
                                   std_dev_t=s, beta=0.5, guard=guard)
    ratio = torch.exp(guard_log_ratio(lp_new, lp_old, mean_new, guard))
    policy = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - 1e-3, 1 + 1e-3)).mean() / dt
    kl = (((mean_new - ref) ** 2).mean(dim=(1, 2, 3)) / (2 * s.flatten() ** 2)).mean()
    assert loss.item() == pytest.approx(policy.item() + 0.5 * kl.item(), rel=1e-5)
    assert metrics["ratio_mean"].item() == pytest.approx(ratio.mean().item(), rel=1e-6)


def test_the_loss_clips_the_advantages_itself():
    """An advantage beyond train.adv_clip_max gives the loss and gradient of the clipped one (the caller need not
    have clipped), with and without GRPO-Guard; advantages within the bound pass unchanged to the bit."""
    from components.algorithms.flow_grpo import GuardTerms

    lp_old, lp_new, mean_old, mean_new, _, s, dt = _guard_setup(2)
    raw = torch.tensor([9.0, -0.5, -7.5])
    for guard in (None, GuardTerms(old_mean=mean_old, noise_std=s, dt=dt)):
        results = []
        for adv, bound in ((raw, C), (raw.clamp(-C, C), C), (raw.clamp(-C, C), 100.0), (raw, 100.0)):
            lp = lp_new.clone().requires_grad_(True)
            loss, _ = flow_grpo_loss(lp, lp_old, adv, clip_range=1e-3, adv_clip_max=bound, mean=mean_new, guard=guard)
            loss.backward()
            results.append((loss.detach(), lp.grad))
        (unclipped, g_unclipped), (clipped, g_clipped), (within, g_within), (beyond, _) = results
        assert torch.equal(unclipped, clipped) and torch.equal(g_unclipped, g_clipped)
        assert torch.equal(clipped, within) and torch.equal(g_clipped, g_within)
        assert abs(beyond.item() - clipped.item()) > 0.1 * abs(clipped.item())  # the bound does bind here


def test_adv_clip_max_and_mean_shift_are_checked():
    from components.algorithms.flow_grpo import GuardTerms

    with pytest.raises(ValueError, match="adv_clip_max"):
        flow_grpo_loss(torch.zeros(2), torch.zeros(2), torch.zeros(2), clip_range=0.2, adv_clip_max=0.0)
    with pytest.raises(ValueError, match=r"train\.flow_grpo\.guard_mean_shift"):
        GuardTerms(old_mean=torch.zeros(2, 1), noise_std=torch.ones(2, 1), dt=0.1, mean_shift="group")


def _guard_batch(seed: int):
    """One SDE step of 4 samples at one noise level, sampled with an old velocity and re-scored with a new one
    (a leaf, for gradients) whose shift differs in size per sample, so the micro-batch's mean shift is none of
    the samples' own."""
    from components.flow_rl.sde import sde_step_with_logprob

    g = torch.Generator().manual_seed(seed)
    x, v_old = torch.randn(4, 4, 6, 6, generator=g), torch.randn(4, 4, 6, 6, generator=g)
    shift = torch.tensor([0.02, 0.05, 0.1, 0.2]).view(4, 1, 1, 1) * torch.randn(4, 4, 6, 6, generator=g)
    sigma, sigma_next = 0.7, 0.55
    x_next, lp_old, mean_old, std_dev_t = sde_step_with_logprob(v_old, sigma, sigma_next, x, noise_level=0.7,
                                                                generator=g)
    v_new = (v_old + shift).requires_grad_(True)
    _, lp_new, mean_new, _ = sde_step_with_logprob(v_new, sigma, sigma_next, x, noise_level=0.7, prev_sample=x_next)
    ref_mean = mean_old + 0.1 * torch.randn(4, 4, 6, 6, generator=g)
    return v_new, lp_new, lp_old, mean_new, mean_old, ref_mean, std_dev_t, sigma - sigma_next


GUARD_ADV = torch.tensor([7.0, -0.4, 1.5, -6.0])  # two beyond C: the authors' and Flow-Factory's loss clip them
GUARD_CLIP = 1e-3


def _ours(mean_shift: str, seed: int, beta: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """flow_grpo_loss with GRPO-Guard as FlowGRPO.loss calls it: the loss, its gradient in the new velocity and
    the mean ratio."""
    from components.algorithms.flow_grpo import GuardTerms

    v, lp, lp_old, mean, mean_old, ref, std_dev_t, dt = _guard_batch(seed)
    guard = GuardTerms(old_mean=mean_old, noise_std=std_dev_t * dt**0.5, dt=dt, mean_shift=mean_shift)
    loss, metrics = flow_grpo_loss(lp, lp_old, GUARD_ADV, clip_range=GUARD_CLIP, adv_clip_max=C, mean=mean,
                                   ref_mean=ref, std_dev_t=std_dev_t, beta=beta, guard=guard)
    (grad,) = torch.autograd.grad(loss, v)
    return loss.detach().double(), grad.double(), metrics["ratio_mean"].double()


def _authors_guard_loss(seed: int, beta: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The authors' GRPO-Guard step, scripts/train_sd3_GRPO_Guard.py at 2e2f712e lines 910-937 (config.rationorm),
    transcribed in float64: loss, its gradient in the new velocity, mean ratio."""
    v, lp, lp_old, mean, mean_old, ref, std_dev_t, dt = _guard_batch(seed)
    log_prob, old_log_prob = lp.double(), lp_old.double()
    prev_sample_mean, old_prev_sample_mean, prev_sample_mean_ref = mean.double(), mean_old.double(), ref.double()
    std_dev_t = std_dev_t.double()
    sqrt_dt = torch.full_like(std_dev_t, dt).sqrt()  # sde_step_with_logprob's torch.sqrt(-1*dt), (B, 1, 1, 1)
    advantages = torch.clamp(GUARD_ADV.double(), -C, C)
    sigma_t = std_dev_t.mean()
    ratio_mean_bias = (prev_sample_mean - old_prev_sample_mean).pow(2).mean(dim=tuple(range(1, log_prob.ndim)))
    assert ratio_mean_bias.ndim == 0  # log_prob is (B,): dim=() reduces every dim, the micro-batch's mean
    ratio_mean_bias = ratio_mean_bias / (2 * (sqrt_dt.mean() * sigma_t) ** 2)
    ratio = torch.exp((log_prob - old_log_prob + ratio_mean_bias) * (sqrt_dt.mean() * sigma_t))
    unclipped_loss = -advantages * ratio
    clipped_loss = -advantages * torch.clamp(ratio, 1.0 - GUARD_CLIP, 1.0 + GUARD_CLIP)
    policy_loss = torch.mean(torch.maximum(unclipped_loss, clipped_loss))
    policy_loss = policy_loss / (sqrt_dt.mean() ** 2)
    kl_loss = ((prev_sample_mean - prev_sample_mean_ref) ** 2).mean(dim=(1, 2, 3), keepdim=True) / (2 * std_dev_t**2)
    loss = policy_loss + beta * torch.mean(kl_loss)
    (grad,) = torch.autograd.grad(loss, v)
    return loss.detach(), grad.double(), ratio.detach().mean()


def _flow_factory_guard_loss(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Flow-Factory's GRPOGuardTrainer.optimize, src/flow_factory/trainers/grpo.py at a0b2bc5a (no KL),
    transcribed in float64: loss, its gradient in the new velocity, mean ratio."""
    v, lp, lp_old, mean, mean_old, _, std_dev_t, dt = _guard_batch(seed)
    adv = torch.clamp(GUARD_ADV.double(), -C, C)  # adv_clip_range (-5, 5)
    output_dt = torch.full((4,), -dt, dtype=torch.float64)  # t_next - t
    scale_factor = torch.sqrt(-output_dt) * std_dev_t.double().flatten()
    mse = (mean.double() - mean_old.double()).flatten(1).pow(2).mean(dim=1)
    ratio = torch.exp((lp.double() - lp_old.double()) * scale_factor + mse / (2 * scale_factor))
    unclipped_loss = -adv * ratio
    clipped_loss = -adv * torch.clamp(ratio, 1.0 - GUARD_CLIP, 1.0 + GUARD_CLIP)
    loss = torch.mean(torch.maximum(unclipped_loss, clipped_loss))
    (grad,) = torch.autograd.grad(loss, v)
    return loss.detach(), grad.double(), ratio.detach().mean()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_guard_mean_shift_batch_is_the_authors_code(seed):
    """train.flow_grpo.guard_mean_shift: batch gives the authors' loss, gradient and ratio, KL included; sample
    does not."""
    for beta in (0.0, 2.0):
        loss, grad, ratio = _ours("batch", seed, beta)
        a_loss, a_grad, a_ratio = _authors_guard_loss(seed, beta)
        assert loss.item() == pytest.approx(a_loss.item(), rel=1e-5)
        torch.testing.assert_close(grad, a_grad, rtol=1e-4, atol=1e-4 * a_grad.abs().max().item())
        assert ratio.item() == pytest.approx(a_ratio.item(), rel=1e-6)
        _, other_grad, _ = _ours("sample", seed, beta)
        assert (grad - other_grad).abs().max() > 0.01 * a_grad.abs().max()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_guard_mean_shift_sample_is_flow_factorys_ratio_over_dt(seed):
    """train.flow_grpo.guard_mean_shift: sample gives Flow-Factory's ratio and its loss and gradient divided by
    |dt| (the authors' reweighting, which Flow-Factory leaves out); batch does not."""
    dt = _guard_batch(seed)[-1]
    loss, grad, ratio = _ours("sample", seed, 0.0)
    f_loss, f_grad, f_ratio = _flow_factory_guard_loss(seed)
    assert loss.item() == pytest.approx(f_loss.item() / dt, rel=1e-5)
    torch.testing.assert_close(grad, f_grad / dt, rtol=1e-4, atol=1e-4 * f_grad.abs().max().item() / dt)
    assert ratio.item() == pytest.approx(f_ratio.item(), rel=1e-6)
    _, other_grad, _ = _ours("batch", seed, 0.0)
    assert (grad - other_grad).abs().max() > 0.01 * grad.abs().max()
