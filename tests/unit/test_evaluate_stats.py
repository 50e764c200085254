"""Evaluation statistics, the promotion gate and the reward-hacking check, against closed forms."""

import math

import numpy as np
import pytest

from components.evaluate.config import EvalConfig, GateConfig
from components.evaluate.evaluate import (
    MIN_PROMPTS_FOR_CI,
    few_prompts_warnings,
    gate_decision,
    hacking_warnings,
    paired_bootstrap,
    summarize,
)
from components.evaluate.report import PromptResult


def test_bootstrap_of_a_constant_delta_is_that_delta():
    base = np.array([0.1, 0.5, 0.9])
    assert paired_bootstrap(base, base + 0.25, 500, 0.95, 0) == pytest.approx((0.25, 0.25))


def test_bootstrap_of_two_values_follows_the_binomial():
    # deltas {0, 1}: a resampled mean is 0, 1/2 or 1 with probabilities 1/4, 1/2, 1/4,
    # so the 95% percentile interval is [0, 1] and the 50% one is [1/2, 1/2]
    base, lora = np.zeros(2), np.array([0.0, 1.0])
    assert paired_bootstrap(base, lora, 20000, 0.95, 1) == (0.0, 1.0)
    assert paired_bootstrap(base, lora, 20000, 0.4, 1) == (0.5, 0.5)


def test_bootstrap_interval_narrows_with_more_prompts_and_is_seeded():
    rng = np.random.default_rng(0)
    small, large = rng.normal(size=8), rng.normal(size=800)
    lo_s, hi_s = paired_bootstrap(np.zeros(8), small, 2000, 0.95, 3)
    lo_l, hi_l = paired_bootstrap(np.zeros(800), large, 2000, 0.95, 3)
    assert hi_l - lo_l < (hi_s - lo_s) / 4  # width ~ 1/sqrt(n): 100x the prompts, about 1/10 the width
    assert lo_l < large.mean() < hi_l
    assert paired_bootstrap(np.zeros(8), small, 2000, 0.95, 3) == (lo_s, hi_s)


def _prompt(base: dict, lora: dict) -> PromptResult:
    return PromptResult("p", 0, [], [], base, lora)


def test_summarize_pairs_prompts_and_drops_those_a_model_failed():
    prompts = [_prompt({"r": [1.0, 3.0]}, {"r": [4.0, 4.0]}),
               _prompt({"r": [0.0, 0.0]}, {"r": [1.0, math.nan]}),   # LoRA mean over its scored image: 1
               _prompt({"r": [math.nan, math.nan]}, {"r": [9.0, 9.0]})]  # base failed: not comparable
    row = summarize(prompts, ["r"], EvalConfig(bootstrap_samples=200))["r"]
    assert row["n"] == 2
    assert row["base_mean"] == pytest.approx((2.0 + 0.0) / 2)
    assert row["lora_mean"] == pytest.approx((4.0 + 1.0) / 2)
    assert row["delta"] == pytest.approx(((4 - 2) + (1 - 0)) / 2)
    assert row["ci_low"] <= row["delta"] <= row["ci_high"]


def _rewards(**deltas):
    return {k: {"delta": d} for k, d in deltas.items()}


def _row(delta: float, low: float, high: float, n: int = 32) -> dict:
    """A summary row as ``summarize`` writes it, for a 95% CI over n prompts."""
    return {"delta": delta, "ci_low": low, "ci_high": high, "ci_level": 0.95, "n": n,
            "few_prompts": n < MIN_PROMPTS_FOR_CI}


def test_gate_promotes_when_the_ci_lower_bound_is_above_the_threshold_and_says_so():
    rewards = {"geneval": _row(0.067, 0.021, 0.113), "aesthetic": _row(-0.01, -0.03, 0.01)}
    ok, why = gate_decision(rewards, GateConfig(guards={"aesthetic": 0.05}))
    assert ok
    assert why == ("geneval improved by +0.067 (95% CI [+0.021, +0.113]), lower bound > +0 required; "
                   "guards within tolerance (aesthetic)")
    ok, why = gate_decision(rewards, GateConfig(min_improvement=0.02))
    assert ok and why.endswith("lower bound > +0.02 required; no guards")


