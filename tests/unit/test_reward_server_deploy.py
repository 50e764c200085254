"""The reward server's Kubernetes objects as plain data: names, strict schema validation, judge wiring, security."""

from __future__ import annotations

import re
import subprocess
import sys

import kubernetes_validate
import pytest
import yaml
from k8s_manifests import (
    MANIFESTS,
    containers,
    pod_specs,
    quantity,
    selector_matches,
    target_user,
)

from components.errors import ConfigError, LaunchError
from components.launch.kubernetes.podspec import S3_SECRET_KEYS
from components.launch.kubernetes.reward_deploy import (
    CONFIG_HASH,
    MAX_NAME,
    build_reward_server_objects,
    judge_name,
    reward_server_name,
    service_url,
)
from components.reward_server.entry import build_parser as reward_server_parser
from components.reward_server.settings import ServerSettings
from pipeline.config import TINY_CONFIG, load_config

NS = "team-a"
DNS_1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")
KUBERNETES_VERSIONS = ("1.35.0", "1.37.0")
JUDGE_REWARDS = ('rewards=[{name: ocr}, {name: vlm_judge, args: {base_url: "http://elsewhere:8000/v1", model: qwen}},'
                 ' {name: rank, label: judge_rank, args: {reward: {name: vlm_judge, args: {base_url: '
                 '"http://x:1/v1", model: judge}}}}]')


def _objects(*overrides: str, run_id: str = "run-1") -> list[dict]:
    config = load_config(TINY_CONFIG, list(overrides))
    return build_reward_server_objects(config, name=reward_server_name(run_id), namespace=NS, run_id=run_id)


def _by_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


@pytest.mark.parametrize("run_id", ["run-1", "Run_1 with spaces/and:colons", "ÜBER-lauf", "x" * 300,
                                    "--7--", "3f2a6c1e-0b1d-4f6e-9a8b-2c3d4e5f6a7b"])
def test_names_are_deterministic_short_dns_labels(run_id):
    name = reward_server_name(run_id)
    assert name == reward_server_name(run_id)
    for n in (name, judge_name(name)):
        assert DNS_1035.fullmatch(n) and len(n) <= 63, n
    assert len(name) <= MAX_NAME and name.startswith("flowgrpo-rs-")


def test_distinct_run_ids_that_slug_alike_get_distinct_names():
    names = {reward_server_name(r) for r in ("run-1", "Run-1", "run_1", "run.1", "run 1")}
    assert len(names) == 5
    assert reward_server_name("run-1") == "flowgrpo-rs-run-1"  # a clean run id stays readable


def test_a_run_id_without_letters_or_digits_is_refused():
    with pytest.raises(LaunchError, match="at least one letter or digit"):
        reward_server_name("--//--")


def test_service_url_is_the_cluster_dns_name():
    assert service_url("flowgrpo-rs-a", "ns", 8600) == "http://flowgrpo-rs-a.ns.svc.cluster.local:8600"


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("overrides", [(), (JUDGE_REWARDS,),
                                       (JUDGE_REWARDS, "reward_deploy.judge.model=s3://models/judge",
                                        "reward_deploy.service_account=reward-sa", "reward_deploy.gpus=1",
                                        "reward_deploy.node_selector={pool: gpu}")])
def test_objects_pass_strict_schema_validation(overrides, version):
    for obj in _objects(*overrides):
        kubernetes_validate.validate(obj, version, strict=True)


