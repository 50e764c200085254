"""Prompt sources of the `data` section."""

import io
import json
import struct
import time
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from pydantic import ValidationError

from components.dataset import prepare as prep
from components.dataset.config import DataConfig
from components.dataset.prepare import prepare_dataset
from components.dataset.prompts import MAX_PROMPT_TOKENS, data_path_note, load_prompt_rows, load_prompts
from components.errors import DataError


def test_inline_prompts(tmp_path):
    assert load_prompts(DataConfig(prompts=["a", "b"])) == ["a", "b"]


def test_txt_and_jsonl_files(tmp_path):
    txt = tmp_path / "p.txt"
    txt.write_text("a cat\n\n  a dog  \n")
    assert load_prompts(DataConfig(prompts=None, path=str(txt))) == ["a cat", "a dog"]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "a cat"}\n{"prompt": "a \\"sign\\"", "ground_truth": "sign"}\n')
    assert load_prompts(DataConfig(prompts=None, path=str(jsonl))) == ["a cat", 'a "sign"']


@pytest.mark.parametrize(
    ("name", "content", "needle"),
    [
        ("p.jsonl", '{"prompt": "ok"}\nnot json\n', "p.jsonl:2: expected a JSON object"),
        ("p.jsonl", '{"text": "no prompt"}\n', "p.jsonl:1: missing, empty or non-string prompt"),
        ("p.jsonl", '{"prompt": "  "}\n', "p.jsonl:1: missing, empty or non-string prompt (prompt is '  ')"),
        ("p.jsonl", '{"prompt": "ok"}\n["a list"]\n', "p.jsonl:2: expected a JSON object with a 'prompt' field, got"),
        ("p.jsonl", '{"prompt": "ok", "score": Infinity}\n', "p.jsonl:1: record does not parse (metadata not JSON-"),
        ("p.txt", "\n\n", "holds no prompts"),
        ("p.csv", "prompt\na\n", "must be a .txt or .jsonl file"),
    ],
)
def test_bad_files_name_file_and_line(tmp_path, name, content, needle):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(DataError) as info:
        load_prompts(DataConfig(prompts=None, path=str(path)))
    assert needle in str(info.value)


def test_missing_file_and_bad_encoding(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_prompts(DataConfig(prompts=None, path=str(tmp_path / "none.txt")))
    bad = tmp_path / "latin.txt"
    bad.write_bytes(b"caf\xe9\n")
    with pytest.raises(DataError, match="not UTF-8"):
        load_prompts(DataConfig(prompts=None, path=str(bad)))


def test_exactly_one_source():
    with pytest.raises(ValidationError, match=r"exactly one of data\.prompts and data\.path"):
        DataConfig(prompts=["a"], path="x.txt")
    with pytest.raises(ValidationError, match=r"data\.prompts\.1 is empty"):
        DataConfig(prompts=["a", " "])



@pytest.mark.parametrize("name", ["p.txt", "p.jsonl"])
def test_a_prompt_file_passes_the_row_check_of_prepare_dataset(tmp_path, name):
    # Before: a 1 MB prompt in a .txt reached the tokenizers and rewards (train at 2.0 GB RSS instead of 542 MB).
    def line(prompt: str) -> str:
        return f'{{"prompt": "{prompt}"}}' if name.endswith(".jsonl") else prompt

    at_limit = " ".join(["a"] * MAX_PROMPT_TOKENS)  # 256 words of 511 characters: estimated 256 tokens
    path = tmp_path / name
    path.write_text(f"{line('a cat')}\n{line(at_limit)}\n")
    assert load_prompts(DataConfig(prompts=None, path=str(path))) == ["a cat", at_limit]
    prepared = prepare_dataset(str(path.with_suffix(".jsonl")) if name.endswith(".jsonl") else _as_jsonl(path),
                               str(tmp_path / "prepared"))
    assert prepared.manifest["rows"]["kept"] == 2  # prepare keeps what train reads

    path.write_text(f"{line('a cat')}\n\n{line(at_limit + ' a')}\n")
    with pytest.raises(DataError) as info:
        load_prompts(DataConfig(prompts=None, path=str(path)))
    assert str(info.value) == (f"{path}:3: prompt longer than max_prompt_tokens (estimated) (about 257 tokens, "
                               "limit 256); for a longer limit prepare the file with `flowgrpo prepare-dataset "
                               "--max-prompt-tokens N` and train on its output")
    assert prepare_dataset(_as_jsonl(path), str(tmp_path / "prepared")).rejections.counts["prompt_too_long"] == 1

    path.write_text(line("a" * 1_000_000) + "\n")
    start = time.perf_counter()
    with pytest.raises(DataError, match=r":1: prompt longer than max_prompt_tokens \(estimated\) \(about 250000 "):
        load_prompts(DataConfig(prompts=None, path=str(path)))
    assert time.perf_counter() - start < 1


def _as_jsonl(path):
    """The prompts of a .txt or .jsonl file as the JSONL `prepare-dataset` reads."""
    if path.suffix == ".jsonl":
        return str(path)
    out = path.with_suffix(".prep.jsonl")
    out.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in path.read_text().splitlines() if p.strip()))
    return str(out)


