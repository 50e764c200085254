"""The reward service (FastAPI): scores images with a configured set of rewards over HTTP.

Endpoints: ``GET /healthz``, ``GET /readyz``, ``GET /v1/rewards``, ``POST /v1/score``,
``GET /metrics`` (Prometheus), and Flow-Factory's remote-reward API (``GET /health``,
``POST /compute``). Rewards load in a background thread at start-up; until they are loaded
``/readyz`` and the scoring endpoints answer 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import math
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from typing import Annotated, Any

import numpy as np
from fastapi import APIRouter, Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from starlette.concurrency import run_in_threadpool

from components.reward_server.batching import Batcher
from components.reward_server.gate import GatedRoute, RequestGate
from components.reward_server.settings import ServerSettings
from components.rewards.base import BatchedReward, Inputs, RewardOutput, SampleProblem
from components.rewards.codec import (
    ImageDecodeError,
    ImageTooLargeError,
    decode_image,
    decode_raw_b64,
    image_bytes_b64,
    image_pixels,
)
from components.rewards.scoring import RewardSet, combine
from components.rewards.wire import (
    ComputeRequest,
    RawPixels,
    RewardInfo,
    RewardResult,
    RewardsResponse,
    ScoreRequest,
    ScoreResponse,
)

log = logging.getLogger("flowgrpo.reward_server")
COMPUTE_PATH = "/compute"


class RewardService:
    """The loaded rewards, their batchers and metrics."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.rewards: RewardSet | None = None
        self.load_error: str | None = None
        self.batchers: dict[str, Batcher] = {}
        self.registry = CollectorRegistry()
        self.requests = Counter("reward_server_requests_total", "HTTP requests", ["endpoint", "status"],
                                registry=self.registry)
        self.images = Counter("reward_server_images_total", "images scored", ["reward"], registry=self.registry)
        self.failures = Counter("reward_server_failures_total", "samples whose reward failed", ["reward"],
                                registry=self.registry)
        self.seconds = Histogram("reward_server_reward_seconds", "seconds per reward call", ["reward"],
                                 registry=self.registry)

    def load(self) -> None:
        try:
            rewards = RewardSet(self.settings.rewards)
        except Exception as exc:
            self.load_error = f"{type(exc).__name__}: {exc}"
            log.error("loading rewards failed: %s", self.load_error)
            return
        b = self.settings.batching
        for key, reward in rewards.rewards.items():
            if isinstance(reward, BatchedReward):
                self.batchers[key] = Batcher(
                    lambda im, pr, md, gi, key=key: rewards.call(key, im, pr, md, gi), b.window_ms / 1000, b.max_batch)
        self.rewards = rewards
        log.info("rewards loaded: %s", ", ".join(rewards.weights))

    def ready(self) -> RewardSet:
        if self.rewards is None:
            raise HTTPException(503, self.load_error or "rewards are still loading")
        return self.rewards

    def decode(self, images: list[str], pixels: RawPixels | None = None, inputs: list[str] | None = None,
               name: str = "images") -> np.ndarray:
        """The request's images (``images`` as files, or ``pixels``), every pixel of them and of ``inputs`` (the
        edits' input images, any sizes) counted in one budget before any is decoded."""
        limits = self.settings.limits
        n = pixels.shape[0] if pixels is not None else len(images)
        if n > limits.max_images:
            raise HTTPException(413, f"{n} images exceed the limit of {limits.max_images} per request")
        if pixels is not None:
            if len(pixels.shape) == 5 and pixels.shape[1] > limits.max_frames:
                raise HTTPException(413, f"videos of {pixels.shape[1]} frames exceed the limit of "
                                         f"{limits.max_frames} frames per video (limits.max_frames)")
            _check_request_pixels(math.prod(pixels.shape[:-1]) + self._pixels_of(inputs or [], "inputs")[1],
                                  limits.max_request_pixels)
            try:
                return decode_raw_b64(pixels.data, pixels.shape, limits.max_pixels)
            except ImageDecodeError as exc:
                raise _rejected(exc) from exc
        raw, total = self._pixels_of(images, name)
        _check_request_pixels(total + self._pixels_of(inputs or [], "inputs")[1], limits.max_request_pixels)
        decoded = self.decode_each(raw, name)
        if not decoded:
            return np.zeros((0, 1, 1, 3), dtype=np.uint8)
        shapes = {im.shape for im in decoded}
        if len(shapes) > 1:
            raise HTTPException(422, f"all images of a request must have one size, got {sorted(shapes)}")
        return np.stack(decoded)

    def _pixels_of(self, images: list[str], name: str) -> tuple[list[bytes], int]:
        """The files of base64 images and their pixels, from the headers only: the whole request's size is known
        before any pixel is decoded."""
        raw, total = [], 0
        for i, data in enumerate(images):
            try:
                raw.append(image_bytes_b64(data))
                total += image_pixels(raw[-1], self.settings.limits.max_pixels)
            except ImageDecodeError as exc:
                raise _rejected(exc, f"{name}[{i}]: ") from exc
        return raw, total

    def decode_each(self, raw: list[bytes], name: str) -> list[np.ndarray]:
        decoded = []
        for i, data in enumerate(raw):
            try:
                decoded.append(decode_image(data, self.settings.limits.max_pixels))
            except ImageDecodeError as exc:
                raise _rejected(exc, f"{name}[{i}]: ") from exc
        return decoded

    def decode_inputs(self, inputs: list[str], index: list[list[int]]) -> Inputs:
        """Each sample's input images (their pixels already counted by ``decode``)."""
        decoded = self.decode_each([image_bytes_b64(data) for data in inputs], "inputs")
        return [[decoded[j] for j in row] for row in index]

    async def score(self, keys: list[str], images: np.ndarray, prompts: list[str], metadata: list[dict[str, Any]],
                    group_ids: list[int], inputs: Inputs | None = None) -> dict[str, RewardOutput]:
        rewards = self.ready()

        async def one(key: str) -> RewardOutput:
            start = time.perf_counter()
            if key in self.batchers and not rewards.rewards[key].inputs:
                out = await self.batchers[key].score(images, prompts, metadata)
            else:
                out = await run_in_threadpool(rewards.call, key, images, prompts, metadata, group_ids, inputs)
            self.seconds.labels(key).observe(time.perf_counter() - start)
            self.images.labels(key).inc(len(images))
            self.failures.labels(key).inc(out.failed)
            return out

        outputs = await asyncio.gather(*(one(k) for k in keys))
        return dict(zip(keys, outputs, strict=True))


