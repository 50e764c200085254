"""FlowGRPO (docs/ALGORITHM.md sections 1-6): rollouts with SDE steps sampled by the trained weights, the clipped
policy gradient on their stored transitions. Its knobs are `train:`'s policy-gradient keys (clip_range,
grpo_guard, skip_zero_advantage, cfg_uncond_grad), which the algorithms built on it share, and its section
`train.flow_grpo`."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from components.algorithms.base import Algorithm, AlgorithmConfig, JobConfig, register, section_of

if TYPE_CHECKING:
    import torch

    from components.flowgrpo.rollout import Rollout, SamplerSettings
    from components.flowgrpo.update import Optimization


class FlowGRPOConfig(AlgorithmConfig):
    """FlowGRPO's own settings (`train.flow_grpo`), beside `train:`'s shared policy-gradient keys."""

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
        if section_of(config).guard_mean_shift != "sample" and not config.train.grpo_guard:
            return [f"train.{cls.key}.guard_mean_shift is not used: train.grpo_guard is false"]
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

    def update(self, rollout: Rollout, advantages: torch.Tensor, sampler: SamplerSettings,
               generator: torch.Generator, optim: Optimization) -> dict[str, float]:
        from components.flowgrpo.update import policy_update

        return policy_update(self.model, rollout, advantages, sampler, generator, optim, self.config.train,
                             self.training_guidance(), guard_mean_shift=self.section.guard_mean_shift)
