"""DiffusionNFT (docs/ALGORITHM.md section 9): ODE rollouts sampled by the old policy, flow matching on their
clean latents between the implicit positive and negative policies; the old policy follows the trained one softly
after each epoch. Its maths: components/flowgrpo/nft.py."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from pydantic import Field

from components.algorithms.base import Algorithm, AlgorithmConfig, JobConfig, register

if TYPE_CHECKING:
    import torch

    from components.flowgrpo.config import TrainConfig
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

    def update(self, rollout: Rollout, advantages: torch.Tensor, sampler: SamplerSettings,
               generator: torch.Generator, optim: Optimization) -> dict[str, float]:
        metrics = nft_update(self.model, rollout, advantages, sampler, generator, optim, self.old,
                             self.config.train, self.section, self.training_guidance())
        metrics["nft/old_decay"] = self.old.update(self.params, optim.step)
        return metrics

    def state_dict(self) -> dict | None:
        return self.old.state_dict()

    def load_state_dict(self, state: dict | None) -> None:
        self.old.load_state_dict(state, "DiffusionNFT old policy")


def nft_update(
    model: FlowMatchingModel,
    rollout: Rollout,
    advantages: torch.Tensor,
    sampler: SamplerSettings,
    generator: torch.Generator,
    optim: Optimization,
    old: OldPolicy,
    train: TrainConfig,
    section: DiffusionNFTConfig,
    guidance_scale: float,
) -> dict[str, float]:
    """Train on the rollout's clean latents (its final states); returns mean metrics.

    Each micro-batch draws ``int(num_steps * train.timestep_fraction)`` distinct noise levels of the sampler's grid
    and one noise per level (shared by the micro-batch's samples: a forward takes one noise level); the old (and,
    with a KL weight ``train.beta``, the adapter-disabled) velocities come first under one weight swap, then the
    trained forward and backward per level. Gradients accumulate over the levels of
    ``train.gradient_accumulation_steps`` micro-batches per optimizer step."""
    import torch

    from components.flowgrpo.nft import forward_noise, nft_loss, optimality_probability
    from components.flowgrpo.update import MetricMeans, micro_batches

    grid = model.sigmas(sampler.num_steps, sampler.resolution)[:-1].tolist()  # the terminal 0 is the clean sample
    levels_per_batch = min(max(1, int(sampler.num_steps * train.timestep_fraction)), len(grid))
    scale = 1.0 / (levels_per_batch * train.gradient_accumulation_steps)
    device = model.device
    noise_gen = torch.Generator(device).manual_seed(int(torch.randint(2**62, (1,), generator=generator)))
    x0_all = rollout.trajectory[:, -1]
    r_all = optimality_probability(advantages.to(device).float(), train.adv_clip_max)
    means = MetricMeans()

    model.transformer.train(False)  # dropout off, as in sampling
    for _ in range(train.inner_epochs):
        batches = micro_batches(advantages, train.batch_size_per_worker, False, generator)
        for i, idx in enumerate(batches):
            idx = idx.to(rollout.prompt_index.device)
            cond = rollout.embeds.select(rollout.prompt_index[idx])
            x0 = x0_all[idx]
            sigmas = [grid[j] for j in torch.randperm(len(grid), generator=generator)[:levels_per_batch].tolist()]
            noised = [forward_noise(x0, torch.randn(x0.shape, generator=noise_gen, device=device, dtype=x0.dtype), s)
                      for s in sigmas]
            with torch.no_grad():
                with old.applied(optim.params):
                    v_old = [model.predict_velocity(x, s, cond, guidance_scale) for x, s in zip(
                        noised, sigmas, strict=True)]
                v_ref: list[torch.Tensor | None] = [None] * len(sigmas)
                if train.beta > 0:
                    with model.adapter_disabled():
                        v_ref = [model.predict_velocity(x, s, cond, guidance_scale) for x, s in zip(
                            noised, sigmas, strict=True)]
            for x_t, s, vo, vr in zip(noised, sigmas, v_old, v_ref, strict=True):
                v_theta = model.predict_velocity(x_t, s, cond, guidance_scale)
                loss, metrics = nft_loss(v_theta, vo, x_t, x0, s, r_all[idx], beta=section.beta,
                                         clip=train.adv_clip_max, v_ref=vr, kl_weight=train.beta)
                (loss * scale).backward()
                for k, v in metrics.items():
                    means.add(k, v)
            if (i + 1) % train.gradient_accumulation_steps == 0:
                optim.apply(means)
    metrics = means.result()
    metrics["trained_fraction"] = 1.0
    return metrics
