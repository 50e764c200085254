"""kmock's Kubernetes emulator as the launcher's API server: the resources it serves, a uid on every object it
creates (as the API server assigns one), and the RBAC verbs of the requests it received."""

from __future__ import annotations

import uuid
from typing import Any

from kmock import ResourceInfo, action

# path -> kind of everything the launcher touches (a RayJob and a reward server's objects)
RESOURCES = {"ray.io/v1/rayjobs": "RayJob", "apps/v1/deployments": "Deployment", "v1/services": "Service",
             "v1/configmaps": "ConfigMap", "v1/pods": "Pod", "networking.k8s.io/v1/networkpolicies": "NetworkPolicy"}
_WITH_STATUS = ("RayJob", "Deployment", "Pod")


def serve(kmock: Any, resources: dict[str, str] = RESOURCES) -> Any:
    """``kmock`` serving ``resources``; created objects get a uid."""
    for path, kind in resources.items():
        kmock.resources[path] = ResourceInfo(kind=kind, namespaced=True,
                                             subresources={"status"} if kind in _WITH_STATUS else set())

    def created(request: Any) -> dict[str, Any]:
        meta = request.data.get("metadata") or {}
        stored = kmock.objects[request.resource, request.namespace or meta.get("namespace"), meta.get("name")]
        if "uid" not in stored.get("metadata", {}):
            stored.patch({"metadata": {"uid": str(uuid.uuid4())}})
        return stored.raw

    # Below the tests' own reactions (priority 0), which may answer a create with an error instead.
    kmock[action.CREATE] ** -1 << created
    return kmock


def rbac_verb(method: str, *, named: bool, watch: bool) -> str:
    """The RBAC verb the API server authorizes an HTTP request as."""
    if method == "GET":
        return "watch" if watch else "get" if named else "list"
    if method == "DELETE":
        return "delete" if named else "deletecollection"
    return {"POST": "create", "PATCH": "patch", "PUT": "update"}[method]


def api_calls(kmock: Any) -> tuple[set[tuple[str, str, str]], set[str]]:
    """``(api group, resource[/subresource], verb)`` of every resource request ``kmock`` received, and the paths of
    the others (API discovery)."""
    calls, other = set(), set()
    for request in kmock:
        resource = request.resource
        if resource is None or not resource.plural:
            other.add(request.url.path)
            continue
        plural = resource.plural + (f"/{request.subresource}" if request.subresource else "")
        verb = rbac_verb(request.method.value.upper(), named=request.name is not None,
                         watch=request.params.get("watch") in ("true", "1"))
        calls.add((resource.group or "", plural, verb))
    return calls, other


def outcome(fn: Any) -> Any:
    """What ``fn()`` returns, or the exception it raises: a launcher call run in a thread beside the emulator."""
    try:
        return fn()
    except Exception as exc:
        return exc
