"""Typed settings of a FlowGRPO training job. Defaults equal `pipeline/configs/tiny-cpu.yaml`.

The reasons behind the tiny defaults are written in that file's comments.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from components.config_base import Section, format_validation_error, refuse_url_credentials
from components.dataset.config import DataConfig
from components.errors import ConfigError
from components.models.config import TINY_GUIDANCE, GuidanceMode, ModelConfig
from components.rewards.config import Aggregation, RewardServerConfig, RewardSpec, check_names, check_unique_keys

# Batch sizes are per worker (images in one forward pass on one worker), as upstream flow_grpo's per-GPU
# `sample.train_batch_size` / `train.batch_size`. The old global `train.batch_size` was split across workers,
# so a config that still spells `batch_size` is refused rather than silently changing meaning.
SAMPLES_PER_STEP = ("samples per optimizer step = train.batch_size_per_worker x train.gradient_accumulation_steps "
                    "x workers")


def _refuse_renamed_batch_size(data: Any, section: str, meaning: str) -> Any:
    if isinstance(data, dict) and "batch_size" in data:
        raise ValueError(
            f"{section}.batch_size was renamed {section}.batch_size_per_worker: {meaning} on ONE worker "
            f"(the old train.batch_size was global and split across workers); {SAMPLES_PER_STEP}"
        )
    return data


class SDEWindowConfig(Section):
    size: int = Field(ge=1, description="number of consecutive SDE steps")
    range: tuple[int, int] = Field(
        description="[lo, hi]: the window lies within steps lo .. hi - 1, its first step drawn uniformly from "
                    "lo .. hi - size once per epoch (upstream's sde_window_range)",
    )


class SamplingConfig(Section):
    num_steps: int = Field(default=10, ge=2, le=1000, description="sampling steps during training rollouts")
    eval_num_steps: int = Field(default=20, ge=1, le=1000, description="ODE steps for evaluation sampling")
    guidance_scale: float = Field(
        default=1.0, ge=1.0,
        description="CFG scale (SD3), true-CFG scale (Qwen-Image) or embedded guidance (FLUX.1-dev); 1 disables CFG",
    )
    noise_level: float = Field(default=0.7, gt=0, le=10, description="SDE noise level a")
    sde_type: Literal["sde", "cps"] = Field(default="sde", description="docs/ALGORITHM.md section 1 or 2")
    group_size: int = Field(default=8, ge=1, description="images per prompt (K)")
    prompts_per_epoch: int = Field(default=8, ge=1, description="prompt groups sampled per epoch")
    batch_size_per_worker: int = Field(
        default=16, ge=1, description="images per sampling forward pass on one worker (CFG doubles the rows)",
    )
    sde_window: SDEWindowConfig | None = Field(default=None, description="Flow-GRPO-Fast: SDE only on a window")

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        return _refuse_renamed_batch_size(data, "sampling", "images per sampling forward pass")

    @model_validator(mode="after")
    def _check(self) -> SamplingConfig:
        if self.sde_window is not None:
            lo, hi = self.sde_window.range
            size = self.sde_window.size
            if not 0 <= lo <= hi - size or hi > self.num_steps:
                raise ValueError(
                    f"sampling.sde_window.range [lo, hi] must hold the window of size {size} within the "
                    f"{self.num_steps} steps (0 <= lo <= hi - size, hi <= sampling.num_steps), got [{lo}, {hi}]"
                )
        return self


class EMAConfig(Section):
    enabled: bool = Field(default=False, description="keep an EMA of the LoRA weights for saving and eval")
    decay: float = Field(default=0.9, gt=0, lt=1,
                         description="the decay's ceiling: at optimizer step s it is min(decay, (1 + s) / (10 + s))")
    update_every: int = Field(default=8, ge=1,
                              description="optimizer steps between EMA updates (at steps s with (s + 1) % n == 0)")


class TrainConfig(Section):
    epochs: int = Field(default=40, ge=1, description="rollout + update rounds")
    learning_rate: float = Field(default=3e-3, gt=0, le=1)
    adam_betas: tuple[float, float] = Field(default=(0.9, 0.999), description="AdamW's (beta1, beta2), each in [0, 1)")
    weight_decay: float = Field(default=1e-4, ge=0)
    adam_eps: float = Field(default=1e-8, gt=0)
    batch_size_per_worker: int = Field(
        default=16, ge=1, description="samples per training forward pass (micro-batch) on one worker",
    )
    gradient_accumulation_steps: int = Field(
        default=1, ge=1, description=f"micro-batches each worker accumulates per optimizer step; {SAMPLES_PER_STEP}",
    )
    inner_epochs: int = Field(default=1, ge=1, description="passes over each epoch's samples")
    skip_zero_advantage: bool = Field(
        default=True,
        description="train only the samples whose advantage is not 0 (groups whose rewards all agree, failed rewards), "
                    "spread over the same micro-batches and padded to equal sizes with random zero-advantage samples, "
                    "as upstream; false trains every sample (their policy gradient is 0, they dilute the rest and "
                    "still add KL)",
    )
    clip_range: float = Field(default=0.2, gt=0, lt=1, description="PPO ratio clip epsilon")
    adv_clip_max: float = Field(default=5.0, gt=0)
    global_std: bool = Field(
        default=True,
        description="normalise advantages by the batch std, not the group's (with reward_aggregation 'sum')",
    )
    gdpo_reward_std: Literal["group", "global"] = Field(
        default="group",
        description="with reward_aggregation 'gdpo': each reward is normalised by its std within the group (the "
                    "method's definition, as Flow-Factory) or by its std over the batch, before the weighted sum is "
                    "batch-normalised",
    )
    beta: float = Field(default=0.0, ge=0, description="KL weight to the adapter-disabled model")
    timestep_fraction: float = Field(default=0.99, gt=0, le=1, description="share of the steps trained on")
    train_cfg: bool = Field(default=False, description="repeat CFG in the training forward")
    max_grad_norm: float = Field(default=1.0, gt=0)
    ema: EMAConfig = Field(default_factory=EMAConfig)
    checkpoint_every: int = Field(default=10, ge=1, description="epochs between checkpoints (the last is kept too)")
    gradient_checkpointing: bool = Field(
        default=False,
        description="recompute each transformer block's activations in the backward pass instead of keeping them "
                    "(training forward only; sampling is unchanged); same gradients, less memory, ~1 more forward",
    )
    compile: bool = Field(
        default=False,
        description="compile each repeated transformer block once with torch.compile (regional compilation) and "
                    "use it in the sampling, training and KL reference forwards; the first epoch pays the compile",
    )
    cfg_uncond_grad: bool = Field(
        default=True,
        description="with train_cfg: let the gradient flow through the unconditional (negative-prompt) CFG branch "
                    "too (the exact gradient, as upstream flow_grpo's current train_sd3.py); false runs that branch "
                    "without gradient, as upstream did between commits 2d76907 and ac4c86e: a cheaper backward and a "
                    "different gradient, missing (1 - scale) x d v_uncond / d theta (docs/ALGORITHM.md section 6)",
    )
    sharding: Literal["none", "fsdp"] = Field(
        default="none",
        description="`fsdp`: shard the frozen transformer weights across the Ray Train workers (PyTorch FSDP2, per "
                    "transformer block); the LoRA stays replicated. Needs Ray Train workers (--ray-workers, a cluster)",
    )

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        return _refuse_renamed_batch_size(data, "train", "samples per training forward pass (micro-batch)")

    @field_validator("adam_betas")
    @classmethod
    def _check_betas(cls, betas: tuple[float, float]) -> tuple[float, float]:
        if not all(0 <= b < 1 for b in betas):
            raise ValueError("each beta must be in [0, 1)")
        return betas


class TrackingConfig(Section):
    """What goes to MLflow. Where it goes comes from MLFLOW_TRACKING_URI only; unset = no tracking."""

    experiment: str = Field(default="flowgrpo", min_length=1, description="MLflow experiment name")
    sample_every: int = Field(default=10, ge=0,
                              description="epochs between sample image grids (the last epoch too); 0 = none")
    sample_images: int = Field(default=8, ge=1, le=64, description="images per sample grid, one per prompt")
    system_metrics: bool = Field(default=True, description="log CPU/GPU/memory/disk/network as system/* metrics")
    registered_model: str | None = Field(
        default="flowgrpo-lora", min_length=1,
        description="Model Registry name the final LoRA is registered under (no '/' or ':'); null = do not "
                    "register",
    )

    @field_validator("registered_model")
    @classmethod
    def _registry_name(cls, value: str | None) -> str | None:
        # refused here, not by MLflow at the end of a finished run
        if value is not None and any(c in value for c in "/:"):
            raise ValueError("MLflow model names cannot contain '/' or ':'")
        return value


class TrainingJobConfig(Section):
    """Everything the trainer reads. The pipeline's experiment config extends it."""

    seed: int = Field(default=0, ge=0, description="seeds the tiny model, prompt order, noise and LoRA init")
    model: ModelConfig = Field(default_factory=ModelConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    rewards: list[RewardSpec] = Field(
        default_factory=lambda: [RewardSpec(name="brightness")], min_length=1,
        description="training rewards",
    )
    reward_aggregation: Aggregation = Field(default="sum", description="how several rewards combine")
    reward_server: RewardServerConfig = Field(default_factory=RewardServerConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)

    @classmethod
    def from_sections(cls, data: dict[str, Any], source: str) -> TrainingJobConfig:
        """The trainer's own sections of an experiment mapping, validated; the other stages' sections are theirs
        to read (the experiment config they came from was validated whole where it was composed)."""
        try:
            return cls.model_validate({k: v for k, v in data.items() if k in cls.model_fields})
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc, source)) from exc

    @model_validator(mode="before")
    @classmethod
    def _no_credentials(cls, data: Any) -> Any:
        return refuse_url_credentials(data)

    @model_validator(mode="after")
    def _check_consistency(self) -> TrainingJobConfig:
        s, t = self.sampling, self.train
        if s.group_size < 2:
            hint = "" if t.global_std else " (with train.global_std false even its std is undefined)"
            raise ValueError(
                f"sampling.group_size must be at least 2, got {s.group_size}: advantages are relative to the "
                f"prompt's group, so a group of one always has advantage 0{hint}"
            )
        problems = epoch_split_problems(self, 1)
        if problems:
            raise ValueError("; ".join(problems))
        if t.train_cfg and s.guidance_scale == 1.0:
            raise ValueError("train.train_cfg is true but sampling.guidance_scale is 1 (no CFG to repeat)")
        if not t.cfg_uncond_grad and not t.train_cfg:
            raise ValueError("train.cfg_uncond_grad is false but train.train_cfg is false: the training forward has "
                             "no unconditional CFG branch; remove train.cfg_uncond_grad or set train.train_cfg true")
        if self.model.kind in TINY_GUIDANCE:
            check_guidance(self, TINY_GUIDANCE[self.model.kind], self.model.kind)
        check_unique_keys(self.rewards, "rewards")
        if self.reward_server.url is None:  # a server of the user's own may serve rewards by other names
            check_names(self.rewards, "rewards")
        if self.reward_aggregation == "gdpo" and len(self.rewards) < 2:
            raise ValueError("reward_aggregation 'gdpo' needs at least two rewards; use 'sum' for one")
        return self


