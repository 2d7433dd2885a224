"""`TieredExperts`: routed experts streamed from the pack through a host and a device tier.

    store (experts.bin) --O_DIRECT read--> host slot (aligned arena; pinned on CUDA)
                        --async copy-----> device slot (CUDA; or a CPU "device" in tests)

On a CPU-only machine the host arena is the compute tier: the matmul reads the slot the SSD wrote,
no copy in between. With a device tier the host arena is the staging area and a second-level
cache; a host copy that has been promoted to the device is made the first to be evicted, so the
two budgets mostly hold different experts.

Layer-ahead prefetch: the model calls ``layer_input(L, x)`` with layer L's router input. Once
layer L's own experts are pinned, layer L+1's (..L+lookahead's) router is applied to that same
input (the "stale gate"); predicted experts that are not cached are read speculatively, behind any
demand read (demand reads are submitted as urgent and jump the engine's pending queue), and never
more than ``io_queue_depth`` speculative reads are in flight. A host-tier ``acquire`` or
``acquire_as_ready`` (the CPU decode step) that waits for layer L's reads works out these guesses (and
takes their slots) before it waits, and submits their reads the moment L's own reads have landed,
so the disk does not sit idle while the guesses are computed. (With a device tier, and in a
prefill's ``acquire_runs``, the guesses are worked out and queued together.)

Every served expert is bit-identical to the pack's bytes (checksum on first read) and hence to
``ResidentExperts`` loaded from the same pack.
"""
from __future__ import annotations

import time
from collections import deque
from contextlib import contextmanager
from typing import Optional, Sequence

import torch

from ..common import ConfigError, format_size
from ..io_engine import AlignedBuffer
from ..store.reader import record_views
from .cache import READING, SlotCache
from .provider import ExpertProvider, ExpertWeights
from .stats import TierStats


