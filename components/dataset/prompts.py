"""Read training prompts (and their metadata) from the `data` config section."""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import IO

from components import storage
from components.dataset.config import DataConfig, PrepareConfig
from components.dataset.input_images import check_rows
from components.dataset.prepare import BUILTIN_PREFIX, MAX_LINE_BYTES, REASONS, bounded_lines, builtin_source, check_row
from components.dataset.prepared import MANIFEST_NAME, PromptRow, read_manifest, read_split
from components.errors import DataError

__all__ = ["PromptRow", "dataset_hash", "held_out_rows", "is_prepared", "load_prompt_rows", "load_prompts"]

_FILE_SUFFIXES = (".txt", ".jsonl")


# A prompt file trained on directly has no `dataset.max_prompt_tokens` of its own: it gets prepare-dataset's default.
MAX_PROMPT_TOKENS = PrepareConfig.default_of("max_prompt_tokens")


@contextlib.contextmanager
def _opened(path: str) -> Iterator[IO[bytes]]:
    """The file ``path`` open for reading; an s3:// object is downloaded to a temporary file first (read line by
    line like a local one, never whole into memory)."""
    if not storage.is_remote(path):
        with open(path, "rb") as f:
            yield f
        return
    with tempfile.TemporaryDirectory(prefix="flowgrpo-prompts-") as tmp:
        storage.get_file(path, Path(tmp) / "prompts")
        with (Path(tmp) / "prompts").open("rb") as f:
            yield f


def _parse_file(f: IO[bytes], path: str, jsonl: bool, base: str, allow_external: bool) -> list[PromptRow]:
    """The rows of a .txt (a prompt a line) or .jsonl file, as written; each must pass `prepare-dataset`'s row check
    (``check_row``; input images relative to the file ``base``), else a DataError names the file and line. A line
    over ``MAX_LINE_BYTES`` is refused unread."""
    rows = []
    for lineno, raw in bounded_lines(f):
        if raw is None:
            raise DataError(f"{path}:{lineno}: a line longer than {MAX_LINE_BYTES} bytes; a row is at most that "
                            "(give its images as files beside it)")
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise DataError(f"{path}:{lineno}: not UTF-8 text ({exc})") from exc
        if not line.strip():
            continue
        try:
            fields = json.loads(line) if jsonl else {"prompt": line.strip()}
        except (ValueError, RecursionError) as exc:  # RecursionError: nested deeper than Python's stack
            raise DataError(f"{path}:{lineno}: expected a JSON object with a 'prompt' field ({exc})") from exc
        if not isinstance(fields, dict):
            raise DataError(f"{path}:{lineno}: expected a JSON object with a 'prompt' field, got a JSON "
                            f"{type(fields).__name__}")
        checked, reason, detail = check_row(fields, "generic", MAX_PROMPT_TOKENS, base, allow_external)
        if checked is None:
            hint = ("; for a longer limit prepare the file with `flowgrpo prepare-dataset --max-prompt-tokens N` and "
                    "train on its output" if reason == "prompt_too_long" else "")
            raise DataError(f"{path}:{lineno}: {REASONS[reason]}{f' ({detail})' if detail else ''}{hint}")
        rows.append(PromptRow(fields["prompt"], {k: v for k, v in fields.items() if k not in ("prompt", "images")},
                              checked.images))
    return rows


def is_prepared(path: str) -> bool:
    """Whether ``path`` is a folder written by `prepare-dataset` (it holds a manifest)."""
    return PurePosixPath(path).suffix not in _FILE_SUFFIXES and storage.exists(storage.join(path, MANIFEST_NAME))


def load_prompt_rows(config: DataConfig) -> list[PromptRow]:
    """The prompts of ``config`` with their metadata: inline, from a .txt/.jsonl file or a prepared dataset."""
    if config.prompts is not None:
        return [PromptRow(p) for p in config.prompts]
    path = config.path
    if path.startswith(BUILTIN_PREFIX):
        if config.split != "train":
            raise DataError(f"data.split {config.split!r} needs a prepared dataset; {path} is a built-in prompt set "
                            f"(prepare it: `flowgrpo prepare-dataset {path} --output DIR`)")
        source = builtin_source(path.removeprefix(BUILTIN_PREFIX))
        with source.open("rb") as f:
            return _parse_file(f, path, jsonl=True, base=str(source), allow_external=config.allow_external_images)
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
        raise DataError(f"data.path: {path} does not exist or is not a file")
    with _opened(path) as f:
        rows = _parse_file(f, path, jsonl=suffix == ".jsonl", base=path, allow_external=config.allow_external_images)
    if not rows:
        raise DataError(f"data.path: {path} holds no prompts")
    return rows


def data_path_note(config: DataConfig, resolution: int) -> str | None:
    """What ``flowgrpo validate`` says about ``data.path``: it reads the prompts as `train` does
    (``load_prompt_rows``) and checks their input images as `train` does (``check_rows``, at the model's
    ``resolution``), so what `train` refuses it refuses with the same line. A path missing on this machine is a
    note, as for ``model.path`` (the shipped configs name files of the machine that trains), and so is an s3://
    path (it needs the S3 credentials)."""
    path = config.path
    if path is None:
        return None
    if storage.is_remote(path):
        return f"data.path {path}: read when the run starts (needs the S3 credentials)"
    if not path.startswith(BUILTIN_PREFIX) and not storage.local_copy(path).exists():
        return (f"data.path {path} does not exist on this machine: fine if it exists where the training runs; "
                "`flowgrpo train` here would stop on it")
    rows, held_out = held_out_rows(config)  # training shows samples of the held-out rows too
    check_rows(rows + load_prompt_rows(config) if held_out else rows, resolution)
    return None


def held_out_rows(config: DataConfig) -> tuple[list[PromptRow], bool]:
    """The ``test`` split of a prepared dataset, else the training prompts; and whether they are held out."""
    held_out = (config.path is not None and not config.path.startswith(BUILTIN_PREFIX) and is_prepared(config.path)
                and read_manifest(config.path)["rows"]["test"] > 0)
    return load_prompt_rows(config.model_copy(update={"split": "test" if held_out else config.split})), held_out


def load_prompts(config: DataConfig) -> list[str]:
    """The prompt texts of ``config``."""
    return [row.prompt for row in load_prompt_rows(config)]


def dataset_hash(config: DataConfig) -> str | None:
    """The manifest's ``content_sha256`` when ``data.path`` is a prepared dataset, else None (hash the prompts
    instead). It covers both splits and which row is in which, so it names exactly the data a run saw."""
    if config.path is None or config.path.startswith(BUILTIN_PREFIX) or not is_prepared(config.path):
        return None
    return str(read_manifest(config.path)["content_sha256"])
