"""The experiment config: the stages' sections composed into one pydantic schema (``ExperimentConfig``), read
from a YAML file or a shipped config of ``pipeline/configs/`` by name, with ``key.sub=value`` overrides, or from
the pipeline's ``config`` parameter. The embedded default (``--config`` and the pipeline parameter) is
``shapes-cpu.yaml``, the shapes demo; ``tiny-cpu.yaml`` spells out the schema defaults, the random tiny model
the tests train.

Everything is validated before anything starts; every error names the full key path
(``train.learning_rate``) or the file and line.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, model_validator

from components.config_base import ENV_SOURCE, chained, format_validation_error, load_yaml, read_yaml_mapping
from components.dataset.config import PrepareConfig
from components.errors import ConfigError
from components.evaluate.config import EvalConfig
from components.launch.kubernetes.cluster_config import RayJobConfig
from components.launch.kubernetes.reward_deploy_config import RewardDeployConfig
from components.rewards.registry import RewardSpec, check_names, check_unique_keys
from components.trainer.config import TrainingJobConfig

CONFIG_DIR = Path(__file__).parent / "configs"
DEFAULT_CONFIG = CONFIG_DIR / "shapes-cpu.yaml"  # the embedded default: `--config` and the pipeline parameter
TINY_CONFIG = CONFIG_DIR / "tiny-cpu.yaml"  # the schema defaults, spelt out: the fast random model of the tests


class ExperimentConfig(TrainingJobConfig):
    """The whole experiment: the trainer's sections plus evaluation, dataset preparation, the cluster and the
    reward server's deployment, and the checks that span sections."""

    eval_rewards: list[RewardSpec] | None = Field(
        default=None, description="rewards for evaluation, kept apart from training; null = the training rewards",
    )
    eval: EvalConfig = Field(default_factory=EvalConfig, description="evaluation of the LoRA and the promotion gate")
    dataset: PrepareConfig = Field(
        default_factory=PrepareConfig,
        description="the pipeline's prepare_dataset step; a plain `flowgrpo train` reads `data:` as it is",
    )
    cluster: RayJobConfig = Field(
        default_factory=RayJobConfig,
        description="the KubeRay RayJob a cluster run becomes (`flowgrpo rayjob`); a local `train` ignores it",
    )
    reward_deploy: RewardDeployConfig = Field(
        default_factory=RewardDeployConfig,
        description="the reward server the pipeline deploys for the run's training rewards (a Deployment + Service "
                    "on a cluster, a process locally) and removes when the run ends",
    )

    @model_validator(mode="after")
    def _check_eval_rewards(self) -> ExperimentConfig:
        if self.eval_rewards is not None:
            if not self.eval_rewards:
                raise ValueError("eval_rewards is empty; use null to evaluate with the training rewards")
            check_unique_keys(self.eval_rewards, "eval_rewards")
            check_names(self.eval_rewards, "eval_rewards")
        keys = [s.key for s in self.evaluation_rewards()]
        gate = self.eval.gate
        for where, key in [("eval.gate.metric", gate.metric), *(("eval.gate.guards", k) for k in gate.guards)]:
            if key is not None and key not in keys:
                raise ValueError(f"{where}: {key!r} is not an eval reward (they are: {', '.join(keys)})")
        return self

    def evaluation_rewards(self) -> list[RewardSpec]:
        return self.eval_rewards if self.eval_rewards is not None else self.rewards


def check_rewards(config: ExperimentConfig) -> None:
    """Resolve each reward this machine's run scores in-process with the function the trainer and the evaluation
    build them with (``check_spec``: a custom reward's module is imported, its class must be a Reward, its
    arguments must fit), so `flowgrpo validate` fails with the line `train` would: the training rewards unless
    a reward server scores them, and the evaluation rewards (the training ones when ``eval_rewards`` is null)."""
    from components.rewards.registry import check_specs

    lists = {"eval_rewards": config.eval_rewards} if config.eval_rewards is not None else {}
    if config.reward_server.url is None or config.eval_rewards is None:
        lists = {"rewards": config.rewards, **lists}
    for where, specs in lists.items():
        check_specs(specs, where)


def _parse_override(text: str) -> tuple[list[str], Any]:
    if not isinstance(text, str):  # a pipeline's `overrides` argument is YAML: its items could be anything
        raise ConfigError(f"override {text!r} must be a string key.sub=value, got {type(text).__name__}")
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {text!r} must look like key.sub=value")
    if not key.isprintable():  # a control character would reach the terminal in an error naming the key
        raise ConfigError(f"override {key!r}: a key holds no control characters")
    return key.strip().split("."), load_yaml(raw, f"override {key.strip()}") if raw.strip() else None


