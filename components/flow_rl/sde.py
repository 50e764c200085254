"""The steps along a flow-matching path: one reverse-time SDE step of the sampler with its log-probability, the ODE
steps, and the forward noising the flow-matching losses train on.

Implements docs/ALGORITHM.md sections 1 (``sde``), 2 (``cps``) and 13 (``dance``), the multistep solver of section 12
and the forward process of sections 9, 11 and 14. The sampler's maths runs in float32 whatever the model dtype.
Imports only torch.
"""

from __future__ import annotations

import math

import torch

SDE_TYPES = ("sde", "cps", "dance")
_LOG_SQRT_2PI = 0.5 * math.log(2.0 * math.pi)


def _per_sample(value: float | torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Broadcast a float or a (B,) tensor to shape (B, 1, ..., 1) in float32."""
    if isinstance(value, torch.Tensor):
        t = value.to(device=like.device, dtype=torch.float32)
        if t.ndim == 0:
            t = t.expand(like.shape[0])
    else:  # filled on the device: a tensor made from a host number would be a copy that waits for the device
        t = torch.full((like.shape[0],), float(value), dtype=torch.float32, device=like.device)
    if t.shape != (like.shape[0],):
        raise ValueError(f"sigma must be a float or a tensor of shape ({like.shape[0]},), got {tuple(t.shape)}")
    return t.view(-1, *([1] * (like.ndim - 1)))


def sde_step_with_logprob(
    model_output: torch.Tensor,
    sigma: float | torch.Tensor,
    sigma_next: float | torch.Tensor,
    sample: torch.Tensor,
    *,
    noise_level: float,
    sde_type: str = "sde",
    prev_sample: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Step ``sample`` from ``sigma`` to ``sigma_next`` and score the result.

    Returns ``(prev_sample, log_prob, mean, std_dev_t)``: ``log_prob`` has shape
    (B,) (mean over non-batch dims), ``mean`` carries the gradient, ``prev_sample``
    is detached, ``std_dev_t`` has shape (B, 1, ..., 1). When ``prev_sample`` is
    given no noise is drawn and its log-probability is returned.
    """
    if sde_type not in SDE_TYPES:
        raise ValueError(f"sde_type must be one of {SDE_TYPES}, got {sde_type!r}")
    x = sample.float()
    v = model_output.float()
    s = _per_sample(sigma, x)
    s_next = _per_sample(sigma_next, x)

    if sde_type in ("sde", "dance"):
        dt = s_next - s
        if sde_type == "sde":
            # At sigma == 1 the factor sigma / (1 - sigma) is infinite; upstream uses sigma_next there.
            s_safe = torch.where(s == 1, s_next, s)
            std_dev_t = noise_level * torch.sqrt(s / (1 - s_safe))
        else:  # DanceGRPO: the same SDE with a constant diffusion coefficient
            std_dev_t = torch.full_like(s, noise_level)
        mean = x * (1 + std_dev_t**2 / (2 * s) * dt) + v * (1 + std_dev_t**2 * (1 - s) / (2 * s)) * dt
        noise_std = std_dev_t * torch.sqrt(-dt)
    else:
        std_dev_t = s_next * math.sin(noise_level * math.pi / 2)
        x0_hat = x - s * v
        x1_hat = x + (1 - s) * v
        mean = x0_hat * (1 - s_next) + x1_hat * torch.sqrt(s_next**2 - std_dev_t**2)
        noise_std = std_dev_t

    if prev_sample is None:
        noise = torch.randn(x.shape, generator=generator, device=x.device, dtype=torch.float32)
        prev_sample = mean + noise_std * noise
    prev_sample = prev_sample.detach().float()

    sq = (prev_sample - mean) ** 2
    if sde_type != "cps":
        log_prob = -sq / (2 * noise_std**2) - torch.log(noise_std) - _LOG_SQRT_2PI
    else:
        log_prob = -sq  # constants and scale dropped, as upstream
    log_prob = log_prob.mean(dim=tuple(range(1, log_prob.ndim)))
    return prev_sample, log_prob, mean, std_dev_t


def forward_noise(x0: torch.Tensor, noise: torch.Tensor, sigma: float) -> torch.Tensor:
    """``x_t = (1 - t) x0 + t eps``: the flow-matching forward process at noise level ``sigma``."""
    return (1 - sigma) * x0 + sigma * noise


def euler_step(model_output: torch.Tensor, sigma: float, sigma_next: float, sample: torch.Tensor) -> torch.Tensor:
    """Deterministic ODE step (noise level 0), in float32."""
    return sample.float() + model_output.float() * (sigma_next - sigma)



ODE_SOLVERS = ("euler", "dpm2")


def data_prediction(model_output: torch.Tensor, sigma: float, sample: torch.Tensor) -> torch.Tensor:
    """x0 = x - sigma * v, in float32: what DPM-Solver++ extrapolates."""
    return sample.float() - sigma * model_output.float()


def _log_snr(sigma: float) -> float:
    """lambda = log(alpha / sigma) of the flow-matching path x = (1 - sigma) x0 + sigma noise."""
    return math.log((1 - sigma) / sigma)


def dpm2_step(
    model_output: torch.Tensor, sigma: float, sigma_next: float, sample: torch.Tensor,
    previous: tuple[torch.Tensor, float] | None,
) -> torch.Tensor:
    """One multistep DPM-Solver++(2M) step (midpoint form) from ``sigma`` to ``sigma_next``, in float32
    (docs/ALGORITHM.md section 12). ``previous``: the last step's ``(data_prediction, sigma)``. Without a usable
    one (none, or one at sigma 1, where the log-SNR is -inf) and on the step to sigma 0 it is first order, which
    in this parametrisation (alpha = 1 - sigma) is exactly the Euler step."""
    if previous is None or previous[1] >= 1 or sigma_next == 0:
        return euler_step(model_output, sigma, sigma_next, sample)
    x0, (x0_prev, sigma_prev) = data_prediction(model_output, sigma, sample), previous
    h = _log_snr(sigma_next) - _log_snr(sigma)
    r = (_log_snr(sigma) - _log_snr(sigma_prev)) / h
    d = x0 + (x0 - x0_prev.float()) / (2 * r)
    return sigma_next / sigma * sample.float() - (1 - sigma_next) * math.expm1(-h) * d
