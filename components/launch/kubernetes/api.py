"""Submit, follow and cancel KubeRay RayJobs; create, wait for and delete the reward server's Deployments,
Services, ConfigMaps and NetworkPolicies. The only module that imports ``kubernetes``.

Names are deterministic (one RayJob per run id), so a RayJob that already exists is the same run submitted
before (a retried pipeline step, a restarted launcher): it is followed, not replaced, when its entrypoint and
runtime environment (which hold the whole config and the output) are the same, and refused otherwise. The
reward server's objects are stateless: one that exists with the same manifest is kept, one with another is
replaced.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from components.console import status_line
from components.errors import LaunchError

GROUP, VERSION, PLURAL = "ray.io", "v1", "rayjobs"
RESOURCE = f"{PLURAL}.{GROUP}"
TERMINAL = ("Complete", "Failed", "ValidationFailed")
CRD_MISSING = (f"the RayJob CRD ({GROUP}/{VERSION}) is not installed in this cluster: install the KubeRay operator "
               "(v1.7 or later, e.g. its Helm chart kuberay/kuberay-operator), then submit again")
# How to find out more, per KubeRay failure reason (status.reason).
REASON_HINTS = {
    "AppFailed": "the training application failed; its log: kubectl logs -n {ns} job/{name} (K8sJobMode) or the "
                 "Ray dashboard",
    "SubmissionFailed": "the job could not be submitted to the Ray cluster; see kubectl describe job -n {ns} {name} "
                        "and the head pod's events",
    "DeadlineExceeded": "it ran longer than cluster.active_deadline_seconds; raise it, or resume from the last "
                        "checkpoint with a longer deadline",
    "PreRunningDeadlineExceeded": "the Ray cluster did not start in time; check for Pending pods (GPU quota, "
                                  "node selector, image pull): kubectl get pods -n {ns}",
    "ValidationFailed": "KubeRay rejected the RayJob spec; fix the cluster section of the config",
}
# Transient API trouble (restarts, overload) during a days-long follow is waited out this long.
API_GRACE_S = 300.0
REQUEST_TIMEOUT = (10, 60)
# The manifest an object was created from, hashed: a 409 on create compares this instead of the stored spec,
# which the API server has filled with defaults.
MANIFEST_HASH = "flowgrpo.io/manifest-sha256"
# Container states that will not fix themselves: the deploy fails as soon as a pod shows one.
IMAGE_PULL = ("ErrImagePull", "ImagePullBackOff", "InvalidImageName")

CancelMode = Literal["delete", "suspend"]


@dataclass(frozen=True)
class _Kind:
    """A resource as RBAC and error messages name it, and how the typed client reaches it."""

    kind: str
    resource: str  # plural.group, as in a Role
    verbs: str  # what a 403 says to grant
    api: Literal["core", "apps", "networking", "custom"] = "custom"
    method: str = ""  # suffix of the client's create_namespaced_<method>, ...
    missing: str = ""  # what a 404 on create means (a CRD that is not installed)


RAYJOB = _Kind("RayJob", RESOURCE, "get, create, patch and delete", missing=CRD_MISSING)
_RUNNER = "create, get, list, patch and delete"
DEPLOYMENT = _Kind("Deployment", "deployments.apps", _RUNNER, "apps", "deployment")
POD = _Kind("Pod", "pods", "get and list", "core", "pod")
BUILTIN = {k.kind: k for k in (DEPLOYMENT, POD, _Kind("Service", "services", _RUNNER, "core", "service"),
                               _Kind("ConfigMap", "configmaps", _RUNNER, "core", "config_map"),
                               _Kind("NetworkPolicy", "networkpolicies.networking.k8s.io", _RUNNER, "networking",
                                     "network_policy"))}
_GROUPS = {"core": client.CoreV1Api, "apps": client.AppsV1Api, "networking": client.NetworkingV1Api}
# RBAC verbs -> the client's method prefixes.
_METHOD = {"get": "read", "create": "create", "patch": "patch", "delete": "delete", "list": "list"}


@dataclass(frozen=True)
class RayJobResult:
    name: str
    namespace: str
    deployment_status: str
    job_status: str
    reason: str
    message: str
    elapsed_s: float
    dashboard_url: str = ""

    @property
    def succeeded(self) -> bool:
        return self.deployment_status == "Complete" and self.job_status == "SUCCEEDED"


class RayJobFailed(LaunchError):
    """The RayJob ended without a successful Ray job."""

    def __init__(self, message: str, result: RayJobResult) -> None:
        super().__init__(message)
        self.result = result


class RayJobCancelled(LaunchError):
    """Following stopped on request; the RayJob was deleted or suspended."""


class ApiUnavailable(LaunchError):
    """The Kubernetes API could not be reached or answered 429 / 5xx: worth retrying for a while."""


class DeploymentFailed(LaunchError):
    """A pod of the Deployment cannot become ready by itself; the message names the pod and the reason."""

    def __init__(self, message: str, pod: str, reason: str) -> None:
        super().__init__(message)
        self.pod = pod
        self.reason = reason


def client_for(host: str | None = None) -> client.CustomObjectsApi:
    """An API for ``host`` (no credentials: tests), else the in-cluster service account or the kubeconfig."""
    return client.CustomObjectsApi(api_client_for(host))


def api_client_for(host: str | None = None) -> client.ApiClient:
    """The client every API group shares: ``host`` without credentials (tests, ``kubectl proxy``), else the
    in-cluster service account or the kubeconfig."""
    cfg = client.Configuration()
    if host:
        cfg.host = host.rstrip("/")
    else:
        try:
            if os.environ.get("KUBERNETES_SERVICE_HOST"):
                config.load_incluster_config(client_configuration=cfg)
            else:
                config.load_kube_config(client_configuration=cfg)
        except config.ConfigException as exc:
            raise LaunchError(f"no Kubernetes credentials ({exc}): set KUBECONFIG or run inside the cluster") from exc
    return client.ApiClient(cfg)


def _detail(exc: ApiException) -> tuple[str, str]:
    """The API server's own message and the kind of object it is about (``details.kind``)."""
    try:
        body = json.loads(exc.body or "{}")
    except (TypeError, ValueError):
        return str(exc.body or exc.reason or "").strip(), ""
    return str(body.get("message") or exc.reason or ""), str((body.get("details") or {}).get("kind") or "")


