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

Connections are also bounded in number, so that a flood of them cannot use up the process's file
descriptors (then ``accept`` fails and nobody, ``/health`` included, gets in until some close):
``main.run`` raises the soft ``RLIMIT_NOFILE`` to the hard limit at start; one client address may
hold ``server.max_connections_per_client`` connections and the process ``capacity`` (the descriptor
limit less those already open and a reserve). A connection past either limit does not wait: the
oldest connection of that client (or, past the capacity, of anyone) that is only waiting for a
request head — stalled, or idle between keep-alive requests — gets ``503`` and is closed to make
room, and when every one of them has a request in progress the new connection gets the ``503``.
A client thus loses its own stalled sockets first, and a request is answered at once, never left
unaccepted.

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
import os
import resource
from typing import Optional

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from lean_qwenflash.server.protocol import ApiError

log = logging.getLogger("lean_qwenflash.server")

_GRACEFUL_SHUTDOWN_S = 5
FD_RESERVE = 32             # descriptors kept free beside the connections (files, snapshots, accept)


def raise_open_files_limit() -> tuple[int, int]:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit (capped by ``fs.nr_open``); returns the
    (old, new) soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = hard
    if hard == resource.RLIM_INFINITY:
        try:
            want = int(open("/proc/sys/fs/nr_open").read())
        except (OSError, ValueError):
            want = 1 << 20
    if want > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        except (ValueError, OSError) as e:
            log.warning("could not raise the open-files limit from %d to %d: %s", soft, want, e)
            return soft, soft
        return soft, want
    return soft, soft


def _soft_nofile() -> int:
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 1 << 20 if soft == resource.RLIM_INFINITY else soft


def accept_backlog() -> int:
    """The listen backlog: asyncio accepts up to this many connections in one go before any of
    them is seen by the protocol (which counts and limits them), so it is kept to a fraction of
    the descriptor limit (2048, uvicorn's default, when descriptors are plenty)."""
    return max(16, min(2048, _soft_nofile() // 8))


def connection_capacity() -> int:
    """Connections this process holds at most: the soft descriptor limit less the descriptors open
    now, ``FD_RESERVE`` and two accept bursts (accepted, not yet counted; closed, not yet released)."""
    try:
        open_now = len(os.listdir("/proc/self/fd"))
    except OSError:
        open_now = 64
    return max(16, _soft_nofile() - open_now - FD_RESERVE - 2 * accept_backlog())


class TimedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a deadline for each request's head and one for its body.

    Use ``timed_protocol(header_timeout_s, body_timeout_s)`` for a class with the limits set.
    """

    header_timeout_s: float = 30.0
    body_timeout_s: float = 60.0
    max_per_client: int = 64
    capacity: int = 1 << 20
    _by_client: dict = {}               # client address -> its open connections, oldest first
    _all: dict = {}                     # every open connection, oldest first (a dict as an ordered set)
    _warned: dict = {}                  # reason -> (when last logged, lines suppressed since)

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
            self._send_error(408, b"Request Timeout", f"the request {what} did not arrive within {limit:g} s ({key})",
                             "request_timeout", "invalid_request_error")
        if cycle is not None:
            # The application (waiting in receive()) sees the client as gone; later sends are dropped.
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()

    def _send_error(self, status: int, reason: bytes, message: str, code: str, type: str,
                    retry_after: Optional[int] = None) -> None:
        body = json.dumps(ApiError(status, message, code=code, type=type).body())
        body = body.encode()
        headers = self.server_state.default_headers + [
            (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
            (b"connection", b"close")] + ([(b"retry-after", str(retry_after).encode())] if retry_after else [])
        try:
            out = self.conn.send(h11.Response(status_code=status, headers=headers, reason=reason))
            out += self.conn.send(h11.Data(data=body))
            out += self.conn.send(h11.EndOfMessage())
        except h11.LocalProtocolError:      # h11 cannot answer in this state (e.g. mid-response)
            return
        self.transport.write(out)

    # -- uvicorn's hooks ------------------------------------------------------------------------

    # -- how many connections -------------------------------------------------------------------

    @property
    def _idle(self) -> bool:
        """Only waiting for a request head (stalled, or idle between keep-alive requests)."""
        return self._waiting_for == "head" and not self.transport.is_closing()

    def _refuse(self, why: str) -> None:
        """Answer 503 (no response has started on a connection waiting for a head) and close."""
        # One warning per reason every 10 s (a flood must not flood the log too), the rest at debug.
        now = self.loop.time()
        last, quiet = self._warned.get(why, (-1e9, 0))
        prefix = "%s:%d - " % self.client if self.client else ""
        if now - last >= 10:
            log.warning("%sclosing a connection with 503: %s%s", prefix, why,
                        f" ({quiet} more since the last such line)" if quiet else "")
            self._warned[why] = (now, 0)
        else:
            log.debug("%sclosing a connection with 503: %s", prefix, why)
            self._warned[why] = (last, quiet + 1)
        self._disarm()
        self._send_error(503, b"Service Unavailable", f"too many connections: {why}; retry shortly",
                         "too_many_connections", "server_error", retry_after=1)
        self.transport.close()

    def _make_room(self, pool, why: str) -> bool:
        """Close the oldest idle connection in ``pool`` other than this one; False if none is idle."""
        for other in pool:
            if other is not self and other._idle:
                other._refuse(why)
                other._forget()
                return True
        return False

    def _forget(self) -> None:
        self._all.pop(self, None)
        host = self.client[0] if self.client else None
        mine = self._by_client.get(host)
        if mine is not None:
            mine.pop(self, None)
            if not mine:
                del self._by_client[host]

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm("head", self.header_timeout_s)
        host = self.client[0] if self.client else None
        mine = self._by_client.setdefault(host, {})
        mine[self] = None
        self._all[self] = None
        if len(mine) > self.max_per_client:
            why = f"{host} holds more than server.max_connections_per_client={self.max_per_client}"
            if not self._make_room(mine, why):
                self._refuse(why)
                self._forget()
                return
        if len(self._all) > self.capacity:
            why = f"the server holds its capacity of {self.capacity} connections (the open-files limit)"
            if not self._make_room(self._all, why):
                self._refuse(why)
                self._forget()

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
        self._forget()
        super().connection_lost(exc)


def timed_protocol(header_timeout_s: float, body_timeout_s: float, max_per_client: int = 64,
                   capacity: int = 1 << 20) -> type:
    """A ``TimedH11Protocol`` subclass with these deadlines and connection limits (uvicorn makes one
    instance per connection from the class it is given, so the limits and the per-server
    connection tables travel as class attributes)."""
    return type("TimedH11Protocol", (TimedH11Protocol,),
                {"header_timeout_s": float(header_timeout_s), "body_timeout_s": float(body_timeout_s),
                 "max_per_client": int(max_per_client), "capacity": int(capacity), "_by_client": {}, "_all": {},
                 "_warned": {}})


def uvicorn_config(app, cfg, log_level: str = "info", host: Optional[str] = None, port: Optional[int] = None):
    """The ``uvicorn.Config`` serving ``app`` as ``cfg`` (a RuntimeConfig) says; ``host``/``port``
    override ``cfg.server``'s (tests bind a free loopback port)."""
    import uvicorn

    s = cfg.server
    return uvicorn.Config(app, host=s.host if host is None else host, port=s.port if port is None else port,
                          log_level=log_level, http=timed_protocol(s.header_timeout_s, s.body_timeout_s,
                                                                   s.max_connections_per_client, connection_capacity()),
                          backlog=accept_backlog(),
                          timeout_graceful_shutdown=_GRACEFUL_SHUTDOWN_S)
