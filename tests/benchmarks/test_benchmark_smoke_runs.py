"""Each benchmark's smoke run (one repeat, few epochs; the CPU stand-in where the real one needs a GPU) exits 0
and prints every figure it exists for, so no benchmark can rot. Timings are printed, never asserted: the figures
come from the full runs (their docstrings, docs/PERFORMANCE.md, docs/MEMORY.md)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
NUM = r"[-+]?\d+(?:\.\d+)?(?:e[-+]?\d+)?"
POSITIVE = r"(?:\d*[1-9]\d*(?:\.\d+)?|\d*\.\d*[1-9]\d*)"  # a measured amount: above 0 as printed
BREAKDOWN = (rf"{NUM} s a sampling batch: transformer {NUM} s, VAE decode {NUM} s, prompt encoding {NUM} s, "
             rf"the rest {NUM} s")

# benchmark -> (smoke-run arguments, what its output must hold)
SMOKE_RUNS: dict[str, tuple[list[str], list[str]]] = {
    "bench_sampler.py": (["--repeats", "1", "--epochs", "1"], [
        *(rf"(?m)^\s+{family}\s+{NUM}\s+{NUM}\s+{NUM}\s+{NUM}\s+{NUM}\s+{NUM}$"
          for family in ("tiny-sd3", "tiny-flux", "tiny-qwenimage")),
        rf"epoch \(.*\): sampling {NUM}%, scoring {NUM}%, training {NUM}%",
    ]),
    "bench_rewards.py": (["--repeats", "1"], [
        rf"jpeg_compressibility, batch 32 x 512 px: throughput via server / in-process = {NUM}",
        rf"ocr, batch 32 x 512 px: throughput via server / in-process = {NUM}",
        rf"batching: 32 concurrent single-image requests / one 32-image request = {NUM}x",
        rf"overlap, 8 batches of 8: .* = {NUM}x sampling alone",
    ]),
    "bench_tracking.py": (["--repeats", "1", "--epochs", "3"], [rf"on/off epoch time = {NUM}"]),
    "bench_ray.py": (["--epochs", "2"], [
        rf"steady-state epoch: single process {NUM} s, 1 Ray worker {NUM} s, 2 Ray workers {NUM} s",
        rf"Ray overhead: 1 worker / single process = {NUM}", rf"2 workers / 1 worker epoch time = {NUM}",
    ]),
    "scaling_model.py": (["--recipes", "sd35-medium-ocr", "--workers", "1,8"], [
        rf"(?m)^\| 8 \| NVLink \| 144 \| 2 \| {NUM} \| {NUM} \| {NUM} \| {NUM}% \|",
        r"Below 90% efficiency:",
    ]),
    # 3 epochs: the first two are warm-up, the third the steady state; 2 prompts: one optimizer step an epoch
    "bench_multihost.py": (["--epochs", "3", "--prompts", "2"], [
        rf"link between two hosts \(veth \+ bridge\): {NUM} GB/s, {NUM} us one way",
        rf"1 worker alone, steady-state epoch: sampling {NUM} s \+ scoring {NUM} s \+ training {NUM} s = {NUM} s",
        rf"1 worker beside another on the other host, steady-state epoch: sampling {NUM} s .* = {NUM} s",
        rf"2 workers on 2 hosts: predicted {NUM} s, measured {NUM} s, predicted / measured = {NUM}",
    ]),
    "bench_gpu_throughput.py": (["--epochs", "1"], [
        rf"(?m)^epoch images/s\s+{NUM}\s+{NUM}$", rf"(?m)^sampling / diffusers \(target <= 1\.1\)\s+{NUM}\s+{NUM}$",
        r"(?m)^unique graphs after warm-up / measured\s+0 / 0\s+(\d+) / \1$",  # compiled once, nothing recompiled
        rf"train\.cfg_uncond_grad false / true \(compile off\): training images/s x{NUM}",
        *(rf"compile {setting}: {BREAKDOWN}" for setting in ("off", "on")),
    ]),
    "bench_memory.py": (["--depth", "2", "--cpu-families", "sd35-medium"], [
        *(rf"(?m)^{recipe}: per worker" for recipe in ("sd35-medium-ocr", "sd35-large-ocr", "flux1-dev-pickscore",
                                                        "qwenimage-ocr", "flux2-klein-pickscore",
                                                        "zimage-pickscore", "wan21-t2v-1.3b-pickscore",
                                                        "flux1-kontext-edit", "wan21-i2v-14b-480p",
                                                        "flux2-klein-edit", "qwenimage-edit-2509")),
        rf"(?m)^\* ckpt (?:on|off)\s+offload (?:on|off)\s+(?:none|fsdp)\s+{NUM}\s+{NUM}\s+{NUM}\s+{NUM}\s+fits",
        # the measured leg: the trainer's epoch, its training phase's peak RSS with checkpointing off and on
        rf"(?m)^\s+sd35-medium\s+training: checkpointing off\s+{POSITIVE} \(estimated\s+{POSITIVE}\), "
        rf"on\s+{POSITIVE} \(estimated\s+{POSITIVE}\); on / off = {POSITIVE} measured, {POSITIVE} estimated$",
    ]),
    # three algorithms through the same child; every algorithm's workload loads in test_bench_algorithms.py
    "bench_algorithms.py": (["--throughput", "--epochs", "1", "--algorithms", "flow_grpo", "grpo_guard",
                             "diffusion_nft"], [
        pattern for algorithm in ("flow_grpo", "grpo_guard", "diffusion_nft")
        for pattern in (rf"(?m)^\| {algorithm} \| {NUM} \| {NUM} \| {NUM} \| {NUM} \|",
                        rf"(?m)^{algorithm}: {BREAKDOWN}")
    ]),
}


@pytest.mark.slow
@pytest.mark.parametrize("script", list(SMOKE_RUNS))
def test_the_benchmark_smoke_run_prints_its_figures(script: str) -> None:
    args, expected = SMOKE_RUNS[script]
    proc = subprocess.run([sys.executable, str(HERE / script), *args], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=1200)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{script} exited {proc.returncode}:\n{out[-4000:]}"
    missing = [pattern for pattern in expected if not re.search(pattern, proc.stdout)]
    assert not missing, f"{script} did not print {missing}:\n{proc.stdout[-4000:]}"


@pytest.mark.slow
def test_the_prepared_gpu_call_smoke_run_writes_what_it_measured(tmp_path: Path) -> None:
    """bench_open_gpu_figures.py on a CPU: one job of each leg through its scheduling; its markdown and JSON, which
    a call cut short keeps, hold the rows it printed."""
    # SD3.5-Medium's reduced CPU shape: the cheapest (14 s, 4 GB; FLUX.2 klein's: 33 s, 13 GB)
    proc = subprocess.run([sys.executable, str(HERE / "bench_open_gpu_figures.py"), "--smoke", "--out", str(tmp_path),
                           "--recipes", "sd35-medium-ocr"], cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"}, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = [rf"(?m)^\| sd35-medium-ocr \| False \| False \| {NUM} \| {NUM} \| {POSITIVE} \| nan \| nan \|$",
            rf"(?m)^\| flow_grpo \| {POSITIVE} \| 1\.00 \| {POSITIVE} \| {POSITIVE} \| - \| {NUM} \|$"]
    written = (tmp_path / "open_gpu_figures.md").read_text()
    for pattern in rows:
        assert re.search(pattern, proc.stdout), (pattern, proc.stdout[-4000:])
        assert re.search(pattern, written), (pattern, written)
    data = json.loads((tmp_path / "open_gpu_figures.json").read_text())
    assert [r["recipe"] for r in data["memory"]] == ["sd35-medium-ocr"]
    assert [r["algorithm"] for r in data["throughput"]] == ["flow_grpo"]
    assert data["failed"] == [] and data["not_run"] == []
