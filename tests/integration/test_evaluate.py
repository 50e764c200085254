"""Evaluation on the tiny model: determinism, a trained LoRA beats its base, the gate on a real registry."""

import html
import json
import uuid
from pathlib import Path

import pytest
from mlflow import MlflowClient

from components.evaluate.config import EvalConfig, GateConfig
from components.evaluate.evaluate import MIN_PROMPTS_FOR_CI, evaluate
from components.registry.versions import apply_gate
from components.trainer.training_run import train
from pipeline.config import TINY_CONFIG, load_config

EVAL = EvalConfig(images_per_prompt=2, max_prompts=6, bootstrap_samples=500)


def _quiet(_message: str) -> None:
    pass


@pytest.fixture(scope="module")
def trained(services, tmp_path_factory):
    """The tiny default config trained for 14 epochs with tracking on: (config, LoRA URI, history, model name)."""
    s3, mlflow = services
    name = f"eval-{uuid.uuid4().hex[:6]}"
    with pytest.MonkeyPatch.context() as mp:
        for key, value in {**s3.env(), **mlflow.env(),
                           "FLOWGRPO_CACHE_DIR": str(tmp_path_factory.mktemp("cache"))}.items():
            mp.setenv(key, value)
        config = load_config(TINY_CONFIG, [f"tracking.registered_model={name}", "tracking.system_metrics=false",
                                           "tracking.sample_every=0", "train.epochs=14"])
        result = train(config, f"s3://{s3.bucket}/eval/{uuid.uuid4().hex[:8]}", log=_quiet)
    assert result.learning_summary()["learned"]
    return config, result.lora_uri, result.history, name


@pytest.mark.slow
def test_same_lora_and_seeds_give_the_same_numbers_and_the_lora_beats_its_base(trained, env, tmp_path):
    config, lora, history, _ = trained
    a = evaluate(config, config.evaluation_rewards(), EVAL, lora, tmp_path / "a", history=history, log=_quiet)
    b = evaluate(config, config.evaluation_rewards(), EVAL, lora, tmp_path / "b", history=history, log=_quiet)
    assert json.loads(a.eval_path.read_text()) == json.loads(b.eval_path.read_text())
    row = a.summary["rewards"]["brightness"]
    assert row["n"] == 6 and row["lora_mean"] > row["base_mean"]
    assert row["ci_low"] > 0, row  # the improvement is not noise: the whole interval is above zero
    # ... but 6 prompts are too few for the gate to trust that interval
    assert not a.summary["gate"]["promoted"] and "only 6 prompt(s)" in a.summary["gate"]["reason"]
    # independent check of the reported means from the per-image scores
    base = [sum(p.base_scores["brightness"]) / 2 for p in a.prompts]
    assert row["base_mean"] == pytest.approx(sum(base) / len(base))
    deltas = [sum(p.lora_scores["brightness"]) / 2 - b for p, b in zip(a.prompts, base, strict=True)]
    shown = 6 + min(3, sum(d > 0 for d in deltas)) + min(3, sum(d < 0 for d in deltas))  # + wins and losses
    assert a.report_path.read_text().count("data:image/png;base64,") == shown * 2 * 2


def test_gate_promotes_with_a_lenient_threshold_and_refuses_with_a_strict_one(trained, env, services, tmp_path):
    config, lora, history, name = trained
    # The gate needs MIN_PROMPTS_FOR_CI prompts; the tiny config has 8, so evaluate on 4 more.
    config = config.model_copy(update={"data": config.data.model_copy(update={"prompts": [
        *config.data.prompts, "a green bicycle by a canal", "an owl on a fence post", "a teapot on a stove",
        "a sailboat on a calm lake"]})})
    wide = EVAL.model_copy(update={"max_prompts": None})
    client = MlflowClient(services[1].url)
    (version,) = client.search_model_versions(f"name='{name}'")
    lenient = wide.model_copy(update={"gate": GateConfig(min_improvement=0.0)})
    result = evaluate(config, config.evaluation_rewards(), lenient, lora, tmp_path / "lenient", history=history,
                      log=_quiet)
    gate, row = result.summary["gate"], result.summary["rewards"]["brightness"]
    assert row["n"] == 12 >= MIN_PROMPTS_FOR_CI
    assert gate["promoted"] and "brightness improved" in gate["reason"]
    assert apply_gate(name, version.version, gate["promoted"], gate["reason"], gate["alias"], log=_quiet)
    assert client.get_model_version_by_alias(name, "candidate").version == version.version
    assert client.get_model_version(name, version.version).tags["flowgrpo.gate"] == "promoted"

    # A threshold equal to the mean gain: a mean-based gate promotes, but the CI reaches below it.
    assert row["ci_low"] < row["delta"]
    strict = wide.model_copy(update={"gate": GateConfig(min_improvement=row["delta"])})
    result = evaluate(config, config.evaluation_rewards(), strict, lora, tmp_path / "strict", history=history,
                      log=_quiet)
    gate = result.summary["gate"]
    assert not gate["promoted"] and f"lower bound {row['ci_low']:+.3g} <= required" in gate["reason"]
    assert apply_gate(name, version.version, gate["promoted"], gate["reason"], gate["alias"], log=_quiet)
    tags = client.get_model_version(name, version.version).tags
    assert tags["flowgrpo.gate"] == "refused" and tags["flowgrpo.gate_reason"] == gate["reason"]
    assert "candidate" not in client.get_registered_model(name).aliases
    assert html.escape(gate["reason"]) in Path(result.report_path).read_text()
