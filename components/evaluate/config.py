"""How a trained LoRA is evaluated and when it is promoted."""

from __future__ import annotations

from pydantic import Field

from components.config_base import Section, Seed


class GateConfig(Section):
    metric: str | None = Field(
        default=None, description="eval reward key that must improve; null = the first eval reward",
    )
    min_improvement: float = Field(
        default=0.0, description="the lower bound of the gate metric's CI of LoRA - base must be above this; "
        "0 = the whole interval above zero",
    )
    guards: dict[str, float] = Field(
        default_factory=dict, description="eval reward key -> the largest drop (base - LoRA) it may show",
    )
    alias: str = Field(default="candidate", min_length=1, description="MLflow alias set on a promoted version")


class EvalConfig(Section):
    images_per_prompt: int = Field(default=2, ge=1, le=64, description="images per prompt, each model")
    seed: Seed = Field(default=1000, description="prompt i is sampled with seed + i, for base and LoRA alike")
    max_prompts: int | None = Field(default=16, ge=1, description="evaluate at most this many prompts; null = all")
    bootstrap_samples: int = Field(
        default=2000, ge=100, le=100_000,  # numpy draws samples x prompts indices at once
        description="resamples for the confidence intervals",
    )
    ci_level: float = Field(default=0.95, gt=0, lt=1)
    gate: GateConfig = Field(default_factory=GateConfig)
