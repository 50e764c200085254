"""Training against a real SeaweedFS (S3) and a real MLflow server (runs in PostgreSQL, artifacts in that S3).

Everything is checked through the services' own APIs: boto3 for S3, MlflowClient and pyfunc for MLflow.
"""

import base64
import contextlib
import hashlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import boto3
import numpy as np
import pandas as pd
import pytest
import torch
from botocore.config import Config
from browser import chromium_binary  # tests/browser.py
from mlflow import MlflowClient
from PIL import Image
from postgres_server import PostgresServer, postgres_cluster, running_postgres  # tests/postgres_server.py
from safetensors import safe_open
from safetensors.torch import load_file

from components.errors import TrackingError
from components.launch.process import free_ports
from components.models.generate import generate, load_with_lora
from components.registry.versions import register_lora_version
from components.tracking.replay import replay_run
from components.tracking.tracker import MlflowTracker
from components.trainer import checkpoint as ckpt
from components.trainer.run_output import RUN_RECORD_FILE, read_finished_run
from components.trainer.training_run import train
from pipeline.services.mlflow_server import running_mlflow
from pipeline.services.seaweed import SeaweedS3

REPO = Path(__file__).resolve().parents[2]
SMALL = ["train.epochs=4", "sampling.prompts_per_epoch=2", "sampling.group_size=4", "sampling.batch_size_per_worker=8",
         "train.batch_size_per_worker=4", "sampling.num_steps=4", "train.checkpoint_every=2", "tracking.sample_every=2",
         "tracking.sample_images=2"]
# what every epoch logs to MLflow (held-out rewards only on sampling epochs)
EPOCH_METRICS = ("reward/mean", "reward/std", "reward/brightness/mean", "update/advantage_abs_mean",
                 "zero_std_group_fraction", "failed_fraction", "policy_loss", "kl", "approx_kl", "clipfrac",
                 "grad_norm", "lr", "time/sampling", "time/scoring", "time/training", "images_per_s")


def _s3_client(s3: SeaweedS3):
    return boto3.client("s3", endpoint_url=s3.endpoint, aws_access_key_id=s3.access_key,
                        aws_secret_access_key=s3.secret_key, region_name=s3.region,
                        config=Config(s3={"addressing_style": "path"}))


def _keys(s3: SeaweedS3, prefix: str) -> dict[str, bytes]:
    client = _s3_client(s3)
    listed = client.list_objects_v2(Bucket=s3.bucket, Prefix=prefix).get("Contents", [])
    return {o["Key"][len(prefix):]: client.get_object(Bucket=s3.bucket, Key=o["Key"])["Body"].read() for o in listed}


def _config(*overrides: str):
    from pipeline.config import TINY_CONFIG, load_config

    return load_config(TINY_CONFIG, [*SMALL, *overrides])


def _header(path: Path) -> dict:
    with safe_open(str(path), "pt") as f:
        return f.metadata()


def _messages() -> tuple[list[str], object]:
    lines: list[str] = []
    return lines, lines.append


def _run_of(client: MlflowClient, experiment: str):
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    return run


