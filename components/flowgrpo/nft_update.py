"""DiffusionNFT's update on one epoch's samples, and its old policy (docs/ALGORITHM.md section 9)."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from components.flowgrpo.ema import LoRAEMA, weights_applied
from components.flowgrpo.nft import forward_noise, nft_loss, old_policy_decay, optimality_probability, soft_update
from components.flowgrpo.rollout import Rollout, SamplerSettings
from components.flowgrpo.update import MetricMeans, apply_gradients, micro_batches
from components.models.base import FlowMatchingModel


@dataclass(frozen=True)
class NFTSettings:
    batch_size: int
    gradient_accumulation_steps: int
    inner_epochs: int
    max_grad_norm: float
    guidance_scale: float
    beta: float  # NFT's beta: how far the implicit policies sit from the old one
    adv_clip: float  # C: advantages are clipped to [-C, C] and mapped to r in [0, 1]
    kl_weight: float  # weight of the velocity MSE to the adapter-disabled model (0: not computed)
    train_timesteps: int  # noise levels each micro-batch trains on, drawn from the sampler's grid


class OldPolicy:
    """The old policy: a copy of the LoRA weights that samples the rollouts and anchors the implicit policies,
    moved towards the trained weights after each epoch by ``old <- d old + (1 - d) current`` with the decay ``d``
    of ``old_policy_decay`` at the optimizer step reached."""

    def __init__(self, params: list[torch.nn.Parameter], flat: int, rate: float, max_decay: float) -> None:
        self.weights = [p.detach().clone() for p in params]
        self.flat, self.rate, self.max_decay = flat, rate, max_decay

    def applied(self, params: list[torch.nn.Parameter]) -> contextlib.AbstractContextManager[None]:
        return weights_applied(params, self.weights)

    def update(self, params: list[torch.nn.Parameter], optimizer_step: int) -> float:
        decay = old_policy_decay(optimizer_step, self.flat, self.rate, self.max_decay)
        soft_update(self.weights, params, decay)
        return decay

    def state_dict(self) -> dict:
        return {"old_policy": [w.cpu() for w in self.weights]}

    def load_state_dict(self, state: dict) -> None:
        for w, saved in zip(self.weights, state["old_policy"], strict=True):
            w.copy_(saved)


def nft_update(
    model: FlowMatchingModel,
    optimizer: torch.optim.Optimizer,
    params: list[torch.nn.Parameter],
    old: OldPolicy,
    rollout: Rollout,
    advantages: torch.Tensor,
    sampler: SamplerSettings,
    settings: NFTSettings,
    generator: torch.Generator,
    ema: LoRAEMA | None,
    optimizer_step: int,
    average_grads: Callable[[list[torch.Tensor]], None] | None = None,
) -> tuple[dict[str, float], int]:
    """Train on the rollout's clean latents (its final states); then move the old policy. Returns mean metrics
    and the new optimizer step count.

    Each micro-batch draws ``train_timesteps`` distinct noise levels of the sampler's grid and one noise per level
    (shared by the micro-batch's samples: a forward takes one noise level); the old (and, with a KL weight, the
    adapter-disabled) velocities come first under one weight swap, then the trained forward and backward per
    level. Gradients accumulate over the levels of ``gradient_accumulation_steps`` micro-batches per step."""
    grid = model.sigmas(sampler.num_steps, sampler.resolution)[:-1].tolist()  # the terminal 0 is the clean sample
    levels_per_batch = min(settings.train_timesteps, len(grid))
    scale = 1.0 / (levels_per_batch * settings.gradient_accumulation_steps)
    device = model.device
    noise_gen = torch.Generator(device).manual_seed(int(torch.randint(2**62, (1,), generator=generator)))
    x0_all = rollout.trajectory[:, -1]
    r_all = optimality_probability(advantages.to(device).float(), settings.adv_clip)
    means = MetricMeans()

    model.transformer.train(False)  # dropout off, as in sampling
    for _ in range(settings.inner_epochs):
        batches = micro_batches(advantages, settings.batch_size, False, generator)
        for i, idx in enumerate(batches):
            idx = idx.to(rollout.prompt_index.device)
            cond = rollout.embeds.select(rollout.prompt_index[idx])
            x0 = x0_all[idx]
            sigmas = [grid[j] for j in torch.randperm(len(grid), generator=generator)[:levels_per_batch].tolist()]
            noised = [forward_noise(x0, torch.randn(x0.shape, generator=noise_gen, device=device, dtype=x0.dtype), s)
                      for s in sigmas]
            with torch.no_grad():
                with old.applied(params):
                    v_old = [model.predict_velocity(x, s, cond, settings.guidance_scale) for x, s in zip(
                        noised, sigmas, strict=True)]
                v_ref: list[torch.Tensor | None] = [None] * len(sigmas)
                if settings.kl_weight > 0:
                    with model.adapter_disabled():
                        v_ref = [model.predict_velocity(x, s, cond, settings.guidance_scale) for x, s in zip(
                            noised, sigmas, strict=True)]
            for x_t, s, vo, vr in zip(noised, sigmas, v_old, v_ref, strict=True):
                v_theta = model.predict_velocity(x_t, s, cond, settings.guidance_scale)
                loss, metrics = nft_loss(v_theta, vo, x_t, x0, s, r_all[idx], beta=settings.beta,
                                         clip=settings.adv_clip, v_ref=vr, kl_weight=settings.kl_weight)
                (loss * scale).backward()
                for k, v in metrics.items():
                    means.add(k, v)
            if (i + 1) % settings.gradient_accumulation_steps == 0:
                optimizer_step = apply_gradients(optimizer, params, settings.max_grad_norm, average_grads, ema,
                                                 optimizer_step, means)
    metrics = means.result()
    metrics["nft/old_decay"] = old.update(params, optimizer_step)
    metrics["trained_fraction"] = 1.0
    return metrics, optimizer_step
