"""FLUX.2 [klein] (4B and 9B, base and distilled): an MMDiT on 2x2-patchified latents of FLUX.2's own VAE,
conditioned on three stacked hidden layers of a Qwen3 text encoder.

The family's conventions, mapped onto the shared sampler:
- Guidance is CFG, uncond + s (cond - uncond) without rescaling (the base models); the pipeline's negative is
  the empty prompt, another ``model.negative_prompt`` reaches its ``__call__`` as embeddings. The distilled
  models ignore the scale: no guidance at all (``is_distilled`` in model_index.json). No model has a guidance
  embedding (``guidance_embeds`` false).
- Every prompt is padded to ``max_sequence_length`` tokens and the transformer sees no text mask, so prompt and
  negative rows have one length and share one batched forward.
- The transformer takes timestep = sigma (the pipeline's t / 1000); the schedule is linspace(1, 1/N, N) under the
  exponential time shift with FLUX.2's empirical mu, which depends on the image tokens and on N.
- Latents live as the pipeline's ``latents`` argument: (4 x VAE channels, H / 16, W / 16), each 2x2 VAE patch
  one channel group; the forward flattens them to tokens row by row, as the pipeline packs them. The VAE's
  batch-norm statistics un-normalise them before decoding.
- Reference images (the pipeline's ``image=``: 0 to ``MAX_REFERENCES`` per prompt, as many as the rows carry) are
  encoded as ``prepare_image_latents`` does: the VAE posterior's mode, patchified 2x2, normalised by the VAE's
  batch-norm statistics and packed row by row, the references' tokens one after another, with position ids
  (10 + 10 i, h, w, 0) for reference i. They follow the noisy tokens in every forward, the CFG negative's too
  (the pipeline's negative pass takes the same image tokens); the velocity is read off the noisy tokens alone, and
  the schedule's mu counts the noisy tokens only.
"""

from __future__ import annotations

import torch

from components.errors import DataError, ModelLoadError
from components.models.base import JOINT_ATTENTION_TARGETS, FlowMatchingModel, PromptEmbeddings, same_images
from components.models.families import GuidanceMode

# Flow-Factory's default klein targets (src/flow_factory/models/flux/flux2_klein.py, commit a0b2bc5a): the joint
# attention, both SwiGLU feed-forwards of the double-stream blocks, and the single-stream blocks' fused QKV + MLP
# input projection
FLUX2_LORA_TARGETS = (*JOINT_ATTENTION_TARGETS, "ff.linear_in", "ff.linear_out", "ff_context.linear_in",
                      "ff_context.linear_out", "attn.to_qkv_mlp_proj")
# Black Forest Labs' limit for klein 4B and 9B (docs.bfl.ml, "Image Editing": reference images per model); the
# pipeline itself sets none, each reference adds as many tokens as the image has
MAX_REFERENCES = 4


