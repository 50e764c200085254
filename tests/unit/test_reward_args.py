"""The built-in rewards' arguments models: a bad type or an out-of-range value is refused when a config loads (the
trainer's, the experiment's, the reward server's, `flowgrpo validate`), naming its key path; a good one builds the
reward it describes; docs/REWARDS.md is what the models generate."""

from __future__ import annotations

from pathlib import Path

import pytest

from components.errors import ConfigError
from components.reward_server.settings import load_settings
from components.rewards.arguments import NoArgs
from components.rewards.docs_page import markdown
from components.rewards.registry import BUILTIN, RewardSpec, build_reward, reward_class
from components.trainer.config import TrainingJobConfig
from pipeline.cli import main
from pipeline.config import load_config

REPO = Path(__file__).resolve().parents[2]
CLIP = {"model_path": "/models/clip"}
JUDGE = {"base_url": "http://127.0.0.1:8000/v1", "model": "judge"}
# name -> (valid args, [(a key path, what merged into the valid args gives it a wrong type, then an out-of-range
# value)]). A reward without arguments has neither: any key is refused.
CASES = {
    "geneval_shapes": ({}, [("min_area_fraction", {"min_area_fraction": "0.1"}),
                            ("min_area_fraction", {"min_area_fraction": 0.5})]),
    "shapes_edit": ({}, [("mode", {"mode": 1}), ("min_area_fraction", {"min_area_fraction": -0.1})]),
    "edit_consistency": ({}, [("margin", {"margin": "wide"}), ("margin", {"margin": 0.5})]),
    "ocr": ({}, [("use_angle_cls", {"use_angle_cls": 1}), ("min_confidence", {"min_confidence": -0.1})]),
    "clip_score": (CLIP, [("max_batch_size", {"max_batch_size": 2.0}), ("max_batch_size", {"max_batch_size": 0})]),
    "pickscore": (CLIP, [("device", {"device": 0}), ("max_batch_size", {"max_batch_size": -1})]),
    "aesthetic": ({**CLIP, "head_path": "/models/head.pt"},
                  [("head_path", {"head_path": 3}), ("max_batch_size", {"max_batch_size": 0})]),
    "vlm_judge": (JUDGE, [("retries", {"retries": "3"}), ("max_tokens", {"mode": "score", "max_tokens": 0})]),
    "rank": ({"reward": {"name": "ocr"}},
             [("reward", {"reward": "ocr"}),
              ("reward.args.min_confidence", {"reward": {"name": "ocr", "args": {"min_confidence": 2}}})]),
}
NO_ARGS = sorted(name for name, builtin in BUILTIN.items() if builtin.args is NoArgs)


def _bad(name: str) -> list[tuple[str, dict, str]]:
    if name in NO_ARGS:
        return [(name, {"quality": 95}, "quality: unknown key")]
    valid, cases = CASES[name]
    return [(name, {**valid, **bad}, f"{path}: Input should be") for path, bad in cases]


BAD = [case for name in BUILTIN for case in _bad(name)]


def test_every_built_in_reward_is_covered():
    assert sorted(CASES) == sorted(set(BUILTIN) - set(NO_ARGS))


@pytest.mark.parametrize(("name", "args", "message"), BAD)
def test_a_bad_argument_is_refused_when_the_trainer_config_loads(name, args, message):
    with pytest.raises(ConfigError) as info:
        TrainingJobConfig.from_sections({"rewards": [{"name": "brightness"}, {"name": name, "args": args}]}, "test")
    assert f"rewards.1.args.{message}" in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(("name", "args", "message"), BAD)
def test_a_bad_argument_is_refused_in_the_eval_rewards_and_the_servers_settings(name, args, message, tmp_path):
    spec = RewardSpec.model_construct(name=name, args=args).model_dump(exclude_unset=True)  # written as a user would
    with pytest.raises(ConfigError, match=r"eval_rewards\.0\.args\.") as info:
        load_config(None, [f"eval_rewards=[{spec}]"])
    assert f"eval_rewards.0.args.{message}" in str(info.value)
    settings = tmp_path / "rewards.yaml"
    settings.write_text(f"rewards: [{spec}]\n")
    with pytest.raises(ConfigError) as info:
        load_settings(settings, None)
    assert str(info.value).startswith(f"invalid config {settings}: rewards.0.args.{message}")


def test_validate_reports_a_bad_argument_by_its_key_path(capsys):
    assert main(["validate", "--config", "tiny-cpu", "rewards.0.args={quality: 95}"]) == 2
    assert "rewards.0.args.quality: unknown key" in capsys.readouterr().err
    judge = "rewards=[{name: vlm_judge, args: {base_url: 'http://judge:8000/v1', model: m, max_concurrency: 0}}]"
    assert main(["validate", "--config", "tiny-cpu", judge]) == 2
    message = "rewards.0.args.max_concurrency: Input should be greater than or equal to 1 (got 0)"
    assert message in capsys.readouterr().err


def test_args_are_kept_as_written():
    """The run's config.yaml and the reward server's settings carry the user's mapping, not the model's defaults."""
    spec = RewardSpec(name="vlm_judge", args={**JUDGE, "max_tokens": None, "retries": 0})
    assert spec.model_dump()["args"] == {**JUDGE, "max_tokens": None, "retries": 0}


def test_a_good_config_builds_the_reward_it_describes():
    judge = build_reward(RewardSpec(name="vlm_judge", args={**JUDGE, "mode": "score", "score_min": 1,
                                                            "score_max": 5, "retries": 0, "backoff_s": 0}))
    assert (judge.mode, judge.max_tokens, judge.retries, judge.backoff_s, judge.max_concurrency) == ("score", 16, 0,
                                                                                                     0.0, 8)
    assert "from 1 (not at all) to 5 (perfectly)" in judge.question and judge.api_key_env == "VLM_JUDGE_API_KEY"
    shapes = build_reward(RewardSpec(name="geneval_shapes", args={"min_area_fraction": 0}))
    assert (shapes.mode, shapes.min_area_fraction) == ("partial", 0.0)
    ranked = build_reward(RewardSpec(name="rank", args={"reward": {"name": "geneval_shapes",
                                                                   "args": {"mode": "strict"}}}))
    assert ranked.inner.mode == "strict"


@pytest.mark.parametrize("name", sorted(BUILTIN))
def test_a_classs_model_is_the_one_its_config_is_checked_against(name):
    """The light table (config loads without the model libraries) and the classes name the same models."""
    assert (reward_class(name).Args or NoArgs) is BUILTIN[name].args


def test_the_published_schemas_are_the_models():
    assert (REPO / "docs" / "REWARDS.md").read_text(encoding="utf-8") == markdown(), \
        "regenerate: python -m components.rewards.docs_page > docs/REWARDS.md"
