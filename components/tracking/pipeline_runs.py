"""MLflow runs of a pipeline run: the parent run every step logs under, what it shows (the evaluation's results,
the gate's verdict, the registered model version) and the links to it. Synchronous, unlike the trainer's tracker:
a pipeline step has nothing to overlap with."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator

from components.errors import ConfigError
from components.tracking.params import redact, short_error, user_tag
from components.tracking.server import (
    CHARTS_VIEW_TAG,
    PIPELINE_RUN_TAG,
    charts_view,
    experiment_id,
    experiment_url,
    mlflow_client,
    model_version_route,
    model_version_url,
    run_url,
    tracking_uri,
)

_PARENT = "mlflow.parentRunId"
_DESCRIPTION = "mlflow.note.content"  # the run page's Description, rendered as Markdown (links work)
GATE_TAG, GATE_REASON_TAG = "flowgrpo.gate", "flowgrpo.gate_reason"
MODEL_VERSION_TAG, MODEL_VERSION_URL_TAG = "flowgrpo.model_version", "flowgrpo.model_version_url"
# What the pipeline run shows of each eval reward (its evaluate run has them all).
EVAL_FIELDS = ("base_mean", "lora_mean", "delta", "ci_low", "ci_high")


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
    run = client.create_run(experiment, run_name=run_name, tags={**user_tag(), PIPELINE_RUN_TAG: pipeline_run_id})
    return run.info.run_id


@contextlib.contextmanager
def _reported(what: str, log: Callable[[str], None]) -> Iterator[str | None]:
    """Yields the tracking URI (None: tracking off) and turns a refused URI or an MLflow that cannot be reached
    into one line saying it could not ``what``: for calls whose results are kept elsewhere too."""
    try:
        uri = tracking_uri()
    except ConfigError as exc:
        log(f"MLflow: could not {what}: {exc}")
        uri = None
    if uri is None:
        yield None
        return
    from mlflow.exceptions import MlflowException

    try:
        yield uri
    except (MlflowException, OSError) as exc:
        log(f"MLflow at {redact(uri)}: could not {what}: {short_error(exc)}")


def finish_parent_run(experiment: str, pipeline_run_id: str, succeeded: bool,
                      log: Callable[[str], None] = print) -> None:
    """Close the pipeline's run as FINISHED or FAILED (no-op when tracking is off or it was never opened). An
    MLflow that cannot be reached, or a tracking URI refused, is reported, not raised: the exit task's real job is
    the teardown."""
    with _reported("close the pipeline's run", log) as uri:
        if uri is None:
            return
        client = mlflow_client()
        found = client.get_experiment_by_name(experiment)
        for run in [] if found is None else _runs_of(client, found.experiment_id, pipeline_run_id):
            client.set_terminated(run.info.run_id, status="FINISHED" if succeeded else "FAILED")


def show_evaluation(parent_run_id: str, rewards: dict[str, dict], tags: dict[str, str],
                    log: Callable[[str], None] = print) -> None:
    """Put an evaluation's results on the pipeline run (``eval/<reward>/<field>`` metrics, the gate's ``tags``, a
    Description summing them up) and save its experiment's chart view with the reward charts first. Reported, not
    raised: the results are in eval.json and the evaluate run too."""
    from components.tracking.tracker import metric_batch

    with _reported("show the evaluation on the pipeline run", log) as uri:
        if uri is None:
            return
        client = mlflow_client()
        now = int(time.time() * 1000)
        metrics = {f"eval/{key}/{field}": row[field] for key, row in rewards.items() for field in EVAL_FIELDS}
        client.log_batch(parent_run_id, metrics=metric_batch(metrics, 0, now))
        _describe(client, parent_run_id, tags)
        experiment = client.get_run(parent_run_id).info.experiment_id
        shown = _parent_runs(client, [experiment], f"tags.`{PIPELINE_RUN_TAG}` != ''")
        keys = {key for run in shown for key in run.data.metrics} | set(metrics)
        client.set_experiment_tag(experiment, CHARTS_VIEW_TAG, charts_view(keys, now))


def show_model_version(train_run_id: str, name: str, version: str, log: Callable[[str], None] = print) -> None:
    """Tag the pipeline run that training run ``train_run_id`` belongs to with the model version registered from
    it (``NAME/VERSION`` and the UI's URL of the version) and link the version in its Description. Reported, not
    raised: the version is registered and gated already."""
    with _reported("link the model version from the pipeline run", log) as uri:
        if uri is None:
            return
        client = mlflow_client()
        parent = client.get_run(train_run_id).data.tags.get(_PARENT)
        if parent is None:
            return
        tags = {MODEL_VERSION_TAG: f"{name}/{version}"}
        if uri.startswith(("http://", "https://")):  # a sqlite:// store has no UI of its own
            tags[MODEL_VERSION_URL_TAG] = model_version_url(uri, name, version)
        _describe(client, parent, tags)


def _describe(client, run_id: str, tags: dict[str, str]) -> None:
    """Set ``tags`` on ``run_id`` and write its Description from what it shows: the gate's verdict, the model
    version (a link relative to the UI, so it works wherever the UI is served) and each eval reward's numbers."""
    from mlflow.entities import RunTag

    run = client.get_run(run_id)
    shown, metrics = {**run.data.tags, **tags}, run.data.metrics
    blocks = []
    if GATE_TAG in shown:
        blocks.append(f"**Gate: {shown[GATE_TAG]}**: {shown.get(GATE_REASON_TAG, '')}")
    if MODEL_VERSION_TAG in shown:
        name, _, version = shown[MODEL_VERSION_TAG].rpartition("/")
        blocks.append(f"Registered model: [{name} version {version}]({model_version_route(name, version)})")
    lines = []
    for key in sorted({k[len("eval/"):].rpartition("/")[0] for k in metrics if k.startswith("eval/")}):
        v = {field: metrics.get(f"eval/{key}/{field}", float("nan")) for field in EVAL_FIELDS}
        lines.append(f"- {key}: base {v['base_mean']:.4g} -> LoRA {v['lora_mean']:.4g}, delta {v['delta']:+.4g}, "
                     f"CI [{v['ci_low']:+.4g}, {v['ci_high']:+.4g}]")
    if lines:
        blocks.append("\n".join(lines))
    written = {**tags, _DESCRIPTION: "\n\n".join(blocks)}
    client.log_batch(run_id, tags=[RunTag(k, v) for k, v in written.items()])


def lineage_of(run_id: str) -> dict[str, str]:
    """The ``flowgrpo.*`` lineage tags a training run carries (config hash, dataset, base model, commit)."""
    return {k: v for k, v in mlflow_client().get_run(run_id).data.tags.items() if k.startswith("flowgrpo.")}


def parent_run_links(run_name: str, server: str) -> tuple[str, str] | None:
    """The UI pages on ``server`` of the pipeline run named ``run_name`` (the KFP job name), if tracked: its
    experiment's chart view and the run's own page."""
    if tracking_uri() is None:
        return None
    client = mlflow_client()
    experiments = {e.experiment_id: e for e in client.search_experiments()}
    runs = _parent_runs(client, list(experiments),
                        f"attributes.run_name = '{run_name}' and tags.`{PIPELINE_RUN_TAG}` != ''")
    if not runs:
        return None
    run = runs[0].info
    return _charts_url(server, experiments[run.experiment_id]), run_url(server, run.experiment_id, run.run_id)


def newest_experiment_url(server: str) -> str:
    """The chart view of the experiment a run was logged to last on ``server`` (its root when there is none)."""
    found = mlflow_client(server).search_experiments(order_by=["last_update_time DESC"], max_results=10)
    used = [e for e in found if e.name != "Default"]
    return _charts_url(server, used[0]) if used else server


def _charts_url(server: str, experiment) -> str:
    """``experiment``'s chart view, in the reward-first order of its saved view once a pipeline run saved it."""
    return experiment_url(server, experiment.experiment_id, saved_view=CHARTS_VIEW_TAG in (experiment.tags or {}))


def child_run(parent_run_id: str, run_name: str) -> str | None:
    """The id of the run named ``run_name`` under ``parent_run_id`` (the newest, if retried), if any."""
    client = mlflow_client()
    parent = client.get_run(parent_run_id)
    runs = client.search_runs([parent.info.experiment_id],
                              f"tags.mlflow.parentRunId = '{parent_run_id}' and attributes.run_name = '{run_name}'",
                              order_by=["attributes.start_time DESC"], max_results=1)
    return runs[0].info.run_id if runs else None
