"""Where the training prompts come from."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from components.config_base import Section

DEFAULT_PROMPTS = [
    "a red apple on a wooden table",
    "a lighthouse on a cliff at dusk",
    "a cat sleeping on a blue sofa",
    "a bowl of ramen, studio lighting",
    "a snowy mountain village at night",
    "a vintage car parked in the rain",
    "a field of sunflowers under a clear sky",
    "a robot reading a newspaper",
]


# The prompt sets shipped in components/dataset/builtin/ and the row check each gets (prepare.py)
BUILTIN_KINDS: dict[str, Literal["ocr", "generic"]] = {"ocr": "ocr", "aesthetic": "generic",
                                                       "compositional": "generic", "shapes": "generic",
                                                       "shapes-edit": "generic"}


class DataConfig(Section):
    prompts: list[str] | None = Field(
        default_factory=lambda: list(DEFAULT_PROMPTS),
        description="inline training prompts; set to null when `path` is used",
    )
    path: str | None = Field(
        default=None,
        description="a .txt (one prompt per line) or .jsonl (a `prompt` field per line, other fields are "
                    "metadata; an `images` field gives a row its input images for an editing or image-to-video "
                    "model) file, or a folder written by `flowgrpo prepare-dataset` (it holds manifest.json); "
                    "a local path or an s3:// URI; or `builtin:NAME`, a built-in prompt set read as it ships",
    )
    allow_external_images: bool = Field(
        default=False,
        description="also read input images a row names by an absolute path or an s3:// URI; off, a row's images "
                    "are paths relative to its file's folder and inside it, or inline data: URLs",
    )
    split: Literal["train", "test"] = Field(
        default="train",
        description="which split of a prepared dataset to read; `test` needs `path` to be a prepared dataset",
    )

    @model_validator(mode="after")
    def _one_source(self) -> DataConfig:
        if (self.prompts is None) == (self.path is None):
            raise ValueError("set exactly one of data.prompts and data.path")
        if self.split != "train" and self.prompts is not None:
            raise ValueError(f"data.split {self.split!r} needs data.path to be a prepared dataset; "
                             "inline data.prompts are all training prompts")
        if self.prompts is not None:
            if not self.prompts:
                raise ValueError("data.prompts is empty")
            for i, p in enumerate(self.prompts):
                if not p.strip():
                    raise ValueError(f"data.prompts.{i} is empty")
        return self


class PrepareConfig(Section):
    """How the pipeline's prepare_dataset step builds the run's dataset (`flowgrpo prepare-dataset` options)."""

    source: str | None = Field(
        default=None,
        description="`builtin:ocr|aesthetic|compositional|shapes`, or a JSONL / CSV / Parquet file (path or s3:// "
                    "URI); null = the training data of `data:` (its inline prompts or its file)",
    )
    kind: Literal["ocr", "generic"] | None = Field(
        default=None, description="`ocr` also rejects rows with no text to render; null = from the source",
    )
    test_fraction: float = Field(default=0.25, ge=0, lt=1, description="share of rows held out for evaluation")
    seed: int = Field(default=0, description="the split depends only on each prompt and this seed")
    max_prompt_tokens: int = Field(default=256, ge=1, description="longer prompts are rejected (T5's limit)")
