"""The RayJob launcher's manifest: valid against the KubeRay v1.7.0 CRD, reproducible, free of secrets."""

import copy
import hashlib
import re
import shlex
import sys
from pathlib import Path

import pytest
import yaml

from components.errors import ConfigError, LaunchError
from components.launch.kubernetes.rayjob_manifest import (
    MAX_NAME,
    SUBMITTER_CRD_LABEL,
    SUBMITTER_NAME_LABEL,
    build_network_policy,
    build_rayjob,
    default_run_id,
    rayjob_name,
    to_yaml,
)
from components.trainer.config import TrainingJobConfig
from pipeline.config import CONFIG_DIR, ExperimentConfig, load_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: rayjob_schema
import kubernetes_validate
import rayjob_schema
from k8s_manifests import admits, pod_templates

TINY = CONFIG_DIR / "tiny-cpu.yaml"
SD35 = CONFIG_DIR / "sd35-medium-ocr.yaml"
DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
OUT = "s3://flowgrpo/runs/test"


def _build(path=TINY, overrides=(), run_id="run-1", output=OUT, parent=None):
    config = load_config(path, list(overrides))
    return config, build_rayjob(config, run_id=run_id, output=output, parent_run_id=parent)


def _worker(manifest):
    (group,) = manifest["spec"]["rayClusterSpec"]["workerGroupSpecs"]
    return group


def _containers(manifest):
    spec = manifest["spec"]["rayClusterSpec"]
    return [spec["headGroupSpec"]["template"]["spec"]["containers"][0],
            _worker(manifest)["template"]["spec"]["containers"][0]]


def test_schema_copy_is_the_unmodified_kuberay_v170_rayjob_crd():
    crd = rayjob_schema.crd()
    assert crd["kind"] == "CustomResourceDefinition" and crd["spec"]["group"] == "ray.io"
    assert crd["spec"]["names"]["kind"] == "RayJob"
    assert "v1" in [v["name"] for v in crd["spec"]["versions"] if v["served"]]
    digest = hashlib.sha256(rayjob_schema.SCHEMA_FILE.read_bytes()).hexdigest()
    assert digest == rayjob_schema.SCHEMA_SHA256


def test_the_validator_rejects_unknown_wrong_and_missing_fields():
    _, manifest = _build()
    assert rayjob_schema.errors(manifest) == []
    bad = copy.deepcopy(manifest)
    _worker(bad)["gpus"] = 1
    assert any("gpus" in e for e in rayjob_schema.errors(bad))
    bad = copy.deepcopy(manifest)
    _worker(bad)["replicas"] = "four"
    assert any("replicas" in e for e in rayjob_schema.errors(bad))
    bad = copy.deepcopy(manifest)
    del _worker(bad)["groupName"]
    assert any("groupName" in e for e in rayjob_schema.errors(bad))


