"""Edit consistency: how much of the input image that the instruction did not ask to change the result keeps.

1 - the mean absolute difference between the result and the input (pixels scaled to [0, 1], over the channels)
outside the region the edit may change: ``metadata.edit_box`` ([top, left, bottom, right) in the input's pixels,
widened by ``margin`` of the side). The input is first brought to the result's size as the model saw it (centre
square, resized), and the box with it. A row without ``edit_box`` is compared over the whole image: the score then
says how close the result stays to the input at all, which an unedited copy maximises -- weigh it with a reward for
following the instruction (``shapes_edit``, ``vlm_judge``). Needs no model: a counterweight to instruction rewards
an image redrawn from scratch could satisfy.
"""

from __future__ import annotations

import math
from numbers import Real
from typing import Any, ClassVar

import numpy as np
from PIL import Image

from components.rewards.arguments import EditConsistencyArgs
from components.rewards.base import PointwiseReward, SampleError


def edit_box(value: Any) -> list[float] | None:
    """``metadata.edit_box`` checked: None, or [top, left, bottom, right) as four finite numbers with top < bottom
    and left < right; a SampleError naming the field otherwise (a sample's metadata comes from its caller)."""
    if value is None:
        return None
    numbers = isinstance(value, list | tuple) and len(value) == 4 and all(
        isinstance(v, Real) and not isinstance(v, bool) and math.isfinite(v) for v in value)
    if not numbers or not (value[0] < value[2] and value[1] < value[3]):
        raise SampleError("metadata.edit_box", f"must be [top, left, bottom, right] in the input's pixels, four "
                                               f"finite numbers with top < bottom and left < right; got {value!r:.80}")
    return [float(v) for v in value]


def _as_result(source: np.ndarray, side: int, box: list[float] | None) -> tuple[np.ndarray, list[float] | None]:
    """The input's centre square at ``side`` px, and ``box`` in that square's pixels."""
    height, width = source.shape[:2]
    crop = min(height, width)
    top, left = (height - crop) // 2, (width - crop) // 2
    square = source[top:top + crop, left:left + crop]
    if crop != side:
        square = np.asarray(Image.fromarray(np.ascontiguousarray(square)).resize((side, side), Image.LANCZOS))
    if box is None:
        return square, None
    scale = side / crop
    return square, [(box[0] - top) * scale, (box[1] - left) * scale, (box[2] - top) * scale, (box[3] - left) * scale]


def consistency(result: np.ndarray, source: np.ndarray, box: list[float] | None = None, margin: float = 0.0) -> float:
    """1 - mean |result - source| / 255 over the pixels outside ``box`` (widened by ``margin`` x the side)."""
    if result.ndim != 3 or result.shape[0] != result.shape[1] or result.shape[-1] != 3:
        raise SampleError("image", f"expected a square RGB result (S, S, 3), got shape {result.shape}")
    side, given = result.shape[0], box
    source, box = _as_result(source, side, box)
    keep = np.ones((side, side), dtype=bool)
    if box is not None:
        pad = margin * side
        # clipped to the image before rounding: a box far past it (1e308 x a scale) must not overflow int()
        top, left = (math.floor(min(max(v - pad, 0), side)) for v in box[:2])
        bottom, right = (math.ceil(min(max(v + pad, 0), side)) for v in box[2:])
        keep[top:bottom, left:right] = False
    if not keep.any():
        raise SampleError("metadata.edit_box", f"{given} (margin {margin}) covers the whole image: nothing is left to "
                                               "compare")
    diff = np.abs(result.astype(np.float64) - source.astype(np.float64)).mean(-1) / 255.0
    return float(1.0 - diff[keep].mean())


class EditConsistency(PointwiseReward):
    name = "edit_consistency"
    Args = EditConsistencyArgs
    inputs: ClassVar[bool] = True

    def __init__(self, args: EditConsistencyArgs | None = None) -> None:
        self.margin = (EditConsistencyArgs() if args is None else args).margin

    def score(self, image: np.ndarray, prompt: str, metadata: dict[str, Any], inputs: list[np.ndarray]) -> float:
        if not inputs:
            raise SampleError("inputs", "edit_consistency compares the result with its input image, and this sample "
                                        "has none (rows need `images`)")
        return consistency(image, inputs[0], edit_box(metadata.get("edit_box")), self.margin)
