"""Dataset preparation: rejection reasons with line numbers, input formats, split, manifest, built-in sets,
and reading a prepared dataset back through the `data` config."""

from __future__ import annotations

import csv
import json
import random
import re
import tracemalloc
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from components.dataset import prepare as prep
from components.dataset.config import DataConfig
from components.dataset.prepare import REASONS, builtin_source, prepare_dataset, split_rows
from components.dataset.prepared import PromptRow, read_split, row_id
from components.dataset.prompts import dataset_hash, load_prompt_rows, load_prompts
from components.errors import DataError
from components.rewards.text_match import target_text


def write_lines(path: Path, lines: list[str | bytes]) -> Path:
    path.write_bytes(b"".join((x if isinstance(x, bytes) else x.encode()) + b"\n" for x in lines))
    return path


def jl(**fields: object) -> str:
    return json.dumps(fields)


def all_rows(out: Path) -> dict[str, list[PromptRow]]:
    return {s: read_split(str(out), s)[0] for s in ("train", "test")}


# ------------------------------------------------------------------------------------------ rejections

DEFECTIVE_JSONL = [
    jl(prompt='a sign that says "OPEN"'),                 # 1 kept
    "not json",                                           # 2 unparseable
    b'{"prompt": "caf\xe9 \\"X\\""}',                     # 3 bad_encoding (latin-1 byte)
    jl(prompt=""),                                        # 4 missing_prompt
    jl(text="no prompt field"),                           # 5 missing_prompt
    jl(prompt="word " * 300 + '"X"'),                     # 6 prompt_too_long
    jl(prompt="a plain cat"),                             # 7 no_ocr_target (kind ocr)
    jl(prompt='  a sign   that says "OPEN" '),            # 8 duplicate of 1 after whitespace normalisation
    "",                                                   # 9 blank: skipped, not a record
    jl(prompt="a mug with a word on it", ground_truth="MUG"),  # 10 kept: target from ground_truth
    "[1, 2]",                                             # 11 unparseable: not an object
    jl(prompt=42),                                        # 12 missing_prompt: not a string
    jl(prompt='a flag with "HI"', ground_truth=""),       # 13 kept: empty ground_truth dropped, quote is the target
]


def test_every_rejection_reason_is_counted_with_its_line_numbers(tmp_path):
    src = write_lines(tmp_path / "in.jsonl", DEFECTIVE_JSONL)
    result = prepare_dataset(str(src), str(tmp_path / "out"), kind="ocr")
    r = result.rejections
    assert r.counts == {**dict.fromkeys(REASONS, 0), "unparseable": 2, "bad_encoding": 1, "missing_prompt": 3,
                        "prompt_too_long": 1, "no_ocr_target": 1, "duplicate": 1}
    assert {k: v for k, v in r.examples.items() if v} == {
        "unparseable": [2, 11], "bad_encoding": [3], "missing_prompt": [4, 5, 12], "prompt_too_long": [6],
        "no_ocr_target": [7], "duplicate": [8]}
    assert "first at line 1" in r.details["duplicate"] and "Expecting value" in r.details["unparseable"]
    m = result.manifest
    assert m["rows"] == {"input": 12, "kept": 3, "rejected": 9, "train": 2, "test": 1}
    assert m["rejected"] == r.counts and m["rejected_examples"]["missing_prompt"] == [4, 5, 12]
    kept = {row.prompt: row.metadata for rows in all_rows(tmp_path / "out").values() for row in rows}
    assert kept == {'a sign that says "OPEN"': {}, "a mug with a word on it": {"ground_truth": "MUG"},
                    'a flag with "HI"': {}}
    summary = r.summary()
    assert "\n" not in summary and "missing_prompt 3 (lines 4, 5, 12" in summary and "bad_encoding 1 (line 3" in summary


def test_generic_kind_keeps_rows_without_ocr_target(tmp_path):
    src = write_lines(tmp_path / "in.jsonl", DEFECTIVE_JSONL)
    result = prepare_dataset(str(src), str(tmp_path / "out"), kind="generic")
    assert result.rejections.counts["no_ocr_target"] == 0 and result.manifest["rows"]["kept"] == 4