@pytest.mark.slow
def test_tiny_run_lands_in_s3_and_mlflow_and_registers_a_working_model(services, env):
    s3, mlflow = services
    prefix = f"runs/{uuid.uuid4().hex[:8]}"
    experiment, model_name = f"e-{uuid.uuid4().hex[:6]}", f"m-{uuid.uuid4().hex[:6]}"
    config = _config(f"tracking.experiment={experiment}", f"tracking.registered_model={model_name}")
    lines, log = _messages()
    result = train(config, f"s3://{s3.bucket}/{prefix}", log=log)

    # S3: the run's files, the checkpoints behind a manifest and a pointer, the final LoRA byte for byte
    objects = _keys(s3, prefix + "/")
    rows = [json.loads(line) for line in objects["metrics.jsonl"].decode().splitlines()]
    assert [r["epoch"] for r in rows] == [1, 2, 3, 4] and rows == result.history
    assert objects["checkpoints/latest"].decode() == "epoch-000004"
    for epoch in ("epoch-000002", "epoch-000004"):
        manifest = json.loads(objects[f"checkpoints/{epoch}/_MANIFEST.json"])
        for rel, meta in manifest["files"].items():
            assert hashlib.sha256(objects[f"checkpoints/{epoch}/{rel}"]).hexdigest() == meta["sha256"]
    assert objects["lora/" + ckpt.LORA_FILE] == (result.lora_dir / ckpt.LORA_FILE).read_bytes()
    assert {"samples/epoch-000002.png", "samples/epoch-000004.png", "config.yaml"} <= set(objects)

    # MLflow: params, lineage tags, one value per epoch for every metric, system metrics, sample images
    client = MlflowClient(mlflow.url)
    run = _run_of(client, experiment)
    assert run.info.status == "FINISHED" and run.info.run_id in (result.mlflow_run_url or "")
    assert run.data.params["train.learning_rate"] == str(config.train.learning_rate)
    assert run.data.params["sampling.group_size"] == "4"
    dumped = json.dumps(config.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    assert run.data.tags["flowgrpo.config_hash"] == hashlib.sha256(dumped.encode()).hexdigest()
    assert run.data.tags["flowgrpo.latest_checkpoint"] == f"s3://{s3.bucket}/{prefix}/checkpoints/epoch-000004"
    for key in EPOCH_METRICS:
        history = client.get_metric_history(run.info.run_id, key)
        assert [(m.step, m.value) for m in history] == [(r["epoch"], pytest.approx(r[key])) for r in rows], key
    assert any(k.startswith("system/") for k in run.data.metrics)
    assert _grid_steps(client, run.info.run_id) == [0, 2, 4]  # 0: the base model, sampled before any update
    assert client.get_experiment(run.info.experiment_id).tags["mlflow.experimentKind"] == "custom_model_development"
    secrets = (s3.secret_key, s3.access_key)
    assert not any(s in json.dumps([run.data.params, run.data.tags]) for s in secrets)

    # the Model Registry: a version with lineage whose pyfunc makes the trained LoRA's images
    (version,) = client.search_model_versions(f"name='{model_name}'")
    assert f"registered {model_name} version {version.version}" in "\n".join(lines)
    assert version.run_id == run.info.run_id
    assert version.tags["flowgrpo.run_id"] == run.info.run_id
    assert version.tags["flowgrpo.lora_uri"] == f"s3://{s3.bucket}/{prefix}/lora"
    assert version.tags["flowgrpo.config_hash"] == run.data.tags["flowgrpo.config_hash"]
    import mlflow.pyfunc

    served = mlflow.pyfunc.load_model(f"models:/{model_name}/{version.version}")
    prompts = ["a red apple", "a blue car"]
    out = served.predict(pd.DataFrame({"prompt": prompts}),
                         params={"seed": 3, "num_inference_steps": 4, "guidance_scale": 1.0})
    got = np.stack([np.asarray(Image.open(io.BytesIO(base64.b64decode(b)))) for b in out["image_png_b64"]])
    kw = {"resolution": 32, "num_steps": 4, "guidance_scale": 1.0, "seed": 3}
    expected = generate(load_with_lora(config.model, config.seed, result.lora_dir), prompts, **kw)
    base = generate(load_with_lora(config.model, config.seed, None), prompts, **kw)
    assert np.array_equal(got, expected)
    assert not np.array_equal(got, base)  # the registered model really carries the LoRA

    # replayed from the output, the run is the one MLflow would have had: refused where the live run is,
    # equal to it elsewhere
    output = read_finished_run(f"s3://{s3.bucket}/{prefix}")
    assert run.data.tags["flowgrpo.run_output"] == output.uri
    with pytest.raises(TrackingError, match=f"already in MLflow experiment '{experiment}' as run {run.info.run_id}"):
        replay_run(output, run_name="again", register=register_lora_version, log=log)
    replayed = replay_run(output, run_name="replayed", experiment=experiment + "-replay",
                          register=register_lora_version, log=log)
    copy = client.get_run(replayed.run_id)
    assert copy.info.status == replayed.status == "FINISHED" and copy.info.run_name == "replayed"
    assert copy.data.params == run.data.params
    live_tags = {k: v for k, v in run.data.tags.items() if k.startswith("flowgrpo.")}
    assert {k: v for k, v in copy.data.tags.items() if k.startswith("flowgrpo.")} == {**live_tags,
                                                                                     "flowgrpo.replayed": "true"}
    live_keys = {k for k in run.data.metrics if not k.startswith("system/")}
    assert set(copy.data.metrics) == live_keys
    for key in live_keys:
        assert ([(m.step, m.value) for m in client.get_metric_history(copy.info.run_id, key)]
                == [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, key)]), key
    assert _grid_steps(client, copy.info.run_id) == _grid_steps(client, run.info.run_id) == [0, 2, 4]
    (again,) = [v for v in client.search_model_versions(f"name='{model_name}'") if v.run_id == copy.info.run_id]
    assert replayed.registered_version == again.version and again.version != version.version
    assert again.tags["flowgrpo.lora_uri"] == version.tags["flowgrpo.lora_uri"]
    out = mlflow.pyfunc.load_model(f"models:/{model_name}/{again.version}").predict(
        pd.DataFrame({"prompt": prompts}), params={"seed": 3, "num_inference_steps": 4, "guidance_scale": 1.0})
    assert np.array_equal(np.stack([np.asarray(Image.open(io.BytesIO(base64.b64decode(b))))
                                    for b in out["image_png_b64"]]), got)


