"""`flowgrpo run --local`: the whole pipeline under kfp.local with real SeaweedFS, MLflow, reward server and
Ray; then what it left (S3 objects, MLflow runs, the registered model, the report, read back as a user behind AWS
SSO), the cached dataset step on a second run, SIGTERM, a kill -9 (nothing of the run trains on), and a failing
training step that still tears the reward server down."""

# No `from __future__ import annotations`: kfp reads the test components' annotations as types.
import contextlib
import io
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from aws_users import SSO_ENV, sso_user  # tests/aws_users.py
from kfp import dsl

from components.environ import patched_environ
from pipeline.config import DEFAULT_CONFIG, load_config
from pipeline.local_run import BUCKET, _following_kfp_local, _Progress, local_services

pytestmark = pytest.mark.slow
# Small shapes: each test asserts what the steps leave and how a run stops, not how much it learns.
CONFIG = ["train.epochs=3", "train.checkpoint_every=2", "tracking.sample_every=1", "tracking.sample_images=4",
          "sampling.prompts_per_epoch=4", "sampling.num_steps=6", "sampling.eval_num_steps=6", "eval.max_prompts=16"]
REGISTERED = load_config(DEFAULT_CONFIG).tracking.registered_model  # the default run registers its LoRA there
STEPS = ["prepare-dataset", "deploy-reward-server", "train", "evaluate", "register", "teardown"]


def _flowgrpo(workdir: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "pipeline.cli", "run", "--local", "--workdir", str(workdir), *args]


def _clean_env() -> dict[str, str]:
    # The run starts its own services; nothing of the test session's may leak in.
    drop = ("MLFLOW_TRACKING_URI", "AWS_ENDPOINT_URL_S3", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "RAY_ADDRESS")
    return {k: v for k, v in os.environ.items() if k not in drop}


def _processes_under(workdir: Path) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(proc.info["cmdline"] or [])
        if str(workdir) in cmdline and proc.pid != os.getpid():
            found.append(proc)
    return found


@pytest.fixture(scope="module")
def first_run(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    workdir = tmp_path_factory.mktemp("local") / "wd"
    done = subprocess.run(_flowgrpo(workdir, *CONFIG), capture_output=True, text=True, timeout=900,
                          env=_clean_env())
    return workdir, done


@dsl.component(base_image="python:3.11", install_kfp_package=False)
def echo_step(text: str) -> str:
    print(f"echo says {text}")
    return text


@dsl.component(base_image="python:3.11", install_kfp_package=False)
def failing_step(text: str):
    print("about to fail")
    raise ValueError(f"no good: {text}")


@dsl.pipeline(name="progress-events")
def _two_steps(text: str):
    failing_step(text=echo_step(text=text).output)


def test_progress_lines_come_from_kfp_local_task_events(tmp_path):
    """The step lines come from kfp.local's task calls (not its log text): a step that runs, one that fails
    (with the error its output ends with), and the first one again answered by the cache."""
    from kfp import local
    from kfp.local import subprocess_task_handler
    from kfp.local.orchestrator import task_executor

    hooked = (task_executor.execute_single_task, subprocess_task_handler.SubprocessTaskHandler.run)
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(tmp_path / "root"),
               workspace_root=str(tmp_path / "workspace"), raise_on_error=False, enable_caching=True,
               cache_root=str(tmp_path / "cache"))
    shown, runs = [], []
    for _ in range(2):
        terminal = io.StringIO()
        progress = _Progress(tmp_path / "run.log", terminal)
        with _following_kfp_local(progress):
            _two_steps(text="hello")
        progress.close()
        shown.append(terminal.getvalue())
        runs.append(progress)
    failed = r"▶ failing-step\n  about to fail\n✗ failing-step failed after \d+\.\d s: ValueError: no good: hello\n"
    assert re.fullmatch(r"▶ echo-step\n  echo says hello\n✓ echo-step \(\d+\.\d s\)\n" + failed, shown[0]), shown[0]
    assert re.fullmatch(r"✓ echo-step \(cached: the same inputs as an earlier run\)\n" + failed, shown[1]), shown[1]
    assert [p.failed for p in runs] == [[("failing-step", "ValueError: no good: hello")]] * 2
    assert runs[1].seconds["echo-step"] == 0.0 and runs[0].seconds["echo-step"] > 0
    log = (tmp_path / "run.log").read_text()
    assert "Got executor_input" in log and "Task echo-step cache hit" in log  # kfp's own lines: in the log only
    assert (task_executor.execute_single_task, subprocess_task_handler.SubprocessTaskHandler.run) == hooked