def test_token_limit_is_the_estimate(tmp_path):
    assert prep.estimate_tokens("a b c d") == 4  # short words: one token each at least
    assert prep.estimate_tokens("x" * 40) == 10  # one long word: characters / 4
    src = write_lines(tmp_path / "in.jsonl", [jl(prompt="x" * 40), jl(prompt="x" * 44)])
    result = prepare_dataset(str(src), str(tmp_path / "out"), max_prompt_tokens=10)
    assert result.rejections.examples["prompt_too_long"] == [2]
    assert "about 11 tokens, limit 10" in result.rejections.details["prompt_too_long"]


def test_only_the_first_five_line_numbers_are_listed(tmp_path):
    src = write_lines(tmp_path / "in.jsonl", [jl(prompt="same")] * 8)
    r = prepare_dataset(str(src), str(tmp_path / "out")).rejections
    assert r.counts["duplicate"] == 7 and r.examples["duplicate"] == [2, 3, 4, 5, 6]
    assert "duplicate 7 (lines 2, 3, 4, 5, 6, ...: first at line 1)" in r.summary()


def test_csv_defects_name_the_line_where_the_record_starts(tmp_path):
    src = tmp_path / "in.csv"
    src.write_bytes(b'prompt,ground_truth\n'              # 1 header
                    b'a red "EXIT" sign,EXIT\n'           # 2 kept
                    b'caf\xe9 menu,X\n'                   # 3 bad_encoding
                    b'too,many,fields\n'                  # 4 unparseable
                    b'"a prompt over\ntwo lines",\n'      # 5-6 kept, empty cell dropped
                    b',ORPHAN\n'                          # 7 missing_prompt
                    b'"a red\n""EXIT"" sign",EXIT\n')      # 8-9 duplicate of 2
    result = prepare_dataset(str(src), str(tmp_path / "out"))
    assert {k: v for k, v in result.rejections.examples.items() if v} == {
        "bad_encoding": [3], "unparseable": [4], "missing_prompt": [7], "duplicate": [8]}
    kept = {row.prompt: row.metadata for rows in all_rows(tmp_path / "out").values() for row in rows}
    assert kept == {'a red "EXIT" sign': {"ground_truth": "EXIT"}, "a prompt over two lines": {}}


def test_a_line_over_the_limit_is_rejected_unread_and_a_deep_one_does_not_crash(tmp_path, monkeypatch):
    # Before: a 300 MB single-line JSONL cost prepare-dataset 4.0 GB RSS and 41 s (and the row was kept); 100,000
    # nested brackets ended in a RecursionError traceback.
    monkeypatch.setattr(prep, "MAX_LINE_BYTES", 20_000)
    head = '{"prompt": "a long row", "pad": "'
    at_limit = head + "x" * (20_000 - len(head) - 2) + '"}'
    src = write_lines(tmp_path / "in.jsonl", [
        jl(prompt="a cat"),                               # 1 kept
        '{"prompt": "a dog", "x": "' + "0" * 30_000_000 + '"}',  # 2 line_too_long: 30 MB, never held
        "[" * 5000 + "]" * 5000,                          # 3 unparseable: nested past Python's stack
        at_limit,                                         # 4 kept: exactly the limit
        jl(prompt="a cow"),                               # 5 kept: reading goes on after the long line
    ])
    assert len(at_limit.encode()) == prep.MAX_LINE_BYTES
    prepare_dataset(str(write_lines(tmp_path / "warm.jsonl", [jl(prompt="a")])), str(tmp_path / "warm"))  # imports
    tracemalloc.start()
    try:
        result = prepare_dataset(str(src), str(tmp_path / "out"), test_fraction=0)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    r = result.rejections
    assert {k: v for k, v in r.examples.items() if v} == {"line_too_long": [2], "unparseable": [3]}
    assert r.details["line_too_long"] == "over 20000 bytes" and "recursion" in r.details["unparseable"]
    assert sorted(row.prompt for row in all_rows(tmp_path / "out")["train"]) == ["a cat", "a cow", "a long row"]
    assert peak < 10 * 2**20  # the long line's first 20 kB, then 1 MiB reads (before: the 30 MB line, parsed)
    csv_src = tmp_path / "in.csv"
    csv_src.write_text("prompt\na cat\n" + "a," * 20_000 + "\n")
    with pytest.raises(DataError, match=r"in\.csv:3: a line longer than 20000 characters"):
        prepare_dataset(str(csv_src), str(tmp_path / "csv"))


