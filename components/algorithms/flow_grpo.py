"""FlowGRPO (docs/ALGORITHM.md sections 1-6): rollouts with SDE steps sampled by the trained weights, the clipped
policy gradient on their stored transitions. Its knobs are `train:`'s policy-gradient keys (clip_range,
grpo_guard, skip_zero_advantage, cfg_uncond_grad), which the algorithms built on it share."""

from __future__ import annotations

from typing import TYPE_CHECKING

from components.algorithms.base import Algorithm, AlgorithmConfig, JobConfig, register

if TYPE_CHECKING:
    import torch

    from components.flowgrpo.rollout import Rollout, SamplerSettings
    from components.flowgrpo.update import Optimization


class FlowGRPOConfig(AlgorithmConfig):
    """FlowGRPO reads `train:`'s shared policy-gradient keys; it has no section of its own yet."""


@register("flow_grpo")
class FlowGRPO(Algorithm):
    name = "FlowGRPO"
    Config = FlowGRPOConfig

    @classmethod
    def check(cls, config: JobConfig) -> list[str]:
        if config.train.grpo_guard and config.sampling.sde_type not in ("sde", "dance"):
            raise ValueError("train.grpo_guard normalises the ratio of the SDE step's Gaussian: it needs "
                             f"sampling.sde_type sde or dance (got {config.sampling.sde_type})")
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
                             self.training_guidance())