def test_the_server_is_a_configmap_deployment_and_clusterip_service_labelled_by_run():
    objects = _objects(run_id="Run 1/α")
    name = reward_server_name("Run 1/α")
    assert [(o["kind"], o["metadata"]["name"]) for o in objects] == [
        ("ConfigMap", name), ("Deployment", name), ("Service", name), ("NetworkPolicy", name)]
    for obj in objects:
        labels = obj["metadata"]["labels"]
        assert obj["metadata"]["namespace"] == NS
        assert labels["app.kubernetes.io/part-of"] == "flowgrpo"
        assert labels["app.kubernetes.io/component"] == "reward-server"
        assert LABEL_VALUE.fullmatch(labels["flowgrpo.io/run-id"]) and labels["flowgrpo.io/run-id"] == "Run-1"
        assert obj["metadata"]["annotations"]["flowgrpo.io/run-id"] == "Run 1/α"  # the exact run id
    (deployment,), (service,) = _by_kind(objects, "Deployment"), _by_kind(objects, "Service")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert selector_matches(deployment["spec"]["selector"], pod_labels)
    assert selector_matches({"matchLabels": service["spec"]["selector"]}, pod_labels)
    assert service["spec"]["type"] == "ClusterIP" and service["spec"]["ports"][0]["port"] == 8600
    # The shared Service of manifests/base must not pick up a run's pods (it would mix rewards).
    base = [o for o in yaml.safe_load_all((MANIFESTS / "base/reward-server.yaml").read_text()) if o]
    (shared,) = [o for o in base if o["kind"] == "Service"]
    assert not selector_matches({"matchLabels": shared["spec"]["selector"]}, pod_labels)


def test_the_deployment_runs_the_cli_on_the_configmap_with_probes():
    objects = _objects("reward_deploy.port=9000")
    (config_map,), (deployment,) = _by_kind(objects, "ConfigMap"), _by_kind(objects, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["command"] == ["python", "-m", "components.reward_server"]
    args = reward_server_parser().parse_args(container["args"])
    assert (args.host, args.port) == ("0.0.0.0", 9000)
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "config"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == "config"]
    assert volume["configMap"]["name"] == config_map["metadata"]["name"]
    assert args.config.parent.as_posix() == mount["mountPath"] and args.config.name in config_map["data"]
    settings = ServerSettings.model_validate(yaml.safe_load(config_map["data"][args.config.name]))
    assert [s.name for s in settings.rewards] == ["brightness"]  # the training rewards
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["ports"] == [{"name": "http", "containerPort": 9000, "protocol": "TCP"}]
    assert {"name": "HF_HUB_OFFLINE", "value": "1"} in container["env"]


def test_changed_rewards_roll_the_pods():
    def config_hash(*overrides):
        (deployment,) = _by_kind(_objects(*overrides), "Deployment")
        return deployment["spec"]["template"]["metadata"]["annotations"][CONFIG_HASH]

    assert config_hash() == config_hash()
    assert config_hash() != config_hash("rewards.0.weight=2")


def test_no_judge_without_a_vlm_judge_reward():
    assert not [o for o in _objects() if o["metadata"]["name"].endswith("-judge")]


def test_a_vlm_judge_reward_gets_a_judge_and_its_base_url_points_there():
    objects = _objects(JUDGE_REWARDS)
    name = reward_server_name("run-1")
    judge = judge_name(name)
    assert [(o["kind"], o["metadata"]["name"]) for o in objects][4:] == [
        ("Deployment", judge), ("Service", judge), ("NetworkPolicy", judge)]
    (config_map,) = _by_kind(objects, "ConfigMap")
    rewards = yaml.safe_load(config_map["data"]["rewards.yaml"])["rewards"]
    url = f"http://{judge}.{NS}.svc.cluster.local:8000/v1"
    assert rewards[1]["args"]["base_url"] == url
    assert rewards[2]["args"]["reward"]["args"]["base_url"] == url  # also inside a wrapper
    assert rewards[0] == {"name": "ocr", "label": None, "weight": 1.0, "args": {}, "required": False,
                          "timeout_s": 300.0, "frames": "mean"}
    deployment = next(o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == judge)
    pod = deployment["spec"]["template"]["spec"]
    args = pod["containers"][0]["args"]
    assert args[:4] == ["/models/judge", "--served-model-name", "qwen", "judge"]
    assert pod["volumes"][0] == {"name": "models",
                                 "persistentVolumeClaim": {"claimName": "flowgrpo-models", "readOnly": True}}
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    (service,) = [o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == judge]
    assert selector_matches({"matchLabels": service["spec"]["selector"]}, deployment["spec"]["template"]["metadata"]
                            ["labels"])
    reward_pods = _by_kind(objects, "Deployment")[0]["spec"]["template"]["metadata"]["labels"]
    assert not selector_matches({"matchLabels": service["spec"]["selector"]}, reward_pods)


