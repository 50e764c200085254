"""Training with rewards on the reward server (real HTTP) and with misbehaving rewards."""

import json
import math

import pytest
from metric_rows import without_timing
from safetensors.torch import load_file
from servers import free_port, running_server

from components.errors import RewardError
from components.reward_server.settings import ServerSettings
from components.rewards.registry import RewardSpec
from components.trainer.training_run import train


def _quiet(_m):
    pass


def _server(*specs):
    return running_server(ServerSettings(rewards=[RewardSpec(**s) for s in specs]))


def test_remote_rewards_give_exactly_the_in_process_run(small_config, tmp_path):
    local = train(small_config(), tmp_path / "local", log=_quiet)
    with _server({"name": "brightness"}) as url:
        remote = train(small_config(f"reward_server.url={url}"), tmp_path / "remote", log=_quiet)
    assert without_timing(remote.history) == without_timing(local.history)
    a, b = load_file(str(local.lora_dir / "pytorch_lora_weights.safetensors")), load_file(
        str(remote.lora_dir / "pytorch_lora_weights.safetensors"))
    assert all((a[k] == b[k]).all() for k in a)


def test_hanging_reward_times_out_is_recorded_and_training_continues(small_config, tmp_path):
    with _server({"name": "brightness"},
                 {"name": "reward_fixtures:Hang", "label": "hang", "args": {"seconds": 30}, "timeout_s": 0.3}) as url:
        result = train(small_config(f"reward_server.url={url}",
                                    "rewards=[{name: brightness}, {name: hang}]"), tmp_path, log=_quiet)
    assert [r["epoch"] for r in result.history] == [1, 2]
    for row in result.history:
        assert row["reward/hang/failed_fraction"] == 1.0 and row["reward/brightness/failed_fraction"] == 0.0
        assert row["failed_fraction"] == 1.0  # every combined reward failed: no sample got an advantage
        assert row["update/advantage_abs_mean"] == 0.0 and math.isfinite(row["policy_loss"])


def test_nan_rewards_are_excluded_end_to_end(small_config, tmp_path):
    prompts = "data.prompts=[prompt 1, prompt 2, prompt 3, prompt 4]"
    with _server({"name": "reward_fixtures:NanOdd", "label": "nan_odd"}) as url:
        result = train(small_config(f"reward_server.url={url}", prompts, "rewards=[{name: nan_odd}]"), tmp_path,
                       log=_quiet)
    for line in (tmp_path / "metrics.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c} in metrics.jsonl"))
    for row in result.history:
        failed = row["reward/nan_odd/failed_fraction"]
        assert failed in (0.0, 0.5, 1.0)  # 2 prompts per epoch, each odd or even
        assert (row["reward/mean"] is None) == (failed == 1.0)
        assert math.isfinite(row["update/advantage_abs_mean"]) and math.isfinite(row["policy_loss"])
        assert math.isfinite(row["grad_norm"])
    assert any(row["reward/nan_odd/failed_fraction"] > 0 for row in result.history)


def test_required_reward_failure_aborts_with_its_name(small_config, tmp_path):
    with pytest.raises(RewardError, match=r"required reward 'boom' failed on 8 of 8 samples: RuntimeError"):
        train(small_config("rewards=[{name: brightness}, {name: 'reward_fixtures:Boom', label: boom, "
                           "required: true}]"), tmp_path, log=_quiet)


def test_optional_failing_reward_is_counted_not_fatal(small_config, tmp_path):
    result = train(small_config("rewards=[{name: brightness}, {name: 'reward_fixtures:Boom', label: boom, "
                                "weight: 0.5}]", "train.epochs=1"), tmp_path, log=_quiet)
    assert result.history[0]["reward/boom/failed_fraction"] == 1.0


def test_server_down_is_a_clear_error_after_retries(small_config, tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(RewardError, match=rf"reward server {url}/v1/rewards: gave up after \d+ attempts in \d+ s, "
                                          r"last: Connect.*\(reward_server\.retry_window_s 2 s\)"):
        train(small_config(f"reward_server.url={url}", "reward_server.retry_window_s=2"), tmp_path, log=_quiet)


def test_server_without_the_configured_reward_is_named(small_config, tmp_path):
    with _server({"name": "jpeg_compressibility"}) as url, pytest.raises(
        RewardError, match="does not serve brightness; it serves jpeg_compressibility"
    ):
        train(small_config(f"reward_server.url={url}"), tmp_path, log=_quiet)


def test_groupwise_rank_reward_trains_in_process(small_config, tmp_path):
    result = train(small_config("rewards=[{name: rank, args: {reward: {name: brightness}}}]", "train.epochs=1"),
                   tmp_path, log=_quiet)
    row = result.history[0]
    # ranks within each group of 4 are {0, 1/4, 2/4, 3/4}: mean 0.375, population std sqrt(5)/8
    assert row["reward/mean"] == pytest.approx(0.375)
    assert row["reward/std"] == pytest.approx(math.sqrt(5) / 8)


@pytest.mark.slow
def test_default_config_learns_as_well_through_the_server(tmp_path):
    from pipeline.config import TINY_CONFIG, load_config

    # 8 of the config's 40 epochs: the whole-run equality is the point, and seed 0's trend is 8 standard errors above
    # 0 by epoch 8
    local = train(load_config(TINY_CONFIG, ["train.epochs=8"]), tmp_path / "local", log=_quiet)
    with _server({"name": "brightness"}) as url:
        remote = train(load_config(TINY_CONFIG, ["train.epochs=8", f"reward_server.url={url}"]), tmp_path / "remote",
                       log=_quiet)
    s = remote.learning_summary()
    assert s["learned"], s
    assert s == local.learning_summary()
    assert json.dumps(without_timing(remote.history)) == json.dumps(without_timing(local.history))


def test_each_sample_is_scored_with_its_own_prompt(small_config, tmp_path):
    prompts = ["a", "bbbb", "cccccccccccccccc"]
    result = train(small_config(f"data.prompts={json.dumps(prompts)}", "train.epochs=3",
                                "rewards=[{name: 'reward_fixtures:PromptLength', label: plen}]"), tmp_path, log=_quiet)
    lengths = {len(p) for p in prompts}
    for row in result.history:
        # 2 distinct prompts per epoch, 4 samples each: the mean is the mean of two distinct lengths
        assert row["reward/plen/mean"] in {(a + b) / 2 for a in lengths for b in lengths if a != b}
        assert row["zero_std_group_fraction"] == 1.0  # a group's samples share a prompt, so a score


def test_each_sample_is_scored_with_its_rows_metadata(small_config, tmp_path):
    rows = [{"prompt": "sign A", "ground_truth": "x"}, {"prompt": "sign B", "ground_truth": "xxxx"},
            {"prompt": "sign C", "ground_truth": "xxxxxxxxx"}]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = train(small_config("data.prompts=null", f"data.path={data}", "train.epochs=3",
                                "rewards=[{name: 'reward_fixtures:GroundTruthLength', label: gt}]"),
                   tmp_path / "out", log=_quiet)
    lengths = [1, 4, 9]
    for row in result.history:
        # 2 distinct rows per epoch, 4 samples each: the mean is the mean of two distinct targets' lengths
        assert row["reward/gt/mean"] in {(a + b) / 2 for a in lengths for b in lengths if a != b}
