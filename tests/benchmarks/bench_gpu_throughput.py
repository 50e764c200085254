"""Throughput of one FlowGRPO worker on the SD3.5-Medium OCR recipe, with train.compile off and on.

    python tests/benchmarks/bench_gpu_throughput.py [--compile off,on] [--epochs N]

The workload is the shipped recipe (pipeline/configs/sd35-medium-ocr.yaml) at its per-worker settings: 9 images
per sampling and per training forward, 10 steps, CFG 4.5 in sampling and training, KL to the adapter-disabled
model (beta 0.04), an r32 LoRA, 512 px, bf16, text encoders offloaded; 3 prompts x 9 images an epoch (3 sampling
batches, 3 micro-batches, one optimizer step), the brightness reward (no OCR model) and inline prompts.

On a GPU the model is the real-shape SD3.5-Medium pipeline (tests/benchmarks/real_shapes.py: random weights, text
encoders 2 layers deep), handed to the trainer where it would read `model.path`. Without one, the tiny SD3 model at
32 px, 4 steps and smaller batches stands in: a smoke test of every code path, not figures to quote.

Each compile setting runs in a fresh process (no compiled state carries over; on a GPU with an empty inductor
cache): the trainer's own epoch (Trainer.run_epoch), one warm-up epoch (which compiles), then ``--epochs`` measured
ones (default 2 on a GPU, 3 on a CPU). Printed, per setting: images/s of the epoch, of sampling and of training; our
sampling time per batch against diffusers' own ``__call__`` on the same batches (eager, LoRA disabled, decoding too;
target <= 1.1); the epoch's images/s as a fraction of the FLOP floor (FlopCounterMode on one CFG forward x the
forwards an image costs, over a measured matmul peak); the warm-up seconds; dynamo's unique graphs after the warm-up
and after the measured epochs (equal: nothing recompiled); where a sampling batch's time goes (transformer, VAE
decode, prompt encoding, the rest). The compile-off process also reports which attention kernels ran. Timings never
fail the run: it exits 0 whatever the figures (1 only when a setting crashed)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_memory, real_shapes (tests/ is no package)

import torch
from bench_memory import real_shape_pipeline  # its import sets the offline, no-MLflow environment

from components.dataset.prepared import PromptRow
from components.flow_rl.rollout import plan_steps
from components.models.base import FlowMatchingModel, PromptEmbeddings
from pipeline.config import CONFIG_DIR, ExperimentConfig, load_config

RECIPE = CONFIG_DIR / "sd35-medium-ocr.yaml"
# each algorithm's shipped SD3.5-Medium recipe and what selects it there (bench_algorithms.py's GPU leg), with its
# published settings: MixGRPO's window of 4 steps (Flash: DPM-Solver++(2M) on 40% of the points after it), Dance-SDE
# at eta 0.3 on int((N - 1) 0.6) of the steps, AWM's CFG-free ODE rollouts with KL 0.003 on 90% of the levels and
# every sample, online DPO at beta 100 on the recipe's CFG (docs/ALGORITHM.md sections 11-14)
MIX_GRPO = ["train.algorithm=mix_grpo", "sampling.sde_window=null", "train.mix_grpo.window_size=4"]
ALGORITHM_RECIPES: dict[str, tuple[Path, list[str]]] = {
    "flow_grpo": (RECIPE, []),
    "grpo_guard": (RECIPE, ["train.grpo_guard=true"]),
    "diffusion_nft": (CONFIG_DIR / "sd35-medium-nft-ocr.yaml", []),
    "mix_grpo": (RECIPE, MIX_GRPO),
    "mix_grpo_flash": (RECIPE, [*MIX_GRPO, "train.mix_grpo.ode_solver=dpm2", "train.mix_grpo.tail_ratio=0.4"]),
    "dance_grpo": (RECIPE, ["sampling.sde_type=dance", "sampling.noise_level=0.3", "sampling.same_initial_noise=true",
                            "sampling.sde_window=null", "train.timestep_fraction=0.5"]),
    "awm": (RECIPE, ["train.algorithm=awm", "sampling.guidance_scale=1", "train.train_cfg=false",
                     "train.timestep_fraction=0.9", "train.beta=0.003", "train.skip_zero_advantage=false"]),
    "dpo": (RECIPE, ["train.algorithm=dpo"]),
}
PROMPTS = ["a shop sign that reads OPEN", "a chalkboard menu that says SOUP OF THE DAY",
           "a street sign reading MAIN ST"]
# the paper's code (upstream flow_grpo) on the same work on one H100, and the goal for this trainer
REFERENCE_IMAGES_PER_S = 0.91
TARGET_SPEEDUP = 1.5
TARGET_SAMPLER_RATIO = 1.1
ATTENTION_MARKERS = ("scaled_dot_product", "flash", "cudnn", "efficient_attention", "_math", "fmha")


# -- the workload ----------------------------------------------------------------------------------

def workload(cpu: bool, compile_: bool, uncond_grad: bool = True, algorithm: str = "flow_grpo") -> ExperimentConfig:
    """The algorithm's recipe's per-worker work, 27 images an epoch on a GPU; on a CPU the tiny model at a reduced
    shape."""
    recipe, overrides = ALGORITHM_RECIPES[algorithm]
    overrides = [*overrides,
        "model.path=in-memory", f"model.device={'cpu' if cpu else 'cuda'}", "rewards=[{name: brightness}]",
        f"data.prompts=[{', '.join(PROMPTS)}]", "data.path=null", "tracking.sample_every=0",
        "tracking.system_metrics=false", "train.checkpoint_every=1000", f"train.compile={str(compile_).lower()}",
        "sampling.prompts_per_epoch=3", "sampling.group_size=9", "train.gradient_accumulation_steps=3",
        f"train.cfg_uncond_grad={str(uncond_grad).lower()}",
    ]
    if cpu:  # CFG, train_cfg and beta stay the recipe's: the same forwards, fewer and smaller
        overrides += ["model.kind=tiny-sd3", "model.path=null", "model.dtype=float32", "model.resolution=32",
                      "model.max_sequence_length=null",  # the tiny tokenizers hold 32 tokens
                      "sampling.num_steps=4", "sampling.batch_size_per_worker=4", "train.batch_size_per_worker=4",
                      "sampling.group_size=4", "sampling.prompts_per_epoch=2", "train.gradient_accumulation_steps=2"]
    return load_config(recipe, overrides)


def describe(config: ExperimentConfig, cpu: bool) -> str:
    """The shape that runs and the work of an epoch, for the first line of the output."""
    s, t, m = config.sampling, config.train, config.model
    shape = ("tiny SD3 (tiny-sd3), float32 -- a CPU smoke test, not timings to quote" if cpu else
             f"SD3.5-Medium real shape (random weights, text encoders 2 layers), {m.dtype}")
    return (f"{shape}; {s.prompts_per_epoch} prompts x {s.group_size} images an epoch, {s.batch_size_per_worker} per "
            f"sampling forward, {t.batch_size_per_worker} per training forward x {t.gradient_accumulation_steps} "
            f"accumulated, {s.num_steps} steps, CFG {s.guidance_scale:g} (train_cfg {t.train_cfg}), beta {t.beta:g}, "
            f"LoRA r{m.lora.rank}, {m.resolution} px, offload_text_encoders {m.offload_text_encoders}")


def epoch_prompts(config: ExperimentConfig) -> list[str]:
    """The epoch's distinct prompts, ``prompts_per_epoch`` of PROMPTS in turn."""
    return [PROMPTS[i % len(PROMPTS)] for i in range(config.sampling.prompts_per_epoch)]


