"""The edit world of the editing demo: a shapes scene (``scenes``) and an instruction that changes one cell.

Three instructions, each well defined on the scene it is drawn for:
- recolour: "make the blue square red" -- the named object exists and is the only one the words fit;
- remove: "remove the triangle" -- the same;
- add: "add a green circle" -- the scene has a free cell; the object goes to the first free cell in reading
  order (top left, top right, bottom left, bottom right), centred in it at the middle size, so the target is
  one image, not a choice.
An object is named by its shape alone when no other object has that shape, else by colour and shape (the
shortest unambiguous words). Words outside the shapes vocabulary ("make", "the", "remove", "add") are spelled by
the demo models' character-level tokenizers, whose letters every encoder already has (docs/MODELS.md).

``edit_triples`` draws (source, instruction, target) for pretraining and the built-in ``shapes-edit`` set;
``python -m components.shapes.edits`` rewrites components/dataset/builtin/shapes-edit.jsonl.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import math
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from components.shapes.scenes import (
    COLOURS,
    MAX_OBJECTS,
    SHAPES,
    Group,
    PlacedObject,
    PromptParseError,
    draw_objects,
    place_objects,
)

RESOLUTION = 48  # the edit world's drawing size: shapes-sd3's and shapes-kontext's resolution
EDIT_WORDS = ("make", "the", "remove", "add")  # the instruction words the shapes prompts do not use
KINDS = ("recolour", "remove", "add")
ADDED_SIZE = 0.30  # an added object's side as a share of the image: the middle of place_objects' 0.26-0.34
BUILTIN_ROWS = 800
BUILTIN_SEED = 4500  # apart from the pretraining seed, so the built-in set's scenes are not its training scenes
BUILTIN_PATH = Path(__file__).resolve().parents[1] / "dataset" / "builtin" / "shapes-edit.jsonl"

Scene = tuple[PlacedObject, ...]

_NAME = r"(?:(\w+) )?(circle|square|triangle)"
_RECOLOUR = re.compile(rf"^make the {_NAME} (\w+)$")
_REMOVE = re.compile(rf"^remove the {_NAME}$")
_ADD = re.compile(r"^add an? (\w+) (circle|square|triangle)$")


@dataclass(frozen=True)
class Edit:
    """A parsed instruction: ``colour`` None when the object is named by its shape alone; ``new_colour`` for
    recolour, and the added object's colour for add."""

    kind: str
    shape: str
    colour: str | None = None
    new_colour: str | None = None

    def text(self) -> str:
        name = f"{self.colour} {self.shape}" if self.colour else self.shape
        if self.kind == "recolour":
            return f"make the {name} {self.new_colour}"
        if self.kind == "remove":
            return f"remove the {name}"
        return f"add a {self.new_colour} {self.shape}"


def _colour(word: str | None, text: str) -> str | None:
    if word is not None and word not in COLOURS:
        raise PromptParseError(f"unknown colour {word!r} in {text!r}; known: {', '.join(COLOURS)}")
    return word


def parse_instruction(text: str) -> Edit:
    """The edit an instruction asks for; ``PromptParseError`` when it is not in the grammar."""
    clean = text.strip().lower().rstrip(".")
    if match := _RECOLOUR.match(clean):
        colour, shape, new = match.groups()
        return Edit("recolour", shape, _colour(colour, text), _colour(new, text))
    if match := _REMOVE.match(clean):
        colour, shape = match.groups()
        return Edit("remove", shape, _colour(colour, text))
    if match := _ADD.match(clean):
        new, shape = match.groups()
        return Edit("add", shape, new_colour=_colour(new, text))
    raise PromptParseError(f"{text!r} is not 'make the [<colour>] <shape> <colour>', 'remove the [<colour>] <shape>' "
                           "or 'add a <colour> <shape>'")


def _matches(scene: Scene, edit: Edit) -> list[PlacedObject]:
    return [o for o in scene if o.shape == edit.shape and edit.colour in (None, o.colour)]


def free_cells(scene: Scene) -> list[int]:
    taken = {o.cell for o in scene}
    return [c for c in range(MAX_OBJECTS) if c not in taken]


def edited_cell(scene: Scene, edit: Edit) -> int:
    """The grid cell the edit changes; ``PromptParseError`` when the instruction is not well defined on ``scene``
    (no object or several fit its words, a recolour to the same colour, no free cell to add to)."""
    if edit.kind == "add":
        free = free_cells(scene)
        if not free:
            raise PromptParseError(f"{edit.text()!r}: the scene has no free cell")
        return free[0]
    found = _matches(scene, edit)
    if len(found) != 1:
        raise PromptParseError(f"{edit.text()!r} fits {len(found)} objects of the scene; it must name exactly one")
    if edit.kind == "recolour" and found[0].colour == edit.new_colour:
        raise PromptParseError(f"{edit.text()!r}: the object is {edit.new_colour} already")
    return found[0].cell


