"""Prompt sources of the `data` section."""

import pytest
from pydantic import ValidationError

from components.dataset.config import DataConfig
from components.dataset.prompts import load_prompts
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
        ("p.jsonl", '{"text": "no prompt"}\n', "p.jsonl:1: expected a JSON object with a 'prompt' field"),
        ("p.jsonl", '{"prompt": "  "}\n', "p.jsonl:1: 'prompt' must be a non-empty string"),
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

