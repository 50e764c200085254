"""FlowGRPO (docs/ALGORITHM.md sections 1-6): rollouts with SDE steps sampled by the trained weights, the clipped
policy gradient on their stored transitions, with GRPO-Guard's ratio normalisation. Its knobs are `train:`'s
policy-gradient keys (clip_range, grpo_guard, skip_zero_advantage, cfg_uncond_grad), which the algorithms built on it
share, and its section `train.flow_grpo`; its loss is theirs too (MixGRPO inherits it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from components.algorithms.base import Algorithm, AlgorithmConfig, JobConfig, MicroBatch, Update, register

if TYPE_CHECKING:
    import torch

    from components.flow_rl.rollout import SamplerSettings

# Over what GRPO-Guard averages the mean shift mse = mean((mu - mu_old)^2): each sample's own (the paper's
# formula, Flow-Factory, verl-omni) or the whole micro-batch's (the authors' code); docs/ALGORITHM.md section 6.
GuardMeanShift = Literal["sample", "batch"]

# also logged per sampler step, e.g. update/clipfrac/step3: under update/ because MLflow shows metric sections in
# name order, and reward/ must come first
PER_STEP_METRICS = ("policy_loss", "approx_kl", "clipfrac")


class FlowGRPOConfig(AlgorithmConfig):
    """FlowGRPO's own settings (`train.flow_grpo`), beside `train:`'s shared policy-gradient keys; the algorithms
    built on FlowGRPO (MixGRPO) read them too."""

    guard_mean_shift: GuardMeanShift = Field(
        default="sample",
        description="with train.grpo_guard: over what mse = mean((mu - mu_old)^2) is averaged. sample (default): "
                    "each sample's own, the paper's formula (each log-ratio is exactly mean(eps (mu - mu_old)), "
                    "centred on 0), as Flow-Factory and verl-omni; batch: the micro-batch's, exactly as the authors' "
                    "code (a torch mean over dim=() of a 1-D tensor reduces every dim), which leaves each sample's "
                    "ratio its shift's deviation from the batch's (docs/ALGORITHM.md section 6)",
    )


def _per_sample_mean(x: torch.Tensor) -> torch.Tensor:
    return x.mean(dim=tuple(range(1, x.ndim))) if x.ndim > 1 else x


@dataclass(frozen=True)
class GuardTerms:
    """What GRPO-Guard needs of one stored transition: the rollout's own mean, the step's noise std
    ``s = std_dev_t * sqrt(-dt)``, ``|dt|``, and over what the mean shift is averaged."""

    old_mean: torch.Tensor
    noise_std: torch.Tensor  # (B, 1, ..., 1)
    dt: float  # |sigma_next - sigma|
    mean_shift: GuardMeanShift = "sample"

    def __post_init__(self) -> None:
        if self.mean_shift not in ("sample", "batch"):
            raise ValueError("mean_shift must be 'sample' or 'batch' (train.flow_grpo.guard_mean_shift), "
                             f"got {self.mean_shift!r}")


def guard_log_ratio(log_prob: torch.Tensor, old_log_prob: torch.Tensor, mean: torch.Tensor,
                    guard: GuardTerms) -> torch.Tensor:
    """GRPO-Guard's normalised log-ratio ``s (logp - logp_old) + mean_CHW((mean - old_mean)^2) / (2 s)``, which
    equals ``mean_CHW(eps * (mean - old_mean))`` (``eps`` the step's drawn noise): centred on 0 with the same
    spread at every step, where the plain log-ratio is shifted by ``-mse / (2 s^2)``.

    ``mse`` is each sample's own with ``guard.mean_shift`` "sample"; with "batch" it is the micro-batch's mean, as
    the authors' code computes it (``.mean(dim=())`` on a 1-D log-prob reduces every dim): each sample's log-ratio
    then keeps ``(mse_batch - mse_i) / (2 s)`` of its own shift."""
    s = _per_sample_mean(guard.noise_std.float())
    mse = _per_sample_mean((mean.float() - guard.old_mean.float()) ** 2)
    if guard.mean_shift == "batch":
        mse = mse.mean()
    return s * (log_prob - old_log_prob.detach()) + mse / (2 * s)


def flow_grpo_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_range: float,
    adv_clip_max: float,
    mean: torch.Tensor | None = None,
    ref_mean: torch.Tensor | None = None,
    std_dev_t: torch.Tensor | None = None,
    beta: float = 0.0,
    guard: GuardTerms | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-style clipped loss on per-sample log-probs of one timestep.

    The advantages are clipped to ``[-adv_clip_max, adv_clip_max]`` here, as the authors' GRPO-Guard code,
    Flow-Factory and verl-omni clip them in the loss: the loss is then right whatever its caller passed (an
    unclipped advantage scales its sample's term without bound, most under GRPO-Guard's ``1 / |dt|``), and
    clipping advantages already clipped changes no bit. Refusing out-of-range input instead would need a host
    read of the advantages on every forward.

    ``kl = mean_CHW((mean - ref_mean)**2) / (2 * std_dev_t**2)``, averaged over the
    batch, is added with weight ``beta`` when ``beta > 0``. With ``guard`` (GRPO-Guard)
    the ratio is ``exp(guard_log_ratio)`` and the policy loss is divided by ``|dt|``
    (the KL is not). Metrics are detached.
    """
    import torch

    if not adv_clip_max > 0:
        raise ValueError(f"adv_clip_max must be positive (train.adv_clip_max), got {adv_clip_max}")
    adv = advantages.to(log_prob.dtype).clamp(-adv_clip_max, adv_clip_max)
    if guard is None:
        log_ratio = log_prob - old_log_prob.detach()
    else:
        if mean is None:
            raise ValueError("GRPO-Guard needs the transition's mean")
        log_ratio = guard_log_ratio(log_prob, old_log_prob, mean, guard)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    policy_loss = torch.maximum(unclipped, clipped).mean()
    if guard is not None:
        policy_loss = policy_loss / guard.dt

    if beta > 0:
        if mean is None or ref_mean is None or std_dev_t is None:
            raise ValueError("beta > 0 needs mean, ref_mean and std_dev_t")
        std = _per_sample_mean(std_dev_t.float())
        kl = (_per_sample_mean((mean.float() - ref_mean.float()) ** 2) / (2 * std**2)).mean()
    else:
        kl = torch.zeros((), dtype=policy_loss.dtype, device=policy_loss.device)
    loss = policy_loss + beta * kl

    with torch.no_grad():
        metrics = {
            "policy_loss": policy_loss.detach(),
            "kl": kl.detach(),
            "approx_kl": 0.5 * (log_ratio.detach() ** 2).mean(),
            "clipfrac": ((ratio - 1.0).abs() > clip_range).float().mean(),
            "clipfrac_high": (ratio > 1.0 + clip_range).float().mean(),
            "clipfrac_low": (ratio < 1.0 - clip_range).float().mean(),
            "ratio_mean": ratio.detach().mean(),
        }
    return loss, metrics


@register("flow_grpo")
class FlowGRPO(Algorithm):
    name = "FlowGRPO"
    Config = FlowGRPOConfig

    @classmethod
    def check(cls, config: JobConfig) -> list[str]:
        if config.train.grpo_guard and config.sampling.sde_type not in ("sde", "dance"):
            raise ValueError("train.grpo_guard normalises the ratio of the SDE step's Gaussian: it needs "
                             f"sampling.sde_type sde or dance (got {config.sampling.sde_type})")
        if config.train.flow_grpo.guard_mean_shift != "sample" and not config.train.grpo_guard:
            return ["train.flow_grpo.guard_mean_shift is not used: train.grpo_guard is false"]
        return []

    def sampler_settings(self, generator: torch.Generator, epoch: int) -> SamplerSettings:
        import torch

        from components.flow_rl.rollout import plan_steps

        s = self.config.sampling
        window = None
        if s.sde_window is not None:  # once per epoch, for every sample of it (upstream: once per sampling batch)
            lo, hi = s.sde_window.range
            size = s.sde_window.size
            window = (int(torch.randint(lo, hi - size + 1, (1,), generator=generator)), size)
        sde_steps, train_steps = plan_steps(s.num_steps, self.config.train.timestep_fraction, window)
        return self._sampler(sde_steps, train_steps)

    def prepare(self, update: Update, indices: torch.Tensor) -> MicroBatch:
        return MicroBatch(update, indices, terms=range(update.rollout.log_probs.shape[1]))  # its trained steps

    def loss(self, batch: MicroBatch, term: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The clipped policy gradient on the stored transition of trained step ``term`` (section 6), with the KL
        to the base model under train.beta and GRPO-Guard's ratio under train.grpo_guard."""
        import torch

        from components.flow_rl.rollout import step_log_prob

        update, train, model = batch.update, self.config.train, self.model
        rollout, sampler, t = update.rollout, update.sampler, term
        log_prob, mean, std_dev_t = step_log_prob(model, rollout, batch.rows, t, sampler, update.guidance,
                                                  cond=batch.cond, uncond_grad=train.cfg_uncond_grad)
        ref_mean = None
        if train.beta > 0:
            with torch.no_grad(), model.adapter_disabled():
                _, ref_mean, _ = step_log_prob(model, rollout, batch.rows, t, sampler, update.guidance,
                                               cond=batch.cond)
        guard = None
        if train.grpo_guard:
            sigma, sigma_next = rollout.levels[t]
            guard = GuardTerms(old_mean=rollout.means[batch.rows, t], dt=sigma - sigma_next,
                               noise_std=std_dev_t * (sigma - sigma_next) ** 0.5,
                               mean_shift=train.flow_grpo.guard_mean_shift)
        loss, metrics = flow_grpo_loss(
            log_prob, rollout.log_probs[batch.rows, t], batch.advantages, clip_range=train.clip_range,
            adv_clip_max=train.adv_clip_max, mean=mean, ref_mean=ref_mean, std_dev_t=std_dev_t, beta=train.beta,
            guard=guard,
        )
        step = sampler.train_steps[t]
        return loss, {key: value for k, value in metrics.items()
                      for key in ((k, f"update/{k}/step{step}") if k in PER_STEP_METRICS else (k,))}
