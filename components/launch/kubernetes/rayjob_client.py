"""Submit, follow and cancel KubeRay RayJobs.

Names are deterministic (one RayJob per run id), so a RayJob that already exists is the same run submitted
before (a retried pipeline step, a restarted launcher): it is followed, not replaced, when its entrypoint and
runtime environment (which hold the whole config and the output) are the same, and refused otherwise.
Each RayJob gets the NetworkPolicy of its Ray pods (``rayjob_manifest.build_network_policy``), owned by it: Kubernetes
deletes it with the RayJob, whoever deletes that.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from components.console import status_line
from components.errors import LaunchError
from components.launch.kubernetes.api import (
    REQUEST_TIMEOUT,
    Kind,
    Trouble,
    api_error,
    client_for,
    clock,
    transient,
    unreachable,
)
from components.launch.kubernetes.objects_client import apply_objects
from components.launch.kubernetes.rayjob_manifest import build_network_policy
from components.polling import Polls

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

CancelMode = Literal["delete", "suspend"]

RAYJOB = Kind("RayJob", RESOURCE, "get, create, patch and delete", missing=CRD_MISSING)


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


def _check_crd(api: client.CustomObjectsApi, namespace: str) -> None:
    try:
        found = api.get_api_resources(GROUP, VERSION, _request_timeout=REQUEST_TIMEOUT)
    except ApiException as exc:
        if exc.status == 404:
            raise LaunchError(CRD_MISSING) from exc
        raise api_error(exc, "discover", namespace, "", RAYJOB) from exc
    except urllib3.exceptions.HTTPError as exc:
        raise unreachable(api.api_client, exc) from exc
    if not any(r.name == PLURAL for r in found.resources or []):
        raise LaunchError(CRD_MISSING)


def _get(api: client.CustomObjectsApi, namespace: str, name: str) -> dict[str, Any]:
    return api.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name, _request_timeout=REQUEST_TIMEOUT)


def _create_or_reuse(api: client.CustomObjectsApi, manifest: dict[str, Any],
                     log: Callable[[str], None]) -> dict[str, Any]:
    """The RayJob as the API server stores it (with its uid)."""
    namespace, name = manifest["metadata"]["namespace"], manifest["metadata"]["name"]
    try:
        created = api.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, manifest,
                                                      _request_timeout=REQUEST_TIMEOUT)
        log(f"RayJob {namespace}/{name} created")
        return created
    except ApiException as exc:
        if exc.status != 409:
            raise api_error(exc, "create", namespace, name, RAYJOB) from exc
    except urllib3.exceptions.HTTPError as exc:
        raise unreachable(api.api_client, exc) from exc
    try:
        existing = _get(api, namespace, name)
    except ApiException as exc:
        raise api_error(exc, "get", namespace, name, RAYJOB) from exc
    same = all((existing.get("spec") or {}).get(k) == manifest["spec"][k] for k in ("entrypoint", "runtimeEnvYAML"))
    if not same:
        raise LaunchError(f"RayJob {namespace}/{name} already exists with another config or output: choose another "
                          f"run id, or delete it (kubectl delete rayjob -n {namespace} {name})")
    log(f"RayJob {namespace}/{name} already exists with this config (submitted before): following it")
    return existing


def _protect(api: client.CustomObjectsApi, manifest: dict[str, Any], uid: str, log: Callable[[str], None]) -> None:
    """Create the Ray pods' NetworkPolicy, owned by the RayJob ``uid``; without it the RayJob is deleted (its Ray
    ports must not stay open to the namespace)."""
    namespace, name = manifest["metadata"]["namespace"], manifest["metadata"]["name"]
    try:
        apply_objects([build_network_policy(manifest, uid)], api=api.api_client, log=log)
    except LaunchError as exc:
        cancel_rayjob(name, namespace, "delete", api=api)
        raise LaunchError(f"{exc} (RayJob {namespace}/{name} deleted: its Ray pods do not run without their "
                          "NetworkPolicy)") from exc


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
        raise api_error(exc, "delete" if mode == "delete" else "patch", namespace, name, RAYJOB) from exc
    except urllib3.exceptions.HTTPError as exc:
        raise unreachable(api.api_client, exc) from exc


def _outcome(result: RayJobResult, log: Callable[[str], None]) -> RayJobResult:
    where = f"RayJob {result.namespace}/{result.name}"
    if result.succeeded:
        log(f"{where} succeeded after {clock(result.elapsed_s)}")
        return result
    reason = result.reason or f"Ray job {result.job_status or 'status unknown'}"
    hint = REASON_HINTS.get(result.reason, "see kubectl describe rayjob -n {ns} {name}")
    message = f": {result.message}" if result.message else ""
    raise RayJobFailed(f"{where} ended {result.deployment_status} ({reason}){message}; "
                       + hint.format(ns=result.namespace, name=result.name), result)


def _follow(api: client.CustomObjectsApi, namespace: str, name: str, *, timeout_s: float | None, poll_s: float,
            heartbeat_s: float, log: Callable[[str], None], stop: threading.Event | None,
            cancel_mode: CancelMode) -> RayJobResult:
    last: tuple[str, str] | None = None
    last_line = 0.0
    trouble = Trouble(f"RayJob {namespace}/{name}", log)
    polls = Polls(timeout_s, poll_s, wait=time.sleep if stop is None else stop.wait)
    for now in polls:  # seconds since the polls began
        status: dict[str, Any] | None = None
        try:
            status = _get(api, namespace, name).get("status") or {}
            trouble.since = None
        except ApiException as exc:
            if not transient(exc):
                raise api_error(exc, "get", namespace, name, RAYJOB) from exc
            trouble.seen(exc, now, unreachable(api.api_client, exc))
        except urllib3.exceptions.HTTPError as exc:
            trouble.seen(exc, now, unreachable(api.api_client, exc))
        if status is not None:
            state = (status.get("jobDeploymentStatus") or "New", status.get("jobStatus") or "-")
            if state != last or now - last_line >= heartbeat_s:
                still = "still " if state == last else ""
                log(f"RayJob {namespace}/{name}: {still}{state[0]} (Ray job {state[1]}) after {clock(now)}")
                last, last_line = state, now
            if state[0] in TERMINAL:
                return _outcome(RayJobResult(
                    name=name, namespace=namespace, deployment_status=state[0],
                    job_status=status.get("jobStatus") or "",
                    reason=status.get("reason") or "", message=status.get("message") or "",
                    elapsed_s=now, dashboard_url=status.get("dashboardURL") or "",
                ), log)
    if polls.woken:  # ``stop`` was set
        cancel_rayjob(name, namespace, cancel_mode, api=api)
        raise RayJobCancelled(f"RayJob {namespace}/{name} stopped on request and "
                              f"{'deleted' if cancel_mode == 'delete' else 'suspended'}")
    raise LaunchError(f"RayJob {namespace}/{name} is still {last[0] if last else 'unknown'} after "
                      f"{clock(timeout_s)}; it keeps running on the cluster: kubectl get rayjob -n "
                      f"{namespace} {name} (or kubectl delete rayjob -n {namespace} {name})")


def submit_rayjob(manifest: dict[str, Any], *, timeout_s: float | None = None, poll_s: float = 10.0,
                  heartbeat_s: float = 60.0, log: Callable[[str], None] = status_line,
                  api: client.CustomObjectsApi | None = None, stop: threading.Event | None = None,
                  cancel_mode: CancelMode = "delete") -> RayJobResult:
    """Create (or reuse, see the module doc) the RayJob and its Ray pods' NetworkPolicy, and follow it to its end.

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
    _protect(api, manifest, _create_or_reuse(api, manifest, log)["metadata"]["uid"], log)
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


