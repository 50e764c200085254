"""A training run end to end: its output (config.yaml, run.json, resume or refuse), its MLflow run, the trainer in
this process or on Ray Train workers, and the registration of the final LoRA."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import yaml

from components import storage
from components.console import status_line
from components.dataset.input_images import check_rows
from components.dataset.prepared import PromptRow
from components.dataset.prompts import dataset_hash, load_prompt_rows
from components.errors import CheckpointError
from components.models.loading import check_model_path
from components.registry.versions import register_lora_version
from components.rewards.registry import check_specs
from components.tracking.params import RUN_OUTPUT_TAG, flatten_params, lineage_tags, redact
from components.tracking.tracker import NullTracker, open_tracker, resolve_parent_run
from components.trainer import checkpoint as ckpt
from components.trainer.config import TrainingJobConfig
from components.trainer.loop import TrainResult, check_world_size, run_worker, showcase_rows
from components.trainer.metrics import MetricsFile
from components.trainer.ray_train import run_on_ray
from components.trainer.run_output import (
    CONFIG_FILE,
    FINAL_LORA_DIR,
    METRICS_FILE,
    STEP_RUN_NAME,
    RunOutput,
    run_name,
    write_run_record,
)


def check_before_writing(config: TrainingJobConfig, workers: int) -> list[PromptRow]:
    """What a run refuses before it writes anything under its output: a worker count that cannot split an epoch,
    a reward this process would score that cannot be built (``check_spec``, as `flowgrpo validate` runs it), a
    ``model.path`` that is no pipeline or cannot be reached, a ``data.path`` that cannot be read, an input image
    of the training or showcase rows that the trainer would refuse. Returns the prompts."""
    if workers:
        check_world_size(config, workers)
    if config.reward_server.url is None:
        check_specs(config.rewards, "rewards")
    check_model_path(config.model)
    rows = load_prompt_rows(config.data)
    check_rows(rows + showcase_rows(config), config.model.resolution)
    return rows


def _check_output(out: RunOutput, resume: bool | str) -> tuple[str, ckpt.TrainerState] | None:
    """Check ``out`` against ``resume`` ("auto": whatever is there), reading only: it must be new, empty or a run's
    output (``RunOutput.check_ours``), and hold a complete checkpoint exactly when the run continues. Returns the
    (URI, state) of the checkpoint it continues from, or None for a run that starts."""
    out.check_ours()
    latest = ckpt.latest_checkpoint(out.uri)
    if resume == "auto":
        resume = latest is not None
    if resume and latest is None:
        raise CheckpointError(f"--resume: no complete checkpoint under {ckpt.checkpoint_root(out.uri)}")
    if not resume and latest is not None:
        raise CheckpointError(
            f"{out.uri} already holds checkpoints; pass --resume to continue that run or choose another --output"
        )
    return (latest, ckpt.read_checkpoint(latest)) if resume else None


def _open_output(out: RunOutput, record: dict, lineage: dict[str, str], starts: bool) -> None:
    """Write run.json (a run that ``starts``) and config.yaml into the checked output."""
    out.prepare(fresh=starts)
    if starts:  # the first write: it marks the output as a run's; a wrong bucket or credentials stop the run here
        write_run_record(out, lineage)
    (out.local / CONFIG_FILE).write_text(yaml.safe_dump(record, sort_keys=False))
    out.publish(CONFIG_FILE)


def _register(tracker: NullTracker, config: TrainingJobConfig, out: RunOutput, lineage: dict[str, str],
              log: Callable[[str], None]) -> None:
    """Register the final LoRA in the Model Registry (queued on the tracker; no-op without tracking)."""
    name = config.tracking.registered_model
    if name:
        tags = {**lineage, "flowgrpo.lora_uri": out.uri_of(FINAL_LORA_DIR)}
        model = config.model.model_dump(mode="json")
        tracker.call(f"register model {name}", lambda run_id: register_lora_version(
            run_id, name, out.local / FINAL_LORA_DIR, model, config.seed, tags, log=log))


def train(config: TrainingJobConfig, output: str | Path, *, resume: bool | str = False,
          log: Callable[[str], None] = status_line, parent_run_id: str | None = None, workers: int = 0,
          record: dict | None = None) -> TrainResult:
    """Train to ``config.train.epochs`` into ``output`` (a directory or ``s3://`` prefix). With ``resume``
    continue from the newest complete checkpoint there; ``"auto"`` continues if there is one (a retried job).
    ``workers`` > 0 trains on that many Ray Train workers instead of in this process. Tracks to MLflow when
    MLFLOW_TRACKING_URI is set. ``record``: the whole experiment the config is part of, kept with the run
    (config.yaml, MLflow params); default the config itself."""
    rows = check_before_writing(config, workers)  # loaded once: for the lineage and for the trainer in this process
    dumped = config.model_dump(mode="json") if record is None else record
    out = RunOutput(output)
    start = _check_output(out, resume)
    lineage = lineage_tags(dumped, [r.prompt for r in rows], dataset_hash(config.data))
    _open_output(out, dumped, lineage, starts=start is None)
    t = config.tracking
    parent = resolve_parent_run(parent_run_id)
    tracker = open_tracker(t.experiment, STEP_RUN_NAME if parent else run_name(out.uri),
                           run_id=start[1].mlflow_run_id if start else None,
                           parent_run_id=parent, system_metrics=t.system_metrics and not workers, log=log)
    status = "FAILED"
    try:
        tracker.set_tags({**lineage, RUN_OUTPUT_TAG: redact(out.uri)})
        if start is None:
            tracker.log_params(flatten_params(dumped))
        if workers:
            run_on_ray(config, out, workers, tracker, log)
            result = _collect(out, tracker)
        else:
            result = run_worker(config, out, log=log, tracker=tracker, start=start, rows=rows)
        _register(tracker, config, out, lineage, log)
        status = "FINISHED"
        return result
    except KeyboardInterrupt:
        status = "KILLED"
        raise
    finally:
        tracker.close(status)


def _collect(out: RunOutput, tracker: NullTracker) -> TrainResult:
    """The result of a run the workers wrote: its metrics and final LoRA, copied here from ``out``."""
    out.fetch(METRICS_FILE)
    if out.remote:
        storage.download_dir(out.uri_of(FINAL_LORA_DIR), out.local / FINAL_LORA_DIR)
    return TrainResult(out, MetricsFile(out.local / METRICS_FILE).read(), out.local / FINAL_LORA_DIR, tracker.url)
