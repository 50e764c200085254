"""Every GPU figure still open, in one call that ends before a deadline: the measured memory of each GPU recipe and
the throughput of the algorithms not yet measured with ``train.compile`` on.

    python tests/benchmarks/bench_open_gpu_figures.py --out DIR [--deadline-s 540]
        [--recipes flux2-klein-pickscore,...] [--algorithms flow_grpo,mix_grpo,...]

1. Memory (bench_memory.py's GPU leg): each recipe's epoch at its own setting, one unsharded worker, eager, random
   real-shape weights, ``torch.cuda.max_memory_allocated`` per phase beside the estimate. Each recipe runs in a
   fresh process; several run at once where their estimated peaks (x 1.25, + 3 GiB) fit the device together and
   their float32 builds fit host memory (a process's own allocations are what it measures, so the figures do not
   depend on its neighbours).
2. Throughput (bench_algorithms.py's GPU leg, compile on, 1 warm-up + ``--epochs`` measured): each algorithm alone
   on the device once the memory jobs are done, the first listed being the reference of the ratios. The children
   share one inductor cache: the first compiles cold, the rest reuse its blocks, so their warm-up is not a fresh
   worker's (the measured epochs are unaffected).

A job starts only when the time left covers its expected duration, and is stopped at the deadline; what did not
run is listed. After every job ``DIR/open_gpu_figures.json`` and ``DIR/open_gpu_figures.md`` are rewritten, so a
call cut short keeps what it measured. Without a GPU (``--smoke``, CI): the first recipe's memory job at
bench_memory's reduced CPU shape and the first algorithm's tiny throughput job, eager, through the same scheduling
and files.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench_memory, bench_gpu_throughput

import bench_gpu_throughput
import bench_memory
import psutil
import torch

GIB = 2**30
# the memory GPU leg not yet run for any recipe: the ones that are only estimated first, the three the H100
# calibration covers last
MEMORY_RECIPES = ("flux2-klein-pickscore", "zimage-pickscore", "wan21-t2v-1.3b-pickscore", "sd35-large-ocr",
                  "flux2-klein-edit", "flux1-kontext-edit", "wan21-i2v-14b-480p", "qwenimage-edit-2509",
                  "sd35-medium-ocr", "flux1-dev-pickscore", "qwenimage-ocr")
# FlowGRPO (the reference, measured 2026-11-27) beside the four whose compile-on figure is open
THROUGHPUT_ALGORITHMS = ("flow_grpo", "mix_grpo", "mix_grpo_flash", "dance_grpo", "grpo_guard")
# expected seconds of a job on an H100/H200 (build on the host, one epoch); a job starts only if they fit
MEMORY_JOB_S, BIG_MEMORY_JOB_S, BIG_PARAMS = 75.0, 150.0, 10e9
THROUGHPUT_FIRST_S, THROUGHPUT_WARM_S = 150.0, 90.0
GPU_MARGIN, GPU_SLACK_GIB = 1.25, 3.0


class Deadline:
    def __init__(self, seconds: float) -> None:
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


class Results:
    """What has been measured so far, rewritten as JSON and markdown after every job."""

    def __init__(self, out: Path, device: str) -> None:
        self.out = out
        self.data: dict[str, Any] = {"device": device, "date": datetime.date.today().isoformat(),
                                     "weights": "random, real transformer and VAE shapes; text encoders 2 layers",
                                     "memory": [], "throughput": [], "not_run": [], "failed": []}

    def add(self, key: str, row: dict[str, Any]) -> None:
        self.data[key].append(row)
        self.write()

    def write(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "open_gpu_figures.json").write_text(json.dumps(self.data, indent=1))
        (self.out / "open_gpu_figures.md").write_text(markdown(self.data))


def markdown(data: dict[str, Any]) -> str:
    lines = [f"Measured on {data['device']}, {data['date']} ({data['weights']}).", "",
             "| recipe | checkpointing | offload | start GiB | sampling GiB | training GiB | estimate GiB | "
             "measured / estimated |", "|---" * 8 + "|"]
    for r in data["memory"]:
        peak = max(r.get("sampling_peak_gib", math.nan), r.get("training_peak_gib", math.nan))
        lines.append(f"| {r['recipe']} | {r['gradient_checkpointing']} | {r['offload_text_encoders']} | "
                     f"{r.get('start_peak_gib', math.nan):.1f} | {r.get('sampling_peak_gib', math.nan):.1f} | "
                     f"{r.get('training_peak_gib', math.nan):.1f} | {r.get('estimate_gib', math.nan):.1f} | "
                     f"{peak / r.get('estimate_gib', math.nan):.2f} |")
    lines += ["", "| algorithm | epoch images/s | x the first | sampling images/s | training images/s | peak GiB | "
              "warm-up s |", "|---" * 7 + "|"]
    reference = data["throughput"][0]["epoch_images_per_s"] if data["throughput"] else math.nan
    for r in data["throughput"]:
        peak = "-" if r.get("peak_gib") is None else f"{r['peak_gib']:.1f}"
        lines.append(f"| {r['algorithm']} | {r['epoch_images_per_s']:.3g} | "
                     f"{r['epoch_images_per_s'] / reference:.2f} | {r['sampling_images_per_s']:.3g} | "
                     f"{r['training_images_per_s']:.3g} | {peak} | {r['warmup_s']:.0f} |")
    for key in ("not_run", "failed"):
        if data[key]:
            lines += ["", f"{key.replace('_', ' ')}: " + "; ".join(data[key])]
    return "\n".join(lines) + "\n"


def estimates(recipes: list[str], path: Path | None) -> dict[str, float]:
    """Each recipe's estimated GPU-leg peak; read from ``path`` where it holds them (the estimator runs on fake
    tensors, the same on any machine, but takes seconds a recipe in one thread), else computed and written there."""
    known = json.loads(path.read_text()) if path is not None and path.exists() else {}
    for recipe in recipes:
        if recipe not in known:
            known[recipe] = bench_memory.gpu_estimate(recipe, *bench_memory.own_setting(recipe))
    if path is not None:
        path.write_text(json.dumps(known, indent=1))
    return known


def memory_job(recipe: str, cpu: bool, timeout: float, estimate: float) -> dict[str, Any]:
    """One recipe's memory epoch: on a GPU its own setting beside the estimate; on a CPU (smoke) the reduced shape."""
    if not cpu:
        ckpt, offload = bench_memory.own_setting(recipe)
        return bench_memory.gpu_row(recipe, ckpt, offload, timeout, estimate)
    got = bench_memory._child([bench_memory.RECIPES[recipe], "cpu", "False", "False"], timeout)
    return {"recipe": recipe, "gradient_checkpointing": False, "offload_text_encoders": False,
            "start_peak_gib": got["start_above_start_mib"] / 1024,
            "sampling_peak_gib": got["sampling_above_start_mib"] / 1024,
            "training_peak_gib": got["training_above_start_mib"] / 1024, "estimate_gib": math.nan}


