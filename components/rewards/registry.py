"""The rewards by name: the table of built-in rewards (class, arguments model, purpose), a reward's entry of a config
(``RewardSpec``, its ``args`` checked against the built-in's model when it loads), what a name stands for (a
built-in's class or an import path of a user's reward), and the classes, imported lazily so that heavy dependencies
load only when used, built from their entries. ``check_spec`` is the one resolution: the trainer, the evaluation
and the reward server call it through ``build_reward``, and `flowgrpo validate` calls it directly."""

from __future__ import annotations

import importlib
import inspect
import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, ValidationError, ValidationInfo, field_validator

from components.config_base import Section, format_validation_error, validation_problems
from components.errors import RewardError
from components.rewards.arguments import (
    AestheticArgs,
    ClipArgs,
    EditConsistencyArgs,
    GenEvalShapesArgs,
    NoArgs,
    OcrArgs,
    ShapesEditArgs,
    VLMJudgeArgs,
)
from components.rewards.base import Reward

FrameAggregation = Literal["mean", "min"]


def import_target(name: str) -> str:
    """The ``module:attribute`` a reward name stands for: a built-in's, or the name itself when it is an import path
    ``package.module:Class`` (or ``package.module.Class``) of dot-separated Python identifiers. ValueError saying
    why otherwise (a file path, a typo): the one place both a config check and the trainer read a name."""
    if name in BUILTIN:
        return BUILTIN[name].target
    module, sep, attr = name.partition(":")
    if not sep:
        module, _, attr = name.rpartition(".")
    if module and attr.isidentifier() and all(part.isidentifier() for part in module.split(".")):
        return f"{module}:{attr}"
    known = ", ".join(sorted(BUILTIN))
    if any(c in name for c in ".:/\\"):
        raise ValueError(f"reward {name!r} is neither a built-in ({known}) nor an import path package.module:Class "
                         "of Python identifiers (a file path cannot name a reward: put its class in an importable "
                         "module)")
    raise ValueError(f"unknown reward {name!r}; known: {known} (or a custom reward as package.module:Class)")


