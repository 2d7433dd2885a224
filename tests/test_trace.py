"""Routing traces (experts/trace.py): the file format, the cache simulator, and the property that
matters: replaying a run's own trace through the runtime's policy gives exactly the hits and misses
the run counted."""
from __future__ import annotations

import os
import struct
import subprocess
import sys

import pytest

from lean_qwenflash.experts.trace import (MAGIC, Trace, TraceError, TraceWriter, read_trace, simulate,
                                          suggest_cache)

HEADER = {"version": 1, "layers": [0, 1], "top_k": 1, "num_experts": 4, "record_bytes": {"0": 100, "1": 50},
          "slot_bytes": 100, "host_slots": 2}


def _write(path, records, header=HEADER):
    w = TraceWriter(path, header, flush_bytes=8)
    for layer, ids in records:
        w(layer, ids)
    w.close()
    return w


def test_format_round_trip_append_and_refusals(tmp_path):
    p = tmp_path / "t.lqft"
    _write(p, [(0, [1]), (1, [2, 3])])
    _write(p, [(0, [0])])                                  # same model: appended
    t = read_trace(p)
    assert t.records == [(0, (1,)), (1, (2, 3)), (0, (0,))] and not t.truncated
    assert p.read_bytes().startswith(MAGIC)
    other = dict(HEADER, top_k=2)
    with pytest.raises(TraceError, match="another model"):
        TraceWriter(p, other)
    with open(p, "ab") as f:                               # a record cut short by a kill
        f.write(struct.pack("<HH", 1, 3) + struct.pack("<H", 2))
    t = read_trace(p)
    assert t.truncated and len(t.records) == 3
    bad = tmp_path / "bad"
    bad.write_bytes(b"hello world, not a trace")
    with pytest.raises(TraceError, match="not a routing trace"):
        read_trace(bad)


def test_simulator_by_hand():
    # Two slots, top-1, one layer: A B A C B A. LRU: A miss, B miss, A hit, C evicts B, B evicts A,
    # A evicts C -> 1 hit. LFU: C evicts B (A used twice), B evicts C, A hit -> 2 hits.
    # OPT: C evicts A or B by next use (B at 4, A at 5): evicts A; B hit; A evicts C/B -> 2 hits.
    h = dict(HEADER, layers=[0])
    t = Trace(h, [(0, (e,)) for e in (0, 1, 0, 2, 1, 0)])
    assert (simulate(t, 2, "lru").hits, simulate(t, 2, "lfu").hits, simulate(t, 2, "opt").hits) == (1, 2, 2)
    assert simulate(t, 3, "lru").hits == 3 and simulate(t, 3, "lru").bytes_read == 300
    # Steps: every record here is layer 0, so each is its own one-layer forward pass; all decode.
    assert len(t.decode_steps()) == 6
    # Pinning: an acquire's own experts are never evicted by its other misses.
    t2 = Trace(dict(h, top_k=2), [(0, (0, 1)), (0, (2, 3)), (0, (0, 1))])
    assert simulate(t2, 2, "lru").hits == 0
    # ... nor a key of its own acquire that is cached: it is pinned before the misses get slots.
    # After [0, 1] (0 the candidate under either rule), [2, 0]: 2 evicts 1, 0 hits.
    t3 = Trace(dict(h, top_k=2), [(0, (0, 1)), (0, (2, 0)), (0, (0, 2))])
    assert [simulate(t3, 2, p).hits for p in ("lru", "lfu", "opt")] == [3, 3, 3]
    with pytest.raises(TraceError, match="below one layer's top-k"):
        simulate(t2, 1, "lru")
    size, r = suggest_cache(t, 0.5)
    assert size == 300 and r.hit_rate == 0.5


