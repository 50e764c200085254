"""Dataset preparation from and to a real SeaweedFS, training config reading it back, and the CLI."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from components import storage
from components.dataset.config import DataConfig
from components.dataset.prepare import prepare_dataset
from components.dataset.prepared import read_split
from components.dataset.prompts import dataset_hash, load_prompt_rows
from components.errors import DataError
from pipeline.services.seaweed import SeaweedS3

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _s3(s3_env: SeaweedS3) -> SeaweedS3:
    """Every test here talks to the session's SeaweedFS (tests/integration/conftest.py)."""
    return s3_env


@pytest.fixture
def prefix(seaweed: SeaweedS3) -> str:
    return f"s3://{seaweed.bucket}/datasets-{uuid.uuid4().hex[:10]}"


def flowgrpo(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], capture_output=True, text=True, cwd=REPO,
                          timeout=300)


LINES = [json.dumps({"prompt": f'a shop sign reading "SHOP {i}"', "ground_truth": f"SHOP {i}"}) for i in range(20)]


def test_prepare_from_s3_to_s3_then_train_config_reads_it(prefix):
    storage.put_bytes(("\n".join([*LINES, "{broken", LINES[0]]) + "\n").encode(), f"{prefix}/in/prompts.jsonl")
    out = f"{prefix}/prepared"
    result = prepare_dataset(f"{prefix}/in/prompts.jsonl", out, kind="ocr", seed=5, test_fraction=0.1)
    assert result.rejections.examples["unparseable"] == [21] and result.rejections.examples["duplicate"] == [22]
    for name in ("train.parquet", "test.parquet", "manifest.json"):
        assert storage.exists(f"{out}/{name}")
    manifest = json.loads(storage.get_bytes(f"{out}/manifest.json"))
    assert manifest == result.manifest and manifest["rows"]["train"] == 18 and manifest["rows"]["test"] == 2

    rows = load_prompt_rows(DataConfig(prompts=None, path=out))
    assert rows == read_split(out, "train")[0] and len(rows) == 18
    assert all(r.metadata["ground_truth"] in r.prompt for r in rows)
    test_rows = load_prompt_rows(DataConfig(prompts=None, path=out, split="test"))
    assert {r.prompt for r in rows} | {r.prompt for r in test_rows} == {json.loads(x)["prompt"] for x in LINES}
    assert dataset_hash(DataConfig(prompts=None, path=out)) == manifest["content_sha256"]


def test_an_editing_set_on_s3_reads_only_its_own_images_and_none_over_the_size_limit(prefix, monkeypatch):
    from components.dataset import input_images

    png = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(png, "PNG")
    storage.put_bytes(png.getvalue(), f"{prefix}/in/img/a.png")
    storage.put_bytes(png.getvalue(), f"{prefix}/secret.png")
    storage.put_bytes(b"\x89PNG" + bytes(5000), f"{prefix}/in/img/large.png")
    monkeypatch.setattr(input_images, "MAX_IMAGE_BYTES", 4096)
    rows = [{"prompt": "make it red", "images": "img/a.png"}, {"prompt": "make it blue", "images": "../secret.png"},
            {"prompt": "make it green", "images": "img/large.png"}]
    storage.put_bytes("".join(json.dumps(r) + "\n" for r in rows).encode(), f"{prefix}/in/rows.jsonl")
    result = prepare_dataset(f"{prefix}/in/rows.jsonl", f"{prefix}/out", test_fraction=0)
    assert {k: v for k, v in result.rejections.examples.items() if v} == {"image_outside": [2], "image_too_large": [3]}
    assert "is 5004 bytes, over the limit of 4096" in result.rejections.details["image_too_large"]
    (row,) = load_prompt_rows(DataConfig(prompts=None, path=f"{prefix}/out"))
    assert row.images[0].startswith(f"{prefix}/out/images/")
    with pytest.raises(DataError, match=r"rows\.jsonl:2: an input image outside the source file's folder"):
        load_prompt_rows(DataConfig(prompts=None, path=f"{prefix}/in/rows.jsonl"))


def test_csv_input_from_s3_matches_local_preparation(prefix, tmp_path):
    text = "prompt,ground_truth\n" + "".join(f'"a banner with ""WORD {i}""",WORD {i}\n' for i in range(8))
    (tmp_path / "in.csv").write_text(text)
    storage.put_bytes(text.encode(), f"{prefix}/in.csv")
    remote = prepare_dataset(f"{prefix}/in.csv", f"{prefix}/out", kind="ocr")
    local = prepare_dataset(str(tmp_path / "in.csv"), str(tmp_path / "out"), kind="ocr")
    assert remote.manifest["content_sha256"] == local.manifest["content_sha256"]
    assert remote.manifest["rows"]["kept"] == 8


def test_cli_prepares_to_s3_and_reports_a_fully_rejected_file_in_one_line(prefix, tmp_path):
    storage.put_bytes(("\n".join(LINES) + "\n").encode(), f"{prefix}/in.jsonl")
    ok = flowgrpo("prepare-dataset", "--input", f"{prefix}/in.jsonl", "--output", f"{prefix}/cli", "--kind", "ocr",
                  "--test-fraction", "0.25", "--seed", "3")
    assert ok.returncode == 0, ok.stderr
    assert "kept 20 of 20 rows (15 train, 5 test)" in ok.stdout and "rejected 0: none" in ok.stdout
    assert f"train: {prefix}/cli/train.parquet" in ok.stdout
    assert len(load_prompt_rows(DataConfig(prompts=None, path=f"{prefix}/cli"))) == 15

    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(b'{"prompt": ""}\nnot json\n{"prompt": "no quoted text"}\n\xff\n')
    proc = flowgrpo("prepare-dataset", "--input", str(bad), "--output", f"{prefix}/never", "--kind", "ocr")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, proc.stderr
    for needle in ("all 4 rows rejected", "missing_prompt 1 (line 1", "unparseable 1 (line 2",
                   "no_ocr_target 1 (line 3", "bad_encoding 1 (line 4"):
        assert needle in errors[0]
    assert not storage.exists(f"{prefix}/never/manifest.json")

    missing = flowgrpo("prepare-dataset", "--input", f"{prefix}/nothing-here.jsonl", "--output", str(tmp_path / "o"))
    assert missing.returncode == 2 and "Traceback" not in missing.stderr
    assert "nothing-here.jsonl" in missing.stderr and "no such object" in missing.stderr
