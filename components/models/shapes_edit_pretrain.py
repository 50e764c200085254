"""Pretrain the shapes-kontext editing demo model's transformer from a seed on the shapes edit world.

    python -m components.models.shapes_edit_pretrain      # rebuilds components/models/weights/shapes-kontext.*

Rectified flow on (source, instruction, target) triples: the target's packed latents are noised, the source's enter
as the Kontext condition, and the forward is ``FluxKontextModel._forward`` itself -- the one the sampler, the
log-probs and RL call -- so training and use cannot feed the condition differently. The VAE and text encoders are
shapes-sd3's, frozen: the latents and text embeddings are computed once. Deterministic like shapes_pretrain (the
same seed, steps and threads give bitwise the same weights); the learning rate is constant after a warm-up, and
the committed model is a short run on purpose, one that edits imperfectly and leaves RL room.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from safetensors.torch import save_file

from components import environ
from components.models.base import PromptEmbeddings
from components.models.flux.kontext import FluxKontextModel
from components.models.shapes_kontext import RESOLUTION, WEIGHTS, build_architecture
from components.models.shapes_pretrain import (
    Progress,
    _curve,
    _deterministic,
    _logit_normal,
    _pixels,
    _Printer,
    _Steps,
)
from components.rewards.shapes_edit import edit_scores
from components.shapes.edits import edit_triples

EVAL_SEED = 9000  # held-out triples, apart from the training seed and the built-in set's


@dataclass(frozen=True)
class EditPretrainConfig:
    """The committed model's recipe: small batches, so a run fits the time on 2 busy cores. One thread: with two,
    OpenMP spins while the machine runs other jobs (one forward and backward of 16 took 4-40 s with two threads,
    0.7-1.1 s with one, on the same loaded machine)."""

    seed: int = 0
    triples: int = 2048
    steps: int = 2400
    batch: int = 16
    lr: float = 2e-3
    warmup: int = 100
    # noise levels per batch: _forward takes one per call, so the batch is split into this many forwards
    sigma_groups: int = 1
    eval_triples: int = 64
    eval_steps: int = 10
    threads: int = 1


def adapter(pipe) -> FluxKontextModel:
    return FluxKontextModel(pipe, torch.device("cpu"), torch.float32)


@torch.no_grad()
def encode_triples(model: FluxKontextModel, sources: np.ndarray, instructions: list[str], targets: np.ndarray,
                   batch: int = 256) -> tuple[PromptEmbeddings, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The distinct instructions' text embeddings, each row's index into them, and the packed source and target
    latents."""
    unique = sorted(set(instructions))
    text = model.encode_prompts(unique)
    index = torch.tensor([unique.index(t) for t in instructions])

    def tokens(images: np.ndarray) -> torch.Tensor:
        return torch.cat([model.encode_image(_pixels(images[i:i + batch])) for i in range(0, len(images), batch)])

    return text, index, tokens(sources), tokens(targets)


def train(model: FluxKontextModel, text: PromptEmbeddings, index: torch.Tensor, sources: torch.Tensor,
          targets: torch.Tensor, config: EditPretrainConfig, generator: torch.Generator,
          progress: Progress, snapshot: Callable[[int], None] | None = None) -> list[float]:
    """Rectified flow (x_s = (1 - s) x0 + s noise, target noise - x0) on the transformer alone; ``snapshot(step)``
    after each step, e.g. to keep the weights of shorter runs (the same as theirs: the learning rate is constant)."""
    transformer = model.transformer
    transformer.train().requires_grad_(True)
    params = list(transformer.parameters())
    steps = _Steps(params, config.lr, 1e-4, config.warmup, clip=1.0)
    losses = []
    for step in range(config.steps):
        rows = torch.randint(len(targets), (config.batch,), generator=generator)
        noise = torch.randn(targets[rows].shape, generator=generator)
        sigmas = _logit_normal(config.sigma_groups, generator).tolist()
        loss = torch.zeros(())
        for part, sigma in zip(torch.arange(config.batch).chunk(config.sigma_groups), sigmas, strict=True):
            x0, eps = targets[rows[part]], noise[part]
            embeds = PromptEmbeddings({**text.select(index[rows[part]]).tensors, "image_latents": sources[rows[part]]})
            velocity = model._forward((1 - sigma) * x0 + sigma * eps, sigma, embeds, 1.0)
            loss = loss + (velocity - (eps - x0)).pow(2).mean() / config.sigma_groups
        losses.append(steps.take(loss))
        progress("flow", step + 1, config.steps, losses[-1])
        if snapshot is not None:
            snapshot(step + 1)
    transformer.eval().requires_grad_(False)
    return losses


