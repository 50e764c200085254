"""The KubeRay RayJob (ray.io/v1) of a training run, as plain data: no Kubernetes client here.

The experiment config travels inside the RayJob (``runtimeEnvYAML`` -> ``$FLOWGRPO_EXPERIMENT_CONFIG``), so
the manifest alone reproduces the run. Credentials never do: pods read them from Secrets by reference.
"""

from __future__ import annotations

import hashlib
import json
import shlex
from typing import Any, Protocol

import yaml

from components import environ, storage
from components.config_base import URL_USERINFO, url_credentials_at
from components.errors import LaunchError
from components.launch.kubernetes import podspec
from components.launch.kubernetes.cluster_config import RayJobConfig
from components.launch.kubernetes.types import object_store_bytes
from components.storage import StorageError

API_VERSION = "ray.io/v1"
NAME_PREFIX = "flowgrpo-"
# KubeRay (v1.7 validation) caps a RayJob name at 53 - 6: it appends "-xxxxx" for the RayCluster, whose
# services append up to "-serve-svc" within the 63 characters of a DNS label. It must be a DNS-1035 label.
MAX_NAME = 47
HEAD_PORTS = (("gcs-server", 6379), ("dashboard", 8265), ("client", 10001))
# seconds of a worker pod's grace period left after its preStop drain, for Ray to stop on SIGTERM
DRAIN_MARGIN_S = 10
# The pod of KubeRay's submitter Job (K8sJobMode) carries no label of ours: KubeRay v1.7.0 labels it with the RayJob
# it runs for (rayjob_controller.go, getSubmitterTemplate).
SUBMITTER_CRD_LABEL, SUBMITTER_NAME_LABEL = "ray.io/originated-from-crd", "ray.io/originated-from-cr-name"
# The KubeRay operator's pods, in whatever namespace (its Helm chart and its kustomize manifests both set this).
OPERATOR_LABELS = {"app.kubernetes.io/component": "kuberay-operator"}


class LaunchableConfig(Protocol):
    """What the launcher needs of an experiment config (pipeline.config.ExperimentConfig): the cluster, the whole
    config (its run id follows it) and what of it the run is handed."""

    cluster: RayJobConfig

    def model_dump(self, *, mode: str = ...) -> dict[str, Any]: ...

    def run_data(self) -> dict[str, Any]: ...


def rayjob_name(run_id: str) -> str:
    """``flowgrpo-<run id>`` when that is a valid, short enough name; else a slug plus a hash of the run id."""
    return podspec.run_name(NAME_PREFIX, run_id, MAX_NAME)


def default_run_id(config: LaunchableConfig, label: str) -> str:
    """``<label>-<config hash>``: the same config gives the same run id, hence the same RayJob."""
    digest = hashlib.sha256(json.dumps(config.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()
    return f"{label}-{digest[:10]}"


def _pod(cluster: RayJobConfig, labels: dict[str, str], *, cpu: str, memory: str, gpus: int, shm_size: str,
         head: bool) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": "ray",  # KubeRay treats the first container as the Ray container
        "image": cluster.image,
        "imagePullPolicy": "IfNotPresent",
        "env": [
            *({"name": name, "value": value} for name, value in environ.entry_settings().items()),
            {"name": environ.FLOWGRPO_IMAGE.name, "value": cluster.image},  # recorded as an MLflow lineage tag
            # The root filesystem is read-only: every cache kept under $HOME (the base model copied from s3://,
            # checkpoints being staged, torch, Triton, Hugging Face) goes to the /tmp emptyDir.
            {"name": "HOME", "value": "/tmp"},
            # gloo and NCCL bind the interface the pod's hostname resolves to, or loopback when they cannot tell:
            # named, the collective crosses the network the Ray nodes share
            {"name": "GLOO_SOCKET_IFNAME", "value": cluster.network_interface},
            {"name": "NCCL_SOCKET_IFNAME", "value": cluster.network_interface},
            *podspec.secret_env(cluster.s3_secret, podspec.S3_SECRET_KEYS),
            *podspec.secret_env(cluster.mlflow_secret, podspec.MLFLOW_SECRET_KEYS),
        ],
        "resources": podspec.resources(cpu, memory, gpus),
        "securityContext": podspec.container_security(),
        # /tmp: Ray's session directory (/tmp/ray: logs, sockets, spilled objects) and $HOME. Ray's object store and
        # NCCL use /dev/shm; the container default (64 MiB) is far too small.
        "volumeMounts": [{"name": "tmp", "mountPath": "/tmp"}, {"name": "dshm", "mountPath": "/dev/shm"}],
    }
    if head:
        container["ports"] = [{"name": name, "containerPort": port} for name, port in HEAD_PORTS]
    spec: dict[str, Any] = {
        "automountServiceAccountToken": False,  # Ray and the trainer never call the Kubernetes API
        "containers": [container],
        "securityContext": podspec.pod_security(1000),
        # No size limit on /tmp: it takes the node's disk as the container's writable layer did, and a base model
        # of tens of GB must fit beside the checkpoints.
        "volumes": [{"name": "tmp", "emptyDir": {}},
                    {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm_size}}],
    }
    if not head:
        spec.update(podspec.placement(cluster.workers.node_selector, cluster.workers.tolerations))
        # rank 0 may be writing a checkpoint when its pod is deleted: the hook lets it finish, SIGTERM comes after
        spec["terminationGracePeriodSeconds"] = cluster.termination_grace_s
        drain = ["python", "-m", "components.trainer.drain",
                 "--timeout", str(cluster.termination_grace_s - DRAIN_MARGIN_S)]
        container["lifecycle"] = {"preStop": {"exec": {"command": drain}}}
    return {"metadata": {"labels": labels}, "spec": spec}


