"""Config of one reward and of how several are combined."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from components.config_base import Section

Aggregation = Literal["sum", "gdpo"]


class RewardSpec(Section):
    name: str = Field(min_length=1, description="registered reward name")
    weight: float = Field(default=1.0, description="weight in the combined reward (FLOWGRPO.md section 5)")
    args: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of the reward")