@pytest.mark.parametrize(
    ("path", "overrides"),
    [
        (TINY, []),
        (SD35, []),
        (TINY, ["cluster.workers.replicas=4"]),
        (SD35, ["cluster.workers.replicas=2", "cluster.workers.gpus_per_worker=8", "cluster.submission_mode=HTTPMode"]),
        (TINY, ["cluster.submission_mode=SidecarMode", "cluster.active_deadline_seconds=null",
                "cluster.s3_secret=null", "cluster.mlflow_secret=null", "cluster.ray_token_auth=false",
                "cluster.backoff_limit=3", "cluster.shutdown_after_job_finishes=false",
                "cluster.ttl_seconds_after_finished=0"]),
        (TINY, ["cluster.image=registry.local:5000/team/flowgrpo@sha256:" + "a" * 64, "cluster.head.cpu=500m",
                "cluster.workers.memory=1.5Gi", "cluster.namespace=ml-team",
                "cluster.workers.node_selector={pool: cpu}",
                "cluster.workers.tolerations=[{key: dedicated, operator: Equal, value: ml, effect: NoExecute}]"]),
    ],
)
def test_every_rayjob_validates_against_the_kuberay_crd(path, overrides):
    config, manifest = _build(path, overrides, parent="0123abcd")
    assert rayjob_schema.errors(manifest) == []
    cluster = config.cluster
    assert manifest["apiVersion"] == "ray.io/v1" and manifest["kind"] == "RayJob"
    assert manifest["metadata"]["namespace"] == cluster.namespace
    group = _worker(manifest)
    n = cluster.workers.replicas
    assert (group["replicas"], group["minReplicas"], group["maxReplicas"]) == (n, n, n)
    # one training worker per GPU (each asks Ray for one), one per pod without GPUs: a pod's other GPUs never idle
    per_pod = cluster.workers.gpus_per_worker or 1
    assert manifest["spec"]["entrypoint"].endswith(f"--ray-workers {n * per_pod} --auto-resume")
    head, worker = _containers(manifest)
    assert head["image"] == worker["image"] == cluster.image
    assert "nvidia.com/gpu" not in head["resources"]["limits"]
    gpus = cluster.workers.gpus_per_worker
    for kind in ("requests", "limits"):
        assert worker["resources"][kind].get("nvidia.com/gpu") == (str(gpus) if gpus else None)
        assert worker["resources"][kind]["cpu"] == cluster.workers.cpu
    pod = group["template"]["spec"]
    assert pod.get("nodeSelector", {}) == cluster.workers.node_selector
    assert len(pod.get("tolerations", [])) == len(cluster.workers.tolerations)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert worker["securityContext"]["allowPrivilegeEscalation"] is False
    assert all(c["securityContext"]["readOnlyRootFilesystem"] is True for c in (head, worker))
    spec = manifest["spec"]
    assert spec["submissionMode"] == cluster.submission_mode
    assert spec.get("activeDeadlineSeconds") == cluster.active_deadline_seconds
    assert spec["shutdownAfterJobFinishes"] is cluster.shutdown_after_job_finishes
    assert ("authOptions" in spec["rayClusterSpec"]) is cluster.ray_token_auth


