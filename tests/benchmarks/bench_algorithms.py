"""FlowGRPO, GRPO-Guard and DiffusionNFT side by side: what each learns on the shapes demo in the same wall-clock,
and (``--throughput``) the images/s of each at the SD3.5-Medium shape on a GPU.

    python tests/benchmarks/bench_algorithms.py [--minutes 12] [--seeds 0 1 2] [--plot docs/algorithms.png]
    python tests/benchmarks/bench_algorithms.py --throughput [--epochs 2] [--compile]

Learning: each algorithm trains the shipped demo (`flowgrpo run --local`, shapes-cpu) with its settings below, the
same seeds and prompts, for the epochs that take ``--minutes`` of training on this machine (each algorithm's epoch
time is measured first: the median of 3 epochs after a warm-up one, in this process). Equal wall-clock, not equal
epochs: an algorithm whose epoch is cheaper gets more of them. Printed: per algorithm, epochs, images sampled,
training minutes; the sample grid's held-out partial score (16 held-out prompts, fixed noise) at epoch 0 and at the
end, mean over seeds with a 95% t-interval; the evaluation's held-out partial and strict deltas (the demo's
`eval.max_prompts` prompts x 2 images, paired bootstrap CI per run, t-interval over seeds); and the wall-clock
each algorithm takes to reach FlowGRPO's final held-out gain. The plot draws the held-out gain against training
minutes and against images sampled (mean over seeds, 95% band).

Throughput: bench_gpu_throughput's per-worker epoch of each algorithm's SD3.5-Medium recipe (random real-shape
weights; compile off, or on with ``--compile``), one warm-up and ``--epochs`` measured epochs in a fresh process
each: images/s of the epoch, of sampling and of training, the peak memory, and where a sampling batch's time goes.
Without a GPU the tiny model stands in (a smoke run, no figures).

`--smoke` (a few epochs, 10 eval prompts, one seed) checks the script runs; its figures mean nothing. `--report
--workdir DIR` prints the table (and `--plot`) of the seeds whose runs all finished there, e.g. after a stop. Run
again with the same `--workdir`, the benchmark continues: the epochs measured the first time (DIR/epochs.json), the
finished runs read back, a run cut short started over, so seeds can be added later.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_demo_learning, bench_gpu_throughput

from bench_demo_learning import SMOKE, read_run, run_seed  # noqa: E402  (its import sets HF_HUB_OFFLINE)

# What selects each algorithm on the demo, whatever the demo's own default: its published settings where they carry
# over to a 10-step, 600k-parameter LoRA model, else the demo's. FlowGRPO samples by SDE on a window of 2 of the
# first 5 steps and trains on those; DiffusionNFT trains on 2 of the 10 rollout noise levels per image, as many, so
# an epoch of either costs about the same; its other settings are NVlabs' defaults (docs/ALGORITHM.md section 9).
# MixGRPO: a window of 2 of 10 steps (the published 4 of 25) moving every 10 epochs; Flash adds DPM-Solver++(2M)
# on 40% of the points after the window (section 12). DanceGRPO: Dance-SDE at eta 0.3, one initial noise per
# group, int((N - 1) 0.6) = 5 of 10 steps trained, clip 1e-4, per-group advantages (section 13). AWM: the authors'
# geneval recipe as first published, ODE rollouts, 90% of the levels, KL 0.003 (their current GenEval recipe's
# is 0.001, OCR's 0.003), every sample trained, one optimizer step an epoch
# (section 11). Online DPO: beta 100, 99% of the levels, the 8 groups' pairs in one micro-batch and one optimizer
# step an epoch, as the authors (section 14).
FLOW_GRPO = ["train.algorithm=flow_grpo", "sampling.sde_window={size: 2, range: [0, 5]}"]
MIX_GRPO = ["train.algorithm=mix_grpo", "sampling.sde_window=null", "train.mix_grpo.window_size=2",
            "train.mix_grpo.stride=1", "train.mix_grpo.shift_interval=10"]
ALGORITHMS: dict[str, list[str]] = {
    "flow_grpo": FLOW_GRPO,
    "grpo_guard": [*FLOW_GRPO, "train.grpo_guard=true"],
    "diffusion_nft": ["train.algorithm=diffusion_nft", "sampling.sde_window=null", "train.timestep_fraction=0.2"],
    "mix_grpo": MIX_GRPO,
    "mix_grpo_flash": [*MIX_GRPO, "train.mix_grpo.ode_solver=dpm2", "train.mix_grpo.tail_ratio=0.4",
                       "train.mix_grpo.shift_interval=8"],
    "dance_grpo": ["train.algorithm=flow_grpo", "sampling.sde_type=dance", "sampling.noise_level=0.3",
                   "sampling.same_initial_noise=true", "sampling.sde_window=null", "train.timestep_fraction=0.5",
                   "train.clip_range=1e-4", "train.advantage_std=group"],
    "awm": ["train.algorithm=awm", "sampling.sde_window=null", "train.timestep_fraction=0.9", "train.beta=0.003",
            "train.skip_zero_advantage=false", "train.gradient_accumulation_steps=4"],
    "dpo": ["train.algorithm=dpo", "sampling.sde_window=null", "train.timestep_fraction=0.99"],
}
REWARD = "geneval"  # the demo's training reward and the sample grid's held-out curve (partial score)
STRICT = "geneval_strict"
CALIBRATION_EPOCHS = 4
# the shipped demo (shapes-cpu.yaml): its algorithm and epochs, and its held-out gain on the evaluation's partial
# score at those epochs, mean of 3 seeds (docs/MODELS.md, "What RL does with it"): the target of --demo-fraction
DEMO_ALGORITHM = "diffusion_nft"
DEMO_EPOCHS = 150
DEMO_GAIN = 0.130
CURVE_POINTS = 8  # sample-grid evaluations per run besides epoch 0
PLAN_FILE = "epochs.json"  # in --workdir: the epochs each algorithm gets


# -- statistics -------------------------------------------------------------------------------------

def t_interval(values: list[float]) -> tuple[float, float, float]:
    """Mean and its 95% t-interval over independent runs (NaN bounds for a single run)."""
    from scipy import stats

    mean = statistics.fmean(values)
    if len(values) < 2:
        return mean, math.nan, math.nan
    half = stats.t.ppf(0.975, len(values) - 1) * statistics.stdev(values) / math.sqrt(len(values))
    return mean, mean - half, mean + half


def _fmt(mean: float, low: float, high: float, digits: int = 3) -> str:
    interval = "" if math.isnan(low) else f" [{low:+.{digits}f}, {high:+.{digits}f}]"
    return f"{mean:+.{digits}f}{interval}"


# -- the runs ---------------------------------------------------------------------------------------

def epoch_seconds(algorithms: list[str], overrides: list[str]) -> dict[str, float]:
    """Median training seconds of an epoch of the demo per algorithm, after a first (warm-up) epoch each, measured
    side by side: the algorithms take their epochs in turn, so a burst of other work on the machine lands on all."""
    from components.trainer import loop
    from pipeline.config import DEFAULT_CONFIG, load_config

    seconds: dict[str, list[float]] = {a: [] for a in algorithms}
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {}
        for algorithm in algorithms:
            config = load_config(DEFAULT_CONFIG, [*ALGORITHMS[algorithm], *overrides, "tracking.sample_every=0",
                                                  "tracking.system_metrics=false", "train.checkpoint_every=1000"])
            trainers[algorithm] = loop.Trainer(config, Path(tmp) / algorithm, log=lambda _m: None)
            trainers[algorithm].run_epoch()
        for _ in range(CALIBRATION_EPOCHS - 1):
            for algorithm, trainer in trainers.items():
                start = time.perf_counter()
                trainer.run_epoch()
                seconds[algorithm].append(time.perf_counter() - start)
    return {a: statistics.median(s) for a, s in seconds.items()}  # a burst moves the mean, not the median


def curve(history: list[dict], images_per_epoch: int, epoch_seconds: float | None = None) -> dict[str, np.ndarray]:
    """The held-out gain at each epoch that sampled the grid, with the training minutes and images to it. The
    minutes count ``epoch_seconds`` per epoch where given (the epoch time measured side by side when the budgets
    were planned: other work on the machine during a run then moves no curve), else each row's own times."""
    base = history[0][f"heldout/{REWARD}/base"]
    minutes, images, gains = [0.0], [0.0], [0.0]
    elapsed = 0.0
    for row in history:
        elapsed += epoch_seconds if epoch_seconds is not None else (
            row["time/sampling"] + row["time/scoring"] + row["time/training"])
        value = row.get(f"heldout/{REWARD}/mean")
        if value is not None:
            minutes.append(elapsed / 60)
            images.append(row["epoch"] * images_per_epoch)
            gains.append(value - base)
    return {"minutes": np.array(minutes), "images": np.array(images), "gain": np.array(gains)}


