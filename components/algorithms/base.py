"""The algorithm seam: what a training algorithm decides in an epoch (how the rollouts are sampled and by which
weights, how the policy is updated from them and their advantages), its config section and its registration.
Sampling, scoring, advantages, Ray Train, sharding, checkpoints and tracking are the trainer's, the same for every
algorithm. docs/DESIGN.md, "Adding an algorithm", says how to add one.

An algorithm module's top level imports no torch: the light pipeline steps validate configs (each algorithm's
section among them) in an image without it. Torch and the trainer's helpers are imported where they are used.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import pkgutil
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from components.config_base import Section

if TYPE_CHECKING:
    import torch

    from components.flowgrpo.rollout import Rollout, SamplerSettings
    from components.flowgrpo.update import Optimization
    from components.models.base import FlowMatchingModel

# components.trainer.config.TrainingJobConfig, a layer above this one: `.train`, `.sampling`, `.model`, `.seed`
JobConfig = Any
_PACKAGE = "components.algorithms"
_NOT_ALGORITHMS = {"base"}


class AlgorithmConfig(Section):
    """An algorithm's own section, ``train.<key>``: the settings no other algorithm reads."""


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

    def sampler_settings(self, generator: torch.Generator, epoch: int) -> SamplerSettings:
        """Epoch ``epoch``'s sampler (``generator``: the epoch's, for anything drawn once per epoch). By default ODE
        rollouts: every step Euler, only the final, clean latent kept; an algorithm scoring SDE steps overrides it."""
        return self._sampler((), ())

    @abstractmethod
    def update(self, rollout: Rollout, advantages: torch.Tensor, sampler: SamplerSettings,
               generator: torch.Generator, optim: Optimization) -> dict[str, float]:
        """Train on this worker's ``rollout`` and its advantages, stepping with ``optim``; returns mean metrics."""

    def sampling_weights(self) -> contextlib.AbstractContextManager[None]:
        """The weights the rollouts are sampled with, swapped in for the block: the trained ones by default."""
        return contextlib.nullcontext()

    def state_dict(self) -> dict | None:
        return None

    def load_state_dict(self, state: dict | None) -> None:  # noqa: B027  # nothing to restore by default
        """Restore what ``state_dict`` returned."""

    def _sampler(self, sde_steps: tuple[int, ...], train_steps: tuple[int, ...], **changes: Any) -> SamplerSettings:
        """The epoch's sampler from ``sampling:``; ``changes`` override its fields."""
        from components.flowgrpo.rollout import SamplerSettings

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


def algorithm_name(config: JobConfig) -> str:
    return algorithm_class(config.train.algorithm).name


def build_algorithm(config: JobConfig, model: FlowMatchingModel, params: list[torch.nn.Parameter]) -> Algorithm:
    return algorithm_class(config.train.algorithm)(config, model, params)
