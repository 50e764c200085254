"""The reward server over real HTTP on 127.0.0.1: endpoints, limits, failures, batching, Flow-Factory API."""

import base64
import concurrent.futures as cf
import io
import struct
import time
import zlib

import httpx
import numpy as np
import pytest
from PIL import Image
from servers import running_server

from components.reward_server.settings import Batching, Limits, ServerSettings
from components.rewards.codec import encode_png_b64
from components.rewards.jpeg import jpeg_size_kb
from components.rewards.registry import RewardSpec


def _image(value: int, size: int = 16) -> np.ndarray:
    rng = np.random.default_rng(value)
    img = rng.integers(0, 256, size=(size, size, 3), dtype=np.uint8)
    img[: size // 2] = value
    return img


def _luma(img: np.ndarray) -> float:
    return float((img.astype(np.float64) @ np.array([0.299, 0.587, 0.114])).mean() / 255)


def _jpeg_b64(img: np.ndarray) -> str:
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, "JPEG", quality=90)
    return base64.b64encode(buf.getvalue()).decode()


def _settings(*specs, **kw) -> ServerSettings:
    return ServerSettings(rewards=[RewardSpec(**s) if isinstance(s, dict) else RewardSpec(name=s) for s in specs], **kw)


@pytest.fixture(scope="module")
def server():
    settings = _settings(
        {"name": "brightness", "weight": 2.0}, "jpeg_compressibility",
        {"name": "reward_fixtures:Boom", "label": "boom"},
        {"name": "reward_fixtures:NanOdd", "label": "nan_odd"},
        {"name": "reward_fixtures:Hang", "label": "hang", "args": {"seconds": 5}, "timeout_s": 0.5},
        {"name": "reward_fixtures:GroundTruthLength", "label": "gt_len"},
        {"name": "rank", "label": "rank_brightness", "args": {"reward": {"name": "brightness"}}},
        limits=Limits(max_body_bytes=200_000, max_images=8, max_pixels=64 * 64),
    )
    with running_server(settings) as url:
        yield url


def _score(url, images, prompts=None, **extra):
    body = {"prompts": prompts or [f"p{i}" for i in range(len(images))], "images": images, **extra}
    return httpx.post(f"{url}/v1/score", json=body, timeout=30)


def test_health_ready_and_reward_list(server):
    assert httpx.get(f"{server}/healthz").json() == {"status": "ok"}
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}
    assert httpx.get(f"{server}/readyz").json() == {"ready": True}
    listed = {r["key"]: r for r in httpx.get(f"{server}/v1/rewards").json()["rewards"]}
    assert listed["brightness"] == {"key": "brightness", "name": "brightness", "kind": "pointwise", "weight": 2.0,
                                    "inputs": False}
    assert listed["rank_brightness"]["kind"] == "groupwise" and listed["boom"]["name"] == "reward_fixtures:Boom"


def test_score_png_and_jpeg_match_in_process_rewards(server):
    imgs = [_image(10), _image(200)]
    r = _score(server, [encode_png_b64(imgs[0]), "data:image/png;base64," + encode_png_b64(imgs[1])],
               rewards=["brightness", "jpeg_compressibility"])
    assert r.status_code == 200
    res = r.json()["results"]
    assert res["brightness"]["scores"] == pytest.approx([_luma(i) for i in imgs])
    assert res["jpeg_compressibility"]["scores"] == pytest.approx([-jpeg_size_kb(i) / 500 for i in imgs])
    assert res["brightness"]["errors"] == [None, None]
    jpeg = _jpeg_b64(imgs[0])
    decoded = np.asarray(Image.open(io.BytesIO(base64.b64decode(jpeg))).convert("RGB"))
    r = _score(server, [jpeg], rewards=["brightness"])
    assert r.json()["results"]["brightness"]["scores"] == pytest.approx([_luma(decoded)])


def test_metadata_and_groups_reach_the_rewards(server):
    imgs = [encode_png_b64(_image(v)) for v in (10, 50, 90, 130)]
    r = _score(server, imgs, metadata=[{"ground_truth": "ab"}, {"ground_truth": "abcd"}, {"ground_truth": ""},
                                       {"ground_truth": "x"}],
               group_ids=[0, 0, 1, 1], rewards=["gt_len", "rank_brightness"])
    res = r.json()["results"]
    assert res["gt_len"]["scores"] == [2.0, 4.0, 0.0, 1.0]
    assert res["rank_brightness"]["scores"] == [0.0, 0.5, 0.0, 0.5]  # ranked within each group of two


