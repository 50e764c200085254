"""Rollouts: K images per prompt sampled with the SDE, with the trajectory FlowGRPO trains on
(docs/ALGORITHM.md section 3)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from components.flow_rl.sde import ODE_SOLVERS, data_prediction, dpm2_step, euler_step, sde_step_with_logprob
from components.models.base import FlowMatchingModel, PromptEmbeddings


@dataclass(frozen=True)
class SamplerSettings:
    num_steps: int
    guidance_scale: float
    noise_level: float
    sde_type: str
    resolution: int
    sde_steps: tuple[int, ...]  # steps that inject noise; the others are ODE steps
    train_steps: tuple[int, ...]  # consecutive subset of sde_steps whose transitions are stored for training
    keep_means: bool = False  # also store each trained transition's SDE mean (GRPO-Guard's ratio needs it)
    same_initial_noise: bool = False  # a group's images start from one noise (DanceGRPO's init_same_noise)
    # the ODE steps after the last SDE step: Euler, or DPM-Solver++(2M) on the data predictions of all steps so far
    # (MixGRPO-Flash, docs/ALGORITHM.md section 12); the ODE steps before it are Euler either way
    ode_solver: str = "euler"
    # the fraction of the schedule's points after the last SDE step that the ODE steps there visit (fewer forwards;
    # MixGRPO-Flash's compression, docs/ALGORITHM.md section 12); 1 visits them all
    tail_ratio: float = 1.0

    def __post_init__(self) -> None:
        if self.ode_solver not in ODE_SOLVERS:
            raise ValueError(f"ode_solver must be one of {ODE_SOLVERS}, got {self.ode_solver!r}")
        if not 0 < self.tail_ratio <= 1:
            raise ValueError(f"tail_ratio must be in (0, 1], got {self.tail_ratio}")


def plan_steps(
    num_steps: int, timestep_fraction: float, window: tuple[int, int] | None
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(sde_steps, train_steps): all steps / the first fraction, or the window for both."""
    if window is not None:
        start, size = window
        steps = tuple(range(start, start + size))
        return steps, steps
    n_train = max(1, int(num_steps * timestep_fraction))
    return tuple(range(num_steps)), tuple(range(n_train))


def step_path(num_steps: int, last_sde: int, tail_ratio: float) -> list[int]:
    """The schedule's points the sampler visits, as indices into its ``num_steps + 1`` noise levels: every one up to
    the step after the last SDE step (``last_sde``, -1 for none), then ``n = max(2, int((num_steps - last_sde) *
    tail_ratio))`` of the remaining ones, evenly spaced in index (rounded) from there to the final one."""
    first = last_sde + 1
    n = max(2, int((num_steps - first + 1) * tail_ratio))
    if tail_ratio == 1 or n >= num_steps - first + 1:
        return list(range(num_steps + 1))
    spacing = (num_steps - first) / (n - 1)
    return [*range(first), *(first + math.floor(k * spacing + 0.5) for k in range(n))]


@dataclass
class Rollout:
    """Samples of one epoch. Embeddings are stored once per prompt and indexed per sample."""

    prompts: list[str]
    embeds: PromptEmbeddings  # one row per prompt
    prompt_index: torch.Tensor  # (B,) long: the sample's prompt, also its GRPO group
    sigmas: torch.Tensor  # (T,) noise level before each stored step
    sigmas_next: torch.Tensor  # (T,)
    trajectory: torch.Tensor  # (B, T + 1, *latent) float32: stored step t goes from [:, t] to [:, t + 1]; with no
    # train_steps (T = 0) only the final, clean latent
    log_probs: torch.Tensor  # (B, T) float32
    images: np.ndarray  # (B, H, W, 3) uint8, what rewards score; a video family's (B, F, H, W, 3)
    means: torch.Tensor | None = None  # (B, T, *latent) float32: each stored transition's mean, with keep_means
    levels: list[tuple[float, float]] = field(init=False, repr=False)  # (sigma, sigma_next) per stored step

    def __post_init__(self) -> None:
        # as host numbers once: reading a tensor element at every training forward costs a dispatch each time
        self.levels = list(zip(self.sigmas.tolist(), self.sigmas_next.tolist(), strict=True))

    def __len__(self) -> int:
        return self.prompt_index.shape[0]


