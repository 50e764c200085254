"""Peak memory of one FlowGRPO training worker, per shipped GPU recipe and memory setting.

    python tests/benchmarks/bench_memory.py
        [--recipes sd35-medium-ocr,sd35-large-ocr,flux1-dev-pickscore,qwenimage-ocr,flux2-klein-pickscore,
                   zimage-pickscore,wan21-t2v-1.3b-pickscore,flux1-kontext-edit,wan21-i2v-14b-480p,flux2-klein-edit,
                   qwenimage-edit-2509]
        [--cpu-families sd35-medium,sd35-large,flux1-dev,qwen-image,flux2-klein,z-image,wan21-1.3b,flux1-kontext,
                        wan21-i2v-14b,flux2-klein-base]
        [--all-settings]
        [--depth N]   # estimates with N transformer blocks, each recipe's own setting only: a smoke run (CI)

1. Estimated, every machine: each recipe at real shape (random weights, fake tensors: no memory, no compute,
   seconds on a CPU), at its per-worker batches, for every combination of train.gradient_checkpointing,
   model.offload_text_encoders and train.sharding (FSDP over the recipe's cluster.workers.replicas), against
   the 72 GiB target; the recipe's own setting is marked. First, the estimator against the one measurement
   taken on an H100 (docs/MEMORY.md).
2. Measured on this CPU: the trainer's own epoch (Trainer.run_epoch) on real-width pipelines with fewer blocks
   (``--cpu-families``), peak RSS of sampling and of training above what was resident before each, with
   activation checkpointing off and on, each in a fresh process; the on / off ratio.
3. Measured on a GPU, when one is visible: the same epoch on the real-shape pipeline (text encoders at real
   width with 2 layers) at each recipe's per-worker batches, torch.cuda.max_memory_allocated per phase, for the
   recipe's own setting (``--all-settings``: checkpointing x offload), beside the estimate. Unsharded (one worker)
   and eager (``train.compile`` off), as the estimate is.

Pipelines are built in memory (tests/benchmarks/real_shapes.py) and handed to the trainer instead of the one
`model.path` names (``Trainer(pipeline=...)``); each phase is measured through the trainer's ``phase_scope``, and
everything else is the trainer's own code.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import itertools
import json
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
os.environ["MLFLOW_TRACKING_URI"] = ""
sys.path.insert(0, str(Path(__file__).resolve().parent))  # real_shapes, memory_estimate (tests/ is no package)

import torch

from pipeline.config import CONFIG_DIR, ExperimentConfig, load_config

TARGET_GIB = 72.0
RECIPES = {"sd35-medium-ocr": "sd35-medium", "sd35-large-ocr": "sd35-large", "flux1-dev-pickscore": "flux1-dev",
           "qwenimage-ocr": "qwen-image", "flux2-klein-pickscore": "flux2-klein",
           "zimage-pickscore": "z-image", "wan21-t2v-1.3b-pickscore": "wan21-1.3b",
           "flux1-kontext-edit": "flux1-kontext", "wan21-i2v-14b-480p": "wan21-i2v-14b",
           "flux2-klein-edit": "flux2-klein-base", "qwenimage-edit-2509": "qwen-image-edit"}
# input images per prompt in an editing recipe's data where the family takes a number of them (FLUX.2 klein's
# references); the others take their adapter's ``input_images``. Each forward's sequence grows by them
INPUT_IMAGES = {"flux2-klein-edit": 1}
FAMILY_RECIPE = {family: recipe for recipe, family in RECIPES.items()}
# The one real measurement (one H100 80 GB, SD3.5-Medium shape with T5 reduced to 2 layers, the earlier recipe:
# 8 images per sampling and training forward, CFG 4.5 in both, KL on, r32 LoRA, no checkpointing / offload).
H100_SD35_PEAK_GIB = 49.9
QWEN_PROMPT_TOKENS = 100  # a typical OCR prompt after the template (Z-Image: PickScore's, longer than most); SD3
# and FLUX pad to a fixed length
GIB = 2**30
MIB = 2**20
# the CPU measurement: real width, few blocks, small images, so an epoch takes seconds
CPU_SIZES = {"sample_batch": 2, "train_batch": 2, "resolution": 128, "transformer_layers": 2}
CPU_TEXT_LAYERS = 1
CPU_T5_LENGTH = 64
CPU_SHAPE = (f"bf16, real width, {CPU_SIZES['transformer_layers']} transformer blocks, {CPU_TEXT_LAYERS} text-encoder "
             f"layer, T5 length {CPU_T5_LENGTH}, {CPU_SIZES['resolution']} px, batch {CPU_SIZES['sample_batch']}")


# -- 1. estimates ----------------------------------------------------------------------------------

def _setting(ckpt: bool, offload: bool, sharding: str) -> str:
    return f"ckpt {'on ' if ckpt else 'off'}  offload {'on ' if offload else 'off'}  {sharding:<4}"


def _text_tokens(config: ExperimentConfig, family: str) -> int:
    """Text tokens per prompt row: Qwen-Image's and Z-Image's own prompt length; SD3's 77 CLIP + the T5 length;
    FLUX's T5; FLUX.2 klein's padded Qwen3 length; Wan's padded UMT5 length."""
    if family in ("qwen-image", "z-image"):
        return QWEN_PROMPT_TOKENS
    if family == "qwen-image-edit":  # the picture's tokens join the prompt's (memory_estimate.FAMILIES)
        import memory_estimate

        return memory_estimate.FAMILIES[family].text_tokens
    if family in ("flux2-klein", "flux2-klein-base"):
        from components.models.flux2.adapter import Flux2KleinModel

        return config.model.max_sequence_length or Flux2KleinModel.default_max_sequence_length
    if family in ("wan21-1.3b", "wan21-i2v-14b"):
        from components.models.wan.adapter import WanModel

        return config.model.max_sequence_length or WanModel.default_max_sequence_length
    from components.models.flux.adapter import FluxModel
    from components.models.sd3.adapter import SD3Model

    sd3 = family.startswith("sd35")
    adapter = SD3Model if sd3 else FluxModel
    t5 = config.model.max_sequence_length or adapter.default_max_sequence_length
    return 77 + t5 if sd3 else t5


