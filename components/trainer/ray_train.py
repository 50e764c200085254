"""Data-parallel training on Ray Train: N ``TorchTrainer`` workers run the same :class:`Trainer`.

Ray Train starts the workers and their ``torch.distributed`` group (gloo on CPU, NCCL on GPU); each worker
samples and scores its share of the epoch's prompt groups, the rewards are gathered so advantages are
computed over the whole batch, and gradients of the LoRA are averaged before every optimizer step. When a
worker, its host or its link is lost, Ray Train restarts the group (``distributed.max_restarts`` times) and every
worker resumes from the newest complete checkpoint under the run's output; a group that cannot be placed within
``distributed.start_timeout_s`` stops the run with :class:`WorkersLostError`. The driver (this process) owns the
MLflow run; worker rank 0 logs into it.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import socket
from collections.abc import Callable, Iterator
from typing import Any

from components import environ
from components.console import status_line
from components.errors import FlowGRPOError
from components.tracking.tracker import NullTracker, open_tracker
from components.trainer.checkpoint import latest_checkpoint
from components.trainer.config import TrainingJobConfig
from components.trainer.run_output import RunOutput


class WorkersLostError(FlowGRPOError):
    """The Ray Train workers failed more often than ``distributed.max_restarts`` allows, or could not be placed
    (again) within ``distributed.start_timeout_s``; the checkpoints written so far are kept."""


def _worker_loop(args: dict[str, Any]) -> None:
    environ.apply_settings()  # a Ray Train worker is an entry point of its own
    import ray

    from components.trainer.collective import TorchCollective
    from components.trainer.loop import run_worker

    collective = TorchCollective()
    # where each rank runs, said once per start of the group: after a restart it shows where the workers went
    here = (ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id()[:8])
    placement = collective.all_gather(here)
    if collective.is_main:
        status_line("Ray Train workers: " + ", ".join(f"rank {rank} on {ip} (node {node})"
                                                     for rank, (ip, node) in enumerate(placement)))
    config = TrainingJobConfig.model_validate(args["config"])
    tracker: NullTracker = NullTracker()
    if collective.is_main and args["run_id"]:
        tracker = open_tracker(config.tracking.experiment, "train", run_id=args["run_id"],
                               system_metrics=config.tracking.system_metrics, owns_run=False, log=status_line)
    try:
        run_worker(config, RunOutput(args["output"]), log=status_line, tracker=tracker, collective=collective)
    finally:
        tracker.close()


def worker_cpus(cluster_cpus: float, workers: int, largest_node_cpus: float | None = None) -> float:
    """Each worker's CPU request: whole CPUs split evenly, or a fraction of one when there are more workers than
    CPUs (a whole CPU each would wait for resources the cluster will never have). Ray keeps 4 decimals of a
    fraction: rounded down, so the requests never sum past the cluster. Never more than the largest node holds: a
    worker runs on one node, and fewer workers than pods would otherwise ask for more CPUs than any pod has."""
    if cluster_cpus >= workers:
        share: float = max(1, int(cluster_cpus // workers))
    else:
        share = math.floor(cluster_cpus / workers * 10_000) / 10_000
    return min(share, largest_node_cpus) if largest_node_cpus else share


def _uses_gpu(config: TrainingJobConfig, cluster_gpus: float) -> bool:
    return config.model.device != "cpu" and cluster_gpus >= 1


def run_on_ray(config: TrainingJobConfig, out: RunOutput, workers: int, tracker: NullTracker,
               log: Callable[[str], None] = status_line) -> None:
    """Train with ``workers`` Ray Train workers into ``out``; joins the Ray cluster at $RAY_ADDRESS (as in a
    RayJob) or starts a local one. WorkersLostError when the workers cannot go on (``config.distributed``)."""
    import ray

    with _ray_session(ray, log):
        _fit(ray, config, out, workers, tracker, log)


class LocalRayStartError(FlowGRPOError):
    """The local Ray did not come up in any of ``LOCAL_RAY_STARTS`` tries."""


LOCAL_RAY_STARTS = 3
# Ray waits a fixed 30 s for its raylet to register with the GCS and then gives up with this message; on a machine
# busy with other work that can happen once and not the next time
_RAY_START_TIMEOUT = "timed out during startup"


@contextlib.contextmanager
def _ray_session(ray: Any, log: Callable[[str], None] = print) -> Iterator[None]:
    """Join the Ray at $RAY_ADDRESS (a RayJob's), or start one of our own whose address every process it starts
    knows. ray.init() without an address would join any Ray already running on this machine (another user's),
    or fail with "Found multiple active Ray instances" when there are several; so does Ray Train's own
    placement-group cleaner actor, which looks for "the" Ray unless $RAY_ADDRESS names it. Hence the GCS port is
    chosen here and $RAY_ADDRESS set before the start, for the processes Ray spawns, then restored."""
    if ray.is_initialized() or environ.RAY_ADDRESS.get():
        if not ray.is_initialized():
            ray.init(address=environ.RAY_ADDRESS.value(), log_to_driver=True)
        yield
        return
    for attempt in range(1, LOCAL_RAY_STARTS + 1):
        with socket.socket() as s:  # a free port for the GCS (bound on every interface, as Ray's head binds)
            s.bind(("", 0))
            port = s.getsockname()[1]
        with environ.patched_environ({environ.RAY_GCS_SERVER_PORT.name: str(port),
                                      environ.RAY_ADDRESS.name: f"{ray.util.get_node_ip_address()}:{port}"}):
            try:
                # Ray starts its workers at niceness 15: on a machine with anything else busy (the reward server
                # scoring, a vLLM judge, other jobs) the training workers would get a few percent of a core (seen: a
                # 1-minute run taking 7). Training is this Ray's only work, so its workers run at the driver's
                # priority.
                ray.init(address="local", log_to_driver=True, _system_config={"worker_niceness": os.nice(0)})
            except Exception as exc:  # Ray raises a bare Exception for this
                if _RAY_START_TIMEOUT not in str(exc):
                    raise
                ray.shutdown()
                if attempt == LOCAL_RAY_STARTS:
                    raise LocalRayStartError(
                        f"the local Ray did not start in {LOCAL_RAY_STARTS} tries (each time its raylet did not "
                        f"register within Ray's 30 s: {exc}); the machine is likely too busy (load average "
                        f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs): run again when it is less loaded"
                    ) from None
                log(f"the local Ray did not start (try {attempt} of {LOCAL_RAY_STARTS}: its raylet did not "
                    "register within Ray's 30 s, the machine is busy); starting it again")
                continue
            yield
            return


def _fit(ray: Any, config: TrainingJobConfig, out: RunOutput, workers: int, tracker: NullTracker,
         log: Callable[[str], None]) -> None:
    from ray.train import FailureConfig, RunConfig, ScalingConfig, TrainingFailedError
    from ray.train.torch import TorchConfig, TorchTrainer

    resources = ray.cluster_resources()
    alive = [n for n in ray.nodes() if n["Alive"]]
    nodes = {n["NodeID"] for n in alive}  # a failure names those of them it lost
    largest = max(n["Resources"].get("CPU", 0) for n in alive) if alive else None
    gpu = _uses_gpu(config, resources.get("GPU", 0))
    per_worker: dict[str, float] = {"CPU": worker_cpus(resources.get("CPU", 1), workers, largest)}
    if gpu:
        per_worker["GPU"] = 1
    log(f"Ray Train: {workers} worker(s), {per_worker} each, {'NCCL' if gpu else 'gloo'}")
    train_fields = TrainingJobConfig.model_fields.keys()
    # Ray's workers run in a folder of their own: a relative output would land there (and pyarrow refuses a
    # relative storage_path outright), so they are handed absolute ones.
    local = out.local.absolute()
    args = {"config": config.model_dump(mode="json", include=set(train_fields)),
            "output": out.uri if out.remote else str(local), "run_id": tracker.run_id}
    name = "flowgrpo-" + hashlib.sha256(out.uri.encode()).hexdigest()[:12]
    d = config.distributed
    trainer = TorchTrainer(
        _worker_loop, train_loop_config=args,
        scaling_config=ScalingConfig(num_workers=workers, use_gpu=gpu, resources_per_worker=per_worker),
        # the process group's timeout bounds every collective op, gloo's as NCCL's (its watchdog aborts the op)
        torch_config=TorchConfig(timeout_s=math.ceil(d.collective_timeout_s)),
        run_config=RunConfig(
            name=name, storage_path=str(local / ".ray"),
            # a group that cannot start within start_timeout_s is a controller failure; Ray retries those
            # forever by default, which turns a node that never comes back into a run that never ends
            failure_config=FailureConfig(max_failures=d.max_restarts, controller_failure_limit=0),
            # the dashboard shows a runtime env: secrets reach workers through their own environment (the pod's
            # Secrets in a cluster, the inherited one locally)
            worker_runtime_env={"env_vars": environ.worker_settings()},
        ),
    )
    # Ray Train reads the start timeout in the driver and hands it to its controller
    with environ.patched_environ({environ.RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S.name: str(d.start_timeout_s),
                          environ.RAY_TRAIN_ENABLE_PRINT_PATCH.name: "0"}):
        try:
            trainer.fit()
        except TrainingFailedError as exc:
            raise WorkersLostError(_describe_failure(ray, exc, config, out, workers, per_worker, nodes)) from None


def _describe_failure(ray: Any, exc: Exception, config: TrainingJobConfig, out: RunOutput, workers: int,
                      per_worker: dict[str, float], nodes: set[str]) -> str:
    """Why the run stopped, which of the Ray ``nodes`` it started with are gone, what the cluster lacks, and what
    is kept."""
    from ray.train import ControllerError

    d = config.distributed
    if isinstance(exc, ControllerError):
        why = (f"the {workers} Ray Train worker(s) could not be placed within distributed.start_timeout_s "
               f"({d.start_timeout_s:g} s)")
    else:
        first = next(iter(getattr(exc, "worker_failures", {}).values()), exc)
        why = (f"the Ray Train workers failed more than distributed.max_restarts ({d.max_restarts}) time(s), last "
               f"with {_last_line(first)}")
    lost = [f"{n['NodeManagerAddress']} (node {n['NodeID'][:8]}, {state})" for n in ray.nodes()
            if n["NodeID"] in nodes and (state := _node_state(n)) != "up"]
    free = ray.available_resources()
    need = ", ".join(f"{k} {v:g}" for k, v in per_worker.items())
    have = ", ".join(f"{k} {free.get(k, 0):g}" for k in per_worker)
    newest = latest_checkpoint(out.uri)
    kept = f"the newest checkpoint is {newest}" if newest else "no checkpoint was written yet"
    return (f"{why}; Ray nodes lost: {', '.join(lost) or 'none'}; the workers need {workers} x ({need}), "
            f"the cluster has {have} free; {kept}")


def _node_state(node: dict[str, Any]) -> str:
    """"dead" when Ray says so; "unreachable" when its raylet does not answer a connection now (a partition: Ray
    takes about a minute to declare such a node dead); else "up"."""
    if not node["Alive"]:
        return "dead"
    try:
        socket.create_connection((node["NodeManagerAddress"], node["NodeManagerPort"]), timeout=3).close()
    except OSError:
        return "unreachable"
    return "up"


def _last_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[-1] if lines else ''}"
