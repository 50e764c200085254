"""`flowgrpo run --local` and `flowgrpo ui`: the whole pipeline on this machine, with real services.

SeaweedFS (S3) and an MLflow server (sqlite, artifacts in that S3) are started for the run, the pipeline
function executes under ``kfp.local`` (each step a subprocess of this one; the reward server a process of its
own; training on a local Ray), and everything started is stopped at the end, on failure and on Ctrl-C. All
state lives under the work directory, so a second run reuses the cached dataset and ``ui`` shows every run.

    WORKDIR/s3/            SeaweedFS data (bucket ``flowgrpo``: datasets/, runs/, mlflow/)
    WORKDIR/credentials.json  the local S3 keys (mode 0600; generated once)
    WORKDIR/mlflow/        mlflow.db and the server's log
    WORKDIR/pipeline-root/ kfp.local task outputs (the report HTML), WORKDIR/kfp-cache/ its cache
    WORKDIR/reward-servers/ the reward server's record and log while it runs
    WORKDIR/services/      a record per service running (its pid and the run's, see ``owning_workdir``)
    WORKDIR/logs/<run>.log everything every step printed
    WORKDIR/instance.lock  held by the one `run --local` or `ui` using the work directory (pid, command)
    WORKDIR/runs/<run id>/ what a person looks at: lora/, samples/, eval/ (report.html), metrics.jsonl,
                           config.yaml, copied from the run's output in S3 (checkpoints stay there)
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from components import environ
from components.console import status_line
from components.errors import FlowGRPOError
from components.launch.process import (
    LEASES_DIR,
    SCRATCH_PREFIX,
    STOP_GRACE_S,
    Lease,
    ProcessRef,
    lease_record,
    port_is_free,
    reap_leases,
    running_process,
    stop_processes,
)
from pipeline.config import ExperimentConfig, dump_config
from pipeline.kfp_local_patch import following_tasks
from pipeline.single_instance import holding_workdir, is_held_here, stopping_on_signals

BUCKET = "flowgrpo"
RUN_COMMAND = "flowgrpo run --local"
STORAGE_ROOT = f"s3://{BUCKET}"
DEFAULT_UI_PORT = 5000
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# Library chatter a person does not need on the terminal (it stays in the log): MLflow's run links and
# download bars, warnings with their source lines.
# Ray's dashboard link too: it dies with the run's Ray, unlike the MLflow links `flowgrpo ui` serves again.
_NOISE = re.compile(r"^(🏃 View run|🧪 View experiment|Downloading artifacts|warnings\.warn\()|Warning: |"
                   r"View the dashboard at |Setting up process group for|"
                   r"core_worker\.cc|Found credentials in|Found endpoint for|\(TrainController |"
                   r"^\d{4}/\d\d/\d\d \d\d:\d\d:\d\d INFO mlflow|^Successfully registered model|^Created version")
_RAY_PREFIX = re.compile(r"^\(RayTrainWorker pid=\d+\) ")
_KFP_LOG = re.compile(r"^\d\d:\d\d:\d\d\.\d+ - ")  # a log record in kfp.local's format: log file only
_ERROR_LINE = re.compile(r"^(?:[\w.]+\.)?(\w*(?:Error|Exception|Failed|Cancelled|Interrupt)): (.+)$")


class LocalRunError(FlowGRPOError):
    """A local pipeline run whose step failed (the message names the step, the reason and the log)."""


@dataclass
class LocalRunResult:
    run_name: str
    mlflow_charts_url: str | None  # the experiment's chart view: the reward curves of every pipeline run first
    mlflow_run_url: str | None  # the pipeline run's page: the evaluation, the gate's verdict, the model version
    results: Path  # WORKDIR/runs/<run id>
    lora_uri: str
    registered: str | None
    log_path: Path
    step_seconds: dict[str, float] = field(default_factory=dict)

    @property
    def lora_path(self) -> Path:
        return self.results / "lora"

    @property
    def report_path(self) -> Path:
        return self.results / "eval" / "report.html"


class _Progress:
    """Stands in for sys.stdout while kfp.local runs: every line goes to the run's log file; a person sees
    each step start and end (with its duration), what the step itself prints, and why a step failed.
    kfp's own chatter (executor input JSON, output listings, tracebacks) stays in the log.

    Which step runs, whether it succeeded and whether the cache answered for it come as calls to
    ``task_started``, ``task_cached`` and ``task_finished`` (pipeline.kfp_local_patch), never from kfp's log text;
    what comes through ``write`` is only text, and only a running step's own output is shown."""

    def __init__(self, log_path: Path, terminal) -> None:
        self.log = open(log_path, "a", encoding="utf-8")
        self.terminal = terminal
        self.buffer = ""
        self.task: str | None = None
        self.started = 0.0
        self.in_json = False
        self.last_error: str | None = None
        self.failed: list[tuple[str, str | None]] = []
        self.seconds: dict[str, float] = {}
        self.shown = ""

    def task_started(self, name: str) -> None:
        self.task, self.started, self.last_error, self.in_json = name, time.monotonic(), None, False
        self._show(f"▶ {name}")

    def task_cached(self, name: str) -> None:
        self.seconds[name] = 0.0
        self._show(f"✓ {name} (cached: the same inputs as an earlier run)")

    def task_finished(self, name: str, succeeded: bool) -> None:
        if self.buffer:  # the step's last line, unterminated: still its output
            self.write("\n")
        took = time.monotonic() - self.started
        self.seconds[name] = took
        if succeeded:
            self._show(f"✓ {name} ({took:.1f} s)")
        else:
            self.failed.append((name, self.last_error))
            self._show(f"✗ {name} failed after {took:.1f} s: {self.last_error or 'see the log'}")
        self.task = None

    def write(self, text: str) -> int:
        self.log.write(text)
        self.buffer += text
        *lines, self.buffer = self.buffer.split("\n")
        for line in lines:
            self._line(_ANSI.sub("", line))
        return len(text)

    def flush(self) -> None:
        self.log.flush()
        self.terminal.flush()

    def isatty(self) -> bool:
        return False

    def _show(self, text: str) -> None:
        if text == self.shown:  # Ray can forward a worker's line twice (its stdout and stderr monitors)
            return
        self.shown = text
        self.terminal.write(text + "\n")
        self.terminal.flush()

    def _line(self, line: str) -> None:
        if self.task is None:  # kfp.local's own output between steps
            return
        text = _RAY_PREFIX.sub("", line.strip())
        if self.in_json:
            self.in_json = line.rstrip() != "    }"
            return
        if "Got executor_input:" in text:
            self.in_json = True
            return
        if _KFP_LOG.match(text) or _NOISE.search(text):
            return
        if not text or text.startswith(("[KFP Executor", "Traceback", "File ", "^")) or line.startswith("      "):
            return
        if m := _ERROR_LINE.match(text):
            self.last_error = f"{m.group(1)}: {m.group(2)}"
            return
        self._show(f"  {text}")

    def close(self) -> None:
        if self.log.closed:
            return
        if self.buffer:
            self.write("\n")
        self.log.close()