def _run(tmp_path, host_slots: int, tokens: int, prompt_len: int, policy: str = "lru"):
    """Generate with a streamed default model, prefetch off, tracing on; returns (trace, stats)."""
    import torch

    from lean_qwenflash.config import load_config
    from lean_qwenflash.experts.trace import recording
    from lean_qwenflash.generate import Generator, SamplingParams
    from lean_qwenflash.runtime import Runtime
    cfg = load_config(None)
    rt0 = Runtime.open(cfg)
    slot = rt0.provider.slot_bytes
    rt0.close()
    cfg = load_config(None, host_cache_bytes=host_slots * slot, prefetch=False, cache_policy=policy)
    path = tmp_path / "run.lqft"
    with Runtime.open(cfg) as rt, recording(rt.provider, path):
        assert rt.provider.num_host_slots == host_slots
        g = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, int(rt.store.config["vocab_size"]), (prompt_len,), generator=g).tolist()
        gen = Generator(rt.model, prefill_chunk_tokens=16)
        out = list(gen.generate(prompt, SamplingParams(temperature=1.0, seed=3), tokens))
        assert len(out) == tokens
        stats = rt.provider.stats.snapshot()
    return read_trace(path), stats


@pytest.mark.parametrize("policy", ["lru", "lfu"])
@pytest.mark.parametrize("host_slots", [3, 9, 40])
def test_replay_reproduces_the_runs_hits_exactly(tmp_path, host_slots, policy):
    """The replay of a run's routing trace under the run's cache policy gives its hits exactly
    (lfu: with its use counts halving on the way at the smallest size)."""
    trace, stats = _run(tmp_path, host_slots, tokens=24, prompt_len=40, policy=policy)
    r = simulate(trace, host_slots, policy)
    if policy == "lfu" and host_slots == 3:
        from lean_qwenflash.experts.cache import DECAY_SLOTS
        assert r.lookups > DECAY_SLOTS * host_slots
    tot = stats["total"]
    assert tot["lookups"] > 0 and tot["misses"] > 0
    assert (r.lookups, r.hits, r.misses, r.bytes_read) == \
        (tot["lookups"], tot["hits_host"] + tot["hits_device"], tot["misses"], tot["bytes_read"])
    for layer, (lookups, hits) in r.per_layer.items():
        c = stats["layers"][layer]
        assert (lookups, hits) == (c["lookups"], c["hits_host"]), layer
    # 40 prompt tokens in chunks of 16, then 23 fed tokens: the decode steps are recognised.
    assert len(trace.decode_steps()) == 23
    assert len(trace.steps()) == 3 + 23
    # Belady is the bound: no policy beats it on the same trace.
    assert simulate(trace, host_slots, "opt").hits >= max(simulate(trace, host_slots, p).hits for p in ("lru", "lfu"))


def test_generate_trace_replay_and_doctor_cli(tmp_path, capsys):
    env = dict(os.environ, HOME=str(tmp_path))
    trace = tmp_path / "cli.lqft"
    cmd = [sys.executable, "-m", "lean_qwenflash"]
    for _ in range(2):                                      # the second run appends
        r = subprocess.run(cmd + ["generate", "--prompt-ids", "5,6,7,8,9,10", "--max-tokens", "6", "--no-prefetch",
                                  "--host-cache-bytes", "600KiB", "--trace", str(trace)],
                           env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr
        assert "records appended to" in r.stderr
    t = read_trace(trace)
    # Two runs, each a prefill step then a decode step per further token (fewer if EOS came early).
    assert len(t.steps()) - len(t.decode_steps()) == 2 and 2 <= len(t.decode_steps()) <= 10
    from lean_qwenflash.cli import main
    capsys.readouterr()
    assert main(["replay", str(trace), "--cache", "600KiB,1MiB,64MiB", "--policy", "lru,lfu,opt",
                 "--disk-gbps", "2"]) == 0
    out = capsys.readouterr().out
    rows = [l.split() for l in out.splitlines() if l.split() and l.split()[0].endswith(("KiB", "MiB"))]
    assert len(rows) == 9
    big = [row for row in rows if row[0] == "64.0MiB" and row[2] == "lru"][0]
    # 64 MiB holds every expert: only the first use of each misses.
    distinct = len({(l, e) for l, ids in t.records for e in ids})
    assert int(big[4]) == distinct
    assert "tok/s" in out and f"{len(t.decode_steps())} decode tokens" in out
    assert main(["replay", str(trace), "--policy", "fifo"]) == 2
    assert "fifo" in capsys.readouterr().err
    main(["doctor", "--trace", str(trace), "--probe-seconds", "0.2"])
    out = capsys.readouterr().out
    assert "host_cache_bytes:" in out and "replayed hit rate" in out, out
