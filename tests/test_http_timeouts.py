"""Request-reading deadlines (server.header_timeout_s, server.body_timeout_s): a real uvicorn set up
as ``main.run`` sets it up, on 127.0.0.1, driven with raw sockets (stalled heads, trickled bodies)."""
from __future__ import annotations

import copy
import json
import os
import selectors
import socket
import sys
import time

import httpx
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from lean_qwenflash.config import ConfigError, load_config  # noqa: E402
from test_server import MODEL, ServerThread, tiny_runtime  # noqa: E402,F401  (tiny_runtime: a fixture)

HEAD_S = 1.0        # header_timeout_s of the server under test
BODY_S = 1.5        # body_timeout_s
MARGIN_S = 1.5      # scheduling slack on a busy 2-core machine


@pytest.fixture(scope="module")
def timed(tiny_runtime):  # noqa: F811
    from lean_qwenflash.server.app import create_app

    rt, cfg = tiny_runtime
    cfg = copy.deepcopy(cfg)
    cfg.server.header_timeout_s = HEAD_S
    cfg.server.body_timeout_s = BODY_S
    cfg.server.max_connections_per_client = 1000     # (the per-client cap: tests/test_hardening.py)
    cfg.validate()
    s = ServerThread(create_app(rt, cfg, model_name=MODEL), cfg)
    yield s
    s.stop()


def _connect(srv) -> socket.socket:
    return socket.create_connection(("127.0.0.1", srv.port), timeout=30)


def _until_closed(sock: socket.socket, limit_s: float = 30) -> bytes:
    """Everything the server sends until it closes the connection."""
    sock.settimeout(limit_s)
    data = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return data
        if not chunk:
            return data
        data += chunk


def _read_response(f) -> tuple[int, dict, bytes]:
    """One HTTP/1.1 response with a Content-Length from a socket's binary file."""
    status = int(f.readline().split()[1])
    headers = {}
    while (line := f.readline()) not in (b"\r\n", b""):
        k, _, v = line.decode("latin-1").partition(":")
        headers[k.strip().lower()] = v.strip()
    return status, headers, f.read(int(headers["content-length"]))


def _assert_408(data: bytes, what: str):
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), data[:200]
    assert b"connection: close" in head.lower()
    err = json.loads(body)["error"]
    assert err["code"] == "request_timeout" and what in err["message"], err


def test_config_keys_are_validated():
    cfg = load_config(None)
    assert (cfg.server.header_timeout_s, cfg.server.body_timeout_s) == (30.0, 60.0)
    assert load_config(None, server={"header_timeout_s": 5, "body_timeout_s": 0.5}).server.header_timeout_s == 5.0
    for key, bad in (("header_timeout_s", 0), ("body_timeout_s", -1), ("header_timeout_s", float("inf"))):
        with pytest.raises(ConfigError, match=f"server.{key}: must be a positive number of seconds"):
            load_config(None, server={key: bad})
    with pytest.raises(ConfigError, match="server.body_timeout_s: expected a number"):
        load_config(None, server={"body_timeout_s": "soon"})


def test_uvicorn_config_is_the_served_one(timed):
    from lean_qwenflash.server.http import TimedH11Protocol, uvicorn_config

    c = uvicorn_config(timed.app, timed.app.state.server.cfg, "warning")
    assert issubclass(c.http, TimedH11Protocol) and (c.http.header_timeout_s, c.http.body_timeout_s) == (HEAD_S, BODY_S)
    assert c.timeout_graceful_shutdown == 5 and c.limit_concurrency is None
    assert timed.server.config.http.header_timeout_s == HEAD_S      # ServerThread serves with it too


@pytest.mark.parametrize("sent", [b"", b"GET /health HTTP/1.1\r\nHost: x\r\n"], ids=["nothing", "half a head"])
def test_an_unfinished_head_gets_408_and_is_closed(timed, sent):
    with _connect(timed) as s:
        t0 = time.perf_counter()
        s.sendall(sent)
        data = _until_closed(s)
        elapsed = time.perf_counter() - t0
    print(f"head sent {sent[:20]!r}: closed after {elapsed:.2f} s (header_timeout_s={HEAD_S})")
    _assert_408(data, "header_timeout_s")
    assert HEAD_S - 0.05 <= elapsed <= HEAD_S + MARGIN_S, elapsed


def test_after_a_response_the_next_head_is_timed_too(timed):
    with _connect(timed) as s:
        f = s.makefile("rb")
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _read_response(f)[0] == 200
        t0 = time.perf_counter()
        s.sendall(b"GET /health HTTP/1.1\r\n")       # the next request never finishes its head
        data = f.read()
        elapsed = time.perf_counter() - t0
    print(f"second head: closed after {elapsed:.2f} s")
    _assert_408(data, "header_timeout_s")
    assert HEAD_S - 0.05 <= elapsed <= HEAD_S + MARGIN_S, elapsed


