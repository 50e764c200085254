"""Turn user prompt data (JSONL, CSV or Parquet; local or ``s3://``) into a prepared dataset.

Every input row needs a non-empty string ``prompt``; every other field or column becomes a metadata key
(null / empty values are dropped, so an empty CSV cell and a missing JSON key mean the same). Rows are
checked and the bad ones rejected with a reason, counted and reported with their line numbers; the rest are
split into train and test by seed and written as described in ``prepared.py``.

Choices, and why:
- Length limit: ``max_prompt_tokens`` (default 256, what SD3's T5 encoder takes; the CLIP encoders take 77
  and silently truncate, which the T5 copy of the prompt makes up for). Tokens are *estimated* without a
  tokenizer as ``max(words, ceil(characters / 4))``: English averages about 4.5 characters per T5 token and
  one word is at least one token, so the estimate errs towards rejecting. A too-long prompt is rejected,
  not truncated: the encoder would drop its tail silently while rewards still score the whole prompt.
- Duplicates are rows whose prompts are equal after whitespace normalisation and whose input images have the same
  pixels; the first is kept.
- Input images (a row's ``images``: a path relative to the source file's folder and inside it, a ``data:`` URL,
  with ``allow_external`` an absolute path or an ``s3://`` URI; one or a list of at most ``MAX_IMAGES_PER_ROW``)
  are read and checked as hostile input (``input_images.check_image``): a row whose image is outside the folder,
  missing, unreadable, over the file-size or pixel limit or of a size the model cannot take (with
  ``resolution``) is rejected with its reason, like any bad row. Each image is stored once, re-encoded as PNG,
  under ``images/``.
- A JSONL or CSV line longer than ``MAX_LINE_BYTES`` is not parsed: a JSONL row is rejected (``line_too_long``)
  and the rest of its line skipped unread; a CSV file is refused at that line (a CSV reader cannot find the next
  record's start when a line, which may end inside a quoted field, is skipped).
- Split: rows are ranked by ``sha256(f"{seed}:{id}")`` and the first ``round(n * test_fraction)`` (at least
  one when there are two rows or more and ``test_fraction > 0``, never all) form the test split. A row's
  split depends only on the seed, its prompt and the row count, not on the input order. Rows with input images
  are ranked by their first image instead, and every row of one image goes where the first goes: an edit of a
  picture seen in training would not test anything held out.
"""

from __future__ import annotations

import csv
import hashlib
import json
import logging
import math
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import IO, Any, Literal, NamedTuple

from components import storage
from components.dataset.config import BUILTIN_KINDS, PrepareConfig
from components.dataset.input_images import (
    MAX_IMAGES_PER_ROW,
    InputImageError,
    check_image,
    pixels_name,
    png_bytes,
    resolve,
    too_many,
)
from components.dataset.prepared import (
    MANIFEST_NAME,
    SCHEMA_VERSION,
    SPLITS,
    PromptRow,
    dataset_sha256,
    metadata_json,
    normalize_prompt,
    row_id,
    rows_sha256,
    write_split,
)
from components.errors import DataError
from components.rewards.text_match import target_text

log = logging.getLogger(__name__)

Kind = Literal["ocr", "generic"]
BUILTIN_DIR = Path(__file__).resolve().parent / "builtin"
BUILTIN_PREFIX = "builtin:"

# The longest JSONL or CSV line read: a row with four inline (data: URL) images of 1.5 MiB each; larger images go
# in files beside it. Parsing a line costs up to ~50 times its length (a JSON list of empty lists), so one row
# costs at most ~500 MB RSS (measured: 480 MB in `validate`), where a 300 MB line cost 4 GB.
MAX_LINE_BYTES = 8 * 2**20
# Reason key -> what it means (in report order).
REASONS = {
    "unparseable": "record does not parse",
    "bad_encoding": "not valid UTF-8",
    "missing_prompt": "missing, empty or non-string prompt",
    "prompt_too_long": "prompt longer than max_prompt_tokens (estimated)",
    "no_ocr_target": "no quoted text and no ground_truth",
    "duplicate": "same prompt (and input images) as an earlier row",
    "line_too_long": f"line longer than {MAX_LINE_BYTES} bytes",
    "bad_images": "images is not a string or a list of strings",
    "too_many_images": f"more than {MAX_IMAGES_PER_ROW} input images",
    "image_outside": "an input image outside the source file's folder, or not allowed there",
    "image_missing": "an input image does not exist",
    "image_unreadable": "an input image is corrupt or not PNG / JPEG",
    "image_too_large": "an input image is over the file-size or pixel limit",
    "image_size": "an input image of a size the model cannot take",
}
MAX_EXAMPLES = 5
# Seconds between progress lines while reading; tests lower it.
PROGRESS_INTERVAL_S = 5.0
_FORMATS = {".jsonl": "jsonl", ".ndjson": "jsonl", ".csv": "csv", ".parquet": "parquet", ".pq": "parquet"}


