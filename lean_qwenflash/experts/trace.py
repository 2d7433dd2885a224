"""Routing traces: which experts the model asked for, recorded as it runs, replayed against caches.

``generate --trace FILE`` / ``serve --trace FILE`` set a ``TraceWriter`` as the provider's
``observer``: every ``acquire(layer, ids)`` of ``TieredExperts`` is one record. ``replay FILE``
runs the records through a simulated host cache of each size and policy; ``lfu`` and ``lru`` are
the runtime's own rules (``experts/cache.py`` ``SlotCache``: a lookup pins and counts a use, a miss
takes a free slot or evicts the fewest-used / least recently released one, release makes the ids
most recent in acquire order), so with prefetch off the replay at the run's ``host_cache_bytes``
and ``cache_policy`` gives exactly the hits and misses the run counted. (With prefetch on the run also read speculatively, which a trace of demand
lookups does not hold: the replay is then the cache without prefetch.)

File: ``LQFTRACE`` + u32 header length + a JSON header (``layers``, ``top_k``, ``num_experts``,
``record_bytes`` per layer, ``slot_bytes``), then records ``u16 layer, u16 n, n x u16 ids``
(little-endian). A file is appendable: opening an existing trace of the same model appends to it;
one of another model is refused. A record cut short (the process was killed) ends the trace.

Steps are recovered from the records: a forward pass walks the MoE layers in order (a long prefill
acquires one layer in groups of ``host_slots`` ids), so a record whose layer is below the previous
one, or the same layer after a record that was not a full group, starts a new step. A step that acquires every layer once with at most ``top_k`` ids is one decode token.
"""
from __future__ import annotations

import heapq
import json
import struct
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Optional

from ..common import format_size
from .cache import DECAY_SLOTS

MAGIC = b"LQFTRACE"
VERSION = 1
POLICIES = ("lru", "lfu", "opt")
_HEAD = struct.Struct("<HH")


class TraceError(ValueError):
    """A trace file that cannot be read or appended to; the message says why."""


def header_for(provider) -> dict:
    """The header of a trace of ``provider`` (a ``TieredExperts``)."""
    store = provider.store
    layers = list(provider.layers)
    return {"version": VERSION, "layers": layers, "top_k": int(provider.top_k),
            "num_experts": max(store.layer(l).num_experts for l in layers) if layers else 0,
            "record_bytes": {str(l): int(store.record_bytes(l)) for l in layers},
            "slot_bytes": int(provider.slot_bytes), "host_slots": int(provider.num_host_slots)}


def _same_model(a: dict, b: dict) -> bool:
    keys = ("layers", "top_k", "num_experts", "record_bytes", "slot_bytes")
    return all(a.get(k) == b.get(k) for k in keys)


def _read_header(f, path) -> tuple[dict, int]:
    head = f.read(12)
    if len(head) < 12 or head[:8] != MAGIC:
        raise TraceError(f"{path} is not a routing trace (no {MAGIC.decode()} header); record one with "
                         "`generate --trace FILE` or `serve --trace FILE`")
    (n,) = struct.unpack("<I", head[8:])
    try:
        header = json.loads(f.read(n))
    except ValueError:
        raise TraceError(f"{path}: the trace header is damaged") from None
    if header.get("version") != VERSION:
        raise TraceError(f"{path}: trace version {header.get('version')} (this build reads {VERSION})")
    return header, 12 + n


