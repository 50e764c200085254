"""Evaluate a LoRA against its base model: ODE sampling with fixed seeds, separate eval rewards, paired
bootstrap confidence intervals, the promotion gate, ``eval.json`` and ``report.html``.

Base and LoRA images of a prompt come from the same seed and the same starting noise (the base is the
same pipeline with the adapter disabled), so per-prompt deltas compare like with like and the bootstrap
resamples prompts, keeping each prompt's pair together.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from components import storage
from components.algorithms.base import algorithm_name
from components.console import status_line
from components.dataset.input_images import describe, load_row_images, square
from components.dataset.prompts import PromptRow, held_out_rows
from components.evaluate.config import EvalConfig, GateConfig
from components.evaluate.report import PromptResult, render_report
from components.models.generate import generate, load_with_lora
from components.rewards.registry import RewardSpec
from components.rewards.scoring import RewardSet
from components.trainer.config import TrainingJobConfig
from components.trainer.metrics import finite_or_none

EVAL_FILE = "eval.json"
REPORT_FILE = "report.html"
# Below this many prompts a bootstrap CI says little: the resampled means take few distinct values (3 for 2
# prompts), the percentile interval is too narrow for its nominal level, and one odd prompt moves it. 10 is
# the usual floor for a percentile bootstrap; each such reward is flagged (``few_prompts``) and warned about,
# and the gate refuses to promote on it.
MIN_PROMPTS_FOR_CI = 10


@dataclass
class EvalResult:
    summary: dict  # what eval.json holds
    prompts: list[PromptResult]
    eval_path: Path
    report_path: Path


def eval_rows(config: TrainingJobConfig, limit: int | None) -> tuple[list[PromptRow], bool]:
    """The held-out ``test`` split of a prepared dataset, else the training prompts; and whether they are
    held out."""
    rows, held_out = held_out_rows(config.data)
    return rows[:limit] if limit else rows, held_out


def _lora_dir(lora: str, scratch: Path) -> Path:
    if not storage.is_remote(lora):
        return Path(lora)
    storage.download_dir(lora, scratch / "lora")  # fresh every time: a prefix can be trained again
    return scratch / "lora"


def paired_bootstrap(base: np.ndarray, lora: np.ndarray, samples: int, level: float,
                     seed: int) -> tuple[float, float]:
    """Percentile CI of mean(lora - base), resampling prompts with replacement."""
    delta = lora - base
    rng = np.random.default_rng(seed)
    means = delta[rng.integers(0, len(delta), size=(samples, len(delta)))].mean(axis=1)
    tail = (1 - level) / 2
    return float(np.quantile(means, tail)), float(np.quantile(means, 1 - tail))


def _prompt_means(scores: list[list[float]]) -> np.ndarray:
    """Each prompt's mean over the images a reward scored; NaN for a prompt it failed on everywhere."""
    return np.array([np.nanmean(s) if np.isfinite(s).any() else np.nan for s in scores])


def summarize(prompts: list[PromptResult], keys: list[str], cfg: EvalConfig) -> dict[str, dict]:
    """Per reward: base and LoRA means over prompts (each prompt the mean of its images), the mean delta,
    its paired bootstrap CI, n = prompts where both models scored, and ``few_prompts`` when n is below
    ``MIN_PROMPTS_FOR_CI``."""
    out = {}
    for key in keys:
        base = _prompt_means([p.base_scores[key] for p in prompts])
        lora = _prompt_means([p.lora_scores[key] for p in prompts])
        ok = np.isfinite(base) & np.isfinite(lora)
        n = int(ok.sum())
        row = {"base_mean": math.nan, "lora_mean": math.nan, "delta": math.nan, "ci_low": math.nan,
               "ci_high": math.nan, "ci_level": cfg.ci_level, "n": n, "few_prompts": n < MIN_PROMPTS_FOR_CI}
        if n:
            low, high = paired_bootstrap(base[ok], lora[ok], cfg.bootstrap_samples, cfg.ci_level, cfg.seed)
            row.update(base_mean=float(base[ok].mean()), lora_mean=float(lora[ok].mean()),
                       delta=float((lora[ok] - base[ok]).mean()), ci_low=low, ci_high=high)
        out[key] = row
    return out