def _api_error(exc: ApiException, verb: str, namespace: str, name: str, what: _Kind = RAYJOB) -> LaunchError:
    message, kind = _detail(exc)
    if exc.status == 401:
        return LaunchError(f"the Kubernetes API refused the credentials ({message}): check the kubeconfig or the "
                           "service account token")
    if exc.status == 403:
        return LaunchError(f"forbidden: cannot {verb} {what.resource} in namespace {namespace} ({message}): grant "
                           f"this user or service account {what.verbs} on {what.resource} in {namespace} (a Role "
                           "and a RoleBinding, as in manifests/base/rbac.yaml)")
    if exc.status == 404 and kind == "namespaces":
        return LaunchError(f"namespace {namespace} does not exist: create it or set cluster.namespace")
    if exc.status == 404 and verb == "create" and what.missing:
        return LaunchError(what.missing)
    if exc.status == 404:
        return LaunchError(f"{what.kind} {namespace}/{name} does not exist (deleted by someone else?)")
    if exc.status == 422:
        return LaunchError(f"the API server rejected {what.kind} {namespace}/{name}: {message}")
    error = ApiUnavailable if _transient(exc) else LaunchError
    return error(f"cannot {verb} {what.kind} {namespace}/{name}: HTTP {exc.status} {exc.reason}: {message}")


def _unreachable(api: client.ApiClient, exc: Exception) -> LaunchError:
    return ApiUnavailable(f"cannot reach the Kubernetes API at {api.configuration.host}: {exc}")


class _Trouble:
    """Transient API trouble: said once, then waited out for API_GRACE_S before it becomes the error."""

    def __init__(self, where: str, log: Callable[[str], None]) -> None:
        self.where, self.log = where, log
        self.since: float | None = None

    def seen(self, trouble: Exception, now: float, error: LaunchError) -> None:
        if self.since is None:
            self.since = now
            self.log(f"{self.where}: Kubernetes API trouble ({trouble}); retrying for {API_GRACE_S:.0f} s")
        if now - self.since > API_GRACE_S:
            raise error from trouble


def _transient(exc: ApiException) -> bool:
    return exc.status == 429 or exc.status >= 500


