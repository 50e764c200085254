"""Score a batch with several rewards and combine them (FLOWGRPO.md section 5)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from components.rewards.base import Reward, RewardOutput
from components.rewards.config import RewardSpec
from components.rewards.registry import build_reward


@dataclass
class RewardSet:
    """The configured rewards, keyed by name (unique, checked by the config), with their weights."""

    rewards: dict[str, Reward]
    weights: dict[str, float]

    @classmethod
    def from_specs(cls, specs: list[RewardSpec], where: str = "rewards") -> RewardSet:
        rewards, weights = {}, {}
        for i, spec in enumerate(specs):
            rewards[spec.name] = build_reward(spec, where=f"{where}.{i}")
            weights[spec.name] = spec.weight
        return cls(rewards, weights)

    def score(
        self, images: np.ndarray, prompts: list[str], metadata: list[dict[str, Any]]
    ) -> dict[str, RewardOutput]:
        """``images``: uint8 (B, H, W, 3). Returns each reward's output."""
        return {name: reward(images, prompts, metadata) for name, reward in self.rewards.items()}

    def combine(self, outputs: dict[str, RewardOutput]) -> np.ndarray:
        """Weighted sum per sample; NaN where any reward failed."""
        return sum(self.weights[name] * out.scores for name, out in outputs.items())
