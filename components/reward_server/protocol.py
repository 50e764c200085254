"""uvicorn as the reward server runs it: h11 with a timeout on a request's line and headers, which uvicorn lacks (a
client sending a header byte every few seconds would hold its connection for ever), and no reading of a body after
its response (uvicorn reads the rest of a body the app did not read, however long, to reach the next request)."""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol, RequestResponseCycle

from components.reward_server.settings import Limits


class RequestHeadTimeoutH11(H11Protocol):
    """Closes the connection when a request's line and headers (its head) have not all arrived
    ``request_head_timeout_s`` after the connection opened or the previous response ended, and when a response is
    complete before its request's body (a route that reads no body, an answer given before the body was whole)."""

    request_head_timeout_s: float

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._head_timer: asyncio.TimerHandle | None = None
        self._timed_cycle: RequestResponseCycle | None = None
        self._arm()

    def _arm(self) -> None:
        self._disarm()
        self._timed_cycle = self.cycle  # a request whose headers are complete starts another cycle
        self._head_timer = self.loop.call_later(self.request_head_timeout_s, self._expire)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _expire(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            self.transport.close()

    def handle_events(self) -> None:
        super().handle_events()
        if self._head_timer is not None and self.cycle is not self._timed_cycle:
            self._disarm()

    def on_response_complete(self) -> None:
        if self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
            self.transport.close()  # after the response, which is written already
        super().on_response_complete()
        if not self.transport.is_closing() and self.cycle.response_complete:  # no pipelined request started
            self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)


def h11_protocol(limits: Limits) -> type[H11Protocol]:
    """The protocol class to give uvicorn (``http=``): h11 with ``limits.request_head_timeout_s``."""
    return type("RewardServerH11", (RequestHeadTimeoutH11,),
                {"request_head_timeout_s": limits.request_head_timeout_s})