def _check_crd(api: client.CustomObjectsApi, namespace: str) -> None:
    try:
        found = api.get_api_resources(GROUP, VERSION, _request_timeout=REQUEST_TIMEOUT)
    except ApiException as exc:
        if exc.status == 404:
            raise LaunchError(CRD_MISSING) from exc
        raise _api_error(exc, "discover", namespace, "") from exc
    except urllib3.exceptions.HTTPError as exc:
        raise _unreachable(api.api_client, exc) from exc
    if not any(r.name == PLURAL for r in found.resources or []):
        raise LaunchError(CRD_MISSING)


def _get(api: client.CustomObjectsApi, namespace: str, name: str) -> dict[str, Any]:
    return api.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name, _request_timeout=REQUEST_TIMEOUT)


def _create_or_reuse(api: client.CustomObjectsApi, manifest: dict[str, Any], log: Callable[[str], None]) -> None:
    namespace, name = manifest["metadata"]["namespace"], manifest["metadata"]["name"]
    try:
        api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, manifest,
                                            _request_timeout=REQUEST_TIMEOUT)
        log(f"RayJob {namespace}/{name} created")
        return
    except ApiException as exc:
        if exc.status != 409:
            raise _api_error(exc, "create", namespace, name) from exc
    except urllib3.exceptions.HTTPError as exc:
        raise _unreachable(api.api_client, exc) from exc
    try:
        existing = _get(api, namespace, name)
    except ApiException as exc:
        raise _api_error(exc, "get", namespace, name) from exc
    same = all((existing.get("spec") or {}).get(k) == manifest["spec"][k] for k in ("entrypoint", "runtimeEnvYAML"))
    if not same:
        raise LaunchError(f"RayJob {namespace}/{name} already exists with another config or output: choose another "
                          f"run id, or delete it (kubectl delete rayjob -n {namespace} {name})")
    log(f"RayJob {namespace}/{name} already exists with this config (submitted before): following it")


def cancel_rayjob(name: str, namespace: str, mode: CancelMode = "delete", *,
                  api: client.CustomObjectsApi | None = None) -> None:
    """Delete the RayJob (its Ray cluster goes with it) or suspend it (cluster deleted, RayJob kept)."""
    api = api or client_for()
    try:
        if mode == "suspend":
            api.patch_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name, {"spec": {"suspend": True}},
                                               _request_timeout=REQUEST_TIMEOUT)
        else:
            api.delete_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name,
                                                propagation_policy="Background", _request_timeout=REQUEST_TIMEOUT)
    except ApiException as exc:
        if exc.status == 404 and mode == "delete":
            return  # already gone: nothing left to stop
        raise _api_error(exc, "delete" if mode == "delete" else "patch", namespace, name) from exc
    except urllib3.exceptions.HTTPError as exc:
        raise _unreachable(api.api_client, exc) from exc


def _clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m{s % 60:02d}s" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _outcome(result: RayJobResult, log: Callable[[str], None]) -> RayJobResult:
    where = f"RayJob {result.namespace}/{result.name}"
    if result.succeeded:
        log(f"{where} succeeded after {_clock(result.elapsed_s)}")
        return result
    reason = result.reason or f"Ray job {result.job_status or 'status unknown'}"
    hint = REASON_HINTS.get(result.reason, "see kubectl describe rayjob -n {ns} {name}")
    message = f": {result.message}" if result.message else ""
    raise RayJobFailed(f"{where} ended {result.deployment_status} ({reason}){message}; "
                       + hint.format(ns=result.namespace, name=result.name), result)


