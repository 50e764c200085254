"""FlowGRPO (docs/ALGORITHM.md sections 1-6): rollouts with SDE steps sampled by the trained weights, the clipped
policy gradient on their stored transitions. Its knobs are `train:`'s policy-gradient keys (clip_range,
grpo_guard, skip_zero_advantage, cfg_uncond_grad), which the algorithms built on it share, and its section
`train.flow_grpo`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from components.algorithms.base import Algorithm, AlgorithmConfig, JobConfig, MicroBatch, Update, register

if TYPE_CHECKING:
    import torch

    from components.flowgrpo.rollout import SamplerSettings

# also logged per sampler step, e.g. update/clipfrac/step3: under update/ because MLflow shows metric sections in
# name order, and reward/ must come first
PER_STEP_METRICS = ("policy_loss", "approx_kl", "clipfrac")


class FlowGRPOConfig(AlgorithmConfig):
    """FlowGRPO's own settings (`train.flow_grpo`), beside `train:`'s shared policy-gradient keys; the algorithms
    built on FlowGRPO (MixGRPO) read them too."""

    guard_mean_shift: Literal["sample", "batch"] = Field(
        default="sample",
        description="with train.grpo_guard: over what mse = mean((mu - mu_old)^2) is averaged. sample (default): "
                    "each sample's own, the paper's formula (each log-ratio is exactly mean(eps (mu - mu_old)), "
                    "centred on 0), as Flow-Factory and verl-omni; batch: the micro-batch's, exactly as the authors' "
                    "code (a torch mean over dim=() of a 1-D tensor reduces every dim), which leaves each sample's "
                    "ratio its shift's deviation from the batch's (docs/ALGORITHM.md section 6)",
    )


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

        from components.flowgrpo.rollout import plan_steps

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

        from components.flowgrpo.loss import GuardTerms, flow_grpo_loss
        from components.flowgrpo.rollout import step_log_prob

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
