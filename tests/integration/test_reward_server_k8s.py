"""Deploying and tearing down a run's reward server against kmock's Kubernetes emulator; the test plays the
Deployment controller and the kubelet (patching Deployment status, creating Pods with failing statuses).

As in test_kube_launcher.py: the synchronous client runs in a thread, kmock on the test's event loop. kmock ignores
label selectors, so each test creates only the pods of the Deployment it waits for.
"""

from __future__ import annotations

import asyncio
import copy
import sys
from pathlib import Path

import pytest
import yaml
from kmock import KubernetesError, action, resource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: helpers
from kube_emulator import RESOURCES, outcome, serve

from components.errors import LaunchError
from components.launch.kubernetes import objects_client as kube
from components.launch.kubernetes.reward_deploy import (
    deploy_to_kubernetes,
    judge_name,
    reward_server_name,
    service_url,
    teardown_kubernetes,
)
from pipeline.config import TINY_CONFIG, load_config

pytestmark = pytest.mark.asyncio
NS = "flowgrpo"
RUN_ID = "kmock-run-1"
NAME = reward_server_name(RUN_ID)
# kmock matches every request against all earlier ones (quadratic): keep the number of polls small.
POLL_S = 0.05
READY = {"replicas": 1, "updatedReplicas": 1, "readyReplicas": 1, "availableReplicas": 1}
JUDGE_REWARD = "rewards=[{name: vlm_judge, args: {base_url: 'http://127.0.0.1:8000/v1', model: judge}}]"


@pytest.fixture
def cluster(kmock):
    return serve(kmock)


def _key(kind: str, name: str = NAME):
    path = next(p for p, k in RESOURCES.items() if k == kind)
    return resource(path), NS, name  # `in kmock.objects` needs a parsed resource


def _present(kmock, kind: str, name: str = NAME) -> bool:
    key = _key(kind, name)
    return key in kmock.objects and not kmock.objects[key].deleted


def _pod(name: str, status: dict, memory: str = "3Gi") -> dict:
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NS,
                         "labels": {"app.kubernetes.io/instance": NAME,
                                    "app.kubernetes.io/component": "reward-server"}},
            "spec": {"containers": [{"name": "reward-server", "image": "ghcr.io/flowgrpo/flowgrpo-reward-server:0.1.0",
                                     "resources": {"limits": {"cpu": "2", "memory": memory}}}]},
            "status": status}


def _container(**state) -> dict:
    return {"phase": "Running" if "running" in state.get("state", {}) else "Pending",
            "containerStatuses": [{"name": "reward-server", "image": "ghcr.io/flowgrpo/flowgrpo-reward-server:0.1.0",
                                   "ready": False, "restartCount": 3, **state}]}


async def _controller(kmock, steps, name: str = NAME):
    """Once the Deployment exists, apply each step: a Deployment status (dict) or a Pod (created)."""
    while not _present(kmock, "Deployment", name):
        await asyncio.sleep(0.02)
    for step in steps:
        if step.get("kind") == "Pod":
            kmock.objects[_key("Pod", step["metadata"]["name"])] = step
        else:
            kmock.objects[_key("Deployment", name)].patch({"status": step})
        seen = len(kmock[action.FETCH, kmock.resource("apps/v1/deployments")])
        while len(kmock[action.FETCH, kmock.resource("apps/v1/deployments")]) < seen + 2:
            await asyncio.sleep(0.02)



async def _deploy(kmock, steps=(), *overrides: str, judge_steps=()):
    """deploy_to_kubernetes in a thread while the controller plays ``steps``: its URL or what it raised, and the
    lines it logged."""
    lines: list[str] = []
    config = load_config(TINY_CONFIG, ["reward_deploy.ready_timeout_s=15", *overrides])
    tasks = [asyncio.create_task(_controller(kmock, steps))]
    if judge_steps:
        tasks.append(asyncio.create_task(_controller(kmock, judge_steps, judge_name(NAME))))
    try:
        result = await asyncio.to_thread(outcome, lambda: deploy_to_kubernetes(
            config, name=NAME, namespace=NS, run_id=RUN_ID, log=lines.append, host=str(kmock.url), poll_s=POLL_S))
    finally:
        for task in tasks:
            task.cancel()
    return result, lines


async def _teardown(kmock):
    lines: list[str] = []
    await asyncio.to_thread(teardown_kubernetes, NAME, NS, lines.append, str(kmock.url))
    return lines


