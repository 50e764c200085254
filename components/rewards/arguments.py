"""The typed ``args`` of the built-in rewards: names, types, defaults and bounds, checked when a config loads (every
error names its key path, ``rewards.0.args.max_tokens``) and given to the reward's constructor. Nothing here imports
a model library: the pipeline's light steps validate configs without them. ``rank``'s model, which holds a reward
config, is ``components.rewards.registry.RankArgs``; docs/REWARDS.md publishes the JSON schema of each."""

from __future__ import annotations

import re
import string
from typing import Literal

from pydantic import Field, field_validator, model_validator

from components import environ
from components.config_base import Section

JudgeMode = Literal["yes_no", "score", "ocr"]
GenEvalMode = Literal["partial", "strict"]
# A judge's reply length cap per mode when max_tokens is unset (yes_no always reads one token).
DEFAULT_MAX_TOKENS = {"score": 16, "ocr": 128}
_HTTP_URL = re.compile(r"https?://[^/\s]+")


class NoArgs(Section):
    """A reward without arguments: any key in its ``args`` is refused."""


class GenEvalShapesArgs(Section):
    mode: GenEvalMode = Field(default="partial", description="`partial`: multiset Jaccard of the wanted and found "
                                                             "objects; `strict`: 1 when they are equal, else 0")
    min_area_fraction: float = Field(default=0.01, ge=0, lt=0.5,
                                     description="coloured regions under this fraction of the image are specks")


class ShapesEditArgs(GenEvalShapesArgs):
    mode: GenEvalMode = Field(default="partial", description="`partial`: the edited cell's multiset Jaccard times "
                                                             "the other cells'; `strict`: 1 when the image holds "
                                                             "exactly the target scene, cell by cell, else 0")


class EditConsistencyArgs(Section):
    margin: float = Field(default=0.0, ge=0, lt=0.5,
                          description="widen metadata.edit_box by this fraction of the image side on every edge "
                                      "before leaving it out (room for an edit that spills over its box)")


class OcrArgs(Section):
    min_confidence: float = Field(default=0.5, ge=0, le=1,
                                  description="text boxes recognised with a lower confidence are ignored")
    use_angle_cls: bool = Field(default=False, description="also run the 0/180 degree text-direction classifier "
                                                           "(upstream FlowGRPO leaves it off)")


def _non_empty(value: str | None) -> str | None:
    if value is not None and not value.strip():
        raise ValueError("must not be empty or blank")
    return value


class ClipArgs(Section):
    model_path: str = Field(description="local directory (or s3:// URI) of a transformers CLIPModel saved with "
                                        "save_pretrained; never fetched from a hub")
    processor_path: str | None = Field(default=None, description="its CLIPProcessor's directory or URI "
                                                                 "(default: model_path)")
    device: str = Field(default="auto", description="`auto` (CUDA when available), `cpu`, `cuda` or `cuda:N`")
    max_batch_size: int = Field(default=32, ge=1, description="images (or prompts) per forward pass")

    @field_validator("model_path", "processor_path")
    @classmethod
    def _path_given(cls, value: str | None) -> str | None:
        return _non_empty(value)


class AestheticArgs(ClipArgs):
    head_path: str = Field(description="the aesthetic MLP's state dict (.safetensors, .pt, .pth or .bin), a local "
                                       "file or s3:// URI")

    @field_validator("head_path")
    @classmethod
    def _head_given(cls, value: str) -> str:
        return _non_empty(value)


class VLMJudgeArgs(Section):
    base_url: str = Field(description="the OpenAI-compatible API root, e.g. http://127.0.0.1:8000/v1 "
                                      "(/chat/completions is appended)")
    model: str = Field(description="the served model name")
    mode: JudgeMode = Field(default="yes_no", description="`yes_no`: sigmoid(logprob(Yes) - logprob(No)); `score`: "
                                                          "the reply's number mapped from [score_min, score_max] to "
                                                          "[0, 1]; `ocr`: the reply scored as a transcription")
    question: str | None = Field(default=None, description="the question; `{prompt}` is replaced by the sample's "
                                                           "prompt (literal braces: `{{`, `}}`). Default: per mode "
                                                           "(and per `with_inputs`)")
    with_inputs: bool = Field(default=False, description="judge an edit: each request carries the sample's input "
                              "image(s) first and the result last, in one message (1 + N images a request: the "
                              "server's --limit-mm-per-prompt must allow them), and the default question asks "
                              "whether the instruction `{prompt}` was followed with nothing else changed; a sample "
                              "without input images fails. `yes_no` and `score` only")
    score_min: float = Field(default=0.0, description="the low end of `score` mode's scale")
    score_max: float = Field(default=10.0, description="the high end of `score` mode's scale")
    max_tokens: int | None = Field(default=None, ge=1, description="reply length cap of `score` (default "
                                   f"{DEFAULT_MAX_TOKENS['score']}) and `ocr` ({DEFAULT_MAX_TOKENS['ocr']}); `yes_no` "
                                   "reads one token and takes none")
    api_key_env: str = Field(default=environ.VLM_JUDGE_API_KEY.name, description="the environment variable "
                             f"holding the API key, sent as a Bearer token when set (the key itself never goes in "
                             f"config): {environ.JUDGE_KEY_NAMES}, no other variable, so a config cannot send "
                             "the S3 or MLflow credentials to base_url")
    max_concurrency: int = Field(default=8, ge=1, description="requests in flight at once per call")
    timeout_s: float = Field(default=60.0, gt=0, description="limit of one request attempt, connect to last byte")
    retries: int = Field(default=3, ge=0, description="extra attempts after HTTP 408/429/5xx, connection errors "
                                                      "and timeouts")
    backoff_s: float = Field(default=0.5, ge=0, description="the first retry's mean delay; doubles per retry, "
                                                            "with +-50% jitter")

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        if not _HTTP_URL.match(value):
            raise ValueError("must be an http(s) URL such as http://127.0.0.1:8000/v1")
        return value

    @field_validator("model")
    @classmethod
    def _model_named(cls, value: str) -> str:
        return _non_empty(value)

    @field_validator("question")
    @classmethod
    def _template(cls, value: str | None) -> str | None:
        if _non_empty(value) is None:
            return None
        try:
            fields = {name for _, name, _, _ in string.Formatter().parse(value) if name is not None}
        except ValueError as exc:
            raise ValueError(f"not a valid template: {exc}") from exc
        if fields - {"prompt"}:
            raise ValueError(f"may use only the {{prompt}} placeholder, found {sorted(fields - {'prompt'})} "
                             "(write literal braces as {{ and }})")
        return value

    @field_validator("api_key_env")
    @classmethod
    def _env_name(cls, value: str) -> str:
        return environ.judge_key_name(value)

    @model_validator(mode="after")
    def _consistent(self) -> VLMJudgeArgs:
        if self.score_min >= self.score_max:
            raise ValueError(f"score_min ({self.score_min:g}) must be below score_max ({self.score_max:g})")
        if self.with_inputs and self.mode == "ocr":
            raise ValueError("with_inputs judges an edit against its input; ocr mode transcribes the result alone, "
                             "so the input would only cost an image a request: use mode yes_no or score, or leave "
                             "with_inputs unset")
        if self.mode == "yes_no" and self.max_tokens not in (None, 1):
            raise ValueError(f"yes_no mode reads the first token only; max_tokens must be unset, got "
                             f"{self.max_tokens}")
        return self
