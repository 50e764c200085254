"""Z-Image (base and Turbo): a single-stream DiT over image and caption tokens, conditioned on a Qwen3 chat-template
encoding, FLUX.1's 16-channel VAE.

The family's conventions, mapped onto the shared sampler (velocity = d x / d sigma, noise at sigma 1):
- The transformer takes lists, one (C, 1, H, W) latent and one caption of its own length per image, and pads
  them itself; the embeddings keep a row per prompt, right-padded, with a mask that gives each caption's length.
- It is conditioned on t = (1000 - 1000 sigma) / 1000 (1 at the clean image) and predicts the negated velocity.
- The pipeline guides as pos + s (pos - neg); that is CFG at scale s + 1, so ``sampling.guidance_scale`` w is the
  pipeline's ``guidance_scale`` w - 1 (Turbo samples with the pipeline's 0: w = 1, no negative pass).
  ``cfg_normalization`` and ``cfg_truncation`` stay at the pipeline's defaults (off), as Flow-Factory trains.
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_z_image import SEQ_MULTI_OF

from components.models.base import FlowMatchingModel, PromptEmbeddings

# Flow-Factory's default Z-Image LoRA targets: the attention and SwiGLU feed-forward of every block
ZIMAGE_LORA_TARGETS = ("attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0",
                       "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")


class ZImageModel(FlowMatchingModel):
    linear_sigmas = True  # the pipeline's default sigmas, linspace(1, 1/N, N), shifted by the scheduler
    lora_targets = ZIMAGE_LORA_TARGETS
    default_max_sequence_length = 512  # the pipeline's, which Flow-Factory keeps

    def pipeline_call_kwargs(self, guidance_scale: float) -> dict:
        return {"guidance_scale": guidance_scale - 1.0, "cfg_normalization": False, "cfg_truncation": 1.0,
                "max_sequence_length": self.max_sequence_length}

    def pipeline_inputs(self, prompts: list[str], guidance_scale: float, images: list[list] | None = None) -> dict:
        # copies: the pipeline writes the chat-templated text into the prompt lists it is given, and takes one
        # negative prompt per prompt (no shorter list)
        return {**super().pipeline_inputs(list(prompts), guidance_scale, images),
                "negative_prompt": [self.negative_prompt] * len(prompts)}

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], images: torch.Tensor | None = None) -> PromptEmbeddings:
        # a copy: the pipeline writes the chat-templated text into the list it is given
        embeds = self.pipeline.encode_prompt(prompt=list(prompts), device=self.device,
                                             do_classifier_free_guidance=False,
                                             max_sequence_length=self.max_sequence_length)[0]
        lengths = torch.tensor([len(e) for e in embeds], device=self.device)
        mask = (torch.arange(int(lengths.max()), device=self.device) < lengths[:, None]).long()
        padded = torch.nn.utils.rnn.pad_sequence(embeds, batch_first=True)
        return PromptEmbeddings({"prompt_embeds": padded.to(self.dtype), "prompt_embeds_mask": mask})

    def trim_embedding(self, row: PromptEmbeddings) -> PromptEmbeddings:
        length = int(row.tensors["prompt_embeds_mask"].sum())
        return PromptEmbeddings({k: v[:, :length] for k, v in row.tensors.items()})

    def latent_shape(self, resolution: int) -> tuple[int, ...]:
        side = 2 * (resolution // (self.pipeline.vae_scale_factor * 2))
        return (self.transformer.config.in_channels, side, side)

    def image_seq_len(self, resolution: int) -> int:
        return (self.latent_shape(resolution)[1] // 2) ** 2

    def combine_cfg(self, uncond: torch.Tensor, cond: torch.Tensor, scale: float) -> torch.Tensor:
        # the pipeline's arithmetic (its scale is ours - 1): the same float32 rounding as its __call__
        return cond + (scale - 1.0) * (cond - uncond)

    def _forward(self, latents: torch.Tensor, sigma: float, embeds: PromptEmbeddings, guidance: float) -> torch.Tensor:
        text = embeds.tensors["prompt_embeds"]
        lengths, groups = embeds.cached("groups", lambda: _caption_groups(embeds.tensors["prompt_embeds_mask"]))
        timestep = torch.full((latents.shape[0],), sigma * self.pipeline.scheduler.config.num_train_timesteps,
                              device=latents.device, dtype=torch.float32)
        t = (1000 - timestep) / 1000  # as the pipeline computes it
        out: dict[int, torch.Tensor] = {}
        for rows in groups:
            pred = self.transformer(x=[latents[i].unsqueeze(1) for i in rows], t=t[:len(rows)],
                                    cap_feats=[text[i, :lengths[i]] for i in rows], return_dict=False)[0]
            out.update(zip(rows, pred, strict=True))
        return -torch.stack([out[i] for i in range(latents.shape[0])]).squeeze(2)


def _caption_groups(mask: torch.Tensor) -> tuple[list[int], list[list[int]]]:
    """(caption lengths, rows grouped by the length the transformer pads their captions to).

    Rows of one group make sequences of one length, which the transformer batches without an attention mask.
    Rows of different groups would be padded to a common length under a mask, and a row's velocity would then
    depend (at float rounding) on the batch it is in: a sample re-scored in another micro-batch than it was
    sampled in would not give ratio exactly 1.
    """
    lengths = mask.sum(1).tolist()
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        groups.setdefault(-(-n // SEQ_MULTI_OF), []).append(i)
    return lengths, [groups[k] for k in sorted(groups)]
