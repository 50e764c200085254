"""The policy update on one epoch's rollout (docs/ALGORITHM.md section 6)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from components.flowgrpo.ema import LoRAEMA
from components.flowgrpo.loss import GuardMeanShift, GuardTerms, flow_grpo_loss
from components.flowgrpo.rollout import Rollout, SamplerSettings, step_log_prob
from components.models.base import FlowMatchingModel

if TYPE_CHECKING:
    from components.flowgrpo.config import TrainConfig

# also logged per sampler step, e.g. update/clipfrac/step3: under update/ because MLflow shows metric sections in
# name order, and reward/ must come first
PER_STEP_METRICS = ("policy_loss", "approx_kl", "clipfrac")


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
    rollout: Rollout,
    advantages: torch.Tensor,
    sampler: SamplerSettings,
    generator: torch.Generator,
    optim: Optimization,
    train: TrainConfig,
    guidance_scale: float,
    guard_mean_shift: GuardMeanShift = "sample",
) -> dict[str, float]:
    """Run the inner epochs of FlowGRPO's update (``train``: the `train:` section; ``guidance_scale``: the training
    forward's; ``guard_mean_shift``: train.flow_grpo's, with train.grpo_guard); returns mean metrics.

    Gradients accumulate over all trained timesteps of ``gradient_accumulation_steps`` micro-batches, then
    ``optim`` takes one clipped step, averaged over the data-parallel workers first.
    """
    n_steps = rollout.log_probs.shape[1]
    scale = 1.0 / (n_steps * train.gradient_accumulation_steps)
    trained = 0
    device_advantages = advantages.to(model.device)
    means = MetricMeans()

    model.transformer.train(False)  # dropout off: the training forward must equal the sampling forward
    for _ in range(train.inner_epochs):
        batches = micro_batches(advantages, train.batch_size_per_worker, train.skip_zero_advantage, generator)
        trained += sum(len(b) for b in batches)
        for i, idx in enumerate(batches):
            idx = idx.to(rollout.prompt_index.device)
            cond = rollout.embeds.select(rollout.prompt_index[idx])
            for t in range(n_steps):
                log_prob, mean, std_dev_t = step_log_prob(model, rollout, idx, t, sampler, guidance_scale,
                                                          cond=cond, uncond_grad=train.cfg_uncond_grad)
                ref_mean = None
                if train.beta > 0:
                    with torch.no_grad(), model.adapter_disabled():
                        _, ref_mean, _ = step_log_prob(model, rollout, idx, t, sampler, guidance_scale, cond=cond)
                guard = None
                if train.grpo_guard:
                    sigma, sigma_next = rollout.levels[t]
                    guard = GuardTerms(old_mean=rollout.means[idx, t], dt=sigma - sigma_next,
                                       noise_std=std_dev_t * (sigma - sigma_next) ** 0.5,
                                       mean_shift=guard_mean_shift)
                loss, metrics = flow_grpo_loss(
                    log_prob, rollout.log_probs[idx, t], device_advantages[idx], clip_range=train.clip_range,
                    adv_clip_max=train.adv_clip_max, mean=mean, ref_mean=ref_mean, std_dev_t=std_dev_t,
                    beta=train.beta, guard=guard,
                )
                (loss * scale).backward()
                step = sampler.train_steps[t]
                for k, v in metrics.items():
                    for key in (k, f"update/{k}/step{step}") if k in PER_STEP_METRICS else (k,):
                        means.add(key, v)
            if (i + 1) % train.gradient_accumulation_steps == 0:
                optim.apply(means)
    metrics = means.result()
    metrics["trained_fraction"] = trained / (len(rollout) * train.inner_epochs)
    return metrics


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


@dataclass
class Optimization:
    """What every algorithm's update needs of the trainer: the optimizer over the LoRA ``params``, the optimizer
    steps taken so far, the EMA, and (with data-parallel workers) the gradient average over them."""

    optimizer: torch.optim.Optimizer
    params: list[torch.nn.Parameter]
    max_grad_norm: float
    step: int = 0
    ema: LoRAEMA | None = None
    average_grads: Callable[[list[torch.Tensor]], None] | None = None

    def apply(self, means: MetricMeans) -> None:
        """One optimizer step on the accumulated gradients, averaged over the workers first (when
        ``average_grads``) and clipped to ``max_grad_norm``, then the EMA's; adds the norm before clipping to
        ``means`` as grad_norm."""
        if self.average_grads is not None:
            for p in self.params:  # every worker must reduce the same tensors
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            self.average_grads([p.grad for p in self.params])
        means.add("grad_norm", torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm).detach())
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.ema is not None:
            self.ema.step(self.params, self.step + 1)
        self.step += 1
