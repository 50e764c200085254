"""Datasets whose rows carry input images: stored once, every row of one image in one split, bad images rejected
per row with their line, read back exactly; text-only datasets keep their ids and hashes."""

import base64
import hashlib
import io
import json
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from components.dataset.config import DataConfig
from components.dataset.input_images import load_row_images, pixels_name
from components.dataset.prepare import prepare_dataset
from components.dataset.prepared import PromptRow, read_split, row_id, rows_sha256, write_split
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


def test_images_outside_the_source_folder_are_rejected_and_absolute_ones_need_the_opt_in(tmp_path):
    # Before: "../outside/secret.png" was kept and the file copied into the prepared dataset.
    (tmp_path / "outside").mkdir()
    _save(_image(7), tmp_path / "outside" / "secret.png")
    (tmp_path / "ds").mkdir()
    _save(_image(0), tmp_path / "ds" / "ok.png")
    (tmp_path / "ds" / "link.png").symlink_to(tmp_path / "outside" / "secret.png")
    secret = str(tmp_path / "outside" / "secret.png")
    source = _jsonl(tmp_path / "ds" / "rows.jsonl", [
        {"prompt": "make it red", "images": "ok.png"},                    # 1 kept
        {"prompt": "make it blue", "images": "../outside/secret.png"},    # 2 image_outside
        {"prompt": "make it green", "images": "link.png"},                # 3 image_outside (a link out)
        {"prompt": "make it grey", "images": secret},                     # 4 absolute: needs the opt-in
        {"prompt": "make it pink", "images": ["ok.png"] * 5},             # 5 too_many_images
    ])
    result = prepare_dataset(source, str(tmp_path / "out"), test_fraction=0)
    r = result.rejections
    assert {k: v for k, v in r.examples.items() if v} == {"image_outside": [2, 3, 4], "too_many_images": [5]}
    assert "leads outside" in r.details["image_outside"] and "at most 4" in r.details["too_many_images"]
    assert [p.name for p in (tmp_path / "out" / "images").iterdir()] == [pixels_name(_image(0)).split("/")[1]]
    allowed = prepare_dataset(source, str(tmp_path / "out2"), test_fraction=0, allow_external=True)
    assert allowed.rejections.examples["image_outside"] == [2, 3]  # the opt-in is for absolute paths only
    assert sorted(r.prompt for r in read_split(str(tmp_path / "out2"), "train")[0]) == ["make it grey",
                                                                                      "make it red"]
    with pytest.raises(DataError, match=r"rows\.jsonl:2: an input image outside the source file's folder"):
        load_prompt_rows(DataConfig(prompts=None, path=source))
    external = _jsonl(tmp_path / "ds" / "external.jsonl", [{"prompt": "make it grey", "images": secret}])
    with pytest.raises(DataError, match=r"data\.allow_external_images: true"):
        load_prompt_rows(DataConfig(prompts=None, path=external))
    assert load_prompt_rows(DataConfig(prompts=None, path=external, allow_external_images=True))[0].images == (secret,)


def _rewrite_images(folder, images: list[str]) -> None:
    """The train split of the prepared dataset ``folder`` with its images column replaced and the manifest's hash
    recomputed, as someone who edits a prepared dataset would do."""
    rows = [PromptRow("make it red", {}, (name,)) for name in images]
    write_split(rows, folder / "train.parquet")
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest["splits"]["train"].update(rows=len(rows), sha256=rows_sha256(rows))
    (folder / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("name", ["../outside/secret.png", "/etc/hostname", "images/../../outside/secret.png",
                                  "s3://bucket/x.png", "images/link.png"])
def test_a_prepared_dataset_whose_images_leave_its_folder_is_refused(tmp_path, name):
    # Before: the escaping names passed `validate` and `train` read them.
    (tmp_path / "outside").mkdir()
    _save(_image(7), tmp_path / "outside" / "secret.png")
    prepare_dataset(_edit_set(tmp_path / "outside", images=1), str(tmp_path / "out"), test_fraction=0)
    _rewrite_images(tmp_path / "out", [name])
    with pytest.raises(DataError, match=f"names {re.escape(repr(name))}, not an images/<16 hex>.png file inside"):
        read_split(str(tmp_path / "out"), "train")
    stored = next((tmp_path / "out" / "images").iterdir())
    link = tmp_path / "out" / "images" / "0123456789abcdef.png"
    link.symlink_to(tmp_path / "outside" / "secret.png")
    _rewrite_images(tmp_path / "out", [f"images/{stored.name}", "images/0123456789abcdef.png"])
    with pytest.raises(DataError, match=r"names 'images/0123456789abcdef\.png'.*a symbolic link out of it"):
        read_split(str(tmp_path / "out"), "train")


def test_the_pipeline_step_prepares_a_data_path_with_images_from_that_files_folder(tmp_path, monkeypatch):
    # Before: the rows were copied into a scratch file elsewhere, so images named relative to a relative data.path
    # were looked for beside the scratch file and every row was rejected (image_missing).
    from pipeline import steps
    from pipeline.config import load_config

    (tmp_path / "set").mkdir()
    _edit_set(tmp_path / "set", images=2)
    monkeypatch.chdir(tmp_path)
    config = load_config("tiny-cpu", ["data.prompts=null", "data.path=set/edits.jsonl"])
    ref = steps.prepare(config, str(tmp_path / "store"), log=lambda _m: None)
    rows = [r for s in ("train", "test") for r in read_split(ref.uri, s)[0]]
    assert len(rows) == 6 and ref.manifest["images"] == 2
    assert {r.metadata["scene"]: np.array_equal(load_row_images(r.images, "")[0], _image(r.metadata["scene"]))
            for r in rows} == {0: True, 1: True}
