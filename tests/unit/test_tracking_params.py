"""What a run records about itself: params without secrets, stable hashes, lineage tags."""

import pytest

from components.tracking import params as tp
from pipeline.config import TINY_CONFIG, load_config


def test_flatten_indexes_sections_and_keeps_value_lists_whole():
    flat = tp.flatten_params({"train": {"lr": 0.1, "ema": {"on": True}}, "rewards": [{"name": "ocr"}, {"name": "j"}],
                              "data": {"prompts": ["a", "b"], "path": None}})
    assert flat == {"train.lr": "0.1", "train.ema.on": "true", "rewards.0.name": "ocr", "rewards.1.name": "j",
                    "data.prompts": '["a", "b"]', "data.path": "null"}


def test_secret_looking_keys_are_dropped_and_url_passwords_masked():
    flat = tp.flatten_params({"rewards": [{"args": {"api_key": "sk-123", "base_url": "http://u:pw@judge:8000/v1",
                                                    "aws_secret_access_key": "x", "model": "m"}}],
                              "auth_token": "t", "reward_server": {"url": "https://bob:hunter2@rs"}})
    text = repr(flat)
    for secret in ("sk-123", "pw@", "hunter2", "'x'", "'t'"):
        assert secret not in text
    assert flat["rewards.0.args.base_url"] == "http://***@judge:8000/v1"
    assert flat["reward_server.url"] == "https://***@rs"
    assert flat["rewards.0.args.model"] == "m"


def test_long_values_are_cut_to_the_mlflow_limit():
    flat = tp.flatten_params({"data": {"prompts": ["x" * 100] * 100}})
    assert len(flat["data.prompts"]) == tp.MAX_PARAM_CHARS and flat["data.prompts"].endswith("…")


def test_every_param_of_the_shipped_config_fits_mlflow():
    flat = tp.flatten_params(load_config().model_dump(mode="json"))
    assert "train.learning_rate" in flat and "tracking.sample_every" in flat
    assert all(len(k) <= 250 and len(v) <= tp.MAX_PARAM_CHARS for k, v in flat.items())


def test_content_hash_ignores_key_order_and_sees_values():
    assert tp.content_hash({"a": 1, "b": [1, 2]}) == tp.content_hash({"b": [1, 2], "a": 1})
    assert tp.content_hash({"a": 1}) != tp.content_hash({"a": 2})


def test_lineage_tags(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("FLOWGRPO_GIT_COMMIT", "abc123")
    monkeypatch.setenv("FLOWGRPO_IMAGE", "registry/flowgrpo-trainer:0.1.0")
    config = load_config(TINY_CONFIG).model_dump(mode="json")
    tags = tp.lineage_tags(config, ["p1", "p2"])
    assert tags["flowgrpo.git_commit"] == "abc123"
    assert tags["flowgrpo.image"] == "registry/flowgrpo-trainer:0.1.0"
    assert tags["flowgrpo.dataset_uri"] == "inline:data.prompts"
    assert tags["flowgrpo.dataset_rows"] == "2"
    assert tags["flowgrpo.dataset_hash"] != tp.lineage_tags(config, ["p1", "p3"])["flowgrpo.dataset_hash"]
    assert tags["flowgrpo.base_model"] == "tiny-sd3"
    config["train"]["learning_rate"] = 0.5
    assert tags["flowgrpo.config_hash"] != tp.lineage_tags(config, ["p1", "p2"])["flowgrpo.config_hash"]


def test_git_commit_falls_back_to_the_checkout(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("FLOWGRPO_GIT_COMMIT", raising=False)
    commit = tp.git_commit()
    assert commit == "unknown" or (len(commit) == 40 and all(c in "0123456789abcdef" for c in commit))
