"""Read training prompts (and their metadata) from the `data` config section."""

from __future__ import annotations

import json
from pathlib import PurePosixPath

from components import storage
from components.dataset.config import DataConfig, PrepareConfig
from components.dataset.prepare import BUILTIN_PREFIX, REASONS, builtin_source, check_row
from components.dataset.prepared import MANIFEST_NAME, PromptRow, read_manifest, read_split
from components.errors import DataError

__all__ = ["PromptRow", "dataset_hash", "held_out_rows", "is_prepared", "load_prompt_rows", "load_prompts"]

_FILE_SUFFIXES = (".txt", ".jsonl")


# A prompt file trained on directly has no `dataset.max_prompt_tokens` of its own: it gets prepare-dataset's default.
MAX_PROMPT_TOKENS = PrepareConfig.default_of("max_prompt_tokens")


def _parse_file(text: str, path: str, jsonl: bool, base: str | None) -> list[PromptRow]:
    """The rows of a .txt (a prompt a line) or .jsonl file, as written; each must pass `prepare-dataset`'s row check
    (``check_row``; input images relative to the file ``base``), else a DataError names the file and line."""
    rows = []
    for lineno, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            fields = json.loads(line) if jsonl else {"prompt": line.strip()}
        except ValueError as exc:
            raise DataError(f"{path}:{lineno}: expected a JSON object with a 'prompt' field ({exc})") from exc
        if not isinstance(fields, dict):
            raise DataError(f"{path}:{lineno}: expected a JSON object with a 'prompt' field, got a JSON "
                            f"{type(fields).__name__}")
        checked, reason, detail = check_row(fields, "generic", MAX_PROMPT_TOKENS, base)
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
        return _parse_file(source.read_text(encoding="utf-8"), path, jsonl=True, base=None)
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
    try:
        text = storage.get_bytes(path).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(f"data.path: {path} is not UTF-8 text ({exc})") from exc
    rows = _parse_file(text, path, jsonl=suffix == ".jsonl", base=path)
    if not rows:
        raise DataError(f"data.path: {path} holds no prompts")
    return rows


def data_path_note(config: DataConfig) -> str | None:
    """What ``flowgrpo validate`` says about ``data.path``: it reads the prompts as `train` does
    (``load_prompt_rows``), so what `train` refuses it refuses with the same line. A path missing on this machine is
    a note, as for ``model.path`` (the shipped configs name files of the machine that trains), and so is an s3://
    path (it needs the S3 credentials)."""
    path = config.path
    if path is None:
        return None
    if path.startswith(BUILTIN_PREFIX):
        load_prompt_rows(config)
        return None
    if storage.is_remote(path):
        return f"data.path {path}: read when the run starts (needs the S3 credentials)"
    if not storage.local_copy(path).exists():
        return (f"data.path {path} does not exist on this machine: fine if it exists where the training runs; "
                "`flowgrpo train` here would stop on it")
    load_prompt_rows(config)
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