def band(curves: list[dict[str, np.ndarray]], axis: str, grid: np.ndarray) -> tuple[np.ndarray, ...]:
    """Mean held-out gain over runs at ``grid`` on ``axis`` (each run interpolated) and its 95% t-band."""
    at = np.array([np.interp(grid, c[axis], c["gain"]) for c in curves])
    rows = [t_interval(list(at[:, i])) for i in range(len(grid))]
    return tuple(np.array(v) for v in zip(*rows, strict=True))


def reach_minutes(curves: list[dict[str, np.ndarray]], target: float) -> float:
    """Training minutes after which the seeds' mean held-out gain first reaches ``target`` (NaN if never)."""
    end = min(c["minutes"][-1] for c in curves)
    grid = np.linspace(0, end, 200)
    mean = band(curves, "minutes", grid)[0]
    hit = np.nonzero(mean >= target)[0]
    return float(grid[hit[0]]) if len(hit) else math.nan


# -- output -----------------------------------------------------------------------------------------

def report(results: dict[str, list[dict]], epochs: dict[str, int], images_per_epoch: int) -> None:
    curves = {a: [curve(r["history"], images_per_epoch, r.get("epoch_seconds")) for r in runs]
              for a, runs in results.items()}
    reference = next(iter(results))
    target = t_interval([c["gain"][-1] for c in curves[reference]])[0]
    reference_minutes = statistics.fmean(c["minutes"][-1] for c in curves[reference])
    print(f"\n| algorithm | epochs | images | training min | grid held-out {REWARD}: epoch 0 -> end | gain [95% CI] "
          f"| eval {REWARD} delta [95% CI] | eval {STRICT} delta [95% CI] | per-run eval CI above 0 "
          f"| min to {reference}'s final gain |")
    print("|---" * 10 + "|")
    for algorithm, runs in results.items():
        c = curves[algorithm]
        base = statistics.fmean(r["history"][0][f"heldout/{REWARD}/base"] for r in runs)
        end = statistics.fmean(r["history"][0][f"heldout/{REWARD}/base"] + cc["gain"][-1]
                               for r, cc in zip(runs, c, strict=True))
        gain = t_interval([cc["gain"][-1] for cc in c])
        partial = t_interval([r["eval"]["rewards"][REWARD]["delta"] for r in runs])
        strict = t_interval([r["eval"]["rewards"][STRICT]["delta"] for r in runs])
        above = sum(r["eval"]["rewards"][k]["ci_low"] > 0 for r in runs for k in (REWARD, STRICT))
        reach = reach_minutes(c, target)
        reach_cell = ("-" if target <= 0 else "not reached" if math.isnan(reach)  # a reference that gained nothing
                      else f"{reach:.1f} ({reach / reference_minutes:.2f}x)")
        minutes = statistics.fmean(cc["minutes"][-1] for cc in c)
        print(f"| {algorithm} | {epochs[algorithm]} | {epochs[algorithm] * images_per_epoch} | {minutes:.1f} "
              f"| {base:.3f} -> {end:.3f} | {_fmt(*gain)} | {_fmt(*partial)} | {_fmt(*strict)} "
              f"| {above} of {2 * len(runs)} | {reach_cell} |")
    print(f"\nseeds {[r['seed'] for r in results[reference]]}; {reference}'s final grid gain {target:+.3f} after "
          f"{reference_minutes:.1f} min; eval CIs: paired bootstrap per run, t-interval of the deltas over seeds")
    partials = {a: t_interval([r["eval"]["rewards"][REWARD]["delta"] for r in runs]) for a, runs in results.items()}
    best = max(partials, key=lambda a: partials[a][0])
    reached = [a for a, (mean, _, _) in partials.items() if mean >= DEMO_GAIN]
    print(f"the demo's {DEMO_EPOCHS}-epoch held-out gain (eval {REWARD}, docs/MODELS.md) {DEMO_GAIN:+.3f} is reached "
          f"(mean eval delta at or above it) by: {', '.join(reached) or 'none'}; the best is {best}, "
          f"{_fmt(*partials[best])}")
    for algorithm, runs in results.items():
        per_run = "; ".join(f"seed {r['seed']}: {REWARD} {r['eval']['rewards'][REWARD]['delta']:+.3f} "
                            f"[{r['eval']['rewards'][REWARD]['ci_low']:+.3f}, "
                            f"{r['eval']['rewards'][REWARD]['ci_high']:+.3f}], {STRICT} "
                            f"{r['eval']['rewards'][STRICT]['delta']:+.3f}" for r in runs)
        print(f"{algorithm}: {per_run}")


