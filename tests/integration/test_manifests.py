"""The cluster deployment (manifests/, images/) as a cluster and a registry would see it, offline.

Every kustomization is rendered with the real ``kubectl kustomize``; built-in objects are validated with
``kubernetes-validate --strict`` (the schemas ship in the wheel), RayJobs against the KubeRay v1.7.0 CRD;
Dockerfiles are linted with hadolint, shell scripts with shellcheck. The invariants (non-root, resources,
placeholder-only Secrets, namespaced RBAC, ClusterIP only, pinned images, the RayJob templates equal to what
the launcher prints) are checked on the rendered objects, i.e. on what ``kubectl apply -k`` would send.
"""

from __future__ import annotations

import base64
import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: helpers
import rayjob_schema
from k8s_manifests import (
    DOCKERFILE,
    IMAGES,
    MANIFESTS,
    REPO,
    admits,
    containers,
    dockerfile_instructions,
    dockerfile_stages,
    kustomize,
    pod_specs,
    pod_templates,
    quantity,
    selector_matches,
    target_instructions,
    target_user,
    tool,
)
from lockfiles import image_requirements

from components.launch.kubernetes.podspec import MLFLOW_SECRET_KEYS, S3_SECRET_KEYS
from components.launch.kubernetes.types import check_image

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
VERSION = PYPROJECT["project"]["version"]
# The oldest and the newest Kubernetes minor supported upstream when kubernetes-validate 1.37 was current.
KUBERNETES_VERSIONS = ("1.35.0", "1.37.0")
KUSTOMIZATIONS = ("base", "secrets", "overlays/dev", "overlays/gpu", "overlays/dev/rayjob", "overlays/gpu/rayjob")
COMPONENTS = ("components/judge-from-s3",)
JUDGE_FROM_S3 = "overlays/gpu+components/judge-from-s3"
OVERLAYS = ("overlays/dev", "overlays/gpu")
TEMPLATE_CONFIGS = {"overlays/dev/rayjob": "pipeline/configs/tiny-cpu.yaml",
                    "overlays/gpu/rayjob": "pipeline/configs/sd35-medium-ocr.yaml"}
PLACEHOLDER = "REPLACE_ME"
OUR_IMAGE = re.compile(r"^ghcr\.io/flowgrpo/flowgrpo-(?P<target>[a-z0-9-]+):(?P<tag>[^@]+)$")
TARGETS = ("trainer", "reward-server", "components", "vllm-judge", "mlflow")


def _copy_from(args: str) -> str | None:
    """The stage of ``COPY --from=STAGE ...``; None for a COPY from the build context."""
    match = re.match(r"--from=(\S+)\s", args)
    return match.group(1) if match else None


@pytest.fixture(scope="module")
def renders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """Every kustomization rendered, plus the gpu overlay with the judge-from-s3 component."""
    out = {name: kustomize(MANIFESTS / name) for name in KUSTOMIZATIONS}
    wrapper = tmp_path_factory.mktemp("judge-from-s3")
    rel = lambda p: os.path.relpath(MANIFESTS / p, wrapper)  # noqa: E731  kustomize refuses absolute paths
    (wrapper / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [rel("overlays/gpu")], "components": [rel("components/judge-from-s3")]}))
    out[JUDGE_FROM_S3] = kustomize(wrapper)
    return out


def _all(renders: dict[str, list[dict[str, Any]]]) -> list[tuple[str, dict[str, Any]]]:
    return [(name, obj) for name, objs in renders.items() for obj in objs]