def _follow(api: client.CustomObjectsApi, namespace: str, name: str, *, timeout_s: float | None, poll_s: float,
            heartbeat_s: float, log: Callable[[str], None], stop: threading.Event | None,
            cancel_mode: CancelMode) -> RayJobResult:
    start = time.monotonic()
    last: tuple[str, str] | None = None
    last_line = start
    trouble = _Trouble(f"RayJob {namespace}/{name}", log)
    while True:
        now = time.monotonic()
        status: dict[str, Any] | None = None
        try:
            status = _get(api, namespace, name).get("status") or {}
            trouble.since = None
        except ApiException as exc:
            if not _transient(exc):
                raise _api_error(exc, "get", namespace, name) from exc
            trouble.seen(exc, now, _unreachable(api.api_client, exc))
        except urllib3.exceptions.HTTPError as exc:
            trouble.seen(exc, now, _unreachable(api.api_client, exc))
        if status is not None:
            state = (status.get("jobDeploymentStatus") or "New", status.get("jobStatus") or "-")
            if state != last or now - last_line >= heartbeat_s:
                still = "still " if state == last else ""
                log(f"RayJob {namespace}/{name}: {still}{state[0]} (Ray job {state[1]}) after {_clock(now - start)}")
                last, last_line = state, now
            if state[0] in TERMINAL:
                return _outcome(RayJobResult(
                    name=name, namespace=namespace, deployment_status=state[0],
                    job_status=status.get("jobStatus") or "",
                    reason=status.get("reason") or "", message=status.get("message") or "",
                    elapsed_s=now - start, dashboard_url=status.get("dashboardURL") or "",
                ), log)
        if timeout_s is not None and now - start >= timeout_s:
            raise LaunchError(f"RayJob {namespace}/{name} is still {last[0] if last else 'unknown'} after "
                              f"{_clock(timeout_s)}; it keeps running on the cluster: kubectl get rayjob -n "
                              f"{namespace} {name} (or kubectl delete rayjob -n {namespace} {name})")
        if stop is not None and stop.wait(poll_s):
            cancel_rayjob(name, namespace, cancel_mode, api=api)
            raise RayJobCancelled(f"RayJob {namespace}/{name} stopped on request and "
                                  f"{'deleted' if cancel_mode == 'delete' else 'suspended'}")
        if stop is None:
            time.sleep(poll_s)


def submit_rayjob(manifest: dict[str, Any], *, timeout_s: float | None = None, poll_s: float = 10.0,
                  heartbeat_s: float = 60.0, log: Callable[[str], None] = status_line,
                  api: client.CustomObjectsApi | None = None, stop: threading.Event | None = None,
                  cancel_mode: CancelMode = "delete") -> RayJobResult:
    """Create (or reuse, see the module doc) the RayJob and follow it to its end.

    Logs each state change and, while nothing changes, a line every ``heartbeat_s``. Returns when the Ray job
    succeeded; raises ``RayJobFailed`` (naming KubeRay's reason and message) when it did not, ``LaunchError``
    after ``timeout_s`` (the RayJob keeps running). ``stop`` set or Ctrl-C: the RayJob is deleted, or suspended
    with ``cancel_mode="suspend"``, then ``RayJobCancelled`` / ``KeyboardInterrupt`` is raised.
    """
    namespace, name = manifest["metadata"]["namespace"], manifest["metadata"]["name"]
    if cancel_mode == "suspend" and not manifest["spec"].get("shutdownAfterJobFinishes"):
        raise LaunchError("cancelling by suspend needs cluster.shutdown_after_job_finishes: true (KubeRay refuses "
                          "to suspend other RayJobs); cancel by delete instead")
    api = api or client_for()
    _check_crd(api, namespace)
    _create_or_reuse(api, manifest, log)
    try:
        return _follow(api, namespace, name, timeout_s=timeout_s, poll_s=poll_s, heartbeat_s=heartbeat_s, log=log,
                       stop=stop, cancel_mode=cancel_mode)
    except KeyboardInterrupt:
        log(f"interrupted: {'deleting' if cancel_mode == 'delete' else 'suspending'} RayJob {namespace}/{name}")
        try:
            cancel_rayjob(name, namespace, cancel_mode, api=api)
        except LaunchError as exc:
            log(f"could not cancel RayJob {namespace}/{name}: {exc}")
        raise


# --- the reward server: built-in kinds ------------------------------------------------------------------------------

def _request(api: client.ApiClient, what: _Kind, verb: str, namespace: str, name: str = "", *,
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
        raise _api_error(exc, verb, namespace, name, what) from exc
    except urllib3.exceptions.HTTPError as exc:
        raise _unreachable(api, exc) from exc
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
    start = time.monotonic()
    last, last_line = "nothing (no answer from the API yet)", start
    trouble = _Trouble(where, log)
    unschedulable: dict[str, float] = {}  # pod -> when first seen Unschedulable
    while True:
        now = time.monotonic()
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
                log(f"{where} ready ({state}) after {_clock(now - start)}")
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
                log(f"{where}: {'still ' if seen == last else ''}{seen} after {_clock(now - start)}")
                last, last_line = seen, now
        if now - start >= timeout_s:
            raise LaunchError(f"{where} not ready after {_clock(timeout_s)}; last seen: {last}. Look at kubectl "
                              f"describe deployment -n {namespace} {name} and its pods' events")
        time.sleep(poll_s)
