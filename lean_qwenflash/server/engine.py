"""One generation at a time on the model: a worker thread, a bounded FIFO queue, a prefix cache.

The HTTP side builds a ``Job`` (prompt ids, sampling, an output pipeline from ``output.py`` and
optional ``Steering``) and ``submit``s it; the worker runs it and hands events back to the job's
asyncio loop: ``("delta", [deltas])`` as text appears, then ``("done", info)`` or
``("error", message)``. ``Job.cancel()`` (client gone) is checked between tokens.

Prefix reuse: DeltaNet recurrent state cannot be rewound, so we keep whole ``ModelState`` snapshots
at points a later prompt is likely to extend: the end of each prompt, the last block boundary
(every ``block_tokens``) reached while generating and the end of generation. A new prompt starts
from the longest snapshot that is a strict prefix of it and prefills only the rest. The server also
asks for snapshots at turn boundaries inside the prompt (``Job.checkpoints``: the end of the
conversation so far, and after the assistant header): chat templates re-render earlier assistant
turns differently (e.g. without their think block), so the previous prompt's end is often not a
prefix of the next one, while these points are.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from lean_qwenflash.generate import Generator, ModelState, SamplingParams
from lean_qwenflash.generate.sampling import Sampler

log = logging.getLogger("lean_qwenflash.server")


class QueueFull(Exception):
    """More requests are waiting than ``max_queue`` allows."""


class PrefixCache:
    """LRU of ``ModelState`` snapshots keyed by the token ids they hold, bounded in bytes.

    Thread-safety: used only by the engine's worker thread.
    """

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self._entries: collections.OrderedDict[tuple, tuple[ModelState, int]] = collections.OrderedDict()
        self.used_bytes = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, token_ids: Sequence[int]) -> Optional[ModelState]:
        """A fresh copy of the longest snapshot that is a strict prefix of ``token_ids``, or None."""
        best = None
        n = len(token_ids)
        for key in self._entries:
            if len(key) < n and (best is None or len(key) > len(best)) and tuple(token_ids[:len(key)]) == key:
                best = key
        if best is None:
            return None
        self._entries.move_to_end(best)
        return self._entries[best][0].clone()

    def put(self, token_ids: Sequence[int], state: ModelState, copy: bool = True) -> None:
        """Keep a copy of ``state``, which holds exactly ``token_ids``; ``copy=False`` keeps ``state``
        itself, for a caller that will not touch it again."""
        key = tuple(token_ids)
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        if not key:
            return
        nbytes = state.nbytes() + 8 * len(key)
        if nbytes > self.capacity_bytes:
            return
        while self.used_bytes + nbytes > self.capacity_bytes and self._entries:
            _, (_, old) = self._entries.popitem(last=False)
            self.used_bytes -= old
            self.evictions += 1
        self._entries[key] = (state.clone() if copy else state, nbytes)
        self.used_bytes += nbytes


class Steering:
    """Tokens the engine forces instead of sampling: the thinking budget and tool_choice.

    ``in_think``: the prompt opened ``<think>``. Once ``think_budget`` tokens were generated inside
    the think block, ``close_ids`` (e.g. "\\n</think>\\n\\n") are forced. ``after_think_ids``
    (e.g. "<tool_call>" for tool_choice required) are forced when the answer part begins: at once
    when not thinking, else right after the think block closes. ``close_id`` is the single token
    that closes a think block (budgets need one; both Qwen3's and our tokenizer have it).
    """

    def __init__(self, open_id: Optional[int], close_id: Optional[int], close_ids: Sequence[int],
                 think_budget: Optional[int], in_think: bool, after_think_ids: Sequence[int] = ()):
        self.open_id, self.close_id = open_id, close_id
        self.close_ids = list(close_ids)
        self.think_budget = think_budget
        self.in_think = in_think
        self.after_think_ids = list(after_think_ids)
        self.think_tokens = 0           # tokens generated inside the think block (forced close included)
        self.forced_closed = False
        self.pending: list[int] = [] if in_think else list(self.after_think_ids)

    def next_forced(self) -> Optional[int]:
        if (not self.pending and self.in_think and self.think_budget is not None and self.close_id is not None
                and self.think_tokens >= self.think_budget):
            self.pending = list(self.close_ids)
            self.forced_closed = True
        return self.pending.pop(0) if self.pending else None

    def observe(self, token_id: int) -> None:
        if self.in_think:
            self.think_tokens += 1
            if token_id == self.close_id:
                self.in_think = False
                # Forced close ids may trail whitespace after </think>: queue behind them.
                self.pending = self.pending + list(self.after_think_ids)
        elif token_id == self.open_id and self.think_tokens == 0:
            self.in_think = True


@dataclass
class Job:
    prompt_ids: list[int]
    params: SamplingParams
    max_new_tokens: int
    stop_token_ids: frozenset
    output: object                        # output.TextOutput / ChatOutput
    steering: Optional[Steering] = None
    checkpoints: Sequence[int] = ()       # prompt lengths worth a prefix-cache snapshot (turn boundaries)
    loop: Optional[asyncio.AbstractEventLoop] = None
    events: Optional[asyncio.Queue] = None
    submitted_s: float = field(default_factory=time.perf_counter)
    cancelled: threading.Event = field(default_factory=threading.Event)
    client_checked_s: float = 0.0         # when the HTTP layer last looked for a disconnected client

    def __post_init__(self):
        if self.loop is None:
            self.loop = asyncio.get_running_loop()
        if self.events is None:
            self.events = asyncio.Queue()

    def cancel(self) -> None:
        self.cancelled.set()

    def emit(self, kind: str, payload) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:        # the loop is closed: nobody is listening any more
            self.cancel()


class Engine:
    """Owns the model: one worker thread runs queued jobs in order."""

    block_tokens = 64

    def __init__(self, model, prefill_chunk_tokens: int, max_queue: int, prefix_cache_bytes: int, metrics):
        self.generator = Generator(model, prefill_chunk_tokens)
        self.max_queue = max_queue
        self.prefix_cache = PrefixCache(prefix_cache_bytes)
        self.metrics = metrics
        self._queue: collections.deque[Job] = collections.deque()
        self._cond = threading.Condition()
        self._closed = False
        self.running: Optional[Job] = None
        self._thread = threading.Thread(target=self._worker, name="lqf-engine", daemon=True)
        self._thread.start()

    # -- queue ----------------------------------------------------------------------------------

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    def submit(self, job: Job) -> None:
        """Queue ``job``; raises ``QueueFull`` when ``max_queue`` requests already wait."""
        with self._cond:
            if self._closed:
                raise QueueFull("the server is shutting down")
            busy = self.running is not None or self._queue
            if busy and len(self._queue) >= self.max_queue:
                raise QueueFull(f"{len(self._queue)} requests are already waiting (server.max_queue={self.max_queue})")
            self._queue.append(job)
            self._set_gauges()
            self._cond.notify()

    def close(self, timeout_s: float = 5.0) -> None:
        with self._cond:
            self._closed = True
            for job in self._queue:
                job.cancel()
                job.emit("error", "the server is shutting down")
            self._queue.clear()
            if self.running is not None:
                self.running.cancel()
            self._cond.notify_all()
        self._thread.join(timeout_s)

    def _set_gauges(self) -> None:
        self.metrics.queue_depth.set(len(self._queue))
        self.metrics.running.set(1 if self.running is not None else 0)

    def _worker(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                job = self._queue.popleft()
                self.running = job
                self._set_gauges()
            try:
                if job.cancelled.is_set():
                    self.metrics.cancelled.inc()
                    job.emit("done", {"finish_reason": "cancelled"})
                else:
                    self._run(job)
            except Exception as exc:       # a failed generation must not take the worker down
                log.exception("generation failed")
                job.emit("error", f"generation failed: {type(exc).__name__}")
            finally:
                with self._cond:
                    self.running = None
                    self._set_gauges()

    # -- one generation -------------------------------------------------------------------------

    def _run(self, job: Job) -> None:
        m = self.metrics
        gen = self.generator
        prompt = job.prompt_ids
        use_cache = self.prefix_cache.capacity_bytes > 0
        t_start = time.perf_counter()
        state = self.prefix_cache.lookup(prompt) if use_cache else None
        state = state if state is not None else gen.new_state()
        cached = state.num_tokens
        # Prefill in segments ending at the checkpoints, snapshotting each (the prompt's end below).
        pos = cached
        for mark in sorted(p for p in set(job.checkpoints) if cached < p < len(prompt)) + [len(prompt)]:
            logits = gen.prefill(prompt[pos:mark], state)
            pos = mark
            if use_cache and mark < len(prompt):
                self.prefix_cache.put(prompt[:mark], state)
        t_prefill = time.perf_counter()
        m.prefill_computed.inc(len(prompt) - cached)
        m.prefill_reused.inc(cached)
        m.prompt_tokens.inc(len(prompt))
        m.prefill_seconds.inc(t_prefill - t_start)
        if use_cache:
            self.prefix_cache.put(prompt, state)

        sampler = Sampler(job.params, gen.vocab_size, prompt, gen.device)
        steer = job.steering
        seq = list(prompt)                # the tokens the state will hold once each is fed
        boundary = None                   # (ids, snapshot) at the last block boundary
        token_buf = torch.empty(1, 1, dtype=torch.long, device=gen.device)
        n_out = 0
        reason = "length"
        t_first = t_last = None
        for step in range(job.max_new_tokens):
            if job.cancelled.is_set():
                reason = "cancelled"
                break
            forced = steer.next_forced() if steer is not None else None
            token = forced if forced is not None else sampler.sample(logits)
            if forced is None and token in job.stop_token_ids:
                reason = "stop"
                break
            n_out += 1
            t_last = time.perf_counter()
            if t_first is None:
                t_first = t_last
                m.ttft.observe(t_first - job.submitted_s)
            sampler.observe(token)
            if steer is not None:
                steer.observe(token)
            deltas = job.output.push(token)
            if deltas:
                job.emit("delta", deltas)
            if job.output.stopped:
                reason = "stop"
                break
            if step + 1 == job.max_new_tokens:
                break
            seq.append(token)
            token_buf.fill_(token)
            logits = gen.model(token_buf, state)[0, -1]
            if use_cache and state.num_tokens % self.block_tokens == 0:
                boundary = (list(seq), state.clone())
        tail = job.output.finish()
        if tail:
            job.emit("delta", tail)
        t_end = time.perf_counter()
        m.generation_tokens.inc(n_out)
        if t_first is not None and t_last > t_first:
            m.decode_seconds.inc(t_last - t_first)
            m.decode_tokens.inc(n_out - 1)
        reasoning = steer.think_tokens if steer is not None else 0
        job.emit("done", {
            "finish_reason": reason, "prompt_tokens": len(prompt), "completion_tokens": n_out,
            "cached_tokens": cached, "reasoning_tokens": reasoning,
            "think_forced_close": bool(steer and steer.forced_closed),
            "queue_s": t_start - job.submitted_s, "prefill_s": t_prefill - t_start,
            "decode_s": (t_last - t_first) if t_first is not None else 0.0, "total_s": t_end - job.submitted_s,
        })
        # Storing these after "done" keeps them off the client's latency; the worker takes the next
        # job only after this returns, so that job's lookup already sees them. Neither snapshot is
        # used here again, so the cache takes them without a copy.
        if use_cache:
            if boundary is not None:
                self.prefix_cache.put(*boundary, copy=False)
            self.prefix_cache.put(seq, state, copy=False)
        m.prefix_cache_bytes.set(self.prefix_cache.used_bytes)
        m.prefix_cache_entries.set(len(self.prefix_cache))
        if reason == "cancelled":
            m.cancelled.inc()
