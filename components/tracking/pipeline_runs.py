"""MLflow runs of a pipeline run: the parent run every step logs under, and the model version the register
step creates. Synchronous, unlike the trainer's tracker: a pipeline step has nothing to overlap with."""

from __future__ import annotations

from collections.abc import Callable

from components.errors import ConfigError
from components.tracking.params import redact, short_error
from components.tracking.server import (
    PIPELINE_RUN_TAG,
    experiment_id,
    experiment_url,
    mlflow_client,
    run_url,
    tracking_uri,
)

_PARENT = "mlflow.parentRunId"


def _parent_runs(client, experiments: list[str], tag_filter: str, max_results: int = 1000) -> list:
    """The pipeline runs (not their steps' child runs, which carry the same tag) matching ``tag_filter``."""
    runs = client.search_runs(experiments, tag_filter, max_results=max_results)
    return [run for run in runs if _PARENT not in run.data.tags]


def _runs_of(client, experiment: str, pipeline_run_id: str) -> list:
    return _parent_runs(client, [experiment], f"tags.`{PIPELINE_RUN_TAG}` = '{pipeline_run_id}'")


def parent_run(experiment: str, pipeline_run_id: str, run_name: str) -> str | None:
    """The MLflow run of pipeline run ``pipeline_run_id`` (found by tag, else created, so every step and a
    retried step agree without passing ids around); None when tracking is off."""
    if tracking_uri() is None:
        return None
    client = mlflow_client()
    experiment = experiment_id(client, experiment)
    if runs := _runs_of(client, experiment, pipeline_run_id):
        return runs[0].info.run_id
    run = client.create_run(experiment, run_name=run_name, tags={PIPELINE_RUN_TAG: pipeline_run_id})
    return run.info.run_id


def finish_parent_run(experiment: str, pipeline_run_id: str, succeeded: bool,
                      log: Callable[[str], None] = print) -> None:
    """Close the pipeline's run as FINISHED or FAILED (no-op when tracking is off or it was never opened). An
    MLflow that cannot be reached, or a tracking URI refused, is reported, not raised: the exit task's real job is
    the teardown."""
    try:
        uri = tracking_uri()
    except ConfigError as exc:
        log(f"MLflow: could not close the pipeline's run: {exc}")
        return
    if uri is None:
        return
    from mlflow.exceptions import MlflowException

    try:
        client = mlflow_client()
        found = client.get_experiment_by_name(experiment)
        for run in [] if found is None else _runs_of(client, found.experiment_id, pipeline_run_id):
            client.set_terminated(run.info.run_id, status="FINISHED" if succeeded else "FAILED")
    except (MlflowException, OSError) as exc:
        log(f"MLflow at {redact(uri)}: could not close the pipeline's run: {short_error(exc)}")


def lineage_of(run_id: str) -> dict[str, str]:
    """The ``flowgrpo.*`` lineage tags a training run carries (config hash, dataset, base model, commit)."""
    return {k: v for k, v in mlflow_client().get_run(run_id).data.tags.items() if k.startswith("flowgrpo.")}


def parent_run_url(run_name: str, server: str) -> str | None:
    """The UI page on ``server`` of the pipeline run named ``run_name`` (the KFP job name), if tracked."""
    if tracking_uri() is None:
        return None
    client = mlflow_client()
    experiments = [e.experiment_id for e in client.search_experiments()]
    runs = _parent_runs(client, experiments, f"attributes.run_name = '{run_name}' and tags.`{PIPELINE_RUN_TAG}` != ''")
    return run_url(server, runs[0].info.experiment_id, runs[0].info.run_id) if runs else None


def newest_experiment_url(server: str) -> str:
    """The UI page of the experiment a run was logged to last on ``server`` (its root when there is none)."""
    found = mlflow_client(server).search_experiments(order_by=["last_update_time DESC"], max_results=10)
    used = [e for e in found if e.name != "Default"]
    return experiment_url(server, used[0].experiment_id) if used else server


def child_run(parent_run_id: str, run_name: str) -> str | None:
    """The id of the run named ``run_name`` under ``parent_run_id`` (the newest, if retried), if any."""
    client = mlflow_client()
    parent = client.get_run(parent_run_id)
    runs = client.search_runs([parent.info.experiment_id],
                              f"tags.mlflow.parentRunId = '{parent_run_id}' and attributes.run_name = '{run_name}'",
                              order_by=["attributes.start_time DESC"], max_results=1)
    return runs[0].info.run_id if runs else None
