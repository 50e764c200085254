"""The algorithm seam: what a training algorithm decides in an epoch (how the rollouts are sampled and by which
weights, how a micro-batch of them is prepared and its loss), its config section and its registration.
Sampling, scoring, advantages, Ray Train, sharding, checkpoints and tracking are the trainer's, and the update's
loop (inner epochs, micro-batches, gradient accumulation, the optimizer step, metric means) is `Algorithm.update`'s,
the same for every algorithm. docs/DESIGN.md, "Adding an algorithm", says how to add one.

An algorithm module's top level imports no torch: the light pipeline steps validate configs (each algorithm's
section among them) in an image without it. Torch and the trainer's helpers are imported where they are used.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import pkgutil
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, TypeVar

from components.config_base import Section

if TYPE_CHECKING:
    import torch

    from components.flow_rl.config import SamplingConfig, TrainConfig
    from components.flow_rl.rollout import Rollout, SamplerSettings
    from components.flow_rl.update import Optimization
    from components.models.base import FlowMatchingModel, PromptEmbeddings
    from components.models.config import ModelConfig

_PACKAGE = "components.algorithms"
_NOT_ALGORITHMS = {"base"}


class JobConfig(Protocol):
    """What the algorithms read of a run's config (``components.trainer.config.TrainingJobConfig``, a layer above this
    one): ``train:``, its shared keys with each algorithm's section as the attribute ``train.<key>``; ``sampling:``;
    and ``model:`` (its resolution)."""

    train: TrainConfig
    sampling: SamplingConfig
    model: ModelConfig


class AlgorithmConfig(Section):
    """An algorithm's own section, ``train.<key>``: the settings no other algorithm reads."""


@dataclass
class Update:
    """One epoch's update on this worker, as `Algorithm.update` hands it to the algorithm's hooks."""

    rollout: Rollout
    rewards: torch.Tensor  # this worker's samples' combined rewards (reward_aggregation's weighted sum), NaN where
    # one failed; on the CPU
    advantages: torch.Tensor  # theirs, on the CPU: the micro-batches are drawn there
    device_advantages: torch.Tensor  # the same on the model's device
    sampler: SamplerSettings
    generator: torch.Generator  # the epoch's: the micro-batches' order, an algorithm's noise levels
    optim: Optimization
    guidance: float  # the training forward's guidance scale


@dataclass
class MicroBatch:
    """One micro-batch, as an algorithm's `prepare` made it for its `loss`."""

    update: Update
    rows: torch.Tensor  # its samples in the rollout (moved to the rollout's device)
    # what `loss` gets for each trained forward, each loss backpropagated before the next forward: by default one,
    # numbered 0; FlowGRPO's are its steps, the flow-matching algorithms' their noise levels with their no-grad
    # forwards
    terms: Sequence[Any] = range(1)
    weight: float = 1.0  # its losses' weight; 0: a placeholder that keeps the workers' forwards and steps in line

    def __post_init__(self) -> None:
        self.rows = self.rows.to(self.update.rollout.prompt_index.device)

    @functools.cached_property
    def cond(self) -> PromptEmbeddings:
        """Its samples' prompt embeddings."""
        return self.update.rollout.embeds.select(self.update.rollout.prompt_index[self.rows])

    @functools.cached_property
    def x0(self) -> torch.Tensor:
        """Its samples' clean latents (the rollout's final states)."""
        return self.update.rollout.trajectory[:, -1][self.rows]

    @property
    def advantages(self) -> torch.Tensor:
        """Its samples' advantages, on the model's device."""
        return self.update.device_advantages[self.rows]


