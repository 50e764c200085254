"""The shapes world of the embedded demo: coloured circles, squares and triangles on a white background.

One vocabulary serves three users: the pretraining script draws scenes from it, the built-in
``shapes`` prompt set is written in it, and the ``geneval_shapes`` reward parses prompts back into it.
A prompt names one or two groups, e.g. "two red circles and a blue square"; a scene holds at most
``MAX_OBJECTS`` objects, one per cell of a 2 x 2 grid.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
from PIL import Image, ImageDraw

# Saturated, far-apart colours, so colour segmentation of a blurry generated image stays unambiguous.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 160, 50),
    "blue": (30, 70, 220),
    "yellow": (235, 200, 20),
}
BACKGROUND = (255, 255, 255)
SHAPES = ("circle", "square", "triangle")
NUMBERS = {1: "a", 2: "two", 3: "three", 4: "four"}
MAX_OBJECTS = 4
# How far an object's place strays from its cell's centre, as a share of the side (1 px at 48 px). Anywhere in
# the cell (up to 5 px off at 48 px) left the 600k-parameter demo model blending shapes drawn at two places
# into blobs no rule reads: docs/MODELS.md, "The demo model".
JITTER = 1 / 48
VOCABULARY = (*NUMBERS.values(), *COLOURS, *SHAPES, *(s + "s" for s in SHAPES), "and")  # every word of a prompt

_WORD_COUNTS = {"a": 1, "an": 1, "one": 1, "two": 2, "three": 3, "four": 4}
_GROUP = re.compile(r"^(a|an|one|two|three|four) (\w+) (circle|square|triangle)(s?)$")


class PromptParseError(ValueError):
    """The prompt is not in the shapes grammar."""


@dataclass(frozen=True)
class Group:
    count: int
    colour: str
    shape: str

    def text(self) -> str:
        plural = "s" if self.count > 1 else ""
        return f"{NUMBERS[self.count]} {self.colour} {self.shape}{plural}"


def prompt_text(groups: list[Group]) -> str:
    return " and ".join(g.text() for g in groups)


def parse_prompt(prompt: str) -> list[Group]:
    """The groups a prompt asks for; raises ``PromptParseError`` naming the part it cannot read."""
    groups = []
    for part in prompt.strip().lower().rstrip(".").split(" and "):
        match = _GROUP.match(part.strip())
        if match is None:
            raise PromptParseError(f"{part.strip()!r} in {prompt!r} is not '<a|two|three|four> <colour> <shape>'")
        word, colour, shape, plural = match.groups()
        count = _WORD_COUNTS[word]
        if colour not in COLOURS:
            raise PromptParseError(f"unknown colour {colour!r} in {prompt!r}; known: {', '.join(COLOURS)}")
        if (count > 1) != bool(plural):
            raise PromptParseError(f"{part.strip()!r} in {prompt!r}: count and plural disagree")
        groups.append(Group(count, colour, shape))
    if len({(g.colour, g.shape) for g in groups}) != len(groups):
        raise PromptParseError(f"{prompt!r} names the same coloured shape twice")
    return groups


def random_groups(rng: np.random.Generator) -> list[Group]:
    """One or two groups of distinct coloured shapes with at most ``MAX_OBJECTS`` objects in all."""
    kinds = [(c, s) for c in COLOURS for s in SHAPES]
    n_groups = int(rng.integers(1, 3))
    picked = rng.choice(len(kinds), size=n_groups, replace=False)
    counts = [int(rng.integers(1, MAX_OBJECTS + 1))]
    if n_groups == 2:
        counts = [int(rng.integers(1, MAX_OBJECTS)), 0]
        counts[1] = int(rng.integers(1, MAX_OBJECTS - counts[0] + 1))
    return [Group(n, *kinds[int(k)]) for n, k in zip(counts, picked, strict=True)]


def _outline(shape: str, x: float, y: float, size: float) -> list[tuple[float, float]]:
    if shape == "triangle":
        return [(x + size / 2, y), (x + size, y + size), (x, y + size)]
    return [(x, y), (x + size, y + size)]


@dataclass(frozen=True)
class PlacedObject:
    """One object of a drawn scene: its grid cell (0-3, reading order) and its box (left, top, side) in pixels."""

    colour: str
    shape: str
    cell: int
    x: float
    y: float
    size: float


def place_objects(groups: list[Group], rng: np.random.Generator, resolution: int) -> list[PlacedObject]:
    """Where ``draw_scene`` draws ``groups``: each object in its own cell of a 2 x 2 grid, centred in it within
    ``JITTER`` of the side, the cells chosen at random."""
    objects = [g for g in groups for _ in range(g.count)]
    if len(objects) > MAX_OBJECTS:  # the grid has no cell for more; dropping them would draw a wrong scene
        raise ValueError(f"{prompt_text(groups)!r} has {len(objects)} objects; a scene holds at most {MAX_OBJECTS}")
    cell, jitter = resolution / 2, resolution * JITTER
    placed = []
    for group, slot in zip(objects, rng.permutation(MAX_OBJECTS), strict=False):
        size = resolution * rng.uniform(0.26, 0.34)
        margin = (cell - size) / 2
        x = (slot % 2) * cell + margin + rng.uniform(-jitter, jitter)
        y = (slot // 2) * cell + margin + rng.uniform(-jitter, jitter)
        placed.append(PlacedObject(group.colour, group.shape, int(slot), x, y, size))
    return placed


def draw_objects(objects: list[PlacedObject], resolution: int, supersample: int = 4) -> np.ndarray:
    """An RGB uint8 image of ``objects`` on white. Drawn at ``supersample`` times the size and downscaled, so
    edges are anti-aliased like a real image's."""
    big = Image.new("RGB", (resolution * supersample,) * 2, BACKGROUND)
    draw = ImageDraw.Draw(big)
    for obj in objects:
        points = [(px * supersample, py * supersample) for px, py in _outline(obj.shape, obj.x, obj.y, obj.size)]
        fill = COLOURS[obj.colour]
        if obj.shape == "circle":
            draw.ellipse(points, fill=fill)
        elif obj.shape == "square":
            draw.rectangle(points, fill=fill)
        else:
            draw.polygon(points, fill=fill)
    return np.asarray(big.resize((resolution, resolution), Image.Resampling.BOX))


def draw_scene(groups: list[Group], rng: np.random.Generator, resolution: int,
               supersample: int = 4) -> np.ndarray:
    """An RGB uint8 image of ``groups`` placed by ``place_objects``.

    One object per cell keeps objects apart (the reward counts connected regions) and makes layouts few
    enough for a small model to learn in minutes.
    """
    return draw_objects(place_objects(groups, rng, resolution), resolution, supersample)
