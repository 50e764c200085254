"""Merge concurrent requests to a batched (model) reward into one call."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import numpy as np
from starlette.concurrency import run_in_threadpool

from components.rewards.base import RewardOutput

ScoreFn = Callable[[np.ndarray, list[str], list[dict[str, Any]], list[int]], RewardOutput]


class Batcher:
    """Requests wait at most ``window_s`` (or until ``max_batch`` images are queued), then one call scores
    them all in a worker thread and each request gets its slice back."""

    def __init__(self, fn: ScoreFn, window_s: float, max_batch: int) -> None:
        self.fn = fn
        self.window_s = window_s
        self.max_batch = max_batch
        self._queue: list[tuple[np.ndarray, list[str], list[dict[str, Any]], asyncio.Future]] = []
        self._queued = 0
        self._timer: asyncio.TimerHandle | None = None
        self.calls = 0  # how many batched calls ran, for tests and metrics

    async def score(self, images: np.ndarray, prompts: list[str], metadata: list[dict[str, Any]]) -> RewardOutput:
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()
        self._queue.append((images, prompts, metadata, future))
        self._queued += len(images) * (images.shape[1] if images.ndim == 5 else 1)  # a video's frames are images
        if self._queued >= self.max_batch:
            self._flush()
        elif self._timer is None:
            self._timer = loop.call_later(self.window_s, self._flush)
        return await future

    def _flush(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        batch, self._queue, self._queued = self._queue, [], 0
        if batch:
            self.calls += 1
            asyncio.get_running_loop().create_task(self._run(batch))

    async def _run(self, batch: list[tuple[np.ndarray, list[str], list[dict[str, Any]], asyncio.Future]]) -> None:
        images = np.concatenate([b[0] for b in batch])
        prompts = [p for b in batch for p in b[1]]
        metadata = [m for b in batch for m in b[2]]
        try:
            out = await run_in_threadpool(self.fn, images, prompts, metadata, [0] * len(images))
        except Exception as exc:  # the score function never raises; this guards the futures regardless
            out = RewardOutput.all_failed(len(images), f"{type(exc).__name__}: {exc}")
        start = 0
        for part_images, _, _, future in batch:
            end = start + len(part_images)
            if not future.done():
                future.set_result(RewardOutput(
                    scores=out.scores[start:end], errors=out.errors[start:end],
                    extra={k: v[start:end] for k, v in out.extra.items()},
                ))
            start = end
