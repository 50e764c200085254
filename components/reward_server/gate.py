"""What a scoring request passes before the app parses its body: the size cap (Content-Length first, then counted
while reading), a minimum arrival rate, a bound on the bytes of all bodies held at once, a slot among
``max_concurrent_requests``, and a bound on the JSON values parsed, parsing in a worker thread."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any

import pydantic_core
from fastapi import HTTPException, Request, Response
from fastapi.routing import APIRoute
from starlette.concurrency import run_in_threadpool
from starlette.types import Receive, Scope

from components.reward_server.settings import Limits

# Bodies held at once (being read, waiting for a slot, parsed), as a multiple of the slots' worth: a slow sender
# holds only what it has sent, so slow clients cannot take the slots from fast ones (a slot is taken once the body
# is complete).
HELD_BODIES_PER_SLOT = 2
CLOSE = {"connection": "close"}


def json_values_at_most(body: bytes | bytearray) -> int:
    """An upper bound on the JSON values and object keys of ``body``, without parsing it: each but the outermost
    value is the first item of a list or object (one ``[`` or ``{`` each), follows a comma, or follows a colon (a
    member's value). The same characters inside strings only raise the bound."""
    return sum(body.count(c) for c in (b",", b":", b"[", b"{")) + 1


class RequestGate:
    """Shared by the scoring routes of one app (``app.state.gate``)."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.slots = asyncio.Semaphore(limits.max_concurrent_requests)
        self.max_held = HELD_BODIES_PER_SLOT * limits.max_concurrent_requests * limits.max_body_bytes
        self.held = 0  # bytes of request bodies in memory; only the event loop's thread changes it

    async def read_body(self, request: Request) -> bytearray:
        """The whole body, or an HTTPException: 413 over max_body_bytes, 408 slower than the minimum rate, 503
        while the bodies held would pass their bound. Each of these answers before the body is whole, so it closes
        the connection (``CLOSE``): kept open, the server would read the rest of the body, however long, to reach
        the next request. Counted in ``held`` until ``release``; on an exception it is released here."""
        limits = self.limits
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limits.max_body_bytes:
            raise _too_large(limits.max_body_bytes)
        body = bytearray()
        start = asyncio.get_running_loop().time()
        try:
            while True:
                # the body so far must have come at the minimum rate, after the first body_grace_s
                deadline = start + limits.body_grace_s + len(body) / limits.min_body_bytes_per_s
                try:
                    async with asyncio.timeout_at(deadline):
                        message = await request.receive()
                except TimeoutError:
                    raise HTTPException(408, f"the request body came slower than {limits.min_body_bytes_per_s} "
                                             f"bytes/s after {limits.body_grace_s:g} s (limits.min_body_bytes_per_s, "
                                             "limits.body_grace_s)", headers=CLOSE) from None
                if message["type"] == "http.disconnect":
                    raise HTTPException(400, "the client closed the connection before its body was complete")
                chunk = message.get("body", b"")
                if len(body) + len(chunk) > limits.max_body_bytes:
                    raise _too_large(limits.max_body_bytes)
                if self.held + len(chunk) > self.max_held:
                    raise HTTPException(503, f"the server holds {self.held} bytes of request bodies, near its bound "
                                             f"of {self.max_held}; retry shortly",
                                        headers={"retry-after": "1", **CLOSE})
                body += chunk
                self.held += len(chunk)
                if not message.get("more_body", False):
                    return body
        except BaseException:
            self.release(body)
            raise

    def release(self, body: bytearray) -> None:
        self.held -= len(body)


def _too_large(limit: int) -> HTTPException:
    return HTTPException(413, f"request body exceeds the limit of {limit} bytes (limits.max_body_bytes)",
                         headers=CLOSE)


class _ReadRequest(Request):
    """A request whose body the gate has read. FastAPI parses a JSON body through ``json()``: here the values are
    counted before, and the parse runs in a worker thread."""

    def __init__(self, scope: Scope, receive: Receive, body: bytearray, max_values: int) -> None:
        super().__init__(scope, receive)
        self._read, self._max_values = body, max_values

    async def body(self) -> bytes:
        return self._read  # type: ignore[return-value]  # a bytearray: what FastAPI and the parser need of bytes

    async def json(self) -> Any:
        values = json_values_at_most(self._read)
        if values > self._max_values:
            raise HTTPException(413, f"the body holds up to {values} JSON values, over the limit of "
                                     f"{self._max_values} (limits.max_json_values)")
        try:
            return await run_in_threadpool(pydantic_core.from_json, self._read)
        except ValueError as exc:
            raise HTTPException(422, f"the body is not valid JSON: {exc}") from exc


class GatedRoute(APIRoute):
    """A route whose body is read through ``app.state.gate`` and which runs, body parsing included, in one of its
    slots."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def gated(request: Request) -> Response:
            gate: RequestGate = request.app.state.gate
            body = await gate.read_body(request)
            try:
                async with gate.slots:
                    return await handler(_ReadRequest(request.scope, request.receive, body,
                                                      gate.limits.max_json_values))
            finally:
                gate.release(body)

        return gated

