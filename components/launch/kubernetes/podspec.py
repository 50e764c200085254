"""Pieces of Kubernetes pod specs shared by the RayJob and the reward server, as plain data (no client here).

Names derived from a run id, container resources (requests = limits), Secret keys by reference, the non-root
security contexts and node placement are built here once, so every pod the project creates follows the same rules.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

from components.errors import LaunchError
from components.launch.kubernetes.types import Toleration

S3_SECRET_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL_S3", "AWS_REGION")
MLFLOW_SECRET_KEYS = ("MLFLOW_TRACKING_URI", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD")
_LABEL_VALUE_BAD = re.compile(r"[^A-Za-z0-9_.-]+")


def run_name(prefix: str, run_id: str, max_len: int) -> str:
    """``<prefix><run id>`` when that is a valid, short enough DNS-1035 label; else a slug plus a hash of the run
    id, so distinct run ids never share a name. ``prefix`` starts with a letter and ends with '-'."""
    slug = re.sub(r"[^a-z0-9]+", "-", run_id.lower()).strip("-")
    if not slug:
        raise LaunchError(f"run id {run_id!r} needs at least one letter or digit")
    if slug == run_id and len(prefix) + len(slug) <= max_len:
        return prefix + slug
    digest = hashlib.sha256(run_id.encode()).hexdigest()[:8]
    room = max_len - len(prefix) - 1 - len(digest)
    return f"{prefix}{slug[:room].rstrip('-')}-{digest}"


def label_value(text: str) -> str:
    """``text`` as a valid label value (at most 63 of ``[A-Za-z0-9_.-]``, alphanumeric at both ends); lossy, so
    the exact text belongs in an annotation beside it."""
    return _LABEL_VALUE_BAD.sub("-", text)[:63].strip("-_.")


PIPELINE_SERVICE_ACCOUNT = "flowgrpo-pipeline-runner"  # manifests/base/rbac.yaml: what the pipeline's steps may do


def trainer_selector(run_id: str) -> dict[str, str]:
    """The labels of a run's training pods (the RayJob's head and workers), the only clients its reward server
    lets in (NetworkPolicy). Evaluation scores in its own process and never calls the server."""
    return {"app.kubernetes.io/component": "trainer", "flowgrpo.io/run-id": label_value(run_id)}


def secret_env(secret: str | None, keys: tuple[str, ...]) -> list[dict[str, Any]]:
    """Environment variables read from ``secret`` by reference (values never enter a manifest)."""
    # optional: a missing key (say AWS_REGION) leaves the variable unset instead of blocking the pod.
    return [{"name": key, "valueFrom": {"secretKeyRef": {"name": secret, "key": key, "optional": True}}}
            for key in keys] if secret else []


def resources(cpu: str, memory: str, gpus: int) -> dict[str, Any]:
    """requests = limits: the project's pods should not be the first evicted or throttled under pressure."""
    limits = {"cpu": cpu, "memory": memory}
    if gpus:
        limits["nvidia.com/gpu"] = str(gpus)
    return {"requests": dict(limits), "limits": limits}


def container_security() -> dict[str, Any]:
    """No privilege escalation, no capability, a read-only root filesystem: a pod writes only to its volumes."""
    return {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True, "capabilities": {"drop": ["ALL"]}}


def pod_security(uid: int) -> dict[str, Any]:
    """Non-root with the image's own numeric UID (runAsNonRoot needs a number to check)."""
    return {"runAsNonRoot": True, "runAsUser": uid, "runAsGroup": uid, "fsGroup": uid,
            "seccompProfile": {"type": "RuntimeDefault"}}


def network_policy(metadata: dict[str, Any], pods: dict[str, str], ingress: list[dict[str, Any]]) -> dict[str, Any]:
    """A NetworkPolicy letting only the ``ingress`` rules reach the pods labelled ``pods``."""
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy", "metadata": metadata,
            "spec": {"podSelector": {"matchLabels": pods}, "policyTypes": ["Ingress"], "ingress": ingress}}


def placement(node_selector: dict[str, str], tolerations: list[Toleration]) -> dict[str, Any]:
    """``nodeSelector`` and ``tolerations`` of a pod spec, each only when set."""
    spec: dict[str, Any] = {}
    if node_selector:
        spec["nodeSelector"] = dict(node_selector)
    if tolerations:
        spec["tolerations"] = [t.model_dump(exclude_none=True) for t in tolerations]
    return spec
