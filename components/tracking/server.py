"""Which MLflow server tracking goes to: ``$MLFLOW_TRACKING_URI``, read here and nowhere else, and a client
for it that gives up on a dead server in seconds."""

from __future__ import annotations

import os
from typing import Any

TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"
# Callers retry on their own terms (the tracker for as long as it takes, a replay not at all); MLflow's own
# retries (7, exponential) would only make each attempt slower to notice an outage and its end.
_CLIENT_ENV_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}


def tracking_uri() -> str | None:
    """The MLflow server (or ``sqlite:///`` store) to track to; None = tracking off."""
    return os.environ.get(TRACKING_URI_ENV) or None


def mlflow_client(uri: str | None = None) -> Any:
    """An MlflowClient for ``uri`` (default: ``tracking_uri()``)."""
    for key, value in _CLIENT_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    from mlflow import MlflowClient

    return MlflowClient(uri or tracking_uri())