def epoch_split_problems(config: TrainingJobConfig, workers: int) -> list[str]:
    """Why ``workers`` workers cannot split an epoch: each samples whole prompt groups in whole sampling batches
    and trains on its own samples in whole micro-batches and optimizer steps. Empty when they can."""
    s, t = config.sampling, config.train
    n = s.prompts_per_epoch * s.group_size
    on = f"the {workers} workers" if workers > 1 else "one worker"
    if s.prompts_per_epoch % workers:
        return [f"sampling.prompts_per_epoch ({s.prompts_per_epoch}) must be a multiple of the {workers} workers "
                "(each worker samples whole prompt groups)"]
    per = n // workers
    share = (f"each worker's {per} images ({s.prompts_per_epoch // workers} prompts x sampling.group_size "
             f"{s.group_size})" if workers > 1 else f"the {n} images per epoch (sampling.prompts_per_epoch "
             f"{s.prompts_per_epoch} x sampling.group_size {s.group_size})")
    problems = []
    if per % s.batch_size_per_worker:
        problems.append(f"{share} must fill whole sampling batches of sampling.batch_size_per_worker "
                        f"({s.batch_size_per_worker}) on {on}")
    if per % t.batch_size_per_worker:
        problems.append(f"{share} must fill whole micro-batches of train.batch_size_per_worker "
                        f"({t.batch_size_per_worker}) on {on}")
    elif (per // t.batch_size_per_worker) % t.gradient_accumulation_steps:
        problems.append(f"train.gradient_accumulation_steps ({t.gradient_accumulation_steps}) must divide the "
                        f"{per // t.batch_size_per_worker} micro-batches per epoch of {on} ({per} samples / "
                        f"train.batch_size_per_worker {t.batch_size_per_worker}); {SAMPLES_PER_STEP}")
    return problems


def describe_batches(config: TrainingJobConfig, workers: int) -> str:
    """How an epoch is split on ``workers`` workers, in one line (the trainer prints it at start)."""
    s, t = config.sampling, config.train
    per = s.prompts_per_epoch * s.group_size // workers
    micro = per // t.batch_size_per_worker
    steps = micro // t.gradient_accumulation_steps
    per_step = t.batch_size_per_worker * t.gradient_accumulation_steps * workers
    return (f"{workers} worker(s), each {per} images per epoch in {per // s.batch_size_per_worker} sampling "
            f"batches of {s.batch_size_per_worker}; {steps} optimizer step(s) per epoch, each {per_step} samples "
            f"= {t.batch_size_per_worker} per worker x {t.gradient_accumulation_steps} accumulation x {workers} "
            "worker(s)")


def check_guidance(config: TrainingJobConfig, mode: GuidanceMode, family: str) -> None:
    """Reject guidance settings that mean nothing for a model guided by ``mode``; messages name the key."""
    s, t, negative = config.sampling, config.train, config.model.negative_prompt
    if mode in ("embedded", "none"):
        if t.train_cfg:
            raise ValueError(
                f"train.train_cfg must be false for {family}: it has no classifier-free guidance to repeat "
                + ("(guidance-distilled: sampling.guidance_scale is embedded in every forward, training's too)"
                   if mode == "embedded" else "(no CFG and no guidance embedding)")
            )
        if negative:
            raise ValueError(f"model.negative_prompt must be empty for {family}: without CFG it is never used")
        if mode == "none" and s.guidance_scale != 1.0:
            raise ValueError(
                f"sampling.guidance_scale must be 1 for {family}: it has neither CFG nor a guidance embedding"
            )
    elif negative and s.guidance_scale == 1.0:
        raise ValueError("model.negative_prompt is set but sampling.guidance_scale is 1, so it is never used; "
                         "raise the scale above 1 or remove the negative prompt")
