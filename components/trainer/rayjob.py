"""The KubeRay RayJob (ray.io/v1) of a training run, as plain data: no Kubernetes client here.

The experiment config travels inside the RayJob (``runtimeEnvYAML`` -> ``$FLOWGRPO_EXPERIMENT_CONFIG``), so
the manifest alone reproduces the run. Credentials never do: pods read them from Secrets by reference.
"""

from __future__ import annotations

import hashlib
import json
import re
import shlex
from typing import Any, Protocol

import yaml

from components.errors import LaunchError
from components.trainer.rayjob_config import RayJobConfig

API_VERSION = "ray.io/v1"
CONFIG_ENV = "FLOWGRPO_EXPERIMENT_CONFIG"
PARENT_RUN_ENV = "FLOWGRPO_MLFLOW_PARENT_RUN_ID"
NAME_PREFIX = "flowgrpo-"
# KubeRay (v1.7 validation) caps a RayJob name at 53 - 6: it appends "-xxxxx" for the RayCluster, whose
# services append up to "-serve-svc" within the 63 characters of a DNS label. It must be a DNS-1035 label.
MAX_NAME = 47
S3_SECRET_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL_S3", "AWS_REGION")
MLFLOW_SECRET_KEYS = ("MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")
HEAD_PORTS = (("gcs-server", 6379), ("dashboard", 8265), ("client", 10001))
_URL_USERINFO = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^/@\s]+@")


class LaunchableConfig(Protocol):
    """What the launcher needs of an experiment config (pipeline.config.ExperimentConfig)."""

    cluster: RayJobConfig

    def model_dump(self, *, mode: str = ...) -> dict[str, Any]: ...


def rayjob_name(run_id: str) -> str:
    """``flowgrpo-<run id>`` when that is a valid, short enough name; else a slug plus a hash of the run id,
    so distinct run ids never share a RayJob."""
    slug = re.sub(r"[^a-z0-9]+", "-", run_id.lower()).strip("-")
    if not slug:
        raise LaunchError(f"run id {run_id!r} needs at least one letter or digit")
    if slug == run_id and len(NAME_PREFIX) + len(slug) <= MAX_NAME:
        return NAME_PREFIX + slug
    digest = hashlib.sha256(run_id.encode()).hexdigest()[:8]
    room = MAX_NAME - len(NAME_PREFIX) - 1 - len(digest)
    return f"{NAME_PREFIX}{slug[:room].rstrip('-')}-{digest}"