def _estimate(config: ExperimentConfig, family: str, *, ckpt: bool, offload: bool, world: int,
              text_layers: int | None = None, cpu: bool = False, input_images: int = 0,
              **shape: int) -> dict[str, float]:
    """The estimator at ``config``'s per-worker settings; ``text_layers``: text encoders of that depth (as in a
    measured run) instead of their real size; ``cpu``: the reduced shape of the CPU measurement;
    ``input_images``: per prompt (an editing recipe's, ``INPUT_IMAGES``)."""
    import memory_estimate

    s, t, lora = config.sampling, config.train, config.model.lora
    sizes: dict[str, int | None] = {"sample_batch": s.batch_size_per_worker, "train_batch": t.batch_size_per_worker,
                                    "resolution": config.model.resolution, "transformer_layers": None,
                                    "text_tokens": _text_tokens(config, family)}
    if cpu:
        sizes.update(CPU_SIZES)
    sizes.update(shape)
    return memory_estimate.estimate(
        family, sample_cfg=s.guidance_scale > 1, train_cfg=t.train_cfg, lora_rank=lora.rank,
        lora_alpha=lora.alpha, lora_targets=tuple(lora.target_modules), gradient_checkpointing=ckpt,
        offload_text_encoders=offload, shard_world=world, beta=t.beta, text_layers=text_layers,
        num_frames=config.model.num_frames, input_images=input_images, **sizes,
    )