def build_rayjob(config: LaunchableConfig, *, run_id: str, output: str,
                 parent_run_id: str | None = None) -> dict[str, Any]:
    """The RayJob that runs ``python -m components.trainer`` for ``config`` on ``cluster.workers.replicas``
    Ray workers."""
    cluster = config.cluster
    try:
        remote = storage.is_remote(output)
    except StorageError:
        remote = False
    if not remote:
        raise LaunchError(f"--output {output!r} must be an s3:// URI: the Ray pods share no filesystem and are "
                          "deleted when the job ends")
    data = config.run_data()
    for where, value in (("--output", output), ("--mlflow-parent-run-id", parent_run_id or "")):
        if URL_USERINFO.search(value):
            raise LaunchError(f"{where} embeds credentials in a URL; the RayJob is readable by anyone who can "
                              "list it: put them in the Secrets named by cluster.s3_secret / cluster.mlflow_secret")
    if (key := url_credentials_at(data)) is not None:  # validated configs have none; a hand-made one may
        raise LaunchError(f"{key} embeds credentials in a URL; the config is stored in the RayJob in plain text: "
                          "put them in the Secrets named by cluster.s3_secret / cluster.mlflow_secret")
    gpus = cluster.workers.gpus_per_worker
    model = data.get("model") or {}
    if model.get("device") == "cuda" and gpus == 0:
        raise LaunchError("model.device is 'cuda' but cluster.workers.gpus_per_worker is 0: request GPUs "
                          "(with a GPU node pool in cluster.workers.node_selector) or set model.device: auto")

    name = rayjob_name(run_id)
    # the run id label (with the component) is what the run's reward server lets in, the instance what the Ray
    # pods' own NetworkPolicy does (build_network_policy)
    labels = {"app.kubernetes.io/name": "flowgrpo", "app.kubernetes.io/instance": name,
              "app.kubernetes.io/managed-by": "flowgrpo", **podspec.trainer_selector(run_id)}
    config_env = environ.FLOWGRPO_EXPERIMENT_CONFIG.name
    env_vars = {config_env: _dump(data), **environ.entry_settings()}
    if parent_run_id:
        env_vars[environ.FLOWGRPO_MLFLOW_PARENT_RUN_ID.name] = parent_run_id
    replicas = cluster.workers.replicas
    entrypoint = (f"python -m components.trainer --config env:{config_env} --output {shlex.quote(output)} "
                  f"--ray-workers {cluster.workers.training_workers} --auto-resume")  # a retried job continues
    cluster_spec: dict[str, Any] = {
        "rayVersion": cluster.ray_version,
        "headGroupSpec": {
            # num-cpus 0: no training task lands on the head, which is sized only to coordinate.
            "rayStartParams": {"dashboard-host": "0.0.0.0", "num-cpus": "0",
                               "object-store-memory": str(object_store_bytes(cluster.head.shm_size))},
            "template": _pod(cluster, labels, cpu=cluster.head.cpu, memory=cluster.head.memory, gpus=0,
                             shm_size=cluster.head.shm_size, head=True),
        },
        "workerGroupSpecs": [{
            "groupName": "workers",
            "replicas": replicas, "minReplicas": replicas, "maxReplicas": replicas,
            "rayStartParams": {"object-store-memory": str(object_store_bytes(cluster.workers.shm_size))},
            "template": _pod(cluster, labels, cpu=cluster.workers.cpu, memory=cluster.workers.memory, gpus=gpus,
                             shm_size=cluster.workers.shm_size, head=False),
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


def ray_pods(name: str) -> dict[str, str]:
    """The labels that pick the head and worker pods of the RayJob ``name``."""
    return {"app.kubernetes.io/instance": name, "app.kubernetes.io/component": "trainer"}


def build_network_policy(rayjob: dict[str, Any], uid: str) -> dict[str, Any]:
    """The NetworkPolicy of a RayJob's Ray pods, owned by the RayJob (``uid``), so Kubernetes deletes it with the
    RayJob. Every port of the head and workers (GCS 6379, dashboard 8265, client 10001, the raylets' and workers'
    own) is reachable from the same RayJob's head, workers and submitter pod only; the dashboard also from the
    KubeRay operator, which follows the job there (and submits it in HTTPMode)."""
    meta = rayjob["metadata"]
    name = meta["name"]
    own = ray_pods(name)
    submitter = {SUBMITTER_CRD_LABEL: "RayJob", SUBMITTER_NAME_LABEL: name}
    metadata = {"name": name, "namespace": meta["namespace"], "labels": dict(meta["labels"]),
                "annotations": dict(meta["annotations"]),
                "ownerReferences": [{"apiVersion": API_VERSION, "kind": "RayJob", "name": name, "uid": uid}]}
    return podspec.network_policy(metadata, own, [
        {"from": [{"podSelector": {"matchLabels": own}}, {"podSelector": {"matchLabels": submitter}}]},
        {"from": [{"namespaceSelector": {}, "podSelector": {"matchLabels": dict(OPERATOR_LABELS)}}],
         "ports": [{"port": dict(HEAD_PORTS)["dashboard"], "protocol": "TCP"}]},
    ])


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