@pytest.mark.parametrize(("low", "required"), [(-0.012, 0.0), (0.0, 0.0), (0.021, 0.05)])
def test_gate_holds_a_positive_mean_whose_ci_lower_bound_is_not_above_the_threshold(low, required):
    # The mean gain is above the threshold each time: the old rule (mean delta >= threshold) promoted these.
    ok, why = gate_decision({"geneval": _row(0.067, low, 0.113)}, GateConfig(min_improvement=required))
    assert not ok
    assert why == (f"geneval changed by +0.067 (95% CI [{low:+.3g}, +0.113]), lower bound {low:+.3g} <= "
                   f"required {required:+.3g}")


def test_gate_refuses_a_ci_over_too_few_prompts_however_good_it_looks():
    ok, why = gate_decision({"geneval": _row(0.5, 0.4, 0.6, n=4)}, GateConfig())
    assert not ok
    assert why == ("geneval was scored on only 4 prompt(s): at least 10 are needed for the CI to mean "
                   "anything; raise eval.max_prompts or the test split")
    assert not gate_decision({"geneval": _row(0.5, 0.4, 0.6, n=MIN_PROMPTS_FOR_CI - 1)}, GateConfig())[0]
    assert gate_decision({"geneval": _row(0.5, 0.4, 0.6, n=MIN_PROMPTS_FOR_CI)}, GateConfig())[0]


def test_gate_guards_limit_the_mean_drop_and_other_refusals_say_why():
    good, guarded = _row(0.2, 0.1, 0.3), GateConfig(guards={"aesthetic": 0.05})
    # a guard judges its mean drop, not its CI: this CI reaches -0.2, the mean drop 0.04 is within 0.05
    assert gate_decision({"ocr": good, "aesthetic": _row(-0.04, -0.2, 0.1)}, guarded)[0]
    ok, why = gate_decision({"ocr": good, "aesthetic": _row(-0.1, -0.15, -0.05)}, guarded)
    assert not ok and why == "guard aesthetic dropped by 0.1 > tolerance 0.05"
    ok, why = gate_decision({"ocr": good}, GateConfig(metric="pickscore"))
    assert not ok and "'pickscore' is not an eval reward" in why
    ok, why = gate_decision({"ocr": _row(math.nan, math.nan, math.nan, n=0)}, GateConfig())
    assert not ok and "no score" in why
    # default: the first reward is gated, the second (a large drop) is not looked at
    assert gate_decision({"first": good, "second": _row(-5.0, -6.0, -4.0)}, GateConfig())[0]


def _paired(deltas: list[float]) -> list[PromptResult]:
    """One image per prompt, base score i / 8 and LoRA score base + delta (dyadic: the arithmetic is exact)."""
    return [_prompt({"r": [i / 8]}, {"r": [i / 8 + d]}) for i, d in enumerate(deltas)]


def test_gate_through_summarize_on_identical_deltas_where_the_ci_is_that_delta():
    row = summarize(_paired([1 / 8] * 12), ["r"], EvalConfig())["r"]
    assert (row["delta"], row["ci_low"], row["ci_high"]) == (0.125, 0.125, 0.125)
    assert gate_decision({"r": row}, GateConfig(min_improvement=0.0625))[0]
    assert not gate_decision({"r": row}, GateConfig(min_improvement=0.125))[0]  # "above", not "at least"
    ok, why = gate_decision(summarize(_paired([1 / 8] * 4), ["r"], EvalConfig()), GateConfig())
    assert not ok and "only 4 prompt(s)" in why


def test_gate_through_summarize_holds_a_mean_gain_that_a_few_bad_prompts_make_uncertain():
    # 10 prompts gain 1/64, 2 lose 1/16: the mean gain is 2/64/12 = 1/384 > 0. A resampled mean with k of
    # the losing prompts is ((12 - k) - 4k)/64/12, negative for k >= 3. k ~ Binomial(12, 1/6):
    # P(k >= 5) = 3.6% and P(k >= 6) = 0.8%, so the 2.5% quantile has k = 5 (-13/768), and P(k = 0) = 11%
    # puts the 97.5% quantile at k = 0 (1/64).
    row = summarize(_paired([1 / 64] * 10 + [-1 / 16] * 2), ["r"], EvalConfig(bootstrap_samples=2000))["r"]
    assert row["delta"] == pytest.approx(1 / 384)
    assert (row["ci_low"], row["ci_high"]) == (pytest.approx(-13 / 768), pytest.approx(1 / 64))
    ok, why = gate_decision({"r": row}, GateConfig())
    assert not ok and why == "r changed by +0.0026 (95% CI [-0.0169, +0.0156]), lower bound -0.0169 <= required +0"