def epoch_batches(config: ExperimentConfig) -> list[list[str]]:
    """Prompts of each sampling batch of an epoch: each prompt ``group_size`` times, ``batch_size`` per batch."""
    s = config.sampling
    rows = [prompt for prompt in epoch_prompts(config) for _ in range(s.group_size)]
    return [rows[i:i + s.batch_size_per_worker] for i in range(0, len(rows), s.batch_size_per_worker)]


def forwards_per_image(config: ExperimentConfig) -> float:
    """Transformer forwards (in units of one CFG forward) an image costs in an epoch: every sampling step, and per
    trained timestep forward + backward (2 forwards) + the KL reference when beta > 0."""
    s, t = config.sampling, config.train
    train_steps = len(plan_steps(s.num_steps, t.timestep_fraction, None)[1])
    per_step = 3 + (1 if t.beta > 0 else 0)
    rows = 1.0 if t.train_cfg else 0.5  # without train_cfg the training forward has no negative row
    return s.num_steps + train_steps * per_step * rows


# -- measurements (in the child) ------------------------------------------------------------------

def _clock(device: torch.device) -> float:
    """Wall time once the device has finished what was queued (CUDA runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def diffusers_seconds_per_batch(trainer: Any, config: ExperimentConfig) -> float:
    """diffusers' own ``__call__`` on the epoch's batches with the LoRA disabled, eager, decoding to tensors.

    Embeddings are passed in: with offload_text_encoders the pipeline's encoders may have been released."""
    model: FlowMatchingModel = trainer.model
    s, device = config.sampling, model.device
    negative = model.negative_embeddings()
    batches = epoch_batches(config)

    def call(b: int) -> None:
        cond: PromptEmbeddings = trainer.prompts([PromptRow(p) for p in batches[b]])
        neg = negative.expand_to(len(batches[b]))
        model.pipeline(
            prompt_embeds=cond.tensors["prompt_embeds"], pooled_prompt_embeds=cond.tensors["pooled_projections"],
            negative_prompt_embeds=neg.tensors["prompt_embeds"],
            negative_pooled_prompt_embeds=neg.tensors["pooled_projections"], num_inference_steps=s.num_steps,
            guidance_scale=s.guidance_scale, height=config.model.resolution, width=config.model.resolution,
            generator=torch.Generator(device).manual_seed(b), output_type="pt")

    with model.adapter_disabled(), torch.no_grad():
        call(0)  # warm-up: kernels selected, allocator grown
        times = []
        for b in range(len(batches)):
            start = _clock(device)
            call(b)
            times.append(_clock(device) - start)
    return statistics.fmean(times)