def _credentials(workdir: Path) -> tuple[str, str]:
    """The local S3 keys: generated once per work directory, kept with mode 0600, never printed."""
    path = workdir / "credentials.json"
    if path.is_file():
        data = json.loads(path.read_text())
        return data["access_key"], data["secret_key"]
    from pipeline.services.seaweed import random_credentials

    keys = random_credentials()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"access_key": keys[0], "secret_key": keys[1]}, f)
    return keys


@contextlib.contextmanager
def owning_workdir(workdir: Path, command: str, log=status_line) -> Iterator[Path]:
    """Hold ``workdir`` for this process (``holding_workdir``: WorkdirBusy, one line, when another instance holds
    it), stop signals unwinding the block like Ctrl-C, and first stop what an instance killed outright left running
    there (its leased services, see ``local_services``). Yields the resolved path. `flowgrpo run --local` takes it
    before anything else (reading the config, importing the trainer), so a second run is refused at once."""
    workdir = workdir.resolve()
    with holding_workdir(workdir, command), stopping_on_signals():
        reap_leases(workdir / LEASES_DIR, log)
        yield workdir


def _lease(workdir: Path, service: str, scratch: tuple[Path, ...] = ()) -> Lease:
    """Ties ``service`` to this process: it stops when this process is gone, however it ends."""
    return Lease(ProcessRef.of(os.getpid()), lease_record(workdir, service), scratch)


@contextlib.contextmanager
def local_services(workdir: Path, mlflow_port: int | None = None,
                   log=status_line) -> Iterator[dict[str, str | None]]:
    """SeaweedFS and an MLflow server over the work directory's state; yields the changes to the environment
    (None: unset) that point a client at them, and at no AWS of the user's (``environ.own_s3``). Both are stopped
    on exit, and leased to this process (stopped when it is gone however it ends)."""
    from pipeline.services.mlflow_server import running_mlflow
    from pipeline.services.seaweed import running_seaweed

    workdir.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    with running_seaweed(workdir / "s3", bucket=BUCKET, credentials=_credentials(workdir),
                         lease=_lease(workdir, "seaweedfs")) as s3, \
            running_mlflow(workdir / "mlflow", s3=s3, port=mlflow_port, lease=_lease(workdir, "mlflow")) as mlflow:
        log(f"services: S3 (SeaweedFS) at {s3.endpoint}, MLflow at {mlflow.url} "
            f"({time.monotonic() - began:.0f} s to start)")
        yield {**environ.own_s3(s3.env()), **mlflow.env()}


