"""Pretrain the shapes-sd3 demo model from a seed: drawn scenes -> a VAE -> a flow-matching transformer.

    python -m components.models.shapes_pretrain            # rebuilds components/models/weights/shapes-sd3.*

Deterministic: the same seed, step counts and thread count give bitwise the same weights (CPU, float32).
The learning rates are constant after a warm-up, so the weights after k steps do not depend on the total:
the committed model is a short run on purpose, one that follows prompts imperfectly and leaves RL room.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from diffusers import StableDiffusion3Pipeline
from safetensors.torch import save_file

from components import environ
from components.models.shapes_sd3 import RESOLUTION, TEXT_LENGTH, WEIGHTS, build_architecture, state_dict
from components.shapes.scenes import draw_scene, prompt_text, random_groups


@dataclass(frozen=True)
class PretrainConfig:
    seed: int = 0
    scenes: int = 8192
    vae_steps: int = 800
    vae_batch: int = 32
    vae_lr: float = 2e-3
    vae_kl_weight: float = 1e-6
    flow_steps: int = 4000
    flow_batch: int = 64
    flow_lr: float = 2e-3
    warmup: int = 100
    threads: int = 2


def draw_dataset(n: int, seed: int) -> tuple[np.ndarray, list[str]]:
    """``n`` random scenes (uint8, N x H x W x 3) and their prompts."""
    rng = np.random.default_rng(seed)
    images, prompts = [], []
    for _ in range(n):
        groups = random_groups(rng)
        images.append(draw_scene(groups, rng, RESOLUTION))
        prompts.append(prompt_text(groups))
    return np.stack(images), prompts


def _pixels(images: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(images).permute(0, 3, 1, 2).float() / 127.5 - 1.0


def _warmup(step: int, warmup: int) -> float:
    return min(1.0, (step + 1) / warmup)


Progress = Callable[[str, int, int, float], None]


class _Steps:
    """AdamW with a linear warm-up; ``take(loss)`` backpropagates ``loss``, steps, and returns it as a float."""

    def __init__(self, params: list[torch.nn.Parameter], lr: float, weight_decay: float, warmup: int,
                 clip: float | None = None) -> None:
        self.params, self.clip = params, clip
        self.optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
        self.schedule = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: _warmup(s, warmup))

    def take(self, loss: torch.Tensor) -> float:
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if self.clip is not None:
            torch.nn.utils.clip_grad_norm_(self.params, self.clip)
        self.optimizer.step()
        self.schedule.step()
        return loss.item()


def train_vae(vae, pixels: torch.Tensor, config: PretrainConfig, generator: torch.Generator,
              progress: Progress) -> list[float]:
    """Reconstruction (MSE) plus a small KL term, on posterior samples so the decoder tolerates latent noise."""
    vae.train().requires_grad_(True)
    steps = _Steps(list(vae.parameters()), config.vae_lr, 0.0, config.warmup)
    losses = []
    for step in range(config.vae_steps):
        batch = pixels[torch.randint(len(pixels), (config.vae_batch,), generator=generator)]
        posterior = vae.encode(batch).latent_dist
        latents = posterior.mean + posterior.std * torch.randn(posterior.mean.shape, generator=generator)
        loss = (vae.decode(latents).sample - batch).pow(2).mean() + config.vae_kl_weight * posterior.kl().mean()
        losses.append(steps.take(loss))
        progress("vae", step + 1, config.vae_steps, losses[-1])
    vae.eval().requires_grad_(False)
    return losses


@torch.no_grad()
def encode_latents(vae, pixels: torch.Tensor, batch: int = 256) -> torch.Tensor:
    """Posterior means, normalised to zero mean and unit variance; the VAE's config records the scaling."""
    means = torch.cat([vae.encode(pixels[i:i + batch]).latent_dist.mean for i in range(0, len(pixels), batch)])
    shift, scale = means.mean().item(), 1.0 / means.std().item()
    vae.register_to_config(shift_factor=shift, scaling_factor=scale)
    return (means - shift) * scale


def _logit_normal(n: int, generator: torch.Generator) -> torch.Tensor:
    # SD3's training distribution of the noise level: most weight on the middle of the path
    return torch.sigmoid(torch.randn(n, generator=generator))


