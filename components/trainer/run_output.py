"""Where a training run's files go: a local directory, or an ``s3://`` prefix mirrored from local staging.

The trainer always writes into :attr:`RunOutput.local`; for a remote output each finished file is then
uploaded to the same relative name under :attr:`RunOutput.uri`, so the layout is the same in both places:
``config.yaml``, ``run.json``, ``metrics.jsonl``, ``samples/``, ``checkpoints/``, ``lora/``.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import re
import shutil
import time
from pathlib import Path, PurePosixPath

from components import storage
from components.errors import RunOutputError
from components.tracking.replay import FinishedRun
from components.trainer import checkpoint as ckpt

# What a run writes under its output (also read by the pipeline steps, which must not import torch).
FINAL_LORA_DIR = "lora"
METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.yaml"
SAMPLES_DIR = "samples"
# lineage tags and start time, as the run had them: what a later MLflow replay needs beyond the config
RUN_RECORD_FILE = "run.json"
_SAMPLE_NAME = re.compile(r"epoch-(\d+)\.png")
_VIDEO_NAME = re.compile(r"epoch-(\d+)-(\d+)\.gif")  # a video model's animated samples


class RunOutput:
    def __init__(self, uri: str | os.PathLike[str]) -> None:
        self.uri = os.fspath(uri)
        self.remote = storage.is_remote(self.uri)
        if self.remote:
            self.local = storage.cache_root() / "runs" / hashlib.sha256(self.uri.encode()).hexdigest()[:16]
        else:
            self.local = Path(self.uri)
        # Checkpoints are assembled here before they are published under uri/checkpoints.
        self.scratch = self.local / ".staging"

    def __str__(self) -> str:
        return self.uri

    def check_ours(self) -> None:
        """Refuse an output that holds anything but a run's own files (RunOutputError), reading only. A run writes
        run.json into its output first, so an output without one is new, empty, or not a run's: training would
        replace files there (config.yaml, metrics.jsonl) and mix its own into the rest."""
        if self.remote:
            if storage.exists(self.uri_of(RUN_RECORD_FILE)):
                return
            found = [uri.removeprefix(self.uri.rstrip("/") + "/") for uri in storage.list_uris(self.uri, limit=4)]
        elif not self.local.exists():
            return
        elif not self.local.is_dir():
            raise RunOutputError(f"output {self.uri} is a file; a run writes a folder of files: choose a new --output")
        elif (self.local / RUN_RECORD_FILE).is_file():
            return
        else:  # the first few names only: an output may be a large folder (a home directory)
            found = sorted(p.name for p in itertools.islice(self.local.iterdir(), 4))
        if found:
            names = ", ".join(found[:3]) + (", ..." if len(found) > 3 else "")
            raise RunOutputError(f"output {self.uri} already holds files that no flowgrpo run wrote ({names}; no "
                                 f"{RUN_RECORD_FILE}): training would overwrite them; choose a new or empty --output")

    def prepare(self, fresh: bool) -> None:
        """Create the local directory; a fresh remote run starts from an empty staging copy."""
        if fresh and self.remote:
            shutil.rmtree(self.local, ignore_errors=True)
        self.local.mkdir(parents=True, exist_ok=True)

    def uri_of(self, rel: str) -> str:
        return storage.join(self.uri, rel)

    def publish(self, rel: str) -> None:
        """Upload the local file ``rel`` to the output (nothing to do for a local output)."""
        if self.remote:
            storage.put_file(self.local / rel, self.uri_of(rel))

    def publish_dir(self, rel: str) -> None:
        if self.remote:
            storage.upload_dir(self.local / rel, self.uri_of(rel))

    def fetch(self, rel: str) -> bool:
        """Bring the output's copy of ``rel`` into the local directory; whether the file is there now."""
        if self.remote:
            if not storage.exists(self.uri_of(rel)):
                (self.local / rel).unlink(missing_ok=True)
                return False
            storage.get_file(self.uri_of(rel), self.local / rel)
        return (self.local / rel).is_file()


STEP_RUN_NAME = "train"  # a pipeline run's training run: the parent MLflow run carries the pipeline run's name


