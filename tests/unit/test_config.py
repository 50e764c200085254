"""The experiment config: defaults, example configs, overrides and error messages."""

import itertools
from pathlib import Path

import pytest
import yaml

from components.errors import ConfigError
from components.trainer.config import describe_batches, epoch_split_problems
from pipeline.config import CONFIG_DIR, DEFAULT_CONFIG, ExperimentConfig, load_config

TINY = CONFIG_DIR / "tiny-cpu.yaml"
SD35 = CONFIG_DIR / "sd35-medium-ocr.yaml"


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    return path


def test_defaults_equal_the_shipped_tiny_config_and_it_spells_every_key():
    """Every key but the sections of the algorithms it names nowhere: adding an algorithm touches its own module
    only (docs/DESIGN.md, "Adding an algorithm")."""
    from components.algorithms.base import algorithms

    raw = yaml.safe_load(TINY.read_text())
    defaults = ExperimentConfig().model_dump(mode="json")
    unnamed = set(algorithms()) - set(raw["train"])
    assert unnamed < set(algorithms()) and "diffusion_nft" not in unnamed
    defaults["train"] = {k: v for k, v in defaults["train"].items() if k not in unnamed}
    assert raw == defaults


def test_sd35_config_has_upstream_hyperparameters():
    c = load_config(SD35)
    # upstream general_ocr_sd3: 9 images per GPU forward, 576 samples per optimizer step, 2 steps per epoch
    assert (c.sampling.batch_size_per_worker, c.train.batch_size_per_worker) == (9, 9)
    workers = c.cluster.workers.replicas
    assert c.train.batch_size_per_worker * c.train.gradient_accumulation_steps * workers == 576
    assert epoch_split_problems(c, workers) == []
    assert c.model.kind == "diffusers" and c.model.resolution == 512
    assert (c.sampling.num_steps, c.sampling.eval_num_steps, c.sampling.guidance_scale) == (10, 40, 4.5)
    assert (c.sampling.group_size, c.sampling.prompts_per_epoch) == (24, 48)
    assert c.train.beta == 0.04 and c.train.learning_rate == 3e-4 and c.train.clip_range == 1e-4
    assert c.train.adam_betas == (0.9, 0.999) and c.train.weight_decay == 1e-4 and c.train.adam_eps == 1e-8
    assert (c.model.lora.rank, c.model.lora.alpha, c.model.lora.init) == (32, 64.0, "gaussian")
    assert c.train.ema.enabled and c.train.ema.decay == 0.9 and c.train.ema.update_every == 8
    assert c.train.train_cfg and c.train.timestep_fraction == 0.99
    assert [r.name for r in c.rewards] == ["ocr"]


def test_overrides_set_nested_values_and_list_items():
    c = load_config(TINY, ["train.epochs=3", "model.lora.rank=4", "rewards.0.weight=2.5", "sampling.sde_type=cps"])
    assert (c.train.epochs, c.model.lora.rank, c.rewards[0].weight, c.sampling.sde_type) == (3, 4, 2.5, "cps")


def test_override_can_fill_a_null_section():
    c = load_config(TINY, ["sampling.sde_window.size=2", "sampling.sde_window.range=[0,4]"])
    assert c.sampling.sde_window.size == 2 and c.sampling.sde_window.range == (0, 4)


