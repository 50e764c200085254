"""The RayJob launcher against kmock's Kubernetes emulator; the test plays the KubeRay operator.

The synchronous client runs in a thread (kmock serves on the test's event loop); the launcher polls GET
rather than watching (kmock matches `watch=true`, the client sends `watch=True`).
"""

import asyncio
import copy
import sys
import threading
from pathlib import Path

import pytest
from kmock import KubernetesError, action, resource

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: helpers
from kube_emulator import outcome, serve

from components.errors import LaunchError
from components.launch.kubernetes import rayjob_client as kube
from components.launch.kubernetes.rayjob_manifest import build_network_policy, build_rayjob
from pipeline.config import TINY_CONFIG, load_config

pytestmark = pytest.mark.asyncio
RAYJOBS = "ray.io/v1/rayjobs"
NETWORK_POLICIES = "networking.k8s.io/v1/networkpolicies"
NS = "flowgrpo"
# kmock matches every request against all earlier ones (quadratic): keep the number of polls small.
POLL_S = 0.05


@pytest.fixture
def manifest():
    return build_rayjob(load_config(TINY_CONFIG), run_id="kmock-1", output="s3://flowgrpo/runs/kmock-1")


@pytest.fixture
def cluster(kmock):
    """kmock with the RayJob CRD installed (and NetworkPolicies)."""
    return serve(kmock)


def _key(manifest):
    return resource(RAYJOBS), NS, manifest["metadata"]["name"]  # `in kmock.objects` needs a parsed resource


def _policy_key(manifest):
    return resource(NETWORK_POLICIES), NS, manifest["metadata"]["name"]


def _fetches(kmock) -> int:
    return len(kmock[action.FETCH, kmock.resource(RAYJOBS)])


async def _operator(kmock, manifest, states):
    """Set each status once the follower has read the previous one (two reads after a change)."""
    key = _key(manifest)
    while key not in kmock.objects:
        await asyncio.sleep(0.02)
    for status in states:
        kmock.objects[key].patch({"status": status})
        seen = _fetches(kmock)
        while _fetches(kmock) < seen + 2:
            await asyncio.sleep(0.02)


async def _submit(kmock, manifest, states=(), *, log=None, **kwargs):
    """Run submit_rayjob in a thread while the operator plays ``states``; the result or what it raised."""
    lines: list[str] = []

    def call():
        try:
            return kube.submit_rayjob(manifest, api=kube.client_for(str(kmock.url)), poll_s=POLL_S,
                                      log=log or lines.append, **kwargs)
        except BaseException as exc:  # KeyboardInterrupt must not cross the event loop
            return exc

    kwargs.setdefault("timeout_s", 15)  # the thread always ends, even when a test goes wrong
    operator = asyncio.create_task(_operator(kmock, manifest, states))
    try:
        outcome = await asyncio.to_thread(call)
    finally:
        operator.cancel()
    return outcome, lines


async def test_success_is_followed_through_every_state(cluster, manifest):
    states = [{"jobDeploymentStatus": "Initializing"},
              {"jobDeploymentStatus": "Running", "jobStatus": "PENDING"},
              {"jobDeploymentStatus": "Running", "jobStatus": "RUNNING"},
              {"jobDeploymentStatus": "Complete", "jobStatus": "SUCCEEDED", "dashboardURL": "head-svc:8265"}]
    result, lines = await _submit(cluster, manifest, states)
    assert isinstance(result, kube.RayJobResult) and result.succeeded, (result, lines)
    assert (result.deployment_status, result.job_status, result.dashboard_url) == ("Complete", "SUCCEEDED",
                                                                                   "head-svc:8265")
    stored = cluster.objects[_key(manifest)]
    assert stored["spec"] == manifest["spec"] and stored["metadata"]["name"] == "flowgrpo-kmock-1"
    assert len(cluster[action.CREATE, cluster.resource(RAYJOBS)]) == 1
    policy = cluster.objects[_policy_key(manifest)]  # the Ray pods' own, owned by the RayJob
    assert policy["metadata"]["ownerReferences"] == [{"apiVersion": "ray.io/v1", "kind": "RayJob",
                                                      "name": "flowgrpo-kmock-1", "uid": stored["metadata"]["uid"]}]
    assert policy["spec"] == build_network_policy(manifest, "x")["spec"]
    changes = [line.split(": ", 1)[1].split(" after")[0] for line in lines if "(Ray job" in line]
    # "New" (no status yet) shows only when the first poll beats the operator.
    assert [c for c in changes if not c.startswith("New")] == [
        "Initializing (Ray job -)", "Running (Ray job PENDING)", "Running (Ray job RUNNING)",
        "Complete (Ray job SUCCEEDED)"]
    assert "created" in lines[0] and "succeeded" in lines[-1]