def plot(results: dict[str, list[dict]], images_per_epoch: int, path: Path) -> None:
    """Held-out gain against training minutes and against images sampled, one line and band per algorithm."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for algorithm, runs in results.items():
        curves = [curve(r["history"], images_per_epoch, r.get("epoch_seconds")) for r in runs]
        for ax, axis, label in ((axes[0], "minutes", "training minutes (2 CPU cores)"),
                                (axes[1], "images", "images sampled")):
            grid = np.linspace(0, min(c[axis][-1] for c in curves), 60)
            mean, low, high = band(curves, axis, grid)
            (line,) = ax.plot(grid, mean, label=algorithm)
            if len(runs) > 1:
                ax.fill_between(grid, low, high, color=line.get_color(), alpha=0.2)
            ax.set_xlabel(label)
    axes[0].set_ylabel(f"held-out {REWARD} (partial) gain over the base")
    for ax in axes:
        ax.axhline(0, color="grey", linewidth=0.8)
        ax.grid(alpha=0.3)
    axes[0].legend()
    seeds = len(next(iter(results.values())))
    fig.suptitle(f"shapes demo: sample-grid held-out gain, mean of {seeds} seed(s), 95% band")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"plot: {path}")


# -- the legs ---------------------------------------------------------------------------------------

def learning(args: argparse.Namespace) -> None:
    from pipeline.config import DEFAULT_CONFIG, load_config

    shared = [*SMOKE, *args.overrides] if args.smoke else args.overrides
    config = load_config(DEFAULT_CONFIG, shared)
    images_per_epoch = config.sampling.prompts_per_epoch * config.sampling.group_size
    root = args.workdir or Path(tempfile.mkdtemp(prefix="bench-algorithms-"))
    epochs = plan_epochs(args, shared, root)
    seconds = planned_seconds(root)
    results: dict[str, list[dict]] = {a: [] for a in args.algorithms}
    for seed in args.seeds:
        for algorithm in args.algorithms:
            workdir = run_dir(root, algorithm, seed)
            if finished(workdir):  # in an earlier invocation
                print(f"seed {seed}, {algorithm}: finished before, read from {workdir}", flush=True)
                results[algorithm].append({**read_run(seed, workdir), "epoch_seconds": seconds.get(algorithm)})
                continue
            if workdir.exists():  # a run cut short: its pipeline starts over
                shutil.rmtree(workdir)
            every = max(1, epochs[algorithm] // CURVE_POINTS)
            overrides = [*ALGORITHMS[algorithm], *shared, f"train.epochs={epochs[algorithm]}",
                         f"tracking.sample_every={every}"]
            print(f"seed {seed}, {algorithm}: flowgrpo run --local seed={seed} {' '.join(overrides)}", flush=True)
            results[algorithm].append({**run_seed(seed, workdir, overrides), "epoch_seconds": seconds.get(algorithm)})
            print(f"seed {seed}, {algorithm}: {results[algorithm][-1]['wall'] / 60:.1f} min", flush=True)
    report(results, epochs, images_per_epoch)
    if args.plot:
        plot(results, images_per_epoch, args.plot)


def run_dir(root: Path, algorithm: str, seed: int) -> Path:
    """The work directory of one algorithm's run of one seed."""
    return root / f"{algorithm}-seed-{seed}"


