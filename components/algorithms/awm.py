"""AWM, Advantage Weighted Matching (docs/ALGORITHM.md section 11): ODE rollouts sampled by the trained weights;
the flow-matching loss on their clean latents, forward-noised at a few of the sampler's noise levels, is the
log-likelihood surrogate of a clipped policy ratio weighted by the advantage; KL to the base model and to an EMA
anchor of the LoRA that follows the trained weights after each epoch."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from components.algorithms.base import (
    Algorithm,
    AlgorithmConfig,
    JobConfig,
    MicroBatch,
    Update,
    register,
    section_of,
)
from components.algorithms.diffusion_nft import MAX_STEPS, OldPolicy

if TYPE_CHECKING:
    import torch

    from components.flow_rl.rollout import Rollout, SamplerSettings
    from components.flow_rl.update import Optimization
    from components.models.base import FlowMatchingModel

Weighting = Literal["ghuber", "uniform", "t", "t2", "huber"]
TimeSampling = Literal["discrete_wo_init", "discrete"]
HUBER_EPS = 1e-10  # the authors' floor under the squared error before a root or power
HUBER_SHIFT = 1e-5  # and the huber weighting's offset
# the authors' recipe in the keys AWM shares with every algorithm: `recipe_departures` names the others' defaults
RECIPE_TIMESTEP_FRACTION = 0.9
RECIPE_BETAS = "0.001 GenEval, 0.003 OCR, 1e-4 PickScore"


class AWMConfig(AlgorithmConfig):
    """AWM's own settings (`train.awm`); the ratio clip, advantage clip, KL weight and trained share of the steps
    are `train:`'s clip_range, adv_clip_max, beta and timestep_fraction."""

    train_timesteps: int = Field(default=6, ge=1, le=1000,
                                 description="noise levels each micro-batch is trained at, one drawn in each of as "
                                             "many equal strata of the sampler's first int(num_steps * "
                                             "train.timestep_fraction) steps, each with its own noise per sample")
    time_sampling: TimeSampling = Field(
        default="discrete_wo_init",
        description="discrete_wo_init: the strata start at step 1 (the pure-noise level 1 is never trained; the "
                    "GenEval and OCR recipes); discrete: at step 0 (the PickScore recipe)")
    weighting: Weighting = Field(
        default="ghuber",
        description="the log-likelihood surrogate from the per-sample mean squared velocity error e: ghuber "
                    "-((e + 1e-10)^p - 1e-10^p) t / p; uniform -e; t -e t; t2 -e t^2; huber -(sqrt(e + 1e-10) - "
                    "1e-5) t")
    ghuber_power: float = Field(default=0.25, gt=0, le=1, description="p of the ghuber weighting")
    advantage_max: float | None = Field(
        default=1.0, gt=0,
        description="the clipped advantages are rescaled to [-advantage_max, advantage_max]: A = clamp(A, -C, C) / C "
                    "* advantage_max with C = train.adv_clip_max; null keeps clamp(A, -C, C)")
    ema_kl_weight: float = Field(default=1.0, ge=0, le=1000,
                                 description="weight of mean (v - v_ema)^2, the velocities' squared difference to "
                                             "the EMA anchor's; 0 leaves it out")
    decay_flat_steps: int = Field(default=0, ge=0, le=MAX_STEPS,
                                  description="optimizer steps during which the EMA anchor is replaced by the trained "
                                              "weights after each epoch (decay 0)")
    decay_rate: float = Field(default=0.001, ge=0, le=1,
                              description="then the anchor's decay grows by this per optimizer step ...")
    max_decay: float = Field(default=0.3, ge=0, lt=1,
                             description="... up to this: anchor <- d anchor + (1 - d) current")


def level_indices(num_steps: int, timestep_fraction: float, count: int, time_sampling: TimeSampling,
                  generator: torch.Generator) -> list[int]:
    """``count`` indices into the sampler's noise levels, one per stratum: the strata split [lo, int(num_steps *
    timestep_fraction)] (lo 1 for discrete_wo_init, 0 for discrete) at ``linspace``'s points truncated to whole
    steps, and each index is its stratum's lower end plus a uniform fraction of its width, truncated."""
    import torch

    lo = 1 if time_sampling == "discrete_wo_init" else 0
    bounds = torch.linspace(lo, int(num_steps * timestep_fraction), count + 1)
    lower, upper = bounds[:-1].long(), bounds[1:].long()
    u = torch.rand(count, generator=generator)
    return (lower + (u * (upper - lower)).long()).tolist()