def apply_edit(scene: Scene, instruction: str | Edit, resolution: int = RESOLUTION) -> Scene:
    """The scene ``instruction`` asks for: every other object where it was, as it was."""
    edit = parse_instruction(instruction) if isinstance(instruction, str) else instruction
    cell = edited_cell(scene, edit)
    if edit.kind == "add":
        half, size = resolution / 2, resolution * ADDED_SIZE
        margin = (half - size) / 2
        added = PlacedObject(edit.new_colour, edit.shape, cell, (cell % 2) * half + margin,
                             (cell // 2) * half + margin, size)
        return tuple(sorted((*scene, added), key=lambda o: o.cell))
    if edit.kind == "remove":
        return tuple(o for o in scene if o.cell != cell)
    return tuple(replace(o, colour=edit.new_colour) if o.cell == cell else o for o in scene)


def cell_box(cell: int, resolution: int = RESOLUTION) -> list[int]:
    """[top, left, bottom, right) of a grid cell in pixels."""
    half = resolution // 2
    top, left = (cell // 2) * half, (cell % 2) * half
    return [top, left, top + half, left + half]


def _name(obj: PlacedObject, scene: Scene) -> str | None:
    """The shortest words that pick ``obj`` out of ``scene`` (None: its colour and shape are not unique)."""
    if sum(o.shape == obj.shape for o in scene) == 1:
        return None
    if sum((o.colour, o.shape) == (obj.colour, obj.shape) for o in scene) == 1:
        return obj.colour
    return ""


def random_edit(rng: np.random.Generator, resolution: int = RESOLUTION) -> tuple[Scene, Edit]:
    """A scene of one to four objects (one to three for add) and an edit well defined on it, each kind equally
    likely."""
    kind = KINDS[int(rng.integers(len(KINDS)))]
    while True:
        count = int(rng.integers(1, MAX_OBJECTS + (0 if kind == "add" else 1)))
        groups = [Group(1, str(rng.choice(list(COLOURS))), str(rng.choice(SHAPES))) for _ in range(count)]
        # positions rounded to 1/100 px, so the metadata redraws the very same image
        scene = tuple(sorted((replace(o, x=round(float(o.x), 2), y=round(float(o.y), 2),
                                      size=round(float(o.size), 2))
                              for o in place_objects(groups, rng, resolution)), key=lambda o: o.cell))
        if kind == "add":
            return scene, Edit("add", str(rng.choice(SHAPES)), new_colour=str(rng.choice(list(COLOURS))))
        named = [(o, _name(o, scene)) for o in scene]
        named = [(o, n) for o, n in named if n != ""]
        if not named:  # every object has a twin: draw another scene
            continue
        obj, colour = named[int(rng.integers(len(named)))]
        if kind == "remove":
            return scene, Edit("remove", obj.shape, colour)
        others = [c for c in COLOURS if c != obj.colour]
        return scene, Edit("recolour", obj.shape, colour, others[int(rng.integers(len(others)))])


def scene_json(scene: Scene) -> list[dict[str, Any]]:
    return [asdict(o) for o in scene]


class SceneError(ValueError):
    """A scene that is not one ``scene_json`` writes."""


def scene_from_json(objects: Any) -> Scene:
    """The scene ``scene_json`` wrote; ``SceneError`` naming what is wrong with anything else (a row's metadata, a
    reward server's client)."""
    if not isinstance(objects, list) or len(objects) > MAX_OBJECTS:
        raise SceneError(f"must be a list of at most {MAX_OBJECTS} objects, got {objects!r:.80}")
    fields = {f.name for f in dataclasses.fields(PlacedObject)}
    for i, o in enumerate(objects):
        if not isinstance(o, dict) or set(o) != fields:
            raise SceneError(f"object {i} must be a mapping of exactly {', '.join(sorted(fields))}, got {o!r:.80}")
        numbers = [o["x"], o["y"], o["size"]]
        if o["colour"] not in COLOURS or o["shape"] not in SHAPES or o["cell"] not in range(MAX_OBJECTS) \
                or isinstance(o["cell"], bool) or not all(isinstance(v, int | float) and not isinstance(v, bool)
                                                          and math.isfinite(v) for v in numbers):
            raise SceneError(f"object {i}: colour one of {', '.join(COLOURS)}, shape one of {', '.join(SHAPES)}, cell "
                             f"0 to {MAX_OBJECTS - 1}, x, y and size finite numbers; got {o!r:.120}")
    return tuple(PlacedObject(**o) for o in objects)


def edit_triples(n: int, seed: int, resolution: int = RESOLUTION
                 ) -> tuple[np.ndarray, list[str], np.ndarray, list[dict[str, Any]]]:
    """``n`` random edits: source images (uint8, N x H x W x 3), instructions, target images, and per row the
    metadata the edit rewards read (``scene``, ``edit``, ``edit_box``: the edited cell, [top, left, bottom,
    right) in pixels, ``resolution``)."""
    rng = np.random.default_rng(seed)
    sources, instructions, targets, metadata = [], [], [], []
    for _ in range(n):
        scene, edit = random_edit(rng, resolution)
        target = apply_edit(scene, edit, resolution)
        sources.append(draw_objects(list(scene), resolution))
        targets.append(draw_objects(list(target), resolution))
        instructions.append(edit.text())
        metadata.append({"scene": scene_json(scene), "edit": {k: v for k, v in asdict(edit).items() if v is not None},
                         "edit_box": cell_box(edited_cell(scene, edit), resolution), "resolution": resolution})
    return np.stack(sources), instructions, np.stack(targets), metadata


def png_data_url(image: np.ndarray) -> str:
    buffer = io.BytesIO()
    Image.fromarray(image).save(buffer, format="PNG", optimize=True)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def builtin_rows(n: int = BUILTIN_ROWS, seed: int = BUILTIN_SEED) -> list[dict[str, Any]]:
    """The rows of the built-in ``shapes-edit`` set: the instruction, the source scene inline, the metadata."""
    sources, instructions, _, metadata = edit_triples(n, seed)
    return [{"prompt": text, "images": [png_data_url(image)], **meta}
            for image, text, meta in zip(sources, instructions, metadata, strict=True)]


def write_builtin(path: Path = BUILTIN_PATH) -> int:
    rows = builtin_rows()
    path.write_text("".join(json.dumps(row, separators=(",", ":")) + "\n" for row in rows))
    return len(rows)


if __name__ == "__main__":
    print(f"wrote {write_builtin()} rows to {BUILTIN_PATH}")