class TraceWriter:
    """Appends acquire records; use as the provider's ``observer``. ``close()`` flushes."""

    def __init__(self, path, header: dict, flush_bytes: int = 1 << 16):
        self.path = Path(path)
        if header.get("num_experts", 0) > 0xFFFF or max(header.get("layers") or [0]) > 0xFFFF:
            raise TraceError("trace: expert ids and layers must fit in 16 bits")
        if self.path.exists() and self.path.stat().st_size > 0:
            with open(self.path, "rb") as f:
                old, _ = _read_header(f, self.path)
            if not _same_model(old, header):
                raise TraceError(f"{self.path} holds a trace of another model (layers, top-k, experts or record "
                                 "sizes differ); give a new file")
            self._f = open(self.path, "ab")
        else:
            self._f = open(self.path, "wb")
            body = json.dumps(header, sort_keys=True).encode()
            self._f.write(MAGIC + struct.pack("<I", len(body)) + body)
        self._buf = bytearray()
        self.flush_bytes = flush_bytes
        self.records = 0

    def __call__(self, layer_idx: int, expert_ids) -> None:
        self._buf += _HEAD.pack(layer_idx, len(expert_ids))
        self._buf += struct.pack(f"<{len(expert_ids)}H", *expert_ids)
        self.records += 1
        if len(self._buf) >= self.flush_bytes:
            self.flush()

    def flush(self) -> None:
        if self._buf:
            self._f.write(self._buf)
            self._buf.clear()
        self._f.flush()

    def close(self) -> None:
        if not self._f.closed:
            self.flush()
            self._f.close()


def attach(provider, path) -> TraceWriter:
    """Record ``provider``'s acquires into ``path`` (appending to a trace of the same model)."""
    if not hasattr(provider, "observer") or not hasattr(provider, "store"):
        raise TraceError("trace: the experts are resident (not streamed), so there is no routing to record; "
                         "run with a host cache (the default) to trace")
    w = TraceWriter(path, header_for(provider))
    provider.observer = w
    return w


@dataclass
class Trace:
    header: dict
    records: list              # [(layer, (ids...)), ...]
    truncated: bool = False
    _steps: Optional[list] = field(default=None, repr=False, compare=False)
    _decode_steps: Optional[list] = field(default=None, repr=False, compare=False)

    @property
    def record_bytes(self) -> dict:
        return {int(k): v for k, v in self.header["record_bytes"].items()}

    def steps(self) -> list:
        """The records split into forward passes: [[record index, ...], ...] (computed once: a
        trace is read, never changed)."""
        if self._steps is None:
            self._steps = self._split_steps()
        return self._steps

    def _split_steps(self) -> list:
        out, prev, prev_n = [], None, 0
        group = self.header.get("host_slots") or 0
        for i, (layer, ids) in enumerate(self.records):
            # Same layer again continues a step only after a full group (a prefill split in groups).
            if prev is None or layer < prev or (layer == prev and prev_n != group):
                out.append([])
            out[-1].append(i)
            prev, prev_n = layer, len(ids)
        return out

    def acquires(self, group: int) -> tuple[list, set]:
        """The acquires a provider holding ``group`` records at once would see: a step's
        consecutive records of one layer (a prefill's groups) joined, then split in groups of
        ``group`` as ``routed_experts`` does. Returns (acquires, indices of decode ones)."""
        dec_first = {s[0] for s in self.decode_steps()}
        out, dec = [], set()
        for step in self.steps():
            is_dec = step[0] in dec_first
            runs: list = []
            for i in step:
                layer, ids = self.records[i]
                if runs and runs[-1][0] == layer:
                    runs[-1][1].extend(ids)
                else:
                    runs.append((layer, list(ids)))
            for layer, ids in runs:
                for start in range(0, len(ids), group):
                    if is_dec:
                        dec.add(len(out))
                    out.append((layer, tuple(ids[start:start + group])))
        return out, dec

    def decode_steps(self) -> list:
        """The steps that are one decode token: every MoE layer once, at most top-k ids each."""
        if self._decode_steps is None:
            n_layers, k = len(self.header["layers"]), self.header["top_k"]
            self._decode_steps = [s for s in self.steps()
                                  if len(s) == n_layers and all(len(self.records[i][1]) <= k for i in s)
                                  and len({self.records[i][0] for i in s}) == n_layers]
        return self._decode_steps


