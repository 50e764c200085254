"""MixGRPO (docs/ALGORITHM.md section 12): FlowGRPO whose SDE steps, and so its policy gradient, lie only on a
window of consecutive denoising steps that slides from the noisiest steps towards the clean ones as training goes
on; every other step is an ODE step, after the window optionally by DPM-Solver++(2M) on fewer steps (MixGRPO-Flash)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from components.algorithms.base import AlgorithmConfig, JobConfig, register
from components.algorithms.flow_grpo import FlowGRPO

if TYPE_CHECKING:
    import torch

    from components.flow_rl.rollout import SamplerSettings

MAX_EPOCHS = 1_000_000
# the window stays below the last two steps: upstream trains none of them (max_timesteps = sampling_steps - 2)
UNTRAINED_TAIL = 2


class MixGRPOConfig(AlgorithmConfig):
    """MixGRPO's own settings (`train.mix_grpo`): its window. The policy gradient's are FlowGRPO's, in `train:` and
    `train.flow_grpo`, which MixGRPO reads as FlowGRPO does."""

    window_size: int = Field(default=4, ge=1, le=1000, description="consecutive SDE (and trained) steps")
    shift_interval: int = Field(default=25, ge=1, le=MAX_EPOCHS,
                                description="epochs the window stays before it moves (upstream iters_per_group: "
                                            "one of its training steps samples and trains once, as our epoch)")
    stride: int = Field(default=1, ge=0, le=1000,
                        description="steps the window moves each time; 0 keeps it on the first steps "
                                    "(upstream prog_overlap_step)")
    ode_solver: Literal["euler", "dpm2"] = Field(
        default="euler", description="the ODE steps after the window: euler (MixGRPO) or dpm2, DPM-Solver++(2M) "
                                     "(MixGRPO-Flash); those before it are Euler either way")
    tail_ratio: float = Field(default=1.0, gt=0, le=1,
                              description="the fraction of the schedule's points after the window that the ODE "
                                          "steps there visit: fewer forwards (upstream dpm_post_compress_ratio; "
                                          "Flash 0.4)")


def _reach(num_steps: int) -> int:
    if num_steps <= UNTRAINED_TAIL:
        raise ValueError(f"MixGRPO's window needs sampling.num_steps >= {UNTRAINED_TAIL + 1}, got {num_steps}")
    return num_steps - UNTRAINED_TAIL


def window_steps(epoch: int, num_steps: int, size: int, stride: int, shift_interval: int) -> tuple[int, ...]:
    """The window's steps at ``epoch``: it starts on step 0, moves ``stride`` steps every ``shift_interval`` epochs,
    is cut at ``num_steps - UNTRAINED_TAIL`` and starts over on step 0 when it would begin there."""
    reach = _reach(num_steps)
    positions = 1 if stride == 0 else (reach - 1) // stride + 1
    start = (epoch // shift_interval) % positions * stride
    return tuple(range(start, min(start + size, reach)))


@register("mix_grpo")
class MixGRPO(FlowGRPO):
    name = "MixGRPO"
    Config = MixGRPOConfig

    @classmethod
    def check(cls, config: JobConfig) -> list[str]:
        notes = super().check(config)
        _reach(config.sampling.num_steps)
        if config.sampling.sde_window is not None:
            notes.append("sampling.sde_window is not used: MixGRPO's window is train.mix_grpo's")
        return notes

    def sampler_settings(self, generator: torch.Generator, epoch: int) -> SamplerSettings:
        m = self.section
        steps = window_steps(epoch, self.config.sampling.num_steps, m.window_size, m.stride, m.shift_interval)
        return self._sampler(steps, steps, ode_solver=m.ode_solver, tail_ratio=m.tail_ratio)
