"""Dance-SDE (`sampling.sde_type: dance`, docs/ALGORITHM.md section 13) against an independent float64
transcription of DanceGRPO's `flux_step`, the Gaussian density and the flow's closed-form marginals."""

import itertools
import math

import pytest
import torch

from components.errors import ConfigError
from components.flow_rl.sde import sde_step_with_logprob
from pipeline.config import CONFIG_DIR, load_config

TINY = CONFIG_DIR / "tiny-cpu.yaml"


def _authors_flux_step(model_output, latents, eta, sigmas, index, prev_sample):
    """XueZeyue/DanceGRPO @ 15cc71d fastvideo/train_grpo_flux.py `flux_step` (grpo=True, sde_solver=True) with a
    given prev_sample, transcribed in float64: returns (prev_sample_mean, log_prob)."""
    sigma = sigmas[index]
    dsigma = sigmas[index + 1] - sigma
    prev_sample_mean = latents + dsigma * model_output
    pred_original_sample = latents - sigma * model_output
    delta_t = sigma - sigmas[index + 1]
    std_dev_t = eta * math.sqrt(delta_t)
    score_estimate = -(latents - pred_original_sample * (1 - sigma)) / sigma**2
    log_term = -0.5 * eta**2 * score_estimate
    prev_sample_mean = prev_sample_mean + log_term * dsigma
    log_prob = (
        -((prev_sample - prev_sample_mean) ** 2) / (2 * (std_dev_t**2))
        - math.log(std_dev_t) - torch.log(torch.sqrt(2 * torch.as_tensor(math.pi, dtype=torch.float64)))
    )
    return prev_sample_mean, log_prob.mean(dim=tuple(range(1, log_prob.ndim)))


def _authors_sigmas(steps: int, shift: float) -> list[float]:
    """DanceGRPO's schedule: linspace(1, 0, steps + 1) through `sd3_time_shift`."""
    t = torch.linspace(1, 0, steps + 1, dtype=torch.float64)
    return ((shift * t) / (1 + (shift - 1) * t)).tolist()


def _inputs(seed: int, shape=(3, 4, 6, 6)):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def _velocity(x: torch.Tensor, sigma: float, mu: float = 0.5, s0: float = 0.6) -> torch.Tensor:
    """The exact velocity E[eps - x0 | x_sigma = x] of the flow x_sigma = (1 - sigma) x0 + sigma eps for
    x0 ~ N(mu, s0^2) per element, eps ~ N(0, 1)."""
    m, var = (1 - sigma) * mu, (1 - sigma) ** 2 * s0**2 + sigma**2
    return (sigma - (1 - sigma) * s0**2) / var * (x - m) - mu