def _one(objs: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    (found,) = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def _container(deployment: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return found


def _run(args: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=300, **kwargs)


# --- rendering and schema validation ------------------------------------------------------------------------------

def test_every_kustomization_is_rendered_by_these_tests():
    found = {str(p.parent.relative_to(MANIFESTS)): yaml.safe_load(p.read_text())["kind"]
             for p in MANIFESTS.rglob("kustomization.yaml")}
    assert {k for k, kind in found.items() if kind == "Kustomization"} == set(KUSTOMIZATIONS)
    assert {k for k, kind in found.items() if kind == "Component"} == set(COMPONENTS)


def test_renders_hold_the_expected_objects(renders):
    def names(key: str) -> set[str]:
        return {f"{o['kind']}/{o['metadata']['name']}" for o in renders[key]}

    services = {"Deployment/flowgrpo-reward-server", "Service/flowgrpo-reward-server",
                "NetworkPolicy/flowgrpo-reward-server", "PodDisruptionBudget/flowgrpo-reward-server",
                "Deployment/flowgrpo-mlflow", "Service/flowgrpo-mlflow", "NetworkPolicy/flowgrpo-mlflow",
                "ServiceAccount/flowgrpo-pipeline-runner", "Role/flowgrpo-pipeline-runner",
                "RoleBinding/flowgrpo-pipeline-runner"}
    judge = {"Deployment/flowgrpo-vllm-judge", "Service/flowgrpo-vllm-judge", "NetworkPolicy/flowgrpo-vllm-judge"}
    assert services | judge <= names("overlays/gpu")
    assert services <= names("overlays/dev") and not judge & names("overlays/dev")  # no GPU in dev
    assert names("secrets") == {"Secret/flowgrpo-s3", "Secret/flowgrpo-mlflow", "Secret/flowgrpo-mlflow-server"}
    for key in TEMPLATE_CONFIGS:
        assert [o["kind"] for o in renders[key]] == ["RayJob"]
    for key in (*OVERLAYS, "secrets", *TEMPLATE_CONFIGS, JUDGE_FROM_S3):
        assert {o["metadata"].get("namespace") for o in renders[key]} == {"flowgrpo"}, key


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_builtin_objects_pass_strict_schema_validation(renders, version):
    problems, checked = [], 0
    for name, obj in _all(renders):
        if obj["apiVersion"].startswith("ray.io/"):
            continue
        try:
            kubernetes_validate.validate(obj, version, strict=True)
            checked += 1
        except kubernetes_validate.ValidationError as exc:
            path = ".".join(str(p) for p in exc.absolute_path)
            problems.append(f"{name}: {obj['kind']}/{obj['metadata']['name']} {path}: {exc.message}")
        except kubernetes_validate.SchemaNotFoundError as exc:
            problems.append(f"{name}: {exc.message}")
    assert problems == []
    assert checked > 30


def test_strict_validation_rejects_a_misspelt_field(renders):
    deployment = json.loads(json.dumps(_one(renders["overlays/gpu"], "Deployment", "flowgrpo-reward-server")))
    deployment["spec"]["template"]["spec"]["containers"][0]["resource"] = {}  # "resources" misspelt
    with pytest.raises(kubernetes_validate.ValidationError, match="resource"):
        kubernetes_validate.validate(deployment, KUBERNETES_VERSIONS[-1], strict=True)


def test_ray_objects_validate_against_the_kuberay_crd(renders):
    ray = [(name, obj) for name, obj in _all(renders) if obj["apiVersion"].startswith("ray.io/")]
    assert {obj["kind"] for _, obj in ray} == {"RayJob"}  # only RayJob has its CRD in tests/schemas
    for name, obj in ray:
        assert rayjob_schema.errors(obj) == [], name


# --- one source of truth: the RayJob templates are the launcher's output ------------------------------------------

def _header_command(template: Path) -> list[str]:
    lines = template.read_text().splitlines()
    assert lines[0].startswith("# GENERATED by scripts/render-rayjob-templates.sh"), template
    command = shlex.split(lines[1].removeprefix("#"))
    assert command[:2] == ["flowgrpo", "rayjob"], lines[1]
    return command


@pytest.mark.parametrize("key", sorted(TEMPLATE_CONFIGS))
def test_rayjob_template_is_what_the_launcher_prints(renders, key):
    """What is compared: (1) the committed rayjob.yaml after its 3 comment lines, byte for byte, with the stdout of
    the `flowgrpo rayjob` command its header names, run now; (2) the RayJob `kubectl kustomize` renders from the
    overlay's rayjob/ kustomization, as a parsed object, with that stdout parsed: equal, so kustomize alters
    nothing (no namespace, label, image or name change)."""
    template = MANIFESTS / key / "rayjob.yaml"
    command = _header_command(template)
    assert command[command.index("--config") + 1] == TEMPLATE_CONFIGS[key]
    proc = _run([sys.executable, "-m", "pipeline.cli", *command[1:]], cwd=REPO,
                env=os.environ | {"KUBECONFIG": "/nonexistent"})
    assert proc.returncode == 0, proc.stderr
    body = "".join(template.read_text().splitlines(keepends=True)[3:])
    assert body == proc.stdout, f"{template.relative_to(REPO)} is stale: run scripts/render-rayjob-templates.sh"
    (rendered,) = renders[key]
    assert rendered == yaml.safe_load(proc.stdout)


def test_render_script_check_passes_on_the_committed_templates_and_catches_drift(tmp_path):
    script = REPO / "scripts" / "render-rayjob-templates.sh"
    env = os.environ | {"PYTHON": sys.executable, "MANIFESTS": str(tmp_path)}
    for key in TEMPLATE_CONFIGS:
        (tmp_path / key).mkdir(parents=True)
        shutil.copy(MANIFESTS / key / "rayjob.yaml", tmp_path / key / "rayjob.yaml")
    assert _run(["bash", str(script), "--check"], env=env).returncode == 0
    stale = tmp_path / "overlays/gpu/rayjob/rayjob.yaml"
    stale.write_text(stale.read_text().replace("--ray-workers 8", "--ray-workers 4"))
    proc = _run(["bash", str(script), "--check"], env=env)
    assert proc.returncode == 1
    assert "overlays/gpu/rayjob/rayjob.yaml differs" in proc.stderr and "overlays/dev" not in proc.stderr
    assert _run(["bash", str(script)], env=env).returncode == 0  # regenerate
    assert stale.read_text() == (MANIFESTS / "overlays/gpu/rayjob/rayjob.yaml").read_text()


# --- secrets ------------------------------------------------------------------------------------------------------

def test_secret_templates_hold_placeholders_only(renders):
    secrets = {s["metadata"]["name"]: s for s in renders["secrets"]}
    assert set(secrets["flowgrpo-s3"]["data"]) == set(S3_SECRET_KEYS)  # what the launcher's pods reference
    assert set(secrets["flowgrpo-mlflow"]["data"]) == set(MLFLOW_SECRET_KEYS)
    assert set(secrets["flowgrpo-mlflow-server"]["data"]) == {"MLFLOW_BACKEND_STORE_URI"}
    for name, secret in secrets.items():
        assert "stringData" not in secret
        for key, value in secret["data"].items():
            assert base64.b64decode(value).decode() == PLACEHOLDER, f"Secret {name} key {key} holds a real value"


def test_no_secret_is_applied_with_an_overlay(renders):
    for name, obj in _all(renders):
        if name != "secrets":
            assert obj["kind"] != "Secret", f"{name} renders Secret {obj['metadata']['name']}"


def test_every_secret_reference_names_a_templated_key(renders):
    templated = {(s["metadata"]["name"], key) for s in renders["secrets"] for key in s["data"]}
    refs = []
    for name, obj in _all(renders):
        for where, spec in pod_specs(obj):
            for c in containers(spec):
                for env in c.get("env") or []:
                    if ref := (env.get("valueFrom") or {}).get("secretKeyRef"):
                        refs.append((f"{name} {where} {c['name']} {env['name']}", (ref["name"], ref["key"])))
                assert not c.get("envFrom"), f"{name} {where}: envFrom would hide which keys a container reads"
            assert not [v for v in spec.get("volumes") or [] if "secret" in v], f"{name} {where} mounts a Secret"
    assert len(refs) > 20
    assert [(where, ref) for where, ref in refs if ref not in templated] == []


CREDENTIAL_NAME = re.compile(r"SECRET|PASSWORD|TOKEN|ACCESS_KEY|BACKEND_STORE_URI|API_KEY", re.IGNORECASE)
AWS_KEY_ID = re.compile(r"\b(AKIA|ASIA)[0-9A-Z]{16}\b")
URL_USERINFO = re.compile(r"[a-z][a-z0-9+.-]*://([^/@\s:]+):([^/@\s]+)@", re.IGNORECASE)


def test_no_credential_is_written_in_plain_text(renders):
    for name, obj in _all(renders):
        for where, spec in pod_specs(obj):
            for c in containers(spec):
                for env in c.get("env") or []:
                    if CREDENTIAL_NAME.search(env["name"]):
                        assert "value" not in env, f"{name} {where}: {env['name']} must come from a Secret"
    files = [p for p in [*MANIFESTS.rglob("*"), *IMAGES.rglob("*")] if p.is_file()]
    assert len(files) > 20
    for path in files:
        text = path.read_text()
        assert not AWS_KEY_ID.search(text), path
        assert "PRIVATE KEY-----" not in text, path
        for user, password in URL_USERINFO.findall(text):
            assert password.isupper() and password.isalpha(), f"{path}: a URL with a password ({user}:...)"


# --- RBAC ---------------------------------------------------------------------------------------------------------

def test_rbac_is_a_role_in_the_namespace_with_the_base_rules(renders):
    """What the rules grant is checked against the launcher's calls in test_launcher_rbac.py; the overlays keep
    them as they are."""
    for name, obj in _all(renders):
        assert obj["kind"] not in ("ClusterRole", "ClusterRoleBinding", "Namespace"), name
    base = _one(renders["base"], "Role", "flowgrpo-pipeline-runner")
    for key in OVERLAYS:
        objs = renders[key]
        assert _one(objs, "Role", "flowgrpo-pipeline-runner")["rules"] == base["rules"], key
        binding = _one(objs, "RoleBinding", "flowgrpo-pipeline-runner")
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                      "name": "flowgrpo-pipeline-runner"}
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "flowgrpo-pipeline-runner",
                                        "namespace": "flowgrpo"}]
        _one(objs, "ServiceAccount", "flowgrpo-pipeline-runner")


