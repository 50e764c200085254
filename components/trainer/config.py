"""Typed settings of a FlowGRPO training job. Defaults equal `pipeline/configs/tiny-cpu.yaml`.

The reasons behind the tiny defaults are written in that file's comments.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field, ValidationError, create_model, model_validator

from components.algorithms.base import algorithm_class, algorithms, idle_sections, unread_section_notes
from components.config_base import Section, Seed, chained, check_strings, format_validation_error
from components.dataset.config import DataConfig
from components.errors import ConfigError
from components.flow_rl.config import SAMPLES_PER_STEP, SamplingConfig, TrainConfig
from components.models.config import ModelConfig
from components.models.families import GuidanceMode, twins
from components.rewards.config import Aggregation, RewardServerConfig
from components.rewards.registry import RewardSpec, check_names, check_unique_keys
from components.tracking.config import TrackingConfig


def _with_algorithm_sections(base: type[TrainConfig]) -> type[TrainConfig]:
    """`train:` with each algorithm's own section, `train.<key>`: all of them validated, the selected one read (so
    any config switches algorithm with `train.algorithm=<key>`)."""
    sections: dict[str, Any] = {}
    for key, cls in algorithms().items():
        if key in base.model_fields:
            raise ValueError(f"the algorithm {key!r} ({cls.__module__}) is named as the train.{key} key; rename it")
        sections[key] = (cls.Config, Field(default_factory=cls.Config,
                                           description=f"{cls.name}'s own settings, read with train.algorithm {key}"))
    return create_model("TrainConfig", __base__=base, __module__=__name__, **sections)


TrainSection = _with_algorithm_sections(TrainConfig)


class DistributedConfig(Section):
    """How a run on Ray Train workers (``--ray-workers``, a RayJob) meets a lost worker, host or link; read only
    there. Each bound is what it costs in the worst case (docs/DISTRIBUTED.md, "Across hosts")."""

    collective_timeout_s: float = Field(
        default=900.0, gt=0, le=86400,
        description="a collective (the reward gather, the gradient all-reduce, an FSDP all-gather) that waits "
                    "longer than this for a peer fails (the process group's timeout, gloo's and NCCL's alike), so a "
                    "worker cut off by a partition never hangs the others; keep it above the longest lead one worker "
                    "can take (rank 0 writing a checkpoint and the sample grid, the first epoch's compile)",
    )
    start_timeout_s: float = Field(
        default=600.0, gt=0, le=86400,
        description="how long the workers may wait for their resources, at start and after a failure (a node "
                    "coming back, a replacement pod); after it the run stops, naming the nodes lost and the command "
                    "that resumes",
    )
    max_restarts: int = Field(
        default=3, ge=0, le=1000,
        description="failures of the worker group (a worker process, host or link lost) recovered from by starting "
                    "every worker again from the newest checkpoint; one more stops the run",
    )


class TrainingJobConfig(Section):
    """Everything the trainer reads. The pipeline's experiment config extends it."""

    seed: Seed = Field(default=0, description="seeds the tiny model, prompt order, noise and LoRA init")
    model: ModelConfig = Field(default_factory=ModelConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    train: TrainSection = Field(default_factory=TrainSection)
    rewards: list[RewardSpec] = Field(
        default_factory=lambda: [RewardSpec(name="brightness")], min_length=1,
        description="training rewards",
    )
    reward_aggregation: Aggregation = Field(default="sum", description="how several rewards combine")
    reward_server: RewardServerConfig = Field(default_factory=RewardServerConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    tracking: TrackingConfig = Field(default_factory=TrackingConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)

    @classmethod
    def from_sections(cls, data: dict[str, Any], source: str) -> TrainingJobConfig:
        """The trainer's own sections of an experiment mapping, validated; the other stages' sections are theirs
        to read (the experiment config they came from was validated whole where it was composed)."""
        try:
            return cls.model_validate({k: v for k, v in data.items() if k in cls.model_fields})
        except ValidationError as exc:
            raise ConfigError(format_validation_error(exc, source)) from chained(exc, source)

    def run_data(self) -> dict[str, Any]:
        """The config as a run is handed it (the RayJob's copy): without the sections of the algorithms it neither
        reads nor changes (``idle_sections``), which its trainer fills with the same defaults."""
        data = self.model_dump(mode="json")
        for key in idle_sections(self):
            del data["train"][key]
        return data

    @model_validator(mode="before")
    @classmethod
    def _check_strings(cls, data: Any) -> Any:
        return check_strings(data)

    @model_validator(mode="after")
    def _check_consistency(self) -> TrainingJobConfig:
        s, t = self.sampling, self.train
        if s.group_size < 2:
            hint = " (with train.advantage_std group even its std is undefined)" if t.advantage_std == "group" else ""
            raise ValueError(
                f"sampling.group_size must be at least 2, got {s.group_size}: advantages are relative to the "
                f"prompt's group, so a group of one always has advantage 0{hint}"
            )
        problems = epoch_split_problems(self, 1)
        if problems:
            raise ValueError("; ".join(problems))
        algorithm_class(t.algorithm).check(self)
        if t.train_cfg and s.guidance_scale == 1.0:
            raise ValueError("train.train_cfg is true but sampling.guidance_scale is 1 (no CFG to repeat)")
        if not t.cfg_uncond_grad and not t.train_cfg:
            raise ValueError("train.cfg_uncond_grad is false but train.train_cfg is false: the training forward has "
                             "no unconditional CFG branch; remove train.cfg_uncond_grad or set train.train_cfg true")
        twin = twins().get(self.model.kind)
        if twin:
            check_guidance(self, twin.guidance, self.model.kind)
        check_unique_keys(self.rewards, "rewards")
        if self.reward_server.url is None:  # a server of the user's own may serve rewards by other names
            check_names(self.rewards, "rewards")
        if self.reward_aggregation == "gdpo" and len(self.rewards) < 2:
            raise ValueError("reward_aggregation 'gdpo' needs at least two rewards; use 'sum' for one")
        return self


def algorithm_notes(config: TrainingJobConfig) -> list[str]:
    """What the selected algorithm says of the config (the settings it does not read), and the keys changed in the
    sections of algorithms it does not read."""
    return algorithm_class(config.train.algorithm).check(config) + unread_section_notes(config)


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
