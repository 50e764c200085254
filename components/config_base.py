"""The base every config section derives from, and one-line validation messages naming the key path."""

import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from components.errors import ConfigError


class Section(BaseModel):
    """Unknown keys are errors, not silently ignored; so are NaN and infinite numbers (a NaN reward weight or an
    infinite timeout passes every ``gt`` / ``ge`` bound)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


def format_validation_error(exc: ValidationError, source: str) -> str:
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key (check the spelling; the example configs spell every key)"
        elif "input" in err and err["type"] not in ("missing",) and not isinstance(err["input"], dict | list):
            msg = f"{msg} (got {err['input']!r})"
        parts.append(f"{loc}: {msg}" if loc else msg)
    return f"invalid config {source}: " + "; ".join(parts)


ENV_SOURCE = "env:"


def read_yaml_mapping(path: Path) -> dict[str, Any]:
    """A YAML file whose top level is a mapping; ConfigError naming the file (and line) otherwise.
    ``env:NAME`` reads the YAML text from environment variable NAME instead (how a RayJob carries its config)."""
    source = str(path)
    try:
        if source.startswith(ENV_SOURCE):
            text = os.environ.get(source[len(ENV_SOURCE):])
            if text is None:
                raise ConfigError(f"config {source}: environment variable {source[len(ENV_SOURCE):]} is not set")
        elif not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        else:
            text = path.read_text(encoding="utf-8")
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise ConfigError(f"{where}: YAML syntax error: {problem}") from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{path}: not UTF-8 text ({exc})") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections, got {type(data).__name__}")
    return data