@dataclass
class Rejections:
    """Rejected rows per reason: a count, the first line (or Parquet row) numbers and the first detail."""

    unit: str = "line"
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(REASONS, 0))
    examples: dict[str, list[int]] = field(default_factory=lambda: {r: [] for r in REASONS})
    details: dict[str, str] = field(default_factory=dict)

    def add(self, reason: str, where: int, detail: str = "") -> None:
        self.counts[reason] += 1
        if len(self.examples[reason]) < MAX_EXAMPLES:
            self.examples[reason].append(where)
        if detail and reason not in self.details:
            self.details[reason] = detail

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def summary(self) -> str:
        """One line: ``reason N (lines a, b, ...: first detail); ...`` for each reason that occurred."""
        parts = []
        for reason, n in self.counts.items():
            if n:
                where = ", ".join(map(str, self.examples[reason])) + (", ..." if n > MAX_EXAMPLES else "")
                detail = f": {self.details[reason]}" if reason in self.details else ""
                unit = self.unit if n == 1 else f"{self.unit}s"
                parts.append(f"{reason} {n} ({unit} {where}{detail})")
        return "; ".join(parts) or "none"


@dataclass(frozen=True)
class PreparedDataset:
    """Where a prepared dataset was written, its manifest and what was rejected."""

    uri: str
    train_uri: str
    test_uri: str
    manifest_uri: str
    manifest: dict[str, Any]
    rejections: Rejections


class _Record(NamedTuple):
    where: int  # 1-based line (JSONL, CSV: where the record starts) or row (Parquet)
    fields: dict[str, Any] | None  # None when the record was rejected while reading
    reason: str = ""
    detail: str = ""


def estimate_tokens(prompt: str) -> int:
    """A tokenizer-free upper-leaning estimate of T5 tokens (see the module docstring)."""
    return max(len(prompt.split()), math.ceil(len(prompt) / 4))


def _present(value: Any) -> bool:
    return value is not None and value != "" and not (isinstance(value, float) and math.isnan(value))


def _utf8(text: str) -> bool:
    # Files are decoded with surrogateescape: invalid bytes, and only they, become lone surrogates.
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return True


def bounded_lines(f: IO[bytes]) -> Iterator[tuple[int, bytes | None]]:
    """(number, bytes) of each line of ``f``; None for a line over ``MAX_LINE_BYTES``, whose rest is skipped a MiB
    at a time, never held."""
    lineno = 0
    while raw := f.readline(MAX_LINE_BYTES + 1):
        lineno += 1
        if len(raw) > MAX_LINE_BYTES and not raw.endswith(b"\n"):
            while (rest := f.readline(2**20)) and not rest.endswith(b"\n"):
                pass
            yield lineno, None
        else:
            yield lineno, raw


def _jsonl_records(path: Path, source: str) -> Iterator[_Record]:
    with path.open("rb") as f:
        for lineno, raw in bounded_lines(f):
            if raw is None:
                yield _Record(lineno, None, "line_too_long", f"over {MAX_LINE_BYTES} bytes")
                continue
            try:
                text = raw.decode()
            except UnicodeDecodeError as exc:
                yield _Record(lineno, None, "bad_encoding", f"invalid byte at column {exc.start + 1}")
                continue
            if lineno == 1:
                text = text.removeprefix("\ufeff")
            if not text.strip():
                continue
            try:
                obj = json.loads(text)
            except (ValueError, RecursionError) as exc:  # RecursionError: nested deeper than Python's stack
                yield _Record(lineno, None, "unparseable", f"bad JSON: {getattr(exc, 'msg', exc)}")
                continue
            if not isinstance(obj, dict):
                yield _Record(lineno, None, "unparseable", f"a JSON {type(obj).__name__}, not an object")
                continue
            yield _Record(lineno, obj)


