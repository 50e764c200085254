"""The pipeline's steps as plain functions.

Each KFP component in ``pipeline/kfp_pipeline.py`` is a thin wrapper over one of these, so they run (and are
tested) without KFP. The steps that start something are handed a launcher (``components.launch.interface``): on this
machine (reward server as a process, training on a local Ray; ``flowgrpo run --local``) or in a cluster
(reward server as a Deployment, training as a KubeRay RayJob).
"""

from __future__ import annotations

import hashlib
import json
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from components import environ, storage
from components.console import status_line
from components.errors import DataError
from components.launch.interface import Launcher
from pipeline.config import ExperimentConfig, config_from_parameter

Log = Callable[[str], None]


def step_config(config: str, overrides: list[str]) -> ExperimentConfig:
    """What every pipeline step starts with: the environment's settings checked (a value out of range stops the step
    before it reads or writes anything), then the experiment config from the pipeline's parameters."""
    environ.check_settings()
    return config_from_parameter(config, overrides)


def run_output(storage_root: str, run_id: str) -> str:
    """Where a pipeline run's training writes (checkpoints, metrics, samples, the LoRA, the evaluation)."""
    return storage.join(storage_root, "runs", run_id)


def _validated(config: ExperimentConfig, **changes: dict) -> ExperimentConfig:
    """``config`` with some sections replaced, validated again (model_copy would skip the validators)."""
    data = config.model_dump(mode="json")
    for section, values in changes.items():
        data[section] = {**data[section], **values}
    return ExperimentConfig.model_validate(data)


# -- prepare_dataset ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PreparedRef:
    uri: str
    manifest: dict
    reused: bool


def _source_bytes(config: ExperimentConfig, scratch: Path) -> tuple[str, bytes]:
    """The source prepare_dataset reads, and its bytes (they key the cache): ``dataset.source`` as given; else
    ``data.path`` itself when its rows carry input images (their paths are relative to its folder); else the
    prompts of ``data:`` written as JSONL."""
    from components.dataset.prepare import BUILTIN_PREFIX, builtin_source
    from components.dataset.prompts import load_prompt_rows

    source = config.dataset.source
    if source is None:
        rows = load_prompt_rows(config.data)  # refused as `train` refuses them, with the line
        if not any(r.images for r in rows):
            text = "".join(json.dumps({"prompt": r.prompt, **r.metadata}, ensure_ascii=False) + "\n" for r in rows)
            path = scratch / "prompts.jsonl"
            path.write_text(text, encoding="utf-8")
            return str(path), text.encode()
        source = config.data.path
    if source.startswith(BUILTIN_PREFIX):
        return source, builtin_source(source[len(BUILTIN_PREFIX):]).read_bytes()
    if storage.is_remote(source):
        return source, storage.get_bytes(source)
    if not Path(source).is_file():
        raise DataError(f"dataset.source: {source} does not exist or is not a file")
    return source, Path(source).read_bytes()


def prepare(config: ExperimentConfig, storage_root: str, log: Log = status_line) -> PreparedRef:
    """Validate and split the run's prompts into ``STORAGE_ROOT/datasets/<key>``, where the key hashes the
    source's content and the preparation options: the same inputs are prepared once and then reused (also
    without KFP's cache). A ``data.path`` that is already a prepared dataset is used as it is."""
    from components.dataset.prepare import prepare_dataset
    from components.dataset.prepared import read_manifest
    from components.dataset.prompts import is_prepared

    opts = config.dataset
    if opts.source is None and config.data.path is not None and is_prepared(config.data.path):
        log(f"dataset: {config.data.path} is already prepared; using it as it is")
        return PreparedRef(config.data.path, read_manifest(config.data.path), True)
    with tempfile.TemporaryDirectory(prefix="flowgrpo-dataset-") as tmp:
        source, content = _source_bytes(config, Path(tmp))
        options = {"kind": opts.kind, "test_fraction": opts.test_fraction, "seed": opts.seed,
                   "max_prompt_tokens": opts.max_prompt_tokens, "resolution": config.model.resolution,
                   "allow_external": config.data.allow_external_images}
        key = hashlib.sha256(hashlib.sha256(content).digest() + json.dumps(options, sort_keys=True).encode())
        uri = storage.join(storage_root, "datasets", key.hexdigest()[:16])
        if storage.exists(storage.join(uri, "manifest.json")):
            log(f"dataset: reusing {uri} (same prompts and options as an earlier run)")
            return PreparedRef(uri, read_manifest(uri), True)
        result = prepare_dataset(source, uri, kind=opts.kind, test_fraction=opts.test_fraction, seed=opts.seed,
                                 max_prompt_tokens=opts.max_prompt_tokens, resolution=config.model.resolution,
                                 allow_external=config.data.allow_external_images, progress=log)
    rows = result.manifest["rows"]
    log(f"dataset: {uri}: {rows['train']} train / {rows['test']} test rows, {rows['rejected']} rejected")
    return PreparedRef(uri, result.manifest, False)


