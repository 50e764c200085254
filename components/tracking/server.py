"""Which MLflow server tracking goes to: ``$MLFLOW_TRACKING_URI``, read here and nowhere else, and a client
for it that gives up on a dead server in seconds."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any
from urllib.parse import quote

from components import environ
from components.config_base import URL_USERINFO
from components.errors import ConfigError

PIPELINE_RUN_TAG = "flowgrpo.pipeline_run_id"  # on a pipeline run's MLflow run and on its steps' child runs
# Callers retry on their own terms (the tracker for as long as it takes, a replay not at all); MLflow's own
# retries (7, exponential) would only make each attempt slower to notice an outage and its end.
_CLIENT_DEFAULTS = (environ.MLFLOW_HTTP_REQUEST_MAX_RETRIES, environ.MLFLOW_HTTP_REQUEST_TIMEOUT)


def tracking_uri() -> str | None:
    """The MLflow server (or ``sqlite:///`` store) to track to; None = tracking off. A URI with credentials is
    refused: MLflow prints it in its own lines ("View run ... at URI"), which no redaction of ours reaches, so
    they would land in every log. MLflow takes them from MLFLOW_TRACKING_USERNAME / _PASSWORD (or _TOKEN)."""
    uri = environ.MLFLOW_TRACKING_URI.get()
    if uri is not None and URL_USERINFO.search(uri):
        raise ConfigError("MLFLOW_TRACKING_URI holds credentials (user:password@), which MLflow would print in its "
                          "log lines: remove them from the URI and set MLFLOW_TRACKING_USERNAME and "
                          "MLFLOW_TRACKING_PASSWORD (or MLFLOW_TRACKING_TOKEN) instead")
    return uri


def mlflow_client(uri: str | None = None) -> Any:
    """An MlflowClient for ``uri`` (default: ``tracking_uri()``)."""
    for variable in _CLIENT_DEFAULTS:
        variable.set_default()
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
    from mlflow.exceptions import MlflowException

    found = client.get_experiment_by_name(name)
    if found is None:
        try:
            return client.create_experiment(name, tags={EXPERIMENT_KIND_TAG: MODEL_TRAINING_KIND})
        except MlflowException as error:  # another run created it since the lookup: two pipelines started at once
            found = client.get_experiment_by_name(name)
            if error.error_code != "RESOURCE_ALREADY_EXISTS" or found is None:
                raise
    if EXPERIMENT_KIND_TAG not in (found.tags or {}):
        client.set_experiment_tag(found.experiment_id, EXPERIMENT_KIND_TAG, MODEL_TRAINING_KIND)
    return found.experiment_id


def run_url(server: str, experiment: str, run_id: str) -> str:
    """The MLflow UI's page of a run, opened in its model-training view."""
    return f"{server.rstrip('/')}/#/experiments/{experiment}/runs/{run_id}?{_MODEL_TRAINING_VIEW}"


# The UI sorts an experiment's chart sections (a metric key's prefix before its last "/") by name, so eval/ would
# come before reward/. Its saved views (the "Views" menu: an experiment tag holding the view's state, opened by
# viewStateShareKey=<id>) keep the order they list; unlisted sections follow.
CHARTS_VIEW_ID = "flowgrpo-rewards-first"
CHARTS_VIEW_TAG = f"mlflow.sharedViewState.{CHARTS_VIEW_ID}"
_UNPREFIXED_SECTION = "Model metrics"  # the UI's section for keys without "/", the sample grids' image key too


def experiment_url(server: str, experiment: str, *, saved_view: bool = False) -> str:
    """The MLflow UI's chart view of an experiment's runs (``compareRunsMode=CHART``; the experiment's own URL
    would redirect to its runs tab and drop that), in its model-training view; with ``saved_view``, in the order
    of the experiment's ``charts_view``. Newest runs first, each pipeline run with its steps' runs folded."""
    view = f"&viewStateShareKey={CHARTS_VIEW_ID}" if saved_view else ""
    return f"{server.rstrip('/')}/#/experiments/{experiment}/runs?{_MODEL_TRAINING_VIEW}&compareRunsMode=CHART{view}"


def model_version_url(server: str, name: str, version: str) -> str:
    """The MLflow UI's page of a registered model version."""
    return f"{server.rstrip('/')}/{model_version_route(name, version)}"


def model_version_route(name: str, version: str) -> str:
    """The UI's route of a model version, relative to its root (a link that works on any host serving it)."""
    return f"#/models/{quote(name, safe='')}/versions/{version}"


def charts_view(metric_keys: Iterable[str], now_ms: int) -> str:
    """The value of ``CHARTS_VIEW_TAG``: a saved chart view whose sections are the reward curves, the sample grids,
    then the other sections of ``metric_keys`` by name (the evaluation's among them)."""
    sections = {key.rpartition("/")[0] or _UNPREFIXED_SECTION for key in metric_keys} | {_UNPREFIXED_SECTION}
    rewards = sorted(s for s in sections if s == "reward" or s.startswith("reward/"))
    rest = sorted(sections - {*rewards, _UNPREFIXED_SECTION})
    state = {"isAccordionReordered": True, "compareRunCharts": [],  # the UI fills in a chart per metric
             "compareRunSections": [{"uuid": f"flowgrpo-{i}", "name": name, "display": True, "isReordered": False,
                                     "deleted": False, "isGenerated": True}
                                    for i, name in enumerate([*rewards, _UNPREFIXED_SECTION, *rest])]}
    return json.dumps({"name": "FlowGRPO: rewards first", "createdAt": now_ms, "updatedAt": now_ms,
                       "state": json.dumps(state)})
