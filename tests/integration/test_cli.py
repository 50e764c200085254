"""`flowgrpo` as a user runs it: bad input gives one clear line and a non-zero exit, no traceback."""

import json
import os
import re
import subprocess
import sys
import uuid
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from servers import free_port

from components.dataset.prepare import MAX_LINE_BYTES
from components.dataset.prepared import PromptRow, rows_sha256, write_split
from pipeline.config import DEFAULT_CONFIG

REPO = Path(__file__).resolve().parents[2]


def flowgrpo(*args: str, cwd: Path | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipeline.cli", *args], capture_output=True, text=True,
                          cwd=cwd or REPO, timeout=timeout)


def _error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, proc.stderr
    return errors[0]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["train.learnig_rate=0.1"], "train.learnig_rate: unknown key"),
        (["train.learning_rate=-0.001"], "train.learning_rate: Input should be greater than 0"),
        (["sampling.group_size=1", "train.advantage_std=group"], "sampling.group_size must be at least 2"),
        (["train.batch_size=8"], "train.batch_size was renamed train.batch_size_per_worker"),
        (["train.batch_size_per_worker=7"], "train.batch_size_per_worker (7)"),
    ],
)
def test_validate_rejects_bad_values(args, needle):
    line = _error_line(flowgrpo("validate", *args))
    assert needle in line


