"""The GenEval-style shapes reward on drawn images whose contents are known, and the prompt grammar."""

from collections import Counter

import numpy as np
import pytest
from PIL import Image, ImageDraw
from scipy.ndimage import gaussian_filter

from components.errors import ConfigError
from components.rewards.arguments import GenEvalShapesArgs
from components.rewards.geneval_shapes import GenEvalShapes
from components.rewards.registry import RewardSpec, build_reward
from components.shapes.detect import detect_objects
from components.shapes.scenes import (
    COLOURS,
    SHAPES,
    Group,
    PromptParseError,
    draw_scene,
    parse_prompt,
    prompt_text,
    random_groups,
)
from components.trainer.config import TrainingJobConfig


def _found(image: np.ndarray, **kwargs) -> Counter:
    return Counter((o.colour, o.shape) for o in detect_objects(image, **kwargs))


def _wanted(groups: list[Group]) -> Counter:
    return Counter({(g.colour, g.shape): g.count for g in groups})


def _degraded(image: np.ndarray, rng: np.random.Generator, wash: float = 0.0) -> np.ndarray:
    """What a small diffusion model's decoder leaves: soft edges (blur sigma 0.7 px), pixel noise (std 8) and,
    with ``wash``, colours that fade that far towards white."""
    pixels = 255 - (255 - image.astype(np.float64)) * (1 - wash)
    soft = gaussian_filter(pixels, sigma=(0.7, 0.7, 0)) + rng.normal(0, 8, image.shape)
    return np.clip(soft, 0, 255).astype(np.uint8)


