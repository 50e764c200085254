"""The pipeline runner's Role (manifests/base/rbac.yaml) grants exactly what the Kubernetes launcher calls.

Every code path of the launcher that touches the cluster runs here against kmock's API server, which records each
request: a run's reward server and judge deployed, deployed again unchanged (kept), deployed with another config
and port (every object replaced), torn down twice; a RayJob and its NetworkPolicy submitted, followed, submitted
again (kept), submitted after someone deleted the RayJob (the policy re-owned), stopped (deleted) and stopped in
suspend mode (patched). Each request becomes the (API group, resource, verb) an RBAC API server authorizes it as;
the Role must grant each one and nothing else.
"""

from __future__ import annotations

import asyncio
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: helpers
from k8s_manifests import MANIFESTS, kustomize
from kmock import resource
from kube_emulator import api_calls, outcome, rbac_verb, serve

from components.launch.kubernetes import rayjob_client
from components.launch.kubernetes.objects_client import BUILTIN
from components.launch.kubernetes.rayjob_client import RAYJOB
from components.launch.kubernetes.rayjob_manifest import build_rayjob
from components.launch.kubernetes.reward_deploy import deploy_to_kubernetes, reward_server_name, teardown_kubernetes
from pipeline.config import TINY_CONFIG, load_config

NS = "flowgrpo"
POLL_S = 0.05
READY = {"replicas": 1, "updatedReplicas": 1, "readyReplicas": 1, "availableReplicas": 1}
JUDGE_REWARD = "rewards=[{name: vlm_judge, args: {base_url: 'http://127.0.0.1:8000/v1', model: judge}}]"
# Requests that are not about a namespaced resource: API discovery (the RayJob CRD check), which the built-in
# ClusterRole system:discovery grants every authenticated user.
DISCOVERY = {"/apis/ray.io/v1"}


async def _controllers(kmock, rayjob_status: dict) -> None:
    """The Deployment controller (every Deployment becomes ready) and KubeRay (every RayJob takes
    ``rayjob_status``)."""
    while True:
        for (res, _, _), obj in list(kmock.objects.items()):
            if obj.deleted or obj.get("status"):
                continue
            if res == resource("apps/v1/deployments"):
                obj.patch({"status": READY})
            elif res == resource("ray.io/v1/rayjobs"):
                obj.patch({"status": dict(rayjob_status)})
        await asyncio.sleep(0.02)



async def _exercise_every_code_path(kmock) -> list:
    """Run each path in a thread (kmock serves on this event loop); what each returned or raised."""
    url = str(kmock.url)
    status = {"jobDeploymentStatus": "Complete", "jobStatus": "SUCCEEDED"}
    controllers = asyncio.create_task(_controllers(kmock, status))
    log = lambda _: None  # noqa: E731
    name = reward_server_name("rbac-1")

    def deploy(*overrides: str):
        config = load_config(TINY_CONFIG, ["reward_deploy.ready_timeout_s=15", JUDGE_REWARD, *overrides])
        return deploy_to_kubernetes(config, name=name, namespace=NS, run_id="rbac-1", log=log, host=url,
                                    poll_s=POLL_S)

    def submit(run_id: str, **kwargs):
        manifest = build_rayjob(load_config(TINY_CONFIG), run_id=run_id, output=f"s3://flowgrpo/runs/{run_id}")
        return rayjob_client.submit_rayjob(manifest, api=rayjob_client.client_for(url), poll_s=POLL_S, timeout_s=15,
                                           log=log, **kwargs)

    def stopped() -> threading.Event:
        event = threading.Event()
        event.set()
        return event

    outcomes = []
    try:
        for step in (deploy, deploy, lambda: deploy("rewards.0.weight=3", "reward_deploy.port=8700"),
                     lambda: teardown_kubernetes(name, NS, log, url), lambda: teardown_kubernetes(name, NS, log, url),
                     lambda: submit("rbac-a"), lambda: submit("rbac-a")):
            outcomes.append(await asyncio.to_thread(outcome, step))
        kmock.objects[resource("ray.io/v1/rayjobs"), NS, "flowgrpo-rbac-a"].delete()  # kubectl delete rayjob
        outcomes.append(await asyncio.to_thread(outcome, lambda: submit("rbac-a")))
        status.update(jobDeploymentStatus="Running", jobStatus="RUNNING")
        outcomes.append(await asyncio.to_thread(outcome, lambda: submit("rbac-b", stop=stopped())))
        outcomes.append(await asyncio.to_thread(outcome, lambda: submit("rbac-c", stop=stopped(),
                                                                       cancel_mode="suspend")))
    finally:
        controllers.cancel()
    return outcomes


def _role_grants() -> set[tuple[str, str, str]]:
    (role,) = [o for o in kustomize(MANIFESTS / "base") if o["kind"] == "Role"]
    grants = set()
    for rule in role["rules"]:
        assert set(rule) == {"apiGroups", "resources", "verbs"}, rule  # no resourceNames, no nonResourceURLs
        grants |= {(g, r, v) for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    return grants


@pytest.mark.asyncio
async def test_the_role_grants_exactly_what_the_launcher_calls(kmock):
    outcomes = await _exercise_every_code_path(serve(kmock))
    url = f"http://{reward_server_name('rbac-1')}.{NS}.svc.cluster.local"
    assert outcomes[:3] == [f"{url}:8600", f"{url}:8600", f"{url}:8700"], outcomes
    assert outcomes[3:5] == [None, None]
    assert [type(o).__name__ for o in outcomes[5:]] == ["RayJobResult"] * 3 + ["RayJobCancelled"] * 2, outcomes
    calls, other = api_calls(kmock)
    assert other == DISCOVERY
    # each path did what it is here for (so the set below is the launcher's, not a partial run's)
    assert {("networking.k8s.io", "networkpolicies", v) for v in ("create", "get", "patch", "delete")} <= calls
    assert {("ray.io", "rayjobs", v) for v in ("create", "get", "patch", "delete")} <= calls
    grants = _role_grants()
    assert sorted(calls - grants) == [], "the launcher calls these, the Role does not grant them"
    assert sorted(grants - calls) == [], "the Role grants these, no code path of the launcher calls them"


@pytest.mark.parametrize(("method", "named", "watch", "verb"), [
    ("GET", True, False, "get"), ("GET", False, False, "list"), ("GET", False, True, "watch"),
    ("GET", True, True, "watch"), ("POST", False, False, "create"), ("PATCH", True, False, "patch"),
    ("PUT", True, False, "update"), ("DELETE", True, False, "delete"), ("DELETE", False, False, "deletecollection"),
])
def test_requests_map_to_the_verbs_rbac_authorizes(method, named, watch, verb):
    assert rbac_verb(method, named=named, watch=watch) == verb


def test_a_403_names_the_verbs_the_role_grants():
    """What a forbidden call tells the user to grant is the Role's own list for that resource."""
    granted: dict[str, set[str]] = {}
    for group, res, verb in _role_grants():
        granted.setdefault(f"{res}.{group}" if group else res, set()).add(verb)
    for kind in (*BUILTIN.values(), RAYJOB):
        named = set(kind.verbs.replace(" and ", ", ").split(", "))
        assert named == granted[kind.resource], (kind.kind, kind.verbs)