def apply_override(data: dict[str, Any], text: str) -> None:
    """Set ``key.sub=value`` in the raw config dict; list items are addressed by index (``rewards.0.weight``)."""
    path, value = _parse_override(text)
    node: Any = data
    for i, part in enumerate(path[:-1]):
        if isinstance(node, list):
            node = node[_list_index(node, part, path[: i + 1])]
        else:
            if node.get(part) is None:
                node[part] = {}
            node = node[part]
            if not isinstance(node, dict | list):
                raise ConfigError(f"override {'.'.join(path)}: {'.'.join(path[: i + 1])} is not a section")
    last = path[-1]
    if isinstance(node, list):
        node[_list_index(node, last, path)] = value
    else:
        node[last] = value


def _list_index(node: list, part: str, path: list[str]) -> int:
    if not part.isdigit() or int(part) >= len(node):
        raise ConfigError(f"override {'.'.join(path)}: {part!r} is not an index of a list of {len(node)} items")
    return int(part)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> ExperimentConfig:
    """Read ``path`` (a YAML file or a shipped config's name, see ``resolve_config``; default: the embedded
    default, ``shapes-cpu.yaml``), apply overrides, validate."""
    path = Path(path) if path is not None else DEFAULT_CONFIG
    return _validated(read_yaml_mapping(resolve_config(path)), overrides, str(path))


CONFIG_FILE_SUFFIXES = (".yaml", ".yml", ".json")


def resolve_config(value: str | Path) -> Path:
    """The file ``--config VALUE`` names: a YAML (or JSON) file, else a shipped config by name
    (``tiny-flux-cpu`` = ``pipeline/configs/tiny-flux-cpu.yaml``). A file wins over a shipped name, so a local
    ``tiny-cpu`` file is read as it is. ``env:NAME`` is passed through (``read_yaml_mapping`` reads it)."""
    path, text = Path(value), str(value)
    try:
        if text.startswith(ENV_SOURCE) or path.is_file():
            return path
    except OSError as exc:  # a name the filesystem refuses (too long)
        raise ConfigError(f"config {text[:60]}...: {exc.strerror}") from exc
    if (bundled := bundled_config(text)) is not None:
        return bundled
    shipped = ", ".join(example_configs())
    if path.is_dir():
        raise ConfigError(f"config {text} is a directory, not a YAML file (or give a shipped config name: {shipped})")
    if path.suffix in CONFIG_FILE_SUFFIXES or "/" in text or os.sep in text:
        raise ConfigError(f"config file {text} does not exist (or give a shipped config name: {shipped})")
    close = difflib.get_close_matches(text, example_configs(), n=1)
    guess = f"did you mean {close[0]}? " if close else ""
    raise ConfigError(f"config {text!r} is neither a YAML file nor a shipped config name ({guess}shipped: {shipped})")


def bundled_config(name: str) -> Path | None:
    """``pipeline/configs/NAME.yaml`` when ``name`` names one of the example configs shipped in the package."""
    # Looked up among the shipped names, not on disk: a config's text (the pipeline parameter) is no file name.
    return CONFIG_DIR / f"{name}.yaml" if name in example_configs() else None


def config_parameter(value: str | Path) -> str:
    """What ``flowgrpo submit --config VALUE`` sends as the pipeline's ``config`` parameter: a shipped config
    by its name (the images ship the same files), a file as its text (the pipeline's pods cannot read it)."""
    path = resolve_config(value)
    if path == bundled_config(str(value)):
        return str(value)
    if str(path).startswith(ENV_SOURCE):
        return yaml.safe_dump(read_yaml_mapping(path), sort_keys=False)
    return path.read_text(encoding="utf-8")


def config_from_parameter(value: str, overrides: list[str] | None = None) -> ExperimentConfig:
    """The pipeline's ``config`` parameter: an example config's name (``tiny-cpu``), or a whole experiment
    config as YAML or JSON text; then ``overrides``."""
    value = value.strip()
    if (path := bundled_config(value or DEFAULT_CONFIG.stem)) is not None:
        return load_config(path, overrides)
    shipped = ", ".join(example_configs())
    try:
        data = load_yaml(value, "config parameter")
    except ConfigError as exc:
        raise ConfigError(f"{exc} (the parameter is neither a known config name ({shipped}) nor a valid "
                          "YAML/JSON config)") from exc
    if not isinstance(data, dict):
        # A file path cannot travel: the pipeline's pods do not see this machine's files.
        hint = (" (a file path does not reach the pipeline's pods; `flowgrpo submit --config FILE` sends the "
                "file's text)" if Path(value).suffix in CONFIG_FILE_SUFFIXES or "/" in value else "")
        raise ConfigError(f"config parameter {value[:60]!r}: not a known config name "
                          f"({shipped}) and not a YAML/JSON mapping of config sections{hint}")
    # The source completes "invalid config ..." (format_validation_error): worded not to repeat "config".
    return _validated(data, overrides, "from the pipeline's config parameter")


def example_configs() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.yaml"))


def _validated(data: dict[str, Any], overrides: list[str] | None, source: str) -> ExperimentConfig:
    for text in overrides or []:
        apply_override(data, text)
    try:
        return ExperimentConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, source)) from chained(exc, source)


def dump_config(config: ExperimentConfig) -> str:
    """The config as YAML text that ``config_from_parameter`` reads back to an equal config."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