def gate_metric(gate: GateConfig, keys: Iterable[str]) -> str:
    """The eval reward the gate judges: ``gate.metric``, else the first eval reward."""
    return gate.metric or next(iter(keys))


def gate_decision(rewards: dict[str, dict], gate: GateConfig) -> tuple[bool, str]:
    """Promote when the gate metric's CI lower bound is above ``min_improvement`` (so the gain is unlikely
    to be noise), over at least ``MIN_PROMPTS_FOR_CI`` prompts, and no guard's mean dropped by more than its
    tolerance; the reason says which condition decided, with the delta, its CI and the threshold."""
    metric = gate_metric(gate, rewards)
    for key in (metric, *gate.guards):
        if key not in rewards:
            return False, f"gate reward {key!r} is not an eval reward (eval rewards: {', '.join(rewards)})"
    row = rewards[metric]
    delta, low, required = row["delta"], row["ci_low"], gate.min_improvement
    if not math.isfinite(delta):
        return False, f"{metric} has no score (every eval image failed it)"
    if row["n"] < MIN_PROMPTS_FOR_CI:
        return False, (f"{metric} was scored on only {row['n']} prompt(s): at least {MIN_PROMPTS_FOR_CI} are needed "
                       "for the CI to mean anything; raise eval.max_prompts or the test split")
    ci = f"{row['ci_level']:.0%} CI [{low:+.3g}, {row['ci_high']:+.3g}]"
    if not low > required:  # also refuses a NaN bound
        return False, f"{metric} changed by {delta:+.3g} ({ci}), lower bound {low:+.3g} <= required {required:+.3g}"
    for key, tolerance in sorted(gate.guards.items()):
        drop = -rewards[key]["delta"]
        if not math.isfinite(drop) or drop > tolerance:
            return False, f"guard {key} dropped by {drop:.4g} > tolerance {tolerance:.4g}"
    guards = f"; guards within tolerance ({', '.join(sorted(gate.guards))})" if gate.guards else "; no guards"
    return True, f"{metric} improved by {delta:+.3g} ({ci}), lower bound > {required:+.3g} required{guards}"


def few_prompts_warnings(rewards: dict[str, dict]) -> list[str]:
    """One warning per prompt count below ``MIN_PROMPTS_FOR_CI``, naming the rewards whose CI rests on it
    (rewards usually share n; a reward that failed on some prompts has fewer)."""
    by_n: dict[int, list[str]] = {}
    for key, row in rewards.items():
        if row["few_prompts"] and row["n"]:  # n = 0 has no interval at all; the report shows it failed
            by_n.setdefault(row["n"], []).append(key)
    return [f"{', '.join(keys)}: the {rewards[keys[0]]['ci_level']:.0%} CI rests on only {n} prompt(s) "
            f"(fewer than {MIN_PROMPTS_FOR_CI}), too few for the interval to mean much; evaluate more prompts "
            "(eval.max_prompts, a larger test split)" for n, keys in sorted(by_n.items())]


def hacking_warnings(rewards: dict[str, dict], history: list[dict]) -> list[str]:
    """A training reward that rose while the eval reward of the same key fell is the signature of reward
    hacking (the policy found what the reward model likes, not what it measures)."""
    warnings = []
    for key, row in rewards.items():
        series = [r.get(f"reward/{key}/mean") for r in history]
        series = [v for v in series if v is not None and math.isfinite(v)]
        if len(series) < 2 or not math.isfinite(row["delta"]):
            continue
        rise = float(np.mean(series[-3:])) - series[0]
        if rise > 0 and row["delta"] < 0:
            warnings.append(f"reward hacking? training reward {key!r} rose by {rise:.4g} while eval {key!r} "
                            f"fell by {-row['delta']:.4g}")
    return warnings


def _score(rewards: RewardSet, images: np.ndarray, row: PromptRow,
           inputs: list[np.ndarray]) -> dict[str, list[float]]:
    n = len(images)
    outputs = rewards.score(images, [row.prompt] * n, [row.metadata] * n, [0] * n, list(rewards.rewards),
                            [inputs] * n if inputs else None)
    return {k: [float(v) for v in out.scores] for k, out in outputs.items()}


