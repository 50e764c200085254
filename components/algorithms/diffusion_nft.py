"""DiffusionNFT (docs/ALGORITHM.md section 9): ODE rollouts sampled by the old policy, flow matching on their
clean latents between the implicit positive and negative policies; the old policy follows the trained one softly
after each epoch. Its maths: components/flowgrpo/nft.py."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from pydantic import Field

from components.algorithms.base import Algorithm, AlgorithmConfig, JobConfig, MicroBatch, Update, register

if TYPE_CHECKING:
    import torch

    from components.flowgrpo.rollout import Rollout, SamplerSettings
    from components.flowgrpo.update import Optimization
    from components.models.base import FlowMatchingModel

MAX_STEPS = 1_000_000


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


class OldPolicy:
    """The old policy: a copy of the LoRA weights that samples the rollouts and anchors the implicit policies,
    moved towards the trained weights after each epoch by ``old <- d old + (1 - d) current`` with the decay ``d``
    of ``old_policy_decay`` at the optimizer step reached."""

    def __init__(self, params: list[torch.nn.Parameter], section: DiffusionNFTConfig) -> None:
        self.weights = [p.detach().clone() for p in params]
        self.section = section

    def applied(self, params: list[torch.nn.Parameter]) -> contextlib.AbstractContextManager[None]:
        from components.flowgrpo.ema import weights_applied

        return weights_applied(params, self.weights)

    def update(self, params: list[torch.nn.Parameter], optimizer_step: int) -> float:
        from components.flowgrpo.nft import old_policy_decay, soft_update

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
        from components.flowgrpo.update import noise_generator

        self.noise = noise_generator(generator, self.model.device)
        metrics = super().update(rollout, rewards, advantages, sampler, generator, optim)
        metrics["nft/old_decay"] = self.old.update(self.params, optim.step)
        return metrics

    def micro_batches(self, update: Update) -> list[torch.Tensor]:
        from components.flowgrpo.update import micro_batches

        # every sample trains: a zero advantage is r = 0.5, between the implicit policies
        return micro_batches(update.advantages, self.config.train.batch_size_per_worker, False, update.generator)

    def prepare(self, update: Update, indices: torch.Tensor) -> MicroBatch:
        """``int(num_steps * train.timestep_fraction)`` distinct noise levels of the sampler's grid and one noise
        per level (shared by the micro-batch's samples: a forward takes one noise level); the old (and, with a KL
        weight ``train.beta``, the adapter-disabled) velocities under one weight swap each. A term: (noise level,
        noised latents, old velocity, reference velocity or None)."""
        import torch

        from components.flowgrpo.nft import forward_noise

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
        from components.flowgrpo.nft import nft_loss, optimality_probability

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
