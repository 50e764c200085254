"""Logging a training run to MLflow without ever stopping it.

Every call on :class:`MlflowTracker` only queues work; one background thread sends it in order. When the
server is unreachable the thread keeps the queue, retries with back-off, says so once, and says again when
it is back, so an outage costs no metric and no training time. Requests MLflow rejects for good (a bad
value, a missing parent run) are reported and dropped. :meth:`close` waits a bounded time for the queue
to drain and reports what could not be sent (every metric is in ``metrics.jsonl`` anyway).
"""

from __future__ import annotations

import collections
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from components import environ
from components.polling import Polls, backoff
from components.tracking.params import redact, short_error, user_tag
from components.tracking.server import (
    PIPELINE_RUN_TAG,
    experiment_id,
    mlflow_client,
    run_url,
    tracking_uri,
)

PARENT_METRICS_PREFIX = "reward/"  # the metrics a child run also logs into its parent (see _runs_shown)
SAMPLES_KEY = "samples"  # the sample grids' MLflow image key, and their folder among the run's artifacts
SAMPLE_VIDEOS_DIR = f"{SAMPLES_KEY}/videos"  # a video model's animated samples, beside the grids
# a server never reached during the run gets this long at close (one more try, woken by close), not the flush
# timeout: waiting two minutes for a server that never answered loses the user time and saves nothing
NEVER_REACHED_GRACE_S = 5.0
FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
_PERMANENT_CODES = {"INVALID_PARAMETER_VALUE", "RESOURCE_DOES_NOT_EXIST", "RESOURCE_ALREADY_EXISTS",
                    "BAD_REQUEST", "INVALID_STATE", "PERMISSION_DENIED", "UNAUTHENTICATED"}


@dataclass
class _Op:
    name: str
    fn: Callable[[], None]


def _is_permanent(exc: BaseException) -> bool:
    return getattr(exc, "error_code", None) in _PERMANENT_CODES


def metric_batch(metrics: dict[str, Any], step: int, timestamp_ms: int) -> list:
    """MLflow Metric entities of the finite numbers in ``metrics``: an epoch whose rewards all failed has no
    mean to plot."""
    from mlflow.entities import Metric

    return [Metric(k, float(v), timestamp_ms, step) for k, v in metrics.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)]


def base_metrics(row: dict[str, Any]) -> dict[str, Any]:
    """The first row's ``heldout/<reward>/base`` values as ``heldout/<reward>/mean``: what the tracker logs at
    step 0 (before any update), so the held-out curve starts at the base model."""
    return {k.removesuffix("/base") + "/mean": v for k, v in row.items()
            if k.startswith("heldout/") and k.endswith("/base")}


def send_image(client: Any, run_id: str, image: np.ndarray, key: str, step: int, artifact_file: str) -> None:
    """Log ``image`` as ``artifact_file`` (a stable name in the artifact tree) and under ``key`` at ``step``
    (generated names under images/, which the image cards of MLflow's chart view read)."""
    client.log_image(run_id, image, artifact_file=artifact_file)
    client.log_image(run_id, image, key=key, step=step, synchronous=True)


class NullTracker:
    """Tracking off (no MLFLOW_TRACKING_URI): every call is a no-op."""

    run_id: str | None = None
    url: str | None = None

    def log_params(self, params: dict[str, str]) -> None: ...
    def set_tags(self, tags: dict[str, str]) -> None: ...
    def log_metrics(self, metrics: dict[str, Any], step: int) -> None: ...
    def log_image(self, image: np.ndarray, key: str, step: int, artifact_file: str) -> None: ...
    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None: ...
    def call(self, what: str, fn: Callable[[str], None]) -> None: ...
    def close(self, status: str = "FINISHED") -> None: ...

    def last_step(self, key: str) -> int | None:
        """The highest step the run holds for metric ``key``; None when unknown."""
        return None


