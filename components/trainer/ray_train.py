"""Data-parallel training on Ray Train: N ``TorchTrainer`` workers run the same :class:`Trainer`.

Ray Train starts the workers and their ``torch.distributed`` group (gloo on CPU, NCCL on GPU); each worker
samples and scores its share of the epoch's prompt groups, the rewards are gathered so advantages are
computed over the whole batch, and gradients of the LoRA are averaged before every optimizer step. When a
worker dies, Ray Train restarts the group (``FailureConfig``) and every worker resumes from the newest
complete checkpoint under the run's output. The driver (this process) owns the MLflow run; worker rank 0
logs into it.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from typing import Any

from components.console import status_line
from components.tracking.tracker import NullTracker, open_tracker
from components.trainer.config import TrainingJobConfig
from components.trainer.run_output import RunOutput

MAX_FAILURES_ENV = "FLOWGRPO_RAY_MAX_FAILURES"
DEFAULT_MAX_FAILURES = 3
# Safe to hand to workers through Ray's runtime env, which the dashboard shows; secrets reach workers
# through their own environment (the pod's Secrets in a cluster, the inherited one locally).
_FORWARDED_ENV = ("HF_HUB_OFFLINE", "FLOWGRPO_CACHE_DIR", "MLFLOW_HTTP_REQUEST_MAX_RETRIES",
                  "MLFLOW_HTTP_REQUEST_TIMEOUT", "MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL",
                  "FLOWGRPO_MLFLOW_FLUSH_TIMEOUT_S", "FLOWGRPO_MLFLOW_OPEN_TIMEOUT_S")


def _worker_loop(args: dict[str, Any]) -> None:
    from components.trainer.collective import TorchCollective
    from components.trainer.loop import run_worker

    collective = TorchCollective()
    config = TrainingJobConfig.model_validate(args["config"])
    tracker: NullTracker = NullTracker()
    if collective.is_main and args["run_id"]:
        tracker = open_tracker(config.tracking.experiment, "train", run_id=args["run_id"],
                               system_metrics=config.tracking.system_metrics, owns_run=False, log=status_line)
    try:
        run_worker(config, RunOutput(args["output"]), log=status_line, tracker=tracker, collective=collective)
    finally:
        tracker.close()


def _uses_gpu(config: TrainingJobConfig, cluster_gpus: float) -> bool:
    return config.model.device != "cpu" and cluster_gpus >= 1


def run_on_ray(config: TrainingJobConfig, out: RunOutput, workers: int, tracker: NullTracker,
               log: Callable[[str], None] = status_line) -> None:
    """Train with ``workers`` Ray Train workers into ``out``; joins the Ray cluster at $RAY_ADDRESS (as in a
    RayJob) or starts a local one. Raises when the workers fail more than $FLOWGRPO_RAY_MAX_FAILURES times."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import ray
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS"), log_to_driver=True)
    resources = ray.cluster_resources()
    gpu = _uses_gpu(config, resources.get("GPU", 0))
    per_worker: dict[str, float] = {"CPU": max(1, int(resources.get("CPU", 1) // workers))}
    if gpu:
        per_worker["GPU"] = 1
    log(f"Ray Train: {workers} worker(s), {per_worker} each, {'NCCL' if gpu else 'gloo'}")
    train_fields = TrainingJobConfig.model_fields.keys()
    args = {"config": config.model_dump(mode="json", include=set(train_fields)), "output": out.uri,
            "run_id": tracker.run_id}
    name = "flowgrpo-" + hashlib.sha256(out.uri.encode()).hexdigest()[:12]
    env = {k: os.environ[k] for k in _FORWARDED_ENV if k in os.environ}
    trainer = TorchTrainer(
        _worker_loop, train_loop_config=args,
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=gpu, resources_per_worker=per_worker),
        run_config=RunConfig(
            name=name, storage_path=str(out.local / ".ray"),
            failure_config=FailureConfig(max_failures=int(os.environ.get(MAX_FAILURES_ENV, DEFAULT_MAX_FAILURES))),
            worker_runtime_env={"env_vars": env},
        ),
    )
    trainer.fit()