def step_log_prob(
    model: FlowMatchingModel, rollout: Rollout, sample_idx: torch.Tensor, t: int, settings: SamplerSettings,
    guidance_scale: float, *, cond: PromptEmbeddings | None = None, uncond_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-prob of the stored transition ``t`` of samples ``sample_idx`` under the current weights.

    ``cond``: the samples' prompt embeddings, when the caller selected them once for all timesteps.
    ``uncond_grad``: see ``FlowMatchingModel.predict_velocity``.
    Returns ``(log_prob, mean, std_dev_t)``; differentiable through ``mean``.
    """
    x = rollout.trajectory[sample_idx, t]
    if cond is None:
        cond = rollout.embeds.select(rollout.prompt_index[sample_idx])
    sigma, sigma_next = rollout.levels[t]
    v = model.predict_velocity(x, sigma, cond, guidance_scale, uncond_grad)
    _, log_prob, mean, std_dev_t = sde_step_with_logprob(
        v, sigma, sigma_next, x, noise_level=settings.noise_level, sde_type=settings.sde_type,
        prev_sample=rollout.trajectory[sample_idx, t + 1],
    )
    return log_prob, mean, std_dev_t


@torch.no_grad()
def sample_rollout(
    model: FlowMatchingModel,
    prompts: list[str],
    group_size: int,
    batch_size: int,
    settings: SamplerSettings,
    generator: torch.Generator | Callable[[int], torch.Generator],
    on_batch: Callable[[np.ndarray, torch.Tensor], None] | None = None,
    embeds: PromptEmbeddings | None = None,
    check: Callable[[], None] | None = None,
) -> Rollout:
    """Sample ``group_size`` images for each prompt, ``batch_size`` images per forward pass.

    ``generator`` draws all the noise, or is a function giving batch ``b`` its own generator (so a
    shard of the batches, sampled on another worker, draws exactly the noise it would in one process).

    ``on_batch(images, prompt_indices)`` is called as soon as each batch is decoded, so scoring can
    overlap the sampling of the next batch. ``embeds`` are the prompts' embeddings when already computed.
    ``check()`` is called before every denoising step; what it raises abandons the rollout (a batch's scoring
    failed for good: the rest of the epoch's sampling would be thrown away).
    """
    if embeds is None:
        embeds = model.encode_prompts(prompts)
    prompt_index = torch.arange(len(prompts), device=model.device).repeat_interleave(group_size)
    sigmas = model.sigmas(settings.num_steps, settings.resolution)
    levels = sigmas.tolist()
    shape = model.latent_shape(settings.resolution)
    sde_steps, train_steps = set(settings.sde_steps), settings.train_steps
    if train_steps and train_steps != tuple(range(train_steps[0], train_steps[0] + len(train_steps))):
        raise ValueError(f"train_steps must be consecutive, got {train_steps}")
    multistep = settings.ode_solver == "dpm2"
    last_sde = max(sde_steps, default=-1)
    path = step_path(settings.num_steps, last_sde, settings.tail_ratio)
    last_stored = train_steps[-1] if train_steps else path[-2]  # none: keep the final latent only

    trajectories, log_probs, images, means = [], [], [], []
    group_noise: dict[int, torch.Tensor] = {}
    for b, idx in enumerate(prompt_index.split(batch_size)):
        batch_generator = generator(b) if callable(generator) else generator
        cond = embeds.select(idx)
        if settings.same_initial_noise:
            # drawn by the batch holding the group's first image: a group never spans two workers' batches, so
            # N workers draw what one process would
            groups = idx.tolist()
            for g in dict.fromkeys(groups):
                if g not in group_noise:
                    group_noise[g] = torch.randn(shape, generator=batch_generator, device=model.device,
                                                 dtype=torch.float32)
            x = torch.stack([group_noise[g] for g in groups])
        else:
            x = torch.randn((len(idx), *shape), generator=batch_generator, device=model.device,
                            dtype=torch.float32)
        states, lps, step_means = [], [], []
        previous = None  # the last step's (data prediction, sigma), for the multistep solver
        for i, following in itertools.pairwise(path):
            if check is not None:
                check()
            s, s_next = levels[i], levels[following]
            v = model.predict_velocity(x, s, cond, settings.guidance_scale)
            if i in sde_steps:
                x_next, lp, mean, _ = sde_step_with_logprob(
                    v, s, s_next, x, noise_level=settings.noise_level, sde_type=settings.sde_type,
                    generator=batch_generator,
                )
            elif multistep and i > last_sde:
                x_next, lp, mean = dpm2_step(v, s, s_next, x, previous), None, None
            else:
                x_next, lp, mean = euler_step(v, s, s_next, x), None, None
            if multistep:
                previous = (data_prediction(v, s, x), s)
            if i in train_steps:
                states.append(x)
                lps.append(lp)
                if settings.keep_means:  # else each step's mean is freed at once, as before GRPO-Guard
                    step_means.append(mean)
            x = x_next
            if i == last_stored:
                states.append(x)
        trajectories.append(torch.stack(states, dim=1))
        log_probs.append(torch.stack(lps, dim=1) if lps else x.new_zeros((len(idx), 0)))
        if settings.keep_means:
            means.append(torch.stack(step_means, dim=1))
        images.append(to_pixels(model.decode(x)))
        if on_batch is not None:
            on_batch(images[-1], idx.cpu())

    t_idx = torch.tensor(train_steps, dtype=torch.long)
    return Rollout(
        prompts=list(prompts), embeds=embeds, prompt_index=prompt_index,
        sigmas=sigmas[t_idx], sigmas_next=sigmas[t_idx + 1],
        trajectory=torch.cat(trajectories), log_probs=torch.cat(log_probs), images=np.concatenate(images),
        means=torch.cat(means) if settings.keep_means else None,
    )


@torch.no_grad()
def ode_images(model: FlowMatchingModel, embeds: PromptEmbeddings, num_steps: int, resolution: int,
               guidance_scale: float, generator: torch.Generator) -> np.ndarray:
    """One image per row of ``embeds`` by plain Euler (ODE) sampling, as evaluation samples: a fixed
    ``generator`` gives the same starting noise every time, so only the weights change the picture."""
    levels = model.sigmas(num_steps, resolution).tolist()
    x = torch.randn((len(embeds), *model.latent_shape(resolution)), generator=generator,
                    device=model.device, dtype=torch.float32)
    for s, s_next in itertools.pairwise(levels):
        x = euler_step(model.predict_velocity(x, s, embeds, guidance_scale), s, s_next, x)
    return to_pixels(model.decode(x))


def to_pixels(images: torch.Tensor) -> np.ndarray:
    """Float (B, 3, H, W) in [0, 1] -> uint8 (B, H, W, 3), rounded as diffusers' image processor does; videos
    (B, F, 3, H, W) -> (B, F, H, W, 3)."""
    return (images.detach().float().clamp(0, 1).movedim(-3, -1) * 255).round().to(torch.uint8).cpu().numpy()