class Algorithm(ABC):
    """One run's algorithm: built once with the model and its LoRA parameters, asked each epoch how to sample and
    to update; its own state (beyond the LoRA, optimizer and EMA) goes into the checkpoints."""

    key: ClassVar[str]  # train.algorithm's value and the section's name (train.<key>); set by `register`
    name: ClassVar[str]  # as people know it: titles of what the run produced (the evaluation report)
    Config: ClassVar[type[AlgorithmConfig]] = AlgorithmConfig

    def __init__(self, config: JobConfig, model: FlowMatchingModel, params: list[torch.nn.Parameter]) -> None:
        self.config, self.model, self.params = config, model, params
        self.section = section_of(config)

    @classmethod
    def check(cls, config: JobConfig) -> list[str]:
        """Raise ValueError for settings this algorithm cannot honour; return a note for each setting of the config
        it does not read (`validate` and the trainer's start print them)."""
        notes = []
        for key in ("sde_window", "same_initial_noise"):
            if getattr(config.sampling, key):
                notes.append(f"sampling.{key} is not used: {cls.name} samples with the ODE")
        if config.train.grpo_guard:
            raise ValueError(f"train.grpo_guard normalises the ratio of the policy gradient on SDE steps: "
                             f"{cls.name} (train.algorithm {cls.key}) has none; remove it")
        return notes

    @classmethod
    def section_keys(cls) -> list[str]:
        """The `train.<key>` sections it reads: its own, then those of the algorithms it is built on (MixGRPO reads
        FlowGRPO's)."""
        return [c.key for c in cls.__mro__ if "key" in vars(c)]

    def sampler_settings(self, generator: torch.Generator, epoch: int) -> SamplerSettings:
        """Epoch ``epoch``'s sampler (``generator``: the epoch's, for anything drawn once per epoch). By default ODE
        rollouts: every step Euler, only the final, clean latent kept; an algorithm scoring SDE steps overrides it."""
        return self._sampler((), ())

    def update(self, rollout: Rollout, rewards: torch.Tensor, advantages: torch.Tensor, sampler: SamplerSettings,
               generator: torch.Generator, optim: Optimization) -> dict[str, float]:
        """Train on this worker's ``rollout``, its rewards and advantages, stepping with ``optim``; returns mean
        metrics.

        The loop every algorithm shares: ``train.inner_epochs`` passes over the algorithm's `micro_batches`, each
        `prepare`d, then its `loss` for each of its terms, scaled and backpropagated at once. Gradients accumulate
        over ``train.gradient_accumulation_steps`` micro-batches (fewer where a pass holds fewer: the last step of a
        pass takes what is left, never nothing), then ``optim`` takes one step. The metrics are means over the
        terms trained; trained_fraction is the share of the rollout's samples the passes trained. An algorithm that
        keeps values for one update (a noise generator, its pairs) sets them before calling this one."""
        from components.flow_rl.update import MetricMeans

        train = self.config.train
        update = Update(rollout, rewards, advantages, advantages.to(self.model.device), sampler, generator, optim,
                        self.training_guidance())
        means, trained = MetricMeans(), 0
        self.model.transformer.train(False)  # dropout off: the training forward must equal the sampling forward
        for _ in range(train.inner_epochs):
            batches = self.micro_batches(update)
            accumulate = min(train.gradient_accumulation_steps, len(batches))
            for i, indices in enumerate(batches):
                batch = self.prepare(update, indices)
                in_step = min(accumulate, len(batches) - i // accumulate * accumulate)  # this step's micro-batches
                for term in batch.terms:
                    loss, metrics = self.loss(batch, term)
                    (loss * (batch.weight / (len(batch.terms) * in_step))).backward()
                    if batch.weight:
                        for key, value in metrics.items():
                            means.add(key, value)
                trained += len(batch.rows) if batch.weight else 0
                if (i + 1) % accumulate == 0 or i == len(batches) - 1:
                    optim.apply(means)
        metrics = means.result()
        metrics["trained_fraction"] = trained / (len(rollout) * train.inner_epochs)
        return metrics

    def micro_batches(self, update: Update) -> list[torch.Tensor]:
        """One pass's micro-batches of indices for `prepare`: by default of the rollout's samples, in a random order,
        those with a zero advantage left out with train.skip_zero_advantage (`components.flow_rl.update`)."""
        from components.flow_rl.update import micro_batches

        train = self.config.train
        return micro_batches(update.advantages, train.batch_size_per_worker, train.skip_zero_advantage,
                             update.generator)

    def prepare(self, update: Update, indices: torch.Tensor) -> MicroBatch:
        """The micro-batch of `micro_batches`' ``indices``, with what its loss needs computed before the trained
        forwards; by default their samples, one term."""
        return MicroBatch(update, indices)

    @abstractmethod
    def loss(self, batch: MicroBatch, term: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """The loss of ``batch``'s ``term`` (one of its `terms`), through the trained forward, and its metrics
        (detached scalar tensors)."""

    def sampling_weights(self) -> contextlib.AbstractContextManager[None]:
        """The weights the rollouts are sampled with, swapped in for the block: the trained ones by default."""
        return contextlib.nullcontext()

    def state_dict(self) -> dict | None:
        return None

    def load_state_dict(self, state: dict | None) -> None:  # noqa: B027  # nothing to restore by default
        """Restore what ``state_dict`` returned."""

    def _sampler(self, sde_steps: tuple[int, ...], train_steps: tuple[int, ...], **changes: Any) -> SamplerSettings:
        """The epoch's sampler from ``sampling:``; ``changes`` override its fields."""
        from components.flow_rl.rollout import SamplerSettings

        s = self.config.sampling
        fields = dict(num_steps=s.num_steps, guidance_scale=s.guidance_scale, noise_level=s.noise_level,
                      sde_type=s.sde_type, resolution=self.config.model.resolution, sde_steps=sde_steps,
                      train_steps=train_steps, keep_means=self.config.train.grpo_guard,
                      # with no SDE step a group's images would all be the same
                      same_initial_noise=s.same_initial_noise and bool(sde_steps))
        return SamplerSettings(**{**fields, **changes})

    def training_guidance(self) -> float:
        """The guidance scale of the training forward: the sampling scale with train.train_cfg, else 1."""
        return self.model.training_guidance_scale(self.config.sampling.guidance_scale, self.config.train.train_cfg)


_REGISTRY: dict[str, type[Algorithm]] = {}
A = TypeVar("A", bound=type[Algorithm])


def register(key: str) -> Callable[[A], A]:
    """Class decorator: the algorithm selected by ``train.algorithm: <key>``, its section ``train.<key>``."""

    def add(cls: A) -> A:
        if key in _REGISTRY and _REGISTRY[key] is not cls:
            raise ValueError(f"two algorithms are registered as {key!r}: {_REGISTRY[key].__module__} and "
                             f"{cls.__module__}")
        cls.key = key
        _REGISTRY[key] = cls
        return cls

    return add


@functools.cache
def _import_modules() -> None:
    """Import this package's modules, each registering its own algorithm: once a process, not on every config
    validated."""
    package = importlib.import_module(_PACKAGE)
    for module in pkgutil.iter_modules(package.__path__):
        if module.name not in _NOT_ALGORITHMS:
            importlib.import_module(f"{_PACKAGE}.{module.name}")


def algorithms() -> dict[str, type[Algorithm]]:
    """Every algorithm, by key."""
    _import_modules()
    return dict(sorted(_REGISTRY.items()))


def algorithm_class(key: str) -> type[Algorithm]:
    known = algorithms()
    if key not in known:
        raise ValueError(f"train.algorithm must be one of {', '.join(known)}; got {key!r}")
    return known[key]


def section_of(config: JobConfig) -> AlgorithmConfig:
    """The selected algorithm's section of ``config`` (its defaults where the config names none)."""
    return getattr(config.train, config.train.algorithm)


def unread_sections(config: JobConfig) -> dict[str, list[str]]:
    """Each section ``train.<key>`` of an algorithm the run does not read, with the keys it sets to other than their
    defaults (a config may carry every algorithm's section, as tiny-cpu.yaml does with their defaults, so that one
    override switches algorithm)."""
    read = algorithm_class(config.train.algorithm).section_keys()
    sections = {}
    for key in sorted(algorithms().keys() - read):
        section = getattr(config.train, key)
        sections[key] = [f"train.{key}.{name}" for name in sorted(section.model_fields_set)
                         if getattr(section, name) != section.default_of(name)]
    return sections


def unread_section_notes(config: JobConfig) -> list[str]:
    """A note for each section of an algorithm the run does not read that sets a key to other than its default: a
    setting changed there is one the user may expect to act."""
    read = ", ".join(f"train.{k}" for k in algorithm_class(config.train.algorithm).section_keys())
    return [f"{', '.join(changed)} {'is' if len(changed) == 1 else 'are'} not used: train.algorithm is "
            f"{config.train.algorithm}, which reads {read}" for changed in unread_sections(config).values() if changed]


def idle_sections(config: JobConfig) -> list[str]:
    """The sections ``train.<key>`` the run neither reads nor changes from their defaults: what a run is handed may
    leave them out (its trainer fills them with the same defaults), while a changed one travels, so that its note
    (``unread_section_notes``) is given where the run starts too."""
    return [key for key, changed in unread_sections(config).items() if not changed]


def algorithm_name(config: JobConfig) -> str:
    return algorithm_class(config.train.algorithm).name


def build_algorithm(config: JobConfig, model: FlowMatchingModel, params: list[torch.nn.Parameter]) -> Algorithm:
    return algorithm_class(config.train.algorithm)(config, model, params)
