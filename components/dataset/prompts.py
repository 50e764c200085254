"""Read training prompts (and their metadata) from the `data` config section."""

from __future__ import annotations

import json
from pathlib import PurePosixPath

from components import storage
from components.dataset.config import DataConfig
from components.dataset.prepared import MANIFEST_NAME, PromptRow, read_manifest, read_split
from components.errors import DataError

__all__ = ["PromptRow", "dataset_hash", "held_out_rows", "is_prepared", "load_prompt_rows", "load_prompts"]

_FILE_SUFFIXES = (".txt", ".jsonl")


def _parse_file(text: str, path: str, jsonl: bool) -> list[PromptRow]:
    rows = []
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        if not jsonl:
            rows.append(PromptRow(line.strip()))
            continue
        try:
            obj = json.loads(line)
            prompt = obj["prompt"]
        except (ValueError, KeyError, TypeError) as exc:
            raise DataError(f"{path}:{lineno}: expected a JSON object with a 'prompt' field ({exc})") from exc
        if not isinstance(prompt, str) or not prompt.strip():
            raise DataError(f"{path}:{lineno}: 'prompt' must be a non-empty string")
        rows.append(PromptRow(prompt, {k: v for k, v in obj.items() if k != "prompt"}))
    return rows


def is_prepared(path: str) -> bool:
    """Whether ``path`` is a folder written by `prepare-dataset` (it holds a manifest)."""
    return PurePosixPath(path).suffix not in _FILE_SUFFIXES and storage.exists(storage.join(path, MANIFEST_NAME))


def load_prompt_rows(config: DataConfig) -> list[PromptRow]:
    """The prompts of ``config`` with their metadata: inline, from a .txt/.jsonl file or a prepared dataset."""
    if config.prompts is not None:
        return [PromptRow(p) for p in config.prompts]
    path = config.path
    if is_prepared(path):
        rows, _ = read_split(path, config.split)
        if not rows:
            raise DataError(f"data.path: {path} has no {config.split} rows; prepare it with more rows or "
                            "another test_fraction")
        return rows
    suffix = PurePosixPath(path).suffix
    if suffix not in _FILE_SUFFIXES:
        raise DataError(f"data.path: {path} must be a .txt or .jsonl file or a prepared dataset folder holding "
                        f"{MANIFEST_NAME} (see `flowgrpo prepare-dataset`)")
    if config.split != "train":
        raise DataError(f"data.split {config.split!r} needs a prepared dataset; {path} is a plain prompt file")
    if not storage.exists(path):
        raise DataError(f"data.path: {path} does not exist")
    try:
        text = storage.get_bytes(path).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"data.path: {path} is not UTF-8 text ({exc})") from exc
    rows = _parse_file(text, path, jsonl=suffix == ".jsonl")
    if not rows:
        raise DataError(f"data.path: {path} holds no prompts")
    return rows


def held_out_rows(config: DataConfig) -> tuple[list[PromptRow], bool]:
    """The ``test`` split of a prepared dataset, else the training prompts; and whether they are held out."""
    held_out = (config.path is not None and is_prepared(config.path)
                and read_manifest(config.path)["rows"]["test"] > 0)
    return load_prompt_rows(config.model_copy(update={"split": "test" if held_out else config.split})), held_out


def load_prompts(config: DataConfig) -> list[str]:
    """The prompt texts of ``config``."""
    return [row.prompt for row in load_prompt_rows(config)]


def dataset_hash(config: DataConfig) -> str | None:
    """The manifest's ``content_sha256`` when ``data.path`` is a prepared dataset, else None (hash the prompts
    instead). It covers both splits and which row is in which, so it names exactly the data a run saw."""
    if config.path is None or not is_prepared(config.path):
        return None
    return str(read_manifest(config.path)["content_sha256"])
