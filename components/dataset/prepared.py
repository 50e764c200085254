"""The prepared-dataset format: written by ``prepare.py``, read by ``prompts.py``.

A prepared dataset is a folder (local directory or ``s3://`` prefix) holding ``train.parquet``,
``test.parquet`` and ``manifest.json``. Each Parquet file has three string columns: ``id`` (16 hex digits
of the SHA-256 of the prompt, stable across preparations), ``prompt`` (whitespace-normalised) and
``metadata`` (a JSON object as text: rows carry different keys, and JSON keeps their values exactly, where
a Parquet struct would force one schema on every row and fill the gaps with nulls). Rows are sorted by
``id``, so the same rows give the same files whatever order the input had.

The manifest is written last, so a folder without one is incomplete. It holds, per split, the row count
and the SHA-256 of the canonical rows (below); a reader recomputes it, which catches split files that do
not belong to the manifest.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from components import storage
from components.errors import DataError

SCHEMA_VERSION = 1
MANIFEST_NAME = "manifest.json"
SPLITS = ("train", "test")
COLUMNS = ("id", "prompt", "metadata")


@dataclass(frozen=True)
class PromptRow:
    """One training prompt and its metadata (e.g. ``ground_truth`` for the OCR reward)."""

    prompt: str
    metadata: dict[str, Any] = field(default_factory=dict)


def normalize_prompt(prompt: str) -> str:
    """Runs of whitespace become one space, ends stripped: the form that is stored, deduplicated and hashed."""
    return " ".join(prompt.split())


def row_id(prompt: str) -> str:
    """The stable id of a prompt: 16 hex digits of the SHA-256 of its normalised text."""
    return hashlib.sha256(normalize_prompt(prompt).encode()).hexdigest()[:16]


def metadata_json(metadata: dict[str, Any]) -> str:
    """Canonical JSON text of a metadata dict (sorted keys), as stored and hashed."""
    return json.dumps(metadata, sort_keys=True, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def rows_sha256(rows: Iterable[PromptRow]) -> str:
    """SHA-256 over the canonical rows in the order given: one ``id \\t prompt \\t metadata`` line each."""
    h = hashlib.sha256()
    for row in rows:
        h.update(f"{row_id(row.prompt)}\t{row.prompt}\t{metadata_json(row.metadata)}\n".encode())
    return h.hexdigest()


def dataset_sha256(split_hashes: dict[str, str]) -> str:
    """The content hash of a whole prepared dataset: its rows and which split each is in."""
    return hashlib.sha256("".join(f"{s}\t{split_hashes[s]}\n" for s in SPLITS).encode()).hexdigest()


def write_split(rows: list[PromptRow], path: Path) -> None:
    """Write rows (already in id order) as a Parquet file with the three string columns."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({
        "id": pa.array([row_id(r.prompt) for r in rows], pa.string()),
        "prompt": pa.array([r.prompt for r in rows], pa.string()),
        "metadata": pa.array([metadata_json(r.metadata) for r in rows], pa.string()),
    })
    pq.write_table(table, path)


def read_manifest(uri: str) -> dict[str, Any]:
    """The manifest of the prepared dataset at ``uri`` (the folder); DataError when unusable."""
    where = storage.join(uri, MANIFEST_NAME)
    try:
        manifest = json.loads(storage.get_bytes(where))
    except (ValueError, UnicodeDecodeError) as exc:
        raise DataError(f"{where}: not a JSON manifest ({exc}); re-run `flowgrpo prepare-dataset`") from exc
    if not isinstance(manifest, dict) or manifest.get("schema_version") != SCHEMA_VERSION:
        version = manifest.get("schema_version") if isinstance(manifest, dict) else None
        raise DataError(f"{where}: schema_version {version!r}, this version reads {SCHEMA_VERSION}; "
                        "re-run `flowgrpo prepare-dataset`")
    return manifest


def read_split(uri: str, split: str) -> tuple[list[PromptRow], dict[str, Any]]:
    """The rows of one split of the prepared dataset at ``uri``, checked against its manifest."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    manifest = read_manifest(uri)
    info = manifest.get("splits", {}).get(split)
    if not isinstance(info, dict):
        raise DataError(f"{storage.join(uri, MANIFEST_NAME)}: no split {split!r}")
    where = storage.join(uri, f"{split}.parquet")
    try:
        # Prompt sets are small; reading the bytes avoids a cached local copy going stale on re-preparation.
        table = pq.read_table(pa.BufferReader(storage.get_bytes(where)))
    except pa.ArrowException as exc:
        raise DataError(f"{where}: not a readable Parquet file ({exc})") from exc
    if tuple(table.column_names) != COLUMNS:
        raise DataError(f"{where}: columns {table.column_names}, expected {list(COLUMNS)}")
    try:
        rows = [PromptRow(p, json.loads(m)) for p, m in zip(table.column("prompt").to_pylist(),
                                                            table.column("metadata").to_pylist(), strict=True)]
        matches = len(rows) == info.get("rows") and rows_sha256(rows) == info.get("sha256")
    except (TypeError, ValueError, AttributeError):  # nulls or non-JSON text: not written by prepare.py
        matches = False
    if not matches:
        raise DataError(f"{where} does not match {MANIFEST_NAME} beside it (rows or content hash differ): "
                        "the folder was modified or is half re-written; re-run `flowgrpo prepare-dataset`")
    return rows, manifest
