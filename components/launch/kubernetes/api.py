"""The Kubernetes client, shared by the RayJob (rayjob_client.py) and the reward server's objects (objects_client.py):
credentials, API errors a user can act on, and transient trouble waited out. With those two, the only modules
that import ``kubernetes``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from components import environ
from components.errors import LaunchError

# Transient API trouble (restarts, overload) during a days-long follow is waited out this long.
API_GRACE_S = 300.0
REQUEST_TIMEOUT = (10, 60)


@dataclass(frozen=True)
class Kind:
    """A resource as RBAC and error messages name it, and how the typed client reaches it."""

    kind: str
    resource: str  # plural.group, as in a Role
    verbs: str  # what a 403 says to grant
    api: Literal["core", "apps", "networking", "custom"] = "custom"
    method: str = ""  # suffix of the client's create_namespaced_<method>, ...
    missing: str = ""  # what a 404 on create means (a CRD that is not installed)


class ApiUnavailable(LaunchError):
    """The Kubernetes API could not be reached or answered 429 / 5xx: worth retrying for a while."""


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
            if environ.KUBERNETES_SERVICE_HOST.get():
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


def api_error(exc: ApiException, verb: str, namespace: str, name: str, what: Kind) -> LaunchError:
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
    error = ApiUnavailable if transient(exc) else LaunchError
    return error(f"cannot {verb} {what.kind} {namespace}/{name}: HTTP {exc.status} {exc.reason}: {message}")


def unreachable(api: client.ApiClient, exc: Exception) -> LaunchError:
    return ApiUnavailable(f"cannot reach the Kubernetes API at {api.configuration.host}: {exc}")


class Trouble:
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


def transient(exc: ApiException) -> bool:
    return exc.status == 429 or exc.status >= 500


def clock(seconds: float) -> str:
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m{s % 60:02d}s" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


