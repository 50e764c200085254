"""The shapes edit world and its rewards, on scenes drawn by hand whose answer is known by construction."""

import json

import numpy as np
import pytest
from PIL import Image, ImageDraw
from scipy.ndimage import gaussian_filter

from components.dataset.config import BUILTIN_KINDS
from components.rewards.arguments import EditConsistencyArgs, ShapesEditArgs
from components.rewards.base import SampleError
from components.rewards.edit_consistency import EditConsistency, consistency
from components.rewards.registry import RewardSpec, build_reward
from components.rewards.shapes_edit import ShapesEdit, edit_scores
from components.shapes.edits import (
    BUILTIN_PATH,
    BUILTIN_ROWS,
    EDIT_WORDS,
    apply_edit,
    builtin_rows,
    edit_triples,
    parse_instruction,
    scene_from_json,
)
from components.shapes.scenes import COLOURS, VOCABULARY, PromptParseError, draw_objects

# cell -> the left, top corner of a 15 px object centred in that cell of a 48 px image
CORNERS = {0: (4, 4), 1: (28, 4), 2: (4, 28), 3: (28, 28)}


def _by_hand(objects: dict[int, tuple[str, str]], size: int = 15) -> np.ndarray:
    """{cell: (colour, shape)} drawn directly with PIL, independent of draw_objects."""
    image = Image.new("RGB", (48, 48), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    for cell, (colour, shape) in objects.items():
        x, y = CORNERS[cell]
        box = [x, y, x + size - 1, y + size - 1]
        if shape == "square":
            draw.rectangle(box, fill=COLOURS[colour])
        elif shape == "circle":
            draw.ellipse(box, fill=COLOURS[colour])
        else:
            draw.polygon([(x + size / 2, y), (x + size - 1, y + size - 1), (x, y + size - 1)], fill=COLOURS[colour])
    return np.asarray(image)


def _scene(objects: dict[int, tuple[str, str]]) -> list[dict]:
    return [{"colour": c, "shape": s, "cell": cell, "x": CORNERS[cell][0], "y": CORNERS[cell][1], "size": 15.0}
            for cell, (c, s) in sorted(objects.items())]


def _soft(image: np.ndarray, seed: int = 0) -> np.ndarray:
    """A small model's decoder: soft edges and pixel noise."""
    rng = np.random.default_rng(seed)
    out = gaussian_filter(image.astype(np.float64), sigma=(0.7, 0.7, 0)) + rng.normal(0, 8, image.shape)
    return np.clip(out, 0, 255).astype(np.uint8)


SOURCE = {0: ("red", "circle"), 1: ("blue", "square"), 3: ("green", "triangle")}
# instruction -> the target scene, written out by hand
CASES = {
    "make the square yellow": {0: ("red", "circle"), 1: ("yellow", "square"), 3: ("green", "triangle")},
    "make the blue square red": {0: ("red", "circle"), 1: ("red", "square"), 3: ("green", "triangle")},
    "remove the triangle": {0: ("red", "circle"), 1: ("blue", "square")},
    "remove the red circle": {1: ("blue", "square"), 3: ("green", "triangle")},
    "add a green circle": {0: ("red", "circle"), 1: ("blue", "square"), 2: ("green", "circle"),
                           3: ("green", "triangle")},
}


@pytest.mark.parametrize("instruction", list(CASES))
def test_a_correct_edit_scores_one_and_the_unedited_input_zero(instruction):
    reward = ShapesEdit()
    strict = ShapesEdit(ShapesEditArgs(mode="strict"))
    meta = {"scene": _scene(SOURCE)}
    target, source = _soft(_by_hand(CASES[instruction])), _soft(_by_hand(SOURCE))
    assert reward(target[None], [instruction], [meta]).scores.tolist() == [1.0]
    assert strict(target[None], [instruction], [meta]).scores.tolist() == [1.0]
    assert reward(source[None], [instruction], [meta]).scores.tolist() == [0.0]
    assert strict(source[None], [instruction], [meta]).scores.tolist() == [0.0]


def test_an_edit_that_also_changes_another_object_loses_the_kept_share():
    meta = {"scene": _scene(SOURCE)}
    # the square recoloured as asked, and the circle lost: the other cells keep 1 of the 2 objects (Jaccard 1/2)
    damaged = _by_hand({1: ("yellow", "square"), 3: ("green", "triangle")})
    assert edit_scores(damaged, meta["scene"], "make the square yellow") == (1.0, 0.5, 0.0)
    assert ShapesEdit()(damaged[None], ["make the square yellow"], [meta]).scores.tolist() == [0.5]
    # ... and the triangle recoloured too: nothing of the rest is kept
    worse = _by_hand({1: ("yellow", "square"), 3: ("red", "triangle")})
    assert edit_scores(worse, meta["scene"], "make the square yellow") == (1.0, 0.0, 0.0)
    # an extra object in a free cell: wanted {circle, triangle}, found those and a square -> 2/3
    extra = _by_hand({**CASES["remove the red circle"], 0: ("red", "circle"), 2: ("blue", "square")})
    assert edit_scores(extra, meta["scene"], "remove the triangle")[1] == pytest.approx(2 / 3)


def test_an_object_moved_to_another_cell_is_not_kept():
    moved = _by_hand({0: ("red", "circle"), 1: ("yellow", "square"), 2: ("green", "triangle")})
    assert edit_scores(moved, _scene(SOURCE), "make the square yellow") == (1.0, pytest.approx(1 / 3), 0.0)


def test_instructions_ill_defined_on_the_scene_are_refused():
    scene = scene_from_json(_scene({0: ("red", "circle"), 1: ("blue", "circle"), 2: ("red", "square"),
                                    3: ("red", "triangle")}))
    with pytest.raises(PromptParseError, match="fits 2 objects"):
        apply_edit(scene, "remove the circle")  # two circles: the colour is needed
    with pytest.raises(PromptParseError, match="fits 0 objects"):
        apply_edit(scene, "remove the green circle")
    with pytest.raises(PromptParseError, match="already"):
        apply_edit(scene, "make the square red")
    with pytest.raises(PromptParseError, match="no free cell"):
        apply_edit(scene, "add a blue circle")
    with pytest.raises(PromptParseError, match="not 'make the"):
        parse_instruction("paint the square red")
    with pytest.raises(PromptParseError, match="unknown colour"):
        parse_instruction("make the square purple")
    assert [o.colour for o in apply_edit(scene, "make the blue circle yellow")] == ["red", "yellow", "red", "red"]


def test_add_fills_the_first_free_cell_in_reading_order():
    scene = scene_from_json(_scene({0: ("red", "circle"), 2: ("blue", "square")}))
    added = apply_edit(scene, "add a yellow triangle")
    assert [(o.cell, o.colour, o.shape) for o in added] == [(0, "red", "circle"), (1, "yellow", "triangle"),
                                                           (2, "blue", "square")]
    new = added[1]  # centred in cell 1 at 0.30 of the side
    assert (new.x + new.size / 2, new.y + new.size / 2, new.size) == pytest.approx((36.0, 12.0, 14.4))


def test_triples_are_deterministic_well_defined_and_redraw_from_their_metadata():
    sources, instructions, targets, metadata = edit_triples(60, seed=7)
    again = edit_triples(60, seed=7)
    assert np.array_equal(sources, again[0]) and np.array_equal(targets, again[2]) and instructions == again[1]
    assert {text.split()[0] for text in instructions} == {"make", "remove", "add"}
    for source, text, target, meta in zip(sources, instructions, targets, metadata, strict=True):
        assert set(text.split()) <= set(VOCABULARY) | set(EDIT_WORDS)
        scene = scene_from_json(meta["scene"])
        assert np.array_equal(draw_objects(list(scene), 48), source)
        assert np.array_equal(draw_objects(list(apply_edit(scene, text)), 48), target)
        top, left, bottom, right = meta["edit_box"]
        outside = np.ones((48, 48), bool)
        outside[top:bottom, left:right] = False
        assert np.array_equal(source[outside], target[outside])  # the edit stays in its box
        assert not np.array_equal(source, target)
        assert edit_scores(target, meta["scene"], text)[2] == 1.0  # the detector reads every drawn target


def test_builtin_rows_carry_the_source_image_and_the_metadata():
    rows = builtin_rows(3, seed=1)
    assert all(row["images"][0].startswith("data:image/png;base64,") for row in rows)
    assert set(rows[0]) == {"prompt", "images", "scene", "edit", "edit_box", "resolution"}


def _consistency_by_hand(result, source, keep):
    """The float64 transcription: 1 - mean over kept pixels of the per-pixel channel-mean |difference| / 255."""
    total, count = 0.0, 0
    for y in range(result.shape[0]):
        for x in range(result.shape[1]):
            if keep[y, x]:
                total += sum(abs(float(result[y, x, c]) - float(source[y, x, c])) for c in range(3)) / 3 / 255
                count += 1
    return 1 - total / count


def test_edit_consistency_ignores_the_edit_box_and_counts_the_rest():
    rng = np.random.default_rng(3)
    source = rng.integers(0, 256, (48, 48, 3), dtype=np.uint8)
    result = source.copy()
    result[0:24, 24:48] = rng.integers(0, 256, (24, 24, 3))  # inside the box: free
    assert consistency(result, source, [0, 24, 24, 48]) == 1.0
    result[40:44, 2:6] = 255 - result[40:44, 2:6]  # outside: counted
    keep = np.ones((48, 48), bool)
    keep[0:24, 24:48] = False
    assert consistency(result, source, [0, 24, 24, 48]) == pytest.approx(_consistency_by_hand(result, source, keep))
    # a margin of 1/48 widens the box by one pixel on each side
    keep[0:25, 23:48] = False
    assert consistency(result, source, [0, 24, 24, 48], margin=1 / 48) == pytest.approx(
        _consistency_by_hand(result, source, keep))
    # without a box, the whole image
    assert consistency(result, source) == pytest.approx(_consistency_by_hand(result, source, np.ones((48, 48), bool)))


def test_edit_consistency_brings_a_larger_input_and_its_box_to_the_result_size():
    source = np.full((96, 96, 3), 255, np.uint8)
    source[0:48, 48:96] = 0  # the edited quarter, black in the input
    result = np.full((48, 48, 3), 255, np.uint8)
    # Lanczos rings past the quarter's edge, faintly: a margin leaves out most of it
    tight, wide = consistency(result, source, [0, 48, 48, 96]), consistency(result, source, [0, 48, 48, 96], 2 / 48)
    assert 0.99 < tight < wide and wide == pytest.approx(1.0, abs=2e-4)
    assert consistency(result, source) == pytest.approx(0.75, abs=0.005)


def test_edit_consistency_refuses_a_box_over_everything_and_takes_args():
    image = np.zeros((48, 48, 3), np.uint8)
    with pytest.raises(SampleError, match="covers the whole image") as info:
        consistency(image, image, [0, 0, 48, 48])
    assert info.value.field == "metadata.edit_box"
    # a box far past a smaller input, scaled up to the result: clipped, not an OverflowError (before)
    assert consistency(image, np.zeros((24, 24, 3), np.uint8), [0, 0, 1e308, 12]) == 1.0
    reward = build_reward(RewardSpec(name="edit_consistency", args={"margin": 0.1}))
    assert isinstance(reward, EditConsistency) and reward.margin == 0.1 and EditConsistency.inputs
    with pytest.raises(ValueError):
        EditConsistencyArgs(margin=0.6)
    assert build_reward(RewardSpec(name="shapes_edit", args={"mode": "strict"})).mode == "strict"


def test_the_builtin_set_is_what_its_writer_makes():
    lines = BUILTIN_PATH.read_text().splitlines()
    assert len(lines) == BUILTIN_ROWS
    # the rows are drawn one after another from one seed: the first 40 of the writer's are the file's first 40
    assert [json.loads(line) for line in lines[:40]] == builtin_rows(40)
    assert "shapes-edit" in BUILTIN_KINDS


def test_edit_consistency_through_the_reward_call_with_inputs():
    source = np.full((48, 48, 3), 255, np.uint8)
    kept, spoilt = source.copy(), source.copy()
    kept[0:24, 24:48] = 0  # the edit, inside the box
    spoilt[30:36, 6:12] = 0  # 36 of the 1728 pixels outside the box turned black
    out = EditConsistency()(np.stack([kept, spoilt]), ["remove the square"] * 2, [{"edit_box": [0, 24, 24, 48]}] * 2,
                            inputs=[[source], [source]])
    assert out.scores.tolist() == [1.0, pytest.approx(1 - 36 / 1728)]
    missing = EditConsistency()(kept[None], ["remove the square"], [{}], inputs=[[]])
    assert "has none" in missing.errors[0]