def matching_log_prob(v: torch.Tensor, target: torch.Tensor, t: float, weighting: Weighting,
                      power: float) -> torch.Tensor:
    """The per-sample log-likelihood surrogate, float64: minus the mean squared error ``e`` of the velocity ``v``
    against ``target`` (the noise minus the clean latent), weighted by ``weighting`` at noise level ``t``."""
    import torch

    dims = tuple(range(1, v.ndim))
    e = ((v.double() - target.double()) ** 2).mean(dim=dims)
    if weighting == "uniform":
        return -e
    if weighting == "t":
        return -e * t
    if weighting == "t2":
        return -e * t**2
    if weighting == "huber":
        return -(torch.sqrt(e + HUBER_EPS) - HUBER_SHIFT) * t
    return -((e + HUBER_EPS) ** power - HUBER_EPS**power) * t / power


def awm_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_range: float,
    adv_clip_max: float,
    advantage_max: float | None,
    v: torch.Tensor | None = None,
    v_ref: torch.Tensor | None = None,
    kl_weight: float = 0.0,
    v_ema: torch.Tensor | None = None,
    ema_kl_weight: float = 0.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """AWM's loss of one micro-batch at one noise level.

    ``A = clamp(adv, -C, C)`` (then ``/ C * advantage_max``), ``r = exp(logp - logp_old)``; the policy loss is
    ``mean_b max(-A r, -A clamp(r, 1 - clip, 1 + clip))``; plus ``kl_weight mean (v - v_ref)^2`` with ``v_ref``
    and ``ema_kl_weight mean (v - v_ema)^2`` with ``v_ema`` (means over every element, float64). Gradients flow through
    ``log_prob`` and ``v`` only. Returns the loss and detached metrics."""
    import torch

    adv = advantages.to(log_prob.dtype).clamp(-adv_clip_max, adv_clip_max)
    if advantage_max is not None:
        adv = adv / adv_clip_max * advantage_max
    ratio = torch.exp(log_prob - old_log_prob.detach())
    unclipped = -adv * ratio
    clipped = -adv * ratio.clamp(1.0 - clip_range, 1.0 + clip_range)
    policy_loss = torch.maximum(unclipped, clipped).mean()
    metrics = {"policy_loss": policy_loss.detach(), "clipfrac": ((ratio - 1.0).abs() > clip_range).double().mean(),
               "awm/ratio": ratio.detach().mean(), "awm/log_prob": log_prob.detach().mean()}
    loss = policy_loss
    for key, anchor, weight in (("kl", v_ref, kl_weight), ("awm/ema_kl", v_ema, ema_kl_weight)):
        if anchor is None:
            continue
        if v is None:
            raise ValueError(f"awm_loss: {key} needs the trained velocity v")
        kl = ((v.double() - anchor.detach().double()) ** 2).mean()
        loss = loss + weight * kl
        metrics[key] = kl.detach()
    return loss, metrics


def recipe_departures(config: JobConfig) -> list[str]:
    """One note naming the settings AWM shares with every algorithm (`train:`'s, so their defaults are not AWM's)
    in which the run departs from the authors' recipe (docs/ALGORITHM.md section 11); none where it follows it."""
    t, s = config.train, config.sampling
    micro_batches = s.prompts_per_epoch * s.group_size // t.batch_size_per_worker
    steps = micro_batches // t.gradient_accumulation_steps
    departures = []
    if t.timestep_fraction != RECIPE_TIMESTEP_FRACTION:
        departures.append(f"train.timestep_fraction {t.timestep_fraction} (theirs {RECIPE_TIMESTEP_FRACTION})")
    if t.beta == 0:
        departures.append(f"train.beta 0, no KL to the base model (theirs {RECIPE_BETAS})")
    if t.skip_zero_advantage:
        departures.append("train.skip_zero_advantage true (they train every sample: false)")
    if steps > 1:
        departures.append(f"{steps} optimizer steps an epoch on one worker (theirs 1: "
                          f"train.gradient_accumulation_steps {micro_batches}, the epoch's micro-batches)")
    if not departures:
        return []
    return ["AWM departs from its authors' recipe (docs/ALGORITHM.md section 11) in " + "; ".join(departures)]


