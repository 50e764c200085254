"""A Ray cluster laid out as a training run's RayJob, on hosts in network namespaces (scripts/hosts.sh).

Each host is a namespace with its own ``eth0`` and address on a bridge; SeaweedFS and MLflow listen on the bridge's
address, as cluster services a pod reaches over the network. The cluster is started from the RayJob manifest the
launcher builds, as KubeRay would start it: the head pod's ``ray start --head`` with the head spec's ports and
``rayStartParams``, each worker pod's ``ray start --address`` with its ``rayStartParams`` and the ``--num-cpus`` /
``--num-gpus`` / ``--memory`` KubeRay derives from the container's limits, every process with the container's
environment (Secret references filled from the test's services, as Kubernetes fills them) and its own ``HOME`` and
Ray temp dir (a pod's ``/tmp`` emptyDir); a test may add Ray settings of its own to the Ray processes (``ray_env``:
e.g. health checks shorter than Ray's minute, which a test has no time to wait out). The run is the RayJob's own
entrypoint, started on the head host with the runtime env's variables and ``RAY_ADDRESS``, as KubeRay's job
submission starts the driver. So what the tests run is what the manifest says, and a change to the manifest changes
the tests.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from components.launch.kubernetes.rayjob_manifest import HEAD_PORTS
from components.launch.kubernetes.types import quantity_value

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "hosts.sh"
VENV_BIN = Path(sys.executable).parent


def hosts_script(*args: str) -> str:
    return subprocess.run(["bash", str(SCRIPT), *args], check=True, capture_output=True, text=True).stdout


def _ipv4(endpoint: str) -> str:
    """``[::ffff:10.0.0.1]:80`` (an IPv4 peer of a dual-stack socket, as gloo's are) as ``10.0.0.1:80``."""
    return re.sub(r"^\[::ffff:([\d.]+)\]", r"\1", endpoint)


def container(pod: dict[str, Any]) -> dict[str, Any]:
    return pod["spec"]["containers"][0]  # KubeRay's Ray container is the first


def pod_env(pod: dict[str, Any], secrets_: dict[str, str]) -> dict[str, str]:
    """The container's environment: literal values, and Secret keys filled from ``secrets_`` (optional keys
    missing there are left unset, as Kubernetes does)."""
    env = {}
    for var in container(pod).get("env", []):
        if "value" in var:
            env[var["name"]] = var["value"]
        elif (ref := var.get("valueFrom", {}).get("secretKeyRef")) and ref["key"] in secrets_:
            env[var["name"]] = secrets_[ref["key"]]
    return env


def ray_start_args(group: dict[str, Any], *, head: bool, head_address: str) -> list[str]:
    """``ray start`` as KubeRay builds it for a pod of ``group``: its rayStartParams, and the CPUs, GPUs and memory
    of the container's limits unless the params set them."""
    params = dict(group.get("rayStartParams", {}))
    limits = container(group["template"])["resources"]["limits"]
    params.setdefault("num-cpus", str(int(quantity_value(limits["cpu"]))))
    params.setdefault("memory", str(int(quantity_value(limits["memory"]))))
    if "nvidia.com/gpu" in limits:
        params.setdefault("num-gpus", limits["nvidia.com/gpu"])
    ports = dict(HEAD_PORTS)
    if head:
        args = ["--head", f"--port={ports['gcs-server']}", f"--dashboard-port={ports['dashboard']}",
                f"--ray-client-server-port={ports['client']}"]
    else:
        args = [f"--address={head_address}:{ports['gcs-server']}"]
    return args + [f"--{k}={v}" for k, v in params.items()]


@dataclass
class Host:
    index: int
    address: str
    home: Path  # the pod's /tmp: HOME, Ray's temp dir, the trainer's staging
    procs: list[subprocess.Popen] = field(default_factory=list)


class NetnsCluster:
    """Hosts ``NAME-h0`` .. ``NAME-h{n-1}``; host 0 is the Ray head."""

    def __init__(self, name: str, n: int, workdir: Path, subnet: str, ray_env: dict[str, str] | None = None) -> None:
        self.name, self.workdir, self.ray_env = name, workdir, ray_env or {}
        self.bridge_address = f"{subnet}.1"
        lines = hosts_script("up", name, str(n), subnet).split()
        self.hosts = [Host(i, lines[2 * i + 1], workdir / f"h{i}") for i in range(n)]
        self.token = secrets.token_hex(16)
        self.rayjob: dict[str, Any] | None = None
        self.secrets: dict[str, str] = {}

    @property
    def head(self) -> Host:
        return self.hosts[0]

    @property
    def ray_address(self) -> str:
        return f"{self.head.address}:{dict(HEAD_PORTS)['gcs-server']}"

    def _base_env(self, host: Host, rayjob: dict[str, Any] | None = None) -> dict[str, str]:
        """``host``'s pod environment, as ``rayjob`` (default: the running cluster's) describes the pod."""
        rayjob = rayjob or self.rayjob
        assert rayjob is not None, "start_ray(rayjob, ...) first"
        spec = rayjob["spec"]["rayClusterSpec"]
        pod = spec["headGroupSpec" if host.index == 0 else "workerGroupSpecs"]
        pod = pod["template"] if host.index == 0 else pod[0]["template"]
        env = {"PATH": f"{VENV_BIN}:{os.environ['PATH']}", "LANG": "C.UTF-8",
               **pod_env(pod, self.secrets), "HOME": str(host.home)}
        if spec.get("authOptions", {}).get("mode") == "token":  # KubeRay puts a generated token in every pod
            env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=self.token)
        return env

    def popen(self, host: Host, args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
        host.home.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            proc = subprocess.Popen(["ip", "netns", "exec", f"{self.name}-h{host.index}", *args], env=env,
                                    cwd=host.home, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        host.procs.append(proc)
        return proc

    def start_ray(self, rayjob: dict[str, Any], secrets_: dict[str, str], timeout_s: float = 180) -> None:
        """The head and every worker host's Ray node, as the RayJob's pods start them; returns when all joined."""
        self.rayjob, self.secrets = rayjob, secrets_
        for host in self.hosts:
            self.start_node(host)
        self.wait_for_nodes(len(self.hosts), timeout_s)

    def start_node(self, host: Host) -> None:
        """``ray start --block`` on ``host`` (again, after a kill: KubeRay recreating the pod)."""
        assert self.rayjob is not None
        spec = self.rayjob["spec"]["rayClusterSpec"]
        group = spec["headGroupSpec"] if host.index == 0 else spec["workerGroupSpecs"][0]
        args = ray_start_args(group, head=host.index == 0, head_address=self.head.address)
        self.popen(host, ["ray", "start", "--block", f"--node-ip-address={host.address}",
                          f"--temp-dir={host.home / 'ray'}", *args],
                   {**self._base_env(host), **self.ray_env}, self.workdir / f"h{host.index}-ray.log")

    def alive_nodes(self) -> list[str]:
        """Addresses of the nodes the head's GCS counts alive."""
        script = ("import ray, json; ray.init(address='auto', logging_level='ERROR', log_to_driver=False); "
                  "print(json.dumps([n['NodeManagerAddress'] for n in ray.nodes() if n['Alive']]))")
        env = {**self._base_env(self.head), "RAY_ADDRESS": self.ray_address}
        out = subprocess.run(["ip", "netns", "exec", f"{self.name}-h0", sys.executable, "-c", script], env=env,
                             capture_output=True, text=True, timeout=60)
        return json.loads(out.stdout.strip().splitlines()[-1]) if out.returncode == 0 and out.stdout else []

    def wait_for_nodes(self, n: int, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while len(alive := self.alive_nodes()) < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(alive)} of {n} Ray nodes joined within {timeout_s:g} s: {alive}; "
                                   f"logs in {self.workdir}")
            time.sleep(1)

    def layout(self, rayjob: dict[str, Any]) -> list:
        """What the hosts take from ``rayjob``: each pod's ``ray start`` arguments and environment (RayJobs of other
        runs on the same cluster differ only in names, labels, entrypoint and runtime env)."""
        spec = rayjob["spec"]["rayClusterSpec"]
        groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
        return [(ray_start_args(g, head=i == 0, head_address=self.head.address), self._base_env(h, rayjob))
                for i, (g, h) in enumerate(zip(groups, self.hosts[:2], strict=True))]

    def wait_until_gone(self, address: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while address in self.alive_nodes():
            if time.monotonic() > deadline:
                raise TimeoutError(f"Ray still counts the node at {address} alive after {timeout_s:g} s")
            time.sleep(1)

    def entrypoint(self, rayjob: dict[str, Any], log: Path) -> subprocess.Popen:
        """``rayjob``'s entrypoint on the head host, with its runtime env's variables and RAY_ADDRESS, as KubeRay's
        job submission runs the driver. The RayJob must describe the cluster that is running."""
        assert self.rayjob is not None, "start_ray(rayjob, ...) first"
        if self.layout(rayjob) != self.layout(self.rayjob):
            raise ValueError("this RayJob describes another cluster than the one running: start_ray(it) instead")
        runtime = yaml.safe_load(rayjob["spec"]["runtimeEnvYAML"])["env_vars"]
        env = {**self._base_env(self.head), **runtime, "RAY_ADDRESS": self.ray_address}
        return self.popen(self.head, ["bash", "-c", rayjob["spec"]["entrypoint"]], env, log)

    def run_in_pod(self, index: int, command: list[str], timeout_s: float) -> subprocess.CompletedProcess:
        """``command`` on host ``index`` in its pod's environment (what a Kubernetes exec hook gets)."""
        host = self.hosts[index]
        return subprocess.run(["ip", "netns", "exec", f"{self.name}-h{index}", *command], env=self._base_env(host),
                              cwd=host.home, capture_output=True, text=True, timeout=timeout_s)

    def connections(self, index: int) -> list[tuple[str, str, str]]:
        """Host ``index``'s established TCP connections: (local address:port, peer address:port, process)."""
        out = subprocess.run(["ip", "netns", "exec", f"{self.name}-h{index}", "ss", "-tnpH", "state", "established"],
                             check=True, capture_output=True, text=True).stdout
        found = []
        for line in out.splitlines():
            parts = line.split()
            users = re.search(r'users:\(\("([^"]+)"', line)
            found.append((_ipv4(parts[2]), _ipv4(parts[3]), users.group(1) if users else ""))
        return found

    def kill(self, index: int) -> None:
        """kill -9 every process of host ``index`` (its pod is gone)."""
        hosts_script("kill", self.name, str(index))
        for proc in self.hosts[index].procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
        self.hosts[index].procs.clear()

    def cut(self, index: int) -> None:
        hosts_script("cut", self.name, str(index))

    def mend(self, index: int) -> None:
        hosts_script("mend", self.name, str(index))

    def stop_ray(self) -> None:
        for host in reversed(self.hosts):
            self.kill(host.index)

    def down(self) -> None:
        hosts_script("down", self.name)


@contextlib.contextmanager
def netns_cluster(name: str, n: int, workdir: Path, subnet: str,
                  ray_env: dict[str, str] | None = None) -> Iterator[NetnsCluster]:
    """``n`` hosts (scripts/hosts.sh up), deleted with every process on them at the end."""
    cluster = NetnsCluster(name, n, workdir, subnet, ray_env)
    try:
        yield cluster
    finally:
        cluster.down()
