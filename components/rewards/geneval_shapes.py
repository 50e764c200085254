"""GenEval for the shapes world: are the objects, counts and colours the prompt asks for in the image?

GenEval runs an object detector and scores an image 1 when every object, count and colour of the prompt is
right and 0 otherwise. Here the detector is rules (``components.shapes.detect``).

Two scores over the multisets W (asked for) and D (found) of (colour, shape) objects:
- ``strict``: 1 if D equals W (every count right, nothing extra), else 0 -- GenEval's score;
- ``partial``: |W ∩ D| / |W ∪ D| (multiset Jaccard), 1 exactly when strict is; it moves with each object
  made right or wrong, a denser signal for RL than all-or-nothing.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from components.rewards.arguments import GenEvalShapesArgs
from components.rewards.base import PointwiseReward, SampleError
from components.shapes.detect import detect_objects
from components.shapes.scenes import PromptParseError, parse_prompt


def object_scores(wanted: Counter, found: Counter) -> tuple[float, float]:
    """(partial, strict) of the wanted and found multisets of (colour, shape)."""
    matched = sum((wanted & found).values())
    union = sum(wanted.values()) + sum(found.values()) - matched
    return matched / union, float(wanted == found)


class GenEvalShapes(PointwiseReward):
    name = "geneval_shapes"
    Args = GenEvalShapesArgs

    def __init__(self, args: GenEvalShapesArgs | None = None) -> None:
        args = GenEvalShapesArgs() if args is None else args
        self.mode = args.mode
        self.min_area_fraction = args.min_area_fraction

    def score(self, image: np.ndarray, prompt: str, metadata: dict[str, Any]) -> float:
        try:
            groups = parse_prompt(prompt)
        except PromptParseError as exc:
            raise SampleError("prompt", str(exc)) from None
        wanted = Counter({(g.colour, g.shape): g.count for g in groups})
        found = Counter((o.colour, o.shape) for o in detect_objects(image, self.min_area_fraction))
        partial, strict = object_scores(wanted, found)
        return partial if self.mode == "partial" else strict
