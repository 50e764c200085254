"""Replaying a run output into MLflow later, so a run trained while MLflow was down (or with tracking off)
appears on the dashboards as a live-tracked run would: the same params, lineage tags, metric histories
(step = epoch), sample grids and registered LoRA.

Synchronous and all-or-nothing: a replay that fails part-way deletes the run it made, so running the
command again never leaves two copies. A run output already in the experiment (a replay, or the live run
that lost MLflow part-way) is refused unless forced.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from components.errors import TrackingError
from components.tracking.params import RUN_OUTPUT_TAG, flatten_params, redact, short_error, user_tag
from components.tracking.server import experiment_id, mlflow_client, run_url, tracking_uri
from components.tracking.tracker import SAMPLE_VIDEOS_DIR, SAMPLES_KEY, base_metrics, metric_batch, send_image

# MLflow takes at most 1000 metrics and 100 params per log_batch call
_METRICS_PER_BATCH = 1000
_PARAMS_PER_BATCH = 100
_PROGRESS_EVERY_S = 10.0
# (run id, model name, LoRA folder, model config, seed, version tags, log) -> the new version
RegisterFn = Callable[..., str]
EPOCH_SECONDS_KEYS = ("time/sampling", "time/scoring", "time/training")


@dataclass
class FinishedRun:
    """What a run output holds, read back (see ``components.trainer.run_output.read_finished_run``)."""

    uri: str
    config: dict[str, Any]
    metrics: list[dict[str, Any]]
    samples: list[tuple[int, Path]]  # (epoch, grid PNG), by epoch
    lora_dir: Path | None  # None: the run never finished
    lineage: dict[str, str]
    latest_checkpoint: str | None
    started_at_ms: int | None  # None: written before run.json existed
    videos: list[Path] = field(default_factory=list)  # a video model's animated samples, by name


@dataclass
class Replayed:
    run_id: str
    url: str
    status: str
    registered_version: str | None


def metric_timestamps(rows: list[dict[str, Any]], started_at_ms: int | None) -> list[int]:
    """When each epoch ended, as the live run would have logged it: the start plus the epochs' own timings
    (restarts after a crash are not in them). Without a start time: now, for every row."""
    if started_at_ms is None:
        return [int(time.time() * 1000)] * len(rows)
    seconds = [sum(float(row.get(k) or 0.0) for k in EPOCH_SECONDS_KEYS) for row in rows]
    return [started_at_ms + int(1000 * s) for s in itertools.accumulate(seconds)]


class _Replay:
    def __init__(self, uri: str, run: FinishedRun, log: Callable[[str], None]) -> None:
        self.uri = redact(uri)
        self.client = mlflow_client(uri)
        self.run = run
        self.log = log
        self.run_id: str | None = None
        self.timestamps = metric_timestamps(run.metrics, run.started_at_ms)  # one per epoch row

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        try:
            return fn()
        except Exception as exc:  # MLflow raises its own, requests' and OSError types for the same outage
            raise TrackingError(f"MLflow at {self.uri}: {what} failed: {short_error(exc)}") from exc

    def experiment(self, name: str) -> str:
        return self._call(f"finding or creating experiment {name!r}", lambda: experiment_id(self.client, name))

    def existing_runs(self, experiment_id: str) -> list:
        uri = redact(self.run.uri)
        if "'" in uri:  # not expressible in a filter string: list the tagged runs and compare here
            runs = self._call("searching runs", lambda: self.client.search_runs(
                [experiment_id], f"tags.`{RUN_OUTPUT_TAG}` != ''"))
            return [r for r in runs if r.data.tags.get(RUN_OUTPUT_TAG) == uri]
        return self._call("searching runs", lambda: self.client.search_runs(
            [experiment_id], f"tags.`{RUN_OUTPUT_TAG}` = '{uri}'"))

    def create(self, experiment_id: str, run_name: str) -> None:
        tags = {**user_tag(), **self.run.lineage, RUN_OUTPUT_TAG: redact(self.run.uri), "flowgrpo.replayed": "true"}
        if self.run.latest_checkpoint:
            tags["flowgrpo.latest_checkpoint"] = self.run.latest_checkpoint
        created = self._call("creating the run", lambda: self.client.create_run(
            experiment_id, start_time=self.run.started_at_ms, run_name=run_name, tags=tags))
        self.run_id = created.info.run_id

    def params(self) -> int:
        from mlflow.entities import Param

        items = sorted(flatten_params(self.run.config).items())
        for i in range(0, len(items), _PARAMS_PER_BATCH):
            batch = [Param(k, v) for k, v in items[i:i + _PARAMS_PER_BATCH]]
            self._call("logging params", lambda b=batch: self.client.log_batch(self.run_id, params=b))
        return len(items)

    def metrics(self) -> int:
        rows = self.run.metrics
        metrics = [m for row, ts in zip(rows, self.timestamps, strict=True)
                   for m in metric_batch(row, int(row["epoch"]), ts)]
        if rows:  # the base model's held-out reward, logged live at step 0 before the first epoch
            metrics += metric_batch(base_metrics(rows[0]), 0, self.run.started_at_ms or self.timestamps[0])
        for i in range(0, len(metrics), _METRICS_PER_BATCH):
            batch = metrics[i:i + _METRICS_PER_BATCH]
            self._call("logging metrics", lambda b=batch: self.client.log_batch(self.run_id, metrics=b))
        return len(metrics)

    def images(self) -> None:
        from PIL import Image

        total, last_said = len(self.run.samples), time.monotonic()
        for i, (epoch, path) in enumerate(self.run.samples, 1):
            with Image.open(path) as img:
                grid = np.asarray(img.convert("RGB"))
            self._call(f"logging sample grid {path.name}", lambda g=grid, e=epoch, p=path: send_image(
                self.client, self.run_id, g, SAMPLES_KEY, e, f"{SAMPLES_KEY}/{p.name}"))
            if time.monotonic() - last_said >= _PROGRESS_EVERY_S and i < total:
                self.log(f"replay: {i}/{total} sample grids sent")
                last_said = time.monotonic()
        for path in self.run.videos:
            self._call(f"logging sample video {path.name}", lambda p=path: self.client.log_artifact(
                self.run_id, str(p), SAMPLE_VIDEOS_DIR))

    def lora(self, registered_model: str | None, register: RegisterFn | None) -> str | None:
        """Register the LoRA as the live run would; without a registered model (or a way to register), log the
        folder as artifacts."""
        lora_dir = self.run.lora_dir
        if lora_dir is None:
            return None
        if not registered_model or register is None:
            self._call("logging the LoRA", lambda: self.client.log_artifacts(self.run_id, str(lora_dir), "lora"))
            return None
        config = self.run.config
        tags = {**self.run.lineage, "flowgrpo.lora_uri": _join(self.run.uri, lora_dir.name)}
        return self._call(f"registering the LoRA as {registered_model!r}", lambda: register(
            self.run_id, registered_model, lora_dir, config.get("model") or {}, int(config.get("seed", 0)), tags,
            log=self.log))

    def finish(self, status: str) -> None:
        end = self.timestamps[-1:] or [None]
        self._call("finishing the run", lambda: self.client.set_terminated(self.run_id, status, end_time=end[0]))

    def discard(self) -> str:
        """Delete the partial run; returns what became of it, for the error message."""
        try:
            self.client.delete_run(self.run_id)
        except Exception as exc:
            return (f"the partial run {self.run_id} could not be deleted ({short_error(exc)}); delete it before "
                    "replaying again, or pass --force")
        return f"the partial run {self.run_id} was deleted; run the command again"


def _join(uri: str, name: str) -> str:
    return f"{uri.rstrip('/')}/{name}"


def replay_run(run: FinishedRun, *, run_name: str, experiment: str | None = None,
               register: RegisterFn | None = None, force: bool = False,
               log: Callable[[str], None] = print) -> Replayed:
    """Log ``run`` to $MLFLOW_TRACKING_URI as a new run in ``experiment`` (default: the run's
    ``tracking.experiment``) and, with ``register`` (``components.registry.versions.register_lora_version``),
    the LoRA as a new version of its ``tracking.registered_model``."""
    uri = tracking_uri()
    if not uri:
        raise TrackingError("MLFLOW_TRACKING_URI is not set: it names the MLflow server to replay into")
    tracking = run.config.get("tracking") or {}
    experiment = experiment or tracking.get("experiment") or "flowgrpo"
    replay = _Replay(uri, run, log)
    exp_id = replay.experiment(experiment)
    existing = replay.existing_runs(exp_id)
    if existing and not force:
        ids = ", ".join(f"{r.info.run_id} ({r.info.status})" for r in existing)
        raise TrackingError(f"{redact(run.uri)} is already in MLflow experiment {experiment!r} as run {ids}; "
                            "pass --force to log another copy")
    log(f"replay: {redact(run.uri)} -> MLflow experiment {experiment!r} at {replay.uri} as run {run_name!r}")
    replay.create(exp_id, run_name)
    try:
        params = replay.params()
        values = replay.metrics()
        log(f"replay: {params} params, {len(run.metrics)} epochs of metrics ({values} values)")
        replay.images()
        if run.samples:
            videos = f", {len(run.videos)} sample videos" if run.videos else ""
            log(f"replay: {len(run.samples)} sample grids{videos}")
        version = replay.lora(tracking.get("registered_model"), register)
        status = "FINISHED" if run.lora_dir is not None else "FAILED"
        replay.finish(status)
    except BaseException as exc:  # Ctrl-C included: a half-logged run is worse than none
        outcome = replay.discard()
        if isinstance(exc, TrackingError):
            raise TrackingError(f"{exc}; {outcome}") from exc
        raise
    if run.lora_dir is None:
        log("replay: the output has no final lora/ (the run did not finish); the MLflow run is marked FAILED")
    elif version is None:
        log("replay: LoRA logged as artifacts under lora/")
    return Replayed(replay.run_id, run_url(replay.uri, exp_id, replay.run_id), status, version)
