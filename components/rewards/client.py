"""The trainer's client for `flowgrpo reward-server`: async HTTP on a background event loop, with a
connection pool, a timeout, bounded in-flight requests, retries on transient failures within a time window,
and a liveness watch: a server that stops answering its /healthz for that window fails the request, so a
frozen server stops the run instead of stalling it for the request timeout."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Awaitable, Sequence
from typing import Any

import httpx
import numpy as np

from components.console import status_line
from components.errors import RewardError
from components.polling import Polls
from components.rewards.base import Inputs, RewardOutput
from components.rewards.codec import encode_png_b64, encode_raw_b64
from components.rewards.config import RewardServerConfig
from components.rewards.http_retry import EXCERPT, RetriesExhausted, send_with_retries
from components.rewards.registry import RewardSpec
from components.rewards.wire import RawPixels, RewardInfo, RewardsResponse, ScoreRequest, ScoreResponse

# httpx logs every request at INFO; under a runner that turns INFO on (KFP's executor, Ray workers) that is one
# line per sampled batch. Failures are reported by this client itself.
logging.getLogger("httpx").setLevel(logging.WARNING)

BACKOFF_S = 0.5
PROBE_INTERVAL_S = 5.0  # how often an in-flight request checks that the server still answers /healthz
CLOSE_TIMEOUT_S = 10.0


class RemoteRewardSet:
    """Scores on a reward server. Keys, weights and ``required`` come from the trainer's reward specs;
    what each reward computes (its args) is the server's configuration."""

    def __init__(self, specs: list[RewardSpec], config: RewardServerConfig) -> None:
        self.url = config.url.rstrip("/")
        self.config = config
        self.weights = {s.key: s.weight for s in specs}
        self.required = {s.key for s in specs if s.required}
        self._probe_interval = min(PROBE_INTERVAL_S, config.retry_window_s / 4)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="reward-client", daemon=True)
        self._thread.start()
        self._client, self._probe = self._run(self._make_clients())
        self._semaphore = asyncio.Semaphore(config.max_in_flight)
        try:
            served = self._run(self._served())
        except BaseException:
            self.close()
            raise
        missing = [k for k in self.weights if k not in served]
        if missing:
            self.close()
            raise RewardError(f"reward server {self.url} does not serve {', '.join(missing)}; "
                              f"it serves {', '.join(sorted(served)) or 'nothing'}")
        self.groupwise = {k for k in self.weights if served[k].kind == "groupwise"}
        self.takes_inputs = {k for k in self.weights if served[k].inputs}  # the others are sent no input images

    def _run(self, coro: Awaitable[Any]) -> Any:
        """Run ``coro`` on the client's loop and wait for it. ``close`` cancels whatever is still running, so a
        caller never waits on a loop that has stopped."""
        if self._loop.is_closed():
            raise RewardError(f"reward server {self.url}: the client is closed")
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _make_clients(self) -> tuple[httpx.AsyncClient, httpx.AsyncClient]:
        limits = httpx.Limits(max_connections=self.config.max_in_flight,
                              max_keepalive_connections=self.config.max_in_flight)
        # the liveness probe has a connection of its own: scoring requests may hold every pooled one
        return (httpx.AsyncClient(timeout=self.config.timeout_s, limits=limits),
                httpx.AsyncClient(timeout=self._probe_interval))

    async def _alive(self) -> bool:
        with contextlib.suppress(httpx.HTTPError):
            return (await self._probe.get(f"{self.url}/healthz")).status_code == 200
        return False

    async def _watched(self, request: Awaitable[httpx.Response], url: str) -> httpx.Response:
        """``request``, failed once the server has not answered /healthz for the retry window, counted from the
        first probe it did not answer (not from the last it did, which may be a probe interval earlier)."""
        task = asyncio.ensure_future(request)

        async def answered(seconds: float) -> bool:
            done, _ = await asyncio.wait({task}, timeout=seconds)
            return bool(done)

        window, down_since = self.config.retry_window_s, None
        probes = Polls(None, self._probe_interval, wait=answered, wait_first=True)
        async for probed in probes:
            if await self._alive():
                down_since = None
            elif down_since is None:
                down_since = probed
            elif probes.elapsed() - down_since >= window:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
                raise RewardError(f"reward server {url}: no answer to /healthz for {window:g} s "
                                  "(reward_server.retry_window_s): the server is frozen or unreachable")
        return task.result()

    async def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        url = f"{self.url}{path}"

        def on_retry(line: str) -> None:
            status_line(f"reward server {url}: {line}")

        request = send_with_retries(lambda: self._client.request(method, url, **kwargs), retries=None,
                                    backoff_s=BACKOFF_S, limit=self._semaphore,
                                    window_s=self.config.retry_window_s, on_retry=on_retry)
        try:
            response = await self._watched(request, url)
        except RetriesExhausted as exc:
            raise RewardError(f"reward server {url}: {exc} (reward_server.retry_window_s "
                              f"{self.config.retry_window_s:g} s)") from exc
        if response.status_code >= 400:
            raise RewardError(f"reward server {url} answered {response.status_code}: {response.text[:EXCERPT]}")
        return response

    async def _served(self) -> dict[str, RewardInfo]:
        response = await self._send("GET", "/v1/rewards")
        return {r.key: r for r in RewardsResponse.model_validate_json(response.content).rewards}

    def score(self, images: np.ndarray, prompts: list[str], metadata: list[dict[str, Any]],
              group_ids: Sequence[int], keys: Sequence[str], inputs: Inputs | None = None) -> dict[str, RewardOutput]:
        # Raw pixels: lossless and far cheaper than PNG; encoded in the calling (scoring) thread.
        pixels = RawPixels(shape=images.shape, data=encode_raw_b64(images))
        request = ScoreRequest(prompts=prompts, pixels=pixels, metadata=metadata, group_ids=list(group_ids),
                               rewards=list(keys), **_input_fields(inputs if self.takes_inputs & set(keys) else None))
        response = self._run(self._send("POST", "/v1/score", content=request.model_dump_json(),
                                        headers={"content-type": "application/json"}))
        results = ScoreResponse.model_validate_json(response.content).results
        return {k: RewardOutput(scores=np.array([np.nan if s is None else s for s in results[k].scores], dtype=float),
                                errors=list(results[k].errors), extra=results[k].extra) for k in keys}

    async def _shutdown(self) -> None:
        """Cancel every request still in flight (their callers get the cancellation, not a wait forever), then
        close the connections."""
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for client in (getattr(self, "_client", None), getattr(self, "_probe", None)):
            if client is not None:
                await client.aclose()

    def close(self) -> None:
        if self._loop.is_closed():
            return
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout=CLOSE_TIMEOUT_S)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=CLOSE_TIMEOUT_S)
        if not self._thread.is_alive():
            self._loop.close()


def _input_fields(inputs: Inputs | None) -> dict[str, Any]:
    """``inputs`` and ``input_index`` of a request: a group's samples share their input images, each sent once
    (as PNG: an input image is a photo-sized file, sent once, where raw pixels would be 3 bytes a pixel)."""
    if inputs is None or not any(inputs):
        return {}
    unique: dict[int, int] = {}
    encoded: list[str] = []
    index = []
    for row in inputs:
        for image in row:
            if id(image) not in unique:
                unique[id(image)] = len(encoded)
                encoded.append(encode_png_b64(image))
        index.append([unique[id(image)] for image in row])
    return {"inputs": encoded, "input_index": index}