def finished(workdir: Path) -> bool:
    """Whether the `run --local` in ``workdir`` got as far as its evaluation (what ``read_run`` reads)."""
    return any(workdir.glob("runs/*/eval/eval.json"))


def plan_epochs(args: argparse.Namespace, shared: list[str], root: Path) -> dict[str, int]:
    """Each algorithm's epochs in ``--minutes`` of training (with ``--demo-fraction``: that share of the demo's
    DEMO_EPOCHS epochs of its own algorithm), measured here, or read from ``root/epochs.json`` where an earlier
    invocation measured them: seeds added later get the same budgets. An algorithm added later is measured side by
    side with the first one planned, and its epoch time scaled by that one's ratio of then to now."""
    plan_file = root / PLAN_FILE
    if args.smoke:
        return dict.fromkeys(args.algorithms, 2)
    if plan_file.exists():
        plan = json.loads(plan_file.read_text())
        if plan["budget"] != budget_name(args):
            sys.exit(f"{plan_file} holds the epochs of {plan['budget']}: use another --workdir for "
                     f"{budget_name(args)}")
        missing = [a for a in args.algorithms if a not in plan["epochs"]]
        if missing:
            reference = next(iter(plan["seconds"]))
            now = epoch_seconds([reference, *missing], shared)
            scale = plan["seconds"][reference] / now[reference]
            print(f"{', '.join(missing)}: measured beside {reference} ({now[reference]:.2f} s an epoch now, "
                  f"{plan['seconds'][reference]:.2f} s when planned: x{scale:.2f})", flush=True)
            for algorithm in missing:
                plan["seconds"][algorithm] = now[algorithm] * scale
                plan["epochs"][algorithm] = max(1, round(plan["minutes"] * 60 / plan["seconds"][algorithm]))
            plan_file.write_text(json.dumps(plan))
        print(f"epochs from {plan_file}: {plan['epochs']}", flush=True)
        return {a: plan["epochs"][a] for a in args.algorithms}
    measure = list(dict.fromkeys([*args.algorithms, DEMO_ALGORITHM] if args.demo_fraction else args.algorithms))
    seconds = epoch_seconds(measure, shared)
    minutes = args.minutes
    if args.demo_fraction:
        demo = DEMO_EPOCHS * seconds[DEMO_ALGORITHM] / 60
        minutes = args.demo_fraction * demo
        print(f"the demo ({DEMO_ALGORITHM}, {DEMO_EPOCHS} epochs) trains {demo:.1f} min here: "
              f"{args.demo_fraction:g} of it is {minutes:.2f} min", flush=True)
    epochs = {}
    for algorithm in args.algorithms:
        epochs[algorithm] = max(1, round(minutes * 60 / seconds[algorithm]))
        print(f"{algorithm}: {seconds[algorithm]:.2f} s an epoch -> {epochs[algorithm]} epochs in {minutes:.2f} min",
              flush=True)
    root.mkdir(parents=True, exist_ok=True)
    plan_file.write_text(json.dumps({"budget": budget_name(args), "minutes": minutes, "epochs": epochs,
                                     "seconds": {a: seconds[a] for a in args.algorithms}}))
    return epochs