class MlflowTracker(NullTracker):
    def __init__(self, uri: str, experiment: str, run_name: str, *, parent_run_id: str | None = None,
                 run_id: str | None = None, system_metrics: bool = True, owns_run: bool = True,
                 log: Callable[[str], None] = print) -> None:
        self.uri = redact(uri)  # for messages: a password in the URL never reaches a log
        self.client = mlflow_client(uri)
        self.log = log
        self.run_id = run_id
        self.url: str | None = None
        self._experiment, self._run_name, self._parent = experiment, run_name, parent_run_id
        self._system_metrics = system_metrics
        self._owns_run = owns_run  # False: another process (the Ray driver) finishes the run
        self._monitor = None
        self._queue: collections.deque[_Op] = collections.deque()
        self._cond = threading.Condition()
        self._closing = False
        self._disabled = False
        self._idle = threading.Event()
        self._reached = threading.Event()  # some request succeeded: the server exists
        self._opened = threading.Event()
        self._thread = threading.Thread(target=self._work, name="mlflow-tracker", daemon=True)
        self._submit("open run", self._open_run)
        self._thread.start()
        wait = environ.FLOWGRPO_MLFLOW_OPEN_TIMEOUT_S.value()
        # a tracker that does not own its run (a Ray worker's) logs into one whose owner has shown its URL
        if self._opened.wait(wait) and self.url and owns_run:
            self.log(f"MLflow run {self.run_id}: {self.url}")
        # otherwise the worker has said, or will say once its request fails, why there is no run yet

    # -- queue ---------------------------------------------------------------------------------------
    def _submit(self, name: str, fn: Callable[[], None]) -> None:
        with self._cond:
            if self._disabled:
                return
            self._idle.clear()
            self._queue.append(_Op(name, fn))
            self._cond.notify()

    def _work(self) -> None:
        pauses = backoff(FIRST_BACKOFF_S, cap_s=MAX_BACKOFF_S)
        failing_since: float | None = None
        while True:
            with self._cond:
                while not self._queue and not self._closing:
                    self._idle.set()
                    self._cond.wait()
                if not self._queue:
                    self._idle.set()
                    return
                op = self._queue[0]
            try:
                op.fn()
            except Exception as exc:
                if _is_permanent(exc):
                    self._drop(op, exc)
                    continue
                if failing_since is None:
                    failing_since = time.monotonic()
                    self.log(f"MLflow at {self.uri} unreachable ({short_error(exc)}); buffering "
                             f"{len(self._queue)} item(s) and retrying; training goes on")
                with self._cond:
                    self._cond.wait(timeout=next(pauses))  # close() wakes us to retry at once
                continue
            self._reached.set()
            with self._cond:
                self._queue.popleft()
            if failing_since is not None:
                self.log(f"MLflow at {self.uri} reachable again after {time.monotonic() - failing_since:.0f}s; "
                         f"sending {len(self._queue)} buffered item(s)")
                failing_since, pauses = None, backoff(FIRST_BACKOFF_S, cap_s=MAX_BACKOFF_S)

    def _drop(self, op: _Op, exc: BaseException) -> None:
        with self._cond:
            self._queue.popleft()
            if op.name == "open run":  # nothing can be logged without a run
                self._disabled = True
                self._queue.clear()
        what = "tracking is off for this run" if self._disabled else "skipped"
        self.log(f"MLflow rejected {op.name}: {short_error(exc)}; {what}")
        if self._disabled:
            self._opened.set()  # stop the constructor waiting for a run that will never exist

    # -- operations ----------------------------------------------------------------------------------
    def _open_run(self) -> None:
        if self.run_id is None:
            tags = user_tag()
            if self._parent:  # a wrong parent id is a permanent error, not an orphan
                parent_tags = self.client.get_run(self._parent).data.tags
                tags["mlflow.parentRunId"] = self._parent
                if PIPELINE_RUN_TAG in parent_tags:  # every run of a pipeline run carries its id
                    tags[PIPELINE_RUN_TAG] = parent_tags[PIPELINE_RUN_TAG]
            run = self.client.create_run(experiment_id(self.client, self._experiment), run_name=self._run_name,
                                         tags=tags)
            self.run_id = run.info.run_id
        else:
            run = self.client.get_run(self.run_id)
            self.client.update_run(self.run_id, status="RUNNING")
            self._parent = run.data.tags.get("mlflow.parentRunId")  # a resumed run, a worker's: the same parent
        self.url = run_url(self.uri, run.info.experiment_id, self.run_id)
        if self._system_metrics:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            self._monitor = SystemMetricsMonitor(self.run_id, tracking_uri=self.client.tracking_uri,
                                                 resume_logging=True)
            self._monitor.start()
        self._opened.set()

    def log_params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        items = sorted(params.items())
        for i in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
            batch = [Param(k, v) for k, v in items[i:i + 100]]
            self._submit("log params", lambda b=batch: self.client.log_batch(self.run_id, params=b))

    def set_tags(self, tags: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        batch = [RunTag(k, v) for k, v in sorted(tags.items())]
        self._submit("set tags", lambda: self.client.log_batch(self.run_id, tags=batch))

    def log_metrics(self, metrics: dict[str, Any], step: int) -> None:
        """Log ``metrics`` at ``step``; the ``reward/*`` ones also into the parent run (see ``_runs_shown``)."""
        batch = metric_batch(metrics, step, int(time.time() * 1000))

        def send() -> None:
            for run_id in self._runs_shown():
                shown = batch if run_id == self.run_id else [m for m in batch
                                                             if m.key.startswith(PARENT_METRICS_PREFIX)]
                if shown:
                    self.client.log_batch(run_id, metrics=shown)

        self._submit(f"metrics of step {step}", send)

    def log_image(self, image: np.ndarray, key: str, step: int, artifact_file: str) -> None:
        """See ``send_image``; also into the parent run (see ``_runs_shown``)."""
        self._submit(f"image {artifact_file}", lambda: [
            send_image(self.client, run_id, image, key, step, artifact_file) for run_id in self._runs_shown()])

    def last_step(self, key: str) -> int | None:
        """Asked when a run resumes, so the epochs logged before the interruption are not logged twice (MLflow keeps
        every value sent, and would show a second point at each such step). None when the server does not answer
        now: every epoch is then logged, at worst twice."""
        if not self._opened.wait(environ.FLOWGRPO_MLFLOW_OPEN_TIMEOUT_S.value()):
            return None
        try:
            return max((m.step for m in self.client.get_metric_history(self.run_id, key)), default=None)
        except Exception as exc:  # any failure means "unknown": training goes on
            self.log(f"MLflow at {self.uri}: the steps already logged could not be read ({short_error(exc)}); "
                     "epochs since the checkpoint are logged again")
            return None

    def _runs_shown(self) -> list[str]:
        """This run, and its parent when it has one: MLflow's experiment views show a pipeline run with its
        steps' runs folded, so the pipeline run carries the reward curves and sample grids a person looks for
        (the parent is only known once the run is open, hence a method called when an item is sent)."""
        return [self.run_id, self._parent] if self._parent else [self.run_id]

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        """Upload a file as a run artifact (e.g. the evaluation report); the file must stay until close()."""
        self._submit(f"artifact {Path(path).name}",
                     lambda: self.client.log_artifact(self.run_id, str(path), artifact_path))

    def call(self, what: str, fn: Callable[[str], None]) -> None:
        """Queue ``fn(run_id)`` behind everything logged so far (e.g. registering the LoRA as a model version),
        retried like the rest while the server is away; ``what`` names it in messages."""
        self._submit(what, lambda: fn(self.run_id))

    def close(self, status: str = "FINISHED") -> None:
        """Finish the run (if this tracker owns it); wait up to $FLOWGRPO_MLFLOW_FLUSH_TIMEOUT_S for buffered
        items to be sent, or NEVER_REACHED_GRACE_S when no request ever got through."""
        if self._owns_run:
            self._submit("finish run", lambda: self.client.set_terminated(self.run_id, status=status))
        with self._cond:
            self._closing = True
            self._cond.notify()
        timeout = environ.FLOWGRPO_MLFLOW_FLUSH_TIMEOUT_S.value()
        for waited in Polls(timeout, 0.1, wait=self._idle.wait, wait_first=True):
            if not self._reached.is_set() and waited >= NEVER_REACHED_GRACE_S:
                break
        if self._monitor is not None:
            self._monitor.finish()
        with self._cond:
            left = [op.name for op in self._queue]
            self._queue.clear()
            self._cond.notify()
        if left:
            why = (f"not sent within {timeout:g}s" if self._reached.is_set()
                   else "not sent: it was never reachable during this run")
            self.log(f"MLflow at {self.uri}: {len(left)} item(s) {why} ({', '.join(left[:3])}"
                     f"{', ...' if len(left) > 3 else ''}); the metrics are in metrics.jsonl, the sample grids in "
                     "samples/ and the LoRA in lora/ of the run output: `flowgrpo replay-mlflow OUTPUT` logs "
                     "them as a run once MLflow is back")


def resolve_parent_run(given: str | None = None) -> str | None:
    """The MLflow run to log under: ``given``, else $FLOWGRPO_MLFLOW_PARENT_RUN_ID (set by the pipeline step
    that owns the pipeline run's MLflow run), else none."""
    return given or environ.FLOWGRPO_MLFLOW_PARENT_RUN_ID.get()


def open_tracker(experiment: str, run_name: str, *, run_id: str | None = None, parent_run_id: str | None = None,
                 system_metrics: bool = True, owns_run: bool = True,
                 log: Callable[[str], None] = print) -> NullTracker:
    """An MLflow tracker when $MLFLOW_TRACKING_URI is set, else a no-op one; a child of
    ``resolve_parent_run(parent_run_id)`` when there is one."""
    uri = tracking_uri()
    if not uri:
        log("MLflow tracking off (MLFLOW_TRACKING_URI is not set)")
        return NullTracker()
    return MlflowTracker(uri, experiment, run_name, parent_run_id=resolve_parent_run(parent_run_id), run_id=run_id,
                         system_metrics=system_metrics, owns_run=owns_run, log=log)