def test_an_overlay_namespace_moves_every_object_and_the_binding(tmp_path):
    """An overlay of the base in another namespace (how manifests/README.md says to move it) moves the
    RoleBinding's subject too: the base names it in "default", which kustomize rewrites."""
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "namespace": "team-x",
        "resources": [os.path.relpath(MANIFESTS / "base", tmp_path)]}))
    objs = kustomize(tmp_path)
    assert {o["metadata"]["namespace"] for o in objs} == {"team-x"}
    assert _one(objs, "RoleBinding", "flowgrpo-pipeline-runner")["subjects"][0]["namespace"] == "team-x"


# --- pods: non-root, resources, exposure --------------------------------------------------------------------------

def _target_for(image: str) -> str | None:
    match = OUR_IMAGE.match(image)
    return match["target"] if match else None


def test_no_container_runs_as_root(renders):
    checked = 0
    for name, obj in _all(renders):
        for where, spec in pod_specs(obj):
            pod_ctx = spec.get("securityContext") or {}
            assert not spec.get("hostNetwork") and not spec.get("hostPID") and not spec.get("hostIPC"), where
            for c in containers(spec):
                ctx = {**pod_ctx, **(c.get("securityContext") or {})}
                label = f"{name} {where} container {c['name']}"
                assert ctx.get("runAsNonRoot") is True, label
                assert isinstance(ctx.get("runAsUser"), int) and ctx["runAsUser"] > 0, label
                assert ctx.get("allowPrivilegeEscalation") is False, label
                assert not ctx.get("privileged"), label
                assert "ALL" in ((c.get("securityContext") or {}).get("capabilities") or {}).get("drop", []), label
                # the UID the pod runs as owns the image's home and files: it is the image's own USER
                target = _target_for(c["image"])
                assert target in TARGETS and target in dockerfile_stages(), f"{label}: {c['image']} is not built here"
                assert target_user(target)[0] == ctx["runAsUser"], f"{label}: UID differs from target {target}"
                checked += 1
    assert checked >= 15


@pytest.mark.parametrize("target", TARGETS)
def test_dockerfile_runs_as_a_numeric_non_root_user(target):
    uid, gid = target_user(target)
    assert uid > 0 and gid > 0
    stage = target_instructions(target)
    last_user = max(i for i, (_, ins, _) in enumerate(stage) if ins == "USER")
    # nothing after USER switches back or runs as root
    assert all(ins in ("ENV", "EXPOSE", "HEALTHCHECK", "ENTRYPOINT", "CMD", "WORKDIR", "LABEL", "ARG")
               for _, ins, _ in stage[last_user + 1:])


def test_services_and_ray_pods_run_read_only_without_an_api_token(renders):
    pods = [(f"{name} {where}", spec) for name, obj in _all(renders) if obj["kind"] in ("Deployment", "RayJob")
            for where, spec in pod_specs(obj)]
    assert len(pods) >= 10
    for label, spec in pods:
        assert spec.get("automountServiceAccountToken") is False, label  # none of them calls the Kubernetes API
        volumes = {v["name"]: v for v in spec.get("volumes") or []}
        for c in containers(spec):
            assert c["securityContext"].get("readOnlyRootFilesystem") is True, f"{label} {c['name']}"
            tmp = [m for m in c.get("volumeMounts") or [] if m["mountPath"] == "/tmp"]
            assert tmp and "emptyDir" in volumes[tmp[0]["name"]], f"{label} {c['name']}: no writable /tmp"


def test_every_container_has_requests_and_limits(renders):
    for name, obj in _all(renders):
        for where, spec in pod_specs(obj):
            for c in containers(spec):
                label = f"{name} {where} container {c['name']}"
                requests = (c.get("resources") or {}).get("requests") or {}
                limits = (c.get("resources") or {}).get("limits") or {}
                for resource in ("cpu", "memory"):
                    assert resource in requests and resource in limits, f"{label}: no {resource} request+limit"
                    assert quantity(requests[resource]) <= quantity(limits[resource]), f"{label} {resource}"
                # memory request = limit: pods are not OOM-killed for using what they asked for
                assert quantity(requests["memory"]) == quantity(limits["memory"]), label
                if "nvidia.com/gpu" in limits or "nvidia.com/gpu" in requests:
                    assert requests.get("nvidia.com/gpu") == limits.get("nvidia.com/gpu"), label


def test_nothing_is_exposed_outside_the_cluster(renders):
    for name, obj in _all(renders):
        assert obj["kind"] not in ("Ingress", "IngressClass", "Gateway", "HTTPRoute", "Route"), name
        if obj["kind"] == "Service":
            assert obj["spec"].get("type") == "ClusterIP", f"{name} Service/{obj['metadata']['name']}"
            assert not obj["spec"].get("externalIPs") and "nodePort" not in json.dumps(obj["spec"])
        for where, spec in pod_specs(obj):
            for c in containers(spec):
                assert all("hostPort" not in p for p in c.get("ports") or []), f"{name} {where}"


def test_services_select_their_deployment_and_name_its_ports(renders):
    for key in OVERLAYS:
        deployments = [o for o in renders[key] if o["kind"] == "Deployment"]
        for svc in (o for o in renders[key] if o["kind"] == "Service"):
            selected = [d for d in deployments
                        if selector_matches({"matchLabels": svc["spec"]["selector"]},
                                            d["spec"]["template"]["metadata"]["labels"])]
            assert [d["metadata"]["name"] for d in selected] == [svc["metadata"]["name"]], key
            ports = {p["name"] for c in selected[0]["spec"]["template"]["spec"]["containers"]
                     for p in c.get("ports") or []}
            assert {p["targetPort"] for p in svc["spec"]["ports"]} <= ports
        for d in deployments:
            assert selector_matches(d["spec"]["selector"], d["spec"]["template"]["metadata"]["labels"])


