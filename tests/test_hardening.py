"""What a misbehaving client can cost the server: requests whose clients leave (while queued, or
while generating), floods of half-open connections under a small open-files limit, and contexts
longer than memory holds (context budget: generate/budget.py)."""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import re
import resource
import selectors
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import hf_models  # noqa: E402
from lean_qwenflash.config import ConfigError, load_config  # noqa: E402
from test_server import MODEL, ServerThread, tiny_runtime  # noqa: E402,F401  (tiny_runtime: a fixture)

REPO = Path(__file__).resolve().parent.parent


class _Counting:
    """A model that counts its forward calls and takes ``delay_s`` longer for each."""

    def __init__(self, model, delay_s: float):
        self._model, self.delay_s, self.calls = model, delay_s, 0

    def __call__(self, *args, **kwargs):
        self.calls += 1
        time.sleep(self.delay_s)
        return self._model(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._model, name)


@pytest.fixture(scope="module")
def one_at_a_time(tiny_runtime):  # noqa: F811
    """A server that runs one generation at a time (the others queue)."""
    from lean_qwenflash.server.app import create_app

    rt, cfg = tiny_runtime
    cfg = copy.deepcopy(cfg)
    cfg.server.max_active = 1
    cfg.server.max_queue = 32
    cfg.server.prefix_cache_bytes = 0          # every prompt computed: the counts below are exact
    s = ServerThread(create_app(rt, cfg, model_name=MODEL), cfg)
    yield s
    s.stop()


def _wait(cond, limit_s: float, what: str) -> float:
    t0 = time.perf_counter()
    while not cond():
        assert time.perf_counter() - t0 < limit_s, f"timed out waiting for {what}"
        time.sleep(0.01)
    return time.perf_counter() - t0


def _raw_request(port: int, body: dict) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    data = json.dumps(body).encode()
    s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    return s


def test_clients_that_leave_while_queued_cost_nothing(one_at_a_time, monkeypatch):
    srv = one_at_a_time
    service = srv.app.state.server
    engine, gen = service.engine, service.engine.generator
    model = _Counting(gen.model, 0.05)
    monkeypatch.setattr(gen, "model", model)
    withdrawn0 = engine.withdrawn
    tokens0 = srv.metric("lqf_generation_tokens_total")
    cancelled0 = srv.metric("lqf_generations_cancelled_total")

    result = {}
    main_prompt = "Once upon a time"

    def main():
        r = httpx.post(srv.url + "/v1/completions", timeout=120,
                       json={"model": MODEL, "prompt": main_prompt, "max_tokens": 40})
        result["r"] = r

    t = threading.Thread(target=main)
    t.start()
    _wait(lambda: engine.active_count == 1, 30, "the long request to start")
    waiting = [_raw_request(srv.port, {"model": MODEL, "prompt": f"side request {i}", "max_tokens": 8,
                                       "stream": i % 2 == 0})
               for i in range(10)]
    _wait(lambda: engine.queue_depth == 10, 30, "10 queued requests")
    for i, s in enumerate(waiting):
        if i % 3 == 0:      # some reset the connection, the others close it
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        s.close()
    gone_s = _wait(lambda: engine.queue_depth == 0, 5, "the queue to empty")
    still_running = engine.active_count == 1
    t.join(120)
    r = result["r"]
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    print(f"10 queued clients left: the queue was empty {gone_s * 1e3:.0f} ms later (long request still "
          f"running: {still_running}); model calls {model.calls}; long request: {usage}")
    assert still_running, "the queue only emptied when the long request ended"
    assert engine.withdrawn - withdrawn0 == 10
    assert srv.metric("lqf_generations_cancelled_total") - cancelled0 == 10
    # Every token generated and every model call made was the long request's.
    assert srv.metric("lqf_generation_tokens_total") - tokens0 == usage["completion_tokens"]
    prompt_len = usage["prompt_tokens"]
    chunks = -(-prompt_len // gen.prefill_chunk_tokens)
    assert model.calls == chunks + usage["completion_tokens"] - 1, (model.calls, usage)


def test_a_generation_stops_at_the_next_token_when_its_client_leaves(one_at_a_time, monkeypatch):
    srv = one_at_a_time
    engine, gen = srv.app.state.server.engine, srv.app.state.server.engine.generator
    model = _Counting(gen.model, 0.1)
    monkeypatch.setattr(gen, "model", model)
    tokens0 = srv.metric("lqf_generation_tokens_total")
    s = _raw_request(srv.port, {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 200,
                                "stream": True})
    f = s.makefile("rb")
    events = 0
    while events < 3:
        if f.readline().startswith(b"data:"):
            events += 1
    calls_at_close = model.calls
    s.close()
    f.close()
    stop_s = _wait(lambda: engine.active_count == 0, 5, "the generation to stop")
    generated = srv.metric("lqf_generation_tokens_total") - tokens0
    print(f"client left after 3 events ({calls_at_close} model calls): stopped {stop_s * 1e3:.0f} ms later, "
          f"{model.calls} calls, {generated} tokens in all (of 200 asked)")
    # At most the step that was running when it left, and the one started before the cancel was seen.
    assert model.calls <= calls_at_close + 2 and generated <= model.calls


# -- connection floods (a real server process under a small open-files limit) ---------------------

def _set_nofile():
    resource.setrlimit(resource.RLIMIT_NOFILE, (128, 256))


def _from(addr: str, port: int) -> socket.socket:
    s = socket.socket()
    s.bind((addr, 0))
    s.connect(("127.0.0.1", port))
    return s


def _settle(socks: list, limit_s: float, want_closed: int) -> dict:
    """Read what the server sends on each socket; {socket: data} of those it closed, until
    ``want_closed`` are closed or ``limit_s`` passed."""
    sel = selectors.DefaultSelector()
    for s in socks:
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ)
    data = {s: b"" for s in socks}
    closed = {}
    t_end = time.perf_counter() + limit_s
    while len(closed) < want_closed and time.perf_counter() < t_end:
        for key, _ in sel.select(0.2):
            try:
                chunk = key.fileobj.recv(65536)
            except ConnectionResetError:
                chunk = b""
            data[key.fileobj] += chunk
            if not chunk:
                closed[key.fileobj] = data[key.fileobj]
                sel.unregister(key.fileobj)
    sel.close()
    return closed