def _by_hand(objects: list[tuple[str | tuple[int, int, int], str, tuple[int, int, int, int]]],
             size: int = 48) -> np.ndarray:
    """Shapes drawn directly with PIL at exact boxes (x, y, width, height), independent of draw_scene."""
    image = Image.new("RGB", (size, size), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    for colour, shape, (x, y, w, h) in objects:
        fill = COLOURS[colour] if isinstance(colour, str) else colour
        if shape == "square":
            draw.rectangle([x, y, x + w - 1, y + h - 1], fill=fill)
        elif shape == "circle":
            draw.ellipse([x, y, x + w - 1, y + h - 1], fill=fill)
        else:
            draw.polygon([(x + w / 2, y), (x + w - 1, y + h - 1), (x, y + h - 1)], fill=fill)
    return np.asarray(image)


def _read_back(resolution: int, seed: int, degrade: bool, n: int = 200, wash: float = 0.0) -> int:
    rng = np.random.default_rng(seed)
    right = 0
    for _ in range(n):
        groups = random_groups(rng)
        image = draw_scene(groups, rng, resolution)
        if degrade:
            image = _degraded(image, rng, wash)
        right += _found(image) == _wanted(groups)
    return right


@pytest.mark.parametrize("resolution", [32, 48, 64])
def test_every_drawn_scene_is_read_back_exactly(resolution):
    right = _read_back(resolution, seed=resolution, degrade=False)
    assert right == 200, f"{right}/200 clean scenes read back at {resolution} px"


@pytest.mark.parametrize("resolution", [32, 48, 64])
def test_blurred_noisy_scenes_are_still_read_back(resolution):
    right = _read_back(resolution, seed=resolution + 1, degrade=True, n=100)
    # measured: 1000/1000 scenes at each size (the sizes' smallest shapes, 8 px at 32, included)
    assert right >= 98, f"{right}/100 blurred, noisy scenes read back at {resolution} px"


def test_washed_out_colours_are_still_their_colour():
    right = _read_back(48, seed=5, degrade=True, n=50, wash=0.3)
    assert right >= 49, f"{right}/50 washed-out scenes read back"  # measured: 300/300


@pytest.mark.parametrize("colour", list(COLOURS))
@pytest.mark.parametrize("shape", SHAPES)
def test_each_colour_and_shape_alone(colour, shape):
    for x, y, side in [(16, 16, 13), (3, 27, 15), (30, 4, 11)]:
        image = _by_hand([(colour, shape, (x, y, side, side))])
        assert _found(image) == Counter({(colour, shape): 1}), (x, y, side)


def test_what_is_no_object_of_the_world():
    mixed = _by_hand([((228, 115, 25), "square", (16, 16, 14, 14))])  # orange: half red, half yellow
    assert _found(mixed) == Counter()
    speck = _by_hand([("red", "square", (20, 20, 4, 4))])  # 16 px: under 1% of the image
    assert _found(speck) == Counter() and _found(speck, min_area_fraction=0.0) == Counter({("red", "square"): 1})
    bar = _by_hand([("blue", "square", (8, 18, 28, 14))])  # 2:1, unlike any shape drawn: an extra object
    assert _found(bar) == Counter({("blue", "unknown"): 1})


def _scores(image: np.ndarray, prompt: str) -> tuple[float, float]:
    partial = GenEvalShapes(GenEvalShapesArgs(mode="partial"))(image[None], [prompt], [{}])
    strict = GenEvalShapes(GenEvalShapesArgs(mode="strict"))(image[None], [prompt], [{}])
    assert partial.errors == strict.errors == [None]
    return float(partial.scores[0]), float(strict.scores[0])


TWO_RED_CIRCLES = [("red", "circle", (4, 4, 12, 12)), ("red", "circle", (28, 6, 12, 12))]


def test_scores_follow_the_multiset_jaccard_and_all_or_nothing():
    two = _by_hand(TWO_RED_CIRCLES)
    assert _scores(two, "two red circles") == (1.0, 1.0)
    assert _scores(two, "three red circles") == pytest.approx((2 / 3, 0.0))  # 2 matched of 3 wanted
    assert _scores(two, "a red circle") == pytest.approx((1 / 2, 0.0))  # 1 matched, 1 extra
    extra = _by_hand([*TWO_RED_CIRCLES, ("blue", "square", (16, 30, 12, 12))])
    assert _scores(extra, "three red circles") == pytest.approx((2 / 4, 0.0))  # union: 3 wanted + 1 extra
    assert _scores(extra, "two red circles and a blue square") == (1.0, 1.0)
    assert _scores(extra, "two red circles and a blue triangle") == pytest.approx((2 / 4, 0.0))
    assert _scores(extra, "a green triangle") == (0.0, 0.0)
    assert _scores(np.full((48, 48, 3), 255, np.uint8), "a red circle") == (0.0, 0.0)


def test_the_wrong_colour_or_shape_is_not_credited():
    image = _by_hand([("blue", "circle", (16, 16, 14, 14))])
    assert _scores(image, "a red circle") == (0.0, 0.0)
    assert _scores(image, "a blue square") == (0.0, 0.0)
    assert _scores(image, "a blue circle") == (1.0, 1.0)


def test_a_prompt_outside_the_grammar_fails_that_sample_only_and_names_it():
    images = np.stack([_by_hand(TWO_RED_CIRCLES)] * 2)
    out = GenEvalShapes()(images, ["two red circles", "a purple hexagon"], [{}, {}])
    assert out.scores[0] == 1.0 and np.isnan(out.scores[1])
    assert out.errors[0] is None and "a purple hexagon" in out.errors[1]


def test_mode_and_input_are_checked():
    loose = r"rewards\.0\.args\.mode: Input should be 'partial' or 'strict' \(got 'loose'\)"
    with pytest.raises(ConfigError, match=loose):
        TrainingJobConfig.from_sections({"rewards": [{"name": "geneval_shapes", "args": {"mode": "loose"}}]}, "test")
    with pytest.raises(ValueError, match="RGB"):
        detect_objects(np.zeros((48, 48), np.uint8))
    out = GenEvalShapes()(np.zeros((1, 48, 48, 4), np.uint8), ["a red circle"], [{}])
    assert np.isnan(out.scores[0]) and "RGB" in out.errors[0]


def test_it_is_a_registered_reward():
    reward = build_reward(RewardSpec(name="geneval_shapes", args={"mode": "strict"}))
    assert isinstance(reward, GenEvalShapes) and reward.mode == "strict"


def test_prompts_round_trip_through_the_grammar():
    rng = np.random.default_rng(0)
    for _ in range(300):
        groups = random_groups(rng)
        assert sum(g.count for g in groups) <= 4
        assert parse_prompt(prompt_text(groups)) == groups
    assert parse_prompt("Two red circles and a blue square.") == [Group(2, "red", "circle"), Group(1, "blue", "square")]


@pytest.mark.parametrize("prompt, needle", [
    ("two red circle", "count and plural disagree"),
    ("a purple circle", "unknown colour 'purple'"),
    ("a red circle and a red circle", "names the same coloured shape twice"),
    ("a red hexagon", "is not '<a|two|three|four> <colour> <shape>'"),
])
def test_bad_prompts_are_refused_saying_why(prompt, needle):
    with pytest.raises(PromptParseError, match=needle):
        parse_prompt(prompt)


def test_a_scene_with_more_objects_than_cells_is_refused():
    with pytest.raises(ValueError, match="at most 4"):
        draw_scene([Group(4, "red", "circle"), Group(1, "blue", "square")], np.random.default_rng(0), 48)
