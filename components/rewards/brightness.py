"""Brightness: mean luma of the image in [0, 1] (ITU-R BT.601 weights).

A rule reward for exposure control (brighter or, with a negative weight, darker
images). It reads a global pixel statistic, so it responds to small policy
changes; that makes it the reward of the embedded CPU default, where a random
tiny model must show learning in minutes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from components.rewards.base import PointwiseReward

LUMA = np.array([0.299, 0.587, 0.114])


class Brightness(PointwiseReward):
    name = "brightness"

    def score(self, image: np.ndarray, prompt: str, metadata: dict[str, Any]) -> float:
        if image.ndim != 3 or image.shape[-1] != 3:
            raise ValueError(f"expected an RGB image (H, W, 3), got shape {image.shape}")
        return float((image.astype(np.float64) @ LUMA).mean() / 255.0)