def _csv_lines(f: IO[str], source: str) -> Iterator[str]:
    lineno = 0
    while line := f.readline(MAX_LINE_BYTES + 1):
        lineno += 1
        if len(line) > MAX_LINE_BYTES:
            raise DataError(f"{source}:{lineno}: a line longer than {MAX_LINE_BYTES} characters; split the record "
                            "or give its images as files beside the CSV")
        yield line


def _csv_records(path: Path, source: str) -> Iterator[_Record]:
    with path.open(encoding="utf-8-sig", errors="surrogateescape", newline="") as f:
        reader = csv.reader(_csv_lines(f, source))
        header = next(reader, None)
        if header is None:
            return
        if not all(map(_utf8, header)) or "prompt" not in header or len(set(header)) != len(header):
            raise DataError(f"{source}:1: the CSV header must be UTF-8 with distinct column names including "
                            f"'prompt' (got {header!r})")
        end = reader.line_num
        while True:
            try:
                fields = next(reader)
            except StopIteration:
                return
            except csv.Error as exc:
                start, end = end + 1, reader.line_num
                yield _Record(start, None, "unparseable", f"bad CSV: {exc}")
                continue
            start, end = end + 1, reader.line_num
            if not fields:  # a blank line
                continue
            if not all(map(_utf8, fields)):
                yield _Record(start, None, "bad_encoding", "invalid UTF-8 bytes")
            elif len(fields) != len(header):
                yield _Record(start, None, "unparseable", f"{len(fields)} fields where the header has {len(header)}")
            else:
                yield _Record(start, dict(zip(header, fields, strict=True)))


def _parquet_records(path: Path, source: str) -> Iterator[_Record]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{source}: not a readable Parquet file ({exc})") from exc
    if "prompt" not in parquet.schema_arrow.names:
        raise DataError(f"{source}: no 'prompt' column (columns: {parquet.schema_arrow.names})")
    n = 0
    try:
        for batch in parquet.iter_batches(batch_size=4096):
            for fields in batch.to_pylist():
                n += 1
                yield _Record(n, fields)
    except (pa.ArrowException, UnicodeDecodeError) as exc:
        raise DataError(f"{source}: cannot read the Parquet rows after row {n} ({exc})") from exc


def check_row(fields: dict[str, Any], kind: Kind, max_prompt_tokens: int, base: str,
              allow_external: bool = False) -> tuple[PromptRow | None, str, str]:
    """The row a record makes, or None with the reason (a key of ``REASONS``) and a detail. The one row check:
    `prepare-dataset` rejects such a row, a training run reading a prompt file directly stops on it. Input images
    are only named here (``input_images.resolve``: relative to the file ``base`` and inside its folder, absolute
    paths and URIs with ``allow_external``); reading them is ``input_images.check_image``'s."""
    prompt = fields.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        return None, "missing_prompt", "" if prompt is None else f"prompt is {prompt!r}"[:80]
    prompt = normalize_prompt(prompt)
    tokens = estimate_tokens(prompt)
    if tokens > max_prompt_tokens:
        return None, "prompt_too_long", f"about {tokens} tokens, limit {max_prompt_tokens}"
    images: tuple[str, ...] = ()
    if _present(fields.get("images")) and fields.get("images") != []:
        refs = [fields["images"]] if isinstance(fields["images"], str) else fields["images"]
        if not isinstance(refs, list | tuple) or not all(isinstance(r, str) and r.strip() for r in refs):
            return None, "bad_images", f"images is {fields['images']!r}"[:80]
        problem = too_many(len(refs))
        if problem:
            return None, "too_many_images", problem
        try:
            images = tuple(resolve(r.strip(), base, allow_external) for r in refs)
        except InputImageError as exc:
            return None, exc.reason, str(exc)[:400]
    metadata = {k: v for k, v in fields.items() if k not in ("prompt", "images") and _present(v)}
    try:
        metadata_json(metadata)
    except (TypeError, ValueError, RecursionError) as exc:
        return None, "unparseable", f"metadata not JSON-serialisable ({exc})"
    if kind == "ocr" and not target_text(prompt, metadata).strip():
        return None, "no_ocr_target", ""
    return PromptRow(prompt, metadata, images), "", ""