def test_a_trickled_body_gets_408_long_before_it_would_finish(timed):
    body = json.dumps({"model": MODEL, "prompt": "x" * 200, "max_tokens": 2}).encode()
    with _connect(timed) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body))
        t0 = time.perf_counter()
        sent = 0
        sel = selectors.DefaultSelector()
        sel.register(s, selectors.EVENT_READ)
        while sent < len(body) and not sel.select(0.3):      # one byte every 0.3 s (~70 s in all)
            try:
                s.sendall(body[sent:sent + 1])
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += 1
        data = _until_closed(s)
        elapsed = time.perf_counter() - t0
        sel.close()
    print(f"trickled body: {sent} of {len(body)} bytes sent, closed after {elapsed:.2f} s (body_timeout_s={BODY_S})")
    _assert_408(data, "body_timeout_s")
    assert BODY_S - 0.05 <= elapsed <= BODY_S + MARGIN_S and sent < len(body) / 4, (elapsed, sent)
    assert httpx.get(timed.url + "/health").status_code == 200


def test_a_keep_alive_client_with_short_pauses_is_not_affected(timed):
    """Several requests on one connection, each head and body sent in pieces, with pauses that keep
    each head within header_timeout_s of the previous response and each body within body_timeout_s
    of its head: all answered on the one connection."""
    completion = json.dumps({"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2}).encode()
    with _connect(timed) as s:
        f = s.makefile("rb")
        for i in range(4):
            if i % 2 == 0:
                s.sendall(b"GET /health HTTP/1.1\r\n")
                time.sleep(0.3)
                s.sendall(b"Host: x\r\n\r\n")
            else:
                s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n" % len(completion))
                for piece in (completion[:10], completion[10:20], completion[20:]):
                    time.sleep(0.4)
                    s.sendall(piece)
            status, headers, body = _read_response(f)
            assert status == 200 and headers.get("connection") != "close", (i, status, body)
            time.sleep(0.4)                          # + 0.3 s for the head: < header_timeout_s
        s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert _read_response(f)[0] == 200


class _Slow:
    """A model whose every call takes ``delay_s`` longer (the stream then lasts for seconds)."""

    def __init__(self, model, delay_s: float):
        self._model, self._delay_s = model, delay_s

    def __call__(self, *args, **kwargs):
        time.sleep(self._delay_s)
        return self._model(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._model, name)


def test_a_stream_longer_than_both_deadlines_completes(timed, monkeypatch):
    gen = timed.app.state.server.engine.generator
    monkeypatch.setattr(gen, "model", _Slow(gen.model, 0.1))
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 40, "stream": True}
    t0 = time.perf_counter()
    with httpx.stream("POST", timed.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        events = [line for line in r.iter_lines() if line.startswith("data:")]
    elapsed = time.perf_counter() - t0
    print(f"stream: {len(events)} events over {elapsed:.2f} s (deadlines {HEAD_S} + {BODY_S} s)")
    assert events[-1] == "data: [DONE]" and elapsed > HEAD_S + BODY_S + 0.5, (len(events), elapsed)


def test_hundreds_of_stalled_connections_do_not_block_health_and_are_all_closed(timed):
    n = 200
    socks = []
    for i in range(n):
        s = _connect(timed)
        if i % 2:
            s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")     # a head that never ends
        else:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")  # a body
        socks.append(s)
    t_open = time.perf_counter()
    try:
        t0 = time.perf_counter()
        assert httpx.get(timed.url + "/health", timeout=10).status_code == 200
        health_s = time.perf_counter() - t0
        sel = selectors.DefaultSelector()
        for s in socks:
            s.setblocking(False)
            sel.register(s, selectors.EVENT_READ)
        got = {s: b"" for s in socks}
        closed_at = {}
        deadline = t_open + max(HEAD_S, BODY_S) + 10
        while len(closed_at) < n and time.perf_counter() < deadline:
            for key, _ in sel.select(0.5):
                try:
                    chunk = key.fileobj.recv(65536)
                except ConnectionResetError:
                    chunk = b""
                got[key.fileobj] += chunk
                if not chunk:
                    closed_at[key.fileobj] = time.perf_counter() - t_open
                    sel.unregister(key.fileobj)
        sel.close()
    finally:
        for s in socks:
            s.close()
    times = sorted(closed_at.values())
    answered = sum(data.startswith(b"HTTP/1.1 408 ") for data in got.values())
    print(f"{n} stalled connections: /health took {health_s * 1e3:.0f} ms; {len(closed_at)} closed, "
          f"{answered} with 408, between {times[0]:.2f} and {times[-1]:.2f} s after the last was opened")
    assert len(closed_at) == n and answered == n
    assert health_s < 1.0 and times[-1] <= max(HEAD_S, BODY_S) + MARGIN_S + 1.0
    assert httpx.get(timed.url + "/health").status_code == 200