@pytest.mark.parametrize("eta", [0.3, 0.7])
def test_whole_trajectory_matches_the_authors_flux_step(eta):
    """Sample a 16-step trajectory with the published schedule (shift 3); every step's mean and log-prob equal
    the authors' step fed the same latents in float64."""
    sigmas = _authors_sigmas(16, 3.0)
    x = torch.randn((2, 4, 8, 8), generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1)
    for i in range(16):
        v = _velocity(x, sigmas[i])
        prev, log_prob, mean, std_dev_t = sde_step_with_logprob(
            v, sigmas[i], sigmas[i + 1], x, noise_level=eta, sde_type="dance", generator=gen)
        exp_mean, exp_lp = _authors_flux_step(v.double(), x.double(), eta, sigmas, i, prev.double())
        torch.testing.assert_close(mean.double(), exp_mean, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(log_prob.double(), exp_lp, rtol=1e-5, atol=1e-4)
        assert torch.all(std_dev_t == eta)
        x = prev
    assert x.abs().max() < 10  # the sampler stayed on the data's scale


def test_drawn_sample_is_the_authors_mean_plus_their_noise():
    x, v = _inputs(2)
    sigmas = [0.8, 0.65]
    prev, _, _, _ = sde_step_with_logprob(v, 0.8, 0.65, x, noise_level=0.3, sde_type="dance",
                                          generator=torch.Generator().manual_seed(5))
    eps = torch.randn(x.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float32).double()
    exp_mean, _ = _authors_flux_step(v.double(), x.double(), 0.3, sigmas, 0, x.double())
    torch.testing.assert_close(prev.double(), exp_mean + 0.3 * math.sqrt(0.15) * eps, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("sigma", "sigma_next"), [(1.0, 0.9), (0.5, 0.3), (0.1, 0.0)])
def test_log_prob_is_the_gaussian_density_of_the_stored_sample(sigma, sigma_next):
    x, v = _inputs(3)
    target = torch.randn_like(x)
    _, log_prob, mean, _ = sde_step_with_logprob(v, sigma, sigma_next, x, noise_level=0.3, sde_type="dance",
                                                 prev_sample=target)
    exp_mean, _ = _authors_flux_step(v.double(), x.double(), 0.3, [sigma, sigma_next], 0, target.double())
    density = torch.distributions.Normal(exp_mean, 0.3 * math.sqrt(sigma - sigma_next))
    torch.testing.assert_close(log_prob.double(), density.log_prob(target.double()).flatten(1).mean(1),
                               rtol=1e-5, atol=1e-5)
    assert torch.isfinite(mean).all()


def test_noise_has_std_eta_sqrt_dt():
    x, v = _inputs(4, shape=(4, 16, 32, 32))
    prev, _, mean, std_dev_t = sde_step_with_logprob(v, 0.6, 0.45, x, noise_level=0.3, sde_type="dance",
                                                     generator=torch.Generator().manual_seed(6))
    z = (prev - mean) / (0.3 * math.sqrt(0.15))
    assert z.mean().abs() < 0.02  # 5 standard errors for 65536 draws
    assert z.std().item() == pytest.approx(1.0, abs=0.01)
    assert std_dev_t.shape == (4, 1, 1, 1) and torch.all(std_dev_t == 0.3)


def _one_step_moments(m: float, var: float, sigma: float, sigma_next: float, eta: float) -> tuple[float, float]:
    """Exact mean and variance of x_next when x ~ N(m, var): the step is affine in x (the velocity is), so
    read its slope and intercept off the implementation and add the noise's variance."""
    x = torch.tensor([[0.0], [1.0]], dtype=torch.float64)
    _, _, mean, _ = sde_step_with_logprob(_velocity(x, sigma), sigma, sigma_next, x, noise_level=eta,
                                          sde_type="dance", prev_sample=x)
    b, a = mean[0, 0].item(), mean[1, 0].item() - mean[0, 0].item()
    return a * m + b, a * a * var + eta**2 * (sigma - sigma_next)


def _marginal(sigma: float, mu: float = 0.5, s0: float = 0.6) -> tuple[float, float]:
    return (1 - sigma) * mu, (1 - sigma) ** 2 * s0**2 + sigma**2


@pytest.mark.parametrize("eta", [0.3, 1.0])
def test_one_step_keeps_the_flow_marginal_to_second_order(eta):
    """From the flow's marginal at sigma, one step lands on its marginal at sigma_next up to O(dt^2): halving
    dt quarters the error (Euler-Maruyama of an SDE with the flow's marginals)."""
    errors = []
    for dt in (0.02, 0.01, 0.005):
        m, var = _one_step_moments(*_marginal(0.5), 0.5, 0.5 - dt, eta)
        m_exp, var_exp = _marginal(0.5 - dt)
        errors.append(max(abs(m - m_exp), abs(var - var_exp)))
    assert errors[0] < 1e-3
    assert errors[1] / errors[0] == pytest.approx(0.25, abs=0.05)
    assert errors[2] / errors[1] == pytest.approx(0.25, abs=0.05)


def test_many_steps_reach_the_data_distribution():
    """N(0, 1) noise through 400 Dance steps ends at the data's N(mu, s0^2), where a wrong drift (e.g. the
    score term's sign flipped) would not."""
    sigmas = torch.linspace(1, 0, 401, dtype=torch.float64).tolist()
    m, var = 0.0, 1.0
    for s, s_next in itertools.pairwise(sigmas):
        m, var = _one_step_moments(m, var, s, s_next, 0.7)
    assert m == pytest.approx(0.5, abs=0.01)
    assert var == pytest.approx(0.36, abs=0.01)


def test_dance_is_the_sde_step_with_a_constant_diffusion_coefficient():
    """At one sigma, `sde` with a such that a sqrt(sigma / (1 - sigma)) = eta is the same Gaussian as `dance`."""
    x, v = _inputs(7)
    target = torch.randn_like(x)
    sigma, eta = 0.4, 0.3
    a = eta / math.sqrt(sigma / (1 - sigma))
    _, lp_d, mean_d, std_d = sde_step_with_logprob(v, sigma, 0.3, x, noise_level=eta, sde_type="dance",
                                                   prev_sample=target)
    _, lp_s, mean_s, std_s = sde_step_with_logprob(v, sigma, 0.3, x, noise_level=a, sde_type="sde",
                                                   prev_sample=target)
    torch.testing.assert_close(mean_d, mean_s)
    torch.testing.assert_close(lp_d, lp_s)
    torch.testing.assert_close(std_d, std_s)


def test_gradient_flows_through_the_mean():
    x, v = _inputs(8)
    v.requires_grad_(True)
    prev, log_prob, mean, _ = sde_step_with_logprob(v, 0.5, 0.4, x, noise_level=0.3, sde_type="dance")
    assert not prev.requires_grad and mean.requires_grad
    log_prob.sum().backward()
    assert v.grad is not None and torch.isfinite(v.grad).all() and v.grad.abs().sum() > 0


def test_config_accepts_dance_with_grpo_guard_and_refuses_cps():
    c = load_config(TINY, ["sampling.sde_type=dance", "sampling.noise_level=0.3", "train.grpo_guard=true"])
    assert (c.sampling.sde_type, c.sampling.noise_level, c.train.grpo_guard) == ("dance", 0.3, True)
    with pytest.raises(ConfigError, match="sde or dance"):
        load_config(TINY, ["sampling.sde_type=cps", "train.grpo_guard=true"])


def test_shared_initial_noise_reaches_sde_samplers_only_and_an_ode_algorithm_says_it_is_unused():
    from components.algorithms.base import build_algorithm
    from components.trainer.config import algorithm_notes

    shared = ["sampling.same_initial_noise=true"]
    gen = torch.Generator().manual_seed(0)
    grpo = load_config(TINY, [*shared, "train.algorithm=flow_grpo"])
    assert algorithm_notes(grpo) == []
    model = type("NoModel", (), {"device": torch.device("cpu")})()
    assert build_algorithm(grpo, model, []).sampler_settings(gen, 1).same_initial_noise
    nft = load_config(TINY, [*shared, "train.algorithm=diffusion_nft"])
    assert algorithm_notes(nft) == ["sampling.same_initial_noise is not used: DiffusionNFT samples with the ODE"]
    assert not build_algorithm(nft, model, []).sampler_settings(gen, 1).same_initial_noise  # else K equal images