def memory_leg(recipes: list[str], cpu: bool, deadline: Deadline, results: Results,
               estimates_path: Path | None) -> None:
    """Recipes in order, as many at once as device and host memory allow by their estimates."""
    import real_shapes

    params = {r: real_shapes.transformer_param_count(bench_memory.RECIPES[r]) for r in recipes}
    expected = {r: BIG_MEMORY_JOB_S if params[r] > BIG_PARAMS else MEMORY_JOB_S for r in recipes}
    estimate = {r: math.nan for r in recipes} if cpu else estimates(recipes, estimates_path)
    if cpu:
        gpu_total, need = math.inf, {r: (0.0, 0.0) for r in recipes}
    else:
        gpu_total = torch.cuda.get_device_properties(0).total_memory / GIB * 0.95
        need = {}
        for recipe in recipes:
            # the float32 build, then its bf16 copy, in host memory
            need[recipe] = (estimate[recipe] * GPU_MARGIN + GPU_SLACK_GIB, params[recipe] * 4 * 1.25 / GIB + 8)
            print(f"{recipe}: estimated {estimate[recipe]:.1f} GiB, reserving {need[recipe][0]:.0f} GiB of the "
                  f"device and {need[recipe][1]:.0f} GiB of host memory", flush=True)
    host_total = psutil.virtual_memory().available / GIB * 0.85
    pending, running = list(recipes), {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as pool:
        while pending or running:
            used = [sum(need[r][i] for r in running.values()) for i in (0, 1)]
            for recipe in list(pending):
                if deadline.left() < expected[recipe]:
                    pending.remove(recipe)
                    results.data["not_run"].append(f"memory {recipe} (no time left)")
                    continue
                fits = (used[0] + need[recipe][0] <= gpu_total and used[1] + need[recipe][1] <= host_total)
                if fits or not running:
                    pending.remove(recipe)
                    print(f"memory {recipe}: started ({deadline.left():.0f} s left)", flush=True)
                    running[pool.submit(memory_job, recipe, cpu, deadline.left(), estimate[recipe])] = recipe
                    used = [u + n for u, n in zip(used, need[recipe], strict=True)]
                if cpu:  # the smoke run: one at a time
                    break
            done, _ = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
            for future in done:
                recipe = running.pop(future)
                try:
                    row = future.result()
                except (RuntimeError, subprocess.TimeoutExpired) as err:
                    results.data["failed"].append(f"memory {recipe}: {str(err)[-600:]}")
                    results.write()
                    print(f"memory {recipe}: failed: {str(err)[-600:]}", flush=True)
                    continue
                results.add("memory", row)
                print(f"memory {recipe}: {json.dumps(row)}", flush=True)


def throughput_leg(algorithms: list[str], cpu: bool, epochs: int, deadline: Deadline, results: Results) -> None:
    with tempfile.TemporaryDirectory() as empty:
        cache = None if cpu else empty  # on a CPU the default cache, warm from CI's tests (as bench_algorithms)
        for i, algorithm in enumerate(algorithms):
            expected = THROUGHPUT_FIRST_S if i == 0 else THROUGHPUT_WARM_S
            if deadline.left() < expected:
                results.data["not_run"].append(f"throughput {algorithm} (no time left)")
                results.write()
                continue
            print(f"throughput {algorithm}: started ({deadline.left():.0f} s left)", flush=True)
            # compiled on a GPU, the figure asked for; eager on a CPU, where the smoke run checks the plumbing and
            # compiling the tiny model would cost a minute
            row = bench_gpu_throughput._child(cpu, not cpu, epochs, algorithm=algorithm, compare=False,
                                              inductor_cache=cache, timeout=deadline.left())
            if row is None:
                results.data["failed"].append(f"throughput {algorithm}")
                results.write()
                continue
            results.add("throughput", {"algorithm": algorithm, **row})
            print(f"throughput {algorithm}: {json.dumps(row)}", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="where the JSON and markdown go")
    parser.add_argument("--deadline-s", type=float, default=540.0, help="no job runs past this many seconds")
    parser.add_argument("--recipes", default=",".join(MEMORY_RECIPES))
    parser.add_argument("--algorithms", default=",".join(THROUGHPUT_ALGORITHMS), help="the first is the reference")
    parser.add_argument("--epochs", type=int, default=1, help="measured throughput epochs")
    parser.add_argument("--estimates", type=Path,
                        help="a JSON of each recipe's estimated peak, read where present (else computed, written)")
    parser.add_argument("--smoke", action="store_true", help="without a GPU: one job of each leg, reduced shapes")
    args = parser.parse_args()
    recipes = [r for r in args.recipes.split(",") if r]
    algorithms = [a for a in args.algorithms.split(",") if a]
    unknown = [*(r for r in recipes if r not in bench_memory.RECIPES),
               *(a for a in algorithms if a not in bench_gpu_throughput.ALGORITHM_RECIPES)]
    if unknown:
        parser.error(f"unknown recipes or algorithms: {', '.join(unknown)}")
    cpu = not torch.cuda.is_available()
    if cpu and not args.smoke:
        parser.error("no GPU visible: this measures GPU figures (--smoke checks the script on a CPU)")
    if args.smoke:
        recipes, algorithms = recipes[:1], algorithms[:1]
    deadline = Deadline(args.deadline_s)
    results = Results(args.out, "CPU (smoke run: reduced shapes, no figures)" if cpu else torch.cuda.get_device_name())
    results.write()
    memory_leg(recipes, cpu, deadline, results, args.estimates)
    throughput_leg(algorithms, cpu, args.epochs, deadline, results)
    print(markdown(results.data))
    return 1 if results.data["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
