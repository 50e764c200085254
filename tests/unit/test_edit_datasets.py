"""Datasets whose rows carry input images: stored once, every row of one image in one split, bad images rejected
per row with their line, read back exactly; text-only datasets keep their ids and hashes."""

import base64
import hashlib
import io
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from components.dataset.config import DataConfig
from components.dataset.input_images import load_row_images
from components.dataset.prepare import prepare_dataset
from components.dataset.prepared import PromptRow, read_split, row_id, rows_sha256
from components.dataset.prompts import load_prompt_rows
from components.errors import DataError

INSTRUCTIONS = ["make it red", "remove the circle", "add a square"]


def _image(seed: int, h: int = 24, w: int = 24) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


def _save(image: np.ndarray, path) -> None:
    Image.fromarray(image).save(path)


def _jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _edit_set(tmp_path, images: int = 12):
    """``images`` source images (relative paths), each with every instruction."""
    rows = []
    for i in range(images):
        _save(_image(i), tmp_path / f"src{i}.png")
        rows += [{"prompt": text, "images": f"src{i}.png", "scene": i} for text in INSTRUCTIONS]
    return _jsonl(tmp_path / "edits.jsonl", rows)


def test_each_image_is_stored_once_under_its_pixels_hash_and_read_back_exactly(tmp_path):
    result = prepare_dataset(_edit_set(tmp_path), str(tmp_path / "out"), test_fraction=0.25)
    stored = sorted(p.name for p in (tmp_path / "out" / "images").iterdir())
    expected = sorted(hashlib.sha256(f"{_image(i).shape}".encode() + _image(i).tobytes()).hexdigest()[:16] + ".png"
                      for i in range(12))
    assert stored == expected and result.manifest["images"] == 12
    rows = [r for s in ("train", "test") for r in read_split(str(tmp_path / "out"), s)[0]]
    assert len(rows) == 36
    for row in rows:
        (pixels,) = load_row_images(row.images, row.prompt)
        assert np.array_equal(pixels, _image(row.metadata["scene"]))
        assert "images" not in row.metadata


def test_every_row_of_one_source_image_lands_in_one_split(tmp_path):
    result = prepare_dataset(_edit_set(tmp_path), str(tmp_path / "out"), test_fraction=0.25, seed=3)
    splits = {s: read_split(str(tmp_path / "out"), s)[0] for s in ("train", "test")}
    scenes = {s: [r.metadata["scene"] for r in rows] for s, rows in splits.items()}
    assert not set(scenes["train"]) & set(scenes["test"])
    assert all(scenes[s].count(x) == 3 for s in scenes for x in scenes[s])  # whole groups only
    assert len(splits["test"]) == 9 == result.manifest["rows"]["test"]  # round(36 * 0.25), in groups of 3
    other = prepare_dataset(_edit_set(tmp_path), str(tmp_path / "out2"), test_fraction=0.25, seed=4)
    assert {r.metadata["scene"] for r in read_split(str(tmp_path / "out2"), "test")[0]} != set(scenes["test"])
    assert other.manifest["rows"]["test"] == 9


def test_a_rows_id_covers_its_images_and_a_text_rows_id_is_its_prompts(tmp_path):
    assert row_id("a cat") == hashlib.sha256(b"a cat").hexdigest()[:16]  # what schema 1 stored
    assert row_id("make it red", ("images/aa.png",)) == hashlib.sha256(b"make it red\timages/aa.png").hexdigest()[:16]
    assert row_id("make it red", ("images/aa.png",)) != row_id("make it red", ("images/bb.png",))