def test_every_deployment_has_a_network_policy(renders):
    for key in OVERLAYS:
        policies = [o for o in renders[key] if o["kind"] == "NetworkPolicy"]
        for d in (o for o in renders[key] if o["kind"] == "Deployment"):
            labels = d["spec"]["template"]["metadata"]["labels"]
            assert [p for p in policies if selector_matches(p["spec"]["podSelector"], labels)
                    and "Ingress" in p["spec"]["policyTypes"]], f"{key}: {d['metadata']['name']} is open"


def test_the_services_policies_admit_pods_of_their_own_namespace_only(renders):
    policies = [o for o in renders["overlays/gpu"] if o["kind"] == "NetworkPolicy"]
    assert len(policies) == 3
    for policy in policies:
        for rule in policy["spec"]["ingress"]:
            assert rule["from"] and all(set(peer) == {"podSelector"} for peer in rule["from"]), policy


def test_reward_server_admits_only_the_trainer_and_the_evaluation(renders):
    policy = _one(renders["overlays/gpu"], "NetworkPolicy", "flowgrpo-reward-server")
    trainer_pods = [labels for _, labels in pod_templates(renders["overlays/gpu/rayjob"][0])]
    assert len(trainer_pods) == 2  # head and workers, labelled by the launcher
    for labels in trainer_pods:
        assert admits(policy, labels, 8600)
        assert not admits(policy, labels, 8000)  # the port, not the pod
    assert admits(policy, {"app.kubernetes.io/component": "evaluate"}, 8600)
    for other in ({}, {"app.kubernetes.io/component": "mlflow"}, {"app.kubernetes.io/component": "vllm-judge"},
                  {"app.kubernetes.io/name": "flowgrpo"}, {"app": "trainer"}):
        assert not admits(policy, other, 8600), other
    judge = _one(renders["overlays/gpu"], "NetworkPolicy", "flowgrpo-vllm-judge")
    reward_pods = _one(renders["overlays/gpu"], "Deployment", "flowgrpo-reward-server")
    assert admits(judge, reward_pods["spec"]["template"]["metadata"]["labels"], 8000)
    assert not admits(judge, {"app.kubernetes.io/component": "mlflow"}, 8000)


def test_ray_pods_keep_home_and_the_ray_session_on_empty_dirs(renders):
    """The read-only root of the Ray containers: Ray's session directory (/tmp/ray) and every cache under $HOME on
    the /tmp emptyDir, the object store on a memory-backed /dev/shm."""
    for key in TEMPLATE_CONFIGS:
        for where, spec in pod_specs(renders[key][0]):
            volumes = {v["name"]: v for v in spec["volumes"]}
            (ray,) = spec["containers"]
            mounts = {m["mountPath"]: volumes[m["name"]] for m in ray["volumeMounts"]}
            assert set(mounts) == {"/tmp", "/dev/shm"}, where
            assert mounts["/tmp"]["emptyDir"] == {}, where
            shm = mounts["/dev/shm"]["emptyDir"]
            assert shm["medium"] == "Memory" and set(shm) == {"medium", "sizeLimit"}, where  # sized: shm_size
            assert {e["name"]: e.get("value") for e in ray["env"]}["HOME"] == "/tmp", where


COMPILED_PIPELINE = REPO / "pipeline" / "flowgrpo_pipeline.yaml"


def _pipeline_step_labels() -> dict[str, dict[str, str]]:
    """The labels of each step's pod in the compiled pipeline (kfp-kubernetes podMetadata), by executor."""
    spec, platform = yaml.safe_load_all(COMPILED_PIPELINE.read_text())
    executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    return {name: ((executors.get(name) or {}).get("podMetadata") or {}).get("labels") or {}
            for name in spec["deploymentSpec"]["executors"]}


def test_mlflow_admits_exactly_the_pods_that_log(renders):
    """Every pod the project runs, as it is labelled: the RayJob's head and workers and the pipeline's steps log;
    KubeRay's submitter pod, the services (MLflow itself included) and a run's reward server and judge do not."""
    from components.launch.kubernetes.rayjob_manifest import SUBMITTER_CRD_LABEL, SUBMITTER_NAME_LABEL
    from components.launch.kubernetes.reward_deploy import build_reward_server_objects
    from pipeline.config import TINY_CONFIG, load_config

    logging, silent = {}, {"a pod without labels": {}, "another app": {"app.kubernetes.io/name": "other"}}
    for key in TEMPLATE_CONFIGS:
        rayjob = renders[key][0]
        logging |= {f"{key} {group}": labels for group, labels in pod_templates(rayjob)}
        name = rayjob["metadata"]["name"]  # KubeRay's labels and the Job controller's
        silent[f"{key} submitter"] = {SUBMITTER_CRD_LABEL: "RayJob", SUBMITTER_NAME_LABEL: name,
                                      "app.kubernetes.io/created-by": "kuberay-operator",
                                      "batch.kubernetes.io/job-name": name, "job-name": name}
    logging |= {f"pipeline step {step}": labels for step, labels in _pipeline_step_labels().items()}
    assert len(logging) == 4 + 6
    run = build_reward_server_objects(
        load_config(TINY_CONFIG, ["rewards=[{name: vlm_judge, args: {base_url: 'http://j:8000/v1', model: j}}]"]),
        name="flowgrpo-rs-run-1", namespace="flowgrpo", run_id="run-1")
    for key, objs in [*((key, renders[key]) for key in OVERLAYS), ("a run's", run)]:
        silent |= {f"{key} {obj['metadata']['name']}": obj["spec"]["template"]["metadata"]["labels"]
                   for obj in objs if obj["kind"] == "Deployment"}
    assert {"a run's flowgrpo-rs-run-1", "a run's flowgrpo-rs-run-1-judge", "overlays/gpu flowgrpo-mlflow",
            "overlays/gpu flowgrpo-vllm-judge", "overlays/dev flowgrpo-reward-server"} <= set(silent)
    for key in OVERLAYS:
        policy = _one(renders[key], "NetworkPolicy", "flowgrpo-mlflow")
        server = _one(renders[key], "Deployment", "flowgrpo-mlflow")
        assert selector_matches(policy["spec"]["podSelector"], server["spec"]["template"]["metadata"]["labels"])
        admitted = {who for who, labels in {**logging, **silent}.items() if admits(policy, labels, 5000)}
        assert admitted == set(logging), key
        assert not [who for who, labels in logging.items() if admits(policy, labels, 8265)]  # the port, not the pod