def _health_s(port: int) -> float:
    t0 = time.perf_counter()
    r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=10)
    assert r.status_code == 200
    return time.perf_counter() - t0


def _is_503(data: bytes) -> bool:
    head, _, body = data.partition(b"\r\n\r\n")
    return head.startswith(b"HTTP/1.1 503 ") and json.loads(body)["error"]["code"] == "too_many_connections"


def test_connection_floods_under_a_small_open_files_limit_do_not_lock_anyone_out(tmp_path):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))    # this process opens ~700
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    per_client = 32
    (tmp_path / "serve.yaml").write_text(
        f"host_cache_bytes: 64MiB\nserver:\n  port: {port}\n  max_connections_per_client: {per_client}\n"
        "  header_timeout_s: 300\n  body_timeout_s: 300\n")
    log = open(tmp_path / "server.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "lean_qwenflash.server", "--config", str(tmp_path / "serve.yaml")],
                            stdout=log, stderr=subprocess.STDOUT, preexec_fn=_set_nofile, cwd=REPO)
    socks = []
    try:
        t0 = time.perf_counter()
        while True:
            assert proc.poll() is None, (tmp_path / "server.log").read_text()
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.perf_counter() - t0 < 180, "the server did not start"
            time.sleep(0.2)
        text = (tmp_path / "server.log").read_text()
        assert "RLIMIT_NOFILE) raised from 128 to 256" in text, text
        assert re.search(r"context: \d+ bytes per token \(KV as float32\) .* tokens fit", text), text
        capacity = int(re.search(r"connections: at most (\d+) open \(open-files limit 256\)", text).group(1))
        assert 16 <= capacity < 256 - 16

        # 1. One address with every connection busy (a request head read, its body pending): the
        #    next connection from it gets 503 at once (nothing of it can be closed instead).
        busy = [_from("127.0.0.20", port) for _ in range(per_client)]
        for s in busy:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{")
        socks += busy
        time.sleep(0.5)
        extra = _from("127.0.0.20", port)
        socks.append(extra)
        t_refused = time.perf_counter()
        refused = _settle([extra], 5, 1)
        assert extra in refused and _is_503(refused[extra]), refused
        refused_s = time.perf_counter() - t_refused
        assert not _settle(busy, 0.3, 1), "a busy connection was closed"

        # 2. 300 half-open sockets from one address: it keeps only its newest 32; the older ones
        #    get 503 and are closed as the new ones arrive.
        flood = []
        for i in range(300):
            s = _from("127.0.0.2", port)
            if i % 2:
                s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")      # a head that never ends
            flood.append(s)
        socks += flood
        closed = _settle(flood, 15, 300 - per_client)
        assert len(closed) == 300 - per_client and all(_is_503(d) for d in closed.values())
        survivors = [s for s in flood if s not in closed]
        assert survivors == flood[-per_client:]
        health_1 = _health_s(port)

        # 3. Many addresses, each under its own cap, past the process's capacity: the oldest idle
        #    connections are closed to make room; /health and a real request still get in at once.
        wide = [_from(f"127.0.0.{3 + i % 10}", port) for i in range(300)]
        socks += wide
        open_before = per_client + per_client        # busy + the flood's survivors
        want = open_before + len(wide) - capacity
        closed = _settle(survivors + wide, 15, want)
        assert len(closed) >= want and all(_is_503(d) for d in closed.values()), (len(closed), want)
        health_2 = _health_s(port)
        t1 = time.perf_counter()
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       json={"model": "default", "prompt": "Hello", "max_tokens": 4})
        request_s = time.perf_counter() - t1
        assert r.status_code == 200, r.text
        fds = len(os.listdir(f"/proc/{proc.pid}/fd"))
        print(f"capacity {capacity}: busy client refused in {refused_s * 1e3:.0f} ms; /health "
              f"{health_1 * 1e3:.0f} / {health_2 * 1e3:.0f} ms during the floods, a completion {request_s:.2f} s; "
              f"the server holds {fds} descriptors (limit 256)")
        assert health_1 < 1.0 and health_2 < 1.0 and fds < 256
    finally:
        for s in socks:
            s.close()
        proc.terminate()
        proc.wait(30)
        log.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_new_server_keys_are_validated():
    s = load_config(None).server
    assert (s.max_connections_per_client, s.snapshot_dir, s.snapshot_bytes) == (64, None, 8 * 1024**3)
    assert load_config(None, server={"snapshot_bytes": "2GiB"}).server.snapshot_bytes == 2 * 1024**3
    with pytest.raises(ConfigError, match="server.max_connections_per_client: must be >= 1"):
        load_config(None, server={"max_connections_per_client": 0})
    with pytest.raises(ConfigError, match="server.snapshot_dir: expected a string"):
        load_config(None, server={"snapshot_dir": 5})


