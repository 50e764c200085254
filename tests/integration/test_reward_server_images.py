"""Malformed and oversized images against a real reward server: every problem is a 4xx naming it, over a
connection the server keeps, and the server's memory is bounded by its limits, not by the traffic."""

import base64
import io
import struct
import subprocess
import sys
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import psutil
import pytest
import yaml
from PIL import Image
from servers import free_port, running_server, wait_until_ok

from components.reward_server.settings import Limits, ServerSettings
from components.rewards.codec import encode_png_b64
from components.rewards.registry import RewardSpec

REPO = Path(__file__).resolve().parents[2]


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def _png(width: int = 8, height: int = 8, extra: bytes = b"", ihdr_size: tuple[int, int] | None = None) -> bytes:
    """A valid grey PNG, with ``extra`` chunks before its pixel data and, optionally, a header that lies."""
    w, h = ihdr_size or (width, height)
    rows = b"".join(b"\x00" + bytes(width) for _ in range(height))
    return (b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0)) + extra
            + _chunk(b"IDAT", zlib.compress(rows)) + _chunk(b"IEND", b""))


def _encoded(fmt: str, **kw) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.full((16, 16, 3), 128, np.uint8)).save(buffer, format=fmt, **kw)
    return buffer.getvalue()


def _jpeg_claiming(height: int, width: int) -> bytes:
    """A 16 x 16 JPEG whose frame header (SOF0) claims another size."""
    data = bytearray(_encoded("JPEG"))
    sof = data.index(b"\xff\xc0")
    data[sof + 5:sof + 9] = struct.pack(">HH", height, width)
    return bytes(data)


_BOMB = zlib.compress(bytes(8 * 2**20), 9)  # 8 MiB of zeros in a few KiB: over Pillow's 1 MiB text-chunk limit
# refused: Pillow cannot (or may not) decode them
MALFORMED = {
    "oversized zTXt chunk": _png(extra=_chunk(b"zTXt", b"comment\x00\x00" + _BOMB)),
    "oversized iCCP profile": _png(extra=_chunk(b"iCCP", b"icc\x00\x00" + _BOMB)),
    "header claims a huge image": _png(ihdr_size=(100_000, 100_000)),
    "bad chunk CRC": _png()[:29] + b"\x00\x00\x00\x00" + _png()[33:],
    "JPEG whose header claims a huge image": _jpeg_claiming(40_000, 40_000),
    "truncated JPEG": _encoded("JPEG")[:200],
    "WebP": _encoded("WEBP"),
    "GIF": _encoded("GIF"),
    "not an image": b"hello world",
    "empty": b"",
}
# decoded leniently by Pillow / libjpeg (missing rows filled, a broken profile ignored): a 200 is as good as a
# 4xx here; what may never happen is a 5xx or a dropped connection
TOLERATED = {
    "iCCP that is not zlib": _png(extra=_chunk(b"iCCP", b"icc\x00\x00not zlib at all")),
    "header claims more rows than the data holds": _png(ihdr_size=(8, 4000)),
    "truncated PNG": _png()[:60],
    "PNG without IEND": _png()[:-12],
    "JPEG whose header claims more rows than its data": _jpeg_claiming(1024, 16),
}


@pytest.fixture(scope="module")
def server():
    settings = ServerSettings(rewards=[RewardSpec(name="brightness")], limits=Limits(max_pixels=1024 * 1024))
    with running_server(settings) as url:
        yield url


def test_the_builders_make_valid_images_before_they_are_broken():
    """The malformed cases are broken on purpose, each in one place: without the break they decode."""
    assert np.asarray(Image.open(io.BytesIO(_png(8, 6)))).shape == (6, 8)
    assert Image.open(io.BytesIO(_jpeg_claiming(16, 16))).convert("RGB").size == (16, 16)
    text = _png(extra=_chunk(b"zTXt", b"comment\x00\x00" + zlib.compress(b"small")))
    assert Image.open(io.BytesIO(text)).text == {"comment": "small"}


@pytest.mark.parametrize("name", [*MALFORMED, *TOLERATED])
def test_a_malformed_image_is_a_4xx_and_the_connection_is_kept(server, name):
    data = MALFORMED.get(name, TOLERATED.get(name))
    body = {"prompts": ["a"], "images": [base64.b64encode(data).decode()]}
    good = {"prompts": ["a"], "images": [encode_png_b64(np.zeros((8, 8, 3), np.uint8))]}
    with httpx.Client(base_url=server, timeout=30) as client:
        response = client.post("/v1/score", json=body)
        if name in MALFORMED:
            assert response.status_code in (413, 422), (response.status_code, response.text)
            assert "images[0]" in response.json()["detail"]
        else:
            assert response.status_code in (200, 413, 422), (response.status_code, response.text)
        again = client.post("/v1/score", json=good)  # the same connection, still served
        assert again.status_code == 200 and again.json()["results"]["brightness"]["scores"] == [0.0]
        assert client.get("/healthz").status_code == 200