def calibration() -> None:
    import real_shapes

    config = load_config(CONFIG_DIR / "sd35-medium-ocr.yaml", [
        "sampling.batch_size_per_worker=8", "train.batch_size_per_worker=8", "sampling.prompts_per_epoch=1",
        "sampling.group_size=8", "train.gradient_accumulation_steps=1", "model.max_sequence_length=256"])
    est = _estimate(config, "sd35-medium", ckpt=False, offload=False, world=1)  # T5 256: that run's length
    # that run's T5 had 2 layers; its CLIP encoders were whole
    t5_real, t5_run = (real_shapes.sd35_medium_text_encoders(layers)["text_encoder_3"] for layers in (None, 2))
    peak = est["peak_gib"] - (t5_real - t5_run) * 2 / GIB
    print(f"calibration, SD3.5-Medium shape, batch 8 + CFG in training, KL on, T5 at 2 layers: estimated "
          f"{peak:.1f} GiB, measured on an H100 {H100_SD35_PEAK_GIB} GiB (measured / estimated = "
          f"{H100_SD35_PEAK_GIB / peak:.3f})")


def estimates(recipes: list[str], depth: int | None) -> None:
    if depth is not None:
        print(f"\nsmoke run: transformers cut to {depth} blocks and each recipe's own setting only, so these are NOT "
              "the recipes' figures (docs/MEMORY.md has them)")
    for recipe in recipes:
        config = load_config(CONFIG_DIR / f"{recipe}.yaml")
        family, world, t = RECIPES[recipe], config.cluster.workers.training_workers, config.train
        own = (t.gradient_checkpointing, config.model.offload_text_encoders, t.sharding)
        inputs = f", {INPUT_IMAGES[recipe]} input image(s) per prompt" if recipe in INPUT_IMAGES else ""
        print(f"\n{recipe}: per worker {config.sampling.batch_size_per_worker} images per sampling forward, "
              f"{t.batch_size_per_worker} per training forward{' with CFG' if t.train_cfg else ''}, "
              f"{config.model.resolution} px{inputs}; FSDP over {world} workers; estimated GiB")
        print(f"  {'setting':<33} {'sampling':>8} {'training':>8} {'encode':>7} {'peak':>6}")
        # a smoke run estimates one setting per recipe: the shipped recipes' own settings take every value of
        # each knob between them, and each fake pass costs seconds
        settings = itertools.product((False, True), (False, True), ("none", "fsdp")) if depth is None else [own]
        for ckpt, offload, sharding in settings:
            start = time.perf_counter()
            e = _estimate(config, family, ckpt=ckpt, offload=offload, world=world if sharding == "fsdp" else 1,
                          transformer_layers=depth, input_images=INPUT_IMAGES.get(recipe, 0))
            mark = "*" if (ckpt, offload, sharding) == own else " "
            verdict = "fits" if e["peak_gib"] <= TARGET_GIB else "OVER"
            print(f"{mark} {_setting(ckpt, offload, sharding):<33} {e['sampling_peak_gib']:8.1f} "
                  f"{e['training_peak_gib']:8.1f} {e['encode_peak_gib']:7.1f} {e['peak_gib']:6.1f}  {verdict} "
                  f"({time.perf_counter() - start:.0f} s)")
        own_figures = _estimate(config, family, ckpt=own[0], offload=own[1], world=world if own[2] == "fsdp" else 1,
                                transformer_layers=depth, input_images=INPUT_IMAGES.get(recipe, 0))
        if own[1]:
            print(f"  with a prompt set over model.prompt_cache_gib the encoders visit each epoch beside the resident "
                  f"model: {own_figures['epoch_encode_peak_gib']:.1f} GiB in this recipe's setting")
    print("* = the recipe's own setting; encode = encoding the prompts (offloaded: at start, before the model is "
          "placed); add ~1-3 GiB of CUDA context and allocator slack to every figure")


# -- 2. and 3. the trainer's epoch on a real-width pipeline ------------------------------------------

