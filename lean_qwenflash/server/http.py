"""How uvicorn serves the app: its config, and an HTTP protocol that times the reading of requests.

uvicorn closes idle keep-alive connections (``timeout_keep_alive``) but nothing else: a client that
connects and never finishes its request head, or sends the body a byte at a time, holds a
connection (and its buffers) for as long as it likes, and a few hundred such clients starve the
server whether or not an API key is set (the key is checked only once the head is complete).

``TimedH11Protocol`` gives every request two deadlines, kept by one timer per connection:

- the head: a complete request head within ``server.header_timeout_s`` of the connection being
  made, or of the previous response on it finishing (keep-alive);
- the body: the whole body within ``server.body_timeout_s`` of the head.

When one passes the client gets ``408 Request Timeout`` with ``Connection: close`` if no response
has started and h11 can still send one (otherwise the transport is just closed), and the
connection is closed; an application still waiting for the body sees ``http.disconnect``.
Nothing is timed while a response is being sent, so a stream that takes minutes is not affected.

Why the body deadline is here and not in the ``Guard`` middleware (``middleware.py``, which reads
the whole body before any route runs): the head deadline can only live in the protocol (no ASGI
code runs before the head is complete), and keeping both in one place gives one timer, one 408
path and one set of states to reason about. The protocol sees bytes arrive and can close the transport itself, whereas
the middleware could only time its ``receive()`` calls and ask uvicorn to close by answering with
``Connection: close``. The body deadline thus holds for any route or middleware order. (The body
is only read as fast as the application consumes it past uvicorn's 64 KiB buffer; ``Guard``
consumes it at once, so the deadline measures the client.)

``limit_concurrency`` is deliberately not set: uvicorn counts open *connections* against it and
answers 503 to requests arriving while over the limit, so stalled connections would turn every
legitimate request (``/health`` included) into a 503 instead of being kept out. What bounds the
harm of stalled clients is that each is now closed after at most ``header_timeout_s`` +
``body_timeout_s``; one generation runs at a time anyway and ``server.max_queue`` bounds the
waiting requests (429).
"""
from __future__ import annotations

import json
import logging
from typing import Optional

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from lean_qwenflash.server.protocol import ApiError

log = logging.getLogger("lean_qwenflash.server")

_GRACEFUL_SHUTDOWN_S = 5


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request's head and one for its body.

    Use ``timed_protocol(header_timeout_s, body_timeout_s)`` for a class with the limits set.
    """

    header_timeout_s: float = 30.0
    body_timeout_s: float = 60.0

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._deadline = None              # asyncio.TimerHandle of the armed deadline, if any
        self._waiting_for: Optional[str] = None  # "head" or "body": what the deadline is for
        self._seen_scope = None            # the scope of the latest request whose head was read

    # -- the timer ------------------------------------------------------------------------------

    def _arm(self, what: str, seconds: float) -> None:
        self._disarm()
        self._waiting_for = what
        self._deadline = self.loop.call_later(seconds, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = None
        self._waiting_for = None

    def _track(self) -> None:
        """After h11 events were handled: a new request head disarms the head deadline and arms the
        body's (when a body follows); a finished body disarms it."""
        if self.scope is not None and self.scope is not self._seen_scope:
            self._seen_scope = self.scope
            self._disarm()
            cycle = self.cycle
            # No cycle for this scope: the connection was handed to a WebSocket protocol.
            if cycle is not None and cycle.scope is self.scope and cycle.more_body and not cycle.response_complete:
                self._arm("body", self.body_timeout_s)
        elif self._waiting_for == "body" and (not self.cycle.more_body or self.cycle.response_complete):
            self._disarm()

    def _expired(self) -> None:
        what = self._waiting_for
        self._deadline = None
        self._waiting_for = None
        if self.transport.is_closing():
            return
        limit = self.header_timeout_s if what == "head" else self.body_timeout_s
        key = "server.header_timeout_s" if what == "head" else "server.body_timeout_s"
        prefix = "%s:%d - " % self.client if self.client else ""
        log.info("%sclosing a connection: the request %s did not arrive within %g s (%s)",
                 prefix, what, limit, key)
        cycle = self.cycle if what == "body" else None
        if cycle is None or not cycle.response_started:
            self._send_408(f"the request {what} did not arrive within {limit:g} s ({key})")
        if cycle is not None:
            # The application (waiting in receive()) sees the client as gone; later sends are dropped.
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()

    def _send_408(self, message: str) -> None:
        body = json.dumps(ApiError(408, message, code="request_timeout", type="invalid_request_error").body())
        body = body.encode()
        headers = self.server_state.default_headers + [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"connection", b"close")]
        try:
            out = self.conn.send(h11.Response(status_code=408, headers=headers, reason=b"Request Timeout"))
            out += self.conn.send(h11.Data(data=body))
            out += self.conn.send(h11.EndOfMessage())
        except h11.LocalProtocolError:      # h11 cannot answer in this state (e.g. mid-response)
            return
        self.transport.write(out)

    # -- uvicorn's hooks ------------------------------------------------------------------------

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm("head", self.header_timeout_s)

    def handle_events(self) -> None:
        super().handle_events()
        if not self.transport.is_closing():
            self._track()

    def on_response_complete(self) -> None:
        # Armed before uvicorn handles a pipelined request, whose head then disarms it in _track.
        if not self.transport.is_closing():
            self._arm("head", self.header_timeout_s)
        super().on_response_complete()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)


def timed_protocol(header_timeout_s: float, body_timeout_s: float) -> type:
    """A ``TimedH11Protocol`` subclass with these deadlines (uvicorn makes one instance per
    connection from the class it is given, so the limits travel as class attributes)."""
    return type("TimedH11Protocol", (TimedH11Protocol,),
                {"header_timeout_s": float(header_timeout_s), "body_timeout_s": float(body_timeout_s)})


def uvicorn_config(app, cfg, log_level: str = "info", host: Optional[str] = None, port: Optional[int] = None):
    """The ``uvicorn.Config`` serving ``app`` as ``cfg`` (a RuntimeConfig) says; ``host``/``port``
    override ``cfg.server``'s (tests bind a free loopback port)."""
    import uvicorn

    s = cfg.server
    return uvicorn.Config(app, host=s.host if host is None else host, port=s.port if port is None else port,
                          log_level=log_level, http=timed_protocol(s.header_timeout_s, s.body_timeout_s),
                          timeout_graceful_shutdown=_GRACEFUL_SHUTDOWN_S)