class TieredExperts(ExpertProvider):
    # Routing-trace hook (experts/trace.py TraceWriter): called with (layer, ids) on every acquire.
    observer = None

    def __init__(self, store, host_cache_bytes: int, top_k: int, predictors: Optional[dict] = None,
                 device: str | torch.device = "cpu", device_cache_bytes: int = 0, prefetch: bool = True,
                 prefetch_lookahead: int = 1, prefetch_extra: Optional[int] = None, max_speculative: Optional[int] = None,
                 cache_policy: str = "lfu"):
        self.store = store
        self.top_k = top_k
        self.slot_bytes = store.max_record_bytes
        self.layers = sorted(store.moe_layers)
        self._next_layers = {l: self.layers[i + 1:] for i, l in enumerate(self.layers)}
        self.stats = TierStats(self.layers)

        need = top_k * self.slot_bytes
        num_host = host_cache_bytes // self.slot_bytes
        if num_host < top_k:
            raise ConfigError(f"host_cache_bytes: {format_size(host_cache_bytes)} holds {num_host} expert records "
                              f"of {format_size(self.slot_bytes)}; the minimum is one layer's top-k ({top_k}) = "
                              f"{need} bytes ({format_size(need)})")
        # Never more slots than the pack has records: a small model does not get a 1 GiB arena.
        num_host = min(num_host, max(top_k, store.manifest.num_records))
        self.device = torch.device(device)
        self.host = SlotCache(num_host, cache_policy)   # keys (layer, expert id)
        self._num_experts = {l: store.layer(l).num_experts for l in self.layers}
        self.arena = AlignedBuffer(num_host * self.slot_bytes)
        self.host_bytes = torch.frombuffer(self.arena, dtype=torch.uint8).view(num_host, self.slot_bytes)
        self._host_requests: dict[int, int] = {}         # slot -> engine request id, while READING
        self._prefetched: set = set()                    # host slots read speculatively, not yet used
        self._speculative: deque = deque()               # host slots with speculative reads in flight
        self._planned: list = []                         # guesses with a slot, read not yet submitted
        self.max_speculative = max_speculative or (store.engine.queue_depth if store.engine else 1)
        self._cuda = self.device.type == "cuda"
        if self._cuda:
            # Pinned host memory makes the H2D copies true async DMA.
            rc = torch.cuda.cudart().cudaHostRegister(self.arena.address, self.arena.nbytes, 0)
            if int(rc) != 0:
                raise RuntimeError(f"cudaHostRegister of the {format_size(self.arena.nbytes)} host cache failed ({rc})")

        self.dev: Optional[SlotCache] = None
        if device_cache_bytes:
            num_dev = device_cache_bytes // self.slot_bytes
            if num_dev < top_k:
                raise ConfigError(f"device_cache_bytes: {format_size(device_cache_bytes)} holds {num_dev} expert "
                                  f"records; the minimum is one layer's top-k ({top_k}) = {need} bytes "
                                  f"({format_size(need)})")
            self.dev = SlotCache(num_dev, cache_policy)
            self.dev_bytes = torch.empty((num_dev, self.slot_bytes), dtype=torch.uint8, device=self.device)
            self._copy_stream = torch.cuda.Stream(self.device) if self._cuda else None
            self._dev_events: dict[int, object] = {}     # device slot -> event of its fill copy
            self._host_events: dict[int, object] = {}    # host slot -> event of a copy reading it
            self._dev_reads: dict[int, object] = {}      # device slot -> event after its last compute use
        elif self.device.type != "cpu":
            raise ConfigError("device_cache_bytes: a GPU device needs a device expert cache (> 0)")

        self.prefetch = prefetch
        self.predictors: dict = {}
        if predictors is not None:
            self.set_predictors(predictors)
        self.prefetch_lookahead = prefetch_lookahead
        # Experts guessed per layer: top-k + prefetch_extra (at least one), or by default the surest
        # three quarters of top-k, rounded up (when the disk is the bottleneck a wrong guess costs a
        # whole read, and the last-ranked guesses are the ones most often wrong).
        self.prefetch_guesses = (-(-3 * top_k // 4) if prefetch_extra is None else max(1, top_k + prefetch_extra))
        self._hidden: dict[int, torch.Tensor] = {}
        self._pinned: dict[int, list] = {}
        # Each slot's views per tier, made on first use: a list per record layout (indexed by slot),
        # reached by layer, so that layers with the same layout share them.
        layouts: dict = {}
        layout_id = {l: layouts.setdefault(store.layer(l).tensors, len(layouts)) for l in self.layers}

        def slot_views(num_slots: int) -> dict:
            per_layout = [[None] * num_slots for _ in layouts]
            return {l: per_layout[layout_id[l]] for l in self.layers}
        self._host_views = slot_views(num_host)
        self._dev_views = slot_views(self.dev.num_slots) if self.dev is not None else {}

    # -- sizes ----------------------------------------------------------------------------------
    @property
    def max_experts_per_acquire(self) -> int:
        return min(self.host.num_slots, self.dev.num_slots if self.dev else self.host.num_slots)

    @property
    def num_host_slots(self) -> int:
        return self.host.num_slots

    # -- views ----------------------------------------------------------------------------------
    def _views_of(self, layer_idx: int, slots: Sequence[int], dev: bool = False) -> list[ExpertWeights]:
        """The views of these host (device) slots as records of ``layer_idx`` (the hot path: one
        list lookup per slot once made)."""
        cached = (self._dev_views if dev else self._host_views)[layer_idx]
        views = [cached[s] for s in slots]
        if None in views:
            base = self.dev_bytes if dev else self.host_bytes
            for i, s in enumerate(slots):
                if views[i] is None:
                    views[i] = cached[s] = record_views(self.store.layer(layer_idx), base[s])
        return views

    # -- host tier ------------------------------------------------------------------------------
    def _host_alloc(self, key, layer_idx: int, wait: bool = True):
        """A READING host slot for ``key``. With ``wait`` (demand reads) it waits for speculative
        reads to free one; without (prefetch) it returns None instead. (A host slot whose copy to
        the device is still in flight is evictable: reusing it waits for that copy's event.)"""
        while True:
            slot, old = self.host.allocate(key)
            if slot is not None or not wait:
                break
            if not self._speculative:
                raise RuntimeError(f"host expert cache exhausted: all {self.host.num_slots} slots are in use by "
                                   f"layer {layer_idx}; raise host_cache_bytes")
            self._finish_host(self._speculative.popleft())   # oldest speculative read frees its slot
        if slot is None:
            return None
        if old is not None:
            self._evicted(slot, old)
        if self.dev is not None and slot in self._host_events:
            self._host_events.pop(slot).synchronize()        # a copy still reads this slot
        return slot

    def reset_stats(self) -> None:
        """Start the statistics afresh: counters to zero, and reads prefetched before now no longer
        count as useful or wasted later (else precision could exceed 1 after a reset)."""
        self.stats.reset()
        self._prefetched.clear()

    def _evicted(self, slot: int, old_key) -> None:
        if slot in self._prefetched:
            self._prefetched.remove(slot)
            self.stats.layers[old_key[0]].prefetch_wasted += 1

    def _host_submit(self, slot: int, layer_idx: int, expert_id: int, urgent: bool) -> None:
        self._host_requests[slot] = self.store.submit(layer_idx, expert_id, self.arena, slot * self.slot_bytes,
                                                      urgent=urgent)
        self.stats.layers[layer_idx].bytes_read += self.store.record_bytes(layer_idx)

    def _finish_host(self, slot: int) -> None:
        """Wait for the read into a host slot (if any) and make the slot READY."""
        rid = self._host_requests.pop(slot, None)
        if rid is None:
            if self.host.state(slot) == READING:      # (a slot taken for a read never submitted)
                raise RuntimeError(f"host slot {slot} ({self.host.key_of(slot)}) is waited on, but no read "
                                   "was ever submitted into it")
            return
        layer_idx, expert_id = self.host.key_of(slot)
        try:
            service_s = self.store.finish(rid, layer_idx, expert_id, self.arena, slot * self.slot_bytes)
        except Exception:
            pins = self.host.pins(slot)
            for _ in range(pins):
                self.host.unpin(slot)
            self.host.drop(slot)
            self._prefetched.discard(slot)
            raise
        self.stats.layers[layer_idx].read_time_s += service_s
        self.host.mark_ready(slot)

    def _ensure_host(self, layer_idx: int, expert_ids: Sequence[int], count: bool = True) -> list[int]:
        """Pinned, READY host slots holding the given experts; demand reads for misses."""
        slots, waits = self._pin_host(layer_idx, expert_ids, count)
        self._wait_host(layer_idx, waits)
        return slots

    def _pin_host(self, layer_idx: int, expert_ids: Sequence[int], count: bool = True) -> tuple[list, list]:
        """Pinned host slots for the given experts, demand reads submitted for the misses (all at
        once: the engine's queue depth works on them together); returns (slots, slots still READING)."""
        st = self.stats.layers[layer_idx]
        host = self.host
        slots = host.pin_present(layer_idx, expert_ids)
        if slots is not None:
            # Every expert has a slot (the common case once warm), now pinned in order: the loop
            # below without its branches, in one native call.
            if self._prefetched:
                useful = self._prefetched.intersection(slots)
                self._prefetched -= useful
                st.prefetch_useful += len(useful)
            if count:
                st.hits_host += len(slots)
            if not self._host_requests:          # (no read in flight: none of them is READING)
                return slots, []
            return slots, [slot for slot in slots if host.state(slot) == READING]
        # Those present are pinned first, then the misses get slots: a miss must not evict an
        # expert this same acquire is about to use (a guess that just landed, say).
        slots = [host.lookup((layer_idx, e)) for e in expert_ids]
        for slot in slots:
            if slot is not None:
                host.pin(slot)
                if count:
                    st.hits_host += 1
                if slot in self._prefetched:
                    self._prefetched.remove(slot)
                    st.prefetch_useful += 1
        for i, e in enumerate(expert_ids):
            if slots[i] is None:
                slot = slots[i] = self._host_alloc((layer_idx, e), layer_idx)
                host.pin(slot)
                st.misses += 1
                try:
                    self._host_submit(slot, layer_idx, e, urgent=True)
                except BaseException:
                    host.unpin(slot)
                    host.drop(slot)              # (no read will land in it)
                    raise
        return slots, [slot for slot in slots if host.state(slot) == READING]

    @contextmanager
    def _landing(self, layer_idx: int, waits: Sequence[int]):
        """The body runs while this layer's reads (``waits``) land: the next layer's guesses are
        worked out first, and on leaving (also by an exception, or a generator closed early: no
        read may still be landing in a released slot) the reads are waited for, then the guesses'
        reads submitted."""
        try:
            if self.prefetch and waits:
                self._plan_guesses(layer_idx, waits)
            yield
        finally:
            try:
                self._wait_host(layer_idx, waits)
            finally:
                self._read_guesses()

    def _wait_host(self, layer_idx: int, waits: Sequence[int]) -> None:
        """Wait for the reads into these pinned host slots (in order) and make them READY."""
        if not waits:
            return
        t0 = time.perf_counter()
        try:
            for slot in waits:
                if slot in self._speculative:
                    self._speculative.remove(slot)
                self._finish_host(slot)
        finally:
            self.stats.layers[layer_idx].stall_time_s += time.perf_counter() - t0

    # -- device tier ----------------------------------------------------------------------------
    def _acquire_device(self, layer_idx: int, expert_ids: Sequence[int]) -> list[ExpertWeights]:
        st = self.stats.layers[layer_idx]
        dev_slots, missing = [], []
        for i, e in enumerate(expert_ids):
            slot = self.dev.lookup((layer_idx, e))
            if slot is not None:
                self.dev.pin(slot)
                st.hits_device += 1
                dev_slots.append(slot)
            else:
                dev_slots.append(None)
                missing.append(i)
        if missing:
            ids = [expert_ids[i] for i in missing]
            host_slots = self._ensure_host(layer_idx, ids)
            for i, hslot in zip(missing, host_slots):
                key = (layer_idx, expert_ids[i])
                dslot, old = self.dev.allocate(key)
                if self._cuda:
                    self._dev_events.pop(dslot, None)
                if dslot is None:
                    raise RuntimeError(f"device expert cache exhausted: all {self.dev.num_slots} slots are in use; "
                                       "raise device_cache_bytes")
                self.dev.pin(dslot)
                self._copy_to_device(dslot, hslot)
                self.dev.mark_ready(dslot)        # pinned, so not evictable before release
                self.host.unpin(hslot)
                self.host.make_cold(hslot)        # lives on in VRAM now: evict its host copy first
                st.h2d_copies += 1
                dev_slots[i] = dslot
        if self._cuda:
            stream = torch.cuda.current_stream(self.device)
            for d in dev_slots:
                ev = self._dev_events.get(d)
                if ev is not None:
                    stream.wait_event(ev)       # compute waits for its copy, not for all copies
        return dev_slots

    def _copy_to_device(self, dslot: int, hslot: int) -> None:
        if self._cuda:
            last_read = self._dev_reads.pop(dslot, None)
            if last_read is not None:
                # Products queued on the compute stream may still read the evicted expert.
                self._copy_stream.wait_event(last_read)
            with torch.cuda.stream(self._copy_stream):
                self.dev_bytes[dslot].copy_(self.host_bytes[hslot], non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(self._copy_stream)
            self._dev_events[dslot] = ev
            self._host_events[hslot] = ev
        else:
            self.dev_bytes[dslot].copy_(self.host_bytes[hslot])

    # -- provider interface -------------------------------------------------------------------
    def layer_input(self, layer_idx: int, hidden_states: torch.Tensor) -> None:
        if self.prefetch:
            self._hidden[layer_idx] = hidden_states

    def _begin(self, layer_idx: int, expert_ids: Sequence[int]) -> list[int]:
        """An acquire's start: the ids as ints, traced and counted; finished speculative reads reaped."""
        # (a decode step's hot path, on caches its kernels just flushed: a list, the usual case, skips
        # torch's slow isinstance)
        if type(expert_ids) is not list and isinstance(expert_ids, torch.Tensor):
            expert_ids = expert_ids.tolist()
        else:
            expert_ids = list(map(int, expert_ids))
        if self.observer is not None:               # routing trace (experts/trace.py)
            self.observer(layer_idx, expert_ids)
        self.stats.layers[layer_idx].lookups += len(expert_ids)
        if self._planned:              # (a step that never waited for its batches: read its guesses now)
            self._read_guesses()
        if self._speculative:
            self._reap_speculative()
        return expert_ids

    def acquire(self, layer_idx: int, expert_ids: Sequence[int]) -> list[ExpertWeights]:
        expert_ids = self._begin(layer_idx, expert_ids)
        if self.dev is not None:
            slots = self._acquire_device(layer_idx, expert_ids)
            self._pinned.setdefault(layer_idx, []).append(("dev", slots))
            views = self._views_of(layer_idx, slots, dev=True)
        else:
            slots, waits = self._pin_host(layer_idx, expert_ids)
            self._pinned.setdefault(layer_idx, []).append(("host", slots))
            if waits:
                with self._landing(layer_idx, waits):
                    pass          # (nothing to compute meanwhile: guesses worked out, then the reads land)
            views = self._views_of(layer_idx, slots)
        if self.prefetch:
            self._prefetch_after(layer_idx)
        return views

    def acquire_as_ready(self, layer_idx: int, expert_ids: Sequence[int]):
        """``acquire`` of one token's experts in two batches, as (positions in ``expert_ids``, weights):
        first those whose bytes are in the host tier now, then, once their reads have landed, the
        rest (a batch may be empty; one batch when nothing is missing), so that a decode step
        computes its cached experts while the disk reads the others. The next layer's guesses are
        worked out (and given slots) before the first batch, and their reads submitted as soon as
        this layer's reads have landed (queued earlier they would share the disk with them). The
        slots stay pinned until ``release(layer_idx, expert_ids)``. Returns an iterable of batches:
        a list when every expert is cached (and with a device tier: one batch, after ``acquire``),
        else a generator, which the caller closes (``close()``) if it stops early."""
        if self.dev is not None:
            views = self.acquire(layer_idx, expert_ids)
            return [(list(range(len(views))), views)]
        expert_ids = self._begin(layer_idx, expert_ids)
        slots, waits = self._pin_host(layer_idx, expert_ids)
        self._pinned.setdefault(layer_idx, []).append(("host", slots))
        if not waits:          # (every expert cached: one batch, no generator)
            if self.prefetch:
                self._prefetch_after(layer_idx)
            return [(list(range(len(slots))), self._views_of(layer_idx, slots))]
        return self._batches_as_ready(layer_idx, slots, waits)

    def _batches_as_ready(self, layer_idx: int, slots: list, waits: list):
        reading = set(waits)
        ready = [i for i, s in enumerate(slots) if s not in reading]
        with self._landing(layer_idx, waits):     # (also when stopped early: see _landing)
            yield ready, self._views_of(layer_idx, [slots[i] for i in ready])
        rest = [i for i, s in enumerate(slots) if s in reading]
        yield rest, self._views_of(layer_idx, [slots[i] for i in rest])

    def acquire_runs(self, layer_idx: int, expert_ids: Sequence[int], run: int):
        """``acquire`` of ``expert_ids`` whose results arrive as they land: every miss is submitted at
        once, then (ids, weights) of consecutive runs of ``run`` experts are yielded in order, each as
        soon as its own reads are done, so that a prefill computes the first experts while the disk
        reads the rest. The slots stay pinned until ``release(layer_idx, expert_ids)``. (With a device
        tier every run waits for the whole acquire.)"""
        if self.dev is not None:
            views = self.acquire(layer_idx, expert_ids)
            for i in range(0, len(views), run):
                yield list(expert_ids[i:i + run]), views[i:i + run]
            return
        expert_ids = self._begin(layer_idx, expert_ids)
        slots, waits = self._pin_host(layer_idx, expert_ids)
        self._pinned.setdefault(layer_idx, []).append(("host", slots))
        if self.prefetch:
            self._prefetch_after(layer_idx)          # (the next layer's guesses queue behind these)
        if not waits:
            run = len(slots)             # (everything cached: one run)
        reading, done = set(waits), 0
        try:
            for i in range(0, len(slots), run):
                part = slots[i:i + run]
                self._wait_host(layer_idx, [s for s in part if s in reading])
                done = i + len(part)
                yield expert_ids[i:i + run], self._views_of(layer_idx, part)
        finally:      # (stopped early: no read may still be landing in a slot once it is released)
            self._wait_host(layer_idx, [s for s in slots[done:] if s in reading])

    def release(self, layer_idx: int, expert_ids: Sequence[int]) -> None:
        stack = self._pinned.get(layer_idx)
        if not stack:
            return
        tier, slots = stack.pop()
        cache = self.dev if tier == "dev" else self.host
        if tier == "dev" and self._cuda:
            # Release happens when the products are queued, not done: remember where they end so
            # that a copy refilling one of these slots waits for them (write after read).
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
            for s in slots:
                self._dev_reads[s] = done
        cache.unpin_all(slots)

    # -- prefetch -------------------------------------------------------------------------------
    def set_predictors(self, predictors: dict) -> None:
        """{layer: predict(hidden [N, H], n) -> expert ids [N, n]}: each sparse layer's routing rule
        (each sparse block's ``predict``: its router's rule), applied to a stale input to guess its experts.
        With prefetch on, every sparse layer but the first needs one: a family that cannot predict
        is an error here, not a silently disabled prefetch."""
        missing = [l for l in self.layers[1:] if l not in predictors]
        if self.prefetch and missing:
            raise ConfigError(f"prefetch: the model cannot predict the experts of layers {missing[:8]} "
                              "(no routing rule for them); set prefetch: false")
        self.predictors = dict(predictors)

    def _predict(self, layer_idx: int, hidden: torch.Tensor) -> list[int]:
        top = self.predictors[layer_idx](hidden, self.prefetch_guesses)
        if top.shape[0] == 1:
            return top[0].tolist()
        # Many tokens (prefill): the experts picked by the most tokens first.
        counts = torch.bincount(top.flatten(), minlength=self.store.layer(layer_idx).num_experts)
        order = torch.argsort(counts, descending=True, stable=True)
        return [int(e) for e in order[: int((counts > 0).sum())]]

    def _reap_speculative(self) -> None:
        """Make finished speculative reads READY (verified, evictable) without blocking."""
        eng = self.store.engine
        while self._speculative and eng.is_done(self._host_requests[self._speculative[0]]):
            self._finish_host(self._speculative.popleft())

    def _prefetch_after(self, layer_idx: int) -> None:
        """Guess the next layers' experts from layer L's router input and read those not cached."""
        self._plan_guesses(layer_idx)
        self._read_guesses()

    def _plan_guesses(self, layer_idx: int, landing: Sequence[int] = ()) -> None:
        """The next layers' guesses that are not cached, each given a host slot (READING) and kept
        in ``_planned`` until ``_read_guesses`` submits their reads. ``landing``: the slots the step
        is about to wait for (its own speculative reads among them no longer count as in flight)."""
        hidden = self._hidden.pop(layer_idx, None)
        if hidden is None:
            return
        planned = self._planned
        in_flight = len(self._speculative) - sum(1 for slot in landing if slot in self._speculative)
        for nxt in self._next_layers[layer_idx][: self.prefetch_lookahead]:
            if nxt not in self.predictors or self.host.held_in(nxt) >= self._num_experts[nxt]:
                continue            # (the host tier holds every expert of that layer: nothing to read)
            for e in self._predict(nxt, hidden):
                key = (nxt, e)
                if (self.dev is not None and self.dev.lookup(key) is not None) or self.host.lookup(key) is not None:
                    continue
                if in_flight + len(planned) >= self.max_speculative:
                    return
                slot = self._host_alloc(key, nxt, wait=False)
                if slot is None:
                    return                      # everything else is pinned or in flight: skip
                planned.append((slot, nxt, e))

    def _read_guesses(self) -> None:
        """Submit the planned guesses' reads (speculative: behind any demand read)."""
        planned, self._planned = self._planned, []
        for i, (slot, layer, e) in enumerate(planned):
            try:
                self._host_submit(slot, layer, e, urgent=False)
            except BaseException:
                for s, _, _ in planned[i:]:   # (no read will land in these: free them)
                    self.host.drop(s)
                raise
            self._prefetched.add(slot)
            self._speculative.append(slot)
            self.stats.layers[layer].prefetch_issued += 1

    def preload(self) -> int:
        """Read experts into the host tier, layer by layer, until it is full; returns how many.
        (Benchmarks use it to measure a fully cached model; statistics are left untouched.)"""
        if self._planned:
            self._read_guesses()
        saved = self.stats.layers
        self.stats.layers = {l: type(c)() for l, c in saved.items()}
        n = 0
        try:
            for layer in self.layers:
                rec = self.store.layer(layer)
                for start in range(0, rec.num_experts, self.host.num_slots):
                    if n >= self.host.num_slots:
                        return n
                    ids = list(range(start, min(rec.num_experts, start + self.host.num_slots - n)))
                    for slot in self._ensure_host(layer, ids):
                        self.host.unpin(slot)
                    n += len(ids)
        finally:
            self.stats.layers = saved
        return n

    def drain(self) -> None:
        """Finish every speculative read (before closing the store)."""
        if self._planned:
            self._read_guesses()
        while self._speculative:
            self._finish_host(self._speculative.popleft())

    def close(self) -> None:
        try:
            self.drain()
        finally:
            if self._cuda:
                torch.cuda.synchronize(self.device)
                torch.cuda.cudart().cudaHostUnregister(self.arena.address)

    def describe(self) -> str:
        parts = [f"host tier {self.host.num_slots} slots x {format_size(self.slot_bytes)} = "
                 f"{format_size(self.host.num_slots * self.slot_bytes)} ({self.host.policy})"]
        if self.dev:
            parts.append(f"device tier ({self.device}) {self.dev.num_slots} slots = "
                         f"{format_size(self.dev.num_slots * self.slot_bytes)}")
        eng = self.store.engine
        parts.append(f"I/O {eng.kind} depth {eng.queue_depth}" + ("" if eng.direct else " (buffered)"))
        parts.append(f"prefetch {f'on, lookahead {self.prefetch_lookahead}, {self.prefetch_guesses} guesses per layer' if self.prefetch else 'off'}")
        return "; ".join(parts)