def _grid_steps(client: MlflowClient, run_id: str) -> list[int]:
    """The steps of the sample grids logged in a run: under MLflow's image key (images/samples+step+N+..., what
    the chart view's image card reads), and under the same stable names as in the run output."""
    names = [f.path.split("/")[-1] for f in client.list_artifacts(run_id, "images")]
    steps = sorted({int(n.split("+step+")[1].split("+")[0]) for n in names if n.startswith("samples+step+")})
    stable = [f.path for f in client.list_artifacts(run_id, "samples")]
    assert stable == [f"samples/epoch-{step:06d}.png" for step in steps]
    return steps


KILLER = """
import os, sys
from components import storage
real, calls = storage._put_file, []
def put_then_die(src, uri):
    if "/checkpoints/epoch-000004/" in uri:
        calls.append(uri)
        if len(calls) == 2:  # one file of the checkpoint is up, the next never arrives
            os._exit(137)
    real(src, uri)
storage._put_file = put_then_die
from pipeline.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_kill_mid_checkpoint_upload_then_resume_matches_an_uninterrupted_run(services, env, tmp_path):
    s3, mlflow = services
    experiment = f"e-{uuid.uuid4().hex[:6]}"
    # the last epoch's checkpoint is the one cut off: the resumed run trains epochs 3 and 4 again
    args = [*SMALL, f"tracking.experiment={experiment}", "tracking.registered_model=null",
            "tracking.system_metrics=false"]
    uri = f"s3://{s3.bucket}/runs/{uuid.uuid4().hex[:8]}"
    killed = subprocess.run([sys.executable, "-c", KILLER, "train", "--config", "tiny-cpu", "--output", uri, *args],
                            cwd=REPO, capture_output=True, text=True, timeout=600, env={**os.environ, **env})
    assert killed.returncode == 137, killed.stderr
    assert ckpt.latest_checkpoint(uri) == f"{uri}/checkpoints/epoch-000002"
    partial = _keys(s3, uri.split("/", 3)[3] + "/checkpoints/epoch-000004/")
    assert len(partial) == 1 and "_MANIFEST.json" not in partial  # the half-uploaded one is there, unpublished

    lines, log = _messages()
    resumed = train(_config(*args[len(SMALL):]), uri, resume=True, log=log)
    assert any("resumed from" in line and "epoch-000002" in line for line in lines)
    full = train(_config(*args[len(SMALL):], "tracking.experiment=uninterrupted"), tmp_path / "full", log=log)
    a, b = load_file(str(full.lora_dir / ckpt.LORA_FILE)), load_file(str(resumed.lora_dir / ckpt.LORA_FILE))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # every weight, bit for bit
    # the header's metadata too (compared as a mapping: safetensors writes its keys in hash-map order)
    assert _header(full.lora_dir / ckpt.LORA_FILE) == _header(resumed.lora_dir / ckpt.LORA_FILE)

    # the resumed run continues the killed run's MLflow run: one run, every epoch present
    client = MlflowClient(mlflow.url)
    run = _run_of(client, experiment)
    assert run.info.status == "FINISHED"
    # every epoch once: the epochs the killed run logged after its checkpoint were not logged again
    steps = sorted(m.step for m in client.get_metric_history(run.info.run_id, "reward/mean"))
    assert steps == [1, 2, 3, 4]
    last = client.get_metric_history(run.info.run_id, "reward/mean")
    assert [m.value for m in last if m.step == 4] == [pytest.approx(resumed.history[-1]["reward/mean"])]


def test_outage_is_buffered_and_delivered_when_mlflow_comes_back(postgres: PostgresServer, tmp_path,
                                                                  monkeypatch: pytest.MonkeyPatch):
    (port,) = free_ports(1)
    url = f"http://127.0.0.1:{port}"
    monkeypatch.setenv("FLOWGRPO_MLFLOW_OPEN_TIMEOUT_S", "1")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    lines, log = _messages()
    tracker = MlflowTracker(url, "outage", "r", system_metrics=False, log=log)
    assert tracker.run_id is None
    for step in (1, 2, 3):
        tracker.log_metrics({"reward/mean": step / 10, "skipped": float("nan")}, step=step)
    with running_mlflow(tmp_path / "mlflow", port=port, backend_store_uri=postgres.new_database()) as server:
        tracker.close()
        client = MlflowClient(server.url)
        run = _run_of(client, "outage")
        history = client.get_metric_history(run.info.run_id, "reward/mean")
        assert [(m.step, m.value) for m in history] == [(1, 0.1), (2, 0.2), (3, 0.3)]
        assert "skipped" not in run.data.metrics  # NaN is not a value to plot
        assert run.info.status == "FINISHED"
    assert sum("unreachable" in line for line in lines) == 1
    assert any("reachable again" in line for line in lines)


def test_a_postgres_crash_mid_run_is_buffered_and_every_epoch_reaches_mlflow(tmp_path,
                                                                            monkeypatch: pytest.MonkeyPatch):
    """The cluster's MLflow keeps its runs in Postgres. The database dies (SIGKILL of the postmaster) once epoch 1 is
    logged and comes back, crash-recovered from the same files, once epoch 3 is: MLflow answers 503 meanwhile, the
    tracker buffers and retries, and the run ends with every epoch in MLflow exactly once and its LoRA registered."""
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setenv("FLOWGRPO_CACHE_DIR", str(tmp_path / "cache"))
    experiment, model_name = f"e-{uuid.uuid4().hex[:6]}", f"m-{uuid.uuid4().hex[:6]}"
    lines: list[str] = []
    with postgres_cluster() as data, contextlib.ExitStack() as database:
        first = database.enter_context(running_postgres(data))
        with running_mlflow(tmp_path / "mlflow", backend_store_uri=first.new_database()) as server:
            monkeypatch.setenv("MLFLOW_TRACKING_URI", server.url)

            def log(line: str) -> None:
                lines.append(line)
                if line.startswith("epoch 1/"):
                    first.crash()
                    database.close()  # the dead server's process group is swept
                elif line.startswith("epoch 3/"):
                    database.enter_context(running_postgres(data, port=first.port))

            result = train(_config(f"tracking.experiment={experiment}",
                                   f"tracking.registered_model={model_name}", "tracking.system_metrics=false"),
                           tmp_path / "out", log=log)
            assert [r["epoch"] for r in result.history] == [1, 2, 3, 4]
            assert sum("unreachable" in line for line in lines) == 1, lines
            assert any("reachable again" in line for line in lines), lines
            assert not any("not sent" in line for line in lines), lines

            client = MlflowClient(server.url)
            run = _run_of(client, experiment)
            assert run.info.status == "FINISHED"
            for key in EPOCH_METRICS:
                history = client.get_metric_history(run.info.run_id, key)
                assert [m.step for m in history] == [1, 2, 3, 4], key
                assert [m.value for m in history] == [pytest.approx(r[key]) for r in result.history], key
            assert _grid_steps(client, run.info.run_id) == [0, 2, 4]
            (version,) = client.search_model_versions(f"name='{model_name}'")
            assert version.run_id == run.info.run_id


def test_training_finishes_when_mlflow_never_answers(tmp_path, monkeypatch: pytest.MonkeyPatch):
    (port,) = free_ports(1)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("FLOWGRPO_MLFLOW_OPEN_TIMEOUT_S", "1")
    monkeypatch.setenv("FLOWGRPO_MLFLOW_FLUSH_TIMEOUT_S", "1")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    lines, log = _messages()
    result = train(_config("train.epochs=2"), tmp_path / "out", log=log)
    assert [r["epoch"] for r in result.history] == [1, 2]
    assert ckpt.latest_checkpoint(tmp_path / "out") == str(tmp_path / "out" / "checkpoints" / "epoch-000002")
    assert sum("unreachable" in line for line in lines) == 1
    (left,) = [line for line in lines if "not sent" in line]
    assert "metrics.jsonl" in left and result.mlflow_run_url is None


def test_a_server_never_reached_is_not_waited_for_at_the_end_and_the_run_is_replayed_later(
        services, tmp_path, monkeypatch: pytest.MonkeyPatch, capsys):
    _, server = services
    (port,) = free_ports(1)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("FLOWGRPO_MLFLOW_OPEN_TIMEOUT_S", "1")
    monkeypatch.delenv("FLOWGRPO_MLFLOW_FLUSH_TIMEOUT_S", raising=False)  # the default: 120 s
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    lines, log = _messages()
    config = _config("train.epochs=2", "tracking.sample_every=1")
    start = time.monotonic()
    result = train(config, tmp_path / "out", log=log)
    assert time.monotonic() - start < 60  # two tiny epochs; waiting out the flush timeout would take 120 s more
    (left,) = [line for line in lines if "not sent" in line]
    assert "never reachable" in left and "metrics.jsonl" in left
    # nothing is lost: what MLflow would have held is in the run output
    assert [r["epoch"] for r in result.history] == [1, 2]
    assert sorted(p.name for p in (tmp_path / "out" / "samples").iterdir()) == [
        "epoch-000000.png", "epoch-000001.png", "epoch-000002.png"]
    assert (result.lora_dir / ckpt.LORA_FILE).is_file()

    # once MLflow is there, the command line replays the output into it
    experiment = f"e-{uuid.uuid4().hex[:6]}"
    env = {**os.environ, "MLFLOW_TRACKING_URI": server.url}
    proc = _flowgrpo(env, "replay-mlflow", str(tmp_path / "out"), "--experiment", experiment, "--no-register")
    assert proc.returncode == 0, proc.stderr
    client = MlflowClient(server.url)
    run = _run_of(client, experiment)
    assert run.info.run_id in proc.stdout and run.info.status == "FINISHED" and run.info.run_name == "out"
    for key in ("reward/mean", "policy_loss", "images_per_s"):
        history = client.get_metric_history(run.info.run_id, key)
        assert [(m.step, m.value) for m in history] == [(r["epoch"], pytest.approx(r[key])) for r in result.history]
    record = json.loads((tmp_path / "out" / RUN_RECORD_FILE).read_text())
    assert run.info.start_time == record["started_at_ms"]
    assert run.data.tags["flowgrpo.config_hash"] == record["lineage"]["flowgrpo.config_hash"]
    assert run.data.params["train.epochs"] == "2"
    assert _grid_steps(client, run.info.run_id) == [0, 1, 2]
    lora = Path(client.download_artifacts(run.info.run_id, f"lora/{ckpt.LORA_FILE}", str(tmp_path / "dl")))
    assert lora.read_bytes() == (result.lora_dir / ckpt.LORA_FILE).read_bytes()

    # all or nothing: a replay MLflow refuses part-way (a model name it forbids, edited into the output's
    # config) leaves no run behind; an output without a config is not a run output
    from pipeline.cli import main

    monkeypatch.setenv("MLFLOW_TRACKING_URI", server.url)
    config_file = tmp_path / "out" / "config.yaml"
    config_file.write_text(config_file.read_text().replace("registered_model: flowgrpo-lora",
                                                           "registered_model: team/lora"))
    capsys.readouterr()
    assert main(["replay-mlflow", str(tmp_path / "out"), "--experiment", experiment + "-b"]) == 2
    err = capsys.readouterr().err
    (line,) = [line for line in err.splitlines() if "error:" in line]
    assert "registering the LoRA as 'team/lora' failed" in line and "was deleted" in line, err
    assert client.search_runs([client.get_experiment_by_name(experiment + "-b").experiment_id]) == []
    assert main(["replay-mlflow", str(tmp_path / "samples-only")]) == 2
    (line,) = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
    assert "is not a run output: it has no config.yaml" in line


def _flowgrpo(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env=env)


def _one_error(proc: subprocess.CompletedProcess, *secrets: str) -> str:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    (line,) = [line for line in proc.stderr.splitlines() if "error:" in line]
    for secret in secrets:
        assert secret not in proc.stderr + proc.stdout
    return line


@pytest.mark.slow
def test_wrong_credentials_and_missing_bucket_stop_the_run_with_one_clear_line(services, env, tmp_path):
    s3, _ = services
    base = {**os.environ, **env}
    wrong = "SK" + uuid.uuid4().hex
    line = _one_error(_flowgrpo({**base, "AWS_SECRET_ACCESS_KEY": wrong}, "train", "--output",
                                f"s3://{s3.bucket}/runs/x", *SMALL), wrong, s3.secret_key)
    assert s3.endpoint in line and s3.bucket in line and "access denied" in line and "AWS_SECRET_ACCESS_KEY" in line
    line = _one_error(_flowgrpo(base, "train", "--output", "s3://no-such-bucket-here/runs/x", *SMALL),
                      s3.secret_key)
    assert "no-such-bucket-here" in line and "bucket" in line.lower()


@pytest.mark.slow
def test_unreachable_mlflow_is_one_clear_line_and_not_fatal(services, env, tmp_path):
    (port,) = free_ports(1)
    proc = _flowgrpo({**os.environ, **env, "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{port}",
                      "MLFLOW_TRACKING_USERNAME": "alice", "MLFLOW_TRACKING_PASSWORD": "pa55word",
                      "FLOWGRPO_MLFLOW_OPEN_TIMEOUT_S": "1", "FLOWGRPO_MLFLOW_FLUSH_TIMEOUT_S": "1"},
                     "train", "--config", "tiny-cpu", "--output", str(tmp_path / "out"), *SMALL,
                     "train.epochs=1")
    assert proc.returncode == 0, proc.stderr
    assert "pa55word" not in proc.stderr + proc.stdout
    reach = [line for line in proc.stderr.splitlines() if "MLflow" in line and "unreachable" in line]
    assert len(reach) == 1 and f"http://127.0.0.1:{port}" in reach[0], proc.stderr
    (left,) = [line for line in proc.stderr.splitlines() if "never reachable" in line]
    assert f"http://127.0.0.1:{port}" in left
    assert "LoRA:" in proc.stdout


def test_child_run_of_a_parent_and_a_wrong_parent_turns_tracking_off(services, env):
    _, mlflow = services
    client = MlflowClient(mlflow.url)
    experiment = f"e-{uuid.uuid4().hex[:6]}"
    parent = client.create_run(client.create_experiment(experiment), run_name="pipeline").info.run_id
    lines, log = _messages()
    child = MlflowTracker(mlflow.url, experiment, "train", parent_run_id=parent, system_metrics=False, log=log)
    child.log_metrics({"reward/mean": 1.5}, step=1)
    child.close()
    run = client.get_run(child.run_id)
    assert run.data.tags["mlflow.parentRunId"] == parent and run.info.run_name == "train"
    assert run.data.metrics["reward/mean"] == 1.5

    lines, log = _messages()
    orphan = MlflowTracker(mlflow.url, experiment, "train", parent_run_id="0" * 32, system_metrics=False, log=log)
    orphan.log_metrics({"reward/mean": 1.0}, step=1)
    orphan.close()
    assert orphan.run_id is None
    (line,) = [line for line in lines if "rejected" in line]
    assert "open run" in line and "tracking is off" in line
    assert len(client.search_runs([client.get_experiment_by_name(experiment).experiment_id])) == 2


def test_sqlite_tracking_uri_needs_no_server(tmp_path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.chdir(tmp_path)  # a sqlite store keeps artifacts in ./mlruns
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("FLOWGRPO_CACHE_DIR", str(tmp_path / "cache"))
    _, log = _messages()
    result = train(_config("train.epochs=2", "tracking.experiment=local", "tracking.registered_model=local-lora",
                           "tracking.system_metrics=false"), tmp_path / "out", log=log)
    client = MlflowClient(uri)
    run = _run_of(client, "local")
    history = client.get_metric_history(run.info.run_id, "reward/mean")
    assert [(m.step, m.value) for m in history] == [(r["epoch"], pytest.approx(r["reward/mean"]))
                                                    for r in result.history]
    (version,) = client.search_model_versions("name='local-lora'")
    assert version.run_id == run.info.run_id


def test_experiments_are_model_training_ones_and_a_chosen_kind_is_kept(tmp_path, monkeypatch: pytest.MonkeyPatch):
    from components.tracking.server import EXPERIMENT_KIND_TAG, experiment_id

    monkeypatch.chdir(tmp_path)
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    created = experiment_id(client, "fresh")
    assert client.get_experiment(created).tags[EXPERIMENT_KIND_TAG] == "custom_model_development"
    older = client.create_experiment("made-before")  # e.g. by an older flowgrpo: no kind yet
    assert experiment_id(client, "made-before") == older
    assert client.get_experiment(older).tags[EXPERIMENT_KIND_TAG] == "custom_model_development"
    chosen = client.create_experiment("chosen", tags={EXPERIMENT_KIND_TAG: "genai_development"})
    assert experiment_id(client, "chosen") == chosen
    assert client.get_experiment(chosen).tags[EXPERIMENT_KIND_TAG] == "genai_development"


def _chart_sections(url: str) -> list[str]:
    """The section titles of MLflow's chart view at ``url`` in the order a person sees them: headless Chromium runs
    the UI's JavaScript against the server and the rendered page is read."""
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        page = subprocess.run([chromium_binary(), "--headless=new", "--no-sandbox", "--disable-gpu",
                               "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--virtual-time-budget=30000",
                               "--dump-dom", url], capture_output=True, text=True, timeout=180, check=True).stdout
    return re.findall(r'data-testid="experiment-view-compare-runs-section-header"[^>]*><div[^>]*><div[^>]*>([^<]+)<',
                      page)