class RssProbe:
    """Peak resident set size of this process while a phase runs, polled every 2 ms."""

    def __init__(self) -> None:
        import psutil

        self._process = psutil.Process()
        self._libc = ctypes.CDLL("libc.so.6") if sys.platform.startswith("linux") else None

    @contextlib.contextmanager
    def phase(self, into: dict[str, float], key: str) -> Iterator[None]:
        if self._libc is not None:
            self._libc.malloc_trim(0)  # freed heap back to the OS, so the baseline is what is really held
        start = peak = self._process.memory_info().rss
        done = threading.Event()

        def poll() -> None:
            nonlocal peak
            while not done.wait(0.002):
                peak = max(peak, self._process.memory_info().rss)

        thread = threading.Thread(target=poll, daemon=True)
        thread.start()
        try:
            yield
        finally:
            done.set()
            thread.join()
            into[f"{key}_above_start_mib"] = (max(peak, self._process.memory_info().rss) - start) / MIB


class CudaProbe:
    """torch.cuda.max_memory_allocated over a phase (the caching allocator's live tensors, not its slack)."""

    @contextlib.contextmanager
    def phase(self, into: dict[str, float], key: str) -> Iterator[None]:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        yield
        torch.cuda.synchronize()
        into[f"{key}_peak_gib"] = torch.cuda.max_memory_allocated() / GIB
        into[f"{key}_reserved_gib"] = torch.cuda.max_memory_reserved() / GIB


def _epoch_overrides(config: ExperimentConfig, *, cpu: bool, ckpt: bool, offload: bool) -> list[str]:
    """One sampling batch and one micro-batch at the recipe's per-worker sizes (the peak depends on a batch's
    size, not on how many there are), one trained step, a reward that needs no model, prompts inline."""
    s, t = config.sampling, config.train
    batch = CPU_SIZES["sample_batch"] if cpu else s.batch_size_per_worker
    train_batch = CPU_SIZES["train_batch"] if cpu else t.batch_size_per_worker
    group = max(2, math.lcm(batch, train_batch))
    overrides = [
        "model.path=in-memory", f"model.device={'cpu' if cpu else 'cuda'}", "train.epochs=1",
        f"sampling.batch_size_per_worker={batch}", f"train.batch_size_per_worker={train_batch}",
        "sampling.prompts_per_epoch=1", f"sampling.group_size={group}", "train.gradient_accumulation_steps=1",
        "train.timestep_fraction=0.1", "rewards=[{name: brightness}]", "reward_aggregation=sum", "data.path=null",
        "data.prompts=[a red apple on a wooden table, a lighthouse on a cliff at dusk]", "tracking.sample_every=0",
        f"train.gradient_checkpointing={str(ckpt).lower()}", f"model.offload_text_encoders={str(offload).lower()}",
        "train.sharding=none", "train.checkpoint_every=1000",
        # eager, as the estimate: compiling real-width blocks costs minutes on a CPU and 1-2 on a GPU per recipe
        "train.compile=false",
    ]
    if cpu:
        overrides += [f"model.resolution={CPU_SIZES['resolution']}", "sampling.num_steps=2", "sampling.sde_window=null",
                      "model.max_sequence_length=null"]  # the family's, cut to the CPU T5's CPU_T5_LENGTH tokens
    return overrides


def real_shape_pipeline(family: str, config: ExperimentConfig, *, cpu: bool) -> Any:
    """What the trainer gets instead of reading `model.path`: the real-shape pipeline, built in host memory."""
    import real_shapes

    kwargs: dict[str, Any] = {"text_layers": CPU_TEXT_LAYERS if cpu else 2}
    if cpu:
        kwargs["transformer_layers"] = CPU_SIZES["transformer_layers"]
        if family not in ("qwen-image", "qwen-image-edit"):
            kwargs["max_sequence_length"] = CPU_T5_LENGTH
    return real_shapes.BUILDERS[family](device="cpu", dtype=getattr(torch, config.model.dtype), **kwargs)