def test_a_byte_order_mark_is_not_part_of_the_first_record(tmp_path):
    (tmp_path / "in.jsonl").write_bytes(b"\xef\xbb\xbf" + jl(prompt="a cat").encode() + b"\n")
    (tmp_path / "in.csv").write_bytes(b"\xef\xbb\xbfprompt\na cat\n")
    for ext in ("jsonl", "csv"):
        result = prepare_dataset(str(tmp_path / f"in.{ext}"), str(tmp_path / ext))
        assert result.rejections.total == 0 and result.manifest["rows"]["kept"] == 1


def test_csv_and_parquet_without_a_prompt_column_are_refused(tmp_path):
    src = tmp_path / "in.csv"
    src.write_text("text,ground_truth\nhello,HI\n")
    with pytest.raises(DataError, match=r"in\.csv:1: .*'prompt'.*\['text', 'ground_truth'\]"):
        prepare_dataset(str(src), str(tmp_path / "out"))
    pq.write_table(pa.table({"text": ["a"]}), tmp_path / "in.parquet")
    with pytest.raises(DataError, match=r"in\.parquet: no 'prompt' column \(columns: \['text'\]\)"):
        prepare_dataset(str(tmp_path / "in.parquet"), str(tmp_path / "out"))


def test_parquet_rejections_are_numbered_by_row(tmp_path):
    table = pa.table({"prompt": ["a cat", None, "a  cat", "a dog"], "score": [1.0, 2.0, 3.0, float("nan")]})
    pq.write_table(table, tmp_path / "in.parquet")
    result = prepare_dataset(str(tmp_path / "in.parquet"), str(tmp_path / "out"))
    assert result.rejections.examples["missing_prompt"] == [2] and result.rejections.examples["duplicate"] == [3]
    assert "rows 3" not in result.rejections.summary() and "(row 3: first at row 1)" in result.rejections.summary()
    kept = {row.prompt: row.metadata for rows in all_rows(tmp_path / "out").values() for row in rows}
    assert kept == {"a cat": {"score": 1.0}, "a dog": {}}  # NaN is a missing value, like null


def test_fully_rejected_or_empty_input_is_an_error_listing_the_reasons(tmp_path):
    src = write_lines(tmp_path / "in.jsonl", [jl(prompt=""), "{oops", jl(prompt="no quotes")])
    with pytest.raises(DataError) as info:
        prepare_dataset(str(src), str(tmp_path / "out"), kind="ocr")
    message = str(info.value)
    assert "\n" not in message and "all 3 rows rejected" in message
    for needle in ("missing_prompt 1 (line 1", "unparseable 1 (line 2", "no_ocr_target 1 (line 3"):
        assert needle in message
    assert not (tmp_path / "out").exists()  # nothing is written
    empty = write_lines(tmp_path / "empty.jsonl", ["", "  "])
    with pytest.raises(DataError, match=r"empty\.jsonl: holds no rows"):
        prepare_dataset(str(empty), str(tmp_path / "out"))