def test_the_pipeline_run_shows_the_evaluation_and_the_model_version_and_its_charts_open_rewards_first(services, env):
    """What `run --local` links: the pipeline run carries the evaluation's numbers, the gate's verdict and a link to
    the registered version; the experiment's chart view lists the reward curves before the evaluation's bars,
    which MLflow's UI would otherwise sort first (checked in the UI itself)."""
    from urllib.parse import quote

    from components.tracking.pipeline_runs import parent_run, parent_run_links, show_evaluation, show_model_version

    _, mlflow = services
    client = MlflowClient(mlflow.url)
    experiment, run_name, model = f"e-{uuid.uuid4().hex[:6]}", f"flowgrpo-{uuid.uuid4().hex[:6]}", "demo lora"
    parent = parent_run(experiment, f"pipeline-{uuid.uuid4().hex}", run_name)
    train_run = MlflowTracker(mlflow.url, experiment, "train", parent_run_id=parent, system_metrics=False,
                              log=_messages()[1])
    for epoch in (1, 2, 3):
        train_run.log_metrics({"reward/mean": 0.1 * epoch, "reward/shapes/mean": 0.2 * epoch, "kl": 0.01}, epoch)
    train_run.close()
    rewards = {"shapes": {"base_mean": 0.25, "lora_mean": 0.3125, "delta": 0.0625, "ci_low": 0.0125,
                          "ci_high": 0.125, "n": 32, "ci_level": 0.95},
               "strict": {"base_mean": 0.125, "lora_mean": 0.0625, "delta": -0.0625, "ci_low": float("nan"),
                          "ci_high": 0.0, "n": 32, "ci_level": 0.95}}
    lines, log = _messages()
    show_evaluation(parent, rewards, {"flowgrpo.gate": "refused", "flowgrpo.gate_reason": "shapes: too few"}, log=log)
    client.create_registered_model(model)
    version = client.create_model_version(model, "s3://nowhere/lora", run_id=train_run.run_id).version
    show_model_version(train_run.run_id, model, version, log=log)
    assert lines == []

    shown = client.get_run(parent).data
    assert {k: v for k, v in shown.metrics.items() if k.startswith("eval/")} == {
        "eval/shapes/base_mean": 0.25, "eval/shapes/lora_mean": 0.3125, "eval/shapes/delta": 0.0625,
        "eval/shapes/ci_low": 0.0125, "eval/shapes/ci_high": 0.125, "eval/strict/base_mean": 0.125,
        "eval/strict/lora_mean": 0.0625, "eval/strict/delta": -0.0625, "eval/strict/ci_high": 0.0}  # no NaN in MLflow
    assert shown.tags["flowgrpo.gate"] == "refused" and shown.tags["flowgrpo.gate_reason"] == "shapes: too few"
    assert shown.tags["flowgrpo.model_version"] == f"{model}/{version}"
    url = shown.tags["flowgrpo.model_version_url"]
    assert url == f"{mlflow.url}/#/models/demo%20lora/versions/{version}"  # the UI's route of a model version
    assert client.get_model_version(model, version).run_id == train_run.run_id
    # The run page's Description (Markdown) links the version relative to the UI and sums the evaluation up.
    description = shown.tags["mlflow.note.content"]
    assert f"[{model} version {version}](#/models/{quote(model)}/versions/{version})" in description
    assert "**Gate: refused**: shapes: too few" in description
    assert "- shapes: base 0.25 -> LoRA 0.3125, delta +0.0625, CI [+0.0125, +0.125]" in description

    charts, run_page = parent_run_links(run_name, mlflow.url)
    assert run_page.startswith(f"{mlflow.url}/#/experiments/") and f"/runs/{parent}?" in run_page
    assert "compareRunsMode=CHART" in charts
    sections = _chart_sections(charts)
    assert sections[:2] == ["reward", "reward/shapes"] and {"eval/shapes", "eval/strict"} <= set(sections[2:]), sections


def test_an_experiment_created_by_another_run_between_lookup_and_create_is_used(tmp_path, monkeypatch):
    """Two pipelines starting at once against one server: both look the experiment up, find none, and create it;
    the one that loses the race takes the winner's experiment instead of failing."""
    from components.tracking.server import experiment_id

    monkeypatch.chdir(tmp_path)
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")

    class LostRace:
        """The other run creates the experiment right after this one's lookup."""

        def __init__(self) -> None:
            self.looked_up = False

        def get_experiment_by_name(self, name: str):
            if not self.looked_up:
                self.looked_up = True
                client.create_experiment(name)
                return None
            return client.get_experiment_by_name(name)

        def __getattr__(self, attr: str):
            return getattr(client, attr)

    assert experiment_id(LostRace(), "shared") == client.get_experiment_by_name("shared").experiment_id
