"""DiffusionNFT (docs/ALGORITHM.md section 9): ODE rollouts sampled by the old policy, flow matching on their
clean latents between the implicit positive and negative policies; the old policy follows the trained one softly
after each epoch: rewards as optimality probabilities, the implicit positive and negative policies on forward-noised
clean samples, and the soft update of the old policy."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from pydantic import Field

from components.algorithms.base import Algorithm, AlgorithmConfig, JobConfig, MicroBatch, Update, register

if TYPE_CHECKING:
    import torch

    from components.flow_rl.rollout import Rollout, SamplerSettings
    from components.flow_rl.update import Optimization
    from components.models.base import FlowMatchingModel

MAX_STEPS = 1_000_000
WEIGHT_FLOOR = 1e-5  # the adaptive weight's lower bound (NVlabs' clip(min=0.00001))


class DiffusionNFTConfig(AlgorithmConfig):
    """DiffusionNFT's own settings (`train.diffusion_nft`)."""

    beta: float = Field(default=1.0, gt=0, le=10,
                        description="how far the implicit positive and negative policies lie from the old one: "
                                    "v+ = beta v + (1 - beta) v_old, v- = (1 + beta) v_old - beta v")
    decay_flat_steps: int = Field(default=0, ge=0, le=MAX_STEPS,
                                  description="optimizer steps during which the old policy is replaced by the "
                                              "trained one after each epoch (decay 0)")
    decay_rate: float = Field(default=0.001, ge=0, le=1,
                              description="then the old policy's decay grows by this per optimizer step ...")
    max_decay: float = Field(default=0.5, ge=0, lt=1, description="... up to this: old <- d old + (1 - d) current")


def optimality_probability(advantages: torch.Tensor, clip: float) -> torch.Tensor:
    """``r = clamp(clamp(A, -C, C) / C / 2 + 0.5, 0, 1)``: a sample's probability of being optimal, 0.5 for the
    group's mean."""
    return (advantages.clamp(-clip, clip) / clip / 2 + 0.5).clamp(0, 1)