async def test_application_failure_names_reason_message_and_where_the_log_is(cluster, manifest):
    states = [{"jobDeploymentStatus": "Running", "jobStatus": "RUNNING"},
              {"jobDeploymentStatus": "Failed", "jobStatus": "FAILED", "reason": "AppFailed",
               "message": "Job entrypoint command failed with exit code 2"}]
    error, _ = await _submit(cluster, manifest, states)
    assert isinstance(error, kube.RayJobFailed), error
    message = str(error)
    assert "AppFailed" in message and "exit code 2" in message
    assert "kubectl logs -n flowgrpo job/flowgrpo-kmock-1" in message
    assert error.result.job_status == "FAILED" and not error.result.succeeded


async def test_deadline_exceeded_points_at_the_deadline_setting(cluster, manifest):
    states = [{"jobDeploymentStatus": "Running", "jobStatus": "RUNNING"},
              {"jobDeploymentStatus": "Failed", "jobStatus": "RUNNING", "reason": "DeadlineExceeded",
               "message": "The RayJob has passed the activeDeadlineSeconds."}]
    error, _ = await _submit(cluster, manifest, states)
    assert isinstance(error, kube.RayJobFailed), error
    assert "DeadlineExceeded" in str(error) and "cluster.active_deadline_seconds" in str(error)


async def test_validation_failed_is_terminal(cluster, manifest):
    states = [{"jobDeploymentStatus": "ValidationFailed", "reason": "ValidationFailed",
               "message": "The RayJob spec is invalid: backoffLimit must be a positive integer"}]
    error, _ = await _submit(cluster, manifest, states)
    assert isinstance(error, kube.RayJobFailed), error
    assert "ValidationFailed" in str(error) and "backoffLimit must be a positive integer" in str(error)


async def test_missing_crd_says_kuberay_is_not_installed_and_creates_nothing(kmock, manifest):
    error, _ = await _submit(kmock, manifest)
    assert isinstance(error, LaunchError), error
    assert "RayJob CRD (ray.io/v1) is not installed" in str(error) and "KubeRay operator" in str(error)
    assert len(kmock[action.CREATE]) == 0


async def test_rbac_denial_names_verb_resource_and_namespace(cluster, manifest):
    cluster[action.CREATE, cluster.resource(RAYJOBS)] << KubernetesError(
        status=403, reason="Forbidden",
        message='rayjobs.ray.io is forbidden: User "system:serviceaccount:flowgrpo:pipeline-runner" cannot create '
                'resource "rayjobs" in API group "ray.io" in the namespace "flowgrpo"')
    error, _ = await _submit(cluster, manifest)
    assert isinstance(error, LaunchError), error
    message = str(error)
    assert message.startswith("forbidden: cannot create rayjobs.ray.io in namespace flowgrpo")
    assert "pipeline-runner" in message and "RoleBinding" in message
    assert _fetches(cluster) == 0  # nothing to follow


async def test_an_existing_rayjob_of_the_same_run_is_followed_not_replaced(cluster, manifest):
    done = copy.deepcopy(manifest) | {"status": {"jobDeploymentStatus": "Complete", "jobStatus": "SUCCEEDED"}}
    done["metadata"]["uid"] = "3f0c-uid-of-the-first-submission"
    cluster.objects[_key(manifest)] = done
    result, lines = await _submit(cluster, manifest)
    assert isinstance(result, kube.RayJobResult) and result.succeeded, result
    assert any("already exists with this config" in line for line in lines)
    assert not cluster.objects[_key(manifest)].deleted
    owner = cluster.objects[_policy_key(manifest)]["metadata"]["ownerReferences"][0]
    assert owner["uid"] == "3f0c-uid-of-the-first-submission"
    again, lines = await _submit(cluster, manifest)  # a third time: the policy too is kept
    assert isinstance(again, kube.RayJobResult), again
    assert f"NetworkPolicy {NS}/flowgrpo-kmock-1 already exists with this manifest (deployed before): kept" in lines
    assert len(cluster[action.UPDATE]) == 0


async def test_without_its_network_policy_the_rayjob_is_deleted(cluster, manifest):
    cluster[action.CREATE, cluster.resource(NETWORK_POLICIES)] << KubernetesError(
        status=403, reason="Forbidden",
        message='networkpolicies.networking.k8s.io is forbidden: User "system:serviceaccount:flowgrpo:pipeline-runner" '
                'cannot create resource "networkpolicies" in API group "networking.k8s.io"')
    error, _ = await _submit(cluster, manifest)
    assert isinstance(error, LaunchError), error
    message = str(error)
    assert message.startswith("forbidden: cannot create networkpolicies.networking.k8s.io in namespace flowgrpo")
    assert "RayJob flowgrpo/flowgrpo-kmock-1 deleted: its Ray pods do not run without their NetworkPolicy" in message
    assert cluster.objects[_key(manifest)].deleted
    assert _fetches(cluster) == 0  # never followed


