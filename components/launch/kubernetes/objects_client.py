"""Create, wait for and delete the reward server's Deployments, Services, ConfigMaps and NetworkPolicies.

The objects are stateless: one that exists with the same manifest is kept, one with another is replaced.
"""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Callable
from typing import Any

import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from components.console import status_line
from components.errors import LaunchError
from components.launch.kubernetes.api import (
    API_GRACE_S,
    REQUEST_TIMEOUT,
    ApiUnavailable,
    Kind,
    Trouble,
    api_client_for,
    api_error,
    clock,
    unreachable,
)
from components.polling import Polls

# The manifest an object was created from, hashed: a 409 on create compares this instead of the stored spec,
# which the API server has filled with defaults.
MANIFEST_HASH = "flowgrpo.io/manifest-sha256"
# Container states that will not fix themselves: the deploy fails as soon as a pod shows one.
IMAGE_PULL = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName")

_RUNNER = "create, get, patch and delete"
DEPLOYMENT = Kind("Deployment", "deployments.apps", _RUNNER, "apps", "deployment")
POD = Kind("Pod", "pods", "list", "core", "pod")
BUILTIN = {k.kind: k for k in (DEPLOYMENT, POD, Kind("Service", "services", _RUNNER, "core", "service"),
                               Kind("ConfigMap", "configmaps", _RUNNER, "core", "config_map"),
                               Kind("NetworkPolicy", "networkpolicies.networking.k8s.io", _RUNNER, "networking",
                                     "network_policy"))}
_GROUPS = {"core": client.CoreV1Api, "apps": client.AppsV1Api, "networking": client.NetworkingV1Api}
# RBAC verbs -> the client's method prefixes.
_METHOD = {"get": "read", "create": "create", "patch": "patch", "delete": "delete", "list": "list"}


class DeploymentFailed(LaunchError):
    """A pod of the Deployment cannot become ready by itself; the message names the pod and the reason."""

    def __init__(self, message: str, pod: str, reason: str) -> None:
        super().__init__(message)
        self.pod = pod
        self.reason = reason


def _request(api: client.ApiClient, what: Kind, verb: str, namespace: str, name: str = "", *,
             tolerate: tuple[int, ...] = (), **kwargs: Any) -> dict[str, Any] | None:
    """One call of the typed API (``verb`` as RBAC names it), its answer as plain JSON (the client's models
    reject partial objects); None for a status in ``tolerate``."""
    group = _GROUPS[what.api](api)
    call = getattr(group, f"{_METHOD[verb]}_namespaced_{what.method}")
    if name:
        kwargs["name"] = name
    try:
        response = call(namespace=namespace, _preload_content=False, _request_timeout=REQUEST_TIMEOUT, **kwargs)
    except ApiException as exc:
        if exc.status in tolerate:
            return None
        raise api_error(exc, verb, namespace, name, what) from exc
    except urllib3.exceptions.HTTPError as exc:
        raise unreachable(api, exc) from exc
    return json.loads(response.data or b"{}")