def test_failures_are_per_sample_and_never_5xx(server):
    imgs = [encode_png_b64(_image(v)) for v in (10, 20)]
    started = time.perf_counter()
    r = _score(server, imgs, prompts=["a 1", "a 2"], rewards=["boom", "nan_odd", "hang", "brightness"])
    elapsed = time.perf_counter() - started
    assert r.status_code == 200
    res = r.json()["results"]
    assert res["boom"]["scores"] == [None, None] and "reward exploded" in res["boom"]["errors"][0]
    assert res["nan_odd"]["scores"][0] is None and "non-finite" in res["nan_odd"]["errors"][0]
    assert res["nan_odd"]["scores"][1] == pytest.approx(_image(20).mean() / 255)
    assert res["hang"]["errors"] == ["timed out after 0.5s"] * 2 and elapsed < 4
    assert res["brightness"]["errors"] == [None, None]


@pytest.mark.parametrize(
    ("mutate", "status", "needle"),
    [
        (lambda b: b.update(rewards=["nope"]), 400, "unknown reward(s) 'nope'"),
        (lambda b: b.update(prompts=["only one"]), 422, "prompts has 1 items but there are 2 images"),
        (lambda b: b.update(images=b["images"] * 5, prompts=b["prompts"] * 5), 413, "limit of 8 per request"),
        (lambda b: b["images"].__setitem__(0, "!!!not base64"), 422, "images[0]: not valid base64"),
        (lambda b: b["images"].__setitem__(0, base64.b64encode(b"junk" * 10).decode()), 422, "cannot decode"),
        (lambda b: b["images"].__setitem__(0, encode_png_b64(_image(1, size=8))), 422, "one size"),
        (lambda b: b["images"].__setitem__(0, encode_png_b64(_image(1, size=80))), 413, "exceeds the limit"),
        (lambda b: b.update(extra_field=1), 422, "extra_field"),
    ],
)
def test_limits_and_bad_input_are_clear_4xx(server, mutate, status, needle):
    body = {"prompts": ["a", "b"], "images": [encode_png_b64(_image(1)), encode_png_b64(_image(2))]}
    mutate(body)
    r = httpx.post(f"{server}/v1/score", json=body, timeout=30)
    assert r.status_code == status, r.text
    assert needle in r.json()["detail"]
    assert httpx.get(f"{server}/healthz").status_code == 200  # still alive


def _png_with_header_size(width: int, height: int) -> str:
    """A real 1x1 PNG whose header claims width x height: decoding it would allocate gigabytes."""
    buf = io.BytesIO()
    Image.new("RGB", (1, 1)).save(buf, "PNG")
    data = bytearray(buf.getvalue())
    ihdr = data[12:29]  # chunk type + 13 bytes of IHDR data
    ihdr[4:12] = struct.pack(">II", width, height)
    data[12:29] = ihdr
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(ihdr)) & 0xFFFFFFFF)
    return base64.b64encode(bytes(data)).decode()


def test_decompression_bomb_is_rejected_from_the_header(server):
    r = _score(server, [_png_with_header_size(100_000, 100_000)], rewards=["brightness"])
    assert r.status_code == 413 and "10000000000 pixels" in r.json()["detail"]