def test_sd35_runs_on_eight_gpu_workers_in_a_gpu_pool():
    _, manifest = _build(SD35)
    pod = _worker(manifest)["template"]["spec"]
    assert _worker(manifest)["replicas"] == 8
    assert _containers(manifest)[1]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    head_pod = manifest["spec"]["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]
    assert "nodeSelector" not in head_pod and "tolerations" not in head_pod  # the head stays on CPU nodes


def test_a_config_built_without_validation_still_cannot_carry_credentials_into_the_rayjob():
    config = load_config(TINY, [])
    hand_made = config.model_copy(update={"data": config.data.model_copy(update={"path": "s3://k:hunter2@b/p"})})
    with pytest.raises(LaunchError, match=r"data\.path embeds credentials") as info:
        build_rayjob(hand_made, run_id="run-1", output=OUT)
    assert "hunter2" not in str(info.value)


def test_ray_pods_mount_no_service_account_token():
    _, manifest = _build(SD35)
    cluster = manifest["spec"]["rayClusterSpec"]
    for group in (cluster["headGroupSpec"], *cluster["workerGroupSpecs"]):
        assert group["template"]["spec"]["automountServiceAccountToken"] is False


@pytest.mark.parametrize("path", [TINY, SD35])
@pytest.mark.parametrize("parent", [None, "parent-run-42"])
def test_entrypoint_and_runtime_env_carry_the_exact_config(path, parent):
    config, manifest = _build(path, ["train.epochs=7"], output="s3://bucket/runs/a b", parent=parent)
    argv = shlex.split(manifest["spec"]["entrypoint"])
    assert argv == ["python", "-m", "components.trainer", "--config", "env:FLOWGRPO_EXPERIMENT_CONFIG",
                    "--output", "s3://bucket/runs/a b", "--ray-workers", str(config.cluster.workers.replicas * 1),
                    "--auto-resume"]
    env = yaml.safe_load(manifest["spec"]["runtimeEnvYAML"])["env_vars"]
    assert env["HF_HUB_OFFLINE"] == "1"
    assert env.get("FLOWGRPO_MLFLOW_PARENT_RUN_ID") == parent
    assert all(isinstance(v, str) for v in env.values())
    # The whole experiment travels (the run records it); the trainer validates its own sections of it.
    data = yaml.safe_load(env["FLOWGRPO_EXPERIMENT_CONFIG"])
    restored = ExperimentConfig.model_validate(data)
    assert restored == config and restored.train.epochs == 7
    own = TrainingJobConfig.from_sections(data, "env:FLOWGRPO_EXPERIMENT_CONFIG")
    assert own.model_dump() == {k: v for k, v in config.model_dump().items() if k in TrainingJobConfig.model_fields}
    assert "cluster" not in own.model_dump() and own.train.epochs == 7


@pytest.mark.parametrize(("overrides", "sections"), [
    ([], ["flow_grpo"]),
    (["train.algorithm=mix_grpo"], ["flow_grpo", "mix_grpo"]),  # MixGRPO reads FlowGRPO's section too
    (["train.algorithm=awm"], ["awm"]),
    (["train.diffusion_nft.beta=2"], ["diffusion_nft", "flow_grpo"]),  # changed, though unread: it travels
])
def test_the_rayjob_carries_the_sections_the_run_reads_and_those_it_changes(overrides, sections):
    """tiny-cpu.yaml spells two algorithms' sections, the schema has them all; the RayJob carries the run's own and a
    changed one (whose note the trainer then gives), and the trainer fills the others with their defaults."""
    from components.algorithms.base import algorithms
    from components.trainer.config import algorithm_notes

    config, manifest = _build(TINY, overrides)
    data = yaml.safe_load(yaml.safe_load(manifest["spec"]["runtimeEnvYAML"])["env_vars"]["FLOWGRPO_EXPERIMENT_CONFIG"])
    assert sorted(set(data["train"]) & set(algorithms())) == sections
    own = TrainingJobConfig.from_sections(data, "env:FLOWGRPO_EXPERIMENT_CONFIG")
    assert own.train == config.train
    assert algorithm_notes(own) == algorithm_notes(config)
    assert any("train.diffusion_nft.beta is not used" in n for n in algorithm_notes(own)) == ("diffusion_nft" in
                                                                                               sections)


def test_yaml_output_round_trips_without_anchors_or_folded_lines():
    _, manifest = _build(SD35, parent="p")
    text = to_yaml(manifest)
    assert yaml.safe_load(text) == manifest
    assert "&id" not in text and "*id" not in text
    assert f"  entrypoint: {manifest['spec']['entrypoint']}\n" in text


@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        (["cluster.workers.replicas=0"], ["cluster.workers.replicas", "greater than or equal to 1"]),
        (["cluster.workers.gpus_per_worker=1"], ["GPUs requested without a GPU node pool",
                                                 "cluster.workers.node_selector"]),
        (["cluster.image=ghcr.io/flowgrpo/flowgrpo-trainer:latest"], ["cluster.image", "'latest'"]),
        (["cluster.image=ghcr.io/flowgrpo/flowgrpo-trainer"], ["cluster.image", "no tag"]),
        (["cluster.image=localhost:5000/flowgrpo-trainer"], ["cluster.image", "no tag"]),
        (["cluster.submission_mode=InteractiveMode"], ["cluster.submission_mode", "K8sJobMode"]),
        (["cluster.workers.memory=lots"], ["cluster.workers.memory", "quantity"]),
        (["cluster.namespace=Team_A"], ["cluster.namespace", "DNS-1123"]),
        (["cluster.ray_version=2.40.0"], ["cluster.ray_token_auth", "2.52"]),
        (["cluster.workers.tolerations=[{key: a, operator: Exists, value: b}]"], ["cluster.workers.tolerations.0"]),
        (["cluster.workers.gpu=1"], ["cluster.workers.gpu", "unknown key"]),
        (["cluster.workers.shm_size=16Gi"], ["cluster.workers.shm_size 16Gi exceeds cluster.workers.memory 8Gi"]),
        (["cluster.head.shm_size=100Mi"], ["cluster.head.shm_size 100Mi is below 256Mi"]),
        (["cluster.network_interface=eth0;rm"], ["cluster.network_interface"]),
        (["cluster.termination_grace_s=5"], ["cluster.termination_grace_s", "greater than or equal to 20"]),
        (["distributed.collective_timeout_s=0"], ["distributed.collective_timeout_s", "greater than 0"]),
    ],
)
def test_invalid_cluster_configs_are_rejected_naming_the_key(overrides, needles):
    with pytest.raises(ConfigError) as info:
        load_config(TINY, overrides)
    message = str(info.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message


@pytest.mark.parametrize(
    ("overrides", "kwargs", "needles"),
    [
        (["model.device=cuda"], {}, ["model.device", "cluster.workers.gpus_per_worker is 0"]),
        ([], {"output": "runs/demo"}, ["--output", "s3://"]),
        ([], {"parent": "http://u:p@mlflow/run"}, ["--mlflow-parent-run-id", "credentials"]),
        ([], {"run_id": "__"}, ["run id", "letter or digit"]),
    ],
)
def test_unlaunchable_runs_are_refused_before_submission(overrides, kwargs, needles):
    with pytest.raises(LaunchError) as info:
        _build(TINY, overrides, **kwargs)
    message = str(info.value)
    for needle in needles:
        assert needle in message
    assert "hunter2" not in message


def test_no_secret_value_enters_the_manifest(monkeypatch):
    markers = {"AWS_SECRET_ACCESS_KEY": "MARKER-aws-secret-5f3a", "AWS_ACCESS_KEY_ID": "MARKER-aws-id-91c2",
               "MLFLOW_TRACKING_PASSWORD": "MARKER-mlflow-pw-77e1", "MLFLOW_TRACKING_URI": "http://MARKER-uri"}
    for key, value in markers.items():
        monkeypatch.setenv(key, value)
    for path in (TINY, SD35):
        config, manifest = _build(path, parent="p")
        text = to_yaml(manifest)
        assert not [v for v in markers.values() if v in text]
        for container in _containers(manifest):
            env = {e["name"]: e for e in container["env"]}
            for key in markers:
                assert "value" not in env[key]
                ref = env[key]["valueFrom"]["secretKeyRef"]
                secret = config.cluster.s3_secret if key.startswith("AWS") else config.cluster.mlflow_secret
                assert ref == {"name": secret, "key": key, "optional": True}
    _, manifest = _build(TINY, ["cluster.s3_secret=null"])
    assert not any(e["name"].startswith("AWS_") for c in _containers(manifest) for e in c["env"])


@pytest.mark.parametrize("run_id", ["exp-1", "Exp_1", "tiny-cpu-b1c63770cf", "a" * 200, "über run #7 / 2026",
                                    "9-starts-with-digit", "x-" * 40])
def test_rayjob_name_is_deterministic_and_a_valid_kuberay_name(run_id):
    name = rayjob_name(run_id)
    assert name == rayjob_name(run_id)
    assert len(name) <= MAX_NAME == 47 and DNS_1035.fullmatch(name)
    _, manifest = _build(run_id=run_id)
    assert manifest["metadata"]["name"] == name
    assert manifest["metadata"]["annotations"]["flowgrpo.io/run-id"] == run_id


def test_rayjob_names_stay_readable_and_distinct():
    assert rayjob_name("exp-1") == "flowgrpo-exp-1"
    ids = ["exp-1", "Exp-1", "exp_1", "exp 1", "a" * 60, "a" * 61]
    assert len({rayjob_name(i) for i in ids}) == len(ids)


def test_default_run_id_follows_the_config_content():
    a, b = load_config(TINY), load_config(TINY, ["train.epochs=3"])
    assert default_run_id(a, "tiny-cpu") == default_run_id(load_config(TINY), "tiny-cpu")
    assert default_run_id(a, "tiny-cpu") != default_run_id(b, "tiny-cpu")
    assert default_run_id(a, "tiny-cpu").startswith("tiny-cpu-")


@pytest.mark.parametrize("output", ["runs/local", "s3://", "s3:///key", "gs://bucket/run", "file:///tmp/run"])
def test_an_output_that_is_not_an_s3_prefix_is_refused(output):
    with pytest.raises(LaunchError, match=r"must be an s3:// URI: the Ray pods share no filesystem"):
        build_rayjob(load_config(TINY, []), run_id="run-1", output=output)


def _submitter(name):
    """The labels of KubeRay's submitter pod (K8sJobMode): KubeRay's own and the Job controller's."""
    return {SUBMITTER_CRD_LABEL: "RayJob", SUBMITTER_NAME_LABEL: name,
            "app.kubernetes.io/created-by": "kuberay-operator", "batch.kubernetes.io/job-name": name, "job-name": name}


@pytest.mark.parametrize("version", ["1.35.0", "1.37.0"])
def test_the_ray_pods_network_policy_is_a_valid_object_owned_by_its_rayjob(version):
    _, manifest = _build(SD35)
    policy = build_network_policy(manifest, "5c1e0f4a-uid")
    kubernetes_validate.validate(policy, version, strict=True)
    assert policy["metadata"]["ownerReferences"] == [
        {"apiVersion": "ray.io/v1", "kind": "RayJob", "name": manifest["metadata"]["name"], "uid": "5c1e0f4a-uid"}]
    assert policy["metadata"]["namespace"] == manifest["metadata"]["namespace"]


# GCS, dashboard, client, a raylet's, the dashboard agent's, a worker's
@pytest.mark.parametrize("port", [6379, 8265, 10001, 8076, 52365, 12345])
def test_the_ray_pods_are_reachable_from_their_own_rayjob_only(port):
    _, manifest = _build(SD35, ["cluster.workers.replicas=2"])
    name = manifest["metadata"]["name"]
    policy = build_network_policy(manifest, "uid")
    own = dict(pod_templates(manifest))
    assert set(own) == {"head", "workers"}
    for labels in own.values():  # the policy applies to the head and the workers
        assert all(labels.get(k) == v for k, v in policy["spec"]["podSelector"]["matchLabels"].items())
    for who in (own["head"], own["workers"], _submitter(name)):
        assert admits(policy, who, port), who
    _, other = _build(SD35, run_id="run-2")
    strangers = [*dict(pod_templates(other)).values(), _submitter(other["metadata"]["name"]),
                 {"app.kubernetes.io/component": "evaluate", "app.kubernetes.io/part-of": "flowgrpo"},
                 {"app.kubernetes.io/name": "flowgrpo", "app.kubernetes.io/component": "reward-server"},
                 {"app.kubernetes.io/name": "flowgrpo", "app.kubernetes.io/component": "mlflow"}, {}]
    for who in strangers:
        assert not admits(policy, who, port), who
    # the same labels in another namespace are someone else's pods
    assert not admits(policy, own["head"], port, namespace={"kubernetes.io/metadata.name": "elsewhere"})
    # KubeRay's operator, in its own namespace, follows (HTTPMode: submits) the job on the dashboard, nothing else
    operator = {"app.kubernetes.io/name": "kuberay-operator", "app.kubernetes.io/component": "kuberay-operator"}
    assert admits(policy, operator, port, namespace={"kubernetes.io/metadata.name": "kuberay"}) is (port == 8265)


@pytest.mark.parametrize(("path", "overrides"), [(TINY, []), (SD35, ["cluster.workers.gpus_per_worker=4"])])
def test_the_pods_carry_what_a_multi_node_run_needs(path, overrides):
    """The settings tests/integration/test_multihost.py starts its hosts from: the collective's interface, /dev/shm
    and Ray's object store, the grace period and the drain that uses it, one training worker per GPU."""
    config, manifest = _build(path, overrides)
    cluster = config.cluster
    spec = manifest["spec"]["rayClusterSpec"]
    for group, shm in ((spec["headGroupSpec"], cluster.head.shm_size),
                       (spec["workerGroupSpecs"][0], cluster.workers.shm_size)):
        pod = group["template"]["spec"]
        env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
        assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == cluster.network_interface == "eth0"
        volume = next(v for v in pod["volumes"] if v["name"] == "dshm")["emptyDir"]
        assert volume == {"medium": "Memory", "sizeLimit": shm}
        units = {"Mi": 2**20, "Gi": 2**30}
        assert int(group["rayStartParams"]["object-store-memory"]) == int(shm[:-2]) * units[shm[-2:]] // 2
    worker = spec["workerGroupSpecs"][0]["template"]["spec"]
    grace = worker["terminationGracePeriodSeconds"]
    assert grace == cluster.termination_grace_s
    hook = worker["containers"][0]["lifecycle"]["preStop"]["exec"]["command"]
    assert hook == ["python", "-m", "components.trainer.drain", "--timeout", str(grace - 10)]
    assert "terminationGracePeriodSeconds" not in spec["headGroupSpec"]["template"]["spec"]
    gpus = cluster.workers.gpus_per_worker
    workers = shlex.split(manifest["spec"]["entrypoint"])
    assert int(workers[workers.index("--ray-workers") + 1]) == cluster.workers.replicas * max(gpus, 1)