def sample_and_score(config: TrainingJobConfig, rewards: list[RewardSpec], cfg: EvalConfig, lora_dir: Path,
                     rows: list[PromptRow], log: Callable[[str], None]) -> list[PromptResult]:
    model = load_with_lora(config.model, config.seed, lora_dir)
    scorer = RewardSet(rewards, where="eval_rewards")
    kw = {"resolution": config.model.resolution, "num_steps": config.sampling.eval_num_steps,
          "guidance_scale": config.sampling.guidance_scale}
    results, started = [], time.perf_counter()
    try:
        for i, row in enumerate(rows):
            seed, prompts = cfg.seed + i, [row.prompt] * cfg.images_per_prompt
            inputs = load_row_images(row.images, describe(row))
            shown = [square(image, config.model.resolution) for image in inputs]  # as the model sees them
            kw["images"] = [shown] * len(prompts) if inputs else None
            lora_images = generate(model, prompts, seed=seed, **kw)
            model.pipeline.disable_lora()
            try:
                base_images = generate(model, prompts, seed=seed, **kw)
            finally:
                model.pipeline.enable_lora()
            results.append(PromptResult(row.prompt, seed, list(base_images), list(lora_images),
                                        _score(scorer, base_images, row, inputs),
                                        _score(scorer, lora_images, row, inputs), shown))
            rate = (i + 1) / (time.perf_counter() - started)
            log(f"evaluated {i + 1}/{len(rows)} prompts ({rate:.2f} prompts/s, eta {(len(rows) - i - 1) / rate:.0f}s)")
    finally:
        scorer.close()
    return results


def report_title(config: TrainingJobConfig, lora: str) -> str:
    """Names the algorithm the LoRA was trained with (train.algorithm)."""
    return f"{algorithm_name(config)} evaluation: {lora}"


def evaluate(config: TrainingJobConfig, rewards: list[RewardSpec], cfg: EvalConfig, lora: str, output: Path, *,
             history: list[dict] | None = None, log: Callable[[str], None] = status_line) -> EvalResult:
    """Evaluate the LoRA at ``lora`` (a diffusers-format directory or ``s3://`` prefix) against the base model,
    write ``output/eval.json`` and ``output/report.html``. ``history`` (training metrics rows) feeds the
    report's curve and the reward-hacking check. The gate's verdict is in the summary; applying it to the
    Model Registry is the caller's (it needs MLflow)."""
    rows, held_out = eval_rows(config, cfg.max_prompts)
    log(f"evaluating {lora} on {len(rows)} {'held-out test' if held_out else 'training'} prompts x "
        f"{cfg.images_per_prompt} images, {config.sampling.eval_num_steps} ODE steps, "
        f"rewards {', '.join(s.key for s in rewards)}")
    scratch = Path(tempfile.mkdtemp(prefix="flowgrpo-eval-"))
    try:
        prompts = sample_and_score(config, rewards, cfg, _lora_dir(lora, scratch), rows, log)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    reward_rows = summarize(prompts, [s.key for s in rewards], cfg)
    promoted, reason = gate_decision(reward_rows, cfg.gate)
    history = history or []
    summary = {
        "rewards": reward_rows,
        "gate": {"promoted": promoted, "reason": reason, "alias": cfg.gate.alias,
                 "metric": gate_metric(cfg.gate, reward_rows)},
        "warnings": few_prompts_warnings(reward_rows) + hacking_warnings(reward_rows, history)
        + ([] if held_out else ["evaluated on the training prompts (the dataset has no held-out test split)"]),
        "config": {"lora": lora, "model": config.model.kind if config.model.path is None else config.model.path,
                   "prompts": len(rows), "held_out": held_out, "images_per_prompt": cfg.images_per_prompt,
                   "eval_num_steps": config.sampling.eval_num_steps, "seed": cfg.seed},
    }
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    eval_path, report_path = output / EVAL_FILE, output / REPORT_FILE
    eval_path.write_text(json.dumps(finite_or_none(summary), indent=1, allow_nan=False))
    report_path.write_text(render_report(summary, prompts, history, title=report_title(config, lora)))
    return EvalResult(summary, prompts, eval_path, report_path)