def test_a_judge_model_from_s3_is_copied_by_an_init_container():
    objects = _objects(JUDGE_REWARDS, "reward_deploy.judge.model=s3://bucket/models/judge")
    pod = next(o for o in objects if o["metadata"]["name"].endswith("-judge"))["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    env = {e["name"]: e for e in init["env"]}
    assert env["FLOWGRPO_JUDGE_MODEL_URI"]["value"] == "s3://bucket/models/judge"
    assert env["FLOWGRPO_JUDGE_MODEL_DIR"]["value"] == pod["containers"][0]["args"][0]
    assert "emptyDir" in pod["volumes"][0]
    compile(init["command"][2], "fetch-model", "exec")  # the script is valid Python


def test_a_disabled_judge_leaves_the_base_url_alone():
    objects = _objects(JUDGE_REWARDS, "reward_deploy.judge.enabled=false")
    assert len(objects) == 4  # no judge objects
    rewards = yaml.safe_load(_by_kind(objects, "ConfigMap")[0]["data"]["rewards.yaml"])["rewards"]
    assert rewards[1]["args"]["base_url"] == "http://elsewhere:8000/v1"


@pytest.mark.parametrize("overrides", [(), (JUDGE_REWARDS, "reward_deploy.judge.model=s3://b/judge")])
def test_secrets_reach_pods_only_by_reference(overrides):
    for obj in _objects(*overrides):
        for _, spec in pod_specs(obj):
            for container in containers(spec):
                for env in container.get("env") or []:
                    if env["name"] in S3_SECRET_KEYS:
                        assert "value" not in env
                        assert env["valueFrom"]["secretKeyRef"] == {"name": "flowgrpo-s3", "key": env["name"],
                                                                    "optional": True}
    text = yaml.safe_dump(_objects("reward_deploy.s3_secret=null"))
    assert "AWS_" not in text and "secretKeyRef" not in text


@pytest.mark.parametrize("overrides", [(), (JUDGE_REWARDS, "reward_deploy.judge.model=s3://b/judge")])
def test_pods_run_as_the_images_non_root_user_with_requests_equal_to_limits(overrides):
    uids = {"reward-server": target_user("reward-server"), "vllm-judge": target_user("vllm-judge")}
    for obj in _objects(*overrides):
        for _, spec in pod_specs(obj):
            component = obj["metadata"]["labels"]["app.kubernetes.io/component"]
            security = spec["securityContext"]
            assert security["runAsNonRoot"] is True
            assert (security["runAsUser"], security["runAsGroup"]) == uids[component]
            assert spec["automountServiceAccountToken"] is False
            for container in containers(spec):
                assert container["securityContext"] == {"allowPrivilegeEscalation": False,
                                                        "capabilities": {"drop": ["ALL"]},
                                                        "readOnlyRootFilesystem": True}
                res = container["resources"]
                assert res["requests"] == res["limits"] and {"cpu", "memory"} <= set(res["limits"])
                assert all(quantity(v) > 0 for v in res["limits"].values())


def test_gpus_and_placement_reach_the_pod():
    objects = _objects("reward_deploy.gpus=1", "reward_deploy.node_selector={pool: gpu}",
                       "reward_deploy.tolerations=[{key: nvidia.com/gpu, operator: Exists}]")
    pod = _by_kind(objects, "Deployment")[0]["spec"]["template"]["spec"]
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert pod["nodeSelector"] == {"pool": "gpu"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists"}]


@pytest.mark.parametrize(("override", "needles"), [
    ("reward_deploy.image=ghcr.io/flowgrpo/flowgrpo-reward-server:latest", ["reward_deploy.image", "'latest'"]),
    ("reward_deploy.gpus=1", ["GPUs requested without a GPU node pool", "reward_deploy.node_selector"]),
    ("reward_deploy.judge.node_selector={}", ["reward_deploy.judge.node_selector"]),
    ("reward_deploy.judge.model=/models/judge", ["reward_deploy.judge.model", "pvc://"]),
    ("reward_deploy.judge.model=pvc://only-a-claim", ["reward_deploy.judge.model", "a claim and a path"]),
    ("reward_deploy.memory=lots", ["reward_deploy.memory", "quantity"]),
    ("reward_deploy.s3_secret=Not_A_Name", ["reward_deploy.s3_secret", "DNS subdomain"]),
    ("reward_deploy.port=80", ["reward_deploy.port"]),
])
def test_bad_settings_name_the_key(override, needles):
    with pytest.raises(ConfigError) as info:
        load_config(TINY_CONFIG, [override])
    for needle in needles:
        assert needle in str(info.value)


def test_the_deploy_modules_import_no_kubernetes_client_nor_heavy_libraries():
    """The components image (no torch) runs the deploy step; a local run never needs the Kubernetes client."""
    code = ("import sys, components.launch.kubernetes.reward_deploy, components.launch.local\n"
            "bad = sorted({'kubernetes', 'torch', 'rapidocr', 'diffusers'} & {m.split('.')[0] for m in sys.modules})\n"
            "assert not bad, bad")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def _pod_labels(objects: list[dict], name: str) -> dict[str, str]:
    deployment = next(o for o in objects if o["kind"] == "Deployment" and o["metadata"]["name"] == name)
    return deployment["spec"]["template"]["metadata"]["labels"]


def _admits(policy: dict, port: int, labels: dict[str, str]) -> bool:
    """Whether ``policy`` lets a pod labelled ``labels`` (in its namespace) reach ``port``."""
    return any(any(selector_matches(peer["podSelector"], labels) for peer in rule["from"])
               and any(p["port"] == port for p in rule["ports"]) for rule in policy["spec"]["ingress"])


def test_only_the_runs_trainer_pods_reach_its_reward_server_and_only_that_server_its_judge():
    from components.launch.kubernetes.rayjob_manifest import build_rayjob

    objects = _objects(JUDGE_REWARDS, "reward_deploy.port=8600")
    name = reward_server_name("run-1")
    server, judge = (next(o for o in objects if o["kind"] == "NetworkPolicy" and o["metadata"]["name"] == n)
                     for n in (name, judge_name(name)))
    assert server["spec"]["policyTypes"] == ["Ingress"]
    assert selector_matches(server["spec"]["podSelector"], _pod_labels(objects, name))
    assert not selector_matches(server["spec"]["podSelector"], _pod_labels(objects, judge_name(name)))

    def trainer_pods(run_id: str) -> list[dict[str, str]]:
        job = build_rayjob(load_config(TINY_CONFIG, []), run_id=run_id, output="s3://b/runs/x")
        spec = job["spec"]["rayClusterSpec"]
        return [g["template"]["metadata"]["labels"] for g in (spec["headGroupSpec"], *spec["workerGroupSpecs"])]

    assert all(_admits(server, 8600, labels) for labels in trainer_pods("run-1"))  # head and workers
    assert not any(_admits(server, 8600, labels) for labels in trainer_pods("run-2"))  # another run's trainer
    assert not _admits(server, 8600, _pod_labels(objects, judge_name(name)))
    assert not _admits(server, 8600, {"app.kubernetes.io/part-of": "flowgrpo", "app.kubernetes.io/component":
                                      "evaluate"})
    assert selector_matches(judge["spec"]["podSelector"], _pod_labels(objects, judge_name(name)))
    assert _admits(judge, 8000, _pod_labels(objects, name))
    assert not any(_admits(judge, 8000, labels) for labels in trainer_pods("run-1"))
    other = _objects(JUDGE_REWARDS, run_id="run-2")
    assert not _admits(judge, 8000, _pod_labels(other, reward_server_name("run-2")))