@torch.no_grad()
def evaluate(pipe, config: EditPretrainConfig, seed: int = EVAL_SEED) -> dict[str, float]:
    """The mean shapes_edit scores (edit, keep, partial = edit x keep, strict) of the pipeline's own ``__call__`` on
    held-out triples, unguided, ``eval_steps`` steps, one fixed noise."""
    sources, instructions, _, metadata = edit_triples(config.eval_triples, seed)
    model = adapter(pipe)
    pipe.set_progress_bar_config(disable=True)
    kwargs = model.pipeline_inputs(instructions, 1.0, [[Image.fromarray(s)] for s in sources])
    images = pipe(**kwargs, height=RESOLUTION, width=RESOLUTION, num_inference_steps=config.eval_steps,
                  generator=torch.Generator().manual_seed(seed), output_type="np").images
    pixels = (np.clip(images, 0, 1) * 255).round().astype(np.uint8)
    scores = np.array([edit_scores(image, meta["scene"], text)
                       for image, text, meta in zip(pixels, instructions, metadata, strict=True)])
    edit, keep, strict = scores.T
    return {"edit": round(float(edit.mean()), 4), "keep": round(float(keep.mean()), 4),
            "partial": round(float((edit * keep).mean()), 4), "strict": round(float(strict.mean()), 4)}


def pretrain(config: EditPretrainConfig, progress: Progress, snapshot_every: int = 0,
             snapshot_dir: Path | None = None) -> tuple[object, dict]:
    """The trained pipeline and a log (config, loss curve every 50 steps, seconds per phase, held-out scores); with
    ``snapshot_every``, the transformer's weights every that many steps in ``snapshot_dir`` (to choose the steps)."""
    with _deterministic(config.threads):
        generator = torch.Generator().manual_seed(config.seed)
        started = time.perf_counter()
        sources, instructions, targets, _ = edit_triples(config.triples, config.seed)
        pipe = build_architecture(config.seed)
        model = adapter(pipe)
        text, index, source_tokens, target_tokens = encode_triples(model, sources, instructions, targets)
        encoded = time.perf_counter()

        def snapshot(step: int) -> None:
            if snapshot_every and step % snapshot_every == 0:
                save_file(_weights(pipe), str(snapshot_dir / f"step{step}.safetensors"))

        losses = train(model, text, index, source_tokens, target_tokens, config, generator, progress, snapshot)
        trained = time.perf_counter()
        scores = evaluate(pipe, config)
    log = {
        "config": asdict(config),
        "torch": torch.__version__,
        "seconds": {"draw_encode": round(encoded - started, 1), "flow": round(trained - encoded, 1),
                    "eval": round(time.perf_counter() - trained, 1)},
        "flow_loss": _curve(losses),
        "held_out": scores,
    }
    return pipe, log


def _weights(pipe) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone().contiguous() for k, v in pipe.transformer.state_dict().items()}


def save(pipe, log: dict, weights: Path) -> None:
    weights.parent.mkdir(parents=True, exist_ok=True)
    save_file(_weights(pipe), str(weights), metadata={"pretrain": json.dumps(log["config"])})
    weights.with_suffix(".json").write_text(json.dumps(log, indent=1) + "\n")


def main(argv: list[str] | None = None) -> int:
    environ.apply_settings()
    defaults = EditPretrainConfig()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=WEIGHTS, help=f"weights file (default: {WEIGHTS})")
    for field, value in asdict(defaults).items():
        parser.add_argument(f"--{field.replace('_', '-')}", type=type(value), default=value)
    parser.add_argument("--snapshot-every", type=int, default=0, help="also keep the weights every N steps, as "
                        "step<N>.safetensors beside --out (to choose the steps)")
    args = vars(parser.parse_args(argv))
    out, every = args.pop("out"), args.pop("snapshot_every")
    out.parent.mkdir(parents=True, exist_ok=True)
    pipe, log = pretrain(EditPretrainConfig(**args), _Printer(), every, out.parent)
    save(pipe, log, out)
    print(f"wrote {out} and {out.with_suffix('.json')} in {sum(log['seconds'].values()):.0f} s; held-out "
          f"{log['held_out']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
