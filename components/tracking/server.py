"""Which MLflow server tracking goes to: ``$MLFLOW_TRACKING_URI``, read here and nowhere else, and a client
for it that gives up on a dead server in seconds."""

from __future__ import annotations

import os
from typing import Any

from components.config_base import URL_USERINFO
from components.errors import ConfigError

TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"
PIPELINE_RUN_TAG = "flowgrpo.pipeline_run_id"  # on a pipeline run's MLflow run and on its steps' child runs
# Callers retry on their own terms (the tracker for as long as it takes, a replay not at all); MLflow's own
# retries (7, exponential) would only make each attempt slower to notice an outage and its end.
_CLIENT_ENV_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_TIMEOUT": "30"}


def tracking_uri() -> str | None:
    """The MLflow server (or ``sqlite:///`` store) to track to; None = tracking off. A URI with credentials is
    refused: MLflow prints it in its own lines ("View run ... at URI"), which no redaction of ours reaches, so
    they would land in every log. MLflow takes them from MLFLOW_TRACKING_USERNAME / _PASSWORD (or _TOKEN)."""
    uri = os.environ.get(TRACKING_URI_ENV) or None
    if uri is not None and URL_USERINFO.search(uri):
        raise ConfigError(f"{TRACKING_URI_ENV} holds credentials (user:password@), which MLflow would print in its "
                          "log lines: remove them from the URI and set MLFLOW_TRACKING_USERNAME and "
                          "MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) instead")
    return uri


def mlflow_client(uri: str | None = None) -> Any:
    """An MlflowClient for ``uri`` (default: ``tracking_uri()``)."""
    for key, value in _CLIENT_ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    from mlflow import MlflowClient

    return MlflowClient(uri or tracking_uri())


# MLflow 3's experiment kind (its UI's own tag and value): a model-training experiment, not a GenAI one.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
MODEL_TRAINING_KIND = "custom_model_development"
# MLflow 3.17's UI picks its GenAI or model-training navigation from this URL parameter (else from a browser
# setting, GenAI by default); the kind tag alone does not switch it.
_MODEL_TRAINING_VIEW = "workflowType=machine_learning"


def experiment_id(client: Any, name: str) -> str:
    """The id of experiment ``name``, created as a model-training experiment when missing. An existing one
    without a kind is given it; a kind someone chose is kept."""
    found = client.get_experiment_by_name(name)
    if found is None:
        return client.create_experiment(name, tags={EXPERIMENT_KIND_TAG: MODEL_TRAINING_KIND})
    if EXPERIMENT_KIND_TAG not in (found.tags or {}):
        client.set_experiment_tag(found.experiment_id, EXPERIMENT_KIND_TAG, MODEL_TRAINING_KIND)
    return found.experiment_id


def run_url(server: str, experiment: str, run_id: str) -> str:
    """The MLflow UI's page of a run, opened in its model-training view."""
    return f"{server.rstrip('/')}/#/experiments/{experiment}/runs/{run_id}?{_MODEL_TRAINING_VIEW}"


def experiment_url(server: str, experiment: str) -> str:
    """The MLflow UI's page of an experiment, opened in its model-training view."""
    return f"{server.rstrip('/')}/#/experiments/{experiment}?{_MODEL_TRAINING_VIEW}"