def _stored_images(row: PromptRow, resolution: int | None,
                   store: dict[str, bytes]) -> tuple[PromptRow | None, str, str]:
    """The row with its input images read, checked and named as stored (their PNGs added to ``store``), or None
    with the reason and a detail."""
    names = []
    for ref in row.images:
        try:
            image = check_image(ref, resolution)
        except InputImageError as exc:
            return None, exc.reason, str(exc)[:200]
        name = pixels_name(image)
        if name not in store:
            store[name] = png_bytes(image)
        names.append(name)
    return replace(row, images=tuple(names)), "", ""


def _read_rows(path: Path, source: str, kind: Kind, max_prompt_tokens: int, resolution: int | None,
               allow_external: bool, store: dict[str, bytes],
               progress: Callable[[str], None]) -> tuple[list[PromptRow], Rejections, int]:
    fmt = _FORMATS.get(path.suffix.lower())
    if fmt is None:
        raise DataError(f"{source}: unknown format; name the file .jsonl, .csv or .parquet")
    records = {"jsonl": _jsonl_records, "csv": _csv_records, "parquet": _parquet_records}[fmt](path, source)
    rejections = Rejections(unit="row" if fmt == "parquet" else "line")
    rows: list[PromptRow] = []
    first_seen: dict[tuple[str, tuple[str, ...]], int] = {}
    base = str(path) if source.startswith(BUILTIN_PREFIX) else source
    n = 0
    last = time.monotonic()
    for record in records:
        n += 1
        if time.monotonic() - last >= PROGRESS_INTERVAL_S:
            last = time.monotonic()
            progress(f"{source}: {n} records read, {len(rows)} kept, {rejections.total} rejected")
        if record.fields is None:
            rejections.add(record.reason, record.where, record.detail)
            continue
        row, reason, detail = check_row(record.fields, kind, max_prompt_tokens, base, allow_external)
        if row is not None and row.images:
            row, reason, detail = _stored_images(row, resolution, store)
        if row is not None and row.key in first_seen:
            row, reason, detail = None, "duplicate", f"first at {rejections.unit} {first_seen[row.key]}"
        if row is None:
            rejections.add(reason, record.where, detail)
            continue
        first_seen[row.key] = record.where
        rows.append(row)
    return rows, rejections, n


def split_rows(rows: list[PromptRow], test_fraction: float, seed: int) -> dict[str, list[PromptRow]]:
    """Deterministic train/test split (see the module docstring); each split sorted by id."""
    n = len(rows)
    n_test = 0 if n < 2 or test_fraction <= 0 else min(n - 1, max(1, round(n * test_fraction)))
    groups: dict[str, list[PromptRow]] = {}
    for row in rows:  # a text row is a group of its own; rows of one first input image are one group
        groups.setdefault(row.images[0] if row.images else row_id(row.prompt), []).append(row)
    ranked = sorted(groups, key=lambda g: hashlib.sha256(f"{seed}:{g}".encode()).digest())
    test: list[PromptRow] = []
    for group in ranked[:-1]:  # never all: the last group trains
        if len(test) >= n_test:
            break
        test += groups[group]
    held = {id(r) for r in test}
    by_id = lambda r: row_id(r.prompt, r.images)  # noqa: E731
    return {"train": sorted((r for r in rows if id(r) not in held), key=by_id), "test": sorted(test, key=by_id)}


def builtin_source(name: str) -> Path:
    """The JSONL file of a built-in prompt set."""
    if name not in BUILTIN_KINDS:
        raise DataError(f"unknown built-in prompt set {name!r}; choose one of {sorted(BUILTIN_KINDS)}")
    return BUILTIN_DIR / f"{name}.jsonl"


