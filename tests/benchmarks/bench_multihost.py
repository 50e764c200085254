"""The scaling model (scaling_model.py, docs/SCALING.md) against runs across hosts, measured side by side in one run.

Three hosts in network namespaces (tests/netns_hosts.py: the Ray head and two worker pods of one CPU each, started
from the run's RayJob, SeaweedFS and MLflow on the bridge) run the tiny model's epoch on 1 worker, then on 2 workers
(one per host, the same samples per optimizer step: 1 x 2 accumulated micro-batches = 2 workers x 1), and twice on 1
worker at the same time, one run on each host: a worker's epoch under the load of the 2-worker run (both cores busy
beside Ray's own processes) but without its collectives. The link between the hosts is measured (TCP bandwidth and
round trip between two hosts), then the model predicts the 2-worker epoch from that 1-worker epoch's measured
sampling, scoring and training times, the LoRA's gradient bytes, the optimizer steps and the link, and the
prediction is printed beside the measurement (and the one from the 1-worker epoch alone). Steady-state epochs:
the median of every epoch but the first two. Needs root (network namespaces).

    python tests/benchmarks/bench_multihost.py [--epochs N] [--prompts P]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the hosts fixture

from netns_hosts import netns_cluster
from safetensors.torch import load_file
from scaling_model import predict_epoch_s, split_epoch

from components import storage
from components.launch.kubernetes.rayjob_manifest import build_rayjob
from components.trainer import checkpoint as ckpt
from pipeline.config import TINY_CONFIG, load_config
from pipeline.services.seaweed import running_seaweed

NAME, SUBNET = "fgbm", "10.231.43"
EPOCH_KEYS = ("time/sampling", "time/scoring", "time/training")
CLUSTER = ["cluster.workers.replicas=2", "cluster.workers.cpu=1", "cluster.workers.memory=2Gi",
           "cluster.workers.shm_size=256Mi", "cluster.head.cpu=1", "cluster.head.memory=2Gi",
           "cluster.head.shm_size=256Mi"]
# one host sends SIZE bytes to another, then they exchange one byte ROUNDS times
LINK_SERVER = """
import socket, sys
s = socket.create_server(("0.0.0.0", 5599)); c, _ = s.accept()
left = int(sys.argv[1])
while left > 0: left -= len(c.recv(1 << 20))
c.sendall(b"k")
for _ in range(int(sys.argv[2])): c.recv(1); c.sendall(b"p")
"""
LINK_CLIENT = """
import socket, sys, time, json
size, rounds = int(sys.argv[2]), int(sys.argv[3])
for _ in range(100):
    try: c = socket.create_connection((sys.argv[1], 5599)); break
    except OSError: time.sleep(0.1)
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
chunk = b"x" * (1 << 20); t = time.perf_counter()
for _ in range(size >> 20): c.sendall(chunk)
c.recv(1); bandwidth = size / (time.perf_counter() - t)
t = time.perf_counter()
for _ in range(rounds): c.sendall(b"q"); c.recv(1)
print(json.dumps({"bandwidth": bandwidth, "latency": (time.perf_counter() - t) / rounds / 2}))
"""


def measure_link(cluster, size: int = 256 << 20, rounds: int = 2000) -> tuple[float, float]:
    """(bytes/s, one-way latency s) of TCP from worker host 1 to worker host 2."""
    server = cluster.popen(cluster.hosts[2], [sys.executable, "-c", LINK_SERVER, str(size), str(rounds)],
                           {"PATH": os.environ["PATH"]}, cluster.workdir / "link-server.log")
    out = cluster.run_in_pod(1, [sys.executable, "-c", LINK_CLIENT, cluster.hosts[2].address, str(size),
                                 str(rounds)], timeout_s=120)
    server.wait(30)
    link = json.loads(out.stdout)
    return link["bandwidth"], link["latency"]


def launch(cluster, bucket: str, name: str, workers: int, overrides: list[str]):
    """Start the RayJob's entrypoint with ``workers`` training workers; (driver, its output URI, its log)."""
    config = load_config(TINY_CONFIG, [*overrides, *CLUSTER])
    rayjob = build_rayjob(config, run_id=name, output=f"s3://{bucket}/bench/{name}")
    rayjob["spec"]["entrypoint"] = rayjob["spec"]["entrypoint"].replace("--ray-workers 2", f"--ray-workers {workers}")
    log = cluster.workdir / f"{name}.log"
    return cluster.entrypoint(rayjob, log), rayjob["metadata"]["annotations"]["flowgrpo.io/output"], log


def collect(proc, output: str, log: Path) -> tuple[list[dict], int]:
    """Wait for a launched run; (its metrics rows, its LoRA's parameters)."""
    if proc.wait(1800) != 0:
        raise RuntimeError(f"{output} failed; the end of {log}:\n{log.read_text()[-3000:]}")
    local = Path(tempfile.mkdtemp(prefix="bench-"))
    storage.get_file(storage.join(output, "metrics.jsonl"), local / "metrics.jsonl")
    storage.download_dir(storage.join(output, "lora"), local / "lora")
    rows = [json.loads(line) for line in (local / "metrics.jsonl").read_text().splitlines() if line.strip()]
    params = sum(t.numel() for t in load_file(str(local / "lora" / ckpt.LORA_FILE)).values())
    return rows, params


