"""The policy update on one epoch's rollout (docs/ALGORITHM.md section 6)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from components.flowgrpo.ema import LoRAEMA
from components.flowgrpo.loss import GuardMeanShift, GuardTerms, flow_grpo_loss
from components.flowgrpo.rollout import Rollout, SamplerSettings, step_log_prob
from components.models.base import FlowMatchingModel

# also logged per sampler step, e.g. update/clipfrac/step3: under update/ because MLflow shows metric sections in
# name order, and reward/ must come first
PER_STEP_METRICS = ("policy_loss", "approx_kl", "clipfrac")


@dataclass(frozen=True)
class UpdateSettings:
    batch_size: int
    gradient_accumulation_steps: int
    inner_epochs: int
    clip_range: float
    adv_clip_max: float
    beta: float
    max_grad_norm: float
    guidance_scale: float  # guidance in the training forward: the sampling scale with train_cfg, else 1
    cfg_uncond_grad: bool = True  # the gradient also flows through CFG's unconditional branch
    skip_zero_advantage: bool = False  # train only samples with a non-zero advantage (padded, see micro_batches)
    grpo_guard: bool = False  # GRPO-Guard: normalised ratio, policy loss over |dt| (the rollout keeps its means)
    guard_mean_shift: GuardMeanShift = "sample"


def micro_batches(advantages: torch.Tensor, batch_size: int, skip_zero_advantage: bool,
                  generator: torch.Generator) -> list[torch.Tensor]:
    """One inner epoch's micro-batches: sample indices in a random order, ``ceil(n / batch_size)`` of them.

    With ``skip_zero_advantage`` the samples whose advantage is exactly 0 (zero-std groups, failed rewards) are
    left out and the rest spread evenly over the same number of micro-batches, so every worker takes the same
    forwards and optimizer steps whatever its share of zeros. As upstream, zero-advantage samples chosen at
    random pad the kept ones to a multiple of that number (equal micro-batches, none empty).
    """
    n = advantages.shape[0]
    order = torch.randperm(n, generator=generator)
    if not skip_zero_advantage:
        return list(order.split(batch_size))
    count = -(-n // batch_size)
    nonzero = advantages.cpu()[order] != 0
    kept, zeros = order[nonzero], order[~nonzero]  # each in the random order
    target = min(n, max(count, -(-len(kept) // count) * count))
    return list(torch.cat([kept, zeros[:target - len(kept)]]).tensor_split(count))


def policy_update(
    model: FlowMatchingModel,
    optimizer: torch.optim.Optimizer,
    params: list[torch.nn.Parameter],
    rollout: Rollout,
    advantages: torch.Tensor,
    sampler: SamplerSettings,
    settings: UpdateSettings,
    generator: torch.Generator,
    ema: LoRAEMA | None,
    optimizer_step: int,
    average_grads: Callable[[list[torch.Tensor]], None] | None = None,
) -> tuple[dict[str, float], int]:
    """Run the inner epochs; returns mean metrics and the new optimizer step count.

    Gradients accumulate over all trained timesteps of ``gradient_accumulation_steps``
    micro-batches, then one clipped optimizer step is taken. With data-parallel workers,
    ``average_grads`` averages the accumulated gradients over them first, so every worker
    clips and steps identically.
    """
    n_steps = rollout.log_probs.shape[1]
    scale = 1.0 / (n_steps * settings.gradient_accumulation_steps)
    trained = 0
    device_advantages = advantages.to(model.device)
    means = MetricMeans()

    model.transformer.train(False)  # dropout off: the training forward must equal the sampling forward
    for _ in range(settings.inner_epochs):
        batches = micro_batches(advantages, settings.batch_size, settings.skip_zero_advantage, generator)
        trained += sum(len(b) for b in batches)
        for i, idx in enumerate(batches):
            idx = idx.to(rollout.prompt_index.device)
            cond = rollout.embeds.select(rollout.prompt_index[idx])
            for t in range(n_steps):
                log_prob, mean, std_dev_t = step_log_prob(model, rollout, idx, t, sampler, settings.guidance_scale,
                                                          cond=cond, uncond_grad=settings.cfg_uncond_grad)
                ref_mean = None
                if settings.beta > 0:
                    with torch.no_grad(), model.adapter_disabled():
                        _, ref_mean, _ = step_log_prob(model, rollout, idx, t, sampler, settings.guidance_scale,
                                                       cond=cond)
                guard = None
                if settings.grpo_guard:
                    sigma, sigma_next = rollout.levels[t]
                    guard = GuardTerms(old_mean=rollout.means[idx, t], dt=sigma - sigma_next,
                                       noise_std=std_dev_t * (sigma - sigma_next) ** 0.5,
                                       mean_shift=settings.guard_mean_shift)
                loss, metrics = flow_grpo_loss(
                    log_prob, rollout.log_probs[idx, t], device_advantages[idx], clip_range=settings.clip_range,
                    adv_clip_max=settings.adv_clip_max, mean=mean, ref_mean=ref_mean, std_dev_t=std_dev_t,
                    beta=settings.beta, guard=guard,
                )
                (loss * scale).backward()
                step = sampler.train_steps[t]
                for k, v in metrics.items():
                    for key in (k, f"update/{k}/step{step}") if k in PER_STEP_METRICS else (k,):
                        means.add(key, v)
            if (i + 1) % settings.gradient_accumulation_steps == 0:
                optimizer_step = apply_gradients(optimizer, params, settings.max_grad_norm, average_grads, ema,
                                                 optimizer_step, means)
    metrics = means.result()
    metrics["trained_fraction"] = trained / (len(rollout) * settings.inner_epochs)
    return metrics, optimizer_step


class MetricMeans:
    """Running means of an update's metrics, kept as tensors (no device sync per forward) and read once."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor | float] = defaultdict(float)
        self.counts: dict[str, int] = defaultdict(int)

    def add(self, key: str, value: torch.Tensor | float) -> None:
        self.sums[key] = self.sums[key] + value
        self.counts[key] += 1

    def result(self) -> dict[str, float]:
        keys = list(self.sums)  # one host read for every metric, not one per key
        totals = torch.stack([torch.as_tensor(self.sums[k]) for k in keys]).double().cpu().tolist() if keys else []
        return {k: total / self.counts[k] for k, total in zip(keys, totals, strict=True)}


def apply_gradients(optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter], max_grad_norm: float,
                    average_grads: Callable[[list[torch.Tensor]], None] | None, ema: LoRAEMA | None,
                    optimizer_step: int, means: MetricMeans) -> int:
    """One optimizer step on the accumulated gradients, averaged over the workers first (when ``average_grads``)
    and clipped to ``max_grad_norm``, then the EMA's; adds the norm before clipping to ``means`` as grad_norm.
    Returns the optimizer step count."""
    if average_grads is not None:
        for p in params:  # every worker must reduce the same tensors
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        average_grads([p.grad for p in params])
    means.add("grad_norm", torch.nn.utils.clip_grad_norm_(params, max_grad_norm).detach())
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if ema is not None:
        ema.step(params, optimizer_step + 1)
    return optimizer_step + 1
