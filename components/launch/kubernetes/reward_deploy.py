"""A run's reward server on Kubernetes, as plain data, and its deploy / teardown (through objects_client.py).

The server serves the experiment's training rewards (``rewards:``): the trainer is its only client, and the
evaluation step scores in its own process with ``eval_rewards``. Every name derives from the run id alone, so the
pipeline's exit handler (which cannot read other tasks' outputs) tears down what the deploy step created.

Objects: a ConfigMap with the server's settings YAML, a Deployment running ``python -m components.reward_server`` and a
ClusterIP Service; when a ``vlm_judge`` reward is served (and ``reward_deploy.judge.enabled``), a vLLM judge
Deployment + Service named ``<name>-judge``, with every vlm_judge ``base_url`` pointed at it.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Callable
from typing import Any, Protocol

from components import environ
from components.console import status_line
from components.errors import LaunchError
from components.launch.kubernetes.podspec import (
    S3_SECRET_KEYS,
    container_security,
    label_value,
    network_policy,
    placement,
    pod_security,
    resources,
    run_name,
    secret_env,
    trainer_selector,
)
from components.launch.kubernetes.reward_deploy_config import RewardDeployConfig
from components.launch.kubernetes.types import Toleration
from components.reward_server.settings import judge_specs, settings_yaml
from components.rewards.registry import RewardSpec

NAME_PREFIX = "flowgrpo-rs-"
# Service names are DNS-1035 labels (63): room for JUDGE_SUFFIX.
MAX_NAME = 56
JUDGE_SUFFIX = "-judge"
CONFIG_DIR = "/etc/flowgrpo"
CONFIG_FILE = "rewards.yaml"
CONFIG_HASH = "flowgrpo.io/config-sha256"
# The numeric USER of the reward-server and vllm-judge targets of images/Dockerfile (runAsNonRoot needs it).
IMAGE_UID = 10001
MODELS = "/models"
# The judge's model from s3://: the same copy as manifests/components/judge-from-s3 (checksums verified).
FETCH_MODEL = """\
import sys
from components import environ
from components.storage import download_dir
uri, target = environ.FLOWGRPO_JUDGE_MODEL_URI.value(), environ.FLOWGRPO_JUDGE_MODEL_DIR.value()
files = download_dir(uri, target)
print(f"fetch-model: {len(files)} files from {uri} in {target}", flush=True)
sys.exit(0 if files else f"fetch-model: no objects under {uri}")
"""


class DeployableConfig(Protocol):
    """What the deploy step needs of an experiment config (pipeline.config.ExperimentConfig)."""

    rewards: list[RewardSpec]
    reward_deploy: RewardDeployConfig


def reward_server_name(run_id: str) -> str:
    """``flowgrpo-rs-<run id>`` when that is a valid, short enough DNS-1035 label; else a slug plus a hash of
    the run id. The judge is ``<name>-judge``."""
    return run_name(NAME_PREFIX, run_id, MAX_NAME)


def judge_name(name: str) -> str:
    return name + JUDGE_SUFFIX


def service_url(name: str, namespace: str, port: int) -> str:
    return f"http://{name}.{namespace}.svc.cluster.local:{port}"


def judge_models(config: DeployableConfig) -> list[str]:
    """The served model names the vlm_judge rewards ask for; empty when no judge is to be deployed."""
    if not config.reward_deploy.judge.enabled:
        return []
    specs = list(judge_specs([s.model_dump(mode="json") for s in config.rewards]))
    names = list(dict.fromkeys(s["args"].get("model") for s in specs))
    if any(not isinstance(n, str) or not n for n in names):
        raise LaunchError("a vlm_judge reward has no args.model: it names the model the judge serves")
    return names


def _labels(component: str, name: str, run_id: str) -> dict[str, str]:
    # No app.kubernetes.io/name: flowgrpo, so the shared Service, PodDisruptionBudget and NetworkPolicies of
    # manifests/base (which select on it) never pick up a run's pods.
    return {"app.kubernetes.io/part-of": "flowgrpo", "app.kubernetes.io/component": component,
            "app.kubernetes.io/instance": name, "app.kubernetes.io/managed-by": "flowgrpo",
            "flowgrpo.io/run-id": label_value(run_id)}


def _metadata(name: str, namespace: str, labels: dict[str, str], run_id: str) -> dict[str, Any]:
    """The objects of one server share it; each gets its own copy, so editing one object changes no other."""
    return {"name": name, "namespace": namespace, "labels": labels, "annotations": {"flowgrpo.io/run-id": run_id}}


def _http_probe(path: str, period: int, timeout: int, failures: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period, "timeoutSeconds": timeout,
            "failureThreshold": failures}


def _selector(meta: dict[str, Any]) -> dict[str, str]:
    """The labels that pick one server's (or judge's) pods."""
    return {k: meta["labels"][k] for k in ("app.kubernetes.io/instance", "app.kubernetes.io/component")}


def _deployment(meta: dict[str, Any], replicas: int, pod: dict[str, Any], **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": copy.deepcopy(meta),
            "spec": {"replicas": replicas, "revisionHistoryLimit": 1, "selector": {"matchLabels": _selector(meta)},
                     **spec, "template": pod}}


def _service(meta: dict[str, Any], port: int) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service", "metadata": copy.deepcopy(meta),
            "spec": {"type": "ClusterIP", "selector": _selector(meta),
                     "ports": [{"name": "http", "port": port, "targetPort": "http", "protocol": "TCP"}]}}


def _network_policy(meta: dict[str, Any], port: int, clients: dict[str, str]) -> dict[str, Any]:
    """Ingress to the pods of ``meta`` on ``port`` from pods labelled ``clients`` only (in this namespace)."""
    return network_policy(copy.deepcopy(meta), _selector(meta), [{"from": [{"podSelector": {"matchLabels": clients}}],
                                                                  "ports": [{"port": port, "protocol": "TCP"}]}])


def _pod_spec(containers: list[dict[str, Any]], volumes: list[dict[str, Any]], *, node_selector: dict[str, str],
              tolerations: list[Toleration], service_account: str | None) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "automountServiceAccountToken": False,  # neither server calls the Kubernetes API
        "enableServiceLinks": False,
        "securityContext": pod_security(IMAGE_UID),
        **placement(node_selector, tolerations),
        "containers": containers,
        "volumes": volumes,
    }
    if service_account:
        spec["serviceAccountName"] = service_account
    return spec


def _judge_objects(config: DeployableConfig, name: str, namespace: str, run_id: str,
                   models: list[str], clients: dict[str, str]) -> list[dict[str, Any]]:
    deploy, judge = config.reward_deploy, config.reward_deploy.judge
    meta = _metadata(name, namespace, _labels("vllm-judge", name, run_id), run_id)
    from_s3 = judge.model.startswith("s3://")
    if from_s3:
        model_dir = f"{MODELS}/judge"
        models_volume: dict[str, Any] = {"name": "models", "emptyDir": {"sizeLimit": "100Gi"}}
    else:
        claim, _, path = judge.model.removeprefix("pvc://").strip("/").partition("/")
        model_dir = f"{MODELS}/{path}"
        models_volume = {"name": "models", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
    container = {
        "name": "vllm",
        "image": judge.image,
        "imagePullPolicy": "IfNotPresent",
        "args": [model_dir, "--served-model-name", *models, "--host", "0.0.0.0", "--port", str(judge.port),
                 *judge.args],
        "ports": [{"name": "http", "containerPort": judge.port, "protocol": "TCP"}],
        "env": [{"name": "HF_HUB_OFFLINE", "value": "1"}, {"name": "TRANSFORMERS_OFFLINE", "value": "1"},
                {"name": "HOME", "value": "/tmp"}, {"name": "VLLM_CACHE_ROOT", "value": "/tmp/vllm-cache"},
                {"name": "VLLM_NO_USAGE_STATS", "value": "1"}],
        # Loading a large model and capturing CUDA graphs takes minutes: the startup probe allows the whole
        # ready timeout before liveness applies.
        "startupProbe": _http_probe("/health", 10, 5, max(1, int(judge.ready_timeout_s // 10))),
        "readinessProbe": _http_probe("/health", 5, 3, 3),
        "livenessProbe": _http_probe("/health", 15, 5, 4),
        "resources": resources(judge.cpu, judge.memory, judge.gpus),
        "securityContext": container_security(),
        "volumeMounts": [{"name": "models", "mountPath": MODELS, "readOnly": True},
                         {"name": "tmp", "mountPath": "/tmp"}, {"name": "dshm", "mountPath": "/dev/shm"}],
    }
    pod = _pod_spec([container], [
        models_volume,
        {"name": "tmp", "emptyDir": {"sizeLimit": "20Gi"}},
        # vLLM's workers exchange tensors through /dev/shm; the container default (64 MiB) is too small.
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "8Gi"}},
    ], node_selector=judge.node_selector, tolerations=judge.tolerations, service_account=deploy.service_account)
    if from_s3:
        pod["initContainers"] = [{
            "name": "fetch-model",
            "image": judge.fetch_image,
            "imagePullPolicy": "IfNotPresent",
            "command": ["python", "-c", FETCH_MODEL],
            "env": [{"name": environ.FLOWGRPO_JUDGE_MODEL_URI.name, "value": judge.model},
                    {"name": environ.FLOWGRPO_JUDGE_MODEL_DIR.name, "value": model_dir},
                    {"name": "HOME", "value": "/tmp"},
                    *secret_env(deploy.s3_secret, S3_SECRET_KEYS)],
            "resources": resources("1", "1Gi", 0),
            "securityContext": container_security(),
            "volumeMounts": [{"name": "models", "mountPath": MODELS}, {"name": "tmp", "mountPath": "/tmp"}],
        }]
    # Recreate: a rolling update would need a second GPU while the old pod still holds one.
    return [_deployment(meta, 1, {"metadata": {"labels": dict(meta["labels"])}, "spec": pod},
                        strategy={"type": "Recreate"}),
            _service(meta, judge.port), _network_policy(meta, judge.port, clients)]


def build_reward_server_objects(config: DeployableConfig, *, name: str, namespace: str,
                                run_id: str) -> list[dict[str, Any]]:
    """ConfigMap, Deployment, Service and NetworkPolicy (the run's trainer pods only) of the reward server named
    ``name`` (see ``reward_server_name``), then the judge's Deployment, Service and NetworkPolicy (that reward
    server only) when a vlm_judge reward is served."""
    deploy = config.reward_deploy
    models = judge_models(config)
    judge_url = service_url(judge_name(name), namespace, deploy.judge.port) if models else None
    text = settings_yaml(config.rewards, deploy.limits, deploy.batching, judge_url)
    meta = _metadata(name, namespace, _labels("reward-server", name, run_id), run_id)
    container = {
        "name": "reward-server",
        "image": deploy.image,
        "imagePullPolicy": "IfNotPresent",
        "command": ["python", "-m", "components.reward_server"],
        "args": ["--config", f"{CONFIG_DIR}/{CONFIG_FILE}", "--host", "0.0.0.0", "--port", str(deploy.port)],
        "ports": [{"name": "http", "containerPort": deploy.port, "protocol": "TCP"}],
        "env": [
            *({"name": name, "value": value} for name, value in environ.entry_settings().items()),
            {"name": "HOME", "value": "/tmp"},
            # OCR (onnxruntime) and torch use as many threads as the CPU limit, not as the node has cores.
            {"name": "OMP_NUM_THREADS", "valueFrom": {"resourceFieldRef": {"resource": "limits.cpu"}}},
            *secret_env(deploy.s3_secret, S3_SECRET_KEYS),
        ],
        # /healthz answers while the rewards load, /readyz once they are loaded: the Service sends traffic only
        # to pods that can score, and a slow start (importing torch, loading weights) is not a liveness failure.
        "startupProbe": _http_probe("/healthz", 2, 2, 150),
        "readinessProbe": _http_probe("/readyz", 5, 3, 3),
        "livenessProbe": _http_probe("/healthz", 10, 5, 3),
        "resources": resources(deploy.cpu, deploy.memory, deploy.gpus),
        "securityContext": container_security(),
        "volumeMounts": [{"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
                         {"name": "tmp", "mountPath": "/tmp"}],
    }
    pod = _pod_spec([container], [
        {"name": "config", "configMap": {"name": name}},
        # Caches (reward weights from s3://, FLOWGRPO_CACHE_DIR) under a read-only root filesystem.
        {"name": "tmp", "emptyDir": {"sizeLimit": "10Gi"}},
    ], node_selector=deploy.node_selector, tolerations=deploy.tolerations, service_account=deploy.service_account)
    # The settings' hash on the pod template: changed settings roll the pods, which read the ConfigMap at start.
    template = {"metadata": {"labels": dict(meta["labels"]),
                             "annotations": {CONFIG_HASH: hashlib.sha256(text.encode()).hexdigest()}},
                "spec": pod}
    objects = [
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": copy.deepcopy(meta), "data": {CONFIG_FILE: text}},
        _deployment(meta, deploy.replicas, template),
        _service(meta, deploy.port),
        _network_policy(meta, deploy.port, trainer_selector(run_id)),
    ]
    if models:
        objects += _judge_objects(config, judge_name(name), namespace, run_id, models, _selector(meta))
    return objects


def deploy_to_kubernetes(config: DeployableConfig, *, name: str, namespace: str, run_id: str,
                         log: Callable[[str], None] = status_line, host: str | None = None,
                         poll_s: float = 5.0) -> str:
    """Create (or keep, when deployed before with the same config) the reward server and its judge, wait until
    they are ready, and return the server's in-cluster URL. ``host``: an API server URL without credentials
    (``kubectl proxy``, tests); default the in-cluster service account or the kubeconfig.

    Raises ``objects_client.DeploymentFailed`` naming the pod and reason, ``LaunchError`` on a timeout; the objects stay
    for inspection until ``teardown_kubernetes``."""
    from components.launch.kubernetes import objects_client as kube  # the client: only where a cluster is used

    objects = build_reward_server_objects(config, name=name, namespace=namespace, run_id=run_id)
    api = kube.api_client_for(host)
    kube.apply_objects(objects, api=api, log=log)
    deploy = config.reward_deploy
    kube.wait_deployment_ready(name, namespace, timeout_s=deploy.ready_timeout_s, poll_s=poll_s,
                               unschedulable_grace_s=deploy.unschedulable_grace_s, api=api, log=log)
    if judge_models(config):
        kube.wait_deployment_ready(judge_name(name), namespace, timeout_s=deploy.judge.ready_timeout_s, poll_s=poll_s,
                                   unschedulable_grace_s=deploy.unschedulable_grace_s,
                                   config_key="reward_deploy.judge", api=api, log=log)
    url = service_url(name, namespace, deploy.port)
    log(f"reward server {name} ready at {url}")
    return url


def teardown_kubernetes(name: str, namespace: str, log: Callable[[str], None] = status_line,
                        host: str | None = None) -> None:
    """Delete the reward server ``name`` and its judge; what is already gone (or never was) is fine."""
    from components.launch.kubernetes import objects_client as kube

    objects = [("Deployment", name), ("Service", name), ("ConfigMap", name), ("NetworkPolicy", name),
               ("Deployment", judge_name(name)), ("Service", judge_name(name)), ("NetworkPolicy", judge_name(name))]
    deleted = kube.delete_objects(objects, namespace, api=kube.api_client_for(host), log=log)
    log(f"reward server {namespace}/{name}: {'removed' if deleted else 'nothing left to remove'}")