class Flux2KleinModel(FlowMatchingModel):
    linear_sigmas = True
    lora_targets = FLUX2_LORA_TARGETS
    default_max_sequence_length = 512  # the pipeline's, which Flow-Factory keeps
    # the reference images the run's rows carry, each prompt as many (``check_input_images`` sets it from the
    # data); 0 is text-to-image
    input_images = 0
    condition_keys = ("image_latents", "image_ids")

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._ids: dict[tuple, torch.Tensor] = {}

    @property
    def guidance_mode(self) -> GuidanceMode:
        return "none" if self.pipeline.config.is_distilled else "cfg"

    def pipeline_call_kwargs(self, guidance_scale: float) -> dict:
        return {"guidance_scale": guidance_scale, "max_sequence_length": self.max_sequence_length}

    def check_input_images(self, count: int, where: str) -> None:
        """Take the rows' references, 0 to ``MAX_REFERENCES`` each and as many in every row of the run (a batch's
        rows share one sequence): from here on ``input_images`` is ``count``."""
        if count > MAX_REFERENCES:
            raise ModelLoadError(f"{where}: the rows carry {count} reference images each, but FLUX.2 klein takes at "
                                 f"most {MAX_REFERENCES}; give every row `images` with 0 to {MAX_REFERENCES} "
                                 "(docs/MODELS.md)")
        if "input_images" in vars(self) and count != self.input_images:  # an earlier check took another count
            raise ModelLoadError(f"{where}: the rows carry {count} reference images each where others carry "
                                 f"{self.input_images}; FLUX.2 klein takes as many with every prompt of a run: give "
                                 "every row the same number of `images`, or train on them apart (docs/MODELS.md)")
        self.input_images = count

    def pipeline_inputs(self, prompts: list[str], guidance_scale: float, images: list[list] | None = None) -> dict:
        inputs = super().pipeline_inputs(prompts, guidance_scale)
        if self.negative_prompt and guidance_scale > 1 and self.guidance_mode == "cfg":
            # the pipeline's own negative is always ""; another comes in as embeddings, one row per prompt
            negative = self.negative_embeddings()
            inputs["negative_prompt_embeds"] = negative.expand_to(len(prompts)).tensors["prompt_embeds"]
        if images and images[0]:
            # the pipeline's ``image=`` is one list of references for the whole batch
            if not all(same_images(row, images[0]) for row in images[1:]):
                raise DataError("Flux2KleinPipeline takes one set of reference images for all the prompts of a "
                                "call; call it once per prompt when their references differ")
            inputs["image"] = list(images[0])
        return inputs

    def shift_mu(self, num_steps: int, resolution: int) -> float:
        from diffusers.pipelines.flux2.pipeline_flux2_klein import compute_empirical_mu

        return compute_empirical_mu(self.image_seq_len(resolution), num_steps)

    @torch.no_grad()
    def encode_prompts(self, prompts: list[str], images: torch.Tensor | None = None) -> PromptEmbeddings:
        embeds, _ = self.pipeline.encode_prompt(prompt=prompts, device=self.device,
                                                max_sequence_length=self.max_sequence_length)
        text = {"prompt_embeds": embeds.to(self.dtype)}
        if images is None or images.shape[1] == 0:  # the text alone: what negative_embeddings keeps
            return PromptEmbeddings(text)
        return PromptEmbeddings({**text, **self.encode_input_images(images)})

    @torch.no_grad()
    def encode_input_images(self, images: torch.Tensor) -> dict[str, torch.Tensor]:
        """(B, N, 3, R, R) in [-1, 1] -> ``image_latents`` (B, N x (R / 16)^2, 4 x VAE channels) in the model
        dtype and their position ids ``image_ids`` (B, N x (R / 16)^2, 4), by the pipeline's own encoding."""
        vae = self.pipeline.vae
        rows = [self.pipeline.prepare_image_latents(images=[image[None] for image in row], batch_size=1,
                                                    generator=None, device=self.device, dtype=vae.dtype)
                for row in images]
        return {"image_latents": torch.cat([tokens for tokens, _ in rows]).to(self.dtype),
                "image_ids": torch.cat([ids for _, ids in rows])}

    def latent_shape(self, resolution: int) -> tuple[int, ...]:
        side = resolution // (self.pipeline.vae_scale_factor * 2)
        return (self.transformer.config.in_channels, side, side)

    def image_seq_len(self, resolution: int) -> int:
        _, h, w = self.latent_shape(resolution)
        return h * w

    def _position_ids(self, kind: str, like: torch.Tensor) -> torch.Tensor:
        """The pipeline's (T, H, W, L) RoPE coordinates of the image grid or the text, one set for the batch."""
        key = (kind, *like.shape[1:-1]) if kind == "text" else (kind, *like.shape[2:])
        if key not in self._ids:
            make = self.pipeline._prepare_latent_ids if kind == "image" else self.pipeline._prepare_text_ids
            self._ids[key] = make(like[:1])[0].to(like.device)
        return self._ids[key]

    def _forward(self, latents: torch.Tensor, sigma: float, embeds: PromptEmbeddings, guidance: float) -> torch.Tensor:
        b, c, h, w = latents.shape
        text = embeds.tensors["prompt_embeds"]
        tokens, ids = latents.flatten(2).transpose(1, 2), self._position_ids("image", latents)
        if "image_latents" in embeds.tensors:  # the references follow the noisy tokens, as the pipeline puts them
            tokens = torch.cat([tokens, embeds.tensors["image_latents"].to(tokens.dtype)], dim=1)
            # the transformer reads one row's ids for the whole batch, as the pipeline's (every row has the same)
            ids = embeds.cached(f"img_ids_{h}x{w}", lambda: torch.cat(
                [ids, embeds.tensors["image_ids"][0].to(ids.device, ids.dtype)]))
        out = self.transformer(
            hidden_states=tokens,
            timestep=torch.full((b,), sigma, device=latents.device, dtype=torch.float32),
            guidance=None, encoder_hidden_states=text,
            txt_ids=self._position_ids("text", text), img_ids=ids,
            return_dict=False,
        )[0]
        return out[:, :h * w].transpose(1, 2).reshape(b, c, h, w)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        vae = self.pipeline.vae
        z = latents.to(vae.dtype)
        mean = vae.bn.running_mean.view(1, -1, 1, 1).to(z.dtype)
        std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(z.dtype)
        image = vae.decode(self.pipeline._unpatchify_latents(z * std + mean), return_dict=False)[0]
        return (image.float() / 2 + 0.5).clamp(0, 1)
