"""The reward protocol: images in, one score per sample out, failures kept per sample.

Three kinds share one call signature, ``reward(images, prompts, metadata) -> RewardOutput``:
- ``PointwiseReward``: scores each image on its own (``score``); a failing image fails alone.
- ``BatchedReward``: scores a whole batch at once (``score_batch``, e.g. one model forward); if the
  batch raises, each sample is retried alone so one bad input does not fail the others.
- ``GroupwiseReward``: sees one prompt group at a time (``kind = "groupwise"``); the caller splits
  the batch by group.
``images`` is uint8 (B, H, W, 3); ``metadata`` holds one dict per sample (e.g. ``ground_truth``).
Videos are uint8 (B, F, H, W, 3): a reward with ``video = True`` scores them whole; any other sees their frames as
images and a video's score aggregates its frames' (``scoring.score_frames``).
A reward with ``inputs = True`` also gets each sample's input images (editing, image-to-video): it is called
``reward(images, prompts, metadata, inputs=...)``, ``inputs`` a list (one per sample) of lists of uint8 (H, W, 3)
arrays at their stored size; a pointwise one implements ``score(image, prompt, metadata, inputs)``, a batched one
``score_batch(images, prompts, metadata, inputs)``. A sample without input images has an empty list.
A reward that cannot score a sample for what came with it (its metadata, prompt, image or input images) raises
``SampleError`` naming the field: the caller's mistake, kept apart from the reward's own failures (``SampleProblem``).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from components.config_base import Section

Inputs = list[list[np.ndarray]]  # each sample's input images

@dataclass
class RewardOutput:
    """One score per sample (NaN where the reward failed), the failure messages, and extra info."""

    scores: np.ndarray  # (B,) float64
    errors: list[str | None]
    extra: dict[str, list[Any]] = field(default_factory=dict)

    @property
    def failed(self) -> int:
        return sum(e is not None for e in self.errors)

    @classmethod
    def all_failed(cls, n: int, message: str) -> RewardOutput:
        return cls(scores=np.full(n, np.nan), errors=[message] * n)

    @classmethod
    def from_scores(cls, values: Sequence[float], extra: dict[str, list[Any]] | None = None) -> RewardOutput:
        """Wrap raw scores; non-finite values become failures with a message."""
        scores = np.asarray(values, dtype=np.float64).copy()
        errors: list[str | None] = [None] * len(scores)
        for i, v in enumerate(scores):
            if not math.isfinite(v):
                errors[i] = f"non-finite score {v}"
                scores[i] = np.nan
        return cls(scores=scores, errors=errors, extra=extra or {})


class SampleError(ValueError):
    """What one sample came with that a reward cannot score: ``field`` is ``metadata.<key>``, ``prompt``, ``image``
    or ``inputs``. The caller's mistake, not a failure of the reward: the reward server answers it 4xx naming the
    field where it answers a reward's failure 500 (Flow-Factory's ``/compute``)."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


class SampleProblem(str):
    """A ``SampleError``'s failure message. ``RewardOutput.errors`` carries it as any other message (a str: copied,
    sliced and concatenated with the rest); its ``field`` and ``problem`` tell the reward server it was the
    caller's mistake."""

    field: str
    problem: str

    def __new__(cls, exc: SampleError) -> SampleProblem:
        message = super().__new__(cls, f"{type(exc).__name__}: {exc}")
        message.field, message.problem = exc.field, exc.problem
        return message


def describe(exc: BaseException) -> str:
    """A failure's message in ``RewardOutput.errors``; a ``SampleProblem`` for a ``SampleError``."""
    return SampleProblem(exc) if isinstance(exc, SampleError) else f"{type(exc).__name__}: {exc}"


class Reward(ABC):
    """Base of every reward. Subclasses set ``name`` (the registry key) and, when they take arguments, ``Args``: the
    model of the config's ``args``, validated and handed to the constructor as its one argument. A reward without
    ``Args`` (a custom one may) is built with ``args`` as keyword arguments, bound to its constructor's signature."""

    name: ClassVar[str] = ""
    Args: ClassVar[type[Section] | None] = None
    kind: ClassVar[str] = "pointwise"
    video: ClassVar[bool] = False  # scores whole videos (B, F, H, W, 3) rather than images
    inputs: ClassVar[bool] = False  # takes each sample's input images (the module docstring)

    @abstractmethod
    def __call__(self, images: np.ndarray, prompts: list[str], metadata: list[dict[str, Any]],
                 inputs: Inputs | None = None) -> RewardOutput:
        ...

    def _inputs_of(self, inputs: Inputs | None, n: int) -> Inputs:
        if self.inputs and inputs is None:
            raise SampleError("inputs", f"reward {self.name!r} scores edits against their input images, but none "
                                        "were given")
        return inputs if inputs is not None else [[] for _ in range(n)]


class PointwiseReward(Reward):
    """A reward that scores each image on its own."""

    @abstractmethod
    def score(self, image: np.ndarray, prompt: str, metadata: dict[str, Any], *inputs: list[np.ndarray]) -> float:
        """One sample's score; with ``inputs = True`` its input images come as a fourth argument."""

    def __call__(self, images: np.ndarray, prompts: list[str], metadata: list[dict[str, Any]],
                 inputs: Inputs | None = None) -> RewardOutput:
        values = np.full(len(images), np.nan)
        errors: list[str | None] = [None] * len(images)
        given = self._inputs_of(inputs, len(images))
        for i, (image, prompt, meta) in enumerate(zip(images, prompts, metadata, strict=True)):
            try:
                values[i] = float(self.score(image, prompt, meta, given[i]) if self.inputs else
                                  self.score(image, prompt, meta))
            except Exception as exc:  # a reward failure is data, recorded per sample
                errors[i] = describe(exc)
        out = RewardOutput.from_scores(values)
        out.errors = [e or o for e, o in zip(errors, out.errors, strict=True)]
        return out


class BatchedReward(Reward):
    """A reward that scores a batch in one call, falling back to one sample at a time on failure."""

    @abstractmethod
    def score_batch(self, images: np.ndarray, prompts: list[str], metadata: list[dict[str, Any]],
                    *inputs: Inputs) -> np.ndarray:
        """(B,) scores; may raise. With ``inputs = True`` the input images come as a fourth argument."""

    def _batch(self, images: np.ndarray, prompts: list[str], metadata: list[dict[str, Any]],
               inputs: Inputs) -> np.ndarray:
        return (self.score_batch(images, prompts, metadata, inputs) if self.inputs else
                self.score_batch(images, prompts, metadata))

    def __call__(self, images: np.ndarray, prompts: list[str], metadata: list[dict[str, Any]],
                 inputs: Inputs | None = None) -> RewardOutput:
        given = self._inputs_of(inputs, len(images))
        try:
            return RewardOutput.from_scores(self._batch(images, prompts, metadata, given))
        except Exception:  # isolate the failing samples below
            if len(images) == 1:
                raise
        values, errors = np.full(len(images), np.nan), [None] * len(images)
        for i in range(len(images)):
            try:
                values[i] = float(self._batch(images[i:i + 1], prompts[i:i + 1], metadata[i:i + 1], given[i:i + 1])[0])
            except Exception as exc:
                errors[i] = describe(exc)
        out = RewardOutput.from_scores(values)
        out.errors = [e or o for e, o in zip(errors, out.errors, strict=True)]
        return out


class GroupwiseReward(Reward):
    """A reward whose scores depend on the whole prompt group (all samples passed are one group)."""

    kind: ClassVar[str] = "groupwise"