def test_bad_images_are_rejected_per_row_with_their_line_and_the_rest_is_kept(tmp_path):
    _save(_image(0), tmp_path / "ok.png")
    _save(_image(1, 10, 40), tmp_path / "wide.png")
    (tmp_path / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(30))
    source = _jsonl(tmp_path / "rows.jsonl", [
        {"prompt": "make it red", "images": "ok.png"},             # 1 kept
        {"prompt": "make it red", "images": "gone.png"},           # 2 image_missing
        {"prompt": "make it red", "images": "broken.png"},         # 3 image_unreadable
        {"prompt": "make it red", "images": "wide.png"},           # 4 image_size (4:1)
        {"prompt": "make it red", "images": [1, 2]},               # 5 bad_images
        {"prompt": "make it red", "images": "./ok.png"},           # 6 duplicate: same prompt, same pixels
        {"prompt": "make it blue", "images": ["ok.png"]},          # 7 kept: another instruction on the image
        {"prompt": "a plain text row"},                            # 8 kept: no images
    ])
    result = prepare_dataset(source, str(tmp_path / "out"), resolution=24, test_fraction=0)
    r = result.rejections
    assert {k: v for k, v in r.examples.items() if v} == {
        "image_missing": [2], "image_unreadable": [3], "image_size": [4], "bad_images": [5], "duplicate": [6]}
    assert "gone.png does not exist" in r.details["image_missing"] and "4:1" not in r.details["image_size"]
    assert "more than 2:1" in r.details["image_size"]
    kept = read_split(str(tmp_path / "out"), "train")[0]
    assert sorted((k.prompt, len(k.images)) for k in kept) == [("a plain text row", 0), ("make it blue", 1),
                                                               ("make it red", 1)]


def test_without_a_resolution_only_the_images_themselves_are_checked(tmp_path):
    _save(_image(1, 10, 40), tmp_path / "wide.png")
    source = _jsonl(tmp_path / "rows.jsonl", [{"prompt": "make it red", "images": "wide.png"}])
    assert prepare_dataset(source, str(tmp_path / "out")).manifest["rows"]["kept"] == 1


def test_a_schema_1_dataset_is_still_read(tmp_path):
    rows = [PromptRow("a cat", {"k": 1}), PromptRow("a dog")]
    out = tmp_path / "v1"
    out.mkdir()
    for split, part in (("train", rows), ("test", [])):
        pq.write_table(pa.table({"id": pa.array([row_id(r.prompt) for r in part], pa.string()),
                                 "prompt": pa.array([r.prompt for r in part], pa.string()),
                                 "metadata": pa.array([json.dumps(r.metadata) for r in part], pa.string())}),
                       out / f"{split}.parquet")
    manifest = {"schema_version": 1, "content_sha256": "x", "rows": {"train": 2, "test": 0},
                "splits": {"train": {"rows": 2, "sha256": rows_sha256(rows)}, "test": {"rows": 0,
                                                                                    "sha256": rows_sha256([])}}}
    (out / "manifest.json").write_text(json.dumps(manifest))
    assert read_split(str(out), "train")[0] == rows


def test_a_jsonl_trained_on_directly_resolves_its_images_and_a_builtin_set_is_read_as_it_ships(tmp_path):
    rows = load_prompt_rows(DataConfig(prompts=None, path=_edit_set(tmp_path, images=2)))
    assert rows[0].images == (str(tmp_path / "src0.png"),) and rows[0].metadata == {"scene": 0}
    shapes = load_prompt_rows(DataConfig(prompts=None, path="builtin:shapes"))
    assert len(shapes) > 100 and not any(r.images for r in shapes)
    with pytest.raises(DataError, match="needs a prepared dataset"):
        load_prompt_rows(DataConfig(prompts=None, path="builtin:shapes", split="test"))


def test_a_data_url_row_is_stored_like_a_file(tmp_path):
    buf = io.BytesIO()
    Image.fromarray(_image(5)).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    source = _jsonl(tmp_path / "rows.jsonl", [{"prompt": "make it red", "images": url}])
    prepare_dataset(source, str(tmp_path / "out"), test_fraction=0)
    (row,) = read_split(str(tmp_path / "out"), "train")[0]
    assert row.images[0].endswith(".png") and np.array_equal(load_row_images(row.images, "")[0], _image(5))