async def test_success_creates_the_objects_reports_progress_and_returns_the_url(cluster):
    url, lines = await _deploy(cluster, [{"replicas": 1, "updatedReplicas": 1}, READY])
    assert url == service_url(NAME, NS, 8600) == f"http://{NAME}.{NS}.svc.cluster.local:8600", (url, lines)
    assert all(_present(cluster, kind) for kind in ("ConfigMap", "Deployment", "Service", "NetworkPolicy"))
    stored = cluster.objects[_key("ConfigMap")]
    assert yaml.safe_load(stored["data"]["rewards.yaml"])["rewards"][0]["name"] == "brightness"
    assert stored["metadata"]["annotations"][kube.MANIFEST_HASH]
    assert [line for line in lines if line.endswith("created")] == [
        f"ConfigMap {NS}/{NAME} created", f"Deployment {NS}/{NAME} created", f"Service {NS}/{NAME} created",
        f"NetworkPolicy {NS}/{NAME} created"]
    assert any("0/1 ready; pods: none yet after" in line for line in lines)
    assert any(line.startswith(f"Deployment {NS}/{NAME} ready (1/1 ready) after") for line in lines)
    assert lines[-1] == f"reward server {NAME} ready at {url}"


def _failing(reason: str) -> dict:
    name = f"{NAME}-6d5f7c9b8-{reason.lower()[:5]}"
    statuses = {
        "ImagePullBackOff": _container(state={"waiting": {
            "reason": "ImagePullBackOff",
            "message": 'Back-off pulling image "ghcr.io/flowgrpo/flowgrpo-reward-server:0.1.0"'}}),
        "CrashLoopBackOff": _container(
            state={"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s restarting failed container"}},
            lastState={"terminated": {"reason": "Error", "exitCode": 2}}),
        "Unschedulable": {"phase": "Pending", "conditions": [{
            "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
            "message": "0/3 nodes are available: 3 Insufficient cpu."}]},
        "OOMKilled": _container(state={"running": {"startedAt": "2025-01-01T00:00:00Z"}},
                                lastState={"terminated": {"reason": "OOMKilled", "exitCode": 137}}),
    }
    return _pod(name, statuses[reason])


@pytest.mark.parametrize(("reason", "hints"), [
    ("ImagePullBackOff", ["ghcr.io/flowgrpo/flowgrpo-reward-server:0.1.0", "reward_deploy.image"]),
    ("CrashLoopBackOff", ["exit code 2", f"kubectl logs -n {NS}", "--previous"]),
    ("Unschedulable", ["3 Insufficient cpu", "reward_deploy.cpu"]),
    ("OOMKilled", ["exit code 137", "memory limit 3Gi", "reward_deploy.memory"]),
])
async def test_a_failing_pod_is_reported_by_name_and_reason(cluster, reason, hints):
    pod = _failing(reason)
    error, lines = await _deploy(cluster, [{"replicas": 1, "updatedReplicas": 1}, pod])
    assert isinstance(error, kube.DeploymentFailed), (error, lines)
    message = str(error)
    assert f"pod {pod['metadata']['name']} {reason}" in message
    assert (error.pod, error.reason) == (pod["metadata"]["name"], reason)
    for hint in hints:
        assert hint in message, message


async def test_unschedulable_within_the_grace_period_waits_and_the_timeout_says_what_it_saw(cluster):
    pod = _failing("Unschedulable")
    error, lines = await _deploy(cluster, [pod], "reward_deploy.ready_timeout_s=1",
                                 "reward_deploy.unschedulable_grace_s=60")
    assert isinstance(error, LaunchError) and not isinstance(error, kube.DeploymentFailed), error
    message = str(error)
    assert message.startswith(f"Deployment {NS}/{NAME} not ready after 0m01s")
    assert f"last seen: 0/1 ready; pods: {pod['metadata']['name']} Pending (Unschedulable)" in message
    assert "kubectl describe deployment" in message
    assert any(line.endswith("Pending (Unschedulable) after 0m00s") for line in lines), lines  # progress lines


async def test_a_pod_that_never_gets_ready_times_out(cluster):
    pod = _pod(f"{NAME}-6d5f7c9b8-abcde", _container(state={"running": {"startedAt": "2025-01-01T00:00:00Z"}}))
    error, lines = await _deploy(cluster, [{"replicas": 1, "updatedReplicas": 1}, pod],
                                 "reward_deploy.ready_timeout_s=1")
    assert isinstance(error, LaunchError) and "not ready after" in str(error), error
    assert f"{pod['metadata']['name']} Running (not ready)" in str(error)
    assert any(f"0/1 ready; pods: {pod['metadata']['name']} Running (not ready)" in line for line in lines), lines
    assert _present(cluster, "Deployment")  # kept for inspection until the teardown