def planned_seconds(root: Path) -> dict[str, float]:
    """The epoch times measured side by side when ``root``'s budgets were planned (none for a smoke run)."""
    plan_file = root / PLAN_FILE
    return json.loads(plan_file.read_text()).get("seconds", {}) if plan_file.exists() else {}


def budget_name(args: argparse.Namespace) -> str:
    return f"{args.demo_fraction:g} of the demo" if args.demo_fraction else f"{args.minutes:g} min"


def report_finished(args: argparse.Namespace) -> None:
    """The table and plot of the runs already finished under ``--workdir`` (a benchmark stopped early)."""
    from pipeline.config import DEFAULT_CONFIG, load_config

    config = load_config(DEFAULT_CONFIG, args.overrides)
    images_per_epoch = config.sampling.prompts_per_epoch * config.sampling.group_size
    seconds = planned_seconds(args.workdir)
    results: dict[str, list[dict]] = {a: [] for a in args.algorithms}
    for seed in args.seeds:
        if all(finished(run_dir(args.workdir, a, seed)) for a in args.algorithms):
            for algorithm in args.algorithms:
                results[algorithm].append({**read_run(seed, run_dir(args.workdir, algorithm, seed)),
                                           "epoch_seconds": seconds.get(algorithm)})
    if not results[args.algorithms[0]]:
        sys.exit(f"no seed has a finished run of every algorithm under {args.workdir}")
    report(results, {a: len(runs[0]["history"]) for a, runs in results.items()}, images_per_epoch)
    if args.plot:
        plot(results, images_per_epoch, args.plot)