def _bad_sources(tmp_path):
    """data.path values that exist here and that training refuses."""
    latin = tmp_path / "latin.txt"
    latin.write_bytes(b"caf\xe9\n")
    folder = tmp_path / "folder.txt"
    folder.mkdir()
    long = tmp_path / "long.txt"
    long.write_text("a" * 2000 + "\n")
    return {"/dev/null": "/dev/null", "not UTF-8": str(latin), "a folder": str(folder),
            "a folder without manifest": str(tmp_path), "a too-long prompt": str(long)}


def test_validate_refuses_what_training_refuses_with_the_same_line(tmp_path):
    for what, path in _bad_sources(tmp_path).items():
        data = DataConfig(prompts=None, path=path)
        with pytest.raises(DataError) as trained:
            load_prompts(data)
        with pytest.raises(DataError) as validated:
            data_path_note(data, 64)
        assert str(validated.value) == str(trained.value), what
        assert path in str(trained.value), what


def test_validate_notes_a_data_path_it_cannot_read_here_without_failing(tmp_path):
    good = tmp_path / "p.txt"
    good.write_text("a cat\n")
    assert data_path_note(DataConfig(prompts=None, path=str(good)), 64) is None
    assert data_path_note(DataConfig(), 64) is None  # inline prompts: the schema checked them
    missing = data_path_note(DataConfig(prompts=None, path="/data/ocr/train.jsonl"), 64)  # as the shipped GPU configs
    assert missing.startswith("data.path /data/ocr/train.jsonl does not exist on this machine")
    assert "`flowgrpo train` here would stop on it" in missing
    remote = data_path_note(DataConfig(prompts=None, path="s3://bucket/data/train.jsonl"), 64)
    assert remote == "data.path s3://bucket/data/train.jsonl: read when the run starts (needs the S3 credentials)"


def _png(seed: int, height: int = 32, width: int = 32) -> bytes:
    out = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)).save(out, "PNG")
    return out.getvalue()


def _bomb() -> bytes:
    """57 bytes of PNG whose header says 30000 x 30000."""
    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 30000, 30000, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b""))


@pytest.mark.parametrize("bad", ["bomb", "truncated", "wide"])
@pytest.mark.parametrize("prepared", [False, True])
def test_validate_refuses_the_input_images_training_refuses_with_the_same_line(tmp_path, bad, prepared):
    # Before: validate said valid for each; training stopped on the image only as it encoded the row.
    from components.dataset.input_images import describe, load_row_images, model_input

    content = {"bomb": _bomb(), "truncated": _png(1)[:-100], "wide": _png(1, 16, 40)}[bad]
    (tmp_path / "ok.png").write_bytes(_png(0))
    (tmp_path / "bad.png").write_bytes(content)
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "make it red", "images": "ok.png"}) + "\n"
                    + json.dumps({"prompt": "make it blue", "images": ["bad.png"]}) + "\n")
    path = str(rows)
    if prepared:  # a dataset prepared before the bad image was put in its place
        (tmp_path / "bad.png").write_bytes(_png(1))
        path = str(tmp_path / "out")
        prepare_dataset(str(rows), path, test_fraction=0)
        name = next(r for r in load_prompt_rows(DataConfig(prompts=None, path=path)) if r.prompt == "make it blue")
        Path(name.images[0]).write_bytes(content)
    data = DataConfig(prompts=None, path=path)
    start = time.perf_counter()
    with pytest.raises(DataError) as validated:
        data_path_note(data, 32)
    assert time.perf_counter() - start < 2
    row = next(r for r in load_prompt_rows(data) if r.prompt == "make it blue")
    with pytest.raises(DataError) as trained:  # what training raises as it encodes the row (prompt_cache)
        model_input([load_row_images(row.images, describe(row), 32)], 32)
    assert str(validated.value) == str(trained.value)
    assert str(validated.value).startswith("the row 'make it blue' (input image ")


def test_validate_refuses_more_input_images_than_a_model_takes(tmp_path):
    (tmp_path / "ok.png").write_bytes(_png(0))
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "make it red", "images": ["ok.png"] * 5}) + "\n")
    with pytest.raises(DataError, match=r"rows\.jsonl:1: more than 4 input images \(5 input images; a model takes "
                                        r"at most 4"):
        data_path_note(DataConfig(prompts=None, path=str(rows)), 32)


def test_a_line_over_the_limit_is_refused_unread(tmp_path):
    # Before: a 300 MB single-line JSONL took validate to 2.4 GB RSS and 14 s.
    path = tmp_path / "p.jsonl"
    with path.open("w") as f:
        f.write('{"prompt": "a cat"}\n{"prompt": "a dog", "x": "' + "0" * prep.MAX_LINE_BYTES + '"}\n')
    with pytest.raises(DataError, match=rf"p\.jsonl:2: a line longer than {prep.MAX_LINE_BYTES} bytes"):
        load_prompts(DataConfig(prompts=None, path=str(path)))
