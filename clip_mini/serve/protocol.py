"""uvicorn's HTTP/1.1 protocol with deadlines on half-sent requests.

uvicorn times out idle keep-alive connections (``timeout_keep_alive``) but not a request that stops half-way: any
byte received cancels the idle timer, so a client sending one header line, or a body that never ends, held its
connection (and, for a body, a waiting route) open for good. ``TimedH11Protocol`` closes a connection whose
request headers have not all arrived ``HEADER_TIMEOUT_S`` after the connection opened or the previous response
ended, or whose body has not all arrived ``BODY_TIMEOUT_S`` after its headers. A route waiting for that body
then sees the client disconnect.
"""
from __future__ import annotations

import asyncio
from typing import Optional

from uvicorn.protocols.http.h11_impl import H11Protocol

HEADER_TIMEOUT_S = 10.0
BODY_TIMEOUT_S = 60.0     # a 13 MB upload (the body cap) at about 2 Mbit/s
KEEP_ALIVE_S = 5


class TimedH11Protocol(H11Protocol):
    """``H11Protocol`` plus the header and body deadlines above (class attributes, so a test can shorten them)."""

    header_timeout_s = HEADER_TIMEOUT_S
    body_timeout_s = BODY_TIMEOUT_S

    def connection_made(self, transport) -> None:
        self._deadline: Optional[asyncio.TimerHandle] = None
        super().connection_made(transport)
        self._arm(self.header_timeout_s)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not None and self.cycle is not cycle:   # a new request's headers arrived
            self._arm(self.body_timeout_s if self.cycle.more_body else None)
        elif self.cycle is not None and not self.cycle.more_body and not self.cycle.response_complete:
            self._arm(None)   # the body of the request being answered is complete

    def on_response_complete(self) -> None:
        cycle = self.cycle
        super().on_response_complete()   # may start a pipelined request (handle_events arms its deadline)
        if self.cycle is cycle and not self.transport.is_closing():
            self._arm(self.header_timeout_s)   # the next request on this connection

    def connection_lost(self, exc) -> None:
        self._arm(None)
        super().connection_lost(exc)

    def _arm(self, seconds: Optional[float]) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = None if seconds is None else self.loop.call_later(seconds, self._expire)

    def _expire(self) -> None:
        self._deadline = None
        cycle = self.cycle
        if cycle is not None and not cycle.more_body and not cycle.response_complete:
            return   # the request arrived in full and is being answered
        self.logger.info("closing a connection from %s: its request did not arrive in time",
                         "%s:%d" % self.client if self.client else "?")
        if cycle is not None and not cycle.response_complete:
            cycle.disconnected = True   # the route waiting for the body gets http.disconnect
            cycle.message_event.set()
        self.transport.close()


def uvicorn_settings() -> dict:
    """What ``uvicorn.run`` gets besides the app, host, port and workers."""
    return dict(http=TimedH11Protocol, timeout_keep_alive=KEEP_ALIVE_S, log_level="warning", access_log=False)