@register("awm")
class AWM(Algorithm):
    name = "AWM"
    Config = AWMConfig

    @classmethod
    def check(cls, config: JobConfig) -> list[str]:
        notes = super().check(config)
        section = section_of(config)
        lo = 1 if section.time_sampling == "discrete_wo_init" else 0
        hi = int(config.sampling.num_steps * config.train.timestep_fraction)
        if hi <= lo:
            raise ValueError(f"AWM (train.awm.time_sampling {section.time_sampling}) trains the noise levels of steps "
                             f"{lo}..int(sampling.num_steps * train.timestep_fraction) - 1, none here "
                             f"(int({config.sampling.num_steps} * {config.train.timestep_fraction}) = {hi}): raise "
                             f"either, or use time_sampling discrete")
        return notes + recipe_departures(config)

    def __init__(self, config: JobConfig, model: FlowMatchingModel, params: list[torch.nn.Parameter]) -> None:
        super().__init__(config, model, params)
        # the EMA anchor of the KL term follows the trained weights as DiffusionNFT's old policy does
        self.anchor = OldPolicy(params, self.section)

    def update(self, rollout: Rollout, rewards: torch.Tensor, advantages: torch.Tensor, sampler: SamplerSettings,
               generator: torch.Generator, optim: Optimization) -> dict[str, float]:
        """The ratio's old policy is the one that sampled the rollout: until the update's first optimizer step the
        trained forward's own value (detached), after it a forward under the weights the update started with."""
        from components.flow_rl.update import noise_generator

        self.noise = noise_generator(generator, self.model.device)
        self.first_step, self.sampled_with = optim.step, [p.detach().clone() for p in optim.params]
        metrics = super().update(rollout, rewards, advantages, sampler, generator, optim)
        metrics["awm/ema_decay"] = self.anchor.update(self.params, optim.step)
        return metrics

    def prepare(self, update: Update, indices: torch.Tensor) -> MicroBatch:
        """``train_timesteps`` noise levels (``level_indices``) and a noise per level and sample; the no-grad
        forwards (old, adapter-disabled with ``train.beta``, EMA anchor with ``ema_kl_weight``) under one weight
        swap each. A term: (noised latents, noise, level, old log-prob, reference velocity, anchor velocity), each
        of the last three None where not computed."""
        import torch

        from components.flow_rl.ema import weights_applied
        from components.flow_rl.sde import forward_noise

        train, section, model, sampler = self.config.train, self.section, self.model, update.sampler
        batch = MicroBatch(update, indices)
        grid = model.sigmas(sampler.num_steps, sampler.resolution)[:-1].tolist()  # the terminal 0 is the clean one
        x0 = batch.x0
        levels = [grid[j] for j in level_indices(sampler.num_steps, train.timestep_fraction, section.train_timesteps,
                                                 section.time_sampling, update.generator)]
        noises = [torch.randn(x0.shape, generator=self.noise, device=model.device, dtype=x0.dtype) for _ in levels]
        noised = [forward_noise(x0, eps, t) for eps, t in zip(noises, levels, strict=True)]

        def velocities() -> list[torch.Tensor]:
            return [model.predict_velocity(x, t, batch.cond, update.guidance) for x, t in zip(
                noised, levels, strict=True)]

        none: list[torch.Tensor | None] = [None] * len(levels)
        old_log_probs, v_ref, v_ema = none, none, none
        with torch.no_grad():
            if update.optim.step > self.first_step:
                with weights_applied(self.params, self.sampled_with):
                    old_log_probs = [matching_log_prob(v, eps - x0, t, section.weighting, section.ghuber_power)
                                     for v, eps, t in zip(velocities(), noises, levels, strict=True)]
            if train.beta > 0:
                with model.adapter_disabled():
                    v_ref = velocities()
            if section.ema_kl_weight > 0:
                with self.anchor.applied(self.params):
                    v_ema = velocities()
        batch.terms = list(zip(noised, noises, levels, old_log_probs, v_ref, v_ema, strict=True))
        return batch

    def loss(self, batch: MicroBatch, term: tuple) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        train, section = self.config.train, self.section
        x_t, eps, t, old, v_ref, v_ema = term
        v = self.model.predict_velocity(x_t, t, batch.cond, batch.update.guidance)
        log_prob = matching_log_prob(v, eps - batch.x0, t, section.weighting, section.ghuber_power)
        return awm_loss(log_prob, log_prob.detach() if old is None else old, batch.advantages,
                        clip_range=train.clip_range, adv_clip_max=train.adv_clip_max,
                        advantage_max=section.advantage_max, v=v, v_ref=v_ref, kl_weight=train.beta, v_ema=v_ema,
                        ema_kl_weight=section.ema_kl_weight)

    def state_dict(self) -> dict | None:
        return self.anchor.state_dict()

    def load_state_dict(self, state: dict | None) -> None:
        self.anchor.load_state_dict(state, "AWM EMA anchor")