def _children() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}


def _stop_descendants(before: set[int]) -> None:
    """Stop every process started since ``before`` (this process's children then) that still runs: the
    steps, Ray, their children."""
    started = []
    for pid in _children() - before:
        with contextlib.suppress(psutil.NoSuchProcess):  # gone since
            started.append(ProcessRef.of(pid))
    stop_processes(lambda: {p.pid for p in started if p.alive()})


@contextlib.contextmanager
def _kfp_records_to_log(progress: _Progress) -> Iterator[None]:
    """kfp.local logs some records (a cache hit, a skipped task, the workspace cleaned up) on the root logger
    outside its own log handler, so by default they are dropped: keep them in the run's log file (only)."""
    class ToLog(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if not progress.log.closed:
                progress.log.write(self.format(record) + "\n")

    root, handler = logging.getLogger(), ToLog(logging.INFO)
    handler.setFormatter(logging.Formatter("%(asctime)s.%(msecs)03d - %(levelname)s - %(message)s", "%H:%M:%S"))
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


@contextlib.contextmanager
def _following_kfp_local(progress: _Progress) -> Iterator[None]:
    """While kfp.local runs a pipeline: its output (the steps' included) into ``progress``, its task events
    to ``progress``'s calls."""
    with contextlib.redirect_stdout(progress), following_tasks(progress), _kfp_records_to_log(progress):
        yield


def _task_output(job_dir: Path, task: str) -> dict:
    path = job_dir / task / "executor_output.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _results(job_dir: Path, ui_port: int) -> tuple[tuple[str, str] | None, str, str | None]:
    """(the MLflow chart view and pipeline run URLs as `flowgrpo ui` serves them, LoRA URI, registered
    NAME/VERSION)."""
    from components.tracking.pipeline_runs import parent_run_links

    model = _task_output(job_dir, "train").get("artifacts", {}).get("model", {}).get("artifacts", [{}])[0]
    registered = _task_output(job_dir, "register").get("parameterValues", {}).get("Output") or None
    return parent_run_links(job_dir.name, f"http://127.0.0.1:{ui_port}"), model["uri"], registered


def copy_results(lora_uri: str, runs_dir: Path) -> Path:
    """Copy what a person looks at from the run's output in S3 to ``runs_dir/<run id>`` (the output's own
    name): the LoRA, the sample grids, the evaluation, the metrics and the config; checkpoints stay in S3."""
    from components import storage
    from components.trainer.run_output import CONFIG_FILE, FINAL_LORA_DIR, METRICS_FILE, SAMPLES_DIR

    output = lora_uri.rstrip("/").removesuffix(f"/{FINAL_LORA_DIR}")
    local = runs_dir / output.rsplit("/", 1)[1]
    for folder in (FINAL_LORA_DIR, SAMPLES_DIR, "eval"):
        storage.download_dir(storage.join(output, folder), local / folder)
    for name in (METRICS_FILE, CONFIG_FILE):
        storage.get_file(storage.join(output, name), local / name)
    return local


def run_local(config: ExperimentConfig, *, workdir: Path, ray_workers: int = 1, ui_port: int = DEFAULT_UI_PORT,
              log=status_line) -> LocalRunResult:
    """Run the pipeline on this machine (see the module docstring) in ``workdir``, which this process owns
    (``owning_workdir(workdir, RUN_COMMAND)``); raises LocalRunError naming the failed step. Nothing it started
    outlives it, also when it is stopped by Ctrl-C, SIGTERM or SIGHUP, or killed outright (its services are leased
    to it)."""
    if not is_held_here(workdir):
        raise LocalRunError(f"{workdir} is not held by this process: run inside owning_workdir({str(workdir)!r}, "
                            "RUN_COMMAND), which refuses a work directory another instance uses")
    from kfp import local

    from components.launch.interface import LOCAL_PREFIX
    from components.launch.local import stop_all_local
    from pipeline.kfp_pipeline import build_pipeline

    (workdir / "logs").mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=SCRATCH_PREFIX, dir=workdir))  # kfp.local's ephemeral files land here
    # Ray's unix socket paths (under its temp dir) must stay below 108 bytes: a short folder in the system's.
    ray_tmp = Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}ray-"))
    run_name = f"flowgrpo-{time.strftime('%Y%m%d-%H%M%S')}"
    log_path = workdir / "logs" / f"{run_name}.log"
    # The steps, and all they start (Ray, its workers), name this run in their environment (FLOWGRPO_LEASE_OWNER):
    # should this process be killed outright, its tether stops them and removes the scratch folders.
    with running_process([], cwd=workdir, env=dict(os.environ), log_path=log_path, what="the run's tether",
                         ready=lambda: True, timeout_s=STOP_GRACE_S, lease=_lease(workdir, "run", (scratch, ray_tmp))):
        progress = None
        before = _children()
        # MLflow on the port `flowgrpo ui` serves, so the links printed during the run keep working afterwards
        mlflow_port = ui_port if port_is_free(ui_port) else None
        try:
            with local_services(workdir, mlflow_port=mlflow_port, log=log) as service_env, environ.patched_environ({
                **service_env, "TMPDIR": str(scratch), **environ.entry_settings(),
                "FLOWGRPO_CACHE_DIR": str(workdir / "cache"), "RAY_AUTH_MODE": "disabled",
                "RAY_TMPDIR": str(ray_tmp),
                # leases the steps and all they start to this run (the deploy step: the reward server too)
                environ.FLOWGRPO_LEASE_OWNER.name: str(ProcessRef.of(os.getpid())),
            }):
                tempfile.tempdir = str(scratch)
                if mlflow_port is None:
                    log(f"port {ui_port} is in use: the MLflow links printed during this run work only while it "
                        f"runs; afterwards `flowgrpo ui --workdir {workdir} --port {ui_port}` serves them")
                local.init(runner=local.SubprocessRunner(use_venv=False),
                           pipeline_root=str(workdir / "pipeline-root"), workspace_root=str(scratch / "workspace"),
                           raise_on_error=False, enable_caching=True, cache_root=str(workdir / "kfp-cache"))
                log(f"pipeline: prepare dataset -> deploy reward server -> train -> evaluate -> register "
                    f"(log: {log_path})")
                progress = _Progress(log_path, sys.stdout)
                with _following_kfp_local(progress), warnings.catch_warnings():
                    # kfp.local warns that the images are not used and that k8s settings are ignored: both known.
                    warnings.simplefilter("ignore")
                    pipeline = build_pipeline(eval_gpus=0, retries=False)
                    pipeline(config=dump_config(config), overrides=[], storage_root=STORAGE_ROOT,
                             ray_workers=ray_workers, launcher=f"{LOCAL_PREFIX}{workdir}")
                progress.close()
                job_dir = _newest_job(workdir / "pipeline-root")
                if progress.failed:
                    step, reason = progress.failed[0]  # the first failed step (teardown, the exit task, runs last)
                    raise LocalRunError(f"step {step!r} failed: {reason or 'no error line'}; its output is in "
                                        f"{log_path}")
                links, lora, registered = _results(job_dir, ui_port)
                results = copy_results(lora, workdir / "runs")
                return LocalRunResult(job_dir.name, *(links or (None, None)), results, lora, registered, log_path,
                                      progress.seconds)
        except KeyboardInterrupt:
            log("interrupted: stopping every process this run started")
            raise
        finally:
            tempfile.tempdir = None
            if progress is not None:
                progress.close()
            _stop_descendants(before)
            stop_all_local(workdir, log=log)
            shutil.rmtree(scratch, ignore_errors=True)
            shutil.rmtree(ray_tmp, ignore_errors=True)