def cfg_forward_flops(model: FlowMatchingModel, cond: PromptEmbeddings, config: ExperimentConfig) -> float:
    """FLOPs of one CFG transformer forward for one image (the negative and the prompt row)."""
    from torch.utils.flop_counter import FlopCounterMode

    latents = torch.randn((1, *model.latent_shape(config.model.resolution)), device=model.device)
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model.predict_velocity(latents, 0.5, cond, config.sampling.guidance_scale)
    return float(counter.get_total_flops())


def matmul_peak(device: torch.device) -> float:
    """FLOP/s of a large square matmul, repeated after a warm-up: bf16 on CUDA, float32 on a CPU."""
    n, dtype, reps = (8192, torch.bfloat16, 50) if device.type == "cuda" else (1024, torch.float32, 10)
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    for _ in range(3):
        a @ b
    start = _clock(device)
    for _ in range(reps):
        a @ b
    return 2 * n**3 * reps / (_clock(device) - start)


def attention_kernels(model: FlowMatchingModel, cond: PromptEmbeddings, config: ExperimentConfig) -> list[str]:
    """Names of the attention ops and kernels that ran in one CFG forward."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if model.device.type == "cuda" else [])
    latents = torch.randn((1, *model.latent_shape(config.model.resolution)), device=model.device)
    with torch.no_grad(), profile(activities=activities) as prof:
        model.predict_velocity(latents, 0.5, cond, config.sampling.guidance_scale)
        _clock(model.device)
    names = {e.name for e in prof.events() if any(m in e.name.lower() for m in ATTENTION_MARKERS)}
    return sorted(name[:100] for name in names)  # CUDA kernel names are template instantiations, kilobytes long


def sampling_breakdown(trainer: Any, config: ExperimentConfig) -> dict[str, float]:
    """Seconds per sampling batch of one more epoch's rollout (the algorithm's sampler and sampling weights, no
    scoring): in the transformer's forwards, the VAE decode, the prompt encoding, and the rest (the SDE step and
    its log-prob, the noise, copies to the host). The device is synchronised around each timed call."""
    from components.flow_rl.rollout import sample_rollout

    model, s = trainer.model, config.sampling
    device = model.device
    spent = dict.fromkeys(("transformer", "vae_decode", "encode"), 0.0)

    def timed(fn: Callable[..., Any], key: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            start = _clock(device)
            result = fn(*args, **kwargs)
            spent[key] += _clock(device) - start
            return result
        return call

    prompts = epoch_prompts(config)
    sampler = trainer.algorithm.sampler_settings(torch.Generator().manual_seed(0), 0)
    model.predict_velocity = timed(model.predict_velocity, "transformer")  # instance attributes shadow the methods
    model.decode = timed(model.decode, "vae_decode")
    try:
        start = _clock(device)
        embeds = timed(trainer.prompts, "encode")([PromptRow(p) for p in prompts])
        with trainer.algorithm.sampling_weights():
            sample_rollout(model, prompts, s.group_size, s.batch_size_per_worker, sampler,
                           torch.Generator(device).manual_seed(0), embeds=embeds)
        total = _clock(device) - start
    finally:
        del model.predict_velocity, model.decode
    batches = len(epoch_batches(config))
    return {**{key: v / batches for key, v in spent.items()}, "rest": (total - sum(spent.values())) / batches,
            "total": total / batches}


def format_breakdown(b: dict[str, float]) -> str:
    """A sampling breakdown as one line of seconds per batch."""
    return (f"{b['total']:.3g} s a sampling batch: transformer {b['transformer']:.3g} s, VAE decode "
            f"{b['vae_decode']:.3g} s, prompt encoding {b['encode']:.3g} s, the rest {b['rest']:.3g} s")


def measure(cpu: bool, compile_: bool, epochs: int, uncond_grad: bool = True, algorithm: str = "flow_grpo",
            compare: bool = True) -> dict[str, Any]:
    """One setting in this (fresh) process: warm-up epoch, measured epochs, and, eager with the exact gradient and
    ``compare``, the comparisons."""
    from torch._dynamo.utils import counters

    from components.trainer.loop import Trainer

    config = workload(cpu, compile_, uncond_grad, algorithm)
    if cpu:
        # the tiny model's matmuls gain nothing from a second thread, and on a busy CI runner OpenMP's barrier
        # then waits a scheduler tick per op (measured here: 12 ms for a 32-wide linear with 2 threads, 0.1 ms
        # with 1)
        torch.set_num_threads(1)
    pipeline = None if cpu else real_shape_pipeline("sd35-medium", config, cpu=False)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(config, Path(tmp) / "run", log=lambda _m: None, pipeline=pipeline)
        device = trainer.model.device
        start = _clock(device)
        trainer.run_epoch()
        warmup_s = _clock(device) - start
        graphs_warmup = counters["stats"]["unique_graphs"]
        rows = [trainer.run_epoch() for _ in range(epochs)]
        graphs_measured = counters["stats"]["unique_graphs"]
        images = config.sampling.prompts_per_epoch * config.sampling.group_size
        sampling_s = sum(r["time/sampling"] for r in rows)
        out: dict[str, Any] = {
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
            "epoch_images_per_s": statistics.fmean(r["images_per_s"] for r in rows),
            "sampling_images_per_s": images * epochs / sampling_s,
            "training_images_per_s": images * epochs / sum(r["time/training"] for r in rows),
            "sampling_s_per_batch": sampling_s / (epochs * len(epoch_batches(config))),
            "warmup_s": warmup_s, "unique_graphs_warmup": graphs_warmup, "unique_graphs_measured": graphs_measured,
            "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
        }
        out["sampling_breakdown"] = sampling_breakdown(trainer, config)
        # eager: diffusers' call, the FLOP count and the profile see the plain model
        if not compile_ and uncond_grad and compare:
            cond = trainer.prompts([PromptRow(PROMPTS[0])])
            out["diffusers_s_per_batch"] = diffusers_seconds_per_batch(trainer, config)
            out["cfg_forward_flops"] = cfg_forward_flops(trainer.model, cond, config)
            out["peak_flops"] = matmul_peak(device)
            out["attention"] = attention_kernels(trainer.model, cond, config)
    return out


# -- the parent -----------------------------------------------------------------------------------

def _child(cpu: bool, compile_: bool, epochs: int, uncond_grad: bool = True, algorithm: str = "flow_grpo",
           compare: bool = True, inductor_cache: str | None = None,
           timeout: float | None = None) -> dict[str, Any] | None:
    """``measure`` in a fresh process (no compiled graph or dynamo cache carries over); None if it failed.
    ``inductor_cache``: a folder shared with other children (their warm-up is then not a fresh worker's)."""
    args = [sys.executable, __file__, "--child", "cpu" if cpu else "cuda", "on" if compile_ else "off", str(epochs),
            str(uncond_grad), algorithm, str(compare)]
    # on a GPU an empty inductor (and Triton) cache unless one is given: the warm-up pays the whole compile, as on a
    # fresh worker, and does not depend on what an earlier run left in /tmp. On a CPU the shared cache: the smoke
    # run's compile time is no figure to quote, and CI's tests have compiled the same tiny blocks already (saves ~45
    # s there)
    with tempfile.TemporaryDirectory() as empty:
        cache = inductor_cache or (None if cpu else empty)
        env = {**os.environ, **({"TORCHINDUCTOR_CACHE_DIR": cache} if cache else {})}
        try:
            proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=timeout)
        except subprocess.TimeoutExpired:
            print(f"{algorithm}, compile {'on' if compile_ else 'off'}: the child ran past {timeout:.0f} s")
            return None
    if proc.returncode:
        print(f"{algorithm}, compile {'on' if compile_ else 'off'}: the child failed (exit {proc.returncode}):\n"
              f"{proc.stderr[-3000:]}")
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _cells(results: dict[bool, dict[str, Any] | None], fmt: str,
           value: Callable[[dict[str, Any]], float | None]) -> str:
    """One table row's cells, compile off then on ('-' where that setting did not run or has no figure)."""
    cells = []
    for setting in (False, True):
        r = results.get(setting)
        v = value(r) if r is not None else None
        cells.append(f"{'-' if v is None else format(v, fmt):>12}")
    return "".join(cells)


