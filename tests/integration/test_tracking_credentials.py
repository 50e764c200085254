"""No credential in any log line, whoever prints it: MLflow prints its tracking URI in its own lines ("View run ...
at URI"), so a URI with user:password@ is refused and the credentials come from MLFLOW_TRACKING_USERNAME /
MLFLOW_TRACKING_PASSWORD; nor the user name in what MLflow stores (`mlflow.user` is the OS account). A real
`flowgrpo train` against a real MLflow server."""

from __future__ import annotations

import getpass
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient

from components.errors import ConfigError
from components.tracking.server import tracking_uri

REPO = Path(__file__).resolve().parents[2]
PASSWORD = "s3cretpw-7f3a"
USER = "tracking-login-5c1e"
TINY = ["--config", "tiny-cpu", "train.epochs=1", "sampling.prompts_per_epoch=2", "sampling.group_size=4",
        "sampling.batch_size_per_worker=4", "train.batch_size_per_worker=4", "sampling.num_steps=3",
        "tracking.system_metrics=false", "tracking.registered_model=null", "tracking.experiment=credentials"]


def _train(env: dict[str, str], output: Path, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", "train", "--output", str(output), *TINY, *overrides],
                          capture_output=True, text=True, cwd=REPO, env=env, timeout=300)


def _runs(url: str) -> int:
    experiment = MlflowClient(url).get_experiment_by_name("credentials")
    return 0 if experiment is None else len(MlflowClient(url).search_runs([experiment.experiment_id]))


def test_a_tracking_uri_with_credentials_is_refused_before_mlflow_prints_it(env, tmp_path):
    url = env["MLFLOW_TRACKING_URI"]
    before = _runs(url)
    with_credentials = url.replace("http://", f"http://someone:{PASSWORD}@")
    proc = _train(os.environ | {"MLFLOW_TRACKING_URI": with_credentials}, tmp_path / "refused")
    out = proc.stdout + proc.stderr
    assert PASSWORD not in out  # before: MLflow's "View run train at http://someone:<password>@..." line
    assert proc.returncode == 2 and "Traceback" not in out, out[-3000:]
    (line,) = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert "MLFLOW_TRACKING_URI" in line and "MLFLOW_TRACKING_USERNAME" in line and "MLFLOW_TRACKING_PASSWORD" in line
    assert _runs(url) == before  # refused before any run was opened


def test_credentials_from_the_environment_track_and_never_reach_the_output(env, tmp_path):
    url = env["MLFLOW_TRACKING_URI"]
    before = _runs(url)
    proc = _train(os.environ | {"MLFLOW_TRACKING_USERNAME": USER, "MLFLOW_TRACKING_PASSWORD": PASSWORD},
                  tmp_path / "tracked", "tracking.registered_model=credentials")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert PASSWORD not in out and "MLflow run: http://127.0.0.1" in out
    assert _runs(url) == before + 1

    # The run, its logged model and the registered version record the OS account as their user, never the
    # tracking login (before: MLflow stored MLFLOW_TRACKING_USERNAME as the logged model's mlflow.user).
    client = MlflowClient(url)
    experiment = client.get_experiment_by_name("credentials").experiment_id
    run = client.search_runs([experiment], order_by=["attributes.start_time DESC"])[0]
    (model,) = client.search_logged_models([experiment], filter_string=f"source_run_id = '{run.info.run_id}'")
    (version,) = client.search_model_versions(f"name = 'credentials' and run_id = '{run.info.run_id}'")
    users = {run.info.user_id, *(tags.get("mlflow.user") for tags in (run.data.tags, model.tags, version.tags))}
    assert users == {getpass.getuser()} != {USER}
    stored = [run.data.tags, run.data.params, model.tags, version.tags, {"": version.user_id}]
    assert not [d for d in stored if any(USER in str(v) for v in d.values())]


@pytest.mark.parametrize("uri", ["http://u:p@mlflow:5000", "https://token@mlflow.example", "http://u:@h:1/x"])
def test_every_reader_of_the_tracking_uri_refuses_credentials(uri, monkeypatch):
    """The trainer, evaluation, registration, the pipeline's parent runs and replay all read it here."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    with pytest.raises(ConfigError) as error:
        tracking_uri()
    assert uri.split("://")[1].split("@")[0] not in str(error.value)


@pytest.mark.parametrize("uri", ["http://127.0.0.1:5000", "sqlite:///mlflow.db", "databricks"])
def test_plain_tracking_uris_pass(uri, monkeypatch):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    assert tracking_uri() == uri