# -- context budget ---------------------------------------------------------------------------------

@pytest.mark.parametrize("family", ["qwen3_next", "gpt_oss", "deepseek_v3"])
def test_context_cost_is_what_the_state_holds(family):
    """bytes per token and per sequence, from the model's layers, against a real state's bytes."""
    from lean_qwenflash.generate import Generator
    from lean_qwenflash.generate.budget import context_cost
    from lean_qwenflash.loader import load_hf_checkpoint

    c = hf_models.case(family)
    model, _ = load_hf_checkpoint(c.path)
    gen = Generator(model, prefill_chunk_tokens=16)
    cost = context_cost(model, "float32", 16)
    ids = hf_models.prompt_ids(c.config["vocab_size"], 100)[0].tolist()
    state = gen.new_state()
    gen.prefill(ids, state)

    def held(st) -> int:        # every tensor of the state (a ring's positions too)
        return sum(t.nbytes for layer in st.layers for t in vars(layer).values() if isinstance(t, torch.Tensor))

    # 100 tokens in chunks of 16: KV capacity 64 -> 128
    assert held(state) == cost.per_token * 128 + cost.fixed, (held(state), cost)
    assert held(state.clone()) == cost.per_token * 100 + cost.fixed
    print(family, cost)


def test_the_automatic_prefill_chunk_follows_the_model_shape(tiny_runtime):  # noqa: F811
    """generation.prefill_chunk_tokens 0 (the default): the longest multiple of 256 tokens, at most
    2048, whose activations fit 512 MiB and half the memory left beside the caches: 2048 for
    a small model, less for wide ones or little memory, never under 256; a configured chunk wins; the Runtime, its Generator and the budget use the same one, and a
    streamed runtime the same as a resident one (their outputs stay equal); peak_bytes counts the
    chunk's activations; a negative setting is refused by name."""
    from lean_qwenflash.config import ConfigError
    from lean_qwenflash.generate import Generator
    from lean_qwenflash.generate.budget import (CHUNK_WORKING_BYTES, MARGIN_BYTES, chunk_activation_bytes,
                                                context_cost, prefill_chunk_tokens, run_budget, run_caches, run_room)
    from lean_qwenflash.runtime import Runtime
    from lean_qwenflash.server.engine import context_budget

    def qwen(hidden, width, top_k):
        return {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": hidden, "moe_intermediate_size": width,
                "num_experts_per_tok": top_k, "num_experts": 128, "num_hidden_layers": 4, "intermediate_size": 64}
    chunks = {}
    for shape in ((1024, 512, 8), (2048, 768, 8), (4096, 1536, 8), (7168, 2048, 8), (16384, 8192, 16)):
        config = qwen(*shape)
        chunk, per_token = prefill_chunk_tokens(config), chunk_activation_bytes(config)
        chunks[shape] = chunk
        assert chunk % 256 == 0 and 256 <= chunk <= 2048
        assert chunk == 256 or (chunk * per_token <= CHUNK_WORKING_BYTES
                                and (chunk == 2048 or (chunk + 256) * per_token > CHUNK_WORKING_BYTES)), shape
        assert prefill_chunk_tokens(config, 100) == 100
    assert chunks[(1024, 512, 8)] == 2048 and chunks[(16384, 8192, 16)] == 256
    assert list(chunks.values()) == sorted(chunks.values(), reverse=True)
    small = qwen(1024, 512, 8)          # little memory left beside the caches: a shorter chunk, at least 256
    per_token = chunk_activation_bytes(small)
    assert prefill_chunk_tokens(small, 0, 2 * 1024 * per_token) == 1024
    assert prefill_chunk_tokens(small, 0, 2 * 1100 * per_token) == 1024
    assert prefill_chunk_tokens(small, 0, 1 << 20) == prefill_chunk_tokens(small, 0, -5) == 256
    assert prefill_chunk_tokens(small, 0, 1 << 40) == 2048 and prefill_chunk_tokens(small, 300, 0) == 300

    rt, cfg = tiny_runtime
    auto = prefill_chunk_tokens(rt.model.config, 0, run_room(cfg))
    assert cfg.generation.prefill_chunk_tokens == 0 and rt.prefill_chunk_tokens == auto
    assert Generator(rt.model).prefill_chunk_tokens == prefill_chunk_tokens(rt.model.config)
    budget = run_budget(rt.model, cfg, 4096, 8 * 1024**3, "RAM")
    assert budget.cost.chunk == prefill_chunk_tokens(rt.model.config, 0, 8 * 1024**3 - run_caches(cfg, "RAM")
                                                     - MARGIN_BYTES)
    assert budget.cost.activation_per_token == chunk_activation_bytes(rt.model.config)
    assert context_budget(rt, cfg, 4096).cost.chunk == rt.prefill_chunk_tokens
    cost = context_cost(rt.model, "float32", 64)
    plain = copy.copy(cost)
    plain.activation_per_token = 0
    for tokens in (10, 64, 1000):
        assert cost.peak_bytes(tokens) - plain.peak_bytes(tokens) == cost.activation_per_token * min(tokens, 64)
    with Runtime.open(dataclasses.replace(cfg, generation=dataclasses.replace(cfg.generation, prefill_chunk_tokens=48)),
                      resident_experts=True) as resident:
        assert resident.prefill_chunk_tokens == 48
    with Runtime.open(cfg, resident_experts=True) as resident:
        assert resident.prefill_chunk_tokens == rt.prefill_chunk_tokens
    bad = copy.deepcopy(cfg)
    bad.generation.prefill_chunk_tokens = -1
    with pytest.raises(ConfigError, match="generation.prefill_chunk_tokens: must be >= 1, or 0 for the automatic"):
        bad.validate()


