"""The RayJob's `ray` container runs with a read-only root filesystem: the training run its entrypoint starts (Ray,
torch, MLflow, the S3 output's staging) writes only to the pod's emptyDirs.

No container engine here, so the pod is imitated with Linux namespaces: every mount read-only, fresh tmpfs on /tmp
and /dev/shm (the pod's two emptyDirs), its own PID namespace (Ray's processes end with it), and exactly the
environment the RayJob gives the container (its env, the secrets' values, the runtime env's variables, the image's
PATH), then the RayJob's entrypoint. Real SeaweedFS and MLflow, on 127.0.0.1.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import yaml

from components import storage
from components.launch.kubernetes.rayjob_manifest import build_rayjob
from pipeline.config import TINY_CONFIG, load_config

REPO = Path(__file__).resolve().parents[2]
# Remount every mount read-only (those the namespace may not remount stay as they are: /proc, /sys), then the
# pod's emptyDirs. The checkout (with its venv: the image's contents) may itself lie under /tmp, as a CI clone does;
# it is kept across the pod's fresh /tmp by a read-only bind through /mnt.
POD_FS = """
set -e
for m in $(awk '{print $5}' /proc/self/mountinfo | sort -u); do
    mount -o remount,bind,ro "$m" 2>/dev/null || :
done
case "$REPO_ROOT" in /tmp/*)
    mount -t tmpfs tmpfs /mnt && mkdir /mnt/repo && mount --bind "$REPO_ROOT" /mnt/repo ;;
esac
mount -t tmpfs -o size=4g tmpfs /tmp
case "$REPO_ROOT" in /tmp/*)
    mkdir -p "$REPO_ROOT" && mount --bind /mnt/repo "$REPO_ROOT" && mount -o remount,bind,ro "$REPO_ROOT" ;;
esac
mount -t tmpfs tmpfs /dev/shm
if touch "$REPO_ROOT/.rw-probe" 2>/dev/null; then echo "the root filesystem is writable" >&2; exit 90; fi
exec "$@"
"""
SMALL = ["sampling.prompts_per_epoch=2", "sampling.group_size=4", "sampling.batch_size_per_worker=4",
         "train.batch_size_per_worker=4", "sampling.num_steps=4", "train.epochs=1", "tracking.system_metrics=false",
         "tracking.registered_model=null"]


def _pod_env(container: dict, secrets: dict[str, str], runtime_env: dict[str, str]) -> dict[str, str]:
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",  # the image's: its venv first
           "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1", "REPO_ROOT": str(REPO)}
    for var in container["env"]:
        if "value" in var:
            env[var["name"]] = var["value"]
        elif var["valueFrom"]["secretKeyRef"]["key"] in secrets:
            env[var["name"]] = secrets[var["valueFrom"]["secretKeyRef"]["key"]]
    return env | runtime_env


@pytest.mark.slow
def test_the_rayjob_entrypoint_trains_on_ray_with_a_read_only_root(env, seaweed):
    if shutil.which("unshare") is None or subprocess.run(
            ["unshare", "-rm", "true"], capture_output=True).returncode != 0:
        pytest.fail("this test needs `unshare` and user namespaces (util-linux; kernel.unprivileged_userns_clone=1)")
    output = f"s3://{seaweed.bucket}/read-only-{uuid.uuid4().hex[:8]}"
    manifest = build_rayjob(load_config(TINY_CONFIG, SMALL), run_id="read-only", output=output)
    (container,) = manifest["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"]
    runtime_env = yaml.safe_load(manifest["spec"]["runtimeEnvYAML"])["env_vars"]
    pod_env = _pod_env(container, env, runtime_env)
    assert pod_env["HOME"] == "/tmp"
    # timeout: a hang guard (~50 s alone on 2 cores, x4 beside two busy CI workers)
    proc = subprocess.run(["unshare", "-rm", "--fork", "--pid", "--mount-proc", "--propagation", "private",
                           "sh", "-c", POD_FS, "pod-fs", *shlex.split(manifest["spec"]["entrypoint"])],
                          cwd=REPO, env=pod_env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert storage.list_uris(f"{output}/lora"), proc.stderr[-3000:]
    assert not os.path.exists(REPO / ".rw-probe")
