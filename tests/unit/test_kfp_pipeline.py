"""The compiled Kubeflow pipeline: committed copy up to date, loadable by kfp, with its platform settings."""

from __future__ import annotations

import json

import pytest
import yaml
from kfp import components

from components.errors import ConfigError
from pipeline.config import DEFAULT_CONFIG, config_from_parameter, dump_config, load_config
from pipeline.kfp_pipeline import COMPILED, MLFLOW_SECRET, S3_KEYS, S3_SECRET, compile_pipeline


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> tuple[dict, dict]:
    path = compile_pipeline(tmp_path_factory.mktemp("kfp") / "p.yaml")
    assert path.read_text() == COMPILED.read_text(), (
        "pipeline/flowgrpo_pipeline.yaml is stale: run `flowgrpo compile` and commit it")
    spec, platform = yaml.safe_load_all(path.read_text())
    return spec, platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]


def test_committed_yaml_loads_with_kfp_loader():
    component = components.load_component_from_file(str(COMPILED))
    assert component.name == "flowgrpo"
    assert set(component.component_spec.inputs) == {"config", "overrides", "storage_root", "ray_workers", "launcher"}
    assert component.component_spec.inputs["config"].default == DEFAULT_CONFIG.stem == "shapes-cpu"


def test_dag_order_and_exit_handler(compiled):
    spec, _ = compiled
    inner = spec["components"]["comp-exit-handler-1"]["dag"]["tasks"]
    assert set(inner) == {"prepare-dataset", "deploy-reward-server", "train", "evaluate", "register"}
    consumers = {name: {t for v in task.get("inputs", {}).get("parameters", {}).values()
                        if (t := v.get("taskOutputParameter", {}).get("producerTask"))}
                 | {t for v in task.get("inputs", {}).get("artifacts", {}).values()
                    if (t := v.get("taskOutputArtifact", {}).get("producerTask"))}
                 for name, task in inner.items()}
    assert inner["deploy-reward-server"]["dependentTasks"] == ["prepare-dataset"]
    assert consumers["train"] == {"prepare-dataset", "deploy-reward-server"}
    assert consumers["evaluate"] == {"prepare-dataset", "train"}
    assert consumers["register"] == {"train", "evaluate"}
    root = spec["root"]["dag"]["tasks"]
    assert root["teardown"]["triggerPolicy"]["strategy"] == "ALL_UPSTREAM_TASKS_COMPLETED"
    # The exit task knows the run only by its id, as every inner step that names the reward server does.
    assert root["teardown"]["inputs"]["parameters"]["run_id"]["runtimeValue"]["constant"] == "{{$.pipeline_job_uuid}}"
    assert inner["deploy-reward-server"]["inputs"]["parameters"]["run_id"]["runtimeValue"]["constant"] == \
        "{{$.pipeline_job_uuid}}"
    # Caching only for the deterministic dataset step; a resumable train step may be retried.
    assert inner["prepare-dataset"]["cachingOptions"] == {"enableCache": True}
    assert all(not inner[t]["cachingOptions"].get("enableCache") for t in inner if t != "prepare-dataset")
    assert inner["train"]["retryPolicy"]["maxRetryCount"] == 1


def test_typed_artifacts(compiled):
    spec, _ = compiled
    outputs = {name: {k: v["artifactType"]["schemaTitle"]
                      for k, v in comp.get("outputDefinitions", {}).get("artifacts", {}).items()}
               for name, comp in spec["components"].items()}
    assert outputs["comp-prepare-dataset"] == {"dataset": "system.Dataset"}
    assert outputs["comp-train"] == {"model": "system.Model", "metrics": "system.Metrics"}
    assert outputs["comp-evaluate"] == {"report": "system.HTML", "metrics": "system.Metrics"}


def test_kubernetes_settings(compiled):
    spec, executors = compiled
    assert set(executors) == {f"exec-{n}" for n in ("prepare-dataset", "deploy-reward-server", "train", "evaluate",
                                                     "register", "teardown")}
    for name, executor in executors.items():
        secrets = {(s["secretName"], tuple(sorted(e["envVar"] for e in s["keyToEnv"])), s.get("optional", False))
                   for s in executor["secretAsEnv"]}
        assert (S3_SECRET, tuple(sorted(S3_KEYS)), False) in secrets, name
        assert (MLFLOW_SECRET, ("MLFLOW_TRACKING_URI",), False) in secrets, name
        assert int(executor["activeDeadlineSeconds"]) > 0, name
        assert executor["podMetadata"]["labels"]["app.kubernetes.io/part-of"] == "flowgrpo"
    evaluate = executors["exec-evaluate"]
    assert evaluate["podMetadata"]["labels"]["app.kubernetes.io/component"] == "evaluate"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in evaluate["tolerations"]
    assert evaluate["nodeSelector"]["labels"] == {"nvidia.com/gpu.present": "true"}
    resources = spec["deploymentSpec"]["executors"]["exec-evaluate"]["container"]["resources"]
    assert resources["accelerator"]["resourceCount"] == "1"
    images = {e["container"]["image"] for e in spec["deploymentSpec"]["executors"].values()}
    assert all(":" in i and not i.endswith(":latest") for i in images)
    # No secret value, and no pip install at pod start.
    text = json.dumps(spec)
    assert "pip install" not in text and "AWS_SECRET_ACCESS_KEY=" not in text


def test_cpu_variant_has_no_gpu(tmp_path):
    spec, platform = yaml.safe_load_all(compile_pipeline(tmp_path / "cpu.yaml", eval_gpus=0).read_text())
    assert "accelerator" not in spec["deploymentSpec"]["executors"]["exec-evaluate"]["container"].get("resources", {})
    executor = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]["exec-evaluate"]
    assert "tolerations" not in executor and "nodeSelector" not in executor


def test_config_parameter_forms():
    default = load_config(DEFAULT_CONFIG)
    assert config_from_parameter("") == default
    assert config_from_parameter("tiny-cpu", ["train.epochs=3"]).train.epochs == 3
    assert config_from_parameter(dump_config(default)) == default  # the YAML `run --local` passes
    as_json = json.dumps(default.model_dump(mode="json"))
    assert config_from_parameter(as_json, ["seed=7"]).seed == 7
    with pytest.raises(ConfigError, match="not a known config name"):
        config_from_parameter("no-such-config")
    with pytest.raises(ConfigError, match=r"train\.epochs"):
        config_from_parameter("train: {epochs: 0}")


def test_local_variant_has_no_retries(tmp_path):
    from kfp import compiler

    from pipeline.kfp_pipeline import build_pipeline

    path = tmp_path / "local.yaml"
    compiler.Compiler().compile(build_pipeline(eval_gpus=0, retries=False), str(path))
    spec, _ = yaml.safe_load_all(path.read_text())
    inner = spec["components"]["comp-exit-handler-1"]["dag"]["tasks"]
    assert all("retryPolicy" not in task for task in inner.values())
    assert "retryPolicy" not in spec["root"]["dag"]["tasks"]["teardown"]
