"""The algorithm seam (`train.algorithm`): what a training algorithm decides in an epoch: how the rollouts are
sampled and by which weights, and how the policy is updated from them and their advantages. Sampling, scoring,
advantages, Ray Train, sharding, checkpoints and tracking are the trainer's and the same for every algorithm.
Adding one: its maths and update under components/flowgrpo, its config section, a class here (docs/DESIGN.md)."""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar

import torch

from components.flowgrpo.ema import LoRAEMA
from components.flowgrpo.nft_update import NFTSettings, OldPolicy, nft_update
from components.flowgrpo.rollout import Rollout, SamplerSettings, plan_steps
from components.flowgrpo.update import UpdateSettings, policy_update
from components.models.base import FlowMatchingModel
from components.trainer.config import TrainingJobConfig

Update = tuple[dict[str, float], int]


class Algorithm(ABC):
    """One run's algorithm: built once with the model and its LoRA parameters, asked each epoch how to sample and
    to update; its own state (beyond the LoRA, optimizer and EMA) goes into the checkpoints."""

    name: ClassVar[str]  # as people know it: titles of what the run produced (the evaluation report)

    def __init__(self, config: TrainingJobConfig, model: FlowMatchingModel, params: list[torch.nn.Parameter]) -> None:
        self.config, self.model, self.params = config, model, params

    @abstractmethod
    def sampler_settings(self, generator: torch.Generator) -> SamplerSettings:
        """This epoch's sampler (``generator``: the epoch's, for anything drawn once per epoch)."""

    @abstractmethod
    def update(self, optimizer: torch.optim.Optimizer, rollout: Rollout, advantages: torch.Tensor,
               sampler: SamplerSettings, generator: torch.Generator, ema: LoRAEMA | None, optimizer_step: int,
               average_grads: Callable[[list[torch.Tensor]], None] | None) -> Update:
        """Train on this worker's ``rollout`` and its advantages; returns mean metrics and the optimizer step
        count. ``average_grads`` averages gradients over the workers before every optimizer step."""

    def sampling_weights(self) -> contextlib.AbstractContextManager[None]:
        """The weights the rollouts are sampled with, swapped in for the block: the trained ones by default."""
        return contextlib.nullcontext()

    def state_dict(self) -> dict | None:
        return None

    def load_state_dict(self, state: dict | None) -> None:  # noqa: B027  # nothing to restore by default
        """Restore what ``state_dict`` returned."""

    def _sampler(self, sde_steps: tuple[int, ...], train_steps: tuple[int, ...]) -> SamplerSettings:
        s = self.config.sampling
        return SamplerSettings(
            num_steps=s.num_steps, guidance_scale=s.guidance_scale, noise_level=s.noise_level, sde_type=s.sde_type,
            resolution=self.config.model.resolution, sde_steps=sde_steps, train_steps=train_steps,
            keep_means=self.config.train.grpo_guard,
        )

    def training_guidance(self) -> float:
        """The guidance scale of the training forward: the sampling scale with train.train_cfg, else 1."""
        return self.model.training_guidance_scale(self.config.sampling.guidance_scale, self.config.train.train_cfg)


class FlowGRPO(Algorithm):
    """FlowGRPO: rollouts with SDE steps sampled by the trained weights, the clipped policy gradient on their
    stored transitions."""

    name = "FlowGRPO"

    def sampler_settings(self, generator: torch.Generator) -> SamplerSettings:
        s = self.config.sampling
        window = None
        if s.sde_window is not None:  # once per epoch, for every sample of it (upstream: once per sampling batch)
            lo, hi = s.sde_window.range
            size = s.sde_window.size
            window = (int(torch.randint(lo, hi - size + 1, (1,), generator=generator)), size)
        sde_steps, train_steps = plan_steps(s.num_steps, self.config.train.timestep_fraction, window)
        return self._sampler(sde_steps, train_steps)

    def update(self, optimizer: torch.optim.Optimizer, rollout: Rollout, advantages: torch.Tensor,
               sampler: SamplerSettings, generator: torch.Generator, ema: LoRAEMA | None, optimizer_step: int,
               average_grads: Callable[[list[torch.Tensor]], None] | None) -> Update:
        t = self.config.train
        settings = UpdateSettings(
            batch_size=t.batch_size_per_worker, gradient_accumulation_steps=t.gradient_accumulation_steps,
            inner_epochs=t.inner_epochs, clip_range=t.clip_range, adv_clip_max=t.adv_clip_max, beta=t.beta,
            max_grad_norm=t.max_grad_norm,
            guidance_scale=self.training_guidance(), cfg_uncond_grad=t.cfg_uncond_grad,
            skip_zero_advantage=t.skip_zero_advantage, grpo_guard=t.grpo_guard,
            guard_mean_shift=t.guard_mean_shift,
        )
        return policy_update(self.model, optimizer, self.params, rollout, advantages, sampler, settings, generator,
                             ema, optimizer_step, average_grads=average_grads)


class DiffusionNFT(Algorithm):
    """DiffusionNFT: ODE rollouts sampled by the old policy, flow matching on their clean latents between the
    implicit positive and negative policies; the old policy follows the trained one softly after each epoch."""

    name = "DiffusionNFT"

    def __init__(self, config: TrainingJobConfig, model: FlowMatchingModel, params: list[torch.nn.Parameter]) -> None:
        super().__init__(config, model, params)
        n = config.train.nft
        self.old = OldPolicy(params, n.decay_flat_steps, n.decay_rate, n.max_decay)

    def sampler_settings(self, generator: torch.Generator) -> SamplerSettings:
        return self._sampler((), ())  # every step Euler; only the final, clean latent is kept

    def sampling_weights(self) -> contextlib.AbstractContextManager[None]:
        return self.old.applied(self.params)

    def update(self, optimizer: torch.optim.Optimizer, rollout: Rollout, advantages: torch.Tensor,
               sampler: SamplerSettings, generator: torch.Generator, ema: LoRAEMA | None, optimizer_step: int,
               average_grads: Callable[[list[torch.Tensor]], None] | None) -> Update:
        t = self.config.train
        settings = NFTSettings(
            batch_size=t.batch_size_per_worker, gradient_accumulation_steps=t.gradient_accumulation_steps,
            inner_epochs=t.inner_epochs, max_grad_norm=t.max_grad_norm, guidance_scale=self.training_guidance(),
            beta=t.nft.beta, adv_clip=t.adv_clip_max, kl_weight=t.beta,
            train_timesteps=max(1, int(sampler.num_steps * t.timestep_fraction)),
        )
        return nft_update(self.model, optimizer, self.params, self.old, rollout, advantages, sampler, settings,
                          generator, ema, optimizer_step, average_grads=average_grads)

    def state_dict(self) -> dict | None:
        return self.old.state_dict()

    def load_state_dict(self, state: dict | None) -> None:
        if state is None:
            raise ValueError("the checkpoint holds no DiffusionNFT old policy")
        self.old.load_state_dict(state)


ALGORITHMS: dict[str, type[Algorithm]] = {"flow_grpo": FlowGRPO, "diffusion_nft": DiffusionNFT}


def algorithm_name(config: TrainingJobConfig) -> str:
    return ALGORITHMS[config.train.algorithm].name


def build_algorithm(config: TrainingJobConfig, model: FlowMatchingModel,
                    params: list[torch.nn.Parameter]) -> Algorithm:
    return ALGORITHMS[config.train.algorithm](config, model, params)
