"""The model adapter: what the trainer needs from a text-to-image flow-matching pipeline.

The trainer only talks to this interface; model families (SD3, later FLUX and
Qwen-Image) implement it in a module of their own.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from peft import LoraConfig
from peft.utils import get_peft_model_state_dict

from components.trainer.config import LoRAConfig

ADAPTER_NAME = "default"


@dataclass
class PromptEmbeddings:
    """Text conditioning as named tensors whose first dimension is the batch."""

    tensors: dict[str, torch.Tensor]

    def __len__(self) -> int:
        return next(iter(self.tensors.values())).shape[0]

    def select(self, index: torch.Tensor) -> PromptEmbeddings:
        return PromptEmbeddings({k: v.index_select(0, index.to(v.device)) for k, v in self.tensors.items()})

    def expand_to(self, n: int) -> PromptEmbeddings:
        """Repeat a single-row embedding to ``n`` rows (used for the shared negative prompt)."""
        return PromptEmbeddings({k: v.expand(n, *v.shape[1:]) for k, v in self.tensors.items()})

    @staticmethod
    def cat(parts: list[PromptEmbeddings]) -> PromptEmbeddings:
        return PromptEmbeddings({k: torch.cat([p.tensors[k] for p in parts]) for k in parts[0].tensors})


class FlowMatchingModel(ABC):
    """A diffusers pipeline seen through the operations FlowGRPO needs."""

    def __init__(self, pipeline, device: torch.device, dtype: torch.dtype) -> None:
        self.pipeline = pipeline
        self.device = device
        self.dtype = dtype
        self.lora_config: LoraConfig | None = None
        self._negative: PromptEmbeddings | None = None

    def pipeline_call_kwargs(self) -> dict:
        """Family-specific arguments for the pipeline's own ``__call__`` (plain generation)."""
        return {}

    @property
    def transformer(self) -> torch.nn.Module:
        return self.pipeline.transformer

    @abstractmethod
    def encode_prompts(self, prompts: list[str]) -> PromptEmbeddings:
        """Conditional embeddings, one row per prompt."""

    @abstractmethod
    def latent_shape(self, resolution: int) -> tuple[int, ...]:
        """Shape of one latent (no batch dimension) for a square image of ``resolution`` px."""

    @abstractmethod
    def sigmas(self, num_steps: int, resolution: int) -> torch.Tensor:
        """The scheduler's noise levels, float32 on CPU, shape (num_steps + 1,), from 1 down to 0."""

    @abstractmethod
    def _forward(self, latents: torch.Tensor, sigma: float, embeds: PromptEmbeddings) -> torch.Tensor:
        """One transformer forward: the velocity at noise level ``sigma``."""

    @abstractmethod
    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Images in [0, 1], float32, shape (B, 3, H, W)."""

    def negative_embeddings(self) -> PromptEmbeddings:
        """The empty-prompt embedding used for CFG, computed once (LoRA never touches the text encoders)."""
        if self._negative is None:
            self._negative = self.encode_prompts([""])
        return self._negative

    def predict_velocity(
        self, latents: torch.Tensor, sigma: float, cond: PromptEmbeddings, guidance_scale: float
    ) -> torch.Tensor:
        """Velocity with classifier-free guidance when ``guidance_scale > 1``; float32."""
        x = latents.to(self.dtype)
        if guidance_scale == 1.0:
            return self._forward(x, sigma, cond).float()
        both = PromptEmbeddings.cat([self.negative_embeddings().expand_to(len(cond)), cond])
        uncond_v, cond_v = self._forward(torch.cat([x, x]), sigma, both).float().chunk(2)
        return uncond_v + guidance_scale * (cond_v - uncond_v)

    def add_lora(self, config: LoRAConfig) -> list[torch.nn.Parameter]:
        """Attach a LoRA adapter to the transformer; returns its trainable parameters (float32)."""
        self.lora_config = LoraConfig(
            r=config.rank, lora_alpha=config.alpha, init_lora_weights=config.init,
            target_modules=config.target_modules,
        )
        try:
            self.transformer.add_adapter(self.lora_config, adapter_name=ADAPTER_NAME)
        except ValueError as exc:
            raise ValueError(f"model.lora.target_modules: {exc}") from exc
        params = [p for n, p in self.transformer.named_parameters() if "lora_" in n]
        for p in params:
            p.data = p.data.float()
            p.requires_grad_(True)
        return params

    @contextlib.contextmanager
    def adapter_disabled(self) -> Iterator[None]:
        """The reference model: the same weights with the LoRA switched off."""
        self.transformer.disable_adapters()
        try:
            yield
        finally:
            self.transformer.enable_adapters()

    def lora_state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().cpu().clone() for k, v in get_peft_model_state_dict(self.transformer).items()}

    def save_lora(self, directory: Path, state_dict: dict[str, torch.Tensor] | None = None) -> None:
        """Write the LoRA in diffusers format, loadable with ``pipe.load_lora_weights(directory)``."""
        if self.lora_config is None:
            raise RuntimeError("no LoRA adapter attached")
        type(self.pipeline).save_lora_weights(
            str(directory),
            transformer_lora_layers=state_dict if state_dict is not None else self.lora_state_dict(),
            transformer_lora_adapter_metadata=self.lora_config.to_dict(),
            safe_serialization=True,
        )