@pytest.mark.parametrize(
    ("name", "kwargs", "needle"),
    [
        ("in.txt", {}, "unknown format; name the file .jsonl, .csv or .parquet"),
        ("missing.jsonl", {}, "missing.jsonl does not exist"),
        ("in.jsonl", {"test_fraction": 1.0}, "test_fraction must be in [0, 1)"),
        ("in.jsonl", {"max_prompt_tokens": 0}, "max_prompt_tokens must be at least 1"),
    ],
)
def test_bad_arguments_are_data_errors(tmp_path, name, kwargs, needle):
    write_lines(tmp_path / "in.txt", ["a cat"])
    write_lines(tmp_path / "in.jsonl", [jl(prompt="a cat")])
    with pytest.raises(DataError) as info:
        prepare_dataset(str(tmp_path / name), str(tmp_path / "out"), **kwargs)
    assert needle in str(info.value)


def test_unknown_builtin_is_named():
    with pytest.raises(DataError, match="unknown built-in prompt set 'nope'"):
        prepare_dataset("builtin:nope", "/nonexistent")


# ------------------------------------------------------------------------------------------ formats

ROWS = [
    {"prompt": 'a poster reading "HELLO"', "ground_truth": "HELLO", "style": "retro"},
    {"prompt": "a quiet lake at dawn", "style": "photo"},
    {"prompt": 'a mug that says "TEA"'},
    {"prompt": "a cat in a hat", "ground_truth": "HAT", "style": "ink"},
] + [{"prompt": f"a landscape, variation {i}", "style": "oil"} for i in range(10)]