def prepare_dataset(source: str, output: str, *, kind: Kind | None = None,
                    test_fraction: float = PrepareConfig.default_of("test_fraction"),
                    seed: int = PrepareConfig.default_of("seed"),
                    max_prompt_tokens: int = PrepareConfig.default_of("max_prompt_tokens"),
                    resolution: int | None = None, allow_external: bool = False,
                    progress: Callable[[str], None] | None = None) -> PreparedDataset:
    """Validate ``source`` (a path, an ``s3://`` URI or ``builtin:NAME``), split it and write it to ``output``.

    ``kind`` "ocr" also rejects rows without a text to render; it defaults to "ocr" for ``builtin:ocr`` and
    "generic" otherwise. ``resolution``: the model's, to reject input images of a size it cannot take.
    ``allow_external``: also read input images named by absolute paths and URIs (``data.allow_external_images``).
    Raises DataError when nothing usable is left, listing the reasons.
    """
    progress = progress or log.info
    if not 0 <= test_fraction < 1:
        raise DataError(f"test_fraction must be in [0, 1), got {test_fraction}")
    if max_prompt_tokens < 1:
        raise DataError(f"max_prompt_tokens must be at least 1, got {max_prompt_tokens}")
    builtin = source.removeprefix(BUILTIN_PREFIX) if source.startswith(BUILTIN_PREFIX) else None
    kind = kind or (BUILTIN_KINDS.get(builtin, "generic") if builtin else "generic")
    with tempfile.TemporaryDirectory(prefix="flowgrpo-dataset-") as tmp:
        if builtin is not None:
            local = builtin_source(builtin)
        elif storage.is_remote(source):
            # A fresh download each time: a cached copy would go stale when the object is replaced.
            local = Path(tmp) / f"input{PurePosixPath(source).suffix}"
            storage.get_file(source, local)
        else:
            local = Path(source)
            if not local.is_file():
                raise DataError(f"{source} does not exist or is not a file")
        store: dict[str, bytes] = {}
        rows, rejections, n_records = _read_rows(local, source if builtin is None else BUILTIN_PREFIX + builtin,
                                                 kind, max_prompt_tokens, resolution, allow_external, store,
                                                 progress)
        if not rows:
            what = f"all {n_records} rows rejected: {rejections.summary()}" if n_records else "holds no rows"
            raise DataError(f"{source}: {what}")
        progress(f"{source}: {n_records} records read, {len(rows)} kept, {rejections.total} rejected")
        splits = split_rows(rows, test_fraction, seed)
        split_hashes = {s: rows_sha256(splits[s]) for s in SPLITS}
        manifest = {
            "schema_version": SCHEMA_VERSION,
            "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "source": source,
            "kind": kind,
            "seed": seed,
            "test_fraction": test_fraction,
            "max_prompt_tokens": max_prompt_tokens,
            "rows": {"input": n_records, "kept": len(rows), "rejected": rejections.total,
                     **{s: len(splits[s]) for s in SPLITS}},
            "rejected": rejections.counts,
            "rejected_examples": {r: v for r, v in rejections.examples.items() if v},
            "rejected_unit": rejections.unit,
            "content_sha256": dataset_sha256(split_hashes),
            "splits": {s: {"file": f"{s}.parquet", "rows": len(splits[s]), "sha256": split_hashes[s]}
                       for s in SPLITS},
            "columns": {"id": "16 hex digits of sha256(prompt and image names)", "prompt": "string",
                        "images": "list of images/<16 hex of sha256(pixels)>.png",
                        "metadata": "JSON object as a string"},
            "images": len({name for r in rows for name in r.images}),
        }
        manifest_uri = storage.join(output, MANIFEST_NAME)
        # An old manifest must never describe the new split files while they are being replaced.
        storage.delete(manifest_uri)
        for i, (name, data) in enumerate(sorted(store.items()), start=1):
            if name in {n for r in rows for n in r.images}:
                storage.put_bytes(data, storage.join(output, name))
            if i % 500 == 0:
                progress(f"{output}: {i}/{len(store)} input images stored")
        for s in SPLITS:
            write_split(splits[s], Path(tmp) / f"{s}.parquet")
            storage.put_file(Path(tmp) / f"{s}.parquet", storage.join(output, f"{s}.parquet"))
        storage.put_bytes(json.dumps(manifest, indent=1).encode() + b"\n", manifest_uri)
    return PreparedDataset(uri=output, train_uri=storage.join(output, "train.parquet"),
                           test_uri=storage.join(output, "test.parquet"), manifest_uri=manifest_uri,
                           manifest=manifest, rejections=rejections)