# -- reward server -----------------------------------------------------------------------------------------


def deploy_reward_server(config: ExperimentConfig, run_id: str, launcher: Launcher, log: Log = status_line) -> str:
    """Start the run's reward server with ``launcher``; its URL."""
    return launcher.start_reward_server(config, run_id, log)


def teardown_reward_server(config: ExperimentConfig, run_id: str, launcher: Launcher, log: Log = status_line) -> None:
    """Stop what deploy_reward_server started for ``run_id``; fine when nothing (or part of it) is there."""
    launcher.stop_reward_server(config, run_id, log)


# -- train -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrainedRef:
    output: str
    lora_uri: str
    mlflow_run_id: str | None
    last_metrics: dict


def training_config(config: ExperimentConfig, dataset_uri: str, reward_url: str | None) -> ExperimentConfig:
    """What the training step runs: the prepared train split, scored by the run's reward server; the
    register step, not the trainer, registers the LoRA (after the evaluation)."""
    return _validated(config, data={"prompts": None, "path": dataset_uri, "split": "train"},
                      reward_server={"url": reward_url}, tracking={"registered_model": None})


def train(config: ExperimentConfig, output: str, *, run_id: str, parent_run_id: str | None, ray_workers: int,
          launcher: Launcher, log: Log = status_line) -> TrainedRef:
    """Train into ``output`` with ``launcher``; a retried step continues from the newest checkpoint there. Locally
    on ``ray_workers`` local Ray Train workers (0: in this process); in a cluster as a RayJob, followed to its
    end."""
    from components.tracking.pipeline_runs import child_run
    from components.trainer.metrics import describe_learning, learning_summary
    from components.trainer.run_output import FINAL_LORA_DIR, METRICS_FILE, STEP_RUN_NAME

    launcher.train(config, output, run_id=run_id, parent_run_id=parent_run_id, workers=ray_workers, log=log)
    history = read_history(storage.join(output, METRICS_FILE))
    if history:
        log(describe_learning(learning_summary(history)))
    last = history[-1] if history else {}
    mlflow_run = child_run(parent_run_id, STEP_RUN_NAME) if parent_run_id else None
    return TrainedRef(output, storage.join(output, FINAL_LORA_DIR), mlflow_run, last)


# -- evaluate ----------------------------------------------------------------------------------------------


def read_history(uri: str) -> list[dict]:
    """The rows of a run's metrics.jsonl (a path or an s3:// URI)."""
    return [json.loads(line) for line in storage.get_bytes(uri).decode().splitlines() if line.strip()]


def training_history(lora: str, metrics: str | None = None) -> list[dict]:
    """The run's metrics.jsonl: ``metrics``, else the one beside a run's lora/ folder when it is there."""
    from components.trainer.run_output import FINAL_LORA_DIR, METRICS_FILE

    if metrics is None:
        run, _, last = lora.rstrip("/").rpartition("/")
        if last != FINAL_LORA_DIR or not run:
            return []
        metrics = storage.join(run, METRICS_FILE)
        if not storage.exists(metrics):
            return []
    return read_history(metrics)