def _rejected(exc: ImageDecodeError, where: str = "") -> HTTPException:
    return HTTPException(413 if isinstance(exc, ImageTooLargeError) else 422, f"{where}{exc}")


def _check_request_pixels(total: int, limit: int) -> None:
    if total > limit:
        raise HTTPException(413, f"the request's images hold {total} pixels in all, over the limit of {limit} "
                                 "(limits.max_request_pixels, where a video counts every frame); send fewer or "
                                 "smaller images per request")


def _finite_or_none(scores: np.ndarray) -> list[float | None]:
    return [float(s) if np.isfinite(s) else None for s in scores]


def _service(request: Request) -> RewardService:
    return request.app.state.service


# Each route takes its app's service through this dependency (one app per settings; tests run several in a process).
# The routes call ``service.ready()`` themselves, after FastAPI has validated the body: an invalid request is a 422
# whether or not the rewards have loaded.
Service = Annotated[RewardService, Depends(_service)]
router = APIRouter()
# the scoring routes read, parse, decode and score within the gate's limits (``app.state.gate``): memory bounded by
# the settings, not by the traffic
scoring = APIRouter(route_class=GatedRoute)


@contextlib.asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    service: RewardService = app.state.service
    threading.Thread(target=service.load, name="reward-loader", daemon=True).start()
    yield
    if service.rewards is not None:
        service.rewards.close()


