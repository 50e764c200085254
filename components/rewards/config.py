"""Config of one reward (its `args` checked against the built-in's model when it loads), the table of built-in
rewards (class, arguments model, purpose), how several rewards combine, and the remote reward server."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from components.config_base import Section
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

Aggregation = Literal["sum", "gdpo"]
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


class RewardServerConfig(Section):
    url: str | None = Field(default=None, description="base URL of `flowgrpo reward-server`; null scores "
                                                      "in this process")
    timeout_s: float = Field(default=600.0, gt=0, le=86400, description="seconds per scoring request")
    retry_window_s: float = Field(
        default=180.0, gt=0, le=3600,
        description="how long a reward server that refuses connections, answers 408/429/5xx or stops answering "
                    "its /healthz is retried and waited for before the run stops (a pod restart fits in the default)",
    )
    max_in_flight: int = Field(default=4, ge=1, le=1024, description="concurrent scoring requests")

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "retries" in data:
            raise ValueError("reward_server.retries was replaced by reward_server.retry_window_s: failures are "
                             "retried with backoff for that many seconds (default 180), not a number of times")
        return data

    @model_validator(mode="after")
    def _check_url(self) -> RewardServerConfig:
        if self.url is not None and not self.url.startswith(("http://", "https://")):
            raise ValueError(f"reward_server.url must start with http:// or https://, got {self.url!r}")
        return self