def test_kv_peak_slots_follows_the_cache_growth():
    from lean_qwenflash.generate import KVCache
    from lean_qwenflash.generate.budget import kv_peak_slots

    for tokens, chunk in ((1, 256), (64, 16), (65, 16), (300, 256), (1000, 7), (5000, 512)):
        kv, peak, end = KVCache(), 0, 0
        while end < tokens:
            n = min(chunk, tokens - end)
            before = 0 if kv.keys is None else kv.keys.shape[2]
            kv.append(torch.zeros(1, 1, n, 2), torch.zeros(1, 1, n, 2))
            after = kv.keys.shape[2]
            peak = max(peak, after + (before if after != before else 0))
            end += n
        assert kv_peak_slots(tokens, chunk) == peak, (tokens, chunk)


def test_a_prompt_past_what_fits_in_memory_is_a_400_and_longer_answers_are_cut(tiny_runtime):  # noqa: F811
    from lean_qwenflash.server.app import create_app
    from lean_qwenflash.server.engine import context_budget

    rt, cfg = tiny_runtime
    app = create_app(rt, cfg, model_name=MODEL)
    service = app.state.server
    real = service.engine.budget
    assert real is not None and real.fit_tokens == service.context_tokens   # a tiny model: all of it fits
    cost = real.cost
    # Pretend only what 100 tokens of context need (plus the caches and margin) is available.
    avail = cost.peak_bytes(100) + real.caches_bytes + real.margin_bytes
    service.engine.budget = context_budget(rt, cfg, service.context_tokens, available=(avail, "RAM"))
    assert service.engine.context_fit == 100
    srv = ServerThread(app, cfg)
    try:
        long_prompt = list(range(5, 125))           # 120 token ids
        r = httpx.post(srv.url + "/v1/completions", json={"model": MODEL, "prompt": long_prompt, "max_tokens": 4})
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == "context_memory_exceeded", r.text
        assert "only 100 tokens of context fit" in err["message"] and "bytes per token" in err["message"]
        r = httpx.post(srv.url + "/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": list(range(5, 95)), "max_tokens": 50})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["usage"]["completion_tokens"] == 10 and body["choices"][0]["finish_reason"] == "length"
    finally:
        srv.stop()