# --- the services themselves --------------------------------------------------------------------------------------

def _reward_settings(renders, key: str) -> tuple[dict[str, Any], Path]:
    deployment = _one(renders[key], "Deployment", "flowgrpo-reward-server")
    (volume,) = [v for v in deployment["spec"]["template"]["spec"]["volumes"] if "configMap" in v]
    config_map = _one(renders[key], "ConfigMap", volume["configMap"]["name"])  # the hashed name resolves
    (mount,) = [m for m in _container(deployment, "reward-server")["volumeMounts"] if m["name"] == volume["name"]]
    (filename, text) = next(iter(config_map["data"].items()))
    return yaml.safe_load(text), Path(mount["mountPath"]) / filename


@pytest.mark.parametrize("key", OVERLAYS)
def test_reward_server_deployment_runs_the_cli_with_its_config(renders, key, tmp_path):
    from components.reward_server.settings import load_settings
    from components.rewards.registry import check_spec
    from pipeline.cli import build_parser

    deployment = _one(renders[key], "Deployment", "flowgrpo-reward-server")
    c = _container(deployment, "reward-server")
    image_cmd = [json.loads(args) for _, ins, args in target_instructions("reward-server") if ins == "ENTRYPOINT"][-1]
    assert image_cmd == ["flowgrpo", "reward-server"]
    args = build_parser().parse_args(["reward-server", *c["args"]])  # the real CLI accepts them
    settings_data, config_path = _reward_settings(renders, key)
    assert args.config == config_path and args.host == "0.0.0.0"
    assert {p["containerPort"] for p in c["ports"]} == {args.port}
    (tmp_path / "rs.yaml").write_text(yaml.safe_dump(settings_data))
    settings = load_settings(tmp_path / "rs.yaml", None)
    for i, spec in enumerate(settings.rewards):
        check_spec(spec, f"rewards.{i}")
    assert "ocr" in [s.name for s in settings.rewards]
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "http"}
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    (tmp_mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/tmp"]
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert "emptyDir" in volumes[tmp_mount["name"]]
    pdb = _one(renders[key], "PodDisruptionBudget", "flowgrpo-reward-server")
    assert selector_matches(pdb["spec"]["selector"], deployment["spec"]["template"]["metadata"]["labels"])
    assert pdb["spec"].get("maxUnavailable") == 1  # never blocks a drain, whatever the replica count


def test_gpu_reward_server_asks_the_judge_that_is_deployed(renders):
    from components.rewards.registry import RewardSpec, build_reward

    settings, _ = _reward_settings(renders, "overlays/gpu")
    (spec,) = [r for r in settings["rewards"] if r["name"] == "vlm_judge"]
    judge = build_reward(RewardSpec(**spec))  # the arguments are the reward's real ones
    service = _one(renders["overlays/gpu"], "Service", "flowgrpo-vllm-judge")
    assert judge.base_url == f"http://{service['metadata']['name']}:{service['spec']['ports'][0]['port']}/v1"
    args = _container(_one(renders["overlays/gpu"], "Deployment", "flowgrpo-vllm-judge"), "vllm")["args"]
    assert args[args.index("--served-model-name") + 1] == judge.model


def test_vllm_judge_runs_on_the_gpu_pool_from_a_read_only_model_volume(renders):
    deployment = _one(renders["overlays/gpu"], "Deployment", "flowgrpo-vllm-judge")
    spec = deployment["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    c = _container(deployment, "vllm")
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["HF_HUB_OFFLINE"] == "1" and env["TRANSFORMERS_OFFLINE"] == "1"
    volumes = {v["name"]: v for v in spec["volumes"]}
    (models,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/models"]
    assert models["readOnly"] is True
    assert volumes[models["name"]]["persistentVolumeClaim"] == {"claimName": "flowgrpo-models", "readOnly": True}
    assert c["args"][0].startswith("/models/")  # vllm serve MODEL_DIR: a local directory, never a hub id
    assert c["startupProbe"]["httpGet"]["path"] == "/health"
    assert deployment["spec"]["strategy"]["type"] == "Recreate"


def test_dev_overlay_needs_no_gpu(renders):
    # The pods, not the config text the RayJob carries: its reward_deploy.judge defaults name the GPU pool, used
    # only when a vlm_judge reward is configured.
    pods = [spec for obj in renders["overlays/dev"] + renders["overlays/dev/rayjob"] for _, spec in pod_specs(obj)]
    assert len(pods) >= 4 and "nvidia.com/gpu" not in json.dumps(pods)
    assert _one(renders["overlays/dev"], "Deployment", "flowgrpo-reward-server")["spec"]["replicas"] == 1
    rayjob = renders["overlays/dev/rayjob"][0]
    assert [g["replicas"] for g in rayjob["spec"]["rayClusterSpec"]["workerGroupSpecs"]] == [1]


def test_mlflow_server_arguments_are_valid_and_its_host_check_admits_the_service(renders):
    from mlflow.cli import server
    from mlflow.server.security_utils import is_allowed_host_header

    for key in OVERLAYS:
        c = _container(_one(renders[key], "Deployment", "flowgrpo-mlflow"), "mlflow")
        image_cmd = [json.loads(args) for _, ins, args in target_instructions("mlflow") if ins == "ENTRYPOINT"][-1]
        assert image_cmd == ["mlflow", "server"]
        ctx = server.make_context("mlflow server", list(c["args"]))  # MLflow's own parser; nothing starts
        assert ctx.params["artifacts_destination"].startswith("s3://")
        assert ctx.params["serve_artifacts"] is True and ctx.params["port"] == 5000
        hosts = ctx.params["allowed_hosts"].split(",")
        for ok in ("flowgrpo-mlflow:5000", "flowgrpo-mlflow.flowgrpo.svc:5000",
                   "flowgrpo-mlflow.flowgrpo.svc.cluster.local:5000", "flowgrpo-mlflow.team-x.svc.cluster.local:5000",
                   "localhost:5000"):
            assert is_allowed_host_header(hosts, ok), ok
        for bad in ("evil.example.com", "flowgrpo-mlflow.evil.example.com", "10.0.0.1:5000", ""):
            assert not is_allowed_host_header(hosts, bad), bad
        env = {e["name"]: e for e in c["env"]}
        assert env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"]["value"] == "false"
        assert env["MLFLOW_DISABLE_TELEMETRY"]["value"] == "true"
        assert env["MLFLOW_BACKEND_STORE_URI"]["valueFrom"]["secretKeyRef"]["name"] == "flowgrpo-mlflow-server"
        assert c["readinessProbe"]["httpGet"]["path"] == "/health"  # exempt from the Host check


def test_judge_from_s3_fetches_the_model_with_the_init_container_command(renders, s3_env, tmp_path):
    from components import storage

    deployment = _one(renders[JUDGE_FROM_S3], "Deployment", "flowgrpo-vllm-judge")
    spec = deployment["spec"]["template"]["spec"]
    (init,) = spec["initContainers"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    (models,) = [m for m in init["volumeMounts"] if m["mountPath"] == "/models"]
    assert volumes[models["name"]] == {"name": models["name"], "emptyDir": {"sizeLimit": "100Gi"}}
    assert _container(deployment, "vllm")["args"][0] == "/models/judge"
    assert init["image"].startswith("ghcr.io/flowgrpo/flowgrpo-components:")
    code = init["command"][2]
    assert init["command"][:2] == ["python", "-c"] and '"/models/judge"' in code
    prefix = f"s3://{s3_env.bucket}/test-manifests/judge"
    storage.put_bytes(b'{"model_type": "qwen2_vl"}', f"{prefix}/config.json")
    storage.put_bytes(b"weights", f"{prefix}/model-00001.safetensors")
    target = tmp_path / "judge"
    proc = _run([sys.executable, "-c", code.replace('"/models/judge"', repr(str(target)))],
                env=os.environ | {"FLOWGRPO_JUDGE_MODEL_URI": prefix})
    assert proc.returncode == 0, proc.stderr
    assert (target / "config.json").read_bytes() == b'{"model_type": "qwen2_vl"}'
    assert (target / "model-00001.safetensors").read_bytes() == b"weights"
    proc = _run([sys.executable, "-c", code.replace('"/models/judge"', repr(str(tmp_path / "empty")))],
                env=os.environ | {"FLOWGRPO_JUDGE_MODEL_URI": f"s3://{s3_env.bucket}/test-manifests/nothing"})
    assert proc.returncode != 0 and "no objects under" in proc.stderr


# --- images -------------------------------------------------------------------------------------------------------

def test_every_image_is_pinned_and_ours_carry_the_package_version(renders):
    images = {c["image"] for _, obj in _all(renders) for _, spec in pod_specs(obj) for c in containers(spec)}
    assert len(images) == 5
    for image in images:
        assert check_image(image) == image  # a tag or digest, never latest (the launcher's own rule)
        match = OUR_IMAGE.match(image)
        assert match and match["tag"] == VERSION, f"{image}: not ghcr.io/flowgrpo/flowgrpo-*:{VERSION}"
        assert match["target"] in TARGETS and match["target"] in dockerfile_stages(), image
    bases = set()
    stages = set()
    for _, ins, args in dockerfile_instructions(DOCKERFILE):
        if ins != "FROM":
            continue
        words = args.split()
        image = words[0]
        if image not in stages:
            assert "$" not in image and check_image(image) == image, f"{DOCKERFILE}: FROM {image}"
            bases.add(image)
        if len(words) == 3 and words[1].upper() == "AS":
            stages.add(words[2])
    python_bases = {b for b in bases if b.startswith("python:")}
    assert len(python_bases) == 1, f"one Python base for every image, got {python_bases}"


def test_the_dockerfile_targets_are_the_images():
    """The stages nothing else starts FROM or copies from are exactly the images; every other stage is shared."""
    stages = dockerfile_stages()
    used = {instructions[0][2].split()[0] for instructions in stages.values()}
    used |= {_copy_from(args) for instructions in stages.values() for _, ins, args in instructions if ins == "COPY"}
    assert sorted(set(stages) - used) == sorted(TARGETS)
    # one image, one target: each carries its own title and ends with its own command
    for target in TARGETS:
        labels = " ".join(args for _, ins, args in target_instructions(target) if ins == "LABEL")
        assert f'org.opencontainers.image.title="flowgrpo-{target}"' in labels, target
        assert "org.opencontainers.image.version=\"$VERSION\"" in labels, target
        assert [ins for _, ins, _ in stages[target]][-1] == "CMD", target


# What each image installs, by target: the pip installs of the stage its /opt/venv comes from (base first). Every
# install that resolves dependencies takes the lock as constraints; torch alone goes in without its dependencies
# (from its own index), which the next, locked, install brings.
LOCKED = "pip install --no-cache-dir -c /opt/locks/flowgrpo.txt"
IMAGE_INSTALLS = {
    "trainer": [f"{LOCKED} pip setuptools", '--no-deps --index-url "$TORCH_INDEX_URL" "torch==$torch_version"',
                "pip install --no-cache-dir --no-build-isolation -c /opt/locks/flowgrpo.txt /src"],
    "components": [f"{LOCKED} pip setuptools", f"{LOCKED} -r /src/images/requirements-components.txt",
                   "pip install --no-cache-dir --no-build-isolation --no-deps /src"],
    "mlflow": [f"{LOCKED} pip setuptools", f"{LOCKED} -r /tmp/requirements.txt"],
    "vllm-judge": [],  # vLLM's own image as it is
}
IMAGE_INSTALLS["reward-server"] = IMAGE_INSTALLS["trainer"]


def _venv_stage(target: str) -> str | None:
    """The stage target ``target`` copies its /opt/venv from (None: it has none)."""
    sources = [_copy_from(args) for _, ins, args in target_instructions(target)
               if ins == "COPY" and "/opt/venv" in args]
    assert len(sources) <= 1, f"target {target}: several venvs {sources}"
    return sources[0] if sources else None


@pytest.mark.parametrize("target", TARGETS)
def test_each_image_installs_what_its_build_stage_installs(target):
    stage = _venv_stage(target)
    build = target_instructions(stage) if stage else []
    installs = [args for _, ins, args in build + target_instructions(target) if ins == "RUN" and "pip install" in args]
    assert len(installs) == len(IMAGE_INSTALLS[target]), installs
    for args, expected in zip(installs, IMAGE_INSTALLS[target], strict=True):
        assert args.endswith(expected) and "--no-cache-dir" in args, (target, args)
    copied = {args.split()[0] for _, ins, args in build if ins == "COPY"}
    if stage:  # the lock, in the shared build stage every installing stage starts from
        assert "locks/flowgrpo.txt" in copied, (target, copied)
    if target == "components":  # its requirements file, then the package without dependencies
        assert "images/requirements-components.txt" in copied and {"pipeline", "components"} <= copied
    elif target == "mlflow":  # the server alone, not this package
        assert copied == {"locks/flowgrpo.txt", "images/requirements-mlflow.txt"}
    elif target != "vllm-judge":
        assert {"pyproject.toml", "pipeline", "components"} <= copied
    for _, ins, args in target_instructions(target):  # the image takes nothing from the build stages but the venv
        assert ins != "COPY" or not _copy_from(args) or args.split()[1:] == ["/opt/venv", "/opt/venv"], args


def test_each_image_runs_offline_with_its_caches_where_it_can_write():
    """The environment each target ends up with, shared stages included."""
    env = {target: dict(pair.split("=", 1) for _, ins, args in target_instructions(target) if ins == "ENV"
                        for pair in shlex.split(args)) for target in TARGETS}
    for target in ("trainer", "reward-server", "components", "vllm-judge"):  # nothing fetched from a model hub
        assert env[target]["HF_HUB_OFFLINE"] == "1", target
    for target in ("trainer", "reward-server", "components"):  # the commit MLflow records as lineage
        assert env[target]["FLOWGRPO_GIT_COMMIT"] == "$GIT_COMMIT", target
        assert [args for _, ins, args in target_instructions(target)
                if ins == "ARG" and args.startswith("GIT_COMMIT=")], target
    for target in ("reward-server", "vllm-judge", "mlflow"):  # read-only root filesystem, an emptyDir on /tmp
        assert env[target]["HOME"] == "/tmp", target
    for target in ("trainer", "reward-server", "components", "mlflow"):
        assert env[target]["PATH"] == "/opt/venv/bin:$PATH" and env[target]["PYTHONUNBUFFERED"] == "1", target


def test_build_script_builds_every_image_with_the_pyproject_version():
    proc = _run(["bash", str(IMAGES / "build.sh"), "--dry-run", "--push", "--reward-gpu"],
                env=os.environ | {"REGISTRY": "registry.example/team"}, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    lines = [shlex.split(line) for line in proc.stdout.splitlines()]
    build_lines = [cmd for cmd in lines if cmd[:2] == ["docker", "build"]]
    builds = {cmd[cmd.index("-t") + 1]: cmd for cmd in build_lines}
    pushes = {cmd[2] for cmd in lines if cmd[:2] == ["docker", "push"]}
    expected = {f"registry.example/team/flowgrpo-{target}:{VERSION}" for target in TARGETS}
    gpu = f"registry.example/team/flowgrpo-reward-server:{VERSION}-gpu"
    assert set(builds) == expected | {gpu} and len(build_lines) == len(builds) and pushes == set(builds)
    for tag, cmd in builds.items():  # one build of the one Dockerfile per image: its target
        name = tag.split("/flowgrpo-")[1].split(":")[0]
        assert cmd[cmd.index("-f") + 1] == "images/Dockerfile" and cmd[-1] == "."
        assert cmd.count("--target") == 1 and cmd[cmd.index("--target") + 1] == name and name in dockerfile_stages()
        assert f"VERSION={VERSION}" in cmd
    # torch's build: the Dockerfile's default (PyPI: the CUDA build) for the trainer, the CPU index for the reward
    # server, PyPI again for its -gpu variant
    (default_index,) = [args.partition("=")[2] for _, ins, args in dockerfile_stages()["torch-build"]
                        if ins == "ARG" and args.startswith("TORCH_INDEX_URL=")]
    assert default_index == "https://pypi.org/simple"
    image = lambda name: builds[f"registry.example/team/flowgrpo-{name}:{VERSION}"]  # noqa: E731
    assert not [arg for arg in image("trainer") if arg.startswith("TORCH_INDEX_URL=")]
    assert "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in image("reward-server")
    assert "TORCH_INDEX_URL=https://pypi.org/simple" in builds[gpu]
    for name in ("no-such-image", "torch-build", "python-runtime"):  # a shared stage is not an image
        bad = _run(["bash", str(IMAGES / "build.sh"), "--dry-run", name], cwd=REPO)
        assert bad.returncode == 2 and f"no image '{name}'" in bad.stderr
    some = _run(["bash", str(IMAGES / "build.sh"), "--dry-run", "mlflow", "trainer"], cwd=REPO)
    assert some.returncode == 0, some.stderr
    assert [cmd[cmd.index("--target") + 1] for cmd in map(shlex.split, some.stdout.splitlines())] == ["mlflow",
                                                                                                     "trainer"]


@pytest.mark.parametrize("script", ["images/build.sh", "scripts/render-rayjob-templates.sh"])
def test_shell_scripts_pass_shellcheck(script):
    proc = _run([tool("shellcheck"), "--severity=style", str(REPO / script)])
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dockerfile_passes_hadolint():
    assert sorted(p.name for p in IMAGES.rglob("*Dockerfile*")) == ["Dockerfile"]  # one Dockerfile for every image
    proc = _run([tool("hadolint"), "--no-color", "--config", str(IMAGES / "hadolint.yaml"), str(DOCKERFILE)])
    assert proc.returncode == 0 and proc.stdout == "", proc.stdout + proc.stderr
    lines = DOCKERFILE.read_text().splitlines()
    for i, line in enumerate(lines):
        if "hadolint ignore=" in line:  # an ignored rule comes with its reason, on the comment line above
            assert i > 0 and lines[i - 1].startswith("#") and "hadolint" not in lines[i - 1], f"{DOCKERFILE}:{i + 1}"
            # DL3049 (labels) is ignored only on the FROM of a shared stage: the images carry every label
            if "DL3049" in line:
                assert lines[i + 1].startswith("FROM ") and lines[i + 1].split()[-1] not in TARGETS, i + 1


def test_dockerignore_admits_exactly_what_the_dockerfile_copies():
    """The build context is the repository root: .dockerignore (last matching pattern wins) must let in every
    COPY source of the Dockerfile, and keep out the rest (tests, manifests, the build scripts)."""
    patterns = [line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
                if line.strip() and not line.startswith("#")]

    def sent(path: str) -> bool:
        parts = path.split("/")
        candidates = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]  # a pattern also matches a folder above
        keep = True
        for pattern in patterns:
            glob = pattern.removeprefix("!").rstrip("/").replace("**/", "*")
            if any(fnmatch.fnmatchcase(c, glob) for c in candidates):
                keep = pattern.startswith("!")
        return keep

    sources = {src for _, ins, args in dockerfile_instructions(DOCKERFILE)
               if ins == "COPY" and not _copy_from(args) for src in args.split()[:-1]}
    assert {"pyproject.toml", "pipeline", "components", "images/requirements-components.txt"} <= sources
    for src in sources:
        assert (REPO / src).exists(), src
        assert sent(src) and sent(f"{src}/x.py" if (REPO / src).is_dir() else src), src
    for path in ("tests/conftest.py", "manifests/base/kustomization.yaml", "images/build.sh", ".git/HEAD",
                 "components/__pycache__/x.pyc"):
        assert not sent(path), path


def test_hadolint_with_this_config_flags_a_careless_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install requests\n")
    proc = _run([tool("hadolint"), "--no-color", "--config", str(IMAGES / "hadolint.yaml"), str(bad)])
    assert proc.returncode != 0
    for rule in ("DL3007", "DL3013", "DL3042", "DL3049"):  # latest, unpinned pip, pip cache, missing labels
        assert rule in proc.stdout, proc.stdout


@pytest.mark.parametrize("name", ["trainer", "reward-server"])
def test_torch_goes_in_first_at_the_pyproject_pin(name):
    (torch_pin,) = [d for d in PYPROJECT["project"]["dependencies"] if d.startswith("torch==")]
    build = target_instructions(_venv_stage(name))  # the build stage the image's venv comes from
    (expr,) = [e for _, ins, args in build if ins == "RUN"
               for e in re.findall(r"sed -n '([^']+)' /src/pyproject\.toml", args)]
    proc = _run(["sed", "-n", expr, str(REPO / "pyproject.toml")])
    assert proc.stdout.strip() == torch_pin.removeprefix("torch==")
    installs = [args for _, ins, args in build if ins == "RUN" and "pip install" in args]
    # after the locked installers, torch first; the package (which brings torch's dependencies) last, locked
    assert installs[0].endswith(f"{LOCKED} pip setuptools") and '"torch==$torch_version"' in installs[1]
    assert installs[-1].endswith("-c /opt/locks/flowgrpo.txt /src")
    assert all("--no-cache-dir" in args for args in installs)


def _closure(names: set[str]) -> set[str]:
    """The distributions ``names`` pull in, from the installed metadata."""
    from importlib.metadata import PackageNotFoundError, distribution

    seen: set[tuple[str, frozenset[str]]] = set()
    todo = [(n, frozenset()) for n in names]
    while todo:
        name, extras = todo.pop()
        if (canonicalize_name(name), extras) in seen:
            continue
        seen.add((canonicalize_name(name), extras))
        try:
            requires = distribution(name).requires or []
        except PackageNotFoundError:
            continue
        for text in requires:
            req = Requirement(text)
            if req.marker and not any(req.marker.evaluate({"extra": e}) for e in (extras or {""})):
                continue
            todo.append((req.name, frozenset(req.extras)))
    return {name for name, _ in seen}


BLOCKER = """
import importlib.abc, json, os, re, runpy, sys
blocked = set(json.loads(os.environ["BLOCKED_MODULES"]))
allowed = set(json.loads(os.environ["ALLOWED_DISTRIBUTIONS"]))
def canonical(name):
    return re.sub(r"[-_.]+", "-", name).lower()
class Absent(importlib.abc.MetaPathFinder):  # blocked modules and distributions are not found, as if not installed
    def __init__(self, inner):
        self.inner = inner
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in blocked:
            return None
        return self.inner.find_spec(name, path, target)
    def find_distributions(self, *args, **kwargs):
        find = getattr(self.inner, "find_distributions", None)
        return [d for d in (find(*args, **kwargs) if find else []) if canonical(d.metadata["Name"]) in allowed]
    def invalidate_caches(self):
        getattr(self.inner, "invalidate_caches", lambda: None)()
sys.meta_path[:] = [Absent(finder) for finder in sys.meta_path]
if sys.argv[1] == "-c":
    exec(sys.argv[2])
else:
    sys.argv = ["flowgrpo", *sys.argv[1:]]
    runpy.run_module("pipeline.cli", run_name="__main__")
"""


def test_components_image_runs_the_light_steps_with_only_its_requirements(tmp_path):
    """The image installs the package with --no-deps plus requirements.txt; every other installed distribution is
    made unimportable here, and the steps that image runs must still work."""
    from importlib.metadata import packages_distributions

    allowed = _closure(set(image_requirements("components"))) | {"pip", "setuptools", "flowgrpo-mlops"}
    blocked = sorted(module for module, dists in packages_distributions().items()
                     if not {canonicalize_name(d) for d in dists} & allowed)
    assert {"torch", "ray", "diffusers", "transformers", "rapidocr", "onnxruntime"} <= set(blocked)
    env = os.environ | {"BLOCKED_MODULES": json.dumps(blocked), "ALLOWED_DISTRIBUTIONS": json.dumps(sorted(allowed)),
                        "KUBECONFIG": "/nonexistent",
                        "FLOWGRPO_CACHE_DIR": str(tmp_path / "cache")}

    def step(*args: str) -> subprocess.CompletedProcess:
        proc = _run([sys.executable, "-c", BLOCKER, *args], cwd=REPO, env=env)
        assert proc.returncode == 0, proc.stderr
        return proc

    assert "kind: RayJob" in step("rayjob", "--config", "pipeline/configs/sd35-medium-ocr.yaml").stdout
    step("prepare-dataset", "--builtin", "ocr", "--output", str(tmp_path / "ds"))
    assert (tmp_path / "ds" / "manifest.json").exists()
    step("-c", "import components.launch.kubernetes.api, components.registry.versions, kfp, kfp.kubernetes\n"
               "from mlflow import MlflowClient\nfrom components.storage import download_dir\n"
               "from mlflow.version import IS_MLFLOW_SKINNY\nassert IS_MLFLOW_SKINNY")
    # The pipeline's light steps (prepare, deploy / teardown, the RayJob launch, register) and the pipeline itself.
    root = tmp_path / "root"
    step("-c", "import pipeline.kfp_pipeline, components.launch.kubernetes.reward_deploy\n"
               "import components.tracking.pipeline_runs, components.launch.kubernetes.launcher\n"
               "from pipeline import steps\nfrom pipeline.config import config_from_parameter\n"
               f"ref = steps.prepare(config_from_parameter('tiny-cpu'), {str(root)!r})\n"
               "assert ref.manifest['rows']['train'] + ref.manifest['rows']['test'] == 8 and not ref.reused\n"
               f"assert steps.prepare(config_from_parameter('tiny-cpu'), {str(root)!r}).reused")
    blocked_proc = _run([sys.executable, "-c", BLOCKER, "-c", "import torch"], env=env)
    assert blocked_proc.returncode != 0 and "No module named 'torch'" in blocked_proc.stderr