def evaluate(config: ExperimentConfig, lora: str, output: Path, *, history: list[dict],
             parent_run_id: str | None, registered_model: tuple[str, str] | None = None,
             log: Log = status_line, say: Log = status_line):
    """Evaluate ``lora`` against the base model into ``output`` (eval.json, report.html), as an MLflow run
    (a child of ``parent_run_id``, which shows the results too) when tracking is on; apply the gate to
    ``registered_model`` (name, version) when given. Progress goes to ``log``, the results (per-reward deltas,
    warnings, verdict) to ``say``. Returns the EvalResult."""
    from components.evaluate.evaluate import evaluate as run_evaluation
    from components.registry.versions import apply_gate
    from components.tracking.pipeline_runs import GATE_REASON_TAG, GATE_TAG, show_evaluation
    from components.tracking.tracker import open_tracker

    tracker = open_tracker(config.tracking.experiment, "evaluate", parent_run_id=parent_run_id,
                           system_metrics=False, log=log)
    status = "FAILED"
    try:
        result = run_evaluation(config, config.evaluation_rewards(), config.eval, lora, output, history=history,
                                log=log)
        for key, row in result.summary["rewards"].items():
            tracker.log_metrics({f"eval/{key}/{k}": v for k, v in row.items()}, step=0)
            say(f"{key}: base {row['base_mean']:.4g} -> LoRA {row['lora_mean']:.4g} (delta {row['delta']:+.4g}, "
                f"{row['ci_level']:.0%} CI [{row['ci_low']:+.4g}, {row['ci_high']:+.4g}], n {row['n']})")
        gate = result.summary["gate"]
        verdict = {GATE_TAG: "promoted" if gate["promoted"] else "refused", GATE_REASON_TAG: gate["reason"]}
        tracker.set_tags(verdict)
        if parent_run_id is not None:  # the run a person opens first: the pipeline's
            show_evaluation(parent_run_id, result.summary["rewards"], verdict, log=log)
        for path in (result.eval_path, result.report_path):
            tracker.log_artifact(path)
        for warning in result.summary["warnings"]:
            say(f"warning: {warning}")
        say(f"gate: {'PROMOTE' if gate['promoted'] else 'REFUSE'}: {gate['reason']}")
        if registered_model is not None:
            apply_gate(*registered_model, gate["promoted"], gate["reason"], gate["alias"], log=log)
        status = "FINISHED"
        return result
    finally:
        tracker.close(status)


def evaluation_config(config: ExperimentConfig, dataset_uri: str) -> ExperimentConfig:
    """Evaluation reads the prepared dataset (its held-out test split) in-process, not via the reward server."""
    return _validated(config, data={"prompts": None, "path": dataset_uri, "split": "train"},
                      reward_server={"url": None})


# -- register ----------------------------------------------------------------------------------------------


def register(config: ExperimentConfig, lora_uri: str, train_run_id: str | None, *, promoted: bool, reason: str,
             log: Log = status_line) -> str | None:
    """Register the LoRA as a new version of ``tracking.registered_model`` (logged into the training run, with
    its lineage tags), apply the gate's verdict to it and link it from the pipeline run; "NAME/VERSION", or None
    when there is no registry (tracking off, no model name, no training run)."""
    from components.registry.versions import apply_gate, register_lora_version
    from components.tracking.pipeline_runs import lineage_of, show_model_version
    from components.tracking.server import tracking_uri

    name = config.tracking.registered_model
    if tracking_uri() is None or not name or train_run_id is None:
        why = ("MLFLOW_TRACKING_URI is not set" if tracking_uri() is None else
               "tracking.registered_model is null" if not name else "the training run has no MLflow run")
        log(f"register: skipped ({why}); the LoRA stays at {lora_uri}")
        return None
    with tempfile.TemporaryDirectory(prefix="flowgrpo-register-") as tmp:
        source = Path(lora_uri)
        if storage.is_remote(lora_uri):
            source = Path(tmp) / "lora"
            storage.download_dir(lora_uri, source)
        tags = {**lineage_of(train_run_id), "flowgrpo.lora_uri": lora_uri}
        version = register_lora_version(train_run_id, name, source, config.model.model_dump(mode="json"),
                                        config.seed, tags, log=log)
    apply_gate(name, version, promoted, reason, config.eval.gate.alias, log=log)
    show_model_version(train_run_id, name, version, log=log)
    return f"{name}/{version}"
