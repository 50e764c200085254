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
    WORKDIR/logs/<run>.log everything every step printed
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import signal
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from components.console import status_line
from components.errors import FlowGRPOError
from pipeline.config import ExperimentConfig, dump_config

BUCKET = "flowgrpo"
STORAGE_ROOT = f"s3://{BUCKET}"
DEFAULT_UI_PORT = 5000
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_TASK_START = re.compile(r" - INFO - Executing task '([^']+)'")
_TASK_END = re.compile(r" - (?:INFO|ERROR) - Task '([^']+)' finished with status (\w+)")
_CACHE_HIT = re.compile(r" - INFO - Task (\S+) cache hit")
# Library chatter a person does not need on the terminal (it stays in the log): MLflow's run links and
# download bars, warnings with their source lines.
_NOISE = re.compile(r"^(🏃 View run|🧪 View experiment|Downloading artifacts|warnings\.warn\()|Warning: |"
                   r"core_worker\.cc|Found credentials in|Found endpoint for|\(TrainController |"
                   r"^\d{4}/\d\d/\d\d \d\d:\d\d:\d\d INFO mlflow|^Successfully registered model|^Created version")
_RAY_PREFIX = re.compile(r"^\(RayTrainWorker pid=\d+\) ")
_KFP_LOG = re.compile(r"^\d\d:\d\d:\d\d\.\d+ - ")
_ERROR_LINE = re.compile(r"^(?:[\w.]+\.)?(\w*(?:Error|Exception|Failed|Cancelled|Interrupt)): (.+)$")


class LocalRunError(FlowGRPOError):
    """A local pipeline run whose step failed (the message names the step, the reason and the log)."""


@dataclass
class LocalRunResult:
    run_name: str
    mlflow_run_url: str | None
    report_path: Path | None
    lora_uri: str | None
    registered: str | None
    log_path: Path
    step_seconds: dict[str, float] = field(default_factory=dict)


class _Progress:
    """Stands in for sys.stdout while kfp.local runs: every line goes to the run's log file; a person sees
    each step start and end (with its duration), what the step itself prints, and why a step failed.
    kfp's own chatter (executor input JSON, output listings, tracebacks) stays in the log."""

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
        if m := _TASK_START.search(line):
            self.task, self.started, self.last_error = m.group(1), time.monotonic(), None
            self._show(f"▶ {self.task}")
            return
        if m := _CACHE_HIT.search(line):
            self.seconds[m.group(1)] = 0.0
            self._show(f"✓ {m.group(1)} (cached: the same inputs as an earlier run)")
            return
        if m := _TASK_END.search(line):
            name, state = m.group(1), m.group(2)
            took = time.monotonic() - self.started
            self.seconds[name] = took
            if state == "SUCCESS":
                self._show(f"✓ {name} ({took:.1f} s)")
            else:
                self.failed.append((name, self.last_error))
                self._show(f"✗ {name} failed after {took:.1f} s: {self.last_error or 'see the log'}")
            self.task = None
            return
        if self.task is None:
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
def local_services(workdir: Path, mlflow_port: int | None = None, log=status_line) -> Iterator[dict[str, str]]:
    """SeaweedFS and an MLflow server over the work directory's state; yields the environment that points a
    client at them. Both are stopped on exit."""
    from pipeline.services.mlflow_server import running_mlflow
    from pipeline.services.seaweed import running_seaweed

    workdir.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    with running_seaweed(workdir / "s3", bucket=BUCKET, credentials=_credentials(workdir)) as s3, \
            running_mlflow(workdir / "mlflow", s3=s3, port=mlflow_port) as mlflow:
        log(f"services: S3 (SeaweedFS) at {s3.endpoint}, MLflow at {mlflow.url} "
            f"({time.monotonic() - began:.0f} s to start)")
        yield {**s3.env(), **mlflow.env()}