def train_flow(pipe, latents: torch.Tensor, prompts: list[str], config: PretrainConfig, generator: torch.Generator,
               progress: Progress) -> list[float]:
    """Rectified flow (x_s = (1 - s) x0 + s noise, target noise - x0), text encoders trained along."""
    modules = [pipe.transformer, pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3]
    for module in modules:
        module.train().requires_grad_(True)
    params = [p for module in modules for p in module.parameters()]
    steps = _Steps(params, config.flow_lr, 1e-4, config.warmup, clip=1.0)
    losses = []
    for step in range(config.flow_steps):
        index = torch.randint(len(latents), (config.flow_batch,), generator=generator)
        text = [prompts[i] for i in index.tolist()]
        x0 = latents[index]
        noise = torch.randn(x0.shape, generator=generator)
        sigma = _logit_normal(len(x0), generator)
        noisy = (1 - sigma[:, None, None, None]) * x0 + sigma[:, None, None, None] * noise
        embeds, _, pooled, _ = pipe.encode_prompt(text, text, text, do_classifier_free_guidance=False,
                                                  max_sequence_length=TEXT_LENGTH)
        velocity = pipe.transformer(hidden_states=noisy, timestep=sigma * 1000, encoder_hidden_states=embeds,
                                    pooled_projections=pooled).sample
        loss = (velocity - (noise - x0)).pow(2).mean()
        losses.append(steps.take(loss))
        progress("flow", step + 1, config.flow_steps, losses[-1])
    for module in modules:
        module.eval().requires_grad_(False)
    return losses


@contextmanager
def _deterministic(threads: int) -> Iterator[None]:
    """Fixed threads and deterministic kernels for the run, the caller's settings restored after it."""
    saved = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.set_num_threads(saved[0])
        torch.use_deterministic_algorithms(saved[1])


def pretrain(config: PretrainConfig, progress: Progress) -> tuple[StableDiffusion3Pipeline, dict]:
    """The trained pipeline and a log (config, loss curves every 50 steps, seconds per phase)."""
    with _deterministic(config.threads):
        generator = torch.Generator().manual_seed(config.seed)
        started = time.perf_counter()
        images, prompts = draw_dataset(config.scenes, config.seed)
        pixels = _pixels(images)
        pipe = build_architecture(config.seed)
        drawn = time.perf_counter()
        vae_losses = train_vae(pipe.vae, pixels, config, generator, progress)
        latents = encode_latents(pipe.vae, pixels)
        vae_done = time.perf_counter()
        flow_losses = train_flow(pipe, latents, prompts, config, generator, progress)
    log = {
        "config": asdict(config),
        "torch": torch.__version__,
        "seconds": {"draw": round(drawn - started, 1), "vae": round(vae_done - drawn, 1),
                    "flow": round(time.perf_counter() - vae_done, 1)},
        "vae_loss": _curve(vae_losses),
        "flow_loss": _curve(flow_losses),
    }
    return pipe, log


def _curve(losses: list[float], every: int = 50) -> list[list[float]]:
    """[step, mean loss over the last ``every`` steps] pairs."""
    return [[i + every, round(float(np.mean(losses[i:i + every])), 5)] for i in range(0, len(losses), every)]


def save(pipe, log: dict, weights: Path) -> None:
    weights.parent.mkdir(parents=True, exist_ok=True)
    save_file(state_dict(pipe), str(weights), metadata={"pretrain": json.dumps(log["config"])})
    weights.with_suffix(".json").write_text(json.dumps(log, indent=1) + "\n")


class _Printer:
    """One line per phase every few seconds: step, loss, rate and ETA."""

    def __init__(self, every_s: float = 10.0) -> None:
        self.every_s, self.last, self.phase_start, self.phase = every_s, 0.0, 0.0, ""

    def __call__(self, phase: str, step: int, total: int, loss: float) -> None:
        now = time.perf_counter()
        if phase != self.phase:
            self.phase, self.phase_start, self.last = phase, now, now
        if now - self.last >= self.every_s or step == total:
            self.last = now
            rate = step / max(now - self.phase_start, 1e-9)
            eta = (total - step) / rate
            print(f"{phase} {step}/{total} loss {loss:.4f} ({rate:.1f} steps/s, eta {math.ceil(eta)} s)",
                  flush=True)


def main(argv: list[str] | None = None) -> int:
    environ.apply_settings()
    defaults = PretrainConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=WEIGHTS, help=f"weights file (default: {WEIGHTS})")
    for field, value in asdict(defaults).items():
        parser.add_argument(f"--{field.replace('_', '-')}", type=type(value), default=value)
    args = vars(parser.parse_args(argv))
    out = args.pop("out")
    pipe, log = pretrain(PretrainConfig(**args), _Printer())
    save(pipe, log, out)
    print(f"wrote {out} and {out.with_suffix('.json')} in {sum(log['seconds'].values()):.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
