"""Data-parallel training on a real local Ray (Ray Train TorchTrainer, gloo) against real S3 and MLflow.

Worker groups take about a minute to start on 2 cores, so each test starts as few runs as it can.
"""

import contextlib
import json
import os
import threading
import time
import uuid

import psutil
import pytest
import torch
from metric_rows import without_timing
from mlflow import MlflowClient
from safetensors.torch import load_file

from components import storage
from components.errors import ConfigError
from components.trainer import checkpoint as ckpt
from components.trainer.training_run import train
from pipeline.config import TINY_CONFIG, load_config

SMALL = ["sampling.prompts_per_epoch=2", "sampling.group_size=4", "sampling.batch_size_per_worker=4",
         "train.batch_size_per_worker=4", "sampling.num_steps=4", "tracking.system_metrics=false",
         "tracking.registered_model=null"]


@pytest.fixture(autouse=True)
def local_ray():
    """``train`` starts a local Ray itself (inheriting this test's environment, S3 keys included, as a user's
    shell would); stop it after each test."""
    import ray

    yield
    ray.shutdown()


def _lines():
    lines: list[str] = []
    return lines, lines.append


@pytest.mark.slow
def test_one_worker_equals_one_process_and_two_workers_see_the_same_first_epoch(tmp_path, capfd):
    config = load_config(TINY_CONFIG, [*SMALL, "train.epochs=2", "train.checkpoint_every=1"])
    _, log = _lines()
    single = train(config, tmp_path / "single", log=log)
    one = train(config, tmp_path / "one", log=log, workers=1)
    assert without_timing(one.history) == without_timing(single.history)
    a, b = load_file(str(single.lora_dir / ckpt.LORA_FILE)), load_file(str(one.lora_dir / ckpt.LORA_FILE))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    # batch sizes are per worker: 2 workers with micro-batches of 2 take the single process's optimizer steps of 4
    # samples; the 2-worker run also shards the frozen transformer (FSDP over Ray Train's gloo group) and
    # recomputes activations, which must change nothing it samples
    sharded = load_config(TINY_CONFIG, [*SMALL, "train.epochs=2", "train.checkpoint_every=1",
                                        "train.batch_size_per_worker=2", "train.sharding=fsdp",
                                        "train.gradient_checkpointing=true"])
    capfd.readouterr()
    two = train(sharded, tmp_path / "two", log=log, workers=2)
    worker_lines = capfd.readouterr().err  # the workers' status lines, forwarded by Ray
    assert "FSDP: 2 transformer blocks sharded over 2 worker(s)" in worker_lines
    assert "each 4 samples = 2 per worker x 1 accumulation x 2 worker(s)" in worker_lines
    first, first2 = single.history[0], two.history[0]
    # same model, same noise per sampling batch: the rewards of epoch 1 are the same up to float summation order
    # (a worker on 1 of the 2 cores runs its matmuls on fewer threads); rewards are ~0.5, so 1e-6 is float noise
    for key in ("reward/mean", "reward/std", "reward/brightness/mean"):
        assert first2[key] == pytest.approx(first[key], rel=1e-5, abs=1e-6), key
    assert [r["epoch"] for r in two.history] == [1, 2]
    assert [r["optimizer_step"] for r in two.history] == [r["optimizer_step"] for r in single.history] == [2, 4]


def test_worker_counts_that_cannot_split_an_epoch_are_refused(tmp_path):
    config = load_config(TINY_CONFIG, [*SMALL, "sampling.prompts_per_epoch=3", "sampling.batch_size_per_worker=4",
                                "train.batch_size_per_worker=4", "sampling.group_size=4"])
    with pytest.raises(ConfigError, match=r"2 workers: sampling.prompts_per_epoch \(3\) must be a multiple"):
        train(config, tmp_path / "x", workers=2)
    assert not (tmp_path / "x").exists()  # refused before anything is written


def _train_workers() -> list[psutil.Process]:
    """This test's Ray Train workers: its local Ray (started by ``train`` in this process) is this process's child,
    and other Ray sessions on the machine are not."""
    found = []
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if "RayTrainWorker" in " ".join(p.cmdline()):
                found.append(p)
    return found


@pytest.mark.slow
def test_two_workers_learn_into_s3_and_mlflow_and_a_killed_worker_resumes_from_the_last_checkpoint(services, env):
    s3, mlflow = services
    experiment = f"ray-{uuid.uuid4().hex[:6]}"
    uri = f"s3://{s3.bucket}/ray/{uuid.uuid4().hex[:8]}"
    config = load_config(TINY_CONFIG, ["train.epochs=12", "train.checkpoint_every=6",
                                       f"tracking.experiment={experiment}", "tracking.sample_every=6"])
    first = f"{uri}/checkpoints/epoch-000006"
    killed: dict = {}

    def kill_once_the_first_checkpoint_is_out() -> None:
        deadline = time.monotonic() + 1200  # 6 epochs take ~15 s alone, several minutes on a loaded CI
        while time.monotonic() < deadline:
            if (manifest := storage.complete_manifest(first)) and (victims := _train_workers()):
                killed["niceness"] = [v.nice() for v in victims]
                killed["published_at"] = manifest["published_at"]
                victims[-1].kill()
                killed["pid"] = victims[-1].pid
                return
            time.sleep(0.2)

    watcher = threading.Thread(target=kill_once_the_first_checkpoint_is_out, daemon=True)
    watcher.start()
    _, log = _lines()
    result = train(config, uri, log=log, workers=2)
    watcher.join(timeout=1)
    assert "pid" in killed, "no Ray Train worker was found to kill"
    # the local Ray's training workers run at this process's priority, not Ray's default niceness of 15
    assert killed["niceness"] == [os.nice(0)] * 2
    assert not psutil.pid_exists(int(killed["pid"])) or psutil.Process(int(killed["pid"])).status() == "zombie"
    summary = result.learning_summary()
    assert summary["learned"], summary
    rows = [json.loads(line) for line in storage.get_bytes(f"{uri}/metrics.jsonl").decode().splitlines()]
    assert [r["epoch"] for r in rows] == list(range(1, 13)) == [r["epoch"] for r in result.history]
    # resumed, not restarted: the checkpoint of epoch 6 was never published again
    assert storage.complete_manifest(first)["published_at"] == killed["published_at"]
    for epoch in (6, 12):  # every checkpoint is complete and readable
        assert ckpt.read_checkpoint(f"{uri}/checkpoints/epoch-{epoch:06d}").epoch == epoch
    assert ckpt.latest_checkpoint(uri) == f"{uri}/checkpoints/epoch-000012"
    assert storage.list_uris(f"{uri}/lora")
    # MLflow: one finished run, every epoch once (the one recomputed after the kill is not logged again)
    client = MlflowClient(mlflow.url)
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    assert run.info.status == "FINISHED"
    history = client.get_metric_history(run.info.run_id, "reward/mean")
    assert [(m.step, m.value) for m in history] == [(r["epoch"], pytest.approx(r["reward/mean"]))
                                                    for r in result.history]
    images = [f.path for f in client.list_artifacts(run.info.run_id, "images")]
    assert any("samples+step+6+" in p for p in images)
