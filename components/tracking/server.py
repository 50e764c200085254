"""Which MLflow server tracking goes to: ``$MLFLOW_TRACKING_URI``, read here and nowhere else, and a client
for it that gives up on a dead server in seconds."""

from __future__ import annotations

import os
from typing import Any

TRACKING_URI_ENV = "MLFLOW_TRACKING_URI"
PIPELINE_RUN_TAG = "flowgrpo.pipeline_run_id"  # on a pipeline run's MLflow run and on its steps' child runs
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