def throughput(args: argparse.Namespace) -> None:
    import torch
    from bench_gpu_throughput import _child, describe, format_breakdown, workload

    cpu = not torch.cuda.is_available()
    epochs = args.epochs if args.epochs is not None else 3 if cpu else 2
    print(f"{'CPU (no CUDA visible)' if cpu else 'CUDA'}, compile {'on' if args.compile else 'off'}, 1 warm-up + "
          f"{epochs} measured epoch(s) each")
    rows = {}
    for algorithm in args.algorithms:
        print(f"{algorithm}: {describe(workload(cpu, args.compile, algorithm=algorithm), cpu)}", flush=True)
        rows[algorithm] = _child(cpu, args.compile, epochs, algorithm=algorithm, compare=False)
        print(f"{algorithm}: {rows[algorithm]}", flush=True)  # each as it ends: a run cut short keeps them
    reference = rows.get(args.algorithms[0])
    devices = sorted({r["device"] for r in rows.values() if r})
    print(f"\nmeasured on: {', '.join(devices) or '-'}")
    print(f"| algorithm | epoch images/s | x {args.algorithms[0]} | sampling images/s | training images/s "
          "| peak GiB | warm-up s |")
    print("|---" * 7 + "|")
    for algorithm, r in rows.items():
        if r is None:
            print(f"| {algorithm} | failed |" + " |" * 5)
            continue
        ratio = r["epoch_images_per_s"] / reference["epoch_images_per_s"] if reference else math.nan
        peak = "-" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
        print(f"| {algorithm} | {r['epoch_images_per_s']:.3g} | {ratio:.2f} | {r['sampling_images_per_s']:.3g} "
              f"| {r['training_images_per_s']:.3g} | {peak} | {r['warmup_s']:.0f} |")
    print("\nwhere a sampling batch's time goes (one more epoch's rollout, no scoring, the device synchronised around "
          "each part):")
    for algorithm, r in rows.items():
        if r is not None:
            print(f"{algorithm}: {format_breakdown(r['sampling_breakdown'])}")
    if None in rows.values():
        sys.exit(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=list(ALGORITHMS),
                        help="the first is the reference")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--minutes", type=float, default=12.0, help="training wall-clock per run")
    parser.add_argument("--demo-fraction", type=float, default=None,
                        help=f"instead of --minutes: this share of the demo's {DEMO_EPOCHS}-epoch training time, "
                             "measured here; the report says which algorithms reach the demo's held-out gain")
    parser.add_argument("--workdir", type=Path, help="keep each run's work directory under this folder")
    parser.add_argument("--plot", type=Path, help="write the held-out curves here (PNG)")
    parser.add_argument("--smoke", action="store_true", help="2 epochs each, 10 eval prompts: checks the script")
    parser.add_argument("--throughput", action="store_true", help="images/s per algorithm (SD3.5-M shape on a GPU)")
    parser.add_argument("--report", action="store_true",
                        help="only the table (and --plot) of the seeds whose runs all finished under --workdir")
    parser.add_argument("--epochs", type=int, help="--throughput: measured epochs (default 2 on a GPU, 3 on a CPU)")
    parser.add_argument("--compile", action="store_true", help="--throughput: with train.compile on")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value", help="for every run of the learning leg")
    args = parser.parse_args()
    if args.minutes <= 0:
        parser.error("--minutes: above 0")
    if args.demo_fraction is not None and args.demo_fraction <= 0:
        parser.error("--demo-fraction: above 0")
    if args.report and args.workdir is None:
        parser.error("--report reads --workdir")
    if args.throughput:
        throughput(args)
    elif args.report:
        report_finished(args)
    else:
        learning(args)


if __name__ == "__main__":
    main()
