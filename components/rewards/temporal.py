"""Temporal consistency: how little a video changes from one frame to the next, in [0, 1].

1 - the mean absolute difference of consecutive frames (pixels scaled to [0, 1]), averaged over the video's
frame pairs: a static video scores 1, and reordering the frames of a smooth video lowers the score (its jumps
grow). A rule reward with no model, so the tiny video twin can learn it on CPU; on real models it is a
counterweight to per-frame rewards that a flickering video could satisfy frame by frame.
"""

from __future__ import annotations

from typing import Any, ClassVar

import numpy as np

from components.rewards.base import PointwiseReward, SampleError


class TemporalConsistency(PointwiseReward):
    name = "temporal_consistency"
    video: ClassVar[bool] = True

    def score(self, image: np.ndarray, prompt: str, metadata: dict[str, Any]) -> float:
        if image.ndim != 4 or image.shape[-1] != 3 or image.shape[0] < 2:
            raise SampleError("image", f"expected a video (F, H, W, 3) of at least 2 frames, got shape {image.shape}: "
                                       "temporal_consistency scores videos (a video model with model.num_frames > 1)")
        frames = image.astype(np.float64) / 255.0
        return float(1.0 - np.abs(np.diff(frames, axis=0)).mean())
