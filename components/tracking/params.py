"""What a run records about itself: flattened params without secrets, and lineage tags. No MLflow here."""

from __future__ import annotations

import getpass
import hashlib
import json
import re
import subprocess
from pathlib import Path
from typing import Any

from components import environ
from components.config_base import URL_USERINFO

# MLflow's limit on a param value; longer values are cut with a marker rather than rejected.
MAX_PARAM_CHARS = 6000
# Keys that can hold credentials are never logged, whatever their value.
SECRET_KEY = re.compile(r"secret|passw|token|api[_-]?key|credential|access[_-]?key|auth", re.IGNORECASE)

# The output a run writes to, on its MLflow run: how a replay finds that the output is already there.
RUN_OUTPUT_TAG = "flowgrpo.run_output"
# MLflow's tag for who logged a run or model (its UI's "User").
USER_TAG = "mlflow.user"


def redact(text: str) -> str:
    """``scheme://user:password@host`` -> ``scheme://***@host``."""
    return URL_USERINFO.sub(r"\g<lead>\g<scheme>***@", text)


def short_error(exc: BaseException) -> str:
    """An exception as one redacted line of at most 300 characters, for status messages."""
    text = redact(" ".join(str(exc).split()))
    return text if len(text) <= 300 else text[:297] + "..."


def _value(v: Any) -> str:
    text = v if isinstance(v, str) else json.dumps(v)
    text = redact(text)
    return text if len(text) <= MAX_PARAM_CHARS else text[: MAX_PARAM_CHARS - 1] + "…"


def flatten_params(data: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Nested config -> ``{"train.learning_rate": "0.003", "rewards.0.name": "ocr", ...}``.

    Lists of sections are indexed; lists of plain values (prompts) stay one JSON value. Keys that look
    like they hold a credential are dropped, and user:password in URLs is masked.
    """
    out: dict[str, str] = {}
    for key, v in data.items():
        name = f"{prefix}{key}"
        if SECRET_KEY.search(str(key)):
            continue
        if isinstance(v, dict):
            out.update(flatten_params(v, f"{name}."))
        elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            for i, item in enumerate(v):
                out.update(flatten_params(item, f"{name}.{i}."))
        else:
            out[name] = _value(v)
    return out


def content_hash(data: Any) -> str:
    """SHA-256 of canonical JSON: equal configs (or prompt lists) hash equal, whatever the key order."""
    return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def git_commit() -> str:
    """The commit the code came from: $FLOWGRPO_GIT_COMMIT (set in images), else the checkout's HEAD."""
    if commit := environ.FLOWGRPO_GIT_COMMIT.get():
        return commit
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=5, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def user_tag() -> dict[str, str]:
    """``mlflow.user`` of every run and model the product logs: the OS account that logs it, as MLflow records it
    without credentials. Never MLFLOW_TRACKING_USERNAME, which MLflow records otherwise: that is the tracking
    server's login (on a cluster the one in the MLflow Secret, the same for every run), not who ran, and it would
    show half of a credential to everyone who can read the experiment."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # a uid without a passwd entry
        user = "unknown"
    return {USER_TAG: user}


def lineage_tags(config: dict[str, Any], prompts: list[str], dataset_sha256: str | None = None) -> dict[str, str]:
    """Tags that tie a run (and the model version it registers) to its inputs. The dataset hash is a prepared
    dataset's manifest hash when there is one, else the hash of the prompt list."""
    data = config.get("data") or {}
    model = config.get("model") or {}
    tags = {
        "flowgrpo.config_hash": content_hash(config),
        "flowgrpo.dataset_uri": redact(data.get("path") or "inline:data.prompts"),
        "flowgrpo.dataset_hash": dataset_sha256 or content_hash(prompts),
        "flowgrpo.dataset_rows": str(len(prompts)),
        "flowgrpo.base_model": redact(model.get("path") or model.get("kind", "unknown")),
        "flowgrpo.git_commit": git_commit(),
    }
    if image := environ.FLOWGRPO_IMAGE.get():
        tags["flowgrpo.image"] = image
    return tags