def report(config: ExperimentConfig, results: dict[bool, dict[str, Any] | None], cpu: bool) -> None:
    """The comparisons, then the table: compile off and on side by side."""
    off = results.get(False)
    devices = sorted({r["device"] for r in results.values() if r})
    print(f"\nmeasured on: {', '.join(devices) or '-'}")
    per_image = forwards_per_image(config)
    floor = None
    if off is not None:
        flops, peak = off["cfg_forward_flops"], off["peak_flops"]
        floor = peak / (flops * per_image)
        print(f"FLOP floor: one CFG forward for one image F = {flops / 1e12:.4g} TFLOP; an image costs F x "
              f"{per_image:g} in an epoch; {'bf16' if not cpu else 'float32'} matmul peak "
              f"{peak / 1e12:.4g} TFLOP/s -> floor {floor:.4g} images/s"
              + (" (CPU attention is not counted by FlopCounterMode)" if cpu else ""))
        attention = off["attention"]
        print("attention ops and kernels: " + ("; ".join(attention) or "none seen"))
        if not cpu:
            fast = [n for n in attention if "flash" in n.lower() or "cudnn" in n.lower()]
            print(f"flash or cuDNN attention ran: {'yes' if fast else 'NO'}")
    diffusers_s = off["diffusers_s_per_batch"] if off is not None else None

    def ratio(r: dict[str, Any]) -> float | None:
        return r["sampling_s_per_batch"] / diffusers_s if diffusers_s else None

    def fraction(r: dict[str, Any]) -> float | None:
        return r["epoch_images_per_s"] / floor if floor else None

    print(f"\n{'':<40}{'compile off':>12}{'compile on':>12}")
    for label, fmt, value in (
        ("epoch images/s", ".4g", lambda r: r["epoch_images_per_s"]),
        ("sampling images/s", ".4g", lambda r: r["sampling_images_per_s"]),
        ("training images/s", ".4g", lambda r: r["training_images_per_s"]),
        ("sampling s per batch", ".4g", lambda r: r["sampling_s_per_batch"]),
        (f"sampling / diffusers (target <= {TARGET_SAMPLER_RATIO})", ".3f", ratio),
        ("fraction of the FLOP floor", ".1%", fraction),
        ("warm-up epoch s (compiles)", ".1f", lambda r: r["warmup_s"]),
    ):
        print(f"{label:<40}{_cells(results, fmt, value)}")
    graphs = ["-" if r is None else f"{r['unique_graphs_warmup']} / {r['unique_graphs_measured']}"
              for r in (results.get(False), results.get(True))]
    print(f"{'unique graphs after warm-up / measured':<40}" + "".join(f"{g:>12}" for g in graphs))
    if diffusers_s is not None:
        print(f"diffusers __call__ (eager, LoRA disabled): {diffusers_s:.4g} s per batch")
    for setting, r in results.items():
        if r is not None:
            print(f"compile {'on' if setting else 'off'}: {format_breakdown(r['sampling_breakdown'])}")
    recompiled = [r for r in results.values() if r and r["unique_graphs_measured"] != r["unique_graphs_warmup"]]
    if recompiled:
        print("RECOMPILED: the measured epochs compiled new graphs")
    on = results.get(True)
    if off is not None and on is not None:
        print(f"compile on / off: epoch images/s x{on['epoch_images_per_s'] / off['epoch_images_per_s']:.2f}, "
              f"sampling x{on['sampling_images_per_s'] / off['sampling_images_per_s']:.2f}, "
              f"training x{on['training_images_per_s'] / off['training_images_per_s']:.2f}")
    if not cpu:
        target = REFERENCE_IMAGES_PER_S * TARGET_SPEEDUP
        here = ", ".join(f"compile {'on' if setting else 'off'} {r['epoch_images_per_s']:.3g} images/s = "
                         f"{r['epoch_images_per_s'] / REFERENCE_IMAGES_PER_S:.2f}x"
                         for setting, r in results.items() if r)
        print(f"reference: one H100, the paper's code on the same work: {REFERENCE_IMAGES_PER_S} images/s; target "
              f"{TARGET_SPEEDUP}x = {target:.2f} images/s; here ({', '.join(devices)}): {here or '-'}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--compile", default="off,on", help="compile settings to run, of off,on")
    parser.add_argument("--epochs", type=int, default=None, help="measured epochs (default 2 on a GPU, 3 on a CPU)")
    parser.add_argument("--child", nargs=6, metavar=("DEVICE", "COMPILE", "EPOCHS", "UNCOND_GRAD", "ALGORITHM",
                                                     "COMPARE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        device, setting, epochs, uncond_grad, algorithm, compare = args.child
        print(json.dumps(measure(device == "cpu", setting == "on", int(epochs), uncond_grad == "True", algorithm,
                                 compare == "True")))
        return 0
    cpu = not torch.cuda.is_available()
    epochs = args.epochs if args.epochs is not None else 3 if cpu else 2
    if epochs < 1:
        parser.error("--epochs: at least 1")
    names = [s.strip() for s in args.compile.split(",") if s.strip()]
    if not names or set(names) - {"off", "on"}:
        parser.error(f"--compile: a list of off and on, got {args.compile!r}")
    settings = [name == "on" for name in dict.fromkeys(names)]
    config = workload(cpu, False)
    # the device's name comes from the children: asking here would hold a CUDA context while they run
    where = "CPU (no CUDA visible)" if cpu else "CUDA"
    print(f"{where}: {describe(config, cpu)}; 1 warm-up + {epochs} measured epoch(s) per compile setting")
    results: dict[bool, dict[str, Any] | None] = {}
    for compile_ in settings:
        start = time.perf_counter()
        results[compile_] = _child(cpu, compile_, epochs)
        print(f"compile {'on' if compile_ else 'off'}: {time.perf_counter() - start:.0f} s in all")
    report(config, results, cpu)
    # train.cfg_uncond_grad false (eager): the unconditional CFG branch without gradient, a different gradient;
    # compared with compile off, so only run beside it
    off = results.get(False)
    detached = _child(cpu, False, epochs, uncond_grad=False) if False in results else None
    if detached is not None and off is not None:
        print(f"train.cfg_uncond_grad false / true (compile off): training images/s "
              f"x{detached['training_images_per_s'] / off['training_images_per_s']:.2f}, epoch images/s "
              f"x{detached['epoch_images_per_s'] / off['epoch_images_per_s']:.2f}")
    # timings never fail the run; a setting that crashed does (its error was printed above)
    return 1 if None in results.values() or (False in results and detached is None) else 0


if __name__ == "__main__":
    sys.exit(main())
