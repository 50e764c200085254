"""The reward server's HTTP API as pydantic models, shared by the server and its client."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, model_validator


class RawPixels(BaseModel):
    model_config = ConfigDict(extra="forbid")

    shape: tuple[NonNegativeInt, ...] = Field(
        min_length=4, max_length=5, description="(images, height, width, 3), or (videos, frames, height, width, 3)")
    data: str = Field(description="base64 of the uint8 pixels in C order")


class ScoreRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    prompts: list[str] = Field(description="one prompt per image")
    images: list[str] = Field(default_factory=list, description="base64 PNG or JPEG (a data URL is accepted)")
    pixels: RawPixels | None = Field(default=None, description="instead of `images`: raw pixels of equally "
                                                               "sized images or videos (what the trainer sends)")
    metadata: list[dict[str, Any]] | None = Field(default=None, description="per-sample fields, e.g. ground_truth")
    group_ids: list[int] | None = Field(default=None, description="prompt group of each sample (groupwise "
                                                                   "rewards); default: one group")
    rewards: list[str] | None = Field(default=None, description="reward keys to compute; default: all served")
    inputs: list[str] = Field(
        default_factory=list, description="the input images of edits (base64 PNG or JPEG), each sent once however "
                                          "many samples share it; their pixels count in the request's budget")
    input_index: list[list[NonNegativeInt]] | None = Field(
        default=None, description="per sample, its input images as indices into `inputs`")

    @model_validator(mode="after")
    def _lengths(self) -> ScoreRequest:
        if self.pixels is not None and self.images:
            raise ValueError("give images or pixels, not both")
        n = self.pixels.shape[0] if self.pixels is not None else len(self.images)
        for field in ("prompts", "metadata", "group_ids", "input_index"):
            value = getattr(self, field)
            if value is not None and len(value) != n:
                raise ValueError(f"{field} has {len(value)} items but there are {n} images")
        if (self.input_index is None) != (not self.inputs):
            raise ValueError("give inputs and input_index together")
        bad = [j for row in self.input_index or [] for j in row if j >= len(self.inputs)]
        if bad:
            raise ValueError(f"input_index names input {bad[0]}, but there are {len(self.inputs)} inputs")
        return self


class RewardResult(BaseModel):
    scores: list[float | None] = Field(description="null where the reward failed")
    errors: list[str | None]
    extra: dict[str, list[Any]] = Field(default_factory=dict)


class ScoreResponse(BaseModel):
    results: dict[str, RewardResult]
    seconds: float


class RewardInfo(BaseModel):
    key: str
    name: str
    kind: Literal["pointwise", "groupwise"]
    weight: float
    inputs: bool = Field(default=False, description="scores edits against their input images (send them)")


class RewardsResponse(BaseModel):
    rewards: list[RewardInfo]


class ComputeRequest(BaseModel):
    """Flow-Factory's RemoteRewardClient body. Only the prompts are required; both singular and
    plural spellings are accepted, and the optional inputs may come as explicit nulls. Any other field is
    refused (Flow-Factory sends none)."""

    model_config = ConfigDict(extra="forbid")

    prompt: list[str] | None = None
    prompts: list[str] | None = None
    image: list[str] | None = None
    images: list[str] | None = None
    video: Any = None
    condition_images: Any = None
    condition_videos: Any = None
    kwargs: dict[str, Any] | None = None
    extra: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_prompt_list(self) -> ComputeRequest:
        if self.prompt is None and self.prompts is None:
            raise ValueError("the body needs `prompt` (a list of strings)")
        return self

    def prompt_list(self) -> list[str]:
        return self.prompt if self.prompt is not None else self.prompts or []

    def image_list(self) -> list[str]:
        return self.image if self.image is not None else self.images or []

    def condition_lists(self) -> list[list[str]] | None:
        """Each sample's input images (Flow-Factory's ``condition_images``: a list of base64 PNGs per sample)."""
        if self.condition_images is None:
            return None
        rows = self.condition_images
        if not isinstance(rows, list) or not all(isinstance(r, list) and all(isinstance(i, str) for i in r)
                                                 for r in rows):
            raise ValueError("condition_images must be a list (one per sample) of lists of base64 images")
        return rows