@contextlib.contextmanager
def patched_environ(values: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``values`` set, restored on exit."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _children() -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process().children(recursive=True)}


def _stop_descendants(before: set[int], grace_s: float = 10.0) -> None:
    """Stop every process started since ``before`` (this process's children then) that still runs: the
    steps, Ray, their children."""
    import psutil

    children = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    for proc in children:
        with contextlib.suppress(psutil.Error):
            proc.send_signal(signal.SIGTERM)
    _, alive = psutil.wait_procs(children, timeout=grace_s)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    psutil.wait_procs(alive, timeout=5)


@contextlib.contextmanager
def _cache_hits_to(progress: _Progress) -> Iterator[None]:
    """kfp.local logs a cache hit at INFO on the root logger outside its own log handler (so by default it is
    dropped): route those records to the progress display."""
    class Hits(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "cache hit" in (message := record.getMessage()):
                progress.write(f"{time.strftime('%H:%M:%S')}.000 - INFO - {message}\n")

    root, handler = logging.getLogger(), Hits(logging.INFO)
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


def _task_output(job_dir: Path, task: str) -> dict:
    path = job_dir / task / "executor_output.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def _results(job_dir: Path, ui_port: int) -> tuple[str | None, Path | None, str | None, str | None]:
    """(MLflow parent run URL as `flowgrpo ui` serves it, report path, LoRA URI, registered NAME/VERSION)."""
    from components.tracking.pipeline_runs import parent_run_of

    model = _task_output(job_dir, "train").get("artifacts", {}).get("model", {}).get("artifacts", [{}])[0]
    lora = model.get("uri")
    report = next((p for p in (job_dir / "evaluate").glob("report*") if p.is_file()), None) \
        if (job_dir / "evaluate").is_dir() else None
    registered = _task_output(job_dir, "register").get("parameterValues", {}).get("Output") or None
    run = parent_run_of(job_dir.name)
    url = f"http://127.0.0.1:{ui_port}/#/experiments/{run[0]}/runs/{run[1]}" if run else None
    return url, report, lora, registered


def run_local(config: ExperimentConfig, *, workdir: Path, ray_workers: int = 1, ui_port: int = DEFAULT_UI_PORT,
              log=status_line) -> LocalRunResult:
    """Run the pipeline on this machine (see the module docstring); raises LocalRunError naming the failed
    step. Nothing it started outlives it."""
    from kfp import local

    from components.launch import LOCAL_PREFIX
    from components.launch.local import stop_all_local
    from pipeline.kfp_pipeline import build_pipeline

    workdir = workdir.resolve()
    (workdir / "logs").mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="tmp-", dir=workdir))  # kfp.local's ephemeral files land here
    # Ray's unix socket paths (under its temp dir) must stay below 108 bytes: a short folder in the system's.
    ray_tmp = Path(tempfile.mkdtemp(prefix="fgray-"))
    run_name = f"flowgrpo-{time.strftime('%Y%m%d-%H%M%S')}"
    log_path = workdir / "logs" / f"{run_name}.log"
    progress = None
    before = _children()
    try:
        with local_services(workdir, log=log) as service_env, patched_environ({
            **service_env, "TMPDIR": str(scratch), "HF_HUB_OFFLINE": "1",
            "FLOWGRPO_CACHE_DIR": str(workdir / "cache"), "RAY_AUTH_MODE": "disabled",
            "RAY_TMPDIR": str(ray_tmp),
        }):
            tempfile.tempdir = str(scratch)
            local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(workdir / "pipeline-root"),
                       workspace_root=str(scratch / "workspace"), raise_on_error=False, enable_caching=True,
                       cache_root=str(workdir / "kfp-cache"))
            log(f"pipeline: prepare dataset -> deploy reward server -> train -> evaluate -> register "
                f"(log: {log_path})")
            progress = _Progress(log_path, sys.stdout)
            with contextlib.redirect_stdout(progress), warnings.catch_warnings(), _cache_hits_to(progress):
                # kfp.local warns that the images are not used and that k8s settings are ignored: both known.
                warnings.simplefilter("ignore")
                pipeline = build_pipeline(eval_gpus=0, retries=False)
                pipeline(config=dump_config(config), overrides=[], storage_root=STORAGE_ROOT, ray_workers=ray_workers,
                         launcher=f"{LOCAL_PREFIX}{workdir}")
            progress.close()
            job_dir = _newest_job(workdir / "pipeline-root")
            if progress.failed:
                step, reason = next((f for f in progress.failed if f[0] != "exit-handler-1"), progress.failed[0])
                raise LocalRunError(f"step {step!r} failed: {reason or 'no error line'}; its output is in "
                                    f"{log_path}")
            url, report, lora, registered = _results(job_dir, ui_port)
            if report is not None:  # the HTML artifact has no extension; keep a copy a browser opens as a page
                copy = workdir / "reports" / job_dir.name / "report.html"
                copy.parent.mkdir(parents=True, exist_ok=True)
                report = Path(shutil.copyfile(report, copy))
            return LocalRunResult(job_dir.name, url, report, lora, registered, log_path, progress.seconds)
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
    """Serve MLflow (with its images, from the local S3) over the state local runs left, until Ctrl-C."""
    workdir = workdir.resolve()
    if not (workdir / "mlflow" / "mlflow.db").is_file():
        raise LocalRunError(f"{workdir} holds no local run (no mlflow/mlflow.db); run `flowgrpo run --local "
                            f"--workdir {workdir}` first")
    with local_services(workdir, mlflow_port=port, log=log):
        log(f"MLflow UI: http://127.0.0.1:{port} (Ctrl-C stops it)")
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                time.sleep(3600)
