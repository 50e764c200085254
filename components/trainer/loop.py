"""The single-process FlowGRPO driver: rollout -> score -> advantages -> update -> checkpoint -> log."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from PIL import Image

from components.algorithms.base import build_algorithm
from components.console import status_line
from components.dataset.input_images import describe, first_inputs, load_row_images
from components.dataset.prompts import PromptRow, held_out_rows, load_prompt_rows
from components.errors import CheckpointError, ConfigError
from components.flow_rl.advantages import compute_advantages, gdpo_advantages, group_statistics
from components.flow_rl.ema import LoRAEMA
from components.flow_rl.prompt_cache import PromptEncoder
from components.flow_rl.rollout import ode_images, sample_rollout
from components.flow_rl.update import Optimization
from components.models.base import FlowMatchingModel, PromptEmbeddings
from components.models.loading import load_model
from components.rewards.base import RewardOutput
from components.rewards.client import RemoteRewardSet
from components.rewards.scoring import (
    BackgroundScoring,
    RewardSet,
    Scorer,
    check_required,
    combine,
    concat_outputs,
)
from components.tracking.tracker import SAMPLE_VIDEOS_DIR, SAMPLES_KEY, NullTracker, base_metrics
from components.trainer import checkpoint as ckpt
from components.trainer.collective import Collective
from components.trainer.compilation import compile_transformer
from components.trainer.config import (
    TrainingJobConfig,
    algorithm_notes,
    check_guidance,
    describe_batches,
    epoch_split_problems,
)
from components.trainer.metrics import EpochEta, MetricsFile, learning_summary, progress_line
from components.trainer.run_output import (
    FINAL_LORA_DIR,
    METRICS_FILE,
    SAMPLES_DIR,
    RunOutput,
)
from components.trainer.samples import animated, sample_grid
from components.trainer.sharding import shard_transformer

if TYPE_CHECKING:
    from diffusers import DiffusionPipeline


@dataclass
class TrainResult:
    output: RunOutput
    history: list[dict]
    lora_dir: Path  # local copy
    mlflow_run_url: str | None = None

    @property
    def lora_uri(self) -> str:
        return self.output.uri_of(FINAL_LORA_DIR)

    @property
    def metrics_uri(self) -> str:
        return self.output.uri_of(METRICS_FILE)

    def learning_summary(self) -> dict[str, float]:
        return learning_summary(self.history)


# logged every epoch, always finite: the step the MLflow run holds last
TRACKED_STEP_KEY = "optimizer_step"


# A scope the caller wraps around each phase of an epoch, by its name ("encoding" the epoch's prompts, "sampling"
# the rollout, the wait for "scoring", "training"): a profiler's range, a memory probe (bench_memory.py). It
# observes; what the epoch computes is the same with any scope.
PhaseScope = Callable[[str], AbstractContextManager[None]]


def _no_scope(_phase: str) -> AbstractContextManager[None]:
    return nullcontext()


def _silent(_: str) -> None:
    """Where workers other than the main one send start-up notes (the main worker says them once)."""


def _epoch_generator(seed: int, epoch: int) -> torch.Generator:
    """The CPU generator for an epoch's prompt order, SDE window and shuffles.

    Derived from (seed, epoch) alone, so a resumed run draws exactly what an uninterrupted one would.
    """
    return torch.Generator().manual_seed(seed * 1_000_003 + epoch + 500_000)


def showcase_rows(config: TrainingJobConfig) -> list[PromptRow]:
    """The grids' prompts: the first ``tracking.sample_images`` held-out prompts (the test split of a prepared
    dataset, which the evaluation samples too), else the first training prompts."""
    if not config.tracking.sample_every:
        return []
    rows, _ = held_out_rows(config.data)
    return list({r.key: r for r in rows}.values())[:config.tracking.sample_images]


def showcase_seed(seed: int) -> int:
    """The seed of the sample grids' starting noise: the same at every epoch (and after a resume), so the grids
    show one set of scenes changing with the weights."""
    return seed * 1_000_003 + 999_983


def _noise_generators(seed: int, epoch: int, first_batch: int,
                      device: torch.device) -> Callable[[int], torch.Generator]:
    """Sampling batch ``b`` of this worker draws its noise from a generator seeded by (seed, epoch, global batch
    index), so N workers sampling disjoint batches draw exactly the noise one process would."""
    def generator(b: int) -> torch.Generator:
        digest = hashlib.sha256(f"{seed}:{epoch}:{first_batch + b}".encode()).digest()
        return torch.Generator(device).manual_seed(int.from_bytes(digest[:7], "little"))

    return generator


def check_world_size(config: TrainingJobConfig, world_size: int) -> None:
    """Reject worker counts that cannot split an epoch (``epoch_split_problems``), before anything starts."""
    problems = epoch_split_problems(config, world_size)
    if problems:
        raise ConfigError(f"{world_size} workers: " + "; ".join(problems))


def _epoch_prompts(rows: list[PromptRow], n: int, generator: torch.Generator) -> list[PromptRow]:
    order: list[int] = []
    while len(order) < n:
        order += torch.randperm(len(rows), generator=generator).tolist()
    return [rows[i] for i in order[:n]]


RESUMABLE_CHANGES = ("train.epochs, train.checkpoint_every, the memory and speed settings "
                     "(train.gradient_checkpointing, train.sharding, train.compile, model.offload_text_encoders, "
                     "model.prompt_cache_gib), tracking, distributed, reward_server, reward timeouts and the pipeline "
                     "sections (eval, eval_rewards, cluster)")
# how memory and time are spent, not what is computed: a run may resume sharded from an unsharded checkpoint, or
# eager from a compiled one, and back (train.cfg_uncond_grad changes the gradient and stays in the fingerprint)
_EXECUTION_SETTINGS = {"train": ("gradient_checkpointing", "sharding", "compile"),
                       "model": ("offload_text_encoders", "prompt_cache_gib")}


def _fingerprint(config: TrainingJobConfig) -> dict:
    """The config a checkpoint must match to be resumed: everything that changes what is computed.
    The epoch count may grow, and where and how patiently rewards are scored may change."""
    # only what the trainer reads: pipeline sections (eval, cluster, ...) never change what training computes
    data = config.model_dump(mode="json", include=set(TrainingJobConfig.model_fields))
    data["train"].pop("epochs")
    data["train"].pop("checkpoint_every")
    for section, keys in _EXECUTION_SETTINGS.items():
        for key in keys:
            data[section].pop(key)
    data.pop("reward_server")
    data.pop("tracking", None)
    data.pop("distributed", None)
    for spec in data["rewards"]:
        spec.pop("timeout_s")
    return data


def _diff_keys(a: dict, b: dict, prefix: str = "") -> list[str]:
    keys = []
    for k in sorted(set(a) | set(b)):
        va, vb = a.get(k), b.get(k)
        if isinstance(va, dict) and isinstance(vb, dict):
            keys += _diff_keys(va, vb, f"{prefix}{k}.")
        elif va != vb:
            keys.append(f"{prefix}{k}")
    return keys


def build_scorer(config: TrainingJobConfig) -> Scorer:
    """Rewards scored on the configured reward server, or in this process."""
    if config.reward_server.url:
        return RemoteRewardSet(config.rewards, config.reward_server)
    return RewardSet(config.rewards)


def rollout_advantages(
    config: TrainingJobConfig, weights: dict[str, float], outputs: dict[str, RewardOutput], combined: np.ndarray,
    group_ids: torch.Tensor,
) -> torch.Tensor:
    t = config.train
    if config.reward_aggregation == "gdpo":
        tensors = {k: torch.from_numpy(out.scores).float() for k, out in outputs.items()}
        return gdpo_advantages(tensors, weights, group_ids.cpu(), reward_std=t.gdpo_reward_std, clip=t.adv_clip_max)
    return compute_advantages(torch.from_numpy(combined).float(), group_ids.cpu(), std=t.advantage_std,
                              clip=t.adv_clip_max)


def _finite_stats(x: np.ndarray) -> tuple[float, float]:
    """Mean and std of the scores that did not fail; NaN when all did."""
    ok = x[np.isfinite(x)]
    return (float(ok.mean()), float(ok.std())) if ok.size else (float("nan"), float("nan"))


def _epoch_metrics(outputs: dict[str, RewardOutput], combined: np.ndarray, advantages: torch.Tensor,
                   group_ids: torch.Tensor) -> dict[str, float]:
    row: dict[str, float] = {}
    row["reward/mean"], row["reward/std"] = _finite_stats(combined)
    for key, out in outputs.items():
        row[f"reward/{key}/mean"], row[f"reward/{key}/std"] = _finite_stats(out.scores)
        row[f"reward/{key}/failed_fraction"] = out.failed / len(out.errors) if out.errors else 0.0
    row.update(group_statistics(torch.from_numpy(combined), group_ids.cpu()))
    # under update/ (the update's input), not advantage/: MLflow shows metric sections in name order, and
    # reward/ is what a person opens a run for
    row["update/advantage_mean"] = float(advantages.mean())
    row["update/advantage_abs_mean"] = float(advantages.abs().mean())
    row["update/advantage_max"] = float(advantages.max())
    row["update/advantage_min"] = float(advantages.min())
    return row


class Trainer:
    """Owns the model, optimizer and EMA for one run; writes everything to ``output``, logs to ``tracker``."""

    def __init__(self, config: TrainingJobConfig, output: RunOutput | str | Path,
                 log: Callable[[str], None] = status_line, tracker: NullTracker | None = None,
                 collective: Collective | None = None, rows: list[PromptRow] | None = None,
                 phase_scope: PhaseScope = _no_scope, pipeline: DiffusionPipeline | None = None) -> None:
        """``rows``: the prompts of ``config.data`` when the caller has loaded them already; ``phase_scope``: wrapped
        around each phase of every epoch (``PhaseScope``); ``pipeline``: one the caller built (in memory), trained
        instead of the one ``config.model`` names."""
        self.collective = collective or Collective()
        check_world_size(config, self.collective.world_size)
        self.config = config
        self.output = output if isinstance(output, RunOutput) else RunOutput(output)
        self.output.prepare(fresh=False)
        self.log = log
        self.phase_scope = phase_scope
        self.tracker = tracker or NullTracker()
        self.rows = load_prompt_rows(config.data) if rows is None else rows
        self.showcase = showcase_rows(config)
        self._showcase_embeds: PromptEmbeddings | None = None
        self.scorer = build_scorer(config)
        self.model: FlowMatchingModel = load_model(config.model, config.seed, on_device=False, pipeline=pipeline)
        try:  # a `diffusers` kind's family is known only now; reject its meaningless settings before training
            check_guidance(config, self.model.guidance_mode, type(self.model.pipeline).__name__)
        except ValueError as exc:
            raise ConfigError(str(exc)) from exc
        self.params = self._place_model()
        t = config.train
        self.optimizer = torch.optim.AdamW(
            self.params, lr=t.learning_rate, betas=t.adam_betas, weight_decay=t.weight_decay, eps=t.adam_eps,
            fused=self.model.device.type == "cuda" or None,  # one kernel for all LoRA tensors on CUDA
        )
        self.ema = LoRAEMA(self.params, t.ema.decay, t.ema.update_every) if t.ema.enabled else None
        self.algorithm = build_algorithm(config, self.model, self.params)
        self.epoch = 0
        self.optimizer_step = 0
        self.tracked_through = -1  # the last epoch the MLflow run holds (from before a resume): none logged again
        self.metrics = MetricsFile(self.output.local / METRICS_FILE)

    def _place_model(self) -> list[torch.nn.Parameter]:
        """Put the model on its device part by part so the accelerator never holds more than it must: the text
        encoders first (and, with offload, only while encoding), then the VAE, then the transformer with its
        LoRA, whole or sharded. Returns the LoRA parameters."""
        cfg, world = self.config, self.collective
        say = self.log if world.is_main else _silent
        self.model.to_device("vae")  # before the prompts: an editing family encodes its input images with it
        self.prompts = PromptEncoder(self.model, self.rows + self.showcase, resolution=cfg.model.resolution,
                                     offload=cfg.model.offload_text_encoders, cache_gib=cfg.model.prompt_cache_gib,
                                     log=say)
        with torch.random.fork_rng(devices=[]):  # the LoRA is initialised in host memory, the same on any device
            torch.manual_seed(cfg.seed)
            params = self.model.add_lora(cfg.model.lora)
        if cfg.train.sharding == "fsdp":
            blocks = shard_transformer(self.model, params, world.world_size)
            say(f"FSDP: {blocks} transformer blocks sharded over {world.world_size} worker(s)")
        else:
            self.model.to_device("transformer")
        if cfg.train.gradient_checkpointing:
            self.model.transformer.enable_gradient_checkpointing()
        if cfg.train.compile:
            say(f"torch.compile: {compile_transformer(self.model)} transformer blocks (compiled during the first "
                "epoch)")
        say("batches: " + describe_batches(cfg, world.world_size))
        for note in algorithm_notes(cfg):
            say(f"note: {note}")
        return params

    # -- checkpoints -------------------------------------------------------------------------------
    def _save_lora(self, directory: Path) -> None:
        if self.ema is None:
            self.model.save_lora(directory)
        else:
            with self.ema.applied(self.params):
                self.model.save_lora(directory)

    def save_checkpoint(self) -> str:
        state = ckpt.TrainerState(
            epoch=self.epoch, optimizer_step=self.optimizer_step,
            lora=[p.detach().cpu().clone() for p in self.params], optimizer=self.optimizer.state_dict(),
            ema=self.ema.state_dict() if self.ema else None, rng=torch.get_rng_state(),
            config_fingerprint=_fingerprint(self.config), mlflow_run_id=self.tracker.run_id,
            algorithm=self.algorithm.state_dict(),
        )
        uri = ckpt.write_checkpoint(self.output.uri, self.output.scratch, state, self._save_lora)
        self.tracker.set_tags({"flowgrpo.latest_checkpoint": uri})
        return uri

    def resume(self, path: str, state: ckpt.TrainerState) -> None:
        """Continue from checkpoint ``state`` (read from ``path``)."""
        changed = _diff_keys(state.config_fingerprint, _fingerprint(self.config))
        if changed:
            raise CheckpointError(
                f"--resume: the config differs from the checkpoint's in {', '.join(changed)} "
                f"(only {RESUMABLE_CHANGES} may change)"
            )
        with torch.no_grad():
            for p, saved in zip(self.params, state.lora, strict=True):
                p.copy_(saved.to(p.device))
        self.optimizer.load_state_dict(state.optimizer)
        if self.ema is not None:
            self.ema.load_state_dict(state.ema)
        self.algorithm.load_state_dict(state.algorithm)
        torch.set_rng_state(state.rng)
        self.epoch, self.optimizer_step = state.epoch, state.optimizer_step
        if self.collective.is_main:
            self.output.fetch(METRICS_FILE)
            self.metrics.truncate_after(self.epoch)
            self.output.publish(METRICS_FILE)
            last = self.tracker.last_step(TRACKED_STEP_KEY)
            self.tracked_through = -1 if last is None else last
            self.log(f"resumed from {path} (epoch {self.epoch}, optimizer step {self.optimizer_step})")

    # -- one epoch ---------------------------------------------------------------------------------
    def run_epoch(self) -> dict[str, float]:
        """Sample this worker's share of the epoch's prompt groups, score them, gather every worker's
        rewards so advantages are computed over the whole batch, then update on this worker's samples."""
        cfg, world = self.config, self.collective
        cpu_gen = _epoch_generator(cfg.seed, self.epoch)
        prompts = _epoch_prompts(self.rows, cfg.sampling.prompts_per_epoch, cpu_gen)
        sampler = self.algorithm.sampler_settings(cpu_gen, self.epoch)
        group_size, batch_size = cfg.sampling.group_size, cfg.sampling.batch_size_per_worker
        share = len(prompts) // world.world_size
        mine = prompts[world.rank * share:(world.rank + 1) * share]
        noise = _noise_generators(cfg.seed, self.epoch, world.rank * share * group_size // batch_size,
                                  self.model.device)
        scoring = BackgroundScoring(self.scorer, max_in_flight=cfg.reward_server.max_in_flight)

        def score_batch(images: np.ndarray, prompt_idx: torch.Tensor) -> None:
            groups = prompt_idx.tolist()  # a sample's prompt is its GRPO group
            scoring.submit(images, [mine[g].prompt for g in groups], [mine[g].metadata for g in groups], groups,
                           self._inputs([mine[g] for g in groups]))

        t0 = time.perf_counter()
        prompt_texts = [r.prompt for r in mine]
        # a batch whose scoring failed for good (the reward server gone past its retry window) stops sampling
        with self.algorithm.sampling_weights():
            with self.phase_scope("encoding"):
                embeds = self.prompts(mine)
            with self.phase_scope("sampling"):
                rollout = sample_rollout(self.model, prompt_texts, group_size, batch_size, sampler, noise,
                                         on_batch=score_batch, embeds=embeds, check=scoring.check)
        t1 = time.perf_counter()
        with self.phase_scope("scoring"):
            outputs = scoring.finish()  # scoring overlapped sampling; this is the wait after the last batch
        t2 = time.perf_counter()
        parts = world.all_gather(outputs)
        outputs = {key: concat_outputs([part[key] for part in parts]) for key in outputs}
        check_required(outputs, self.scorer.required)
        combined = combine(outputs, self.scorer.weights)
        group_ids = torch.arange(len(prompts)).repeat_interleave(group_size)
        advantages = rollout_advantages(cfg, self.scorer.weights, outputs, combined, group_ids)
        local = slice(world.rank * len(rollout), (world.rank + 1) * len(rollout))
        with self.phase_scope("training"):
            optim = Optimization(self.optimizer, self.params, cfg.train.max_grad_norm, self.optimizer_step, self.ema,
                                 average_grads=world.average_ if world.world_size > 1 else None)
            update_metrics = self.algorithm.update(rollout, torch.from_numpy(combined[local]), advantages[local],
                                                   sampler, cpu_gen, optim)
            self.optimizer_step = optim.step
        t3 = time.perf_counter()

        self.epoch += 1
        row = {"epoch": self.epoch, **_epoch_metrics(outputs, combined, advantages, group_ids)}
        row.update(world.mean(update_metrics))
        row.update({
            "lr": self.optimizer.param_groups[0]["lr"], "optimizer_step": self.optimizer_step,
            "time/sampling": t1 - t0, "time/scoring": t2 - t1, "time/training": t3 - t2,
            "images_per_s": len(combined) / (t3 - t0),
        })
        if self._sample_epoch(self.epoch):
            row.update(self.show_samples())
        return row

    def _inputs(self, rows: list[PromptRow]) -> list[list[np.ndarray]] | None:
        """The input images of ``rows`` for the rewards that score edits against them (None: text-to-image)."""
        if not any(r.images for r in rows):
            return None
        return [load_row_images(r.images, describe(r)) for r in rows]

    def _sample_epoch(self, epoch: int) -> bool:
        every = self.config.tracking.sample_every
        return bool(every) and (epoch % every == 0 or epoch == self.config.train.epochs)

    def show_samples(self) -> dict[str, float]:
        """ODE-sample the showcase prompts from fixed noise (every worker takes part: a sharded transformer
        needs all of them for a forward), score them, save and log the grid as epoch ``self.epoch``. Returns
        ``heldout/<reward>/mean`` for the pointwise rewards (a groupwise one needs a group)."""
        cfg = self.config
        rows = self.showcase
        if self._showcase_embeds is None:  # once: with offloaded encoders and no cache, each encode moves them
            self._showcase_embeds = self.prompts(rows)
        images = ode_images(self.model, self._showcase_embeds, cfg.sampling.eval_num_steps,
                            cfg.model.resolution, cfg.sampling.guidance_scale,
                            torch.Generator(self.model.device).manual_seed(showcase_seed(cfg.seed)))
        if not self.collective.is_main:
            return {}
        keys = [k for k in self.scorer.weights if k not in self.scorer.groupwise]
        inputs = self._inputs(rows)
        outputs = self.scorer.score(images, [r.prompt for r in rows], [r.metadata for r in rows],
                                    list(range(len(rows))), keys, inputs) if keys else {}
        shown = outputs[keys[0]].scores if keys else np.full(len(rows), np.nan)
        grid = sample_grid(images, [r.prompt for r in rows], [float(v) for v in shown],
                           label=keys[0] if keys else "reward",
                           inputs=None if inputs is None else first_inputs(inputs, cfg.model.resolution))
        name = f"{ckpt.checkpoint_name(self.epoch)}.png"
        (self.output.local / SAMPLES_DIR).mkdir(exist_ok=True)
        Image.fromarray(grid).save(self.output.local / SAMPLES_DIR / name)
        self.output.publish(f"{SAMPLES_DIR}/{name}")
        if self.epoch > self.tracked_through:  # else logged before the resume, from the same weights
            self.tracker.log_image(grid, key=SAMPLES_KEY, step=self.epoch, artifact_file=f"{SAMPLES_KEY}/{name}")
        if images.ndim == 5:  # each video animated beside the grid's key frames; GIF: MLflow's artifact view plays it
            for i, video in enumerate(images):
                rel = f"{SAMPLES_DIR}/{ckpt.checkpoint_name(self.epoch)}-{i}.gif"
                (self.output.local / rel).write_bytes(animated(video, "GIF"))
                self.output.publish(rel)
                if self.epoch > self.tracked_through:
                    self.tracker.log_artifact(self.output.local / rel, SAMPLE_VIDEOS_DIR)
        return {f"heldout/{key}/mean": _finite_stats(out.scores)[0] for key, out in outputs.items()}

    def fit(self) -> TrainResult:
        """Train to ``train.epochs``. Only the main worker writes metrics, checkpoints and the LoRA."""
        cfg, main = self.config, self.collective.is_main
        total = cfg.train.epochs
        if self.epoch >= total and main:
            self.log(f"nothing to do: {self.epoch} of {total} epochs already done")
        eta = EpochEta(total, self.epoch)
        try:
            # the base model (the LoRA starts at zero): the first row carries it as heldout/<reward>/base
            base = self.show_samples() if self.epoch == 0 and self._sample_epoch(0) and total else {}
            first_mean = next(iter(self.metrics.read()), {}).get("reward/mean") if main else None
            while self.epoch < total:
                row = self.run_epoch()
                if not main:
                    continue
                if base:
                    row.update({k.removesuffix("/mean") + "/base": v for k, v in base.items()})
                    self.tracker.log_metrics(base_metrics(row), step=0)
                    base = {}
                self.metrics.append(row)
                self.output.publish(METRICS_FILE)
                if self.epoch > self.tracked_through:  # a resumed run recomputes the epochs since its checkpoint
                    self.tracker.log_metrics(row, step=self.epoch)
                first_mean = row["reward/mean"] if self.epoch == 1 else first_mean
                self.log(progress_line(row, total, eta.after(self.epoch), first_mean))
                if self.epoch % cfg.train.checkpoint_every == 0 or self.epoch == total:
                    self.save_checkpoint()
        finally:
            self.scorer.close()
        lora_dir = self.output.local / FINAL_LORA_DIR
        if main:
            self._save_lora(lora_dir)
            self.output.publish_dir(FINAL_LORA_DIR)
        return TrainResult(self.output, self.metrics.read() if main else [], lora_dir, self.tracker.url)


def run_worker(config: TrainingJobConfig, out: RunOutput, *, log: Callable[[str], None] = status_line,
               tracker: NullTracker | None = None, collective: Collective | None = None,
               start: tuple[str, ckpt.TrainerState] | None = None,
               rows: list[PromptRow] | None = None) -> TrainResult:
    """One trainer process (or one of N data-parallel workers) from the newest checkpoint under ``out``, or
    from scratch when there is none; the same call serves a first start and a restart after a failure.
    ``start`` is that checkpoint's (URI, state) when the caller has read it already, ``rows`` the prompts of
    ``config.data`` when it has loaded them."""
    trainer = Trainer(config, out, log=log, tracker=tracker, collective=collective, rows=rows)
    if start is None:
        latest = ckpt.latest_checkpoint(out.uri)
        start = (latest, ckpt.read_checkpoint(latest)) if latest is not None else None
    if start is not None:
        trainer.resume(*start)
    elif trainer.collective.is_main:
        trainer.metrics.path.unlink(missing_ok=True)
    return trainer.fit()