def steady(rows: list[dict], key: str) -> float:
    return statistics.median(row[key] for row in rows[2:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=12)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per epoch (groups of 4 images)")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench_multihost.py makes network namespaces: run it as root")
    common = [f"sampling.prompts_per_epoch={args.prompts}", "sampling.group_size=4",
              "sampling.batch_size_per_worker=4", "train.batch_size_per_worker=4", "sampling.num_steps=10",
              f"train.epochs={args.epochs}", f"train.checkpoint_every={args.epochs}", "tracking.sample_every=0",
              "tracking.system_metrics=false", "tracking.registered_model=null"]
    workdir = Path(tempfile.mkdtemp(prefix="fgbm-", dir="/tmp"))
    os.environ.pop("MLFLOW_TRACKING_URI", None)  # tracking is bench_tracking.py's
    try:
        with netns_cluster(NAME, 3, workdir, SUBNET) as cluster, \
                running_seaweed(workdir / "s3", host=cluster.bridge_address) as s3:
            os.environ.update({**s3.env(), "FLOWGRPO_CACHE_DIR": str(workdir / "cache")})
            config = load_config(TINY_CONFIG, [*common, *CLUSTER])
            cluster.start_ray(build_rayjob(config, run_id="bench", output=f"s3://{s3.bucket}/bench/x"), s3.env())
            bandwidth, latency = measure_link(cluster)
            started = time.perf_counter()
            one_worker = [*common, "train.gradient_accumulation_steps=2"]
            alone, params = collect(*launch(cluster, s3.bucket, "alone", 1, one_worker))
            # two 1-worker runs at once, one on each host: a worker's epoch under the load the 2-worker run puts on
            # the machine (both cores busy beside Ray's own processes), without its collectives
            pair = [launch(cluster, s3.bucket, f"beside-{i}", 1, one_worker) for i in (1, 2)]
            beside = [collect(*run)[0] for run in pair]
            two, _ = collect(*launch(cluster, s3.bucket, "two", 2, common))
            wall = time.perf_counter() - started
            cluster.stop_ray()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    steps = split_epoch(config, 2).optimizer_steps

    def predicted(sampling: float, scoring: float, training: float) -> float:
        return predict_epoch_s(sampling_s=sampling, training_s=training, other_s=scoring, workers=2,
                               grad_bytes=4 * params, optimizer_steps=steps, bandwidth_bytes_per_s=bandwidth,
                               latency_s=latency)

    s, sc, t = (steady(alone, k) for k in EPOCH_KEYS)
    bs, bsc, bt = (statistics.mean(steady(rows, k) for rows in beside) for k in EPOCH_KEYS)
    s2, sc2, t2 = (steady(two, k) for k in EPOCH_KEYS)
    measured_one, measured_beside = s + sc + t, bs + bsc + bt
    measured_two = statistics.median(sum(row[k] for k in EPOCH_KEYS) for row in two[2:])
    from_beside, from_alone = predicted(bs, bsc, bt), predicted(s, sc, t)
    print(f"link between two hosts (veth + bridge): {bandwidth / 1e9:.2f} GB/s, {latency * 1e6:.0f} us one way")
    print(f"LoRA {params} parameters ({4 * params / 1e6:.2f} MB of float32 gradients), {steps} optimizer steps an "
          f"epoch on 2 workers; {args.prompts * 4} images an epoch; {args.epochs} epochs a run ({wall:.0f} s all)")
    print(f"1 worker alone, steady-state epoch: sampling {s:.3f} s + scoring {sc:.3f} s + training {t:.3f} s = "
          f"{measured_one:.3f} s")
    print(f"1 worker beside another on the other host, steady-state epoch: sampling {bs:.3f} s + scoring {bsc:.3f} s "
          f"+ training {bt:.3f} s = {measured_beside:.3f} s")
    print(f"2 workers, steady-state epoch: sampling {s2:.3f} s + scoring {sc2:.3f} s + training {t2:.3f} s "
          f"(half the 1-worker-beside phases: {bs / 2:.3f} s, {bsc / 2:.3f} s, {bt / 2:.3f} s)")
    print(f"2 workers on 2 hosts: predicted {from_beside:.3f} s, measured {measured_two:.3f} s, "
          f"predicted / measured = {from_beside / measured_two:.3f} (from the 1-worker epoch beside another; "
          f"from the 1-worker epoch alone: {from_alone / measured_two:.3f})")
    print(f"speed-up 1 -> 2 hosts: measured {measured_one / measured_two:.2f}x, "
          f"predicted {measured_one / from_alone:.2f}x")


if __name__ == "__main__":
    main()