@pytest.mark.parametrize(
    ("overrides", "needles"),
    [
        (["train.learnig_rate=0.1"], ["train.learnig_rate", "unknown key"]),
        (["train.learning_rate=-1"], ["train.learning_rate", "greater than 0", "-1"]),
        (["sampling.group_size=1", "train.advantage_std=group"], ["sampling.group_size", "at least 2",
                                                                   "even its std is undefined"]),
        (["train.global_std=false"], ["train.global_std was replaced by train.advantage_std", "group (was false)"]),
        (["train.advantage_std=batch"], ["train.advantage_std", "'global', 'group' or 'none'"]),
        (["train.grpo_guard=true", "sampling.sde_type=cps"], ["train.grpo_guard", "sampling.sde_type sde", "cps"]),
        (["train.grpo_guard=true", "train.algorithm=diffusion_nft"], ["train.grpo_guard", "diffusion_nft"]),
        (["train.algorithm=grpo"], ["train.algorithm must be one of", "diffusion_nft", "flow_grpo", "'grpo'"]),
        (["train.nft.beta=1"], ["train.nft was renamed train.diffusion_nft"]),
        (["reward_deploy.limits.header_timeout_s=5"], ["reward_deploy.limits", "header_timeout_s was renamed "
                                                        "request_head_timeout_s"]),
        (["reward_deploy.limits.body_timeout_s=5"], ["reward_deploy.limits",
                                                      "body_timeout_s was renamed body_grace_s"]),
        (["train.diffusion_nft.beta=-1"], ["train.diffusion_nft.beta", "greater than 0"]),
        (["train.diffusion_nft.betta=1"], ["train.diffusion_nft.betta", "unknown key"]),
        (["train.flow_grpo.guard_mean_shift=group"], ["train.flow_grpo.guard_mean_shift", "'sample' or 'batch'"]),
        (["train.epochs=many"], ["train.epochs", "integer"]),
        (["sampling.sde_type=ode"], ["sampling.sde_type"]),
        (["model.kind=diffusers"], ["model.path is required"]),
        (["train.batch_size_per_worker=7"], ["train.batch_size_per_worker (7)", "64 images"]),
        (["sampling.batch_size_per_worker=5"], ["sampling.batch_size_per_worker (5)", "64 images"]),
        (["train.gradient_accumulation_steps=3"], ["train.gradient_accumulation_steps (3)", "4 micro-batches",
                                                   "samples per optimizer step"]),
        (["rewards.3.weight=1"], ["rewards.3", "not an index"]),
        (["sampling.sde_window.size=4", "sampling.sde_window.range=[0,11]"], ["sampling.sde_window.range",
                                                                               "hi <= sampling.num_steps"]),
        (["sampling.sde_window.size=4", "sampling.sde_window.range=[3,6]"], ["sampling.sde_window.range",
                                                                              "window of size 4", "[3, 6]"]),
        (["train.train_cfg=true"], ["train.train_cfg", "guidance_scale"]),
        (["noequals"], ["key.sub=value"]),
    ],
)
def test_bad_values_name_the_key(overrides, needles):
    with pytest.raises(ConfigError) as info:
        load_config(TINY, overrides)
    message = str(info.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message


def test_an_sde_window_under_an_ode_algorithm_is_a_note_not_an_error():
    """Any config switches algorithm with one override: DiffusionNFT leaves a config's SDE window unread, and
    says so."""
    from components.trainer.config import algorithm_notes

    window = ["sampling.sde_window.size=2", "sampling.sde_window.range=[0,5]"]
    config = load_config(TINY, ["train.algorithm=diffusion_nft", *window])
    assert algorithm_notes(config) == ["sampling.sde_window is not used: DiffusionNFT samples with the ODE"]
    assert algorithm_notes(load_config(TINY, ["train.algorithm=flow_grpo", *window])) == []


def test_flow_grpo_notes_its_guard_mean_shift_unread_without_the_guard():
    """train.flow_grpo.guard_mean_shift is read with train.grpo_guard (tests/integration/test_update_fidelity.py);
    without it by nothing, and FlowGRPO says so."""
    from components.trainer.config import algorithm_notes

    for shift in ("sample", "batch"):
        assert algorithm_notes(load_config(TINY, ["train.grpo_guard=true", f"train.flow_grpo.guard_mean_shift={shift}"]
                                           )) == []
    assert algorithm_notes(load_config(TINY, ["train.flow_grpo.guard_mean_shift=batch"])) == [
        "train.flow_grpo.guard_mean_shift is not used: train.grpo_guard is false"]


def test_a_changed_key_in_the_section_of_an_algorithm_the_run_does_not_read_is_a_note():
    """A config may carry every algorithm's section (tiny-cpu.yaml spells two at their defaults: no note); a key
    changed in one the selected algorithm does not read would otherwise be silently inert."""
    from components.trainer.config import algorithm_notes

    assert algorithm_notes(load_config(TINY, [])) == []
    assert algorithm_notes(load_config(TINY, ["train.diffusion_nft.beta=2", "train.diffusion_nft.max_decay=0.2",
                                              "train.diffusion_nft.decay_rate=0.001"])) == [
        "train.diffusion_nft.beta, train.diffusion_nft.max_decay are not used: train.algorithm is flow_grpo, which "
        "reads train.flow_grpo"]
    assert algorithm_notes(load_config(TINY, ["train.algorithm=diffusion_nft", "train.mix_grpo.window_size=2"])) == [
        "train.mix_grpo.window_size is not used: train.algorithm is diffusion_nft, which reads train.diffusion_nft"]
    # MixGRPO is built on FlowGRPO and reads its section as well as its own
    assert algorithm_notes(load_config(TINY, ["train.algorithm=mix_grpo", "train.grpo_guard=true",
                                              "train.flow_grpo.guard_mean_shift=batch"])) == []
    assert algorithm_notes(load_config(TINY, ["train.algorithm=flow_grpo", "train.grpo_guard=true",
                                              "train.mix_grpo.stride=2"])) == [
        "train.mix_grpo.stride is not used: train.algorithm is flow_grpo, which reads train.flow_grpo"]


def test_duplicate_reward_is_rejected(tmp_path):
    path = _write(tmp_path, "rewards:\n  - name: brightness\n  - name: brightness\n")
    with pytest.raises(ConfigError, match=r"rewards\.1: reward 'brightness' is listed twice"):
        load_config(path)


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    path = _write(tmp_path, "train:\n  epochs: 3\n  lr: [1, 2\n")
    with pytest.raises(ConfigError, match=rf"{path}:\d+:\d+: YAML syntax error"):
        load_config(path)


def test_missing_file_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"nope\.yaml does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_top_level_must_be_a_mapping(tmp_path):
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(_write(tmp_path, "- 1\n- 2\n"))


def test_partial_file_takes_defaults_for_the_rest(tmp_path):
    c = load_config(_write(tmp_path, "train:\n  epochs: 2\n"))
    assert c.train.epochs == 2 and c.sampling == ExperimentConfig().sampling


def test_config_from_an_environment_variable(monkeypatch):
    monkeypatch.setenv("FLOWGRPO_TEST_CONFIG", "train:\n  epochs: 7\nseed: 3\n")
    c = load_config("env:FLOWGRPO_TEST_CONFIG", ["sampling.group_size=4"])
    assert (c.train.epochs, c.seed, c.sampling.group_size) == (7, 3, 4)
    monkeypatch.delenv("FLOWGRPO_TEST_CONFIG")
    with pytest.raises(ConfigError, match="environment variable FLOWGRPO_TEST_CONFIG is not set"):
        load_config("env:FLOWGRPO_TEST_CONFIG")
    monkeypatch.setenv("FLOWGRPO_TEST_CONFIG", "train: [1\n")
    with pytest.raises(ConfigError, match=r"env:FLOWGRPO_TEST_CONFIG:2:1: not valid YAML \(its text is not shown"):
        load_config("env:FLOWGRPO_TEST_CONFIG")


def test_gate_rewards_must_be_eval_rewards():
    with pytest.raises(ConfigError, match=r"eval.gate.metric: 'ocr' is not an eval reward \(they are: brightness\)"):
        load_config(TINY, ["eval.gate.metric=ocr"])
    with pytest.raises(ConfigError, match=r"eval.gate.guards: 'aesthetic' is not an eval reward"):
        load_config(TINY, ["eval.gate.guards={aesthetic: 0.1}"])
    c = load_config(TINY, ["eval_rewards=[{name: jpeg_compressibility}]", "eval.gate.metric=jpeg_compressibility"])
    assert c.eval.gate.metric == "jpeg_compressibility"


@pytest.mark.parametrize("section", ["sampling", "train"])
def test_the_old_global_batch_key_is_refused_saying_what_it_became(tmp_path, section):
    """`train.batch_size` used to be global (split across workers); a config that still spells it must not
    silently train N times larger micro-batches."""
    path = _write(tmp_path, f"{section}:\n  batch_size: 8\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert "\n" not in message
    assert f"{section}.batch_size was renamed {section}.batch_size_per_worker" in message
    assert "ONE worker" in message and "samples per optimizer step = train.batch_size_per_worker x" in message


def test_an_epoch_splits_per_worker():
    """Batch sizes are per worker: N workers each sample 1/N of the prompt groups and train on their own samples,
    so one optimizer step sees batch x accumulation x N samples."""
    c = load_config(TINY, ["sampling.prompts_per_epoch=8", "sampling.group_size=4", "sampling.batch_size_per_worker=4",
                           "train.batch_size_per_worker=2", "train.gradient_accumulation_steps=2"])
    assert epoch_split_problems(c, 1) == [] and epoch_split_problems(c, 2) == [] and epoch_split_problems(c, 4) == []
    assert describe_batches(c, 2) == ("2 worker(s), each 16 images per epoch in 4 sampling batches of 4; 4 optimizer "
                                      "step(s) per epoch, each 8 samples = 2 per worker x 2 accumulation x 2 worker(s)")
    (problem,) = epoch_split_problems(c, 3)
    assert "sampling.prompts_per_epoch (8) must be a multiple of the 3 workers" in problem
    assert epoch_split_problems(c, 8) == []  # 4 images each: 1 sampling batch, 2 micro-batches, 1 optimizer step
    c = load_config(TINY, ["sampling.prompts_per_epoch=8", "sampling.group_size=4", "sampling.batch_size_per_worker=4",
                           "train.batch_size_per_worker=4", "train.gradient_accumulation_steps=2"])
    (problem,) = epoch_split_problems(c, 8)  # 1 micro-batch per worker cannot make an accumulation of 2
    assert problem.startswith("train.gradient_accumulation_steps (2) must divide the 1 micro-batches per epoch of "
                              "the 8 workers (4 samples / train.batch_size_per_worker 4)")


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_every_algorithm_is_selected_in_every_shipped_config_by_one_override(path):
    """`flowgrpo run --local --config X train.algorithm=<key>` for every pair: what the override leaves unread
    (an SDE window under an ODE algorithm), and where AWM departs from its authors' recipe, is a note, never a
    refusal."""
    from components.algorithms.base import algorithms
    from components.trainer.config import algorithm_notes

    for key, cls in algorithms().items():
        config = load_config(path, [f"train.algorithm={key}"])
        assert config.train.algorithm == key and isinstance(getattr(config.train, key), cls.Config)
        assert all(isinstance(note, str) and ("not used" in note or note.startswith("AWM departs from"))
                   for note in algorithm_notes(config))


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_name_the_images_and_secrets_of_the_one_deployment_place(path):
    """A version bump or a renamed Secret changes components/deploy_defaults.py; a config still spelling the old value
    fails here instead of deploying a stale image."""
    from components import deploy_defaults

    expected = {("cluster", "image"): deploy_defaults.image("trainer"),
                ("cluster", "s3_secret"): deploy_defaults.S3_SECRET,
                ("cluster", "mlflow_secret"): deploy_defaults.MLFLOW_SECRET,
                ("reward_deploy", "image"): deploy_defaults.image("reward-server"),
                ("reward_deploy", "s3_secret"): deploy_defaults.S3_SECRET,
                ("reward_deploy", "judge", "image"): deploy_defaults.image("vllm-judge"),
                ("reward_deploy", "judge", "fetch_image"): deploy_defaults.image("components")}
    raw = yaml.safe_load(path.read_text())
    for keys, value in expected.items():
        node = raw
        for key in keys:
            node = node.get(key) if isinstance(node, dict) else None
        if node is not None:  # tiny-cpu.yaml spells every key (the test above); the recipes spell `cluster:`
            assert node == value, f"{path.name}: {'.'.join(keys)} is {node!r}, the deployment's is {value!r}"


def test_the_design_doc_maps_every_folder_and_indexes_every_config_key():
    """docs/DESIGN.md is where a newcomer finds a folder's concern and where a key is read: a new package or a new
    top-level key that is not there fails here."""
    import inspect
    import re
    import typing

    from pydantic import BaseModel

    repo = CONFIG_DIR.parents[1]
    design = (repo / "docs" / "DESIGN.md").read_text()
    index = design[design.index("### Where a config key is read"):]
    rows = dict(re.findall(r"^\| `(\w+)` \| `([\w/.]+\.py)` \|", index, flags=re.M))
    assert set(rows) == set(ExperimentConfig.model_fields)
    for key, path in rows.items():
        # the module of the section's class (of the list's items), else the module declaring the key itself
        annotation = ExperimentConfig.model_fields[key].annotation
        section = next((a for a in (annotation, *typing.get_args(annotation)) if isinstance(a, type)
                        and issubclass(a, BaseModel)), None)
        declared = (section is not None and Path(inspect.getsourcefile(section)) == repo / path) or \
            re.search(rf"^\s+{key}: ", (repo / path).read_text(), flags=re.M)
        assert declared, f"{key} is not defined in {path}"
    folders = design[design.index("### Where each folder's one concern lives"):design.index("### Where a config key")]
    packages = {p.parent.relative_to(repo).as_posix() for p in (repo / "components").glob("*/__init__.py")}
    for package in sorted(packages):
        assert f"`{package}/`" in folders, f"{package}/ has no row in docs/DESIGN.md"


# -- `--config`: a file or a shipped config's name, resolved in load_config ------------------------------------


def test_config_takes_a_shipped_name_and_a_file_of_that_name_wins(tmp_path, monkeypatch):
    from pipeline.config import resolve_config

    assert resolve_config("tiny-flux-cpu") == CONFIG_DIR / "tiny-flux-cpu.yaml"
    assert load_config("tiny-flux-cpu") == load_config(CONFIG_DIR / "tiny-flux-cpu.yaml")
    assert load_config(Path("sd35-medium-ocr"), ["train.epochs=3"]).train.epochs == 3
    monkeypatch.chdir(tmp_path)
    Path("tiny-cpu").write_text("train:\n  epochs: 2\n")  # a local file named like a shipped config
    assert load_config("tiny-cpu").train.epochs == 2


@pytest.mark.parametrize(
    ("value", "needles"),
    [
        ("my.yaml", ["config file my.yaml does not exist", "tiny-cpu", "sd35-medium-ocr"]),
        ("configs/exp", ["config file configs/exp does not exist"]),
        ("tiny-flux", ["config 'tiny-flux' is neither a YAML file nor a shipped config name",
                       "did you mean tiny-flux-cpu?", "tiny-qwenimage-cpu"]),
        ("nothing-like-it", ["is neither a YAML file nor a shipped config name (shipped: flux1-dev-pickscore"]),
    ],
)
def test_a_config_that_names_neither_a_file_nor_a_shipped_config_is_refused_in_one_line(value, needles, tmp_path,
                                                                                      monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as exc:
        load_config(value)
    message = str(exc.value)
    assert "\n" not in message and all(n in message for n in needles), message
    assert "did you mean" not in message or value == "tiny-flux"


def test_a_folder_is_not_a_config_file(tmp_path):
    with pytest.raises(ConfigError, match="is a directory, not a YAML file"):
        load_config(tmp_path)


def test_submit_sends_a_shipped_name_as_the_name_and_a_file_as_its_text(tmp_path, monkeypatch):
    from pipeline.config import config_parameter

    assert config_parameter("sd35-medium-ocr") == "sd35-medium-ocr"
    assert config_parameter(TINY) == TINY.read_text()  # a path to a shipped file is a file
    path = _write(tmp_path, "train:\n  epochs: 3\n")
    assert config_parameter(path) == "train:\n  epochs: 3\n"
    with pytest.raises(ConfigError, match=r"config file .*missing\.yaml does not exist"):
        config_parameter(tmp_path / "missing.yaml")


def test_no_validation_message_doubles_a_word(tmp_path, monkeypatch):
    from pipeline.config import config_from_parameter

    monkeypatch.chdir(tmp_path)
    (tmp_path / "config.yaml").write_text("train: {epochs: 0}\n")  # the name the word would double with
    messages = []
    for load in (lambda: config_from_parameter("train: {epochs: 0}"),
                 lambda: load_config(_write(tmp_path, "train: {epochs: 0}\n")),
                 lambda: load_config("config.yaml")):
        with pytest.raises(ConfigError) as exc:
            load()
        messages.append(str(exc.value))
    assert messages[0].startswith("invalid config from the pipeline's config parameter: train.epochs")
    assert messages[1].startswith(f"invalid config {tmp_path / 'c.yaml'}: train.epochs")
    assert messages[2].startswith("invalid config.yaml: train.epochs")
    for message in messages:
        words = message.replace(":", " ").split()
        assert not [a for a, b in itertools.pairwise(words) if a == b], message


def test_a_path_given_as_the_pipeline_parameter_is_told_it_does_not_travel():
    from pipeline.config import config_from_parameter

    with pytest.raises(ConfigError, match=r"not a known config name .*a file path does not reach the pipeline's pods"):
        config_from_parameter("my.yaml")


def test_model_path_note_says_what_validate_can_know_of_the_model_here(tmp_path):
    from components.models.config import ModelConfig, model_path_note

    def note(path: str) -> str | None:
        return model_path_note(ModelConfig(kind="diffusers", path=path))

    assert model_path_note(ModelConfig(kind="tiny-flux")) is None  # built from config: no path to check
    assert note("s3://bucket/models/sd35m") == ("model.path s3://bucket/models/sd35m: checked when the run starts "
                                                "(needs the S3 credentials)")
    missing = note(str(tmp_path / "sd35m"))
    assert missing.startswith(f"model.path {tmp_path / 'sd35m'} does not exist on this machine: fine if it exists "
                              "where the training runs")
    assert missing.endswith("`flowgrpo train` here would stop on it")
    assert "no model_index.json" in note(str(tmp_path))
    (tmp_path / "model_index.json").write_text('{"_class_name": "StableDiffusion3Pipeline"}')
    assert note(str(tmp_path)) is None and note(f"file://{tmp_path}") is None
    with pytest.raises(ConfigError, match=r"model\.path: unsupported URI scheme"):
        note("http://example.com/sd35m")


def test_the_embedded_default_is_the_shapes_demo_on_held_out_prompts():
    c = load_config()
    assert DEFAULT_CONFIG.name == "shapes-cpu.yaml"
    assert (c.model.kind, c.model.resolution, c.dataset.source) == ("shapes-sd3", 48, "builtin:shapes")
    assert [r.name for r in c.rewards] == ["geneval_shapes"] and c.dataset.test_fraction > 0
    assert {r.args["mode"] for r in c.eval_rewards} == {"partial", "strict"}


def test_the_shapes_model_refuses_a_resolution_it_was_not_trained_at():
    with pytest.raises(ConfigError, match=r"model.resolution is 32, but the shapes-sd3 demo model was trained at "
                                          r"48 px; set model.resolution: 48"):
        load_config(DEFAULT_CONFIG, ["model.resolution=32"])


def test_a_config_name_too_long_for_the_filesystem_is_one_line():
    # Before: a traceback (OSError: File name too long) from the file lookup.
    with pytest.raises(ConfigError) as info:
        load_config("a" * 5000)
    assert str(info.value) == f"config {'a' * 60}...: File name too long"
