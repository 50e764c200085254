"""Prompt embeddings for the rollouts, with the text encoders kept off the accelerator when asked.

With ``model.offload_text_encoders`` the encoders visit the accelerator only to encode. When the embeddings of
every prompt of the run fit in ``model.prompt_cache_gib`` of host memory they are all computed at start, batch
by batch, and the encoders are released; otherwise the encoders wait in host memory and visit the accelerator
once per epoch to encode that epoch's prompts. LoRA never touches the text encoders, so an embedding computed
once is the embedding for the whole run. A row with input images (editing, image-to-video) is encoded with them:
its embedding holds what the family derives from them (the VAE latents of the input, ...), cached alike.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from components.dataset.input_images import describe, load_row_images, model_input
from components.dataset.prepared import PromptRow
from components.models.base import FlowMatchingModel, PromptEmbeddings

ENCODE_BATCH = 64  # prompts per encoder forward while filling the cache
PROGRESS_EVERY_S = 10.0


class PromptEncoder:
    """``encoder(rows)``: embeddings of ``rows`` (their prompts and input images), one each, on the model's device.
    ``resolution``: the model's, the size input images are made."""

    def __init__(self, model: FlowMatchingModel, rows: list[PromptRow], *, resolution: int, offload: bool,
                 cache_gib: float, log: Callable[[str], None]) -> None:
        self.model = model
        self.resolution = resolution
        self.offload = offload
        self.cache: dict[tuple[str, tuple[str, ...]], PromptEmbeddings] | None = None
        for count in sorted({len(r.images) for r in rows}):
            model.check_input_images(count, f"data ({describe(next(r for r in rows if len(r.images) == count))})")
        model.move_text_encoders(model.device)
        model.negative_embeddings()  # computed once, kept on the device for CFG
        if not offload:
            return
        unique = list({r.key: r for r in rows}.values())
        first = self._rows(unique[:ENCODE_BATCH])  # the first batch of the cache, and the size estimate
        estimate = sum(e.nbytes() for e in first) / len(first) * len(unique)
        if estimate <= cache_gib * 2**30:
            self.cache = dict(zip([r.key for r in unique], self._encode_all(unique, first, log), strict=True))
            model.release_text_encoders()
            log(f"text encoders released: {len(unique)} prompt embeddings cached in host memory "
                f"({sum(e.nbytes() for e in self.cache.values()) / 2**20:.1f} MiB)")
        else:
            model.move_text_encoders(torch.device("cpu"))
            log(f"text encoders offloaded to host memory: the embeddings of {len(unique)} prompts "
                f"(~{estimate / 2**30:.1f} GiB) exceed model.prompt_cache_gib ({cache_gib:g}), so each epoch's "
                "prompts are encoded on the accelerator as the epoch starts")
        _free_accelerator_cache(model.device)

    def __call__(self, rows: list[PromptRow]) -> PromptEmbeddings:
        if self.cache is not None:
            return PromptEmbeddings.cat([self.cache[r.key] for r in rows]).to(self.model.device)
        if not self.offload:
            return self.encode(rows)
        self.model.move_text_encoders(self.model.device)
        try:
            return self.encode(rows)
        finally:
            self.model.move_text_encoders(torch.device("cpu"))
            _free_accelerator_cache(self.model.device)

    def encode(self, rows: list[PromptRow]) -> PromptEmbeddings:
        """The embeddings of ``rows`` computed now: their prompts, with their input images when they have any."""
        images = None
        if any(r.images for r in rows):
            images = model_input([load_row_images(r.images, describe(r), self.resolution) for r in rows],
                                 self.resolution)
        return self.model.encode_prompts([r.prompt for r in rows], images)

    def _rows(self, rows: list[PromptRow]) -> list[PromptEmbeddings]:
        return [self.model.trim_embedding(row) for row in self.encode(rows).rows()]

    def _encode_all(self, prompts: list[PromptRow], first: list[PromptEmbeddings],
                    log: Callable[[str], None]) -> list[PromptEmbeddings]:
        """Embeddings of every row, ``first`` being those of the first batch."""
        rows = list(first)
        start = last = time.perf_counter()
        for i in range(len(first), len(prompts), ENCODE_BATCH):
            rows += self._rows(prompts[i:i + ENCODE_BATCH])
            now = time.perf_counter()
            if now - last >= PROGRESS_EVERY_S and len(rows) < len(prompts):
                rate = (len(rows) - len(first)) / (now - start)
                log(f"encoding prompts: {len(rows)}/{len(prompts)} ({rate:.0f}/s, ETA "
                    f"{(len(prompts) - len(rows)) / rate:.0f} s)")
                last = now
        return rows


def _free_accelerator_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
