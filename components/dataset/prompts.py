"""Read training prompts from the `data` config section."""

from __future__ import annotations

import json
from pathlib import Path

from components.dataset.config import DataConfig
from components.errors import DataError


def _read_file(path: Path) -> list[str]:
    if not path.is_file():
        raise DataError(f"data.path: {path} does not exist")
    prompts = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            if path.suffix == ".jsonl":
                try:
                    row = json.loads(line)
                    prompt = row["prompt"]
                except (ValueError, KeyError, TypeError) as exc:
                    raise DataError(f"{path}:{lineno}: expected a JSON object with a 'prompt' field ({exc})") from exc
                if not isinstance(prompt, str) or not prompt.strip():
                    raise DataError(f"{path}:{lineno}: 'prompt' must be a non-empty string")
                prompts.append(prompt)
            else:
                prompts.append(line.strip())
    return prompts


def load_prompts(config: DataConfig) -> list[str]:
    if config.prompts is not None:
        return list(config.prompts)
    path = Path(config.path)
    if path.suffix not in (".txt", ".jsonl"):
        raise DataError(f"data.path: {path} must be a .txt or .jsonl file")
    try:
        prompts = _read_file(path)
    except UnicodeDecodeError as exc:
        raise DataError(f"data.path: {path} is not UTF-8 text ({exc})") from exc
    if not prompts:
        raise DataError(f"data.path: {path} holds no prompts")
    return prompts