class RewardSpec(Section):
    name: str = Field(min_length=1, description="built-in reward name or import path package.module:Class")
    label: str | None = Field(default=None, description="key in metrics and results (default: the name)")
    weight: float = Field(default=1.0, description="weight in the combined reward (docs/ALGORITHM.md section 5)")
    args: dict[str, Any] = Field(default_factory=dict, description="the reward's arguments (docs/REWARDS.md)")
    required: bool = Field(default=False, description="a failure of this reward aborts the step instead of "
                                                      "excluding the failed samples")
    timeout_s: float = Field(default=300.0, gt=0, le=86400,  # threading refuses waits past ~9.2e9 s
                             description="seconds one scoring call may take")
    frames: FrameAggregation = Field(
        default="mean", description="on videos, how an image reward's per-frame scores make the video's score: "
                                    "`mean`, or `min` (the worst frame); video rewards score the whole video")

    @field_validator("args")
    @classmethod
    def _typed_args(cls, value: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        """A built-in's arguments are checked against its model here, so every error names its key path; a custom
        reward's are checked where its class is imported (``registry.check_spec``). The mapping is kept as written:
        it is what the run's config.yaml and the reward server's settings carry."""
        builtin = BUILTIN.get(info.data.get("name", ""))
        if builtin is not None:
            builtin.args.model_validate(value)
        return value

    @property
    def key(self) -> str:
        return self.label or self.name


class RankArgs(Section):
    reward: RewardSpec = Field(description="the wrapped pointwise reward's config, e.g. {name: jpeg_compressibility}")


@dataclass(frozen=True)
class Builtin:
    target: str  # the class's import path, imported only where scoring happens
    args: type[Section]  # the model of its `args`, checked when a config loads
    purpose: str  # one line, for docs/REWARDS.md


BUILTIN: dict[str, Builtin] = {
    "brightness": Builtin("components.rewards.brightness:Brightness", NoArgs,
                          "mean luma in [0, 1] (ITU-R BT.601 weights); tiny-cpu's reward"),
    "geneval_shapes": Builtin("components.rewards.geneval_shapes:GenEvalShapes", GenEvalShapesArgs,
                              "GenEval for the shapes world: are the objects, counts and colours of the prompt in "
                              "the image"),
    "shapes_edit": Builtin("components.rewards.shapes_edit:ShapesEdit", ShapesEditArgs,
                           "the shapes editing demo: was the instruction's edit made and nothing else changed "
                           "(the objects found per grid cell against the target scene of metadata.scene)"),
    "edit_consistency": Builtin("components.rewards.edit_consistency:EditConsistency", EditConsistencyArgs,
                                "sees the input image: 1 - the mean absolute pixel difference between the result "
                                "and the input outside metadata.edit_box (the whole image without one)"),
    "jpeg_compressibility": Builtin("components.rewards.jpeg:JpegCompressibility", NoArgs,
                                    "-(size of the JPEG at quality 95 in kB) / 500: simpler images score higher"),
    "jpeg_incompressibility": Builtin("components.rewards.jpeg:JpegIncompressibility", NoArgs,
                                      "size of the JPEG at quality 95 in kB: more detailed images score higher"),
    "ocr": Builtin("components.rewards.ocr:OcrReward", OcrArgs,
                   "1 - edit distance / len(target) between RapidOCR's reading (bundled models, offline) and the "
                   "prompt's quoted text or metadata.ground_truth"),
    "clip_score": Builtin("components.rewards.clip_models:ClipScore", ClipArgs,
                          "cosine of the CLIP image and prompt embeddings, in [-1, 1]"),
    "pickscore": Builtin("components.rewards.clip_models:PickScore", ClipArgs,
                         "PickScore: logit_scale.exp() * cosine with a PickScore checkpoint"),
    "aesthetic": Builtin("components.rewards.clip_models:AestheticScore", AestheticArgs,
                         "LAION aesthetic MLP on the unit-norm CLIP image embedding (about 1-10)"),
    "vlm_judge": Builtin("components.rewards.vlm_judge:VLMJudge", VLMJudgeArgs,
                         "an OpenAI-compatible VLM (vLLM) as judge: Yes/No logprobs, a numeric score, or an OCR "
                         "transcription; with `with_inputs`, whether an edit followed its instruction (input and "
                         "result in one request)"),
    "rank": Builtin("components.rewards.rank:Rank", RankArgs,
                    "groupwise: the rank of a wrapped pointwise reward within its prompt group, "
                    "argsort(argsort(s)) / K"),
    "temporal_consistency": Builtin("components.rewards.temporal:TemporalConsistency", NoArgs,
                                    "videos only: 1 - the mean absolute change between consecutive frames (pixels "
                                    "in [0, 1])"),
}


def check_names(specs: list[RewardSpec], where: str) -> None:
    """Each name is a built-in reward or has the form of an import path. Importing it is left to
    ``registry.check_spec``, which the processes that score and `flowgrpo validate` call: the pipeline's light
    steps have no model libraries."""
    for i, spec in enumerate(specs):
        try:
            import_target(spec.name)
        except ValueError as exc:
            raise ValueError(f"{where}.{i}.name: {exc}") from exc


def check_unique_keys(specs: list[RewardSpec], where: str) -> None:
    keys = [s.key for s in specs]
    for i, key in enumerate(keys):
        if key in keys[:i]:
            raise ValueError(f"{where}.{i}: reward {key!r} is listed twice (give one a distinct `label`)")


def reward_class(name: str, where: str = "rewards") -> type[Reward]:
    """The class of a built-in name, or of an import path ``package.module:Class`` / ``package.module.Class``,
    whose module is imported (a user's module runs then, as it would when training)."""
    try:
        module_name, _, attr = import_target(name).partition(":")
    except ValueError as exc:
        raise RewardError(f"{where}.name: {exc}") from exc
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise RewardError(f"{where}.name: cannot import reward {name!r}: {exc}") from exc
    except Exception as exc:  # a user's module runs on import: whatever it raises, the reward cannot be used
        raise RewardError(f"{where}.name: cannot import reward {name!r}: importing {module_name} raised "
                          f"{type(exc).__name__}: {exc}") from exc
    cls = getattr(module, attr, None)
    if cls is None:
        raise RewardError(f"{where}.name: cannot import reward {name!r}: module {module_name} has no {attr!r}")
    if not (isinstance(cls, type) and issubclass(cls, Reward)):
        raise RewardError(f"{where}.name: {name!r} is not a subclass of components.rewards.base.Reward "
                          f"(it is {type(cls).__name__} {cls!r:.60})")
    if inspect.isabstract(cls):
        raise RewardError(f"{where}.name: {name!r} is abstract (it does not implement "
                          f"{', '.join(sorted(cls.__abstractmethods__))})")
    return cls


class RewardCache:
    """Builds rewards, sharing one instance (and its loaded model) between identical configs."""

    def __init__(self) -> None:
        self._built: dict[str, Reward] = {}

    def get(self, spec: RewardSpec, where: str = "rewards") -> Reward:
        key = json.dumps([spec.name, spec.args], sort_keys=True, default=str)
        if key not in self._built:
            self._built[key] = build_reward(spec, where, cache=self)
        return self._built[key]


def check_spec(spec: RewardSpec, where: str = "rewards") -> type[Reward]:
    """Resolve the class and check the arguments (``reward_args``), without building anything. The reward configs
    a wrapper (such as ``rank``) holds among its arguments are checked the same way."""
    cls = reward_class(spec.name, where)
    for key, inner in _wrapped_specs(cls, reward_args(cls, spec, where), where):
        check_spec(inner, f"{where}.args.{key}")
    return cls


def reward_args(cls: type[Reward], spec: RewardSpec, where: str = "rewards") -> Section | dict[str, Any]:
    """What ``cls`` is built with: ``spec.args`` validated by its ``Args`` model, or (a reward without one) the
    mapping itself, bound to its constructor's signature. RewardError naming each bad key's path otherwise."""
    if cls.Args is not None:
        try:
            return cls.Args.model_validate(spec.args)
        except ValidationError as exc:
            raise RewardError(f"{validation_problems(exc, f'{where}.args')} (reward {spec.name!r})") from exc
    extra = {"cache": None} if _takes_cache(cls) else {}
    try:
        inspect.signature(cls).bind(**spec.args, **extra)
    except TypeError as exc:
        raise RewardError(f"{where}.args: {exc} (reward {spec.name!r})") from exc
    return dict(spec.args)


def _takes_cache(cls: type[Reward]) -> bool:
    return "cache" in inspect.signature(cls).parameters


def _wrapped_specs(cls: type[Reward], args: Section | dict[str, Any], where: str) -> list[tuple[str, RewardSpec]]:
    """The reward configs among a wrapper's arguments: the ``RewardSpec`` fields of its ``Args``, or (a wrapper
    without ``Args``) the mappings with a ``name``."""
    if not _takes_cache(cls):
        return []
    if isinstance(args, Section):
        return [(key, value) for key, value in args if isinstance(value, RewardSpec)]
    return [(key, _inner_spec(value, f"{where}.args.{key}")) for key, value in args.items()
            if isinstance(value, dict) and "name" in value]


def check_specs(specs: list[RewardSpec], where: str) -> None:
    """``check_spec`` on each of ``specs``, named ``where.0``, ``where.1``, ... as the scorers name them."""
    for i, spec in enumerate(specs):
        check_spec(spec, f"{where}.{i}")


def _inner_spec(value: dict[str, Any], where: str) -> RewardSpec:
    try:
        return RewardSpec.model_validate(value)
    except ValidationError as exc:
        raise RewardError(format_validation_error(exc, where)) from exc


def build_reward(spec: RewardSpec, where: str = "rewards", cache: RewardCache | None = None) -> Reward:
    """Instantiate ``spec``; unknown names and bad arguments raise ``RewardError`` naming ``where``.

    A reward class whose constructor takes a ``cache`` keyword (wrappers such as ``rank``) gets the
    cache, to build the rewards it wraps.
    """
    cls = check_spec(spec, where)
    args = reward_args(cls, spec, where)
    extra = {"cache": cache or RewardCache()} if _takes_cache(cls) else {}
    try:
        return cls(**args, **extra) if isinstance(args, dict) else cls(args, **extra)
    except (ValueError, TypeError, OSError) as exc:
        raise RewardError(f"{where}: reward {spec.name!r} cannot be built: {exc}") from exc