def test_run_local_runs_every_step_and_leaves_everything_in_s3_and_mlflow(first_run, tmp_path, monkeypatch):
    workdir, done = first_run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    out = done.stdout
    for step in STEPS:  # each step shown starting and ending with its duration, in order
        assert re.search(rf"^▶ {step}$", out, re.M) and re.search(rf"^✓ {step} \(\d+\.\d s\)$", out, re.M), step
    assert [m.group(1) for m in re.finditer(r"^▶ (\S+)$", out, re.M)] == STEPS
    assert re.search(r"^  .*epoch 3/3 reward", out, re.M)  # the training progress inside its step
    assert "Got executor_input" not in out  # kfp's chatter stays in the log file
    assert "View the dashboard" not in out and out.count("MLflow run ") == 2  # train and evaluate, once each
    printed = dict(re.findall(r"^(MLflow run|MLflow charts|report|LoRA|samples|registered model|log): (\S+)", out,
                              re.M))
    report = Path(printed["report"])
    assert report.is_file() and report.suffix == ".html" and "geneval_strict" in report.read_text()
    assert Path(printed["log"]).is_file() and "Got executor_input" in Path(printed["log"]).read_text()
    # The LoRA on this machine, in a folder named by the run id of its S3 output, with how to load it.
    lora_path = Path(printed["LoRA"])
    lora = re.search(r"^  load it: pipe\.load_lora_weights\(\"(.+)\"\)  \(the same files: (\S+)\)$", out, re.M)
    assert lora and Path(lora.group(1)) == lora_path
    lora = lora.group(2)
    run_id = re.fullmatch(rf"s3://{BUCKET}/runs/([^/]+)/lora", lora).group(1)
    assert lora_path == workdir.resolve() / "runs" / run_id / "lora"
    assert report == lora_path.parent / "eval" / "report.html"
    assert sorted(p.name for p in Path(printed["samples"]).iterdir()) == [f"epoch-00000{i}.png" for i in range(4)]
    assert printed["registered model"] == f"{REGISTERED}/1"
    # The printed MLflow links open, on the port `flowgrpo ui` serves and in the model-training view, the pipeline
    # run and the experiment's chart view (the runs tab in chart mode, in the saved reward-first order).
    assert re.fullmatch(r"http://127\.0\.0\.1:5000/#/experiments/\d+/runs/\w+\?workflowType=machine_learning",
                        printed["MLflow run"])
    experiment_id = re.search(r"/experiments/(\d+)/", printed["MLflow run"]).group(1)
    assert printed["MLflow charts"] == (f"http://127.0.0.1:5000/#/experiments/{experiment_id}/runs?workflowType="
                                        "machine_learning&compareRunsMode=CHART&viewStateShareKey=flowgrpo-rewards-first")

    # Nothing left running, no temporary files left behind.
    assert _processes_under(workdir) == []
    assert not list(workdir.glob("tmp-*")) and not list((workdir / "reward-servers").glob("*.json"))

    # Serve the state again (as `flowgrpo ui` does) and look at what the run left, as a user behind AWS SSO or an
    # assumed role, who has a session token and a profile set all the time. The local S3 refuses a token it did not
    # issue (before: InvalidAccessKeyId, then StorageAuthError 403 in prepare-dataset): the environment `run --local`
    # gives its steps (here a step's process) and its MLflow server's artifact proxy reach SeaweedFS with its own
    # keys alone; the user's AWS is back afterwards.
    sso_user(monkeypatch, tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    from mlflow import MlflowClient

    from components import storage

    with local_services(workdir) as env, patched_environ(env):
        step = subprocess.run([sys.executable, "-c", (
            "from components import storage\n"
            f"storage.put_bytes(b'from a step', 's3://{BUCKET}/probe/x')\n"
            f"print(storage.get_bytes('s3://{BUCKET}/probe/x').decode())\n")],
            capture_output=True, text=True, timeout=120)
        assert (step.returncode, step.stdout.strip()) == (0, "from a step"), step.stderr[-2000:]
        client = MlflowClient(env["MLFLOW_TRACKING_URI"])
        probe = client.create_run(client.create_experiment("sso-user"))
        client.log_text(probe.info.run_id, "through the artifact proxy", "note.txt")  # the server writes to S3
        assert [f.path for f in client.list_artifacts(probe.info.run_id)] == ["note.txt"]

        run_root = lora[: -len("/lora")]
        keys = {k[len(run_root) + 1:] for k in storage.list_uris(run_root)}
        assert {"metrics.jsonl", "config.yaml", "checkpoints/latest", "checkpoints/epoch-000002/_MANIFEST.json",
                "lora/pytorch_lora_weights.safetensors", "eval/report.html", "eval/eval.json"} <= keys
        datasets = storage.list_uris(f"s3://{BUCKET}/datasets")
        assert any(k.endswith("/manifest.json") for k in datasets) and any(k.endswith("/test.parquet")
                                                                           for k in datasets)
        config = storage.get_bytes(f"{run_root}/config.yaml").decode()
        assert f"path: s3://{BUCKET}/datasets/" in config  # trained on the prepared dataset
        assert "url: http://127.0.0.1:" in config  # scored over HTTP by the run's reward server

        parent_id = re.search(r"/runs/(\w+)\?", printed["MLflow run"]).group(1)
        parent = client.get_run(parent_id)
        assert parent.info.status == "FINISHED"
        assert parent.info.run_name == re.search(r"^pipeline run (\S+) finished", out, re.M).group(1)
        pipeline_run = parent.data.tags["flowgrpo.pipeline_run_id"]
        experiment = client.get_experiment(parent.info.experiment_id)
        assert experiment.tags["mlflow.experimentKind"] == "custom_model_development"  # not a GenAI experiment
        children = client.search_runs([parent.info.experiment_id],
                                      f"tags.mlflow.parentRunId = '{parent_id}'")
        by_name = {r.info.run_name: r for r in children}
        assert sorted(by_name) == ["evaluate", "train"] and len(children) == 2  # named for what they are
        assert {r.data.tags["flowgrpo.pipeline_run_id"] for r in children} == {pipeline_run}
        train_run = by_name["train"]
        history = client.get_metric_history(train_run.info.run_id, "reward/mean")
        assert [m.step for m in history] == [1, 2, 3]
        # Sample grids under stable names (epoch 0: the base model, before any update), and under MLflow's
        # image key at their steps for the chart view's image card.
        grids = [f.path for f in client.list_artifacts(train_run.info.run_id, "samples")]
        assert grids == [f"samples/epoch-00000{i}.png" for i in range(4)]
        images = [f.path for f in client.list_artifacts(train_run.info.run_id, "images")]
        assert {int(m.group(1)) for p in images if (m := re.search(r"samples\+step\+(\d+)\+", p))} == {0, 1, 2, 3}
        # The pipeline run shows the reward curves and the sample grids too: the experiment's views fold its
        # steps' runs under it.
        assert ([(m.step, m.value) for m in client.get_metric_history(parent_id, "reward/mean")]
                == [(m.step, m.value) for m in history])
        assert "reward/std" in parent.data.metrics
        assert all(k.startswith(("reward/", "eval/")) for k in parent.data.metrics)
        assert [f.path for f in client.list_artifacts(parent_id, "samples")] == grids
        evaluate = by_name["evaluate"]
        assert "eval/geneval/delta" in evaluate.data.metrics and "eval/geneval_strict/delta" in evaluate.data.metrics
        assert evaluate.data.tags["flowgrpo.gate"] in ("promoted", "refused")
        # ... and the evaluation's results (those of eval.json), the verdict and the registered version it links.
        results = json.loads((report.parent / "eval.json").read_text())
        for key, row in results["rewards"].items():
            for field in ("base_mean", "lora_mean", "delta", "ci_low", "ci_high"):  # null: NaN, not sent to MLflow
                assert parent.data.metrics.get(f"eval/{key}/{field}") == pytest.approx(row[field]), (key, field)
        for tag in ("flowgrpo.gate", "flowgrpo.gate_reason"):
            assert parent.data.tags[tag] == evaluate.data.tags[tag]
        assert parent.data.tags["flowgrpo.gate"] == ("promoted" if results["gate"]["promoted"] else "refused")
        assert parent.data.tags["flowgrpo.model_version"] == printed["registered model"]
        assert re.fullmatch(rf"http://127\.0\.0\.1:\d+/#/models/{REGISTERED}/versions/1",
                            parent.data.tags["flowgrpo.model_version_url"])
        assert f"](#/models/{REGISTERED}/versions/1)" in parent.data.tags["mlflow.note.content"]

        version = client.get_model_version(REGISTERED, "1")
        assert version.run_id == train_run.info.run_id
        assert version.tags["flowgrpo.lora_uri"] == lora
        assert version.tags["flowgrpo.gate"] == evaluate.data.tags["flowgrpo.gate"]
        model_files = storage.list_uris(f"s3://{BUCKET}/mlflow")
        assert any(k.endswith("MLmodel") for k in model_files)  # the registered model's artifacts are in S3
        assert any(k.endswith("pytorch_lora_weights.safetensors") for k in model_files)
    assert {name: os.environ[name] for name in SSO_ENV} == SSO_ENV


def _readme_snippet() -> str:
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    found = re.search(r"^<!-- snippet: generate[^>]*-->\n```python\n(.*?)^```\n<!-- /snippet -->", text, re.M | re.S)
    assert found, "README.md has no generate snippet between its markers"
    return found.group(1)


def test_bench_demo_learning_reads_the_run_back_and_prints_its_table(first_run, capsys):
    """tests/benchmarks/bench_demo_learning.py on the run its `run_seed` would start (the same `run --local`): its
    reading and its table, so the benchmark cannot rot with what a run leaves. Before the tests that start more
    runs in this work directory (the benchmark reads the one run there)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_demo_learning

    workdir, done = first_run
    assert done.returncode == 0, done.stderr[-3000:]
    result = bench_demo_learning.read_run(0, workdir, wall=90.0)
    assert [row["epoch"] for row in result["history"]] == [1, 2, 3]
    bench_demo_learning.report([result])
    out = capsys.readouterr().out
    assert re.search(r"(?m)^\| 0 \| 1\.5 min \| .+ \| (?:promote|hold) \|$", out), out
    (eval_json,) = workdir.glob("runs/*/eval/eval.json")
    for key, reward in json.loads(eval_json.read_text())["rewards"].items():
        assert f"{key}: mean delta over 1 seed(s) {reward['delta']:+.3f};" in out


def test_the_readme_snippet_generates_with_the_lora_a_run_printed(first_run, tmp_path, monkeypatch):
    """The quickstart's snippet, run as written with its LoRA path set to the run's: a 48 x 48 RGB image from the
    base demo pipeline plus the LoRA, the very image the evaluation's generation makes with the demo config's
    settings for that prompt and seed, and the base model's image from the same noise differs."""
    import numpy as np
    from PIL import Image

    from components.models.generate import generate, load_with_lora

    _, done = first_run
    assert done.returncode == 0
    lora = re.search(r"^LoRA: (\S+)", done.stdout, re.M).group(1)
    snippet = _readme_snippet()
    assert snippet.count(".flowgrpo/runs/<run id>/lora") == 1
    monkeypatch.chdir(tmp_path)  # where the snippet saves its images
    scope: dict = {}
    exec(compile(snippet.replace(".flowgrpo/runs/<run id>/lora", lora), "README.md", "exec"), scope)
    image, base = np.asarray(Image.open("lora.png")), np.asarray(Image.open("base.png"))
    assert image.shape == base.shape == (48, 48, 3) and image.dtype == base.dtype == np.uint8
    assert np.array_equal(np.asarray(scope["image"]), image)
    assert not np.array_equal(image, base)  # the LoRA changes what the base model draws
    config = load_config(DEFAULT_CONFIG)
    evaluated = generate(load_with_lora(config.model, config.seed, Path(lora)), [scope["prompt"]],
                         resolution=config.model.resolution, num_steps=config.sampling.eval_num_steps,
                         guidance_scale=config.sampling.guidance_scale, seed=0)
    assert np.array_equal(image, evaluated[0])


def test_second_run_reuses_dataset_and_sigterm_stops_everything(first_run):
    workdir, done = first_run
    assert done.returncode == 0
    proc = subprocess.Popen(_flowgrpo(workdir, "--ray-workers", "0", *CONFIG), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=_clean_env())
    lines = []
    deadline = time.monotonic() + 600
    for line in proc.stdout:
        lines.append(line)
        if "epoch 1/3 reward" in line or time.monotonic() > deadline:
            break
    started = psutil.Process(proc.pid).children(recursive=True)
    record = json.loads(next((workdir / "reward-servers").glob("*.json")).read_text())
    assert started and psutil.pid_exists(record["pid"])
    proc.send_signal(signal.SIGTERM)  # as `kill` or a job scheduler stops it; Ctrl-C (SIGINT) unwinds the same way
    rest, _ = proc.communicate(timeout=120)
    output = "".join(lines) + rest
    assert proc.returncode == 128 + signal.SIGTERM and "stopped by SIGTERM" in output, output[-3000:]
    assert re.search(r"^✓ prepare-dataset \(cached", output, re.M)  # same inputs: KFP's cache answered
    time.sleep(1)
    assert [p.pid for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE] == []
    assert not psutil.pid_exists(record["pid"]) or psutil.Process(record["pid"]).status() == psutil.STATUS_ZOMBIE
    assert _processes_under(workdir) == []


def test_a_run_killed_outright_stops_its_steps_and_its_ray_and_leaves_no_scratch(first_run):
    """kill -9 of `run --local` while its train step trains on the local Ray: the run's tether stops the step and
    the Ray it started (GCS, raylet, dashboard, agents, workers in process groups of their own), and removes
    WORKDIR/tmp-* and Ray's temp folder, within seconds. Before, 27 processes of the run still trained after 120 s,
    and both folders stayed."""
    from components.launch.process import ProcessRef, leased_to, stop_leased

    workdir, done = first_run
    assert done.returncode == 0
    # No sample grids: the first epoch line comes with the least work before it.
    proc = subprocess.Popen(_flowgrpo(workdir, *CONFIG, "train.epochs=50", "tracking.sample_every=0"),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=_clean_env())
    ref, scratch = ProcessRef.of(proc.pid), []
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if "epoch 1/50 reward" in line:
                break
        assert "epoch 1/50 reward" in lines[-1], "".join(lines)[-3000:]
        ray_tmp, started = set(), {}
        for pid in leased_to(ref):
            with contextlib.suppress(psutil.NoSuchProcess):
                ray_tmp.add(psutil.Process(pid).environ().get("RAY_TMPDIR"))
        scratch = [*workdir.glob("tmp-*"), *(Path(f) for f in ray_tmp - {None})]
        assert len(scratch) == 2 and all(f.is_dir() for f in scratch)  # WORKDIR/tmp-*, Ray's temp folder
        for pid in leased_to(ref, scratch):
            with contextlib.suppress(psutil.NoSuchProcess):
                started[ProcessRef.of(pid)] = " ".join(psutil.Process(pid).cmdline())
        commands = list(started.values())
        assert [c for c in commands if "kfp.dsl.executor_main" in c and "train" in c]
        for ray_process in ("gcs_server", "raylet", "dashboard.py", "ray::DashboardAgent", "ray::RuntimeEnvAgent",
                            "ray::TrainController", "ray::RayTrainWorker"):
            assert any(ray_process in c for c in commands), (ray_process, commands)

        proc.kill()
        proc.wait()
        killed = time.monotonic()
        while any(p.alive() for p in started) or leased_to(ref, scratch) or any(f.exists() for f in scratch):
            assert time.monotonic() - killed < 30, [c for p, c in started.items() if p.alive()]
            time.sleep(0.1)
        assert not list(workdir.glob("tmp-*"))
        while _processes_under(workdir):  # the services, by their own tethers
            assert time.monotonic() - killed < 30, _processes_under(workdir)
            time.sleep(0.1)
    finally:
        proc.kill()
        stop_leased(ref, scratch, grace_s=1)


def test_failing_training_step_still_tears_the_reward_server_down(first_run, tmp_path):
    workdir, _ = first_run
    model = tmp_path / "not-a-model"
    model.mkdir()
    (model / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusion3Pipeline"}))
    done = subprocess.run(_flowgrpo(workdir, "--ray-workers", "0", *CONFIG, "model.kind=diffusers",
                                    f"model.path={model}"),
                          capture_output=True, text=True, timeout=600, env=_clean_env())
    assert done.returncode == 2, done.stdout[-3000:] + done.stderr[-3000:]
    assert re.search(r"^✗ train failed after", done.stdout, re.M)
    assert re.search(r"^✓ teardown", done.stdout, re.M)  # the exit handler ran after the failure
    assert not re.search(r"^▶ (evaluate|register)$", done.stdout, re.M)
    (error,) = [line for line in done.stderr.splitlines() if "error:" in line]
    assert "step 'train' failed: ModelLoadError: model.path" in error and str(workdir / "logs") in error
    assert "dataset: reusing" in done.stdout  # a changed config, same prompts: the content-addressed dataset
    assert not list((workdir / "reward-servers").glob("*.json"))
    assert _processes_under(workdir) == []


def test_ui_serves_mlflow_with_images_over_the_local_state(first_run):
    workdir, done = first_run
    assert done.returncode == 0
    from components.launch.process import free_ports

    (port,) = free_ports(1)
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "ui", "--workdir", str(workdir), "--port",
                             str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=_clean_env())
    try:
        for line in proc.stdout:
            if f"MLflow UI: http://127.0.0.1:{port}" in line:
                break
        from mlflow import MlflowClient

        client = MlflowClient(f"http://127.0.0.1:{port}")
        parent_id = re.search(r"^MLflow run: \S+/runs/(\w+)\?", done.stdout, re.M).group(1)
        (train_run,) = [r for r in client.search_runs([client.get_run(parent_id).info.experiment_id],
                                                      f"tags.mlflow.parentRunId = '{parent_id}'")
                        if r.info.run_name != "evaluate"]
        png = next(f.path for f in client.list_artifacts(train_run.info.run_id, "images") if f.path.endswith(".png"))
        # The image bytes come from the local S3 through MLflow's artifact proxy, as the UI shows them.
        import urllib.parse
        import urllib.request

        query = urllib.parse.urlencode({"path": png, "run_uuid": train_run.info.run_id})
        url = f"http://127.0.0.1:{port}/get-artifact?{query}"
        with urllib.request.urlopen(url, timeout=30) as resp:
            assert resp.read(8) == b"\x89PNG\r\n\x1a\n"
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=60)
    assert _processes_under(workdir) == []


