"""Epoch time and parallel efficiency of the shipped GPU recipes on 1 to 64 GPUs: an alpha-beta model.

    python tests/benchmarks/scaling_model.py [--recipes sd35-medium-ocr,qwenimage-ocr] [--workers 1,2,4,8,16]
        [--set key=value ...]   # overrides applied to every recipe, e.g. --set sampling.prompts_per_epoch=192

Each of N workers does 1/N of the epoch (sampling, scoring and training are sharded by prompt group), at the
per-image speed measured on one H100 for the SD3.5-Medium recipe (docs/PERFORMANCE.md), scaled to other recipes by
the transformer FLOPs of their work. Then, with nothing overlapped: one ring all-reduce of the float32 LoRA
gradients per optimizer step, a few latency-bound collectives per epoch and, with ``train.sharding: fsdp``, an
all-gather of the bf16 transformer weights for every transformer call and backward (also shown with every gather
hidden under compute, the best FSDP2's prefetching could do). FLOPs and parameter counts come from the product's
own adapters on the real-shape pipelines (``real_shapes``) over fake tensors (``memory_estimate``): no weights, no
GPU, about half a minute on a CPU. docs/SCALING.md explains the model.

``predict_epoch_s`` is the same model for a measured one-worker epoch (the CPU multi-host check).
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from dataclasses import dataclass
from functools import cache
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # memory_estimate, real_shapes (tests/ is no package)

from components.flow_rl.rollout import plan_steps
from components.trainer.config import TrainingJobConfig, epoch_split_problems
from pipeline.config import CONFIG_DIR, load_config

WORKERS = (1, 2, 4, 8, 16, 32, 64)
GPUS_PER_NODE = 8
# The shipped GPU recipes and the real-shape family (real_shapes.FAMILIES) each trains
RECIPES = {"sd35-medium-ocr": "sd35-medium", "sd35-medium-nft-ocr": "sd35-medium", "sd35-large-ocr": "sd35-large",
           "flux1-dev-pickscore": "flux1-dev", "qwenimage-ocr": "qwen-image", "flux2-klein-pickscore": "flux2-klein",
           "zimage-pickscore": "z-image", "wan21-t2v-1.3b-pickscore": "wan21-1.3b"}
REFERENCE_RECIPE = "sd35-medium-ocr"
# docs/PERFORMANCE.md, one H100 80 GB on REFERENCE_RECIPE's per-worker work: (sampling, training) images/s by
# train.compile. The only measured figures; every other recipe is scaled from them.
MEASURED_IMAGES_PER_S: dict[bool, tuple[float, float]] = {True: (8.33, 3.11), False: (4.61, 1.69)}
FLOAT32_BYTES = 4  # the LoRA and its gradients stay float32 (docs/PERFORMANCE.md)
# Per epoch: the reward outputs' all_gather_object (two all-gathers: sizes, then the pickled bytes) and the metrics'
# float64 all-reduce. A few KB each, so only their ring steps count: 2 x (N - 1) + 2 (N - 1) latencies.
EPOCH_COLLECTIVE_STEPS_PER_PEER = 4
EFFICIENCY_TARGET = 0.9


@dataclass(frozen=True)
class Link:
    """The slowest link a ring crosses: usable bandwidth per direction (bytes/s) and latency per message (s)."""

    name: str
    bandwidth: float
    latency: float


# H100 SXM: 18 NVLink 4 links, 900 GB/s both ways = 450 GB/s each way (NVIDIA's H100 datasheet), taken as the ring's
# bus bandwidth (nccl-tests' busbw): an upper bound, a p2p copy reaches ~380 GB/s (NVIDIA/nccl issue 1264)
NVLINK = Link("NVLink", 450e9, 10e-6)
# Between nodes, one NIC per node at line rate (a ring enters and leaves each node once)
NET_100G = Link("100 Gb/s", 100e9 / 8, 50e-6)  # 100 GbE (TCP or RoCE)
NET_400G = Link("400 Gb/s", 400e9 / 8, 20e-6)  # NDR InfiniBand or 400 GbE RoCE
BETWEEN_NODES = (NET_100G, NET_400G)


def ring_link(workers: int, between_nodes: Link | None) -> Link | None:
    """The link that paces a ring of ``workers`` GPUs packed GPUS_PER_NODE to a node: NVLink inside one node, else
    the link between nodes (each ring step waits for its slowest hop); None beyond one node without one."""
    return NVLINK if workers <= GPUS_PER_NODE else between_nodes


# --- closed forms -------------------------------------------------------------------------------------------

def ring_all_reduce_s(nbytes: float, workers: int, bandwidth: float, latency: float) -> float:
    """A ring all-reduce of ``nbytes`` per worker: reduce-scatter then all-gather, 2 (N - 1) steps of nbytes / N."""
    if workers == 1:
        return 0.0
    return 2 * (workers - 1) / workers * nbytes / bandwidth + 2 * (workers - 1) * latency


def ring_all_gather_s(nbytes: float, workers: int, bandwidth: float, latency: float) -> float:
    """A ring all-gather of a tensor of ``nbytes`` in all, 1 / N of it on each worker: N - 1 steps of nbytes / N."""
    if workers == 1:
        return 0.0
    return (workers - 1) / workers * nbytes / bandwidth + (workers - 1) * latency


def epoch_collectives_s(workers: int, latency: float) -> float:
    """The per-epoch small collectives (reward outputs, metrics): latency only."""
    return EPOCH_COLLECTIVE_STEPS_PER_PEER * (workers - 1) * latency


def predict_epoch_s(sampling_s: float, training_s: float, other_s: float, workers: int, grad_bytes: float,
                    optimizer_steps: int, bandwidth_bytes_per_s: float, latency_s: float,
                    fsdp_bytes_per_step: float = 0.0, fsdp_gathers_per_step: float = 0.0) -> float:
    """Seconds of one epoch on ``workers`` workers, from a steady-state epoch measured on one worker.

    - ``sampling_s``, ``training_s``, ``other_s`` (scoring, anything else split by prompt group): the one-worker
      epoch's parts; each worker does 1 / ``workers`` of them at the same speed.
    - ``grad_bytes``: the flat float32 LoRA gradient buffer (4 x LoRA parameters), all-reduced once per optimizer
      step; ``optimizer_steps``: optimizer steps per epoch *at* ``workers`` workers (samples per step =
      batch x accumulation x workers, so they fall as workers rise).
    - ``bandwidth_bytes_per_s``, ``latency_s``: the ring's slowest link.
    - ``fsdp_bytes_per_step``, ``fsdp_gathers_per_step``: with ``train.sharding: fsdp``, the bf16 weight bytes each
      worker gathers per optimizer step (whole, before the (N - 1) / N share: weights x transformer calls and
      backwards per step), and the all-gathers they take (one per block and call).

    Nothing overlaps: the trainer all-reduces after the last micro-batch's backward. FSDP2 may prefetch a block's
    gather under the previous block's compute, so the FSDP term is the bound without that.
    """
    compute = (sampling_s + training_s + other_s) / workers
    # the step's gathers as one volume; each of them pays its own ring latencies
    fsdp = (ring_all_gather_s(fsdp_bytes_per_step, workers, bandwidth_bytes_per_s, 0.0)
            + fsdp_gathers_per_step * (workers - 1) * latency_s)
    per_step = ring_all_reduce_s(grad_bytes, workers, bandwidth_bytes_per_s, latency_s) + fsdp
    return compute + optimizer_steps * per_step + epoch_collectives_s(workers, latency_s)


# --- the work of an epoch -----------------------------------------------------------------------------------

class UnsplittableEpoch(ValueError):
    """``workers`` workers cannot split the epoch; ``problems`` are the trainer's own reasons."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = tuple(problems)