def test_a_request_over_its_pixel_budget_is_refused_from_the_headers():
    limits = Limits(max_pixels=512 * 512, max_request_pixels=4 * 512 * 512)
    image = encode_png_b64(np.zeros((512, 512, 3), np.uint8))
    with running_server(ServerSettings(rewards=[RewardSpec(name="brightness")], limits=limits)) as url:
        ok = httpx.post(f"{url}/v1/score", json={"prompts": ["a"] * 4, "images": [image] * 4}, timeout=30)
        over = httpx.post(f"{url}/v1/score", json={"prompts": ["a"] * 5, "images": [image] * 5}, timeout=30)
        raw = {"prompts": ["a"] * 5, "pixels": {"shape": [5, 512, 512, 3], "data": ""}}
        over_raw = httpx.post(f"{url}/v1/score", json=raw, timeout=30)
    assert ok.status_code == 200
    assert over.status_code == 413 and "1310720 pixels in all, over the limit of 1048576" in over.json()["detail"]
    assert over_raw.status_code == 413 and "limits.max_request_pixels" in over_raw.json()["detail"]


def _rss_mib(proc: psutil.Process) -> float:
    return sum(p.memory_info().rss for p in (proc, *proc.children(recursive=True))) / 2**20


SIDE, PER_REQUEST = 2048, 4  # single-colour 2048 x 2048 PNGs: 25 KB each on the wire, 12 MiB each decoded


def _peak_rss_under_traffic(tmp_path: Path, concurrent: int, requests: int = 48) -> tuple[float, float]:
    """(resident MiB once warm, peak MiB) of a reward-server process while ``requests`` requests of
    ``PER_REQUEST`` images arrive 24 at a time, with ``limits.max_concurrent_requests = concurrent``."""
    limits = {"max_pixels": SIDE * SIDE, "max_request_pixels": PER_REQUEST * SIDE * SIDE,
              "max_concurrent_requests": concurrent}
    config = tmp_path / f"server-{concurrent}.yaml"
    config.write_text(yaml.safe_dump({"rewards": [{"name": "brightness"}], "limits": limits}))
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "reward-server", "--config", str(config),
                             "--port", str(port), "--log-level", "warning"], cwd=REPO)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_ok(f"{url}/readyz", 60, dead=lambda: proc.poll() is not None and "exited")
        image = encode_png_b64(np.full((SIDE, SIDE, 3), 200, np.uint8))
        body = {"prompts": ["a"] * PER_REQUEST, "images": [image] * PER_REQUEST}
        with httpx.Client(timeout=120) as client:
            assert client.post(f"{url}/v1/score", json=body).status_code == 200  # warm: allocator, imports
        server = psutil.Process(proc.pid)
        baseline, peak, done = _rss_mib(server), 0.0, threading.Event()

        def watch() -> None:
            nonlocal peak
            while not done.is_set():
                peak = max(peak, _rss_mib(server))
                time.sleep(0.01)

        watcher = threading.Thread(target=watch)
        watcher.start()
        with ThreadPoolExecutor(24) as pool, httpx.Client(timeout=300, limits=httpx.Limits(max_connections=24)) as c:
            statuses = list(pool.map(lambda _: c.post(f"{url}/v1/score", json=body).status_code, range(requests)))
        done.set()
        watcher.join()
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert statuses == [200] * requests
    return baseline, peak


@pytest.mark.slow
def test_concurrent_small_requests_of_large_images_stay_within_the_memory_the_limits_allow(tmp_path):
    image_mib = SIDE * SIDE * 3 / 2**20
    # per request holding images: its decoded images twice (the list and the stacked batch) plus Pillow's copy,
    # and the reward's own working set (brightness: a float64 copy of one image and its luma, ~11 images' bytes
    # per call, up to its 4 workers); plus the queued bodies (25 KB each) and the interpreter's slack
    per_request = PER_REQUEST * image_mib * 3 + 11 * image_mib
    concurrent = 2
    bound = concurrent * per_request + 100
    baseline, peak = _peak_rss_under_traffic(tmp_path, concurrent)
    assert peak - baseline < bound, (baseline, peak, bound)
    # the same traffic with the limit out of the way (24 at once): the bound above is what the limit buys
    baseline, unbounded = _peak_rss_under_traffic(tmp_path, 24)
    assert unbounded - baseline > 2 * bound, (baseline, unbounded, bound)