def test_jsonl_csv_and_parquet_inputs_give_the_same_dataset(tmp_path):
    columns = ["prompt", "ground_truth", "style"]
    write_lines(tmp_path / "in.jsonl", [json.dumps(r) for r in ROWS])
    with open(tmp_path / "in.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, columns)
        writer.writeheader()
        writer.writerows(ROWS)
    pq.write_table(pa.table({c: [r.get(c) for r in ROWS] for c in columns}), tmp_path / "in.parquet")
    results = {ext: prepare_dataset(str(tmp_path / f"in.{ext}"), str(tmp_path / ext), kind="generic", seed=3)
               for ext in ("jsonl", "csv", "parquet")}
    hashes = {r.manifest["content_sha256"] for r in results.values()}
    assert len(hashes) == 1
    datasets = [all_rows(tmp_path / ext) for ext in results]
    assert datasets[0] == datasets[1] == datasets[2]
    by_prompt = {row.prompt: row.metadata for rows in datasets[0].values() for row in rows}
    assert by_prompt['a poster reading "HELLO"'] == {"ground_truth": "HELLO", "style": "retro"}
    assert by_prompt['a mug that says "TEA"'] == {}
    assert sum(len(rows) for rows in datasets[0].values()) == len(ROWS)


# ------------------------------------------------------------------------------------------ split + manifest

def _prompts(n: int) -> list[str]:
    return [f"prompt number {i}" for i in range(n)]


def test_split_is_deterministic_disjoint_complete_and_seed_dependent(tmp_path):
    lines = [jl(prompt=p) for p in _prompts(50)]
    src = write_lines(tmp_path / "a.jsonl", lines)
    shuffled = lines[:]
    random.Random(0).shuffle(shuffled)
    src_shuffled = write_lines(tmp_path / "b.jsonl", shuffled)
    a = prepare_dataset(str(src), str(tmp_path / "a"), seed=7, test_fraction=0.1)
    again = prepare_dataset(str(src), str(tmp_path / "again"), seed=7, test_fraction=0.1)
    b = prepare_dataset(str(src_shuffled), str(tmp_path / "b"), seed=7, test_fraction=0.1)
    other = prepare_dataset(str(src), str(tmp_path / "other"), seed=8, test_fraction=0.1)
    split_a = all_rows(tmp_path / "a")
    assert split_a == all_rows(tmp_path / "again") == all_rows(tmp_path / "b")
    assert a.manifest["content_sha256"] == again.manifest["content_sha256"] == b.manifest["content_sha256"]
    train = {r.prompt for r in split_a["train"]}
    test = {r.prompt for r in split_a["test"]}
    assert len(test) == 5 and not train & test and train | test == set(_prompts(50))
    assert [row_id(r.prompt) for r in split_a["train"]] == sorted(row_id(r.prompt) for r in split_a["train"])
    other_test = {r.prompt for r in all_rows(tmp_path / "other")["test"]}
    assert other_test != test and len(other_test) == 5
    assert other.manifest["content_sha256"] != a.manifest["content_sha256"]


@pytest.mark.parametrize(("n", "fraction", "n_test"), [(1, 0.1, 0), (2, 0.1, 1), (3, 0.9, 2), (20, 0.0, 0),
                                                       (20, 0.25, 5)])
def test_split_sizes(n, fraction, n_test):
    rows = [PromptRow(p) for p in _prompts(n)]
    splits = split_rows(rows, fraction, seed=0)
    assert len(splits["test"]) == n_test and len(splits["train"]) == n - n_test


def test_manifest_hash_follows_the_content_not_whitespace(tmp_path):
    def content_hash(name: str, rows: list[dict]) -> str:
        src = write_lines(tmp_path / f"{name}.jsonl", [json.dumps(r) for r in rows])
        return prepare_dataset(str(src), str(tmp_path / name)).manifest["content_sha256"]

    base = [{"prompt": p, "tag": "x"} for p in _prompts(10)]
    h = content_hash("base", base)
    changed_prompt = [*base[:3], {"prompt": "prompt number 3!", "tag": "x"}, *base[4:]]
    changed_meta = [*base[:3], {"prompt": "prompt number 3", "tag": "y"}, *base[4:]]
    spaced = [{"prompt": f"  {r['prompt'].replace(' ', '   ')} ", "tag": "x"} for r in base]
    assert content_hash("prompt", changed_prompt) != h
    assert content_hash("meta", changed_meta) != h
    assert content_hash("spaced", spaced) == h


def test_progress_lines_while_reading(tmp_path, monkeypatch):
    monkeypatch.setattr(prep, "PROGRESS_INTERVAL_S", 0.0)
    src = write_lines(tmp_path / "in.jsonl", [jl(prompt=p) for p in _prompts(5)])
    lines: list[str] = []
    prepare_dataset(str(src), str(tmp_path / "out"), progress=lines.append)
    assert any(re.search(r"in\.jsonl: 3 records read, 2 kept, 0 rejected", line) for line in lines)
    assert lines[-1].endswith("5 records read, 5 kept, 0 rejected")


# ------------------------------------------------------------------------------------------ built-in sets

@pytest.mark.parametrize("name", ["ocr", "aesthetic", "compositional"])
def test_builtin_sets_prepare_without_rejections(tmp_path, name):
    n_lines = len(builtin_source(name).read_text(encoding="utf-8").splitlines())
    result = prepare_dataset(f"builtin:{name}", str(tmp_path / name))
    assert result.rejections.total == 0 and n_lines >= 50
    assert result.manifest["rows"]["kept"] == n_lines and result.manifest["source"] == f"builtin:{name}"
    assert result.manifest["kind"] == ("ocr" if name == "ocr" else "generic")


def test_builtin_ocr_rows_all_have_their_quoted_text_as_target(tmp_path):
    prepare_dataset("builtin:ocr", str(tmp_path / "ocr"))
    rows = [r for rows in all_rows(tmp_path / "ocr").values() for r in rows]
    for row in rows:
        quoted = re.findall(r'"([^"]+)"', row.prompt)
        assert quoted == [row.metadata["ground_truth"]], row.prompt
        assert target_text(row.prompt, row.metadata) == quoted[0]


def test_builtin_compositional_metadata_matches_the_prompt(tmp_path):
    prepare_dataset("builtin:compositional", str(tmp_path / "c"))
    for row in (r for rows in all_rows(tmp_path / "c").values() for r in rows):
        m = row.metadata
        assert len(m["objects"]) == len(m["counts"]) == len(m["colors"]) == 2 and m["relation"] in row.prompt
        for obj, count, colour in zip(m["objects"], m["counts"], m["colors"], strict=True):
            number = "an?" if count == 1 else ["two", "three", "four"][count - 2]
            # obj[:4]: the plural may change the ending (cactus, cacti)
            assert re.search(rf"\b{number} {colour} {re.escape(obj[:4])}", row.prompt), (row.prompt, obj)


def test_builtin_aesthetic_refused_as_ocr(tmp_path):
    with pytest.raises(DataError, match="all 60 rows rejected: no_ocr_target 60"):
        prepare_dataset("builtin:aesthetic", str(tmp_path / "a"), kind="ocr")


# ------------------------------------------------------------------------------------------ reading it back

def test_data_config_reads_a_prepared_dataset(tmp_path):
    src = write_lines(tmp_path / "in.jsonl", [json.dumps(r) for r in ROWS])
    out = tmp_path / "prepared"
    result = prepare_dataset(str(src), str(out), seed=1, test_fraction=0.1)
    expected = all_rows(out)
    train = load_prompt_rows(DataConfig(prompts=None, path=str(out)))
    assert train == expected["train"] and len(train) == result.manifest["rows"]["train"] == 13
    assert any(r.metadata.get("ground_truth") == "HELLO" for r in [*train, *expected["test"]])
    assert load_prompt_rows(DataConfig(prompts=None, path=str(out), split="test")) == expected["test"]
    assert load_prompts(DataConfig(prompts=None, path=str(out))) == [r.prompt for r in train]
    assert dataset_hash(DataConfig(prompts=None, path=str(out))) == result.manifest["content_sha256"]
    assert dataset_hash(DataConfig()) is None
    # Preparing again into the same folder replaces it whole.
    prepare_dataset(str(src), str(out), seed=2)
    assert load_prompt_rows(DataConfig(prompts=None, path=str(out))) == all_rows(out)["train"] != train


def test_a_modified_split_file_is_detected(tmp_path):
    src = write_lines(tmp_path / "in.jsonl", [jl(prompt=p) for p in _prompts(10)])
    out = tmp_path / "prepared"
    prepare_dataset(str(src), str(out))
    table = pq.read_table(out / "train.parquet")
    prompts = table.column("prompt").to_pylist()
    prompts[0] = "something else"
    pq.write_table(table.set_column(1, "prompt", pa.array(prompts)), out / "train.parquet")
    with pytest.raises(DataError, match=r"train\.parquet does not match manifest\.json"):
        load_prompt_rows(DataConfig(prompts=None, path=str(out)))
    (out / "manifest.json").unlink()
    with pytest.raises(DataError, match=r"must be a \.txt or \.jsonl file or a prepared dataset folder"):
        load_prompt_rows(DataConfig(prompts=None, path=str(out)))


def test_split_field_needs_a_prepared_dataset(tmp_path):
    with pytest.raises(ValidationError, match=r"data\.split 'test' needs data\.path"):
        DataConfig(split="test")
    jsonl = write_lines(tmp_path / "p.jsonl", [jl(prompt="a cat", ground_truth="CAT")])
    assert load_prompt_rows(DataConfig(prompts=None, path=str(jsonl))) == [PromptRow("a cat", {"ground_truth": "CAT"})]
    with pytest.raises(DataError, match=r"data\.split 'test' needs a prepared dataset"):
        load_prompt_rows(DataConfig(prompts=None, path=str(jsonl), split="test"))


def test_the_command_and_the_function_split_as_the_pipeline_step_does_by_default():
    """`flowgrpo prepare-dataset`, prepare_dataset() and the pipeline's `dataset:` section share their defaults."""
    import inspect

    from components.dataset.config import PrepareConfig
    from pipeline.cli import build_parser

    schema = PrepareConfig()
    args = build_parser().parse_args(["prepare-dataset", "--builtin", "ocr", "--output", "out"])
    signature = inspect.signature(prepare_dataset).parameters
    for key in ("test_fraction", "seed", "max_prompt_tokens"):
        assert getattr(args, key) == signature[key].default == getattr(schema, key), key
    assert schema.test_fraction == 0.25