def test_the_engine_admits_jobs_by_their_memory(tiny_runtime):  # noqa: F811
    """Two jobs that do not fit in memory together run one after the other even with free places
    (and the queue stays FIFO: a small job behind the waiting one waits too)."""
    import asyncio

    from lean_qwenflash.generate import SamplingParams
    from lean_qwenflash.server.engine import Engine, Job, context_budget
    from lean_qwenflash.server.metrics import Metrics
    from lean_qwenflash.server.output import TextOutput

    rt, cfg = tiny_runtime
    cost = context_budget(rt, cfg, 1024).cost
    one = cost.peak_bytes(20 + 30)
    # room for 1.5 big jobs: the second waits; a small job (5 + 3 tokens) fits beside the first
    budget = context_budget(rt, cfg, 1024, available=(int(1.5 * one) + cfg.server.prefix_cache_bytes
                                                      + cfg.host_cache_bytes + 256 * 1024**2, "RAM"))
    assert budget.budget_bytes < 2 * one and budget.budget_bytes > one + cost.peak_bytes(8)

    async def run():
        engine = Engine(rt.model, 16, 8, 0, Metrics(), max_active=4, budget=budget)
        order = []

        def job(name, n_prompt, n_new):
            j = Job(list(range(5, 5 + n_prompt)), SamplingParams(temperature=0.0), n_new, frozenset(),
                    TextOutput(rt.tokenizer, []))
            j.name = name
            return j

        async def drain(j):
            while True:
                kind, _ = await j.events.get()
                if kind == "delta" and (j.name, "first") not in order:
                    order.append((j.name, "first"))
                if kind in ("done", "error"):
                    order.append((j.name, "done"))
                    return

        jobs = [job("a", 20, 30), job("b", 20, 30), job("small", 5, 3)]
        for j in jobs:
            engine.submit(j)
        await asyncio.wait_for(asyncio.gather(*(drain(j) for j in jobs)), 120)
        engine.close()
        return order

    order = asyncio.run(run())
    print(order)
    assert order.index(("b", "first")) > order.index(("a", "done")), order
    # FIFO: the small job waits behind b (the head), so it too starts after a
    assert order.index(("small", "first")) > order.index(("a", "done")), order


def test_doctor_states_the_context_cost_and_what_fits(tiny_runtime):  # noqa: F811
    from lean_qwenflash.doctor import run_doctor
    from lean_qwenflash.generate.budget import context_cost

    rt, cfg = tiny_runtime
    lines = []
    assert run_doctor(cfg.model, probe_seconds=0.1, out=lines.append, cfg=cfg) in (0, 1)
    text = "\n".join(lines)
    cost = context_cost(rt.model, "float32", cfg.generation.prefill_chunk_tokens, copies=2)
    m = re.search(r"context: +(\d+) bytes per token \(KV as float32\).*\n +(\d+) tokens fit \(the model's context: "
                  r"(\d+)\) in .* of RAM", text)
    assert m, text
    assert int(m.group(1)) == cost.per_token and int(m.group(3)) == rt.store.config["max_position_embeddings"]
    assert 0 < int(m.group(2)) <= int(m.group(3))