async def test_teardown_deletes_everything_and_a_second_teardown_is_a_no_op(cluster):
    url, _ = await _deploy(cluster, [READY])
    assert url.startswith("http://"), url
    lines = await _teardown(cluster)
    assert not any(_present(cluster, kind) for kind in ("ConfigMap", "Deployment", "Service", "NetworkPolicy"))
    assert lines[-1] == f"reward server {NS}/{NAME}: removed"
    deletes = cluster[action.DELETE]
    assert {r.params.get("propagationPolicy") for r in deletes} == {"Foreground"}
    again = await _teardown(cluster)
    assert again == [f"reward server {NS}/{NAME}: nothing left to remove"]


async def test_redeploying_the_same_run_keeps_the_objects(cluster):
    first, _ = await _deploy(cluster, [READY])
    versions = {kind: len(cluster.objects[_key(kind)].history) for kind in ("ConfigMap", "Deployment", "Service")}
    second, lines = await _deploy(cluster)
    assert first == second, (first, second, lines)
    assert sum("already exists with this manifest (deployed before): kept" in line for line in lines) == 4
    assert {kind: len(cluster.objects[_key(kind)].history) for kind in versions} == versions
    assert len(cluster[action.UPDATE]) == 0


async def test_redeploying_with_another_config_replaces_the_objects(cluster):
    await _deploy(cluster, [READY])
    before = copy.deepcopy(cluster.objects[_key("Deployment")].raw)
    two = {k: 2 for k in READY}
    url, lines = await _deploy(cluster, [two], "rewards.0.weight=3", "reward_deploy.replicas=2")
    assert url == service_url(NAME, NS, 8600), (url, lines)
    assert [line.split(" ", 1)[0] for line in lines if "existed with another manifest: replaced" in line] == [
        "ConfigMap", "Deployment"]
    assert f"Service {NS}/{NAME} already exists with this manifest (deployed before): kept" in lines
    stored = cluster.objects[_key("Deployment")]
    assert stored["spec"]["replicas"] == 2
    assert stored["spec"]["template"]["metadata"]["annotations"] != before["spec"]["template"]["metadata"][
        "annotations"]  # the pods roll to read the new settings
    assert yaml.safe_load(cluster.objects[_key("ConfigMap")]["data"]["rewards.yaml"])["rewards"][0]["weight"] == 3


async def test_a_judge_is_deployed_and_waited_for_with_a_vlm_judge_reward(cluster):
    url, lines = await _deploy(cluster, [READY], JUDGE_REWARD, judge_steps=[READY])
    judge = judge_name(NAME)
    assert url == service_url(NAME, NS, 8600), (url, lines)
    assert _present(cluster, "Deployment", judge) and _present(cluster, "Service", judge)
    served = yaml.safe_load(cluster.objects[_key("ConfigMap")]["data"]["rewards.yaml"])["rewards"]
    assert served[0]["args"]["base_url"] == f"http://{judge}.{NS}.svc.cluster.local:8000/v1"
    assert any(line.startswith(f"Deployment {NS}/{judge} ready") for line in lines)
    await _teardown(cluster)
    assert not _present(cluster, "Deployment", judge) and not _present(cluster, "Service", judge)


@pytest.mark.parametrize(("act", "path", "verb"), [
    (action.CREATE, "v1/configmaps", "create configmaps"),
    (action.CREATE, "apps/v1/deployments", "create deployments.apps"),
    (action.LIST, "v1/pods", "list pods"),
])
async def test_rbac_denial_names_verb_resource_and_namespace(cluster, act, path, verb):
    cluster[act, cluster.resource(path)] << KubernetesError(
        status=403, reason="Forbidden",
        message=f'User "system:serviceaccount:{NS}:pipeline-runner" cannot {verb.split()[0]} resource in the '
                f'namespace "{NS}"')
    error, _ = await _deploy(cluster)
    assert isinstance(error, LaunchError), error
    message = str(error)
    assert message.startswith(f"forbidden: cannot {verb} in namespace {NS}"), message
    assert "pipeline-runner" in message and "RoleBinding" in message and "manifests/base/rbac.yaml" in message


async def test_an_unreachable_api_is_one_clear_error():
    config = load_config(TINY_CONFIG)
    error = await asyncio.to_thread(outcome, lambda: deploy_to_kubernetes(
        config, name=NAME, namespace=NS, run_id=RUN_ID, log=lambda _: None, host="http://127.0.0.1:9"))
    assert isinstance(error, LaunchError) and "cannot reach the Kubernetes API at http://127.0.0.1:9" in str(error)