def default_run_id(config: LaunchableConfig, label: str) -> str:
    """``<label>-<config hash>``: the same config gives the same run id, hence the same RayJob."""
    digest = hashlib.sha256(json.dumps(config.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()
    return f"{label}-{digest[:10]}"


def _find_userinfo(data: Any, path: str = "") -> str | None:
    if isinstance(data, dict):
        items = data.items()
    elif isinstance(data, list):
        items = enumerate(data)
    else:
        return path.lstrip(".") if isinstance(data, str) and _URL_USERINFO.search(data) else None
    for key, value in items:
        if (found := _find_userinfo(value, f"{path}.{key}")) is not None:
            return found
    return None


def _secret_env(secret: str | None, keys: tuple[str, ...]) -> list[dict[str, Any]]:
    # optional: a missing key (say AWS_REGION) leaves the variable unset instead of blocking the pod.
    return [{"name": key, "valueFrom": {"secretKeyRef": {"name": secret, "key": key, "optional": True}}}
            for key in keys] if secret else []


def _pod(cluster: RayJobConfig, labels: dict[str, str], *, cpu: str, memory: str, gpus: int,
         head: bool) -> dict[str, Any]:
    limits = {"cpu": cpu, "memory": memory}
    if gpus:
        limits["nvidia.com/gpu"] = str(gpus)
    container: dict[str, Any] = {
        "name": "ray",  # KubeRay treats the first container as the Ray container
        "image": cluster.image,
        "imagePullPolicy": "IfNotPresent",
        "env": [
            {"name": "HF_HUB_OFFLINE", "value": "1"},
            {"name": "FLOWGRPO_IMAGE", "value": cluster.image},  # recorded as an MLflow lineage tag
            *_secret_env(cluster.s3_secret, S3_SECRET_KEYS),
            *_secret_env(cluster.mlflow_secret, MLFLOW_SECRET_KEYS),
        ],
        # requests = limits: training pods should not be the first evicted or throttled under pressure.
        "resources": {"requests": dict(limits), "limits": limits},
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
        # Ray's object store and NCCL use /dev/shm; the container default (64 MiB) is far too small.
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
    }
    if head:
        container["ports"] = [{"name": name, "containerPort": port} for name, port in HEAD_PORTS]
    spec: dict[str, Any] = {
        "containers": [container],
        "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}],
    }
    if not head:
        if cluster.workers.node_selector:
            spec["nodeSelector"] = dict(cluster.workers.node_selector)
        if cluster.workers.tolerations:
            spec["tolerations"] = [t.model_dump(exclude_none=True) for t in cluster.workers.tolerations]
    return {"metadata": {"labels": labels}, "spec": spec}


def build_rayjob(config: LaunchableConfig, *, run_id: str, output: str,
                 parent_run_id: str | None = None) -> dict[str, Any]:
    """The RayJob that runs ``flowgrpo train`` for ``config`` on ``cluster.workers.replicas`` Ray workers."""
    cluster = config.cluster
    if not output.startswith("s3://") or len(output) <= len("s3://"):
        raise LaunchError(f"--output {output!r} must be an s3:// URI: the Ray pods share no filesystem and are "
                          "deleted when the job ends")
    data = config.model_dump(mode="json")
    for where, value in (("--output", output), ("--mlflow-parent-run-id", parent_run_id or "")):
        if _URL_USERINFO.search(value):
            raise LaunchError(f"{where} embeds credentials in a URL; the RayJob is readable by anyone who can "
                              "list it: put them in the Secrets named by cluster.s3_secret / cluster.mlflow_secret")
    if (key := _find_userinfo(data)) is not None:
        raise LaunchError(f"{key} embeds credentials in a URL; the config is stored in the RayJob in plain text: "
                          "put them in the Secrets named by cluster.s3_secret / cluster.mlflow_secret")
    gpus = cluster.workers.gpus_per_worker
    model = data.get("model") or {}
    if model.get("device") == "cuda" and gpus == 0:
        raise LaunchError("model.device is 'cuda' but cluster.workers.gpus_per_worker is 0: request GPUs "
                          "(with a GPU node pool in cluster.workers.node_selector) or set model.device: auto")

    name = rayjob_name(run_id)
    labels = {"app.kubernetes.io/name": "flowgrpo", "app.kubernetes.io/component": "trainer",
              "app.kubernetes.io/instance": name, "app.kubernetes.io/managed-by": "flowgrpo"}
    env_vars = {CONFIG_ENV: _dump(data), "HF_HUB_OFFLINE": "1"}
    if parent_run_id:
        env_vars[PARENT_RUN_ENV] = parent_run_id
    replicas = cluster.workers.replicas
    entrypoint = (f"flowgrpo train --config env:{CONFIG_ENV} --output {shlex.quote(output)} "
                  f"--ray-workers {replicas} --auto-resume")  # a retried job (backoffLimit) continues
    cluster_spec: dict[str, Any] = {
        "rayVersion": cluster.ray_version,
        "headGroupSpec": {
            # num-cpus 0: no training task lands on the head, which is sized only to coordinate.
            "rayStartParams": {"dashboard-host": "0.0.0.0", "num-cpus": "0"},
            "template": _pod(cluster, labels, cpu=cluster.head.cpu, memory=cluster.head.memory, gpus=0, head=True),
        },
        "workerGroupSpecs": [{
            "groupName": "workers",
            "replicas": replicas, "minReplicas": replicas, "maxReplicas": replicas,
            "rayStartParams": {},
            "template": _pod(cluster, labels, cpu=cluster.workers.cpu, memory=cluster.workers.memory, gpus=gpus,
                             head=False),
        }],
    }
    if cluster.ray_token_auth:
        cluster_spec["authOptions"] = {"mode": "token"}
    spec: dict[str, Any] = {
        "entrypoint": entrypoint,
        "runtimeEnvYAML": _dump({"env_vars": env_vars}),
        "submissionMode": cluster.submission_mode,
        "shutdownAfterJobFinishes": cluster.shutdown_after_job_finishes,
        "ttlSecondsAfterFinished": cluster.ttl_seconds_after_finished,
        "backoffLimit": cluster.backoff_limit,
        "rayClusterSpec": cluster_spec,
    }
    if cluster.active_deadline_seconds is not None:
        spec["activeDeadlineSeconds"] = cluster.active_deadline_seconds
    return {
        "apiVersion": API_VERSION,
        "kind": "RayJob",
        "metadata": {"name": name, "namespace": cluster.namespace, "labels": labels,
                     "annotations": {"flowgrpo.io/run-id": run_id, "flowgrpo.io/output": output}},
        "spec": spec,
    }


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the embedded config) as literal blocks, so the manifest stays readable."""

    def ignore_aliases(self, data: Any) -> bool:
        return True  # kubectl users read the manifest; `&id001` anchors for repeated labels only confuse


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def _dump(data: Any) -> str:
    return yaml.dump(data, Dumper=_Dumper, sort_keys=False, allow_unicode=True, width=1 << 16)  # no folded lines


def to_yaml(manifest: dict[str, Any]) -> str:
    """The manifest as YAML for ``kubectl apply -f -``."""
    return _dump(manifest)
