"""The rule reward of the shapes editing demo: was the edit made, and did nothing else change?

The row's metadata holds the source scene (``scene``, as ``components.shapes.edits.edit_triples`` writes it) and the
prompt is the instruction; ``apply_edit`` gives the target scene. The shapes detector (``components.shapes.detect``)
reads the result, and each object found goes to the grid cell of its box's centre. Over the multisets of (cell,
colour, shape) wanted and found:
- ``edit``: multiset Jaccard within the edited cell (1 when both are empty: a removal that left it blank);
- ``keep``: multiset Jaccard over the other cells -- an object lost, recoloured, reshaped or added there costs;
- ``partial`` = edit x keep: 0 for an input left as it was, 1 for the target, and between them the share of the
  rest kept, so an edit that also damages another object scores less than a clean one;
- ``strict``: 1 when the objects found equal the target's, cell by cell (GenEval's all-or-nothing), else 0.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from components.rewards.arguments import ShapesEditArgs
from components.rewards.base import PointwiseReward, SampleError
from components.rewards.geneval_shapes import object_scores
from components.shapes.detect import DetectedObject, detect_objects
from components.shapes.edits import SceneError, apply_edit, edited_cell, parse_instruction, scene_from_json
from components.shapes.scenes import MAX_OBJECTS, PromptParseError


def cell_of(obj: DetectedObject, height: int, width: int) -> int:
    """The 2 x 2 grid cell (reading order) of the centre of ``obj``'s box."""
    top, left, bottom, right = obj.bbox
    return 2 * int(top + bottom >= height) + int(left + right >= width)


def _jaccard(wanted: Counter, found: Counter) -> float:
    return object_scores(wanted, found)[0] if wanted or found else 1.0


def edit_scores(image: np.ndarray, scene: list[dict[str, Any]], instruction: str,
                min_area_fraction: float = 0.01) -> tuple[float, float, float]:
    """(edit, keep, strict) of an edited image, as the module docstring defines them."""
    source = scene_from_json(scene)
    edit = parse_instruction(instruction)
    cell = edited_cell(source, edit)
    wanted = Counter((o.cell, o.colour, o.shape) for o in apply_edit(source, edit))
    found = Counter((cell_of(o, *image.shape[:2]), o.colour, o.shape)
                    for o in detect_objects(image, min_area_fraction))
    inside = [c == cell for c in range(MAX_OBJECTS)]

    def part(counter: Counter, edited: bool) -> Counter:
        return Counter({k: v for k, v in counter.items() if inside[k[0]] == edited})

    return (_jaccard(part(wanted, True), part(found, True)), _jaccard(part(wanted, False), part(found, False)),
            float(wanted == found))


class ShapesEdit(PointwiseReward):
    name = "shapes_edit"
    Args = ShapesEditArgs

    def __init__(self, args: ShapesEditArgs | None = None) -> None:
        args = ShapesEditArgs() if args is None else args
        self.mode = args.mode
        self.min_area_fraction = args.min_area_fraction

    def score(self, image: np.ndarray, prompt: str, metadata: dict[str, Any]) -> float:
        if "scene" not in metadata:
            raise SampleError("metadata.scene", "shapes_edit reads the source scene from the row's metadata.scene "
                                                "(the rows of builtin:shapes-edit carry it); this row has none")
        try:
            edit, keep, strict = edit_scores(image, metadata["scene"], prompt, self.min_area_fraction)
        except SceneError as exc:
            raise SampleError("metadata.scene", str(exc)) from None
        except PromptParseError as exc:  # an instruction outside the grammar, or not well defined on the scene
            raise SampleError("prompt", str(exc)) from None
        return edit * keep if self.mode == "partial" else strict