def run_name(uri: str) -> str:
    """The MLflow run name of a standalone run writing to ``uri``: the output's last path part."""
    return PurePosixPath(str(uri).rstrip("/")).name or STEP_RUN_NAME


def write_run_record(out: RunOutput, lineage: dict[str, str]) -> None:
    (out.local / RUN_RECORD_FILE).write_text(json.dumps(
        {"lineage": lineage, "started_at_ms": int(time.time() * 1000)}, indent=1))
    out.publish(RUN_RECORD_FILE)


def _read_json(path: Path, what: str) -> object:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise RunOutputError(f"{what} is unreadable: {exc}") from exc


def _metrics(out: RunOutput) -> list[dict]:
    if not out.fetch(METRICS_FILE):
        return []
    rows = []
    for n, line in enumerate((out.local / METRICS_FILE).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise RunOutputError(f"{out.uri_of(METRICS_FILE)} line {n} is not JSON: {exc}") from exc
        if not isinstance(row, dict) or not isinstance(row.get("epoch"), int):
            raise RunOutputError(f"{out.uri_of(METRICS_FILE)} line {n} has no integer 'epoch'")
        rows.append(row)
    return rows


def _samples(out: RunOutput) -> list[tuple[int, Path]]:
    from PIL import Image, UnidentifiedImageError

    local = out.local / SAMPLES_DIR
    paths = (storage.download_dir(out.uri_of(SAMPLES_DIR), local) if out.remote
             else sorted(local.glob("*.png")) if local.is_dir() else [])
    found = []
    for path in paths:
        if (m := _SAMPLE_NAME.fullmatch(path.name)) is None:
            continue
        try:
            with Image.open(path) as img:
                img.verify()
        except (OSError, UnidentifiedImageError, SyntaxError, ValueError) as exc:
            raise RunOutputError(f"{out.uri_of(SAMPLES_DIR + '/' + path.name)} is not a readable PNG: {exc}") from exc
        found.append((int(m.group(1)), path))
    return sorted(found)


def _videos(out: RunOutput) -> list[Path]:
    local = out.local / SAMPLES_DIR
    return sorted(p for p in local.glob("*.gif") if _VIDEO_NAME.fullmatch(p.name)) if local.is_dir() else []


def _final_lora(out: RunOutput) -> Path | None:
    local = out.local / FINAL_LORA_DIR
    if out.remote:
        if not storage.list_uris(out.uri_of(FINAL_LORA_DIR)):
            return None
        shutil.rmtree(local, ignore_errors=True)
        storage.download_dir(out.uri_of(FINAL_LORA_DIR), local)
    return local if local.is_dir() and any(local.iterdir()) else None


def read_finished_run(uri: str | os.PathLike[str]) -> FinishedRun:
    """Everything a run left under ``uri`` that MLflow would have held, with local paths to its files (a
    remote output is copied into its staging directory first)."""
    import yaml

    out = RunOutput(uri)
    out.local.mkdir(parents=True, exist_ok=True)
    if not out.fetch(CONFIG_FILE):
        raise RunOutputError(f"{out.uri} is not a run output: it has no {CONFIG_FILE}")
    try:
        config = yaml.safe_load((out.local / CONFIG_FILE).read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise RunOutputError(f"{out.uri_of(CONFIG_FILE)} is unreadable: {exc}") from exc
    if not isinstance(config, dict):
        raise RunOutputError(f"{out.uri_of(CONFIG_FILE)} is not a mapping of config sections")
    record = _read_json(out.local / RUN_RECORD_FILE, out.uri_of(RUN_RECORD_FILE)) if out.fetch(RUN_RECORD_FILE) else {}
    if not isinstance(record, dict):
        raise RunOutputError(f"{out.uri_of(RUN_RECORD_FILE)} is not a JSON object")
    samples = _samples(out)  # first: it downloads a remote run's samples/, videos included
    return FinishedRun(
        uri=out.uri, config=config, metrics=_metrics(out), samples=samples, lora_dir=_final_lora(out),
        lineage={str(k): str(v) for k, v in (record.get("lineage") or {}).items()},
        latest_checkpoint=ckpt.latest_checkpoint(out.uri),
        started_at_ms=record.get("started_at_ms"),
        videos=_videos(out),
    )