def read_trace(path) -> Trace:
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as e:
        raise TraceError(f"cannot read the trace {path}: {e.strerror}") from None
    import io
    header, pos = _read_header(io.BytesIO(data), path)
    records, truncated = [], False
    end = len(data)
    while pos < end:
        if pos + 4 > end:
            truncated = True
            break
        layer, n = _HEAD.unpack_from(data, pos)
        if pos + 4 + 2 * n > end:
            truncated = True
            break
        records.append((layer, struct.unpack_from(f"<{n}H", data, pos + 4)))
        pos += 4 + 2 * n
    return Trace(header, records, truncated)


# -- the cache simulator ---------------------------------------------------------------------------

@dataclass
class SimResult:
    policy: str
    slots: int
    lookups: int = 0
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    per_layer: dict = field(default_factory=dict)     # layer -> [lookups, hits]
    decode_tokens: int = 0
    decode_bytes: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0

    @property
    def decode_bytes_per_token(self) -> float:
        return self.decode_bytes / self.decode_tokens if self.decode_tokens else 0.0


def simulate(trace: Trace, slots: int, policy: str = "lfu") -> SimResult:
    """Replay the trace's acquires through a host cache of ``slots`` records under ``policy``:
    ``lru`` or ``lfu`` (the runtime's SlotCache rules, ``cache_policy``: least recently released,
    or fewest lookups, counts halved every ``DECAY_SLOTS`` x ``slots`` lookups, then least recently
    released) or ``opt`` (Belady: the record used furthest in the future; no real cache does
    better). Prefetch is not modelled."""
    if policy not in POLICIES:
        raise TraceError(f"--policy: {policy!r} is not one of {', '.join(POLICIES)}")
    k = trace.header["top_k"]
    if slots < k:
        raise TraceError(f"a cache of {slots} records is below one layer's top-k ({k}); the runtime refuses it")
    rb = trace.record_bytes
    res = SimResult(policy, slots)
    res.decode_tokens = len(trace.decode_steps())
    acquires, decode = trace.acquires(slots)
    cached: set = set()
    evictable: "OrderedDict" = OrderedDict()   # lru: least recently released first
    heap: list = []                            # lfu / opt: (priority..., key), checked lazily
    prio: dict = {}                            # key -> its current priority while evictable
    count: dict = {}
    decay = DECAY_SLOTS * slots                # lfu: counts halve every this many lookups
    tick = 0
    nxt: list = []
    if policy == "opt":
        # For each lookup (in order), the position of the same key's next lookup.
        flat = [(layer, e) for layer, ids in acquires for e in ids]
        last: dict = {}
        nxt = [0] * len(flat)
        for pos in range(len(flat) - 1, -1, -1):
            nxt[pos] = last.get(flat[pos], 1 << 62)
            last[flat[pos]] = pos
    pos = 0
    for idx, (layer, ids) in enumerate(acquires):
        lay = res.per_layer.setdefault(layer, [0, 0])
        pinned = [((layer, e), pos + i) for i, e in enumerate(ids)]
        pos += len(ids)
        # As the runtime: the cached keys are pinned first, then the misses get slots (so a miss
        # never evicts a key of its own acquire).
        for key, _ in sorted(pinned, key=lambda kp: kp[0] not in cached):
            res.lookups += 1
            lay[0] += 1
            if key in cached:
                res.hits += 1
                lay[1] += 1
                evictable.pop(key, None)
                prio.pop(key, None)
            else:
                res.misses += 1
                res.bytes_read += rb[layer]
                if idx in decode:
                    res.decode_bytes += rb[layer]
                if len(cached) >= slots:
                    victim = _evict(policy, evictable, heap, prio)
                    if victim is None:
                        raise TraceError(f"a cache of {slots} records cannot hold one acquire of "
                                         f"{len(ids)} experts (layer {layer})")
                    cached.discard(victim)
                cached.add(key)
            # a use, counted once the key has its slot (as the runtime's pin counts it)
            count[key] = count.get(key, 0) + 1
            if policy == "lfu" and res.lookups % decay == 0:
                for used in count:
                    count[used] >>= 1
                prio = {k: ((c >> 1 if c > 0 else c), t) for k, (c, t) in prio.items()}
                heap = [(pr, k) for k, pr in prio.items()]
                heapq.heapify(heap)
        for key, p in pinned:                  # release, in acquire order
            tick += 1
            if policy == "lru":
                evictable[key] = None
                evictable.move_to_end(key)
            else:
                pr = (count[key], tick) if policy == "lfu" else (-nxt[p], tick)
                prio[key] = pr
                heapq.heappush(heap, (pr, key))
    return res


