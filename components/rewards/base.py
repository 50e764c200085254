"""The reward protocol: images in, one score per sample out, failures kept per sample."""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class RewardOutput:
    """One score per sample (NaN where the reward failed) and the failure messages."""

    scores: np.ndarray  # (B,) float64
    errors: list[str | None]
    extra: dict[str, list[Any]] = field(default_factory=dict)

    @property
    def failed(self) -> int:
        return sum(e is not None for e in self.errors)


class Reward(ABC):
    """Scores a batch. ``images`` is uint8 (B, H, W, 3); ``metadata`` has one dict per sample."""

    name: str = ""

    @abstractmethod
    def __call__(self, images: np.ndarray, prompts: list[str], metadata: list[dict[str, Any]]) -> RewardOutput:
        ...


class PointwiseReward(Reward):
    """A reward that scores each image on its own; one failing image does not fail the batch."""

    @abstractmethod
    def score(self, image: np.ndarray, prompt: str, metadata: dict[str, Any]) -> float:
        ...

    def __call__(self, images: np.ndarray, prompts: list[str], metadata: list[dict[str, Any]]) -> RewardOutput:
        scores = np.full(len(images), np.nan)
        errors: list[str | None] = [None] * len(images)
        for i, (image, prompt, meta) in enumerate(zip(images, prompts, metadata, strict=True)):
            try:
                value = float(self.score(image, prompt, meta))
            except Exception as exc:
                errors[i] = f"{type(exc).__name__}: {exc}"
                continue
            if math.isfinite(value):
                scores[i] = value
            else:
                errors[i] = f"non-finite score {value}"
        return RewardOutput(scores=scores, errors=errors)