@dataclass(frozen=True)
class EpochSplit:
    """One worker's share of an epoch, as ``describe_batches`` prints it (per worker, except optimizer steps)."""

    workers: int
    images: int
    sampling_batches: int
    micro_batches: int  # in one inner epoch
    optimizer_steps: int  # per epoch, taken by all workers together (inner epochs included)


def split_epoch(config: TrainingJobConfig, workers: int) -> EpochSplit:
    """The split the trainer makes; raises ``UnsplittableEpoch`` where it refuses to start."""
    if problems := epoch_split_problems(config, workers):
        raise UnsplittableEpoch(problems)
    s, t = config.sampling, config.train
    images = s.prompts_per_epoch * s.group_size // workers
    micro = images // t.batch_size_per_worker
    return EpochSplit(workers, images, images // s.batch_size_per_worker, micro,
                      micro // t.gradient_accumulation_steps * t.inner_epochs)


@dataclass(frozen=True)
class Shape:
    """A recipe's transformer at real shape, as far as the model needs it."""

    forward_flops: float  # one forward of one image's row, attention included
    lora_params: int
    weight_bytes: int  # frozen transformer weights (bf16): what FSDP gathers for every call
    fsdp_units: int  # all-gathers per call: each repeated block, and the transformer's own parameters
    cfg: bool  # guides by classifier-free guidance (a negative row per image), not embedded or no guidance
    batched_cfg: bool  # both CFG rows in one transformer call (Qwen-Image: two calls)
    transformer_params: int = 0


@dataclass(frozen=True)
class Pass:
    """Transformer work in one step of one batch: rows per image, transformer calls, and whether a backward follows
    (twice the forward's FLOPs, and FSDP gathers the weights again)."""

    rows: int
    calls: int
    backward: bool = False


def _velocity(shape: Shape, guided: bool, backward: bool, uncond_grad: bool = True) -> list[Pass]:
    """One ``predict_velocity`` (components/models/base.py): one row, or CFG's two in one or two calls; with a
    backward and no ``uncond_grad`` the negative row runs apart without one."""
    if not (guided and shape.cfg):
        return [Pass(1, 1, backward)]
    if backward and not uncond_grad:
        return [Pass(1, 1, True), Pass(1, 1, False)]
    return [Pass(2, 1 if shape.batched_cfg else 2, backward)]


def sampling_passes(config: TrainingJobConfig, shape: Shape) -> list[Pass]:
    """The transformer work of one sampling step."""
    return _velocity(shape, config.sampling.guidance_scale > 1, backward=False)


def training_passes(config: TrainingJobConfig, shape: Shape) -> list[Pass]:
    """The transformer work of one trained timestep of a micro-batch (algorithms/flow_grpo.py, diffusion_nft.py):
    FlowGRPO's graph forward and the KL reference with beta > 0; DiffusionNFT's old-policy forward, the reference
    with a KL weight, the graph forward."""
    t = config.train
    reference = _velocity(shape, t.train_cfg, backward=False) if t.beta > 0 else []
    trained = _velocity(shape, t.train_cfg, backward=True, uncond_grad=t.cfg_uncond_grad)
    if t.algorithm == "diffusion_nft":
        return _velocity(shape, t.train_cfg, backward=False) + reference + trained
    return trained + reference


def trained_steps(config: TrainingJobConfig) -> int:
    """Timesteps trained per micro-batch: FlowGRPO's train steps (all but the last fraction, or the SDE window),
    DiffusionNFT's noise levels."""
    s, t = config.sampling, config.train
    if t.algorithm == "diffusion_nft":
        return min(max(1, int(s.num_steps * t.timestep_fraction)), s.num_steps)
    window = None if s.sde_window is None else (s.sde_window.range[0], s.sde_window.size)
    return len(plan_steps(s.num_steps, t.timestep_fraction, window)[1])


def sampling_rows_per_image(config: TrainingJobConfig, shape: Shape) -> int:
    """Transformer forwards of one row an image costs in sampling."""
    return config.sampling.num_steps * sum(p.rows for p in sampling_passes(config, shape))


def training_rows_per_image(config: TrainingJobConfig, shape: Shape) -> int:
    """Transformer forwards of one row an image costs in training: a backward is two, activation checkpointing
    recomputes the forward once more."""
    t = config.train
    backward = 2 + int(t.gradient_checkpointing)
    per_step = sum(p.rows * (1 + backward * p.backward) for p in training_passes(config, shape))
    return trained_steps(config) * t.inner_epochs * per_step


def transformer_calls(config: TrainingJobConfig, shape: Shape, split: EpochSplit) -> int:
    """Transformer calls and backwards of one worker in an epoch: the all-gathers FSDP makes of the whole weights.
    A checkpointed block's recomputation is taken to reuse its backward's gather."""
    sampling_step = sum(p.calls for p in sampling_passes(config, shape))
    training_step = sum(p.calls * (1 + p.backward) for p in training_passes(config, shape))
    return (split.sampling_batches * config.sampling.num_steps * sampling_step
            + split.micro_batches * config.train.inner_epochs * trained_steps(config) * training_step)


# --- compute time, calibrated on the one measurement ------------------------------------------------------------

@dataclass(frozen=True)
class Calibration:
    """FLOP/s of one H100 in sampling and in training, by ``train.compile``: the reference recipe's measured
    images/s times its FLOPs per image."""

    sampling: dict[bool, float]
    training: dict[bool, float]


def calibrate(reference: TrainingJobConfig, shape: Shape) -> Calibration:
    """The calibration from ``MEASURED_IMAGES_PER_S`` on ``reference`` (the SD3.5-Medium recipe) at ``shape``."""
    sampling = shape.forward_flops * sampling_rows_per_image(reference, shape)
    training = shape.forward_flops * training_rows_per_image(reference, shape)
    return Calibration({c: sampling * ips[0] for c, ips in MEASURED_IMAGES_PER_S.items()},
                       {c: training * ips[1] for c, ips in MEASURED_IMAGES_PER_S.items()})


def one_worker_epoch(config: TrainingJobConfig, shape: Shape, calibration: Calibration) -> tuple[float, float]:
    """(sampling s, training s) of the whole epoch on one H100: FLOPs over the calibrated FLOP/s. Scoring is taken
    to overlap sampling (the trainer scores in the background), so it adds nothing."""
    images = config.sampling.prompts_per_epoch * config.sampling.group_size
    compiled = config.train.compile
    return (images * shape.forward_flops * sampling_rows_per_image(config, shape) / calibration.sampling[compiled],
            images * shape.forward_flops * training_rows_per_image(config, shape) / calibration.training[compiled])


@dataclass(frozen=True)
class Prediction:
    """One recipe on ``workers`` GPUs over one link; no times where the epoch cannot split or there is no link."""

    workers: int
    link: str
    problems: tuple[str, ...] = ()
    split: EpochSplit | None = None
    compute_s: float = 0.0
    all_reduce_s: float = 0.0  # the LoRA gradients' and the per-epoch collectives, per epoch
    fsdp_s: float = 0.0  # the weights' all-gathers per epoch (fsdp only)
    epoch_s: float | None = None
    efficiency: float | None = None  # one-GPU epoch / (workers x this epoch)

    @property
    def hidden_gathers_efficiency(self) -> float | None:
        """The efficiency had every FSDP gather run under compute (FSDP2's prefetch at its best): a bound."""
        if self.epoch_s is None:
            return None
        return self.compute_s / (max(self.compute_s, self.fsdp_s) + self.all_reduce_s)


def predict(config: TrainingJobConfig, shape: Shape, calibration: Calibration, workers: int,
            between_nodes: Link | None, fsdp: bool = False) -> Prediction:
    """The epoch of ``config`` on ``workers`` GPUs, packed GPUS_PER_NODE to a node joined by ``between_nodes``
    (None: one NVLink node only), with ``train.sharding: fsdp`` when ``fsdp``."""
    link = ring_link(workers, between_nodes)
    if link is None:
        return Prediction(workers, "-", (f"NVLink joins at most {GPUS_PER_NODE} GPUs",))
    try:
        split = split_epoch(config, workers)
    except UnsplittableEpoch as exc:
        return Prediction(workers, link.name, exc.problems)
    sampling_s, training_s = one_worker_epoch(config, shape, calibration)
    grad_bytes = FLOAT32_BYTES * shape.lora_params
    fsdp_bytes = fsdp_gathers = 0.0
    if fsdp:
        calls_per_step = transformer_calls(config, shape, split) / split.optimizer_steps
        fsdp_bytes, fsdp_gathers = calls_per_step * shape.weight_bytes, calls_per_step * shape.fsdp_units
    epoch = predict_epoch_s(sampling_s, training_s, 0.0, workers, grad_bytes, split.optimizer_steps, link.bandwidth,
                            link.latency, fsdp_bytes, fsdp_gathers)
    compute = (sampling_s + training_s) / workers
    all_reduce = (split.optimizer_steps * ring_all_reduce_s(grad_bytes, workers, link.bandwidth, link.latency)
                  + epoch_collectives_s(workers, link.latency))
    return Prediction(workers, link.name, (), split, compute, all_reduce, epoch - compute - all_reduce if fsdp else 0.0,
                      epoch, (sampling_s + training_s) / (workers * epoch))


# --- the real shapes (CLI) ----------------------------------------------------------------------------------

def real_shape(config: TrainingJobConfig, family: str) -> Shape:
    """The recipe's transformer at real shape with its LoRA: the product's adapter on ``real_shapes``' pipeline over
    fake tensors (``memory_estimate.fake_model``); one row's forward counted by ``FlopCounterMode``, with the text
    lengths of ``memory_estimate.FAMILIES`` (the shipped recipes')."""
    lora = config.model.lora
    return _real_shape(family, lora.rank, lora.alpha, tuple(lora.target_modules), config.model.num_frames,
                       config.model.resolution)


@cache
def _real_shape(family: str, rank: int, alpha: float, targets: tuple[str, ...], num_frames: int,
                resolution: int) -> Shape:
    import memory_estimate
    import real_shapes
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    model = memory_estimate.fake_model(family, memory_estimate.LoRA(rank, alpha, targets), mode,
                                       num_frames=num_frames)
    cond = memory_estimate.fake_embeds(model, mode, 1, memory_estimate.FAMILIES[family].text_tokens)
    with mode:
        latents = torch.empty((1, *model.latent_shape(resolution)))

    # fake CPU tensors take the CPU flash-attention kernel, which FlopCounterMode has no formula for
    def attention(query, key, value, *args, out_shape=None, **kwargs) -> int:
        return sdpa_flop_count(query, key, value)

    counter = FlopCounterMode(display=False, custom_mapping={
        torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: attention})
    with torch.no_grad(), counter:
        model.predict_velocity(latents, 0.7, cond, 1.0)
    weights = memory_estimate.weight_bytes(model)
    return Shape(forward_flops=float(counter.get_total_flops()),
                 lora_params=sum(p.numel() for p in memory_estimate.lora_params(model)),
                 weight_bytes=weights["blocks"] + weights["root"], fsdp_units=len(model.blocks()) + 1,
                 cfg=model.guidance_mode in ("cfg", "true_cfg"), batched_cfg=model.batch_cfg,
                 transformer_params=real_shapes.transformer_param_count(family))


# --- the report ---------------------------------------------------------------------------------------------

def _seconds(value: float) -> str:
    return f"{value:.2f}" if value < 10 else f"{value:.1f}" if value < 100 else f"{value:.0f}"


def recipe_rows(config: TrainingJobConfig, shape: Shape, calibration: Calibration,
                workers: tuple[int, ...]) -> list[tuple[Prediction, Prediction]]:
    """(sharding none, fsdp) for each worker count and the links it crosses: NVLink up to one node, then each of
    BETWEEN_NODES."""
    rows = []
    for n in workers:
        for between in (None,) if n <= GPUS_PER_NODE else BETWEEN_NODES:
            rows.append((predict(config, shape, calibration, n, between),
                         predict(config, shape, calibration, n, between, fsdp=True)))
    return rows


def print_recipe(name: str, config: TrainingJobConfig, shape: Shape, calibration: Calibration,
                 workers: tuple[int, ...]) -> list[str]:
    """The recipe's table; returns where efficiency falls below EFFICIENCY_TARGET."""
    s, t = config.sampling, config.train
    sampling_s, training_s = one_worker_epoch(config, shape, calibration)
    guided = "CFG" if shape.cfg and s.guidance_scale > 1 else "no CFG"
    print(f"\n### {name}\n")
    about = (f"{RECIPES[name]}, {t.algorithm}: {s.prompts_per_epoch} prompts x {s.group_size} = "
             f"{s.prompts_per_epoch * s.group_size} samples an epoch, {config.model.resolution} px, {s.num_steps} "
             f"steps ({guided} in sampling{', CFG in training' if t.train_cfg else ''}), {trained_steps(config)} "
             f"trained per sample, compile {'on' if t.compile else 'off'}, checkpointing "
             f"{'on' if t.gradient_checkpointing else 'off'}. Transformer {shape.transformer_params / 1e9:.2f} B "
             f"parameters ({shape.weight_bytes / 1e9:.1f} GB bf16), {shape.forward_flops / 1e12:.2f} TFLOP a "
             f"forward of one sample; LoRA {shape.lora_params / 1e6:.1f} M parameters, "
             f"{FLOAT32_BYTES * shape.lora_params / 1e6:.0f} MB of float32 gradients a step. One H100 (estimated): "
             f"sampling {_seconds(sampling_s)} s + training {_seconds(training_s)} s = "
             f"{_seconds(sampling_s + training_s)} s an epoch.")
    print(textwrap.fill(about, width=115) + "\n")
    print("| GPUs | ring paced by | samples per GPU | optimizer steps | compute s | all-reduce s | epoch s | "
          "efficiency | fsdp all-gather s | fsdp epoch s | fsdp efficiency | fsdp, gathers hidden |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    low, refused = [], set()
    for plain, sharded in recipe_rows(config, shape, calibration, workers):
        if plain.epoch_s is None:
            if plain.workers not in refused:  # the same reasons over every link
                print(f"| {plain.workers} | - | cannot split: {'; '.join(plain.problems)} |" + " |" * 9)
            refused.add(plain.workers)
            continue
        link = plain.link if plain.workers > 1 else "-"
        print(f"| {plain.workers} | {link} | {plain.split.images} | {plain.split.optimizer_steps} | "
              f"{_seconds(plain.compute_s)} | {plain.all_reduce_s:.3f} | {_seconds(plain.epoch_s)} | "
              f"{plain.efficiency:.1%} | {_seconds(sharded.fsdp_s)} | {_seconds(sharded.epoch_s)} | "
              f"{sharded.efficiency:.1%} | {sharded.hidden_gathers_efficiency:.1%} |")
        if plain.efficiency < EFFICIENCY_TARGET:
            low.append(f"{name}, {plain.workers} GPUs over {plain.link}, sharding none: {plain.efficiency:.1%}")
        if sharded.efficiency < EFFICIENCY_TARGET:
            low.append(f"{name}, {sharded.workers} GPUs over {sharded.link}, fsdp: {sharded.efficiency:.1%} "
                       f"({sharded.hidden_gathers_efficiency:.1%} with every gather hidden)")
    return low


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipes", default=",".join(RECIPES), help="comma-separated shipped GPU recipes")
    parser.add_argument("--workers", default=",".join(map(str, WORKERS)), help="comma-separated GPU counts")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a config override for every recipe (repeatable)")
    args = parser.parse_args(argv)
    recipes = [r for r in args.recipes.split(",") if r]
    unknown = sorted(set(recipes) - set(RECIPES))
    if unknown:
        parser.error(f"unknown recipe(s) {', '.join(unknown)}; known: {', '.join(RECIPES)}")
    workers = tuple(int(n) for n in args.workers.split(",") if n)

    reference = load_config(CONFIG_DIR / f"{REFERENCE_RECIPE}.yaml")
    calibration = calibrate(reference, real_shape(reference, RECIPES[REFERENCE_RECIPE]))
    links = "; ".join(f"{link.name} {link.bandwidth / 1e9:g} GB/s per direction, {link.latency * 1e6:g} us a message"
                      for link in (NVLINK, *BETWEEN_NODES))
    print(textwrap.fill(
        f"Compute: one H100 per worker, at {REFERENCE_RECIPE}'s measured images/s (docs/PERFORMANCE.md: sampling "
        f"{MEASURED_IMAGES_PER_S[True][0]}, training {MEASURED_IMAGES_PER_S[True][1]} compile on; "
        f"{MEASURED_IMAGES_PER_S[False][0]}, {MEASURED_IMAGES_PER_S[False][1]} off), scaled by transformer FLOPs "
        f"per image: {calibration.sampling[True] / 1e12:.0f} / {calibration.training[True] / 1e12:.0f} TFLOP/s "
        f"sampling / training, compile on. Links: {links}. {GPUS_PER_NODE} GPUs a node on NVLink; beyond, one ring "
        "over the link between nodes. Communication adds to compute; 'gathers hidden' is FSDP with every all-gather "
        "under compute instead.", width=115))
    low = []
    for name in recipes:
        config = load_config(CONFIG_DIR / f"{name}.yaml", args.set)
        low += print_recipe(name, config, real_shape(config, RECIPES[name]), calibration, workers)
    print(f"\nBelow {EFFICIENCY_TARGET:.0%} efficiency:")
    print("\n".join(f"- {line}" for line in low) or "- nowhere")


if __name__ == "__main__":
    main()