def _input_rows(folder: Path, prompts: list[str], count: int, resolution: int) -> Path:
    """A JSONL of ``prompts``, each with ``count`` input images (random PNGs of ``resolution`` px): an editing
    recipe's rows, whose inputs join every forward."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    rows = []
    for i, prompt in enumerate(prompts):
        names = [f"input{i}_{k}.png" for k in range(count)]
        for name in names:
            Image.fromarray(rng.integers(0, 256, (resolution, resolution, 3), dtype=np.uint8)).save(folder / name)
        rows.append(json.dumps({"prompt": prompt, "images": names}) + "\n")
    (folder / "rows.jsonl").write_text("".join(rows))
    return folder / "rows.jsonl"


def run_epoch(family: str, *, cpu: bool, ckpt: bool, offload: bool) -> dict[str, float]:
    """One worker's epoch of the family's recipe through the trainer; peak memory of each of its phases
    (``<phase>_above_start_mib`` on a CPU, ``<phase>_peak_gib`` on a GPU; phases: see ``loop.PhaseScope``)."""
    import tempfile

    import memory_estimate

    from components.trainer.loop import Trainer

    recipe = CONFIG_DIR / f"{FAMILY_RECIPE[family]}.yaml"
    overrides = _epoch_overrides(load_config(recipe), cpu=cpu, ckpt=ckpt, offload=offload)
    config = load_config(recipe, overrides)
    probe = RssProbe() if cpu else CudaProbe()
    figures: dict[str, float] = {}
    pipeline = real_shape_pipeline(family, config, cpu=cpu)
    with tempfile.TemporaryDirectory() as tmp:
        count = INPUT_IMAGES.get(FAMILY_RECIPE[family], memory_estimate.adapter_class(pipeline).input_images)
        if count:  # an editing recipe: its rows carry their input images
            rows = _input_rows(Path(tmp), config.data.prompts or [], count, config.model.resolution)
            config = load_config(recipe, [*overrides, "data.prompts=null", f"data.path={rows}"])
        with probe.phase(figures, "start"):  # encode (offload), place the model
            trainer = Trainer(config, Path(tmp) / "run", log=lambda _m: None, pipeline=pipeline,
                              phase_scope=lambda phase: probe.phase(figures, phase))
        trainer.run_epoch()
        # the text lengths the run used, for the estimate of the same shape (its rows' images are in ``tmp``)
        figures["text_tokens"] = trainer.prompts(trainer.rows[:1]).tensors["prompt_embeds"].shape[1]
    figures["negative_tokens"] = trainer.model.negative_embeddings().tensors["prompt_embeds"].shape[1]
    return figures


# glibc keeps freed heap memory (RSS then shows the high-water mark of the whole process); with allocations
# above 64 KiB mmap'd and trimmed at once, RSS follows the live tensors
_MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0", "MALLOC_ARENA_MAX": "2"}


def _child(args: list[str], timeout: float | None = None) -> dict[str, float]:
    """``run_epoch`` in a fresh process, so no phase inherits another's memory."""
    proc = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True, text=True,
                          env={**os.environ, **_MALLOC_ENV}, timeout=timeout)
    if proc.returncode:
        raise RuntimeError(f"bench_memory child {args} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def cpu_measurements(families: list[str]) -> None:
    print(f"\nmeasured on this CPU: the trainer's epoch at {CPU_SHAPE}; peak RSS above the phase's start, MiB "
          "(estimated: the estimator at the same reduced shape, activations + LoRA gradients + AdamW state)")
    for family in families:
        config = load_config(CONFIG_DIR / f"{FAMILY_RECIPE[family]}.yaml")
        measured, estimated = {}, {}
        for ckpt in (False, True):
            got = _child([family, "cpu", str(ckpt), "False"])
            est = _estimate(config, family, ckpt=ckpt, offload=False, world=1, text_layers=1, cpu=True,
                            text_tokens=int(got["text_tokens"]), negative_tokens=int(got["negative_tokens"]))
            measured[ckpt] = got["training_above_start_mib"]
            estimated[ckpt] = (est["training_activations_gib"] + est["lora_grads_gib"] + est["adam_state_gib"]) * 1024
        print(f"  {family:<12} training: checkpointing off {measured[False]:5.0f} (estimated {estimated[False]:4.0f}), "
              f"on {measured[True]:5.0f} (estimated {estimated[True]:4.0f}); on / off = "
              f"{measured[True] / measured[False]:.2f} measured, {estimated[True] / estimated[False]:.2f} estimated")


def gpu_measurements(recipes: list[str], all_settings: bool) -> None:
    print(f"\nmeasured on {torch.cuda.get_device_name()} (random weights of the real transformer and VAE; text "
          "encoders at real width, 2 layers): torch.cuda.max_memory_allocated per phase, GiB")
    print(f"  {'recipe':<20} {'setting':<22} {'start':>6} {'sampling':>8} {'training':>8} {'estimate':>8}")
    for recipe in recipes:
        settings = list(itertools.product((False, True), (False, True))) if all_settings else [own_setting(recipe)]
        for ckpt, offload in settings:
            row = gpu_row(recipe, ckpt, offload)
            print(f"  {recipe:<20} {_setting(ckpt, offload, 'none')[:-5]:<22} {row['start_peak_gib']:6.1f} "
                  f"{row['sampling_peak_gib']:8.1f} {row['training_peak_gib']:8.1f} {row['estimate_gib']:8.1f}")


def own_setting(recipe: str) -> tuple[bool, bool]:
    """The recipe's own (gradient checkpointing, text-encoder offload)."""
    config = load_config(CONFIG_DIR / f"{recipe}.yaml")
    return config.train.gradient_checkpointing, config.model.offload_text_encoders


def gpu_estimate(recipe: str, ckpt: bool, offload: bool) -> float:
    """The estimator's steady peak for the GPU leg's run of ``recipe``: one unsharded worker, text encoders at 2
    layers, as ``run_epoch`` builds them."""
    config = load_config(CONFIG_DIR / f"{recipe}.yaml")
    return _estimate(config, RECIPES[recipe], ckpt=ckpt, offload=offload, world=1, text_layers=2,
                     input_images=INPUT_IMAGES.get(recipe, 0))["steady_peak_gib"]


def gpu_row(recipe: str, ckpt: bool, offload: bool, timeout: float | None = None,
            estimate: float | None = None) -> dict[str, Any]:
    """One recipe's epoch on the GPU in a fresh process, its peaks per phase beside the estimate (``gpu_estimate``
    unless given)."""
    got = _child([RECIPES[recipe], "cuda", str(ckpt), str(offload)], timeout)
    return {"recipe": recipe, "gradient_checkpointing": ckpt, "offload_text_encoders": offload, **got,
            "estimate_gib": gpu_estimate(recipe, ckpt, offload) if estimate is None else estimate}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--recipes", default=",".join(RECIPES))
    parser.add_argument("--cpu-families", default=",".join(FAMILY_RECIPE),
                        help="families measured on the CPU ('' = none)")
    parser.add_argument("--all-settings", action="store_true", help="on a GPU: checkpointing x offload")
    parser.add_argument("--depth", type=int, default=None,
                        help="estimate with this many transformer blocks, each recipe's own setting only (a quick "
                             "smoke run; not the real figures)")
    parser.add_argument("--child", nargs=4, metavar=("FAMILY", "DEVICE", "CKPT", "OFFLOAD"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        family, device, ckpt, offload = args.child
        print(json.dumps(run_epoch(family, cpu=device == "cpu", ckpt=ckpt == "True", offload=offload == "True")))
        return
    import real_shapes

    print(real_shapes.describe())
    recipes = [r for r in args.recipes.split(",") if r]
    if args.depth is None:
        calibration()
    estimates(recipes, args.depth)
    cpu_measurements([f for f in args.cpu_families.split(",") if f])
    if torch.cuda.is_available():
        gpu_measurements(recipes, args.all_settings)
    else:
        print("\nno GPU visible: the measured accelerator peaks are skipped (run this on a GPU node)")


if __name__ == "__main__":
    sys.exit(main())