def _evict(policy, evictable, heap, prio):
    if policy == "lru":
        if not evictable:
            return None
        key, _ = evictable.popitem(last=False)
        return key
    while heap:
        pr, key = heapq.heappop(heap)
        if prio.get(key) == pr:
            del prio[key]
            return key
    return None


def slots_for(trace: Trace, cache_bytes: int) -> int:
    return cache_bytes // trace.header["slot_bytes"]


def replay_table(trace: Trace, sizes: Iterable[int], policies: Iterable[str], disk_gbps: Optional[float]) -> str:
    """The table `replay` prints: per size and policy, hit rate, bytes per decode token and the
    decode speed the disk allows (bytes per token / disk speed; an I/O bound, compute not counted)."""
    rows = [("cache", "slots", "policy", "hit %", "misses", "read", "read/token", "tok/s (I/O)")]
    for size in sizes:
        n = slots_for(trace, size)
        for pol in policies:
            r = simulate(trace, n, pol)
            per_tok = r.decode_bytes_per_token
            speed = ("-" if not disk_gbps or not r.decode_tokens else
                     "unbounded" if per_tok == 0 else f"{disk_gbps * 1e9 / per_tok:.1f}")
            rows.append((format_size(size), str(n), pol, f"{100 * r.hit_rate:.2f}", str(r.misses),
                         format_size(r.bytes_read), format_size(int(per_tok)) if r.decode_tokens else "-", speed))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in rows)


def suggest_cache(trace: Trace, target_hit_rate: float = 0.9, limit_bytes: Optional[int] = None,
                  policy: str = "lfu") -> tuple:
    """The smallest host cache (in slots, by bisection over sizes replayed under ``policy``) whose
    replayed hit rate reaches ``target_hit_rate``, capped at ``limit_bytes``; returns (bytes,
    SimResult)."""
    slot = trace.header["slot_bytes"]
    k = trace.header["top_k"]
    distinct = len({(l, e) for l, ids in trace.records for e in ids})
    hi = max(k, distinct)
    if limit_bytes is not None:
        hi = max(k, min(hi, limit_bytes // slot))
    lo = k
    best = simulate(trace, hi, policy)
    if best.hit_rate < target_hit_rate:
        return hi * slot, best
    while lo < hi:
        mid = (lo + hi) // 2
        r = simulate(trace, mid, policy)
        if r.hit_rate >= target_hit_rate:
            hi, best = mid, r
        else:
            lo = mid + 1
    return hi * slot, best          # (best is always hi's simulation)


__all__ = ["TraceWriter", "TraceError", "attach", "read_trace", "simulate", "replay_table", "suggest_cache",
           "Trace", "SimResult", "POLICIES", "header_for"]


class recording:
    """``with recording(provider, path):`` traces the provider's acquires into ``path`` (nothing
    when ``path`` is None) and says at the end how many records it appended."""

    def __init__(self, provider, path, out=None):
        self.provider, self.path, self.out = provider, path, out
        self.writer: Optional[TraceWriter] = None

    def __enter__(self):
        if self.path is not None:
            self.writer = attach(self.provider, self.path)
        return self.writer

    def __exit__(self, *exc):
        if self.writer is not None:
            self.provider.observer = None
            self.writer.close()
            if self.out is not None:
                self.out(f"trace: {self.writer.records} records appended to {self.path} "
                         f"(lean-qwenflash replay {self.path})")
        return False
