"""Training across hosts: a Ray cluster on three hosts in network namespaces (tests/netns_hosts.py), laid out and
started as the run's RayJob says, with SeaweedFS and MLflow reached over the network; the run is the RayJob's own
entrypoint. One uninterrupted run is the reference every interrupted one must equal bit for bit: a worker host
killed mid-epoch and back, a partition that times the collective out and a host that stays away, the head host
lost and the run submitted again. Each test prints the figures docs/SCALING.md and docs/DISTRIBUTED.md cite.

Needs root (network namespaces) and iproute2 (.ci/run installs it).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import yaml
from mlflow import MlflowClient
from netns_hosts import NetnsCluster, netns_cluster
from process_group import run_in_process_group, train_tiny
from safetensors.torch import load_file

from components import storage
from components.launch.kubernetes.rayjob_manifest import build_rayjob
from components.trainer import checkpoint as ckpt
from components.trainer.training_run import train
from pipeline.config import TINY_CONFIG, load_config
from pipeline.services.mlflow_server import MlflowServer, running_mlflow
from pipeline.services.seaweed import SeaweedS3, running_seaweed

NAME, SUBNET = "fgmh", "10.231.42"  # hosts fgmh-h0 (the head), fgmh-h1 and fgmh-h2 (the worker pods)
EPOCHS = 8
# the run: 2 worker pods of 1 CPU (one training worker each), 16 images an epoch and one optimizer step on all of them
# (2 micro-batches of 4 on each worker), a checkpoint every 2 epochs; collectives time out after 10 s and a group
# waits 20 s for its resources (the defaults are 900 and 600: a test has no minutes to wait)
RUN = ["sampling.prompts_per_epoch=4", "sampling.group_size=4", "sampling.batch_size_per_worker=4",
       "train.batch_size_per_worker=4", "train.gradient_accumulation_steps=2", "sampling.num_steps=10",
       f"train.epochs={EPOCHS}", "train.checkpoint_every=2", "tracking.system_metrics=false",
       "tracking.registered_model=null", "tracking.sample_every=0",
       "distributed.collective_timeout_s=10", "distributed.start_timeout_s=20",
       "cluster.workers.replicas=2", "cluster.workers.cpu=1", "cluster.workers.memory=2Gi",
       "cluster.workers.shm_size=256Mi", "cluster.head.cpu=1", "cluster.head.memory=2Gi",
       "cluster.head.shm_size=256Mi", "cluster.termination_grace_s=30"]
# Ray declares a node that stopped answering dead after failure_threshold health checks in a row missed, each
# timeout_ms then period_ms apart: with Ray's defaults (5 x (10 + 3) s) about a minute (measured 60-66 s), which the
# partition and kill tests would wait out. The hosts' Ray checks every second and gives a check 2 s: ~15 s
HEALTH_CHECKS = {"RAY_health_check_period_ms": "1000", "RAY_health_check_timeout_ms": "2000",
                 "RAY_health_check_failure_threshold": "5"}
NODE_DEATH_S = 5 * (2 + 1) + 5  # the above, and the check already under way when the node stops answering
PLACEMENT = re.compile(r"Ray Train workers: (.*)")
RANK = re.compile(r"rank (\d+) on ([\d.]+) \(node (\w+)\)")


@dataclass
class World:
    cluster: NetnsCluster
    s3: SeaweedS3
    mlflow: MlflowServer
    workdir: Path

    def config(self, run_id: str, *extra: str):
        return load_config(TINY_CONFIG, [*RUN, f"tracking.experiment={run_id}", *extra])

    def rayjob(self, run_id: str, *extra: str) -> dict:
        return build_rayjob(self.config(run_id, *extra), run_id=run_id,
                            output=f"s3://{self.s3.bucket}/runs/{run_id}")

    def output(self, rayjob: dict) -> str:
        return rayjob["metadata"]["annotations"]["flowgrpo.io/output"]


class Log:
    """A driver's output, read as it grows, with the time each line first appeared."""

    def __init__(self, path: Path) -> None:
        self.path, self.lines = path, []  # (monotonic time, line)

    def poll(self) -> list[tuple[float, str]]:
        text = self.path.read_text(errors="replace") if self.path.exists() else ""
        now = time.monotonic()
        complete = text.splitlines()[:-1] if not text.endswith("\n") else text.splitlines()
        self.lines += [(now, line) for line in complete[len(self.lines):]]
        return self.lines

    def wait_for(self, pattern: str, proc: subprocess.Popen, timeout_s: float = 300, after: float = 0.0) -> float:
        """When the first line matching ``pattern`` that appeared after ``after`` appeared."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for at, line in self.poll():
                if at >= after and re.search(pattern, line):
                    return at
            if proc.poll() is not None:
                self.poll()
                for at, line in self.lines:
                    if at >= after and re.search(pattern, line):
                        return at
                raise AssertionError(f"the driver exited ({proc.returncode}) before printing {pattern!r}; "
                                     f"its end:\n{self.text()[-3000:]}")
            time.sleep(0.05)
        raise AssertionError(f"no line matching {pattern!r} within {timeout_s} s; the end:\n{self.text()[-3000:]}")

    def text(self) -> str:
        return self.path.read_text(errors="replace") if self.path.exists() else ""


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    if os.geteuid() != 0:
        raise RuntimeError("the multi-host tests make network namespaces: run them as root")
    workdir = Path(tempfile.mkdtemp(prefix="fgmh-", dir="/tmp"))  # short: Ray's socket paths live under it
    saved = dict(os.environ)
    try:
        with netns_cluster(NAME, 3, workdir, SUBNET, ray_env=HEALTH_CHECKS) as cluster, \
                running_seaweed(workdir / "s3", host=cluster.bridge_address) as s3, \
                running_mlflow(workdir / "mlflow", s3=s3, host=cluster.bridge_address) as mlflow:
            os.environ.update({**s3.env(), **mlflow.env(), "FLOWGRPO_CACHE_DIR": str(workdir / "test-cache")})
            w = World(cluster, s3, mlflow, workdir)
            # the Secrets' keys, as Kubernetes fills the pods' secretKeyRef variables
            cluster.start_ray(w.rayjob("cluster"), {**s3.env(), **mlflow.env()})
            yield w
    finally:
        os.environ.clear()
        os.environ.update(saved)
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(autouse=True)
def whole_cluster(world: World) -> None:
    """Each test starts on three live hosts, whatever the one before it left cut or killed."""
    cluster = world.cluster
    for host in cluster.hosts[1:]:
        cluster.mend(host.index)
    alive = cluster.alive_nodes()
    if cluster.head.address not in alive:
        cluster.stop_ray()
        cluster.start_ray(cluster.rayjob, cluster.secrets)
        return
    lost = [host for host in cluster.hosts[1:]
            if host.address not in alive or not any(p.poll() is None for p in host.procs)]
    for host in lost:
        cluster.kill(host.index)
        cluster.wait_until_gone(host.address, 120)
        cluster.start_node(host)
    if lost:  # else all three were alive in the look above: no second look
        cluster.wait_for_nodes(len(cluster.hosts), 120)


def _launch(world: World, rayjob: dict, name: str) -> tuple[subprocess.Popen, Log]:
    log = Log(world.workdir / f"{name}.log")
    return world.cluster.entrypoint(rayjob, log.path), log


def _finish(proc: subprocess.Popen, log: Log, timeout_s: float = 600) -> None:
    rc = proc.wait(timeout_s)
    assert rc == 0, f"the driver exited {rc}:\n{log.text()[-4000:]}"


def _lora(uri: str) -> dict[str, torch.Tensor]:
    local = Path(tempfile.mkdtemp(prefix="lora-"))
    storage.download_dir(storage.join(uri, "lora"), local)
    return load_file(str(local / ckpt.LORA_FILE))


def _placements(log: Log) -> list[list[tuple[int, str, str]]]:
    """Every "Ray Train workers:" line: [(rank, address, node)] per start of the worker group."""
    return [[(int(r), a, n) for r, a, n in RANK.findall(m.group(1))]
            for _, line in log.poll() if (m := PLACEMENT.search(line))]


def _mlflow_steps(world: World, experiment: str, key: str = "optimizer_step") -> list[int]:
    client = MlflowClient(world.mlflow.url)
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return [m.step for m in client.get_metric_history(run.info.run_id, key)]


def _worker_to_worker(world: World) -> list[tuple[str, str]]:
    """TCP connections held between the Ray Train worker processes of the two worker hosts, seen from both ends."""
    one, two = world.cluster.connections(1), world.cluster.connections(2)
    train = "ray::RayTrainWo"  # ss shows 15 characters of the process name
    return [(a, b) for a, b, who in one if who == train and (b, a, train) in two]


@pytest.fixture(scope="module")
def reference(world: World) -> dict:
    """The uninterrupted run across the two worker hosts, and what was seen during it."""
    rayjob = world.rayjob("reference")
    started = time.monotonic()
    proc, log = _launch(world, rayjob, "reference")
    log.wait_for(r"epoch 2/", proc)
    links = _worker_to_worker(world)
    _finish(proc, log)
    return {"rayjob": rayjob, "log": log, "links": links, "lora": _lora(world.output(rayjob)),
            "wall_s": time.monotonic() - started}


@pytest.mark.slow
def test_one_worker_per_host_over_the_network_equals_one_process(world: World, reference: dict, tmp_path):
    (placement,) = _placements(reference["log"])
    worker_hosts = {h.address for h in world.cluster.hosts[1:]}
    assert {address for _, address, _ in placement} == worker_hosts  # one training worker on each worker host
    assert len({node for _, _, node in placement}) == 2  # two Ray nodes, not one
    # the collective crossed the veth links: the two training workers hold TCP connections to each other (the
    # namespaces have no other path between them)
    assert reference["links"], "no connection between the training workers of the two hosts"
    assert all(a.rsplit(":", 1)[0] in worker_hosts and b.rsplit(":", 1)[0] in worker_hosts
               for a, b in reference["links"])

    # the same two workers on one host (processes joined by gloo over loopback, one thread each, as each pod's one
    # CPU gives): bit for bit the same LoRA, so the network changes nothing
    run_in_process_group(train_tiny, 2, [*RUN, "tracking.experiment=one-host"], str(tmp_path / "one-host"))
    assert _equal(load_file(str(tmp_path / "one-host" / "lora" / ckpt.LORA_FILE)), reference["lora"])

    # the same run in one process, its 4 micro-batches accumulated into the epoch's one optimizer step as the two
    # workers' 2 each are. Equal to float precision in each image, and so in each reward; but the tiny model's
    # images are nearly alike (the reward's std is ~0.3% of its mean), so the advantages, rewards divided by that
    # std, carry those last bits ~1000x into the update: the LoRA after 8 epochs differs in its 4th digit. A run
    # that trained on other samples than one process would (the 2 workers each training on all 16, or on other
    # groups) differs by 5-10% (seen while writing this test)
    single = train(world.config("single", "train.gradient_accumulation_steps=4"), tmp_path / "single",
                   log=lambda _: None)
    a, b = load_file(str(single.lora_dir / ckpt.LORA_FILE)), reference["lora"]
    assert a.keys() == b.keys()
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    scale = max(float(a[k].abs().max()) for k in a)
    print(f"\nacross 2 hosts vs one process, {EPOCHS} epochs: max |LoRA difference| {worst:.3g} "
          f"(largest weight {scale:.3g}); run {reference['wall_s']:.1f} s")
    assert worst < 2e-3 * scale
    # and the metrics the driver's MLflow run holds are the run's, one point per epoch
    assert _mlflow_steps(world, "reference") == list(range(1, EPOCHS + 1))


@pytest.mark.slow
def test_fsdp_across_hosts_equals_the_unsharded_run(world: World, reference: dict):
    rayjob = world.rayjob("fsdp", "train.sharding=fsdp", "train.epochs=2")
    proc, log = _launch(world, rayjob, "fsdp")
    _finish(proc, log)
    assert "FSDP: 2 transformer blocks sharded over 2 worker(s)" in log.text()
    assert {a for _, a, _ in _placements(log)[0]} == {h.address for h in world.cluster.hosts[1:]}
    sharded = _lora(world.output(rayjob))
    plain = load_file(_checkpoint_lora(world.output(reference["rayjob"]), 2))
    assert sharded.keys() == plain.keys()
    assert all(torch.allclose(sharded[k], plain[k], rtol=1e-5, atol=1e-7) for k in plain)


def _checkpoint_lora(output: str, epoch: int) -> str:
    local = Path(tempfile.mkdtemp(prefix="ckpt-")) / ckpt.LORA_FILE
    storage.get_file(storage.join(output, "checkpoints", ckpt.checkpoint_name(epoch), ckpt.LORA_FILE), local)
    return str(local)


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_a_worker_host_killed_mid_epoch_and_back_resumes_and_ends_bit_identical(world: World, reference: dict):
    rayjob = world.rayjob("killed")
    proc, log = _launch(world, rayjob, "killed")
    log.wait_for(r"epoch 3/", proc)
    time.sleep(0.2)  # into epoch 4 (about 0.6 s an epoch here): the checkpoint of epoch 2 is the newest
    assert not re.search(r"epoch 4/", log.text())
    victim = 2
    killed = time.monotonic()
    world.cluster.kill(victim)  # every process of the host: its raylet and the training worker on it
    time.sleep(2)
    world.cluster.start_node(world.cluster.hosts[victim])  # KubeRay recreates the pod
    # from the checkpoint of epoch 2 (or of 4, should the driver's copy of the log lag behind the workers)
    resumed = log.wait_for(r"resumed from .*epoch-0000(02|04)", proc, after=killed)
    training = log.wait_for(r"epoch 3/", proc, after=resumed)
    _finish(proc, log)
    print(f"\nhost killed mid-epoch 4 (back 2 s later): resumed from its checkpoint {resumed - killed:.1f} s after "
          f"the kill, training again (epoch 3 done) {training - killed:.1f} s after it")
    events = [line for _, line in log.poll() if re.search(r"Ray Train workers|FailurePolicy|Error:|resumed from", line)]
    print("\n".join(events))
    placements = _placements(log)
    first, again = placements[0], placements[-1]
    assert {a for _, a, _ in again} == {h.address for h in world.cluster.hosts[1:]}
    lost = next(n for _, a, n in first if a == world.cluster.hosts[victim].address)
    assert lost not in {n for _, _, n in again}  # a new Ray node on the host that came back
    assert _equal(_lora(world.output(rayjob)), reference["lora"])
    # MLflow: every epoch once; the epochs logged before the kill were not logged again
    assert _mlflow_steps(world, "killed") == list(range(1, EPOCHS + 1))


@pytest.mark.slow
def test_a_partition_times_out_the_collective_and_a_host_that_stays_away_stops_the_run(world: World, reference: dict):
    rayjob = world.rayjob("partition")
    config = world.config("partition")
    proc, log = _launch(world, rayjob, "partition")
    log.wait_for(r"epoch 3/", proc)
    victim = 2
    cut = time.monotonic()
    world.cluster.cut(victim)
    timed_out = log.wait_for(r"Timed out waiting 10000ms", proc, after=cut, timeout_s=120)
    gave_up = log.wait_for(r"FailurePolicy\] RAISE", proc, after=cut, timeout_s=300)
    rc = proc.wait(300)
    stopped = time.monotonic()
    error = next(line for _, line in log.poll() if line.startswith("trainer: error:"))
    timeout_s, start_s = config.distributed.collective_timeout_s, config.distributed.start_timeout_s
    print(f"\npartition mid-run: the collective timed out {timed_out - cut:.1f} s after the cut "
          f"(distributed.collective_timeout_s {timeout_s:g}), Ray Train gave up placing the workers at "
          f"{gave_up - cut:.1f} s (+ start_timeout_s {start_s:g}), the run stopped at {stopped - cut:.1f} s\n{error}")
    assert rc == 2
    assert timed_out - cut < timeout_s + 10
    # the restart waits start_timeout_s for the workers' resources only once the old group is gone, and Ray Train
    # lets the group on a cut host go when Ray declares its node dead: NODE_DEATH_S after it stops answering (Ray's
    # health checks, RAY_health_check_* on the head: a minute with Ray's defaults, HEALTH_CHECKS here)
    assert gave_up - cut < max(timeout_s, NODE_DEATH_S) + start_s + 15
    assert stopped - gave_up < 15
    address = world.cluster.hosts[victim].address
    assert re.search(rf"Ray nodes lost: {re.escape(address)} \(node \w+, (unreachable|dead)\);", error), error
    newest = ckpt.latest_checkpoint(world.output(rayjob))
    assert f"the newest checkpoint is {newest};" in error and newest.endswith(("epoch-000002", "epoch-000004"))
    command = re.search(r"run `([^`]+)`", error).group(1)
    assert command == rayjob["spec"]["entrypoint"].replace(" --auto-resume", "") + " --resume"

    # the host comes back (KubeRay restarts the pod whose raylet Ray gave up on) and the printed command resumes
    world.cluster.mend(victim)
    world.cluster.kill(victim)
    world.cluster.wait_until_gone(address, 120)  # Ray forgets the old node (its raylet no longer answers)
    world.cluster.start_node(world.cluster.hosts[victim])
    world.cluster.wait_for_nodes(3, 120)
    resume = dict(rayjob, spec=dict(rayjob["spec"], entrypoint=command))
    proc, log = _launch(world, resume, "partition-resumed")
    _finish(proc, log)
    assert f"resumed from {newest} " in log.text()
    assert _equal(_lora(world.output(rayjob)), reference["lora"])
    assert _mlflow_steps(world, "partition") == list(range(1, EPOCHS + 1))


@pytest.mark.slow
def test_the_head_host_lost_and_the_same_run_submitted_again_resumes_bit_identical(world: World, reference: dict):
    rayjob = world.rayjob("head")
    proc, log = _launch(world, rayjob, "head")
    log.wait_for(r"epoch 5/", proc)
    world.cluster.kill(0)  # the head: GCS, dashboard and the driver
    assert proc.wait(30) != 0
    # a new Ray cluster (a retried RayJob gets one), the same RayJob submitted again
    world.cluster.stop_ray()
    world.cluster.start_ray(world.cluster.rayjob, world.cluster.secrets)
    proc, log = _launch(world, rayjob, "head-again")
    _finish(proc, log)
    assert re.search(r"resumed from .*epoch-00000[24]", log.text())
    assert _equal(_lora(world.output(rayjob)), reference["lora"])
    assert _mlflow_steps(world, "head") == list(range(1, EPOCHS + 1))


def test_the_hosts_run_what_the_rayjob_says(world: World, reference: dict):
    """The settings a multi-node run depends on are read from the RayJob by the fixture itself (netns_hosts.py):
    here, that the running cluster shows them."""
    cluster, rayjob = world.cluster, reference["rayjob"]
    spec = rayjob["spec"]["rayClusterSpec"]
    workers = spec["workerGroupSpecs"][0]
    worker = workers["template"]["spec"]
    container = worker["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    # the collective's interface is the name every host gives its link
    iface = subprocess.run(["ip", "netns", "exec", f"{NAME}-h1", "ip", "-o", "-4", "addr", "show"],
                           capture_output=True, text=True, check=True).stdout
    assert f" {env['GLOO_SOCKET_IFNAME']} " in iface and env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"]
    # one worker pod per host, and the trainer asks for as many training workers
    assert workers["replicas"] == len(cluster.hosts) - 1
    assert rayjob["spec"]["entrypoint"].split("--ray-workers ")[1].startswith(f"{workers['replicas']} ")
    # /dev/shm and Ray's object store: half the volume, as the rayStartParams the hosts were started with
    shm = next(v for v in worker["volumes"] if v["name"] == "dshm")["emptyDir"]["sizeLimit"]
    assert workers["rayStartParams"]["object-store-memory"] == str(256 * 2**20 // 2) and shm == "256Mi"
    # the collective timeout the partition test saw fire is the config's, carried in the RayJob
    carried = yaml.safe_load(yaml.safe_load(rayjob["spec"]["runtimeEnvYAML"])["env_vars"]
                             ["FLOWGRPO_EXPERIMENT_CONFIG"])
    assert carried["distributed"]["collective_timeout_s"] == 10
    # the grace period: the preStop drain the pod runs, run on a worker host in the pod's environment, answers
    # within it (no checkpoint is being written now)
    hook = container["lifecycle"]["preStop"]["exec"]["command"]
    grace = worker["terminationGracePeriodSeconds"]
    assert float(hook[hook.index("--timeout") + 1]) < grace
    started = time.monotonic()
    done = cluster.run_in_pod(1, hook, timeout_s=grace)
    assert done.returncode == 0 and "no checkpoint being written" in done.stderr, done.stderr
    assert time.monotonic() - started < grace
    # restart policy: a retried RayJob (backoffLimit) runs the same entrypoint on a new cluster, and it continues
    # what is there (the head test submits it again so); the cluster goes when the job ends
    assert rayjob["spec"]["entrypoint"].endswith(" --auto-resume")
    assert rayjob["spec"]["shutdownAfterJobFinishes"] is True
    # the run's identity: RayJob name, run id and output are the same on a re-submission (the head test's resume)
    assert build_rayjob(world.config("reference"), run_id="reference",
                        output=world.output(rayjob))["spec"] == rayjob["spec"]
