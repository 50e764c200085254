"""The SDE step against an independent float64 computation of the spec's formulas (docs/ALGORITHM.md 1-2), and the
forward noising."""

import math

import numpy as np
import pytest
import torch

from components.flow_rl.sde import forward_noise, sde_step_with_logprob


def _inputs(seed: int, shape=(3, 4, 5, 5)):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def _expected_sde(x, v, sigma, sigma_next, a):
    """Mean and noise std of the SDE transition, in float64 numpy, written from the spec."""
    x, v = x.double().numpy(), v.double().numpy()
    dt = sigma_next - sigma
    s = sigma_next if sigma == 1 else sigma
    std_dev_t = a * math.sqrt(sigma / (1 - s))
    mean = x * (1 + std_dev_t**2 / (2 * sigma) * dt) + v * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
    return mean, std_dev_t, std_dev_t * math.sqrt(-dt)


def _gaussian_logpdf_mean(y, mean, std):
    dist = torch.distributions.Normal(torch.from_numpy(mean), torch.tensor(std, dtype=torch.float64))
    return dist.log_prob(y.double()).flatten(1).mean(1)


@pytest.mark.parametrize(("sigma", "sigma_next"), [(1.0, 0.9), (0.7, 0.55), (0.2, 0.0)])
def test_sde_log_prob_is_gaussian_density_of_prev_sample(sigma, sigma_next):
    x, v = _inputs(0)
    prev, log_prob, mean, std_dev_t = sde_step_with_logprob(
        v, sigma, sigma_next, x, noise_level=0.7, generator=torch.Generator().manual_seed(1)
    )
    exp_mean, exp_std_dev_t, noise_std = _expected_sde(x, v, sigma, sigma_next, 0.7)
    np.testing.assert_allclose(mean.double().numpy(), exp_mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(std_dev_t.flatten().numpy(), exp_std_dev_t, rtol=1e-6)
    expected = _gaussian_logpdf_mean(prev, exp_mean, noise_std)
    assert log_prob.shape == (3,)
    np.testing.assert_allclose(log_prob.double().numpy(), expected.numpy(), rtol=1e-5, atol=1e-5)


def test_first_step_at_sigma_one_is_finite_and_uses_sigma_next():
    x, v = _inputs(1)
    _, log_prob, _, std_dev_t = sde_step_with_logprob(v, 1.0, 0.8, x, noise_level=0.5)
    assert torch.isfinite(log_prob).all()
    assert std_dev_t.flatten()[0].item() == pytest.approx(0.5 * math.sqrt(1 / (1 - 0.8)), rel=1e-6)


def test_noise_has_the_stated_std():
    x, v = _inputs(2, shape=(4, 16, 32, 32))
    prev, _, mean, std_dev_t = sde_step_with_logprob(v, 0.6, 0.5, x, noise_level=0.7,
                                                     generator=torch.Generator().manual_seed(3))
    z = (prev - mean) / (std_dev_t * math.sqrt(0.1))
    assert z.mean().abs() < 0.02  # 5 standard errors for 65536 draws
    assert z.std().item() == pytest.approx(1.0, abs=0.01)


def test_given_prev_sample_draws_no_noise_and_scores_it():
    x, v = _inputs(3)
    target = torch.randn_like(x)
    gen = torch.Generator().manual_seed(0)
    state = gen.get_state()
    prev, log_prob, _, _ = sde_step_with_logprob(v, 0.5, 0.4, x, noise_level=0.7, prev_sample=target, generator=gen)
    assert torch.equal(prev, target)
    assert torch.equal(gen.get_state(), state)
    exp_mean, _, noise_std = _expected_sde(x, v, 0.5, 0.4, 0.7)
    np.testing.assert_allclose(log_prob.double().numpy(), _gaussian_logpdf_mean(target, exp_mean, noise_std).numpy(),
                               rtol=1e-5, atol=1e-5)


def test_per_sample_sigmas_match_scalar_calls():
    x, v = _inputs(4)
    target = torch.randn_like(x)
    sig = torch.tensor([1.0, 0.6, 0.3])
    sig_next = torch.tensor([0.9, 0.5, 0.0])
    _, lp, mean, _ = sde_step_with_logprob(v, sig, sig_next, x, noise_level=0.7, prev_sample=target)
    for i in range(3):
        _, lp_i, mean_i, _ = sde_step_with_logprob(v[i:i + 1], float(sig[i]), float(sig_next[i]), x[i:i + 1],
                                                   noise_level=0.7, prev_sample=target[i:i + 1])
        assert torch.allclose(lp[i], lp_i[0], rtol=1e-6)
        assert torch.allclose(mean[i], mean_i[0], rtol=1e-6)


def test_gradient_flows_through_mean_only():
    x, v = _inputs(5)
    v.requires_grad_(True)
    prev, log_prob, mean, _ = sde_step_with_logprob(v, 0.5, 0.4, x, noise_level=0.7)
    assert not prev.requires_grad
    assert mean.requires_grad
    log_prob.sum().backward()
    assert v.grad is not None and torch.isfinite(v.grad).all()


@pytest.mark.parametrize(("sigma", "sigma_next"), [(1.0, 0.9), (0.5, 0.3), (0.2, 0.0)])
def test_cps_matches_spec(sigma, sigma_next):
    x, v = _inputs(6)
    a = 0.7
    prev, log_prob, mean, std_dev_t = sde_step_with_logprob(
        v, sigma, sigma_next, x, noise_level=a, sde_type="cps", generator=torch.Generator().manual_seed(7)
    )
    xd, vd = x.double().numpy(), v.double().numpy()
    std = sigma_next * math.sin(a * math.pi / 2)
    x0, x1 = xd - sigma * vd, xd + (1 - sigma) * vd
    exp_mean = x0 * (1 - sigma_next) + x1 * math.sqrt(sigma_next**2 - std**2)
    np.testing.assert_allclose(mean.double().numpy(), exp_mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(std_dev_t.flatten().numpy(), std, rtol=1e-6, atol=1e-12)
    expected = -((prev.double().numpy() - exp_mean) ** 2).reshape(3, -1).mean(1)
    np.testing.assert_allclose(log_prob.double().numpy(), expected, rtol=1e-5, atol=1e-6)


def test_float16_inputs_are_scored_in_float32():
    x, v = _inputs(8)
    _, lp16, _, _ = sde_step_with_logprob(v.half(), 0.5, 0.4, x.half(), noise_level=0.7,
                                          prev_sample=x.half().float())
    assert lp16.dtype == torch.float32


def test_unknown_sde_type_is_rejected():
    x, v = _inputs(9)
    with pytest.raises(ValueError, match="sde_type"):
        sde_step_with_logprob(v, 0.5, 0.4, x, noise_level=0.7, sde_type="ode")


def test_forward_noise_is_the_flow_matching_interpolation():
    x0, eps = torch.tensor([2.0, -1.0]), torch.tensor([0.5, 3.0])
    assert forward_noise(x0, eps, 0.25).tolist() == pytest.approx([0.75 * 2 + 0.25 * 0.5, -0.75 + 0.75])
    assert torch.equal(forward_noise(x0, eps, 0.0), x0) and torch.equal(forward_noise(x0, eps, 1.0), eps)