def test_run_local_with_a_tiny_flux_config(first_run):
    """The pipeline is family-agnostic: the tiny FLUX.1 config runs every step (in-process training). One epoch of
    16 samples trains the LoRA; the default run above shows the epochs, checkpoints and grids."""
    workdir, _ = first_run
    done = subprocess.run(_flowgrpo(workdir, "--ray-workers", "0", "--config", "pipeline/configs/tiny-flux-cpu.yaml",
                                    *CONFIG, "train.epochs=1", "sampling.prompts_per_epoch=2",
                                    "tracking.sample_every=0"),
                          capture_output=True, text=True, timeout=600, env=_clean_env(),
                          cwd=Path(__file__).resolve().parents[2])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert [m.group(1) for m in re.finditer(r"^✓ (\S+)", done.stdout, re.M)] == STEPS
    lora = Path(re.search(r"^LoRA: (\S+)", done.stdout, re.M).group(1))
    assert re.search(r"^registered model: tiny-flux-lora/\d+$", done.stdout, re.M)
    assert _processes_under(workdir) == []
    # The printed local LoRA loads into the base model the run's config.yaml describes, with its trained values.
    import torch
    import yaml
    from safetensors.torch import load_file

    from components.models.config import ModelConfig
    from components.models.generate import load_with_lora

    config = yaml.safe_load((lora.parent / "config.yaml").read_text())
    assert config["model"]["kind"] == "tiny-flux" and config["sampling"]["guidance_scale"] == 3.5
    model = load_with_lora(ModelConfig.model_validate(config["model"]), config["seed"], lora)
    saved = load_file(lora / "pytorch_lora_weights.safetensors")
    loaded = {n: p for n, p in model.pipeline.transformer.named_parameters() if "lora_B" in n}
    assert loaded
    key = next(k for k in saved if "lora_B" in k)
    suffix = key.removeprefix("transformer.").replace(".lora_B.weight", ".lora_B.")
    (match,) = [p for n, p in loaded.items() if n.startswith(suffix)]
    assert torch.equal(match.detach().cpu(), saved[key].to(match.dtype))
    assert float(saved[key].abs().sum()) > 0  # trained: LoRA B starts at zero