def _weighted_x0_error(x0_pred: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
    """Per sample ``mean((x0_pred - x0)^2) / w`` with the adaptive weight ``w = max(mean|x0_pred - x0|, 1e-5)``
    computed in float64 and detached."""
    import torch

    dims = tuple(range(1, x0.ndim))
    with torch.no_grad():
        weight = (x0_pred.double() - x0.double()).abs().mean(dim=dims, keepdim=True).clamp(min=WEIGHT_FLOOR)
    return ((x0_pred - x0) ** 2 / weight.to(x0_pred.dtype)).mean(dim=dims)


def nft_loss(
    v_theta: torch.Tensor,
    v_old: torch.Tensor,
    x_t: torch.Tensor,
    x0: torch.Tensor,
    sigma: float,
    r: torch.Tensor,
    *,
    beta: float,
    clip: float,
    v_ref: torch.Tensor | None = None,
    kl_weight: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The DiffusionNFT loss of one micro-batch at one noise level.

    ``v+ = beta v_theta + (1 - beta) v_old`` and ``v- = (1 + beta) v_old - beta v_theta``; each predicts
    ``x0 = x_t - sigma v``; the loss is ``C * mean_i [r_i L+_i + (1 - r_i) L-_i] / beta`` with ``L`` the adaptively
    weighted squared x0 error, plus ``kl_weight * mean (v_theta - v_ref)^2`` when ``v_ref`` is given. Gradients
    flow only through ``v_theta``. Returns the loss and detached metrics."""
    v_old = v_old.detach()
    positive = beta * v_theta + (1 - beta) * v_old
    negative = (1 + beta) * v_old - beta * v_theta
    positive_loss = _weighted_x0_error(x_t - sigma * positive, x0)
    negative_loss = _weighted_x0_error(x_t - sigma * negative, x0)
    policy_loss = (clip * (r * positive_loss + (1 - r) * negative_loss) / beta).mean()
    metrics = {"policy_loss": policy_loss.detach(), "nft/positive_loss": positive_loss.mean().detach(),
               "nft/negative_loss": negative_loss.mean().detach(),
               "nft/old_gap": ((v_theta - v_old) ** 2).mean().detach()}
    loss = policy_loss
    if v_ref is not None:
        kl = ((v_theta - v_ref.detach()) ** 2).mean(dim=tuple(range(1, v_theta.ndim))).mean()
        loss = loss + kl_weight * kl
        metrics["kl"] = kl.detach()
    return loss, metrics


def old_policy_decay(step: int, flat: int, rate: float, max_decay: float) -> float:
    """The old policy's decay after ``step`` optimizer steps: 0 for the first ``flat`` steps, then
    ``min((step - flat) * rate, max_decay)`` (NVlabs' ``return_decay``)."""
    return 0.0 if step < flat else min((step - flat) * rate, max_decay)


def soft_update(old: list[torch.Tensor], current: list[torch.Tensor], decay: float) -> None:
    """``old <- decay old + (1 - decay) current``, in place."""
    import torch

    with torch.no_grad():
        for o, c in zip(old, current, strict=True):
            o.mul_(decay).add_(c.detach().to(o.dtype), alpha=1 - decay)


class OldPolicy:
    """The old policy: a copy of the LoRA weights that samples the rollouts and anchors the implicit policies,
    moved towards the trained weights after each epoch by ``old <- d old + (1 - d) current`` with the decay ``d``
    of ``old_policy_decay`` at the optimizer step reached."""

    def __init__(self, params: list[torch.nn.Parameter], section: DiffusionNFTConfig) -> None:
        self.weights = [p.detach().clone() for p in params]
        self.section = section

    def applied(self, params: list[torch.nn.Parameter]) -> contextlib.AbstractContextManager[None]:
        from components.flow_rl.ema import weights_applied

        return weights_applied(params, self.weights)

    def update(self, params: list[torch.nn.Parameter], optimizer_step: int) -> float:
        n = self.section
        decay = old_policy_decay(optimizer_step, n.decay_flat_steps, n.decay_rate, n.max_decay)
        soft_update(self.weights, params, decay)
        return decay

    def state_dict(self) -> dict:
        return {"old_policy": [w.cpu() for w in self.weights]}

    def load_state_dict(self, state: dict | None, what: str) -> None:
        """Restore ``state_dict``'s copy; a checkpoint without one is refused, naming ``what`` it lacks."""
        if state is None:
            raise ValueError(f"the checkpoint holds no {what}")
        for w, saved in zip(self.weights, state["old_policy"], strict=True):
            w.copy_(saved)


@register("diffusion_nft")
class DiffusionNFT(Algorithm):
    name = "DiffusionNFT"
    Config = DiffusionNFTConfig

    def __init__(self, config: JobConfig, model: FlowMatchingModel, params: list[torch.nn.Parameter]) -> None:
        super().__init__(config, model, params)
        self.old = OldPolicy(params, self.section)

    def sampling_weights(self) -> contextlib.AbstractContextManager[None]:
        return self.old.applied(self.params)

    def update(self, rollout: Rollout, rewards: torch.Tensor, advantages: torch.Tensor, sampler: SamplerSettings,
               generator: torch.Generator, optim: Optimization) -> dict[str, float]:
        from components.flow_rl.update import noise_generator

        self.noise = noise_generator(generator, self.model.device)
        metrics = super().update(rollout, rewards, advantages, sampler, generator, optim)
        metrics["nft/old_decay"] = self.old.update(self.params, optim.step)
        return metrics

    def micro_batches(self, update: Update) -> list[torch.Tensor]:
        from components.flow_rl.update import micro_batches

        # every sample trains: a zero advantage is r = 0.5, between the implicit policies
        return micro_batches(update.advantages, self.config.train.batch_size_per_worker, False, update.generator)

    def prepare(self, update: Update, indices: torch.Tensor) -> MicroBatch:
        """``int(num_steps * train.timestep_fraction)`` distinct noise levels of the sampler's grid and one noise
        per level (shared by the micro-batch's samples: a forward takes one noise level); the old (and, with a KL
        weight ``train.beta``, the adapter-disabled) velocities under one weight swap each. A term: (noise level,
        noised latents, old velocity, reference velocity or None)."""
        import torch

        from components.flow_rl.sde import forward_noise

        train, model, sampler = self.config.train, self.model, update.sampler
        batch = MicroBatch(update, indices)
        grid = model.sigmas(sampler.num_steps, sampler.resolution)[:-1].tolist()  # the terminal 0 is the clean one
        count = min(max(1, int(sampler.num_steps * train.timestep_fraction)), len(grid))
        sigmas = [grid[j] for j in torch.randperm(len(grid), generator=update.generator)[:count].tolist()]
        x0 = batch.x0
        noised = [forward_noise(x0, torch.randn(x0.shape, generator=self.noise, device=model.device,
                                                dtype=x0.dtype), s) for s in sigmas]
        with torch.no_grad():
            with self.old.applied(self.params):
                v_old = [model.predict_velocity(x, s, batch.cond, update.guidance) for x, s in zip(
                    noised, sigmas, strict=True)]
            v_ref: list[torch.Tensor | None] = [None] * len(sigmas)
            if train.beta > 0:
                with model.adapter_disabled():
                    v_ref = [model.predict_velocity(x, s, batch.cond, update.guidance) for x, s in zip(
                        noised, sigmas, strict=True)]
        batch.terms = list(zip(sigmas, noised, v_old, v_ref, strict=True))
        return batch

    def loss(self, batch: MicroBatch, term: tuple) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        train = self.config.train
        sigma, x_t, v_old, v_ref = term
        v_theta = self.model.predict_velocity(x_t, sigma, batch.cond, batch.update.guidance)
        r = optimality_probability(batch.advantages.float(), train.adv_clip_max)
        return nft_loss(v_theta, v_old, x_t, batch.x0, sigma, r, beta=self.section.beta, clip=train.adv_clip_max,
                        v_ref=v_ref, kl_weight=train.beta)

    def state_dict(self) -> dict | None:
        return self.old.state_dict()

    def load_state_dict(self, state: dict | None) -> None:
        self.old.load_state_dict(state, "DiffusionNFT old policy")