def test_yaml_syntax_error_and_missing_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  epochs: [1\n")
    assert f"{bad}:" in _error_line(flowgrpo("validate", "--config", str(bad)))
    missing = tmp_path / "missing.yaml"
    assert f"config file {missing} does not exist" in _error_line(flowgrpo("train", "--config", str(missing)))


def test_train_with_missing_model_path_fails_before_training(tmp_path):
    proc = flowgrpo("train", "--output", str(tmp_path / "out"), "model.kind=diffusers",
                    f"model.path={tmp_path / 'no-such-model'}")
    assert "model.path:" in _error_line(proc) and "no-such-model" in _error_line(proc)
    assert not (tmp_path / "out").exists()  # refused before anything is written (before: config.yaml, run.json)


def test_train_with_an_unreachable_s3_model_path_fails_before_writing(tmp_path, monkeypatch, capsys):
    # Before: the path was first read when the model loaded, after config.yaml and run.json were written.
    from pipeline.cli import main

    for name, value in {"AWS_ENDPOINT_URL_S3": f"http://127.0.0.1:{free_port()}", "AWS_MAX_ATTEMPTS": "1",
                        "AWS_ACCESS_KEY_ID": "k", "AWS_SECRET_ACCESS_KEY": "s",
                        "AWS_CONFIG_FILE": str(tmp_path / "none"), "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "none")
                        }.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("AWS_ENDPOINT_URL", raising=False)
    assert main(["train", "--output", str(tmp_path / "out"), "model.kind=diffusers", "model.path=s3://models/sd"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("flowgrpo train: error: model.path: cannot read s3://models/sd/model_index.json: "
                              "S3 endpoint") and "is unreachable" in err[-1], err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("image", ["broken.png", "bomb.png", "wide.png"])
def test_train_refuses_a_bad_input_image_before_writing(image, tmp_path, capsys):
    # Before: the images were first read when the prompts were encoded, after config.yaml and run.json were written.
    from PIL import Image

    from pipeline.cli import main

    if image == "broken.png":
        (tmp_path / image).write_bytes(b"\x89PNG\r\n\x1a\n not really")
        needle = "cannot decode"
    elif image == "bomb.png":  # a 30000 px square PNG header: never decoded
        header = b"IHDR" + (30000).to_bytes(4, "big") * 2 + bytes([8, 2, 0, 0, 0])
        (tmp_path / image).write_bytes(b"\x89PNG\r\n\x1a\n" + (13).to_bytes(4, "big") + header
                                       + zlib.crc32(header).to_bytes(4, "big")
                                       + bytes(4) + b"IEND" + zlib.crc32(b"IEND").to_bytes(4, "big"))
        needle = "900000000 pixels"
    else:
        Image.new("RGB", (96, 32)).save(tmp_path / image)
        needle = "more than 2:1"
    rows = tmp_path / "rows.jsonl"
    rows.write_text(json.dumps({"prompt": "make it red", "images": image}) + "\n")
    assert main(["train", "--config", "tiny-flux-kontext-cpu", "--output", str(tmp_path / "run"),
                 f"data.path={rows}"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if ": error: " in line]
    assert len(err) == 1 and f"input image {tmp_path / image}" in err[0] and needle in err[0], err
    assert not (tmp_path / "run").exists()


def test_train_refuses_an_output_holding_files_no_run_wrote_before_writing(tmp_path, capsys):
    # Before: train replaced config.yaml and metrics.jsonl and mixed lora/, samples/, checkpoints/ in.
    from pipeline.cli import main

    out = tmp_path / "d"
    out.mkdir()
    (out / "config.yaml").write_text("notes\n")
    (out / "metrics.jsonl").write_text("mine\n")
    for resume in ([], ["--resume"], ["--auto-resume"]):
        assert main(["train", "--output", str(out), *resume, "train.epochs=1"]) == 2
        err = [line for line in capsys.readouterr().err.splitlines() if ": error: " in line]
        assert err == [f"flowgrpo train: error: output {out} already holds files that no flowgrpo run wrote "
                       "(config.yaml, metrics.jsonl; no run.json): training would overwrite them; choose a new or "
                       "empty --output"], resume
        assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "metrics.jsonl"]
        assert (out / "config.yaml").read_text() == "notes\n" and (out / "metrics.jsonl").read_text() == "mine\n"


def test_validate_accepts_the_shipped_configs(capsys):
    from pipeline.cli import main

    for path in sorted(DEFAULT_CONFIG.parent.glob("*.yaml")):  # in this process: one import for all of them
        assert main(["validate", "--config", str(path)]) == 0, capsys.readouterr().err
        assert capsys.readouterr().out.startswith(f"{path}: valid (")


def test_validate_explains_how_a_gpu_recipe_splits_on_its_workers():
    proc = flowgrpo("validate", "--config", str(DEFAULT_CONFIG.parent / "sd35-medium-ocr.yaml"))
    assert ("on the cluster: 8 worker(s), each 144 images per epoch in 16 sampling batches of 9; 2 optimizer "
            "step(s) per epoch, each 576 samples = 9 per worker x 8 accumulation x 8 worker(s)") in proc.stdout
    # 7 workers cannot share 48 prompt groups: refused naming the worker count and the key
    line = _error_line(flowgrpo("validate", "--config", str(DEFAULT_CONFIG.parent / "sd35-medium-ocr.yaml"),
                                "cluster.workers.replicas=7"))
    assert "the cluster's 7 training workers" in line and "sampling.prompts_per_epoch (48)" in line


CONFIG_COMMANDS = [
    ["train", "--output", "OUT/run"],
    ["validate"],
    ["evaluate", "--lora", "OUT/lora", "--output", "OUT/eval"],
    ["rayjob"],
    ["run", "--local", "--workdir", "OUT/work"],
    ["submit", "--host", "http://127.0.0.1:9"],
]


@pytest.mark.parametrize("command", CONFIG_COMMANDS, ids=lambda c: c[0])
def test_every_config_option_takes_a_file_or_a_shipped_name_and_refuses_neither_in_one_line(command, tmp_path,
                                                                                             capsys):
    from pipeline.cli import main

    argv = [a.replace("OUT", str(tmp_path)) for a in command]
    assert main([*argv, "--config", "tiny-flux"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"flowgrpo {command[0]}: error: config 'tiny-flux' is neither a "
                                               "YAML file nor a shipped config name"), err
    assert "did you mean tiny-flux-cpu?" in err[0] and "sd35-medium-ocr" in err[0]
    assert main([*argv, "--config", str(tmp_path / "missing.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"config file {tmp_path / 'missing.yaml'} does not exist" in err[0], err
    assert not list(tmp_path.iterdir())  # refused before any work
    assert "or the name of a shipped config" in " ".join(flowgrpo(command[0], "--help").stdout.split())


def test_validate_and_rayjob_take_a_shipped_config_by_name():
    proc = flowgrpo("validate", "--config", "tiny-flux-cpu")
    assert proc.returncode == 0 and proc.stdout.startswith("tiny-flux-cpu: valid (tiny-flux,"), proc.stderr
    assert "model.path" not in proc.stdout and proc.stderr == ""  # a tiny model has no path to check
    by_name = flowgrpo("rayjob", "--config", "sd35-medium-ocr", "--run-id", "x")
    by_file = flowgrpo("rayjob", "--config", str(DEFAULT_CONFIG.parent / "sd35-medium-ocr.yaml"), "--run-id", "x")
    assert by_name.returncode == 0 and by_name.stdout == by_file.stdout and "kind: RayJob" in by_name.stdout


def test_validate_notes_a_model_path_it_cannot_check_here_without_failing(tmp_path):
    missing = tmp_path / "sd35m"
    proc = flowgrpo("validate", "--config", "sd35-medium-ocr", f"model.path={missing}")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr  # CI validates where the model is not
    assert "sd35-medium-ocr: valid (diffusers" in proc.stdout
    assert (f"model.path {missing} does not exist on this machine: fine if it exists where the training runs"
            in proc.stdout)
    assert "`flowgrpo train` here would stop on it" in proc.stdout
    proc = flowgrpo("validate", "--config", "sd35-medium-ocr", "model.path=s3://bucket/models/sd35m")
    assert proc.returncode == 0
    assert ("model.path s3://bucket/models/sd35m: checked when the run starts (needs the S3 credentials)"
            in proc.stdout)
    line = _error_line(flowgrpo("validate", "--config", "sd35-medium-ocr", "model.path=http://host/sd35m"))
    assert "model.path: unsupported URI scheme" in line


def test_submit_says_a_missing_config_file_does_not_exist_and_prints_one_line(tmp_path):
    line = _error_line(flowgrpo("submit", "--host", "http://127.0.0.1:9", "--config", str(tmp_path / "my.yaml")))
    assert f"config file {tmp_path / 'my.yaml'} does not exist" in line and "tiny-cpu" in line
    # a shipped name passes validation and the connection error is all stderr holds: no kfp FutureWarning
    proc = flowgrpo("submit", "--host", "http://127.0.0.1:9", "--config", "tiny-cpu")
    line = _error_line(proc)
    assert "cannot reach Kubeflow Pipelines at http://127.0.0.1:9" in line
    assert proc.stderr.strip() == line and "Warning" not in proc.stderr


def test_help_explains_the_commands():
    proc = flowgrpo("--help")
    assert proc.returncode == 0 and "train" in proc.stdout and "validate" in proc.stdout
    proc = flowgrpo("train", "--help")
    assert "--resume" in proc.stdout and "key.sub=value" in proc.stdout


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Callable[[int], tuple[Path, subprocess.CompletedProcess]]:
    """`flowgrpo train` of the tiny config for 14 epochs with a seed, trained once per seed for this module's tests
    (the evaluate command's test evaluates seed 0's LoRA)."""
    runs: dict[int, tuple[Path, subprocess.CompletedProcess]] = {}

    def run(seed: int) -> tuple[Path, subprocess.CompletedProcess]:
        if seed not in runs:
            out = tmp_path_factory.mktemp(f"tiny-seed{seed}")
            runs[seed] = out, flowgrpo("train", "--config", "tiny-cpu", "--output", str(out), f"seed={seed}",
                                       "train.epochs=14")
        return runs[seed]

    return run


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_tiny_config_learns_for_every_seed(tiny_run, seed):
    """The acceptance criterion: last-3-epoch mean > first mean + first per-sample std / 2, in 14 of the config's
    40 epochs (seeds 0, 1, 2 pass it by epochs 6, 10 and 10, and stand 1.9, 1.7 and 1.4 first-epoch stds up at 14)."""
    out, proc = tiny_run(seed)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    first, last3 = rows[0], [r["reward/mean"] for r in rows[-3:]]
    threshold = first["reward/mean"] + first["reward/std"] / 2
    assert sum(last3) / 3 > threshold, (first, last3)
    slope = np.polyfit([r["epoch"] for r in rows], [r["reward/mean"] for r in rows], 1)[0]
    printed = float(re.search(r"trend ([-+.e0-9]+)/epoch", proc.stdout).group(1))
    assert "LEARNED" in proc.stdout and printed == pytest.approx(slope, rel=5e-3)
    assert f"first epoch {first['reward/mean']:.4g}" in proc.stdout
    assert (out / "lora" / "pytorch_lora_weights.safetensors").is_file()


@pytest.mark.parametrize("entry", [["pipeline.cli", "reward-server"], ["components.reward_server"]])
@pytest.mark.parametrize("how", ["names", "config"])
def test_reward_server_command_serves_over_http(tmp_path, how, entry):
    import httpx
    import numpy as np
    from servers import free_port, wait_until_ok

    from components.rewards.codec import encode_png_b64

    port = free_port()
    if how == "names":
        args = ["--rewards", "brightness,jpeg_compressibility"]
    else:
        config = tmp_path / "server.yaml"
        config.write_text("rewards:\n  - name: brightness\n    label: bright\n    weight: 3.0\n"
                          "limits:\n  max_images: 2\n")
        args = ["--config", str(config)]
    # `flowgrpo reward-server` and the entry module a Deployment and a local run start are the same server.
    proc = subprocess.Popen([sys.executable, "-m", *entry, *args, "--port", str(port)],
                            cwd=REPO, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_ok(f"{url}/readyz", 60, dead=lambda: proc.poll() is not None and proc.stderr.read())
        listed = {r["key"]: r["weight"] for r in httpx.get(f"{url}/v1/rewards").json()["rewards"]}
        image = np.full((8, 8, 3), 255, dtype=np.uint8)
        body = {"prompts": ["a"], "images": [encode_png_b64(image)]}
        results = httpx.post(f"{url}/v1/score", json=body).json()["results"]
        if how == "names":
            assert listed == {"brightness": 1.0, "jpeg_compressibility": 1.0}
            assert results["brightness"]["scores"] == [1.0]
        else:
            assert listed == {"bright": 3.0} and results["bright"]["scores"] == [1.0]
            three = {"prompts": ["a"] * 3, "images": body["images"] * 3}
            assert httpx.post(f"{url}/v1/score", json=three).status_code == 413
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_reward_server_command_rejects_bad_rewards_before_starting():
    line = _error_line(flowgrpo("reward-server", "--rewards", "brightness,shiny"))
    assert "rewards.1.name: unknown reward 'shiny'" in line
    line = _error_line(flowgrpo("reward-server"))
    assert "exactly one of --rewards" in line



def test_reward_server_config_errors_name_file_and_line(tmp_path):
    bad = tmp_path / "server.yaml"
    bad.write_text("rewards:\n  - name: [brightness\n")
    import re

    assert re.search(rf"{re.escape(str(bad))}:\d+:\d+: YAML syntax error",
                     _error_line(flowgrpo("reward-server", "--config", str(bad))))
    assert "does not exist" in _error_line(flowgrpo("reward-server", "--config", str(tmp_path / "nope.yaml")))


@pytest.mark.slow
def test_evaluate_command_writes_eval_json_and_report_and_checks_its_arguments(tiny_run, tmp_path):
    run, proc = tiny_run(0)
    assert proc.returncode == 0, proc.stderr[-3000:]
    args = ["--config", "tiny-cpu", "--lora", str(run / "lora"), "eval.max_prompts=2", "eval.images_per_prompt=1",
            "sampling.eval_num_steps=4"]
    proc = flowgrpo("evaluate", "--output", str(tmp_path / "eval"), *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "eval" / "eval.json").read_text())
    row = summary["rewards"]["brightness"]
    assert row["n"] == 2 and row["delta"] == pytest.approx(row["lora_mean"] - row["base_mean"])
    assert f"brightness: base {row['base_mean']:.4g} -> LoRA {row['lora_mean']:.4g}" in proc.stdout
    assert ("gate: PROMOTE" if summary["gate"]["promoted"] else "gate: REFUSE") in proc.stdout
    # 2 prompts: the CI is flagged in eval.json, warned about in the output and marked in the report
    assert row["few_prompts"] is True
    assert "warning: brightness: the 95% CI rests on only 2 prompt(s) (fewer than 10)" in proc.stdout
    assert "only 2 prompt(s): too few for this CI to mean much" in (tmp_path / "eval" / "report.html").read_text()
    assert (tmp_path / "eval" / "report.html").read_text().split("<h2>Base vs LoRA")[1].count("data:image/png") == 4
    # the training history beside the LoRA feeds the report's curve
    assert "no training history" not in (tmp_path / "eval" / "report.html").read_text()
    line = _error_line(flowgrpo("evaluate", "--output", str(tmp_path / "eval2"), *args, "--registered-model", "x"))
    assert "--registered-model must be NAME/VERSION" in line


BAD_CONFIGS = [
    (["rewards.0.name=nope"], "rewards.0.name: unknown reward 'nope'"),
    (["eval_rewards=[{name: nope}]"], "eval_rewards.0.name: unknown reward 'nope'"),
    (["rewards.0.weight=.nan"], "rewards.0.weight: Input should be a finite number"),
    (["rewards.0.weight=.inf"], "rewards.0.weight: Input should be a finite number"),
    (["train.adam_betas=[1.5,0.999]"], "train.adam_betas: each beta must be in [0, 1)"),
    (["rewards.0.timeout_s=.inf"], "rewards.0.timeout_s: Input should be a finite number"),
    (["reward_server.retry_window_s=.inf"], "reward_server.retry_window_s: Input should be a finite number"),
    (["reward_server.retries=3"], "reward_server.retries was replaced by reward_server.retry_window_s"),
    (["reward_server.url=http://bob:PLANTED-9f3@127.0.0.1:1"], "reward_server.url: a URL with credentials"),
    (["rewards=[{name: vlm_judge, args: {base_url: 'https://u:PLANTED-9f3@judge/v1', model: m}}]"],
     "rewards.0.args.base_url: a URL with credentials"),
    (["tracking.registered_model=team/lora"], "tracking.registered_model: MLflow model names cannot contain"),
]


@pytest.mark.parametrize(("overrides", "needle"), BAD_CONFIGS)
def test_validate_and_train_refuse_a_bad_config_with_the_same_line_before_any_work(overrides, needle, tmp_path,
                                                                                  capsys):
    from pipeline.cli import main

    lines = {}
    for command in (["validate"], ["train", "--output", str(tmp_path / "run")]):
        assert main([*command, *overrides]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], err
        lines[command[0]] = err[0].split(": error: ", 1)[1]
    assert lines["validate"] == lines["train"]
    assert not (tmp_path / "run").exists()  # refused before any work
    assert "PLANTED" not in lines["train"]  # a planted password is named by its key, never echoed
    assert not any("PLANTED" in p.read_text(errors="replace") for p in tmp_path.rglob("*") if p.is_file())


def _bad_data_paths(tmp_path: Path) -> dict[str, str]:
    latin = tmp_path / "latin.txt"
    latin.write_bytes(b"caf\xe9\n")
    (tmp_path / "folder.txt").mkdir()
    long = tmp_path / "long.txt"
    long.write_text("a cat\n" + "a" * 1_000_000 + "\n")  # before: train reached 2.0 GB RSS on it
    line = tmp_path / "line.jsonl"  # before: a 300 MB line took validate to 2.4 GB RSS
    line.write_text('{"prompt": "a cat", "x": "' + "0" * MAX_LINE_BYTES + '"}\n')
    escape = tmp_path / "escape"  # a prepared dataset edited to read outside its folder, its hashes recomputed
    escape.mkdir()
    rows = [PromptRow("make it red", {}, ("../outside.png",))]
    for split, part in (("train", rows), ("test", [])):
        write_split(part, escape / f"{split}.parquet")
    (escape / "manifest.json").write_text(json.dumps({
        "schema_version": 2, "content_sha256": "x", "rows": {"train": 1, "test": 0},
        "splits": {"train": {"rows": 1, "sha256": rows_sha256(rows)}, "test": {"rows": 0, "sha256": rows_sha256([])}}}))
    return {"/dev/null": "must be a .txt or .jsonl file or a prepared dataset folder",
            str(latin): f"{latin}:1: not UTF-8 text", str(tmp_path / "folder.txt"): "does not exist or is not a file",
            str(long): f"{long}:2: prompt longer than max_prompt_tokens (estimated) (about 250000 tokens, limit 256)",
            str(line): f"{line}:1: a line longer than {MAX_LINE_BYTES} bytes",
            str(escape): "train.parquet: the images column names '../outside.png', not an images/<16 hex>.png file"}


def test_validate_and_train_refuse_an_unreadable_data_path_with_the_same_line_writing_nothing(tmp_path, capsys):
    # Before: validate said valid for each; train wrote config.yaml under --output, then failed.
    from pipeline.cli import main

    for path, needle in _bad_data_paths(tmp_path).items():
        lines = {}
        for command in (["validate"], ["train", "--output", str(tmp_path / "run")]):
            assert main([*command, "data.prompts=null", f"data.path={path}"]) == 2, path
            err = [line for line in capsys.readouterr().err.splitlines() if ": error: " in line]
            assert len(err) == 1 and needle in err[0], err
            lines[command[0]] = err[0].split(": error: ", 1)[1]
        assert lines["validate"] == lines["train"]
        assert not (tmp_path / "run").exists(), path


def test_a_refused_train_writes_nothing_to_an_s3_output(s3_env, tmp_path, capsys):
    from components import storage
    from pipeline.cli import main

    output = f"s3://{s3_env.bucket}/refused-{uuid.uuid4().hex[:8]}"
    no_model = f"s3://{s3_env.bucket}/no-model-{uuid.uuid4().hex[:8]}"  # before: written, then refused at loading
    for overrides in (["data.prompts=null", "data.path=/dev/null"], ["rewards=[{name: 'foo.bar:Baz'}]"],
                      ["model.kind=diffusers", f"model.path={no_model}"]):
        assert main(["train", "--output", output, *overrides]) == 2
        assert "error:" in capsys.readouterr().err
        assert storage.list_uris(output) == [], overrides

    storage.put_bytes(b"notes", storage.join(output, "config.yaml"))  # not a run's: before, replaced
    assert main(["train", "--output", output, "train.epochs=1"]) == 2
    assert (f"error: output {output} already holds files that no flowgrpo run wrote (config.yaml; no run.json)"
            in capsys.readouterr().err)
    assert storage.list_uris(output) == [storage.join(output, "config.yaml")]
    assert storage.get_bytes(storage.join(output, "config.yaml")) == b"notes"


def test_trainer_entry_module_trains_its_sections_of_a_whole_experiment_from_the_environment(tmp_path, small_config):
    """What a RayJob runs: ``python -m components.trainer --config env:...`` with the whole experiment in the
    variable. It trains on the trainer's sections and keeps the whole experiment with the run."""
    import yaml

    experiment = small_config("train.epochs=1", "eval.max_prompts=3").model_dump(mode="json")
    env = os.environ | {"FLOWGRPO_EXPERIMENT_CONFIG": yaml.safe_dump(experiment)}
    env.pop("MLFLOW_TRACKING_URI", None)
    args = [sys.executable, "-m", "components.trainer", "--config", "env:FLOWGRPO_EXPERIMENT_CONFIG",
            "--output", str(tmp_path / "run"), "--auto-resume"]
    proc = subprocess.run(args, capture_output=True, text=True, cwd=REPO, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "run" / "lora" / "pytorch_lora_weights.safetensors").is_file()
    recorded = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert recorded == experiment and recorded["eval"]["max_prompts"] == 3  # not only the trainer's sections
    assert len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()) == 1

    bad = {**experiment, "train": {**experiment["train"], "epochs": 0}}
    env["FLOWGRPO_EXPERIMENT_CONFIG"] = yaml.safe_dump(bad)
    proc = subprocess.run([*args[:-3], "--output", str(tmp_path / "other")], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=600)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip().splitlines()[-1]]
    assert proc.stderr.startswith("trainer: error: invalid config env:FLOWGRPO_EXPERIMENT_CONFIG: train.epochs")
    assert not (tmp_path / "other").exists()