async def count_requests(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
    response = await call_next(request)
    route = request.scope.get("route")
    _service(request).requests.labels(getattr(route, "path", "unmatched"), str(response.status_code)).inc()
    return response


def _error(request: Request, status: int, detail: Any, headers: Mapping[str, str] | None = None) -> JSONResponse:
    if request.url.path == COMPUTE_PATH:
        return JSONResponse({"error": detail if isinstance(detail, str) else json.dumps(detail)}, status, headers)
    return JSONResponse({"detail": detail}, status, headers)


async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
    return _error(request, exc.status_code, exc.detail, exc.headers)


async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    messages = ["{}: {}".format(".".join(str(p) for p in e["loc"]), e["msg"].removeprefix("Value error, "))
                for e in exc.errors()]
    return _error(request, 422, "; ".join(messages))


@router.get("/healthz", summary="the process is up")
@router.get("/health", summary="the process is up (Flow-Factory's name)")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz", summary="rewards are loaded", responses={503: {"description": "still loading or failed"}})
async def readyz(service: Service) -> dict[str, Any]:
    service.ready()
    return {"ready": True}


@router.get("/v1/rewards", response_model=RewardsResponse, responses={503: {"description": "not ready"}})
async def list_rewards(service: Service) -> RewardsResponse:
    rewards = service.ready()
    return RewardsResponse(rewards=[
        RewardInfo(key=k, name=rewards.specs[k].name, kind=r.kind, weight=rewards.weights[k], inputs=r.inputs)
        for k, r in rewards.rewards.items()
    ])


@router.get("/metrics", summary="Prometheus metrics")
async def metrics(service: Service) -> Response:
    return Response(generate_latest(service.registry), media_type=CONTENT_TYPE_LATEST)


@scoring.post("/v1/score", response_model=ScoreResponse,
              responses={400: {"description": "unknown reward"}, 408: {"description": "body too slow"},
                         413: {"description": "over a limit"}, 422: {"description": "invalid request or image"},
                         503: {"description": "not ready, or request bodies at their bound"}})
async def score(request: ScoreRequest, service: Service) -> ScoreResponse:
    start = time.perf_counter()
    rewards = service.ready()
    keys = request.rewards if request.rewards is not None else list(rewards.weights)
    unknown = [k for k in keys if k not in rewards.rewards]
    if unknown:
        raise HTTPException(400, f"unknown reward(s) {', '.join(map(repr, unknown))}; "
                                 f"served: {', '.join(rewards.weights)}")
    images = await run_in_threadpool(service.decode, request.images, request.pixels, request.inputs)
    n = len(images)
    metadata = request.metadata or [{} for _ in range(n)]
    group_ids = request.group_ids or [0] * n
    inputs = None
    if request.input_index is not None:
        inputs = await run_in_threadpool(service.decode_inputs, request.inputs, request.input_index)
    outputs = await service.score(list(dict.fromkeys(keys)), images, request.prompts, metadata, group_ids, inputs)
    return ScoreResponse(
        results={k: RewardResult(scores=_finite_or_none(o.scores), errors=o.errors, extra=o.extra)
                 for k, o in outputs.items()},
        seconds=time.perf_counter() - start,
    )


@scoring.post(COMPUTE_PATH, summary="Flow-Factory remote reward: the weighted sum of every served reward",
              responses={408: {"description": "body too slow"}, 413: {"description": "over a limit"},
                         422: {"description": "invalid request, or a sample a reward cannot score for what it came "
                                                "with (the field named)"},
                         500: {"description": "a reward failed"},
                         503: {"description": "not ready, or request bodies at their bound"}})
async def compute(request: ComputeRequest, service: Service) -> dict[str, Any]:
    rewards = service.ready()
    prompts, images_b64 = request.prompt_list(), request.image_list()
    if len(prompts) != len(images_b64):
        raise HTTPException(422, f"prompt has {len(prompts)} items but image has {len(images_b64)}")
    try:
        conditions = request.condition_lists()
    except ValueError as exc:
        raise HTTPException(422, str(exc)) from exc
    if conditions is not None and len(conditions) != len(prompts):
        raise HTTPException(422, f"prompt has {len(prompts)} items but condition_images has {len(conditions)}")
    flat = [image for row in conditions or [] for image in row]
    images = await run_in_threadpool(service.decode, images_b64, None, flat)  # checks the count first
    inputs = None
    if conditions is not None:
        starts = np.cumsum([0, *map(len, conditions)]).tolist()
        inputs = await run_in_threadpool(service.decode_inputs, flat,
                                         [list(range(a, b)) for a, b in itertools.pairwise(starts)])
    # one mapping for every sample (rewards only read metadata): a copy each would cost images x its size
    metadata = [request.kwargs or request.extra or {}] * len(prompts)
    outputs = await service.score(list(rewards.weights), images, prompts, metadata, [0] * len(prompts), inputs)
    failures = [(key, i, error) for key, out in outputs.items() for i, error in enumerate(out.errors) if error]
    if mistakes := [(key, i, error) for key, i, error in failures if isinstance(error, SampleProblem)]:
        key, i, error = mistakes[0]
        return JSONResponse({"error": f"{_compute_field(request, error.field, i)}: {error.problem} (reward {key!r}, "
                                      f"sample {i})"}, 422)
    if failures:
        key, i, error = failures[0]
        return JSONResponse({"error": f"reward {key!r} failed on sample {i}: {error}"}, 500)
    return {"rewards": [float(s) for s in combine(outputs, rewards.weights)]}


def _compute_field(request: ComputeRequest, field: str, i: int) -> str:
    """A sample's ``field`` (``SampleError``) as ``/compute``'s body names it: every sample's metadata is its
    ``kwargs`` (or ``extra``), its input images ``condition_images[i]``."""
    root, _, rest = field.partition(".")
    if root == "metadata":
        return f"{'extra' if request.kwargs is None and request.extra else 'kwargs'}.{rest}"
    if root == "inputs":
        return "condition_images" if request.condition_images is None else f"condition_images[{i}]"
    return f"{root if getattr(request, root) is not None else root + 's'}[{i}]"  # prompt / image, either spelling


def create_app(settings: ServerSettings) -> FastAPI:
    """The reward service over ``settings``: its state in ``app.state`` (the service, the request gate), the
    routes above."""
    app = FastAPI(title="FlowGRPO reward server", version="1", lifespan=lifespan)
    app.state.service = RewardService(settings)
    app.state.gate = RequestGate(settings.limits)
    app.middleware("http")(count_requests)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.include_router(router)
    app.include_router(scoring)
    return app
