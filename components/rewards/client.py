"""The trainer's client for `flowgrpo reward-server`: async HTTP on a background event loop, with a
connection pool, a timeout, bounded in-flight requests and retries on transient failures."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Sequence
from typing import Any

import httpx
import numpy as np

from components.errors import RewardError
from components.rewards.base import RewardOutput
from components.rewards.codec import encode_raw_b64
from components.rewards.config import RewardServerConfig, RewardSpec
from components.rewards.http_retry import EXCERPT, RetriesExhausted, send_with_retries
from components.rewards.wire import RawPixels, RewardsResponse, ScoreRequest, ScoreResponse

# httpx logs every request at INFO; under a runner that turns INFO on (KFP's executor, Ray workers) that is one
# line per sampled batch. Failures are reported by this client itself.
logging.getLogger("httpx").setLevel(logging.WARNING)

BACKOFF_S = 0.5


class RemoteRewardSet:
    """Scores on a reward server. Keys, weights and ``required`` come from the trainer's reward specs;
    what each reward computes (its args) is the server's configuration."""

    def __init__(self, specs: list[RewardSpec], config: RewardServerConfig) -> None:
        self.url = config.url.rstrip("/")
        self.config = config
        self.weights = {s.key: s.weight for s in specs}
        self.required = {s.key for s in specs if s.required}
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="reward-client", daemon=True)
        self._thread.start()
        self._client = self._run(self._make_client())
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
        self.groupwise = {k for k in self.weights if served[k] == "groupwise"}

    def _run(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _make_client(self) -> httpx.AsyncClient:
        limits = httpx.Limits(max_connections=self.config.max_in_flight,
                              max_keepalive_connections=self.config.max_in_flight)
        return httpx.AsyncClient(timeout=self.config.timeout_s, limits=limits)

    async def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        url = f"{self.url}{path}"
        try:
            response = await send_with_retries(lambda: self._client.request(method, url, **kwargs),
                                               retries=self.config.retries, backoff_s=BACKOFF_S,
                                               limit=self._semaphore)
        except RetriesExhausted as exc:
            raise RewardError(f"reward server {url}: {exc}") from exc
        if response.status_code >= 400:
            raise RewardError(f"reward server {url} answered {response.status_code}: {response.text[:EXCERPT]}")
        return response

    async def _served(self) -> dict[str, str]:
        response = await self._send("GET", "/v1/rewards")
        return {r.key: r.kind for r in RewardsResponse.model_validate_json(response.content).rewards}

    def score(self, images: np.ndarray, prompts: list[str], metadata: list[dict[str, Any]],
              group_ids: Sequence[int], keys: Sequence[str]) -> dict[str, RewardOutput]:
        # Raw pixels: lossless and far cheaper than PNG; encoded in the calling (scoring) thread.
        pixels = RawPixels(shape=images.shape, data=encode_raw_b64(images))
        request = ScoreRequest(prompts=prompts, pixels=pixels, metadata=metadata, group_ids=list(group_ids),
                               rewards=list(keys))
        response = self._run(self._send("POST", "/v1/score", content=request.model_dump_json(),
                                        headers={"content-type": "application/json"}))
        results = ScoreResponse.model_validate_json(response.content).results
        return {k: RewardOutput(scores=np.array([np.nan if s is None else s for s in results[k].scores], dtype=float),
                                errors=list(results[k].errors), extra=results[k].extra) for k in keys}

    def close(self) -> None:
        if self._loop.is_closed():
            return
        if getattr(self, "_client", None) is not None:
            self._run(self._client.aclose())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5)
        self._loop.close()
