"""`flowgrpo rayjob` as a user runs it: a valid RayJob on stdout, or one error line and exit 2."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.config import DEFAULT_CONFIG

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: rayjob_schema
import rayjob_schema

REPO = Path(__file__).resolve().parents[2]
SD35 = REPO / "pipeline" / "configs" / "sd35-medium-ocr.yaml"


def flowgrpo(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", "rayjob", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=120, env=os.environ | {"KUBECONFIG": "/nonexistent"})  # no cluster


def test_prints_a_valid_rayjob_for_the_gpu_config():
    proc = flowgrpo("--config", str(SD35), "--run-id", "ocr-7", "--output", "s3://exp/ocr-7",
                    "--mlflow-parent-run-id", "abc123", "cluster.workers.replicas=4")
    assert proc.returncode == 0, proc.stderr
    manifest = yaml.safe_load(proc.stdout)
    assert rayjob_schema.errors(manifest) == []
    assert manifest["metadata"]["name"] == "flowgrpo-ocr-7"
    assert manifest["spec"]["entrypoint"] == ("python -m components.trainer --config env:FLOWGRPO_EXPERIMENT_CONFIG "
                                              "--output s3://exp/ocr-7 --ray-workers 4 --auto-resume")
    assert "FLOWGRPO_MLFLOW_PARENT_RUN_ID: abc123" in manifest["spec"]["runtimeEnvYAML"]


def test_defaults_are_deterministic_from_the_config():
    first, second = flowgrpo(), flowgrpo()
    assert first.returncode == 0, first.stderr
    assert first.stdout == second.stdout
    manifest = yaml.safe_load(first.stdout)
    assert rayjob_schema.errors(manifest) == []
    run_id = manifest["metadata"]["annotations"]["flowgrpo.io/run-id"]
    assert run_id.startswith(f"{DEFAULT_CONFIG.stem}-")
    assert manifest["metadata"]["annotations"]["flowgrpo.io/output"] == f"s3://flowgrpo/runs/{run_id}"
    changed = yaml.safe_load(flowgrpo("train.epochs=3").stdout)
    assert changed["metadata"]["name"] != manifest["metadata"]["name"]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["cluster.workers.gpus_per_worker=2"], "GPUs requested without a GPU node pool"),
        (["cluster.image=ghcr.io/flowgrpo/flowgrpo-trainer:latest"], "cluster.image"),
        (["cluster.workers.replicas=0"], "cluster.workers.replicas"),
        (["--output", "runs/local"], "must be an s3:// URI"),
    ],
)
def test_bad_input_is_one_error_line_and_exit_2(args, needle):
    proc = flowgrpo(*args)
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == "" and "Traceback" not in proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("flowgrpo rayjob: error: ") and needle in line


def test_the_trainer_cli_reads_the_config_the_rayjob_carries():
    manifest = yaml.safe_load(flowgrpo("--config", str(SD35), "train.epochs=11").stdout)
    env_vars = yaml.safe_load(manifest["spec"]["runtimeEnvYAML"])["env_vars"]
    config_arg = manifest["spec"]["entrypoint"].split("--config ")[1].split()[0]
    proc = subprocess.run([sys.executable, "-m", "pipeline.cli", "validate", "--config", config_arg],
                          capture_output=True, text=True, cwd=REPO, timeout=120, env=os.environ | env_vars)
    assert proc.returncode == 0, proc.stderr
    assert "diffusers, 11 epochs" in proc.stdout
