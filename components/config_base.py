"""The base every config section derives from, and one-line validation messages naming the key path."""

import os
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

from components.errors import ConfigError

URL_USERINFO = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*://)[^/@\s]+@")


def url_credentials_at(data: Any, prefix: str = "") -> str | None:
    """The key path of the first string in ``data`` holding a URL with ``user[:password]@``, else None."""
    if isinstance(data, str):
        return prefix or "(value)" if URL_USERINFO.search(data) else None
    items = data.items() if isinstance(data, dict) else enumerate(data) if isinstance(data, list) else ()
    for key, value in items:
        found = url_credentials_at(value, f"{prefix}.{key}" if prefix else str(key))
        if found:
            return found
    return None


def refuse_url_credentials(data: Any) -> Any:
    """A config must not carry credentials: it is written to the run's output, S3 and logs. Every service it
    names takes them from the environment (S3: AWS_*, MLflow: MLFLOW_TRACKING_*, the VLM judge: its
    api_key_env) or a Kubernetes Secret. The message names the key, never the value."""
    where = url_credentials_at(data)
    if where:
        raise ValueError(f"{where}: a URL with credentials (user:password@) would be written to the run's "
                         "config.yaml, S3 and logs; remove them and give them in the environment or a Secret "
                         "(S3: AWS_*, MLflow: MLFLOW_TRACKING_*, a VLM judge: its api_key_env)")
    return data


class Section(BaseModel):
    """Unknown keys are errors, not silently ignored; so are NaN and infinite numbers (a NaN reward weight or an
    infinite timeout passes every ``gt`` / ``ge`` bound)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @classmethod
    def default_of(cls, key: str) -> Any:
        """The schema's default of ``key``: what a command-line option or a function argument mirroring it
        defaults to, so a default is written once."""
        return cls.model_fields[key].get_default(call_default_factory=True)


def format_validation_error(exc: ValidationError, source: str) -> str:
    """One line: ``invalid config SOURCE: key.path: problem; ...``. ``source`` names where the mapping came from
    (a file, ``env:NAME``, a phrase such as "from the pipeline's config parameter")."""
    parts = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key (check the spelling; the example configs spell every key)"
        elif "input" in err and err["type"] not in ("missing",) and not isinstance(err["input"], dict | list):
            msg = f"{msg} (got {err['input']!r})"
        parts.append(f"{loc}: {msg}" if loc else msg)
    # A source that starts with the word itself (config.yaml) must not read "invalid config config.yaml".
    lead = "invalid" if re.match(r"config\b", source) else "invalid config"
    return f"{lead} {source}: " + "; ".join(parts)


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