def test_reward_hacking_warning_when_training_rose_and_eval_fell():
    history = [{"reward/ocr/mean": 0.1}, {"reward/ocr/mean": 0.3}, {"reward/ocr/mean": None},
               {"reward/ocr/mean": 0.5}]
    (warning,) = hacking_warnings(_rewards(ocr=-0.05), history)
    assert "'ocr' rose by 0.2" in warning and "fell by 0.05" in warning  # mean of the last 3 (0.3) - first
    assert hacking_warnings(_rewards(ocr=0.05), history) == []
    assert hacking_warnings(_rewards(jpeg=-0.05), history) == []  # no training history for that reward


def _prompts(n: int, failed_for: set[str] = frozenset()) -> list[PromptResult]:
    """n prompts scored by `ocr` and `aesthetic`; `failed_for` rewards failed on every other prompt."""
    return [_prompt({k: [0.1 * i] for k in ("ocr", "aesthetic")},
                    {k: [math.nan if k in failed_for and i % 2 else 0.1 * i + 0.05] for k in ("ocr", "aesthetic")})
            for i in range(n)]


@pytest.mark.parametrize("n", [2, MIN_PROMPTS_FOR_CI - 1])
def test_a_ci_over_fewer_prompts_than_the_threshold_is_flagged_and_warned_about(n):
    rows = summarize(_prompts(n), ["ocr", "aesthetic"], EvalConfig(bootstrap_samples=200))
    assert rows["ocr"]["n"] == n and rows["ocr"]["few_prompts"] is True and rows["aesthetic"]["few_prompts"]
    (warning,) = few_prompts_warnings(rows)  # the rewards share n: one line names both
    assert warning.startswith(f"ocr, aesthetic: the 95% CI rests on only {n} prompt(s) (fewer than "
                              f"{MIN_PROMPTS_FOR_CI}), too few for the interval to mean much")
    assert "eval.max_prompts" in warning


def test_a_ci_over_enough_prompts_is_not_flagged_but_a_reward_that_failed_on_half_of_them_is():
    rows = summarize(_prompts(MIN_PROMPTS_FOR_CI), ["ocr", "aesthetic"], EvalConfig(bootstrap_samples=200))
    assert rows["ocr"]["n"] == MIN_PROMPTS_FOR_CI and rows["ocr"]["few_prompts"] is False
    assert few_prompts_warnings(rows) == []
    rows = summarize(_prompts(2 * MIN_PROMPTS_FOR_CI - 2, failed_for={"aesthetic"}), ["ocr", "aesthetic"],
                     EvalConfig(bootstrap_samples=200))
    assert not rows["ocr"]["few_prompts"] and rows["aesthetic"]["few_prompts"]
    (warning,) = few_prompts_warnings(rows)
    assert warning.startswith(f"aesthetic: the 95% CI rests on only {MIN_PROMPTS_FOR_CI - 1} prompt(s)")


def test_no_interval_no_few_prompts_warning():
    rows = summarize(_prompts(3, failed_for={"ocr"})[1:2], ["ocr"], EvalConfig(bootstrap_samples=200))
    assert rows["ocr"]["n"] == 0 and few_prompts_warnings(rows) == []  # the report shows the reward failed


@pytest.mark.parametrize(("algorithm", "title"), [("flow_grpo", "FlowGRPO evaluation: s3://b/run/lora"),
                                                   ("diffusion_nft", "DiffusionNFT evaluation: s3://b/run/lora")])
def test_the_report_is_titled_with_the_runs_algorithm(algorithm, title):
    from components.evaluate.evaluate import report_title
    from pipeline.config import load_config

    config = load_config("tiny-cpu", [f"train.algorithm={algorithm}"])
    assert report_title(config, "s3://b/run/lora") == title
