"""Every subcommand of `flowgrpo` takes the options it took before its declarations moved beside the functions
that run them: the list here is written out, not read from the parser."""

import argparse

from pipeline.cli import build_parser
from pipeline.config import DEFAULT_CONFIG

CONFIG = {"--config", "overrides"}
EXPECTED = {
    "train": CONFIG | {"--output", "--resume", "--auto-resume", "--mlflow-parent-run-id", "--ray-workers"},
    "reward-server": {"--rewards", "--config", "--host", "--port", "--log-level"},
    "validate": CONFIG,
    "evaluate": CONFIG | {"--lora", "--output", "--metrics", "--registered-model", "--mlflow-parent-run-id"},
    "rayjob": CONFIG | {"--output", "--run-id", "--mlflow-parent-run-id"},
    "prepare-dataset": {"--input", "--builtin", "--output", "--kind", "--test-fraction", "--seed", "--resolution",
                        "--max-prompt-tokens", "--allow-external-images"},
    "run": CONFIG | {"--local", "--workdir", "--ray-workers", "--ui-port"},
    "ui": {"--workdir", "--port"},
    "replay-mlflow": {"output", "--experiment", "--run-name", "--no-register", "--force"},
    "compile": {"--output", "--eval-gpus"},
    "submit": {"--host", "--experiment", "--run-name", "--namespace", "--config", "--eval-gpus", "--service-account",
               "arguments"},
}


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions if not isinstance(a, argparse._HelpAction)
            for s in (a.option_strings or [a.dest])}


def test_every_subcommand_takes_the_options_it_took():
    subcommands = _subcommands()
    assert list(subcommands) == list(EXPECTED)  # the order `flowgrpo --help` lists them in
    assert {name: _options(p) for name, p in subcommands.items()} == EXPECTED


def test_options_shared_by_commands_mean_the_same_in_each():
    subcommands = _subcommands()

    def option(command: str, flag: str) -> argparse.Action:
        return next(a for a in subcommands[command]._actions if flag in a.option_strings)

    assert {option(c, "--config").default for c in ("train", "validate", "evaluate", "rayjob", "run")} == \
        {DEFAULT_CONFIG}
    assert option("compile", "--eval-gpus").default == option("submit", "--eval-gpus").default == 1
    assert str(option("run", "--workdir").default) == str(option("ui", "--workdir").default) == ".flowgrpo"
    assert option("submit", "--config").default is None  # the pipeline's own default config, not the CLI's
