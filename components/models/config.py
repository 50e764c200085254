"""The `model:` section: which text-to-image model to load or build, its dtype, device and LoRA."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from components.config_base import Section
from components.errors import ConfigError
from components.models.families import pipelines, twins

# The tiny model's LoRA also adapts the feed-forward layers and the output projection: with attention
# alone a random 2-layer transformer cannot move the image statistics far (see tiny-cpu.yaml).
TINY_LORA_TARGETS = [
    "attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
    "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out",
    "ff.net.0.proj", "ff.net.2", "proj_out",
]


class LoRAConfig(Section):
    rank: int = Field(default=8, ge=1, le=1024, description="LoRA rank r (above the layers' width it adds nothing)")
    alpha: float = Field(default=16.0, gt=0, description="LoRA alpha (scale = alpha / rank)")
    init: Literal["gaussian", "default"] = Field(default="gaussian", description="peft init_lora_weights")
    target_modules: list[str] = Field(
        default_factory=lambda: list(TINY_LORA_TARGETS), min_length=1,
        description="module-name suffixes of the transformer to adapt",
    )


def _kinds_description() -> str:
    """``model.kind``'s values, from the family registry."""
    registered = pipelines()
    tiny = " / ".join(f"`{t.kind}` ({registered[t.pipeline].name})" for t in twins().values() if not t.about)
    demos = [f"`{t.kind}`: {t.about}" for t in twins().values() if t.about]
    return "; ".join([f"{tiny}: a tiny random pipeline of that model built from config", *demos,
                      f"`diffusers`: load `path`, a saved pipeline of {', '.join(p.name for p in registered.values())} "
                      "(its model_index.json names which)"])


KINDS = (*twins(), "diffusers")  # what model.kind names: a model built in code, or a saved pipeline


class ModelConfig(Section):
    kind: Literal[KINDS] = Field(default="tiny-sd3", description=_kinds_description())
    path: str | None = Field(default=None, description="diffusers pipeline directory or s3:// URI (kind=diffusers)")
    negative_prompt: str = Field(
        default="", description="negative prompt of CFG / true CFG; only read when sampling.guidance_scale > 1",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = Field(default="float32", description="model weights dtype")
    device: Literal["auto", "cpu", "cuda"] = Field(default="auto", description="`auto`: cuda when available")
    resolution: int = Field(default=32, ge=16, le=2048, description="image height and width in pixels")
    num_frames: int = Field(
        default=1, ge=1, le=257,
        description="frames per video of a video family (Wan: (num_frames - 1) divisible by its VAE's time "
                    "compression, 4); image families make one, and refuse any other number",
    )
    max_sequence_length: int | None = Field(
        default=None, ge=1, le=4096,
        description="text tokens per prompt (T5 for SD3 and FLUX, Qwen2.5-VL for Qwen-Image, Qwen3 for Z-Image and "
                    "FLUX.2 klein, which pads every prompt to it); longer prompts are cut. null = the family's: 128 "
                    "for SD3 and FLUX (upstream flow_grpo's training length), 512 for Qwen-Image, Z-Image and FLUX.2 "
                    "klein (their pipelines')",
    )
    offload_text_encoders: bool = Field(
        default=False,
        description="keep the text encoders off the accelerator once prompts are encoded: embeddings are cached "
                    "in host memory (all prompts at start when they fit in prompt_cache_gib, the encoders then "
                    "released; else each epoch's prompts, the encoders waiting in host memory between epochs)",
    )
    prompt_cache_gib: float = Field(
        default=16.0, ge=0, description="host memory for cached prompt embeddings (offload_text_encoders)",
    )
    lora: LoRAConfig = Field(default_factory=LoRAConfig)

    @model_validator(mode="after")
    def _path_matches_kind(self) -> ModelConfig:
        if self.kind == "diffusers" and not self.path:
            raise ValueError("model.path is required when model.kind is 'diffusers'")
        if self.kind != "diffusers" and self.path:
            raise ValueError("model.path is only read when model.kind is 'diffusers'; remove it or change the kind")
        twin = twins().get(self.kind)
        if twin and twin.resolution and self.resolution != twin.resolution:
            raise ValueError(f"model.resolution is {self.resolution}, but the {self.kind} demo model was trained at "
                             f"{twin.resolution} px; set model.resolution: {twin.resolution}")
        if self.num_frames != 1 and twin and not pipelines()[twin.pipeline].video:
            video = [t.kind for t in twins().values() if pipelines()[t.pipeline].video]
            raise ValueError(f"model.num_frames is {self.num_frames}, but {self.kind} makes images; set "
                             f"model.num_frames: 1 (video kinds: {', '.join([*video, 'diffusers'])})")
        if self.resolution % 16:
            raise ValueError(f"model.resolution must be a multiple of 16, got {self.resolution}")
        return self


def model_path_note(config: ModelConfig) -> str | None:
    """What ``flowgrpo validate`` can say about ``model.path`` without loading the model, or None when there is
    nothing to say (a tiny model, or a local diffusers directory that is there). A path missing here is a note,
    not an error: the machine that validates (a laptop, a CI runner) is often not the one that trains, so it
    may be right there; ``flowgrpo train`` stops on it (``loading.py``). Only a URI scheme no loader reads is
    a ConfigError."""
    from components import storage

    path = config.path
    if path is None:
        return None
    try:
        if storage.is_remote(path):
            return f"model.path {path}: checked when the run starts (needs the S3 credentials)"
        root = storage.local_copy(path)  # a local path, or a file:// URI as one
    except storage.StorageError as exc:  # a scheme no loader reads (http://...): wrong wherever it runs
        raise ConfigError(f"model.path: {exc}") from exc
    here = "`flowgrpo train` here would stop on it"
    if not root.exists():
        return (f"model.path {path} does not exist on this machine: fine if it exists where the training runs "
                f"(the cluster's RayJob pods mount no volume: there use model.path=s3://...); {here}")
    if not (root / "model_index.json").is_file():
        return (f"model.path {path} on this machine is not a diffusers pipeline directory (no model_index.json); "
                f"{here}")
    return None
