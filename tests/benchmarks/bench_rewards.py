"""Benchmarks of the reward path; each prints ratios measured side by side in one run.

1. Server overhead: images/s through POST /v1/score (raw pixels, HTTP, decode) vs the same reward
   called in-process, batch 32, for jpeg_compressibility and ocr (target >= 0.9).
2. Batching: 32 concurrent single-image requests vs one 32-image request to a batched reward whose
   call has a fixed cost (like a model forward).
3. Overlap: a training epoch with a reward that takes as long as sampling, vs sampling alone
   (target <= 1.2; scoring after sampling would be 2x).

    python tests/benchmarks/bench_rewards.py [--repeats N]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("DIFFUSERS_VERBOSITY", "error")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: reward_fixtures, servers

import httpx
import numpy as np
from PIL import Image, ImageDraw, ImageFont
from servers import running_server

from components.reward_server.settings import Batching, Limits, ServerSettings
from components.rewards.client import RemoteRewardSet
from components.rewards.codec import encode_png_b64
from components.rewards.config import RewardServerConfig
from components.rewards.registry import RewardSpec
from components.rewards.scoring import RewardSet


def _text_images(n: int, size: int = 512) -> np.ndarray:
    """Text on a noisy gradient: some structure for JPEG, something to read for OCR."""
    font = ImageFont.load_default(size=size // 8)
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:size, 0:size]
    base = np.stack([x * 255 // size, y * 255 // size, (x + y) * 127 // size], -1).astype(np.float64)
    out = []
    for i in range(n):
        pixels = np.clip(base + rng.normal(0, 8, base.shape), 0, 255).astype(np.uint8)
        im = Image.fromarray(pixels)
        ImageDraw.Draw(im).text((size // 16, size // 3), f"word {i}", fill=(0, 0, 0), font=font)
        out.append(np.asarray(im))
    return np.stack(out)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def server_overhead(repeats: int) -> None:
    images = _text_images(32)
    prompts = [f'a sign that says "word {i}"' for i in range(32)]
    meta = [{} for _ in prompts]
    groups = list(range(32))
    for name in ("jpeg_compressibility", "ocr"):
        specs = [RewardSpec(name=name)]
        local = RewardSet(specs)
        # a 32-image batch of 512 px is twice the default per-request pixel budget (16 x 512 x 512)
        limits = Limits(max_request_pixels=images.shape[0] * images.shape[1] * images.shape[2])
        with running_server(ServerSettings(rewards=specs, limits=limits)) as url:
            remote = RemoteRewardSet(specs, RewardServerConfig(url=url))
            local.score(images, prompts, meta, groups, [name])  # warm-up (loads the OCR engine)
            remote.score(images, prompts, meta, groups, [name])
            ratios = []
            for _ in range(repeats):
                t_local = _timed(lambda: local.score(images, prompts, meta, groups, [name]))  # noqa: B023
                t_remote = _timed(lambda: remote.score(images, prompts, meta, groups, [name]))  # noqa: B023
                ratios.append(t_local / t_remote)  # = (images/s via server) / (images/s in-process)
            remote.close()
        local.close()
        print(f"server overhead, {name}, batch 32 x {images.shape[1]} px: throughput via server / in-process = "
              f"{statistics.median(ratios):.3f} (median of {repeats}; target >= 0.9)")


def batching(repeats: int) -> None:
    spec = RewardSpec(name="reward_fixtures:Sleep", label="model", args={"seconds": 0.05})
    images = [encode_png_b64(im) for im in _text_images(32, size=32)]
    settings = ServerSettings(rewards=[spec], batching=Batching(window_ms=10, max_batch=32))
    limits = httpx.Limits(max_connections=32, max_keepalive_connections=32)
    with running_server(settings) as url, httpx.Client(timeout=60, limits=limits) as client, \
            cf.ThreadPoolExecutor(32) as pool:
        def one_request():
            client.post(f"{url}/v1/score", json={"prompts": ["p"] * 32, "images": images})

        def singles():
            list(pool.map(lambda im: client.post(f"{url}/v1/score", json={"prompts": ["p"], "images": [im]}),
                          images))

        one_request(), singles()
        pairs = [(_timed(singles), _timed(one_request)) for _ in range(repeats)]
    ratio = statistics.median(s / b for s, b in pairs)
    print(f"batching: 32 concurrent single-image requests / one 32-image request = {ratio:.2f}x the time "
          f"(a reward call costs 0.05 s; unbatched singles would be ~32x)")


def overlap(epochs: int, batch_size: int) -> None:
    """The last batch's scoring cannot overlap anything, so 1 + 1/batches is the floor."""
    from components.trainer.loop import Trainer
    from pipeline.config import TINY_CONFIG, load_config

    batch = [f"sampling.batch_size_per_worker={batch_size}"]
    with tempfile.TemporaryDirectory() as out:
        base = Trainer(load_config(TINY_CONFIG, batch), Path(out) / "a", log=lambda _m: None)
        base.run_epoch()  # warm-up
        sampling = statistics.median(base.run_epoch()["time/sampling"] for _ in range(epochs))
        config = load_config(TINY_CONFIG, batch)
        n_batches = config.sampling.prompts_per_epoch * config.sampling.group_size // batch_size
        per_call = sampling / n_batches
        slow = load_config(TINY_CONFIG, [*batch,
            "rewards=[{name: brightness}, {name: 'reward_fixtures:Sleep', label: slow, weight: 0.0, "
            f"args: {{seconds: {per_call}}}}}]"])
        trainer = Trainer(slow, Path(out) / "b", log=lambda _m: None)
        trainer.run_epoch()
        rows = [trainer.run_epoch() for _ in range(epochs)]
    with_reward = statistics.median(r["time/sampling"] for r in rows)
    wait = statistics.median(r["time/scoring"] for r in rows)
    print(f"overlap, {n_batches} batches of {batch_size}: sampling {sampling:.2f}s alone, {with_reward:.2f}s while "
          f"scoring + {wait:.2f}s wait for a reward as slow as sampling = {(with_reward + wait) / sampling:.2f}x "
          f"sampling alone (floor {1 + 1 / n_batches:.2f}; target <= 1.2; sequential 2x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    server_overhead(args.repeats)
    batching(args.repeats)
    for batch_size in (16, 8):
        overlap(args.repeats, batch_size)


if __name__ == "__main__":
    main()
