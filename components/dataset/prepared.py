"""The prepared-dataset format: written by ``prepare.py``, read by ``prompts.py``.

A prepared dataset is a folder (local directory or ``s3://`` prefix) holding ``train.parquet``,
``test.parquet``, ``manifest.json`` and, when rows carry input images (editing, image-to-video), ``images/``.
Each Parquet file has four columns: ``id`` (16 hex digits of the SHA-256 of the prompt and its images, stable
across preparations), ``prompt`` (whitespace-normalised), ``images`` (a list of strings: each input image as
``images/<16 hex of its pixels' SHA-256>.png`` inside the folder, stored once however many rows use it; empty
for a text-to-image row) and ``metadata`` (a JSON object as text: rows carry different keys, and JSON keeps
their values exactly, where a Parquet struct would force one schema on every row and fill the gaps with nulls).
Rows are sorted by ``id``, so the same rows give the same files whatever order the input had. Schema version 1
(no ``images`` column) is still read. A reader takes an image name only in that form and only when it stays
inside the folder with symbolic links resolved: a dataset reads nothing but what it holds.

The manifest is written last, so a folder without one is incomplete. It holds, per split, the row count
and the SHA-256 of the canonical rows (below); a reader recomputes it, which catches split files that do
not belong to the manifest.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from components import storage
from components.errors import DataError

SCHEMA_VERSION = 2
READABLE_VERSIONS = (1, 2)
MANIFEST_NAME = "manifest.json"
IMAGES_DIR = "images"
IMAGE_NAME = re.compile(rf"{IMAGES_DIR}/[0-9a-f]{{16}}\.png")
SPLITS = ("train", "test")
COLUMNS = ("id", "prompt", "images", "metadata")


@dataclass(frozen=True)
class PromptRow:
    """One training prompt, its metadata (e.g. ``ground_truth`` for the OCR reward) and its input images
    (editing, image-to-video): each a path, an ``s3://`` URI or a ``data:`` URL."""

    prompt: str
    metadata: dict[str, Any] = field(default_factory=dict)
    images: tuple[str, ...] = ()

    @property
    def key(self) -> tuple[str, tuple[str, ...]]:
        """What makes two rows the same conditioning: the prompt and the input images."""
        return self.prompt, self.images


def normalize_prompt(prompt: str) -> str:
    """Runs of whitespace become one space, ends stripped: the form that is stored, deduplicated and hashed."""
    return " ".join(prompt.split())


def row_id(prompt: str, images: tuple[str, ...] = ()) -> str:
    """The stable id of a row: 16 hex digits of the SHA-256 of its normalised prompt (a text-only row) or of the
    prompt and its stored image names (which are their content hashes)."""
    text = normalize_prompt(prompt) + "".join(f"\t{name}" for name in images)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def metadata_json(metadata: dict[str, Any]) -> str:
    """Canonical JSON text of a metadata dict (sorted keys), as stored and hashed."""
    return json.dumps(metadata, sort_keys=True, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def rows_sha256(rows: Iterable[PromptRow]) -> str:
    """SHA-256 over the canonical rows in the order given: one ``id \\t prompt \\t metadata`` line each, the
    stored image names appended (``\\t`` each) to a row that has them."""
    h = hashlib.sha256()
    for row in rows:
        images = "".join(f"\t{name}" for name in row.images)
        h.update(f"{row_id(row.prompt, row.images)}\t{row.prompt}\t{metadata_json(row.metadata)}{images}\n".encode())
    return h.hexdigest()


def dataset_sha256(split_hashes: dict[str, str]) -> str:
    """The content hash of a whole prepared dataset: its rows and which split each is in."""
    return hashlib.sha256("".join(f"{s}\t{split_hashes[s]}\n" for s in SPLITS).encode()).hexdigest()


def write_split(rows: list[PromptRow], path: Path) -> None:
    """Write rows (already in id order, their images as stored names) as a Parquet file of the four columns."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({
        "id": pa.array([row_id(r.prompt, r.images) for r in rows], pa.string()),
        "prompt": pa.array([r.prompt for r in rows], pa.string()),
        "images": pa.array([list(r.images) for r in rows], pa.list_(pa.string())),
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
    if not isinstance(manifest, dict) or manifest.get("schema_version") not in READABLE_VERSIONS:
        version = manifest.get("schema_version") if isinstance(manifest, dict) else None
        raise DataError(f"{where}: schema_version {version!r}, this version reads "
                        f"{' and '.join(map(str, READABLE_VERSIONS))}; re-run `flowgrpo prepare-dataset`")
    return manifest


def read_split(uri: str, split: str) -> tuple[list[PromptRow], dict[str, Any]]:
    """The rows of one split of the prepared dataset at ``uri``, checked against its manifest; their images as
    URIs (or paths) inside ``uri``."""
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
    columns = COLUMNS if manifest["schema_version"] == SCHEMA_VERSION else ("id", "prompt", "metadata")
    if tuple(table.column_names) != columns:
        raise DataError(f"{where}: columns {table.column_names}, expected {list(columns)}")
    images = table.column("images").to_pylist() if "images" in columns else [[]] * table.num_rows
    try:
        rows = [PromptRow(p, json.loads(m), tuple(i)) for p, m, i in zip(
            table.column("prompt").to_pylist(), table.column("metadata").to_pylist(), images, strict=True)]
        matches = len(rows) == info.get("rows") and rows_sha256(rows) == info.get("sha256")
    except (TypeError, ValueError, AttributeError):  # nulls or non-JSON text: not written by prepare.py
        matches = False
    if not matches:
        raise DataError(f"{where} does not match {MANIFEST_NAME} beside it (rows or content hash differ): "
                        "the folder was modified or is half re-written; re-run `flowgrpo prepare-dataset`")
    inside = {name: _image_inside(uri, where, name) for name in {name for r in rows for name in r.images}}
    return [replace(r, images=tuple(inside[name] for name in r.images)) if r.images else r for r in rows], manifest


def _image_inside(uri: str, where: str, name: str) -> str:
    """Where the stored image ``name`` of the dataset ``uri`` is read from; DataError unless it is a name prepare
    writes and stays inside the folder (``storage.within``: symbolic links resolved)."""
    inside = storage.within(uri, name) if IMAGE_NAME.fullmatch(name) else None
    if inside is None:
        raise DataError(f"{where}: the images column names {name[:200]!r}, not an {IMAGES_DIR}/<16 hex>.png file "
                        f"inside {uri} (a symbolic link out of it counts as outside); re-run `flowgrpo "
                        "prepare-dataset`")
    return inside