def test_body_size_limit(server):
    r = httpx.post(f"{server}/v1/score", content=b"x" * 300_000, headers={"content-type": "application/json"})
    assert r.status_code == 413 and "exceeds the limit of 200000 bytes" in r.json()["detail"]

    def chunks():  # no content-length: the limit is enforced while reading
        for _ in range(30):
            yield b"y" * 10_000

    r = httpx.post(f"{server}/v1/score", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 413


def test_flow_factory_compute_wire_format(server):
    imgs = [_image(30), _image(60)]
    weights = {"brightness": 2.0, "jpeg_compressibility": 1.0}
    body = {"prompt": ["a", "b"], "image": [encode_png_b64(i) for i in imgs], "video": None,
            "condition_images": None, "condition_videos": None}
    with running_server(_settings({"name": "brightness", "weight": 2.0}, "jpeg_compressibility")) as url:
        r = httpx.post(f"{url}/compute", json=body)
        expected = [weights["brightness"] * _luma(i) - jpeg_size_kb(i) / 500 for i in imgs]
        assert r.status_code == 200 and r.json()["rewards"] == pytest.approx(expected)
        plural = {"prompts": ["a", "b"], "images": body["image"], "kwargs": {"k": 1}}
        assert httpx.post(f"{url}/compute", json=plural).json()["rewards"] == pytest.approx(expected)
        with_extra = {"prompt": ["a", "b"], "image": body["image"], "extra": {"k": 1}}
        assert httpx.post(f"{url}/compute", json=with_extra).json()["rewards"] == pytest.approx(expected)
        r = httpx.post(f"{url}/compute", json={"image": body["image"]})
        assert r.status_code == 422 and "prompt" in r.json()["error"]
        r = httpx.post(f"{url}/compute", json={"prompt": ["a"], "image": ["@@@"]})
        assert r.status_code == 422 and "not valid base64" in r.json()["error"]
    with running_server(_settings({"name": "reward_fixtures:Boom", "label": "boom"})) as url:
        r = httpx.post(f"{url}/compute", json=body)
        assert "reward 'boom' failed on sample 0" in r.json()["error"]


def test_concurrent_requests_to_a_model_reward_are_batched():
    from reward_fixtures import CountingMean

    settings = _settings({"name": "reward_fixtures:CountingMean", "label": "mean", "args": {"delay_s": 0.05}},
                         batching=Batching(window_ms=50, max_batch=64))
    imgs = [_image(v) for v in range(32)]
    with running_server(settings) as url:
        CountingMean.calls = 0
        with cf.ThreadPoolExecutor(32) as pool:
            responses = list(pool.map(lambda i: _score(url, [encode_png_b64(i)]), imgs))
        calls = CountingMean.calls
    assert all(r.status_code == 200 for r in responses)
    for img, r in zip(imgs, responses, strict=True):
        assert r.json()["results"]["mean"]["scores"] == pytest.approx([img.mean() / 255])
    assert calls < 32 / 2, calls  # merged: far fewer calls than requests


def test_metrics_count_requests_images_and_failures(server):
    _score(server, [encode_png_b64(_image(5))], rewards=["brightness", "boom"])
    text = httpx.get(f"{server}/metrics").text
    assert 'reward_server_images_total{reward="brightness"}' in text
    failures = [line for line in text.splitlines() if line.startswith('reward_server_failures_total{reward="boom"}')]
    assert failures and float(failures[0].split()[-1]) >= 1
    assert 'reward_server_requests_total{endpoint="/v1/score",status="200"}' in text


def test_readiness_waits_for_slow_loading_and_reports_load_failures():
    with running_server(_settings({"name": "reward_fixtures:SlowToLoad", "label": "slow", "args": {"load_s": 1.5}}),
                        wait_ready=False) as url:
        assert httpx.get(f"{url}/readyz").status_code == 503
        assert httpx.post(f"{url}/v1/score", json={"prompts": [], "images": []}).status_code == 503
        deadline = time.monotonic() + 20
        while httpx.get(f"{url}/readyz").status_code != 200:
            assert time.monotonic() < deadline
            time.sleep(0.1)
    with running_server(_settings({"name": "reward_fixtures:FailsToLoad", "label": "broken"}),
                        wait_ready=False) as url:
        deadline = time.monotonic() + 10
        while "weights not found" not in httpx.get(f"{url}/readyz").text:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert httpx.get(f"{url}/readyz").status_code == 503


def test_raw_pixels_are_scored_like_png(server):
    from components.rewards.codec import encode_raw_b64

    imgs = np.stack([_image(10), _image(200)])
    raw = {"shape": list(imgs.shape), "data": encode_raw_b64(imgs)}
    r = httpx.post(f"{server}/v1/score", json={"prompts": ["a", "b"], "pixels": raw, "rewards": ["brightness"]})
    assert r.status_code == 200 and r.json()["results"]["brightness"]["scores"] == pytest.approx(
        [_luma(i) for i in imgs])
    bad = [
        ({"shape": [2, 16, 16, 3], "data": raw["data"][:-8]}, 422, "bytes but shape"),
        ({"shape": [2, 16, 16, 4], "data": raw["data"]}, 422, "(B, H, W, 3)"),
        ({"shape": [2, 100, 100, 3], "data": raw["data"]}, 413, "exceeds the limit"),
        ({"shape": [9, 16, 16, 3], "data": raw["data"]}, 413, "limit of 8 per request"),
    ]
    for pixels, status, needle in bad:
        r = httpx.post(f"{server}/v1/score", json={"prompts": ["a"] * pixels["shape"][0], "pixels": pixels})
        assert r.status_code == status and needle in r.json()["detail"], (pixels["shape"], r.text)
    both = {"prompts": ["a", "b"], "pixels": raw, "images": [encode_png_b64(imgs[0])] * 2}
    assert "not both" in httpx.post(f"{server}/v1/score", json=both).json()["detail"]


@pytest.mark.parametrize(
    ("shape", "data", "needle"),
    [
        ([1, 0, 4611686018427387904, 3], "", "H and W at least 1"),  # no bytes, but no array can have that shape
        ([1, 16, 0, 3], "", "H and W at least 1"),
        ([0, 0, 0, 3], "", "H and W at least 1"),
        ([1, -16, 16, 3], "", "pixels.shape.1: Input should be greater than or equal to 0"),
        ([1, 2**62, 2**62, 3], "", "over the limit"),  # the product overflows int64
        ([1, 2**70, 1, 3], "", "over the limit"),  # a dimension over int64
        ([1, 16, 16], "", "pixels.shape"),
        ([1, 16, 16, 3, 1], "", "pixels.shape"),
        ([1, 2, 16, 16, 3, 1], "", "pixels.shape"),  # videos are 5-dimensional, nothing more
        ([1, 0, 16, 16, 3], "", "F, H and W at least 1"),  # a video of no frames
        ([1, 2, 4, 4, 3], "A" * 60, "pixels.data holds 45 bytes but shape (1, 2, 4, 4, 3) needs 96"),
        ([1, 4, 4, 3], "A" * 60, "pixels.data holds 45 bytes but shape (1, 4, 4, 3) needs 48"),
        ([1, 4, 4, 3], "AA=A" + "A" * 60, "not valid base64"),
        ([1, 4, 4, 3], "@" * 64, "not valid base64"),
    ],
)
def test_a_client_sent_shape_is_checked_before_anything_is_allocated(server, shape, data, needle):
    body = {"prompts": ["a"] * (shape[0] if 0 <= shape[0] < 9 else 1), "pixels": {"shape": shape, "data": data}}
    r = httpx.post(f"{server}/v1/score", json=body)
    assert r.status_code in (413, 422), r.text
    assert needle in r.json()["detail"]


def test_input_images_reach_the_rewards_that_ask_once_per_request_and_count_in_its_budget():
    """An edit's input images cross the wire once however many samples share them (the trainer's client, and
    Flow-Factory's condition_images on /compute), each sample's reaching an input-aware reward, and their pixels
    count in the request's budget."""
    from components.rewards.client import RemoteRewardSet, _input_fields
    from components.rewards.config import RewardServerConfig

    specs = [RewardSpec(name="reward_fixtures:InputMean", label="input_mean"), RewardSpec(name="brightness")]
    shared, other = _image(40), _image(200)
    images = np.stack([_image(i) for i in range(4)])
    inputs = [[shared], [shared], [shared], [other, shared]]
    fields = _input_fields(inputs)
    assert len(fields["inputs"]) == 2 and fields["input_index"] == [[0], [0], [0], [1, 0]]
    expected = [shared.mean()] * 3 + [other.mean() + 1000]
    # 4 images + 5 inputs of 16 x 16: what /compute gets (Flow-Factory sends each sample's); the client sends 4 + 2
    with running_server(ServerSettings(rewards=specs, limits=Limits(max_request_pixels=9 * 16 * 16))) as url:
        listed = {r["key"]: r["inputs"] for r in httpx.get(f"{url}/v1/rewards").json()["rewards"]}
        assert listed == {"input_mean": True, "brightness": False}
        client = RemoteRewardSet(specs, RewardServerConfig(url=url))
        assert client.takes_inputs == {"input_mean"}  # a request for brightness alone carries no input images
        try:
            out = client.score(images, list("abcd"), [{}] * 4, [0, 0, 1, 1], ["input_mean", "brightness"], inputs)
        finally:
            client.close()
        assert out["input_mean"].scores == pytest.approx(expected)
        assert out["brightness"].scores == pytest.approx([_luma(i) for i in images])
        body = {"prompt": list("abcd"), "image": [encode_png_b64(i) for i in images],
                "condition_images": [[encode_png_b64(x) for x in row] for row in inputs]}
        r = httpx.post(f"{url}/compute", json=body)
        assert r.status_code == 200
        assert r.json()["rewards"] == pytest.approx([e + _luma(i) for e, i in zip(expected, images, strict=True)])
        over = {**body, "condition_images": [[encode_png_b64(x) for x in [*row, shared]] for row in inputs]}
        r = httpx.post(f"{url}/compute", json=over)  # 4 + 9 images of 16 x 16: over the budget of 9
        assert r.status_code == 413 and "max_request_pixels" in r.json()["error"]
        r = httpx.post(f"{url}/compute", json={**body, "condition_images": [["x"]]})
        assert r.status_code == 422 and "condition_images has 1" in r.json()["error"]
        r = _score(url, [encode_png_b64(i) for i in images], rewards=["input_mean"])
        assert r.status_code == 200 and "none were given" in r.json()["results"]["input_mean"]["errors"][0]


@pytest.fixture(scope="module")
def edit_server():
    with running_server(_settings("edit_consistency", "shapes_edit", "geneval_shapes")) as url:
        yield url


_SCENE = [{"colour": "blue", "shape": "square", "cell": 0, "x": 4.0, "y": 4.0, "size": 14.0}]


@pytest.mark.parametrize(
    ("change", "field"),
    [
        # Before: each answered 500 "reward ... failed on sample 0" (a TypeError, an OverflowError or a ValueError).
        ({"condition_images": [[]]}, "condition_images[0]: edit_consistency compares the result with its input"),
        ({"condition_images": None}, "condition_images: reward 'edit_consistency' scores edits against their input"),
        ({"kwargs": {"scene": _SCENE, "edit_box": "abc"}}, "kwargs.edit_box: must be [top, left, bottom, right]"),
        ({"kwargs": {"scene": _SCENE, "edit_box": [0, 0, 1e308, 1e308]}}, "kwargs.edit_box: [0.0, 0.0, 1e+308, 1e+308]"
                                                                          " (margin 0.0) covers the whole image"),
        ({"kwargs": None, "extra": {"scene": _SCENE, "edit_box": [0, 0, True, 1]}}, "extra.edit_box: must be"),
        ({"kwargs": {"scene": "abc"}}, "kwargs.scene: must be a list of at most 4 objects"),
        ({"kwargs": {"scene": [{"colour": "pink"}]}}, "kwargs.scene: object 0 must be a mapping of exactly"),
        ({"kwargs": {}}, "kwargs.scene: shapes_edit reads the source scene"),
        ({"prompt": ["zzz"]}, "prompt[0]: 'zzz' is not 'make the"),  # shapes_edit's grammar, asked before geneval's
        ({"prompt": ["make the red circle blue"]}, "prompt[0]: 'make the red circle blue' fits 0 objects"),
        ({"image": [encode_png_b64(_image(1, size=32)[:, :16].copy())]}, "image[0]: expected a square RGB result"),
    ],
    ids=["empty condition images", "no condition images", "edit_box a string", "edit_box past any image",
         "edit_box a boolean (extra)", "scene a string", "scene object unknown", "no scene",
         "prompt outside the grammar", "prompt not on the scene", "a non-square result"],
)
def test_a_samples_own_mistake_is_a_4xx_naming_the_field(edit_server, change, field):
    body = {"prompt": ["make the blue square red"], "image": [encode_png_b64(_image(5, size=48))],
            "condition_images": [[encode_png_b64(_image(6, size=48))]], "kwargs": {"scene": _SCENE}, **change}
    r = httpx.post(f"{edit_server}/compute", json=body, timeout=30)
    assert r.status_code == 422, r.text
    assert r.json()["error"].startswith(field), r.json()["error"]
    assert httpx.get(f"{edit_server}/healthz").status_code == 200


def test_a_samples_mistake_on_v1_score_stays_a_per_sample_failure(edit_server):
    image = encode_png_b64(_image(5, size=48))
    body = {"prompts": ["make the blue square red"] * 2, "images": [image, image], "inputs": [image],
            "input_index": [[0], [0]], "metadata": [{"edit_box": "abc"}, {"edit_box": [0, 0, 8, 8]}],
            "rewards": ["edit_consistency"]}
    r = httpx.post(f"{edit_server}/v1/score", json=body, timeout=30)
    assert r.status_code == 200, r.text
    result = r.json()["results"]["edit_consistency"]
    assert result["scores"][0] is None and "metadata.edit_box: must be" in result["errors"][0]
    assert result["scores"][1] == 1.0 and result["errors"][1] is None
