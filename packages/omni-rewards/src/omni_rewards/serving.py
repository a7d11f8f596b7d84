"""Run an ASGI app with uvicorn behind connection limits: read timeout, idle timeout, a cap.

uvicorn alone has an idle (keep-alive) timeout, but no deadline for a request to arrive and no
cap on open connections: a client that opens a connection and sends nothing, or sends its
headers one byte a minute, holds a file descriptor forever, and a thousand of them starve
``/health``. `guarded_protocol` subclasses uvicorn's h11 protocol (the pure-Python HTTP/1.1
parser that ships with uvicorn) with three rules:

1. **Read timeout.** A request's headers and body must arrive within ``read_timeout_s`` of its
   first byte (of the connection, for a fresh one). Past it the server answers 408 (JSON) and
   closes the connection. The time the app takes to answer is not limited here.
2. **Idle timeout.** A keep-alive connection with no request for ``idle_timeout_s`` is closed
   (uvicorn's ``timeout_keep_alive``).
3. **Connection cap.** With ``max_connections`` open, a new connection first evicts the
   connection that has been *reading* longest (idle, or still sending its request); only when
   every open connection has a request in progress is the new one refused with 503 (JSON,
   ``Retry-After``). So slow or idle clients cannot lock out a ``/health`` probe.

A request uvicorn cannot parse gets a 400 JSON body here too (uvicorn's own is plain text).
The same design, in its own copy, runs diffusion-rollout's server (the packages import nothing of
each other); the repository's ``tests/test_server_copies.py`` holds the two copies equal.
"""

from __future__ import annotations

import json
import logging
import sys
from collections import Counter
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .limits import HTTPLimits

__all__ = ["CONNECTION_EVENTS", "HTTPLimits", "guarded_protocol", "run", "uvicorn_config"]

log = logging.getLogger("omni_rewards.serving")

# h11 states of the client's side while its request is still arriving
_READING = (h11.IDLE, h11.SEND_BODY)

#: what the rules did in this process: "read_timeout", "evicted", "refused", "bad_http"
#: (the server's /stats reports it under "connections")
CONNECTION_EVENTS: Counter[str] = Counter()


def _raw_response(status: int, reason: str, error: str, kind: str, extra: str = "") -> bytes:
    body = json.dumps({"error": error, "field": None, "kind": kind}).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n{extra}\r\n"
    )
    return head.encode() + body


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a read deadline and a connection cap (module docstring).

    Use `guarded_protocol` to get a subclass bound to a `HTTPLimits`."""

    limits: HTTPLimits = HTTPLimits()

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._read_timer: Any = None
        self._reading_since = self.loop.time()
        if len(self.connections) > self.limits.max_connections and not self._evict_one():
            CONNECTION_EVENTS["refused"] += 1
            log.warning("connection cap (%d) reached: refusing", self.limits.max_connections)
            transport.write(
                _raw_response(
                    503,
                    "Service Unavailable",
                    f"the server holds its maximum of {self.limits.max_connections} connections",
                    "overloaded",
                    "retry-after: 1\r\n",
                )
            )
            transport.close()
            return
        self._arm_read_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_read_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._read_timer is None and self.conn.their_state is h11.IDLE:
            self._reading_since = self.loop.time()  # a new request on a kept-alive connection
            self._arm_read_timer()
        super().data_received(data)
        if self.conn.their_state not in _READING:
            self._disarm_read_timer()  # the whole request is in

    def handle_events(self) -> None:
        try:
            super().handle_events()
        except (UnicodeDecodeError, ValueError) as exc:  # e.g. a non-ASCII request path
            self.send_400_response(f"Invalid HTTP request received ({type(exc).__name__}).")

    def send_400_response(self, msg: str) -> None:
        CONNECTION_EVENTS["bad_http"] += 1
        if not self.transport.is_closing():
            self.transport.write(_raw_response(400, "Bad Request", msg, "bad_request"))
            self.transport.close()

    # ---------------------------------------------------------------- internals
    def _arm_read_timer(self) -> None:
        self._disarm_read_timer()
        self._read_timer = self.loop.call_later(self.limits.read_timeout_s, self._read_timed_out)

    def _disarm_read_timer(self) -> None:
        timer = getattr(self, "_read_timer", None)
        if timer is not None:
            timer.cancel()
            self._read_timer = None

    def _is_reading(self) -> bool:
        """Idle, or still sending its request, with no answer under way."""
        if self.transport.is_closing() or self.conn.their_state not in _READING:
            return False
        cycle = self.cycle
        return cycle is None or cycle.response_complete or not cycle.response_started

    def _read_timed_out(self) -> None:
        self._read_timer = None
        if self._is_reading():
            CONNECTION_EVENTS["read_timeout"] += 1
            self._close_slow(
                408,
                "Request Timeout",
                f"request not received within {self.limits.read_timeout_s:g} s",
            )

    def _close_slow(self, status: int, reason: str, message: str) -> None:
        cycle = self.cycle
        if cycle is None or cycle.response_complete:
            self.transport.write(_raw_response(status, reason, message, "timeout"))
        self.transport.close()

    def _evict_one(self) -> bool:
        """Close the open connection that has been reading longest; False if none is."""
        readers = [
            c
            for c in self.connections
            if c is not self and isinstance(c, GuardedH11Protocol) and c._is_reading()
        ]
        if not readers:
            return False
        oldest = min(readers, key=lambda c: c._reading_since)
        CONNECTION_EVENTS["evicted"] += 1
        log.info("connection cap reached: closing the longest-reading connection")
        oldest._close_slow(
            408, "Request Timeout", "closed to make room: the request did not arrive in time"
        )
        return True


def guarded_protocol(limits: HTTPLimits) -> type[GuardedH11Protocol]:
    """A `GuardedH11Protocol` subclass bound to ``limits`` (uvicorn's ``http=`` argument)."""
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"limits": limits})


def uvicorn_config(
    app: Any, *, host: str, port: int, limits: HTTPLimits, log_level: str = "info"
) -> Any:
    """A ``uvicorn.Config`` that serves ``app`` under ``limits``."""
    import uvicorn

    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=guarded_protocol(limits),
        timeout_keep_alive=limits.idle_timeout_s,
        log_level=log_level,
        lifespan="on",
    )


def run(app: Any, *, host: str, port: int, limits: HTTPLimits, log_level: str = "info") -> None:
    """Serve ``app`` until interrupted (Ctrl-C / SIGTERM).

    The GIL switch interval drops from 5 ms to 1 ms: worker threads (parsing, decoding,
    scoring) then hand the GIL back to the event loop sooner, so ``/health`` and new
    connections wait less behind them. The process is the server's, so the global is ours."""
    import uvicorn

    sys.setswitchinterval(0.001)

    uvicorn.Server(
        uvicorn_config(app, host=host, port=port, limits=limits, log_level=log_level)
    ).run()