def _newest_job(pipeline_root: Path) -> Path:
    jobs = sorted((p for p in pipeline_root.iterdir() if p.is_dir()), key=lambda p: p.stat().st_mtime)
    return jobs[-1]


def serve_ui(workdir: Path, port: int = DEFAULT_UI_PORT, log=status_line) -> None:
    """Serve MLflow (with its images, from the local S3) over the state local runs left, until Ctrl-C, SIGTERM
    or SIGHUP; WorkdirBusy when another instance uses ``workdir``."""
    from components.tracking.pipeline_runs import newest_experiment_url

    workdir = workdir.resolve()
    if not (workdir / "mlflow" / "mlflow.db").is_file():
        raise LocalRunError(f"{workdir} holds no local run (no mlflow/mlflow.db); run `flowgrpo run --local "
                            f"--workdir {workdir}` first")
    with owning_workdir(workdir, "flowgrpo ui", log), local_services(workdir, mlflow_port=port, log=log) as env:
        log(f"MLflow UI: {newest_experiment_url(env['MLFLOW_TRACKING_URI'])} (Ctrl-C stops it)")
        with contextlib.suppress(KeyboardInterrupt):  # SIGTERM, SIGHUP too: a clean stop, not an error
            while True:
                time.sleep(3600)
        log("MLflow UI stopped")