async def test_an_existing_rayjob_with_another_config_is_refused(cluster, manifest):
    other = copy.deepcopy(manifest)
    other["spec"]["entrypoint"] = other["spec"]["entrypoint"].replace("kmock-1", "elsewhere")
    cluster.objects[_key(manifest)] = other
    error, _ = await _submit(cluster, manifest)
    assert isinstance(error, LaunchError), error
    assert "already exists with another config" in str(error) and "kubectl delete rayjob" in str(error)
    assert cluster.objects[_key(manifest)]["spec"]["entrypoint"] == other["spec"]["entrypoint"]


async def test_stop_while_running_deletes_the_rayjob(cluster, manifest):
    stop = threading.Event()

    def log(line):
        if "Running" in line:
            stop.set()

    error, _ = await _submit(cluster, manifest, [{"jobDeploymentStatus": "Running", "jobStatus": "RUNNING"}],
                             log=log, stop=stop)
    assert isinstance(error, kube.RayJobCancelled), error
    assert "deleted" in str(error)
    assert cluster.objects[_key(manifest)].deleted
    assert len(cluster[action.DELETE]) == 1


async def test_ctrl_c_while_running_deletes_the_rayjob_and_reraises(cluster, manifest):
    lines = []

    def log(line):
        lines.append(line)
        if "(Ray job RUNNING)" in line:
            raise KeyboardInterrupt

    error, _ = await _submit(cluster, manifest, [{"jobDeploymentStatus": "Running", "jobStatus": "RUNNING"}],
                             log=log)
    assert isinstance(error, KeyboardInterrupt), error
    assert cluster.objects[_key(manifest)].deleted
    assert any("interrupted: deleting" in line for line in lines)


async def test_stop_in_suspend_mode_suspends_and_keeps_the_rayjob(cluster, manifest):
    stop = threading.Event()

    def log(line):
        if "Running" in line:
            stop.set()

    error, _ = await _submit(cluster, manifest, [{"jobDeploymentStatus": "Running", "jobStatus": "RUNNING"}],
                             log=log, stop=stop, cancel_mode="suspend")
    assert isinstance(error, kube.RayJobCancelled) and "suspended" in str(error), error
    stored = cluster.objects[_key(manifest)]
    assert not stored.deleted and stored["spec"]["suspend"] is True
    assert stored["spec"]["entrypoint"] == manifest["spec"]["entrypoint"]


async def test_suspend_mode_needs_shutdown_after_job_finishes(cluster, manifest):
    manifest["spec"]["shutdownAfterJobFinishes"] = False
    error, _ = await _submit(cluster, manifest, cancel_mode="suspend")
    assert isinstance(error, LaunchError) and "shutdown_after_job_finishes" in str(error), error
    assert len(cluster[action.CREATE]) == 0


async def test_timeout_leaves_the_rayjob_running_and_says_so(cluster, manifest):
    error, lines = await _submit(cluster, manifest, [{"jobDeploymentStatus": "Initializing"}], timeout_s=1.0,
                                 heartbeat_s=0.05)
    assert isinstance(error, LaunchError), error
    assert "still Initializing" in str(error) and "keeps running" in str(error)
    assert any("still Initializing" in line for line in lines)  # periodic progress while nothing changes
    assert not cluster.objects[_key(manifest)].deleted


async def test_a_rayjob_deleted_by_someone_else_is_reported(cluster, manifest):
    error_task = asyncio.create_task(_submit(cluster, manifest, [{"jobDeploymentStatus": "Running"}]))
    while _key(manifest) not in cluster.objects or _fetches(cluster) < 3:
        await asyncio.sleep(0.02)
    cluster.objects[_key(manifest)].delete()
    error, _ = await error_task
    assert isinstance(error, LaunchError) and "does not exist" in str(error), error


async def test_an_unreachable_api_is_one_clear_error(manifest):
    lines: list[str] = []
    api = kube.client_for("http://127.0.0.1:9")
    error = await asyncio.to_thread(lambda: outcome(lambda: kube.submit_rayjob(manifest, api=api, log=lines.append)))
    assert isinstance(error, LaunchError) and "cannot reach the Kubernetes API at http://127.0.0.1:9" in str(error)