def _manifest_hash(manifest: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()


def apply_objects(manifests: list[dict[str, Any]], *, api: client.ApiClient | None = None,
                  log: Callable[[str], None] = status_line) -> None:
    """Create each Deployment / Service / ConfigMap / NetworkPolicy (``metadata.namespace`` set); one that exists
    is kept when it was created from the same manifest (a retried step) and replaced otherwise."""
    api = api or api_client_for()
    for manifest in manifests:
        what = BUILTIN[manifest["kind"]]
        namespace, name = manifest["metadata"]["namespace"], manifest["metadata"]["name"]
        where = f"{what.kind} {namespace}/{name}"
        digest = _manifest_hash(manifest)
        body = copy.deepcopy(manifest)
        body["metadata"].setdefault("annotations", {})[MANIFEST_HASH] = digest
        if _request(api, what, "create", namespace, body=body, tolerate=(409,)) is not None:
            log(f"{where} created")
            continue
        existing = _request(api, what, "get", namespace, name)
        if ((existing or {}).get("metadata") or {}).get("annotations", {}).get(MANIFEST_HASH) == digest:
            log(f"{where} already exists with this manifest (deployed before): kept")
            continue
        # A JSON patch replaces whole fields (a merge patch would keep keys the new manifest dropped); the
        # "patch" verb is all the Role grants. Fields the API server allocated (a Service's clusterIP) are kept.
        ops = [{"op": "add", "path": f"/metadata/{key}", "value": body["metadata"].get(key, {})}
               for key in ("labels", "annotations")]
        ops += [{"op": "add", "path": f"/{key}", "value": value} for key, value in body.items()
                if key not in ("apiVersion", "kind", "metadata")]
        _request(api, what, "patch", namespace, name, body=ops)
        log(f"{where} existed with another manifest: replaced")


def delete_objects(objects: list[tuple[str, str]], namespace: str, *, api: client.ApiClient | None = None,
                   log: Callable[[str], None] = status_line) -> list[str]:
    """Delete each ``(kind, name)``, dependents first (foreground); one already gone is fine. Returns the
    ``Kind/name`` of those that were there."""
    api = api or api_client_for()
    deleted = []
    for kind, name in objects:
        if _request(api, BUILTIN[kind], "delete", namespace, name, tolerate=(404,),
                    propagation_policy="Foreground") is not None:
            log(f"{kind} {namespace}/{name} deleted")
            deleted.append(f"{kind}/{name}")
    return deleted


def _rollout(deployment: dict[str, Any]) -> tuple[bool, str]:
    """Whether the rollout is complete (the checks of ``kubectl rollout status``) and ``x/y ready``."""
    meta, spec, status = deployment["metadata"], deployment.get("spec") or {}, deployment.get("status") or {}
    wanted = spec.get("replicas", 1)
    updated, available = status.get("updatedReplicas") or 0, status.get("availableReplicas") or 0
    observed = meta.get("generation") is None or (status.get("observedGeneration") or 0) >= meta["generation"]
    done = observed and updated >= wanted and (status.get("replicas") or 0) <= updated and available >= updated
    return done, f"{status.get('readyReplicas') or 0}/{wanted} ready"


def _pod_state(pod: dict[str, Any]) -> str:
    """``name Phase (waiting reasons)``: what a timeout message reports as last seen."""
    status = pod.get("status") or {}
    statuses = [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]
    reasons = [w["reason"] for c in statuses if (w := (c.get("state") or {}).get("waiting")) and w.get("reason")]
    reasons += [c["reason"] for c in status.get("conditions") or []
                if c.get("type") == "PodScheduled" and c.get("status") == "False" and c.get("reason")]
    phase = status.get("phase") or "Pending"
    if phase == "Running" and not all(c.get("ready") for c in status.get("containerStatuses") or []):
        reasons.append("not ready")
    return f"{pod['metadata']['name']} {phase}" + (f" ({', '.join(reasons)})" if reasons else "")


def _pod_problem(pod: dict[str, Any], key: str) -> tuple[str, str] | None:
    """``(reason, explanation)`` when the pod shows a failure that will not fix itself, else None."""
    name, status = pod["metadata"]["name"], pod.get("status") or {}
    for cond in status.get("conditions") or []:
        if cond.get("type") == "PodScheduled" and cond.get("status") == "False" and \
                cond.get("reason") == "Unschedulable":
            scheduler = (cond.get("message") or "no node fits").rstrip(".")
            return "Unschedulable", (f"{scheduler}; check {key}.cpu, .memory, .gpus, "
                                     ".node_selector and .tolerations against the nodes")
    limits = {c["name"]: ((c.get("resources") or {}).get("limits") or {}).get("memory", "none")
              for c in [*((pod.get("spec") or {}).get("initContainers") or []),
                        *((pod.get("spec") or {}).get("containers") or [])]}
    for c in [*(status.get("initContainerStatuses") or []), *(status.get("containerStatuses") or [])]:
        state, last = c.get("state") or {}, c.get("lastState") or {}
        waiting = state.get("waiting") or {}
        ended = state.get("terminated") or last.get("terminated") or {}
        container = f"container {c.get('name')}"
        if ended.get("reason") == "OOMKilled":
            return "OOMKilled", (f"{container} ran out of memory (exit code {ended.get('exitCode')}, memory limit "
                                 f"{limits.get(c.get('name'), 'none')}): raise {key}.memory")
        if waiting.get("reason") in IMAGE_PULL:
            return waiting["reason"], (f"{container} cannot pull image {c.get('image')} "
                                       f"({waiting.get('message') or 'no message'}): check that {key}.image exists "
                                       "and that the nodes may pull from its registry")
        if waiting.get("reason") == "CrashLoopBackOff":
            return "CrashLoopBackOff", (f"{container} keeps exiting (last: {ended.get('reason') or 'unknown'}, exit "
                                        f"code {ended.get('exitCode')}); its log: kubectl logs -n "
                                        f"{pod['metadata'].get('namespace')} {name} -c {c.get('name')} --previous")
        if waiting.get("reason") == "CreateContainerConfigError":
            return "CreateContainerConfigError", f"{container}: {waiting.get('message') or 'no message'}"
    return None


def wait_deployment_ready(name: str, namespace: str, *, timeout_s: float, poll_s: float = 5.0,
                          heartbeat_s: float = 60.0, unschedulable_grace_s: float = 0.0,
                          config_key: str = "reward_deploy", api: client.ApiClient | None = None,
                          log: Callable[[str], None] = status_line) -> None:
    """Poll until the Deployment's rollout is complete, logging ``x/y ready`` on change and every ``heartbeat_s``.

    Raises ``DeploymentFailed`` as soon as one of its pods shows ImagePullBackOff / ErrImagePull,
    CrashLoopBackOff, OOMKilled, CreateContainerConfigError, or is Unschedulable for longer than
    ``unschedulable_grace_s``; ``LaunchError`` after ``timeout_s`` saying what it saw last. Hints name the
    settings under ``config_key``.
    """
    api = api or api_client_for()
    where = f"Deployment {namespace}/{name}"
    last, last_line = "nothing (no answer from the API yet)", 0.0
    trouble = Trouble(where, log)
    unschedulable: dict[str, float] = {}  # pod -> when first seen Unschedulable
    for now in Polls(timeout_s, poll_s):  # seconds since the polls began
        try:
            deployment = _request(api, DEPLOYMENT, "get", namespace, name) or {}
            selector = ",".join(f"{k}={v}" for k, v in deployment["spec"]["selector"]["matchLabels"].items())
            pods = (_request(api, POD, "list", namespace, label_selector=selector) or {}).get("items") or []
            trouble.since = None
        except ApiUnavailable as exc:
            trouble.seen(exc, now, LaunchError(f"{exc} (for {API_GRACE_S:.0f} s)"))
        else:
            done, state = _rollout(deployment)
            if done:
                log(f"{where} ready ({state}) after {clock(now)}")
                return
            for pod in pods:
                problem = _pod_problem(pod, config_key)
                if problem is None:
                    continue
                pod_name = pod["metadata"]["name"]
                if problem[0] == "Unschedulable" and \
                        now - unschedulable.setdefault(pod_name, now) < unschedulable_grace_s:
                    continue  # a cluster autoscaler may still add a node
                raise DeploymentFailed(f"{where}: pod {pod_name} {problem[0]}: {problem[1]}", pod_name, problem[0])
            seen = f"{state}; pods: {', '.join(_pod_state(p) for p in pods) or 'none yet'}"
            if seen != last or now - last_line >= heartbeat_s:
                log(f"{where}: {'still ' if seen == last else ''}{seen} after {clock(now)}")
                last, last_line = seen, now
    raise LaunchError(f"{where} not ready after {clock(timeout_s)}; last seen: {last}. Look at kubectl "
                      f"describe deployment -n {namespace} {name} and its pods' events")
