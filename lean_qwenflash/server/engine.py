"""The server's generations on the model: a worker thread, a bounded queue, interleaved decoding.

The HTTP side builds a ``Job`` (prompt ids, sampling, per-token hooks such as thinking ``Steering``
from ``generate/steering.py`` and grammar masks, an output pipeline from ``output.py``) and
``submit``s it; the worker runs it through the one decode loop, ``generate.Generator``, and hands
events back to the job's asyncio loop: ``("delta", [deltas])`` as text appears, then
``("done", info)`` or ``("error", message)``. ``Job.cancel()`` (client gone) is checked before
every token, and before a queued job starts.

Scheduling: up to ``max_active`` generations run at once, each advanced by one step (a prefill
chunk or one token) in turn, so a short side request (an agent's title or summary) finishes in
about its own time instead of waiting behind a long answer. Jobs beyond that wait in FIFO order.

Prefix reuse is the generator's ``PrefixCache`` (``generate/prefix.py``). The server also asks for
snapshots at turn boundaries inside the prompt (``Job.checkpoints``: the end of the conversation so
far, and after the assistant header): chat templates re-render earlier assistant turns differently
(e.g. without their think block), so the previous prompt's end is often not a prefix of the next
one, while these points are.
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

from lean_qwenflash.generate import Generation, Generator, PrefixCache, SamplingParams, Steering, TokenHook

log = logging.getLogger("lean_qwenflash.server")


class QueueFull(Exception):
    """More requests are waiting than ``max_queue`` allows."""


@dataclass
class Job:
    prompt_ids: list[int]
    params: SamplingParams
    max_new_tokens: int
    stop_token_ids: frozenset
    output: object                        # output.TextOutput / ChatOutput
    hooks: Sequence[TokenHook] = ()       # per-token control (grammar, then Steering: see GrammarHook)
    steering: Optional[Steering] = None   # also in hooks; read for the reasoning-token count
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


class _Run:
    """A job being generated: its ``Generation`` plus the timing and output bookkeeping."""

    def __init__(self, job: Job, generation: Generation, metrics):
        self.job, self.generation, self.metrics = job, generation, metrics
        self.t_start = time.perf_counter()
        self.t_prefill = self.t_first = self.t_last = None

    def step(self) -> None:
        job, g, m = self.job, self.generation, self.metrics
        if job.cancelled.is_set():
            g.stop("cancelled")
        token = g.step()
        if self.t_prefill is None and g.prefilled:
            self.t_prefill = time.perf_counter()
        if token is not None:
            self.t_last = time.perf_counter()
            if self.t_first is None:
                self.t_first = self.t_last
                m.ttft.observe(self.t_first - job.submitted_s)
            deltas = job.output.push(token)
            if deltas:
                job.emit("delta", deltas)
            if job.output.stopped:
                g.stop("stop")

    def finish(self) -> None:
        """The generation ended: flush the output, count, answer "done", then keep its snapshots."""
        job, g, m = self.job, self.generation, self.metrics
        tail = job.output.finish()
        if tail:
            job.emit("delta", tail)
        t_end = time.perf_counter()
        t_prefill = self.t_prefill or t_end
        prompt = len(job.prompt_ids)
        m.prefill_computed.inc(prompt - g.cached_tokens)
        m.prefill_reused.inc(g.cached_tokens)
        m.prompt_tokens.inc(prompt)
        m.prefill_seconds.inc(t_prefill - self.t_start)
        m.generation_tokens.inc(g.num_generated)
        if self.t_first is not None and self.t_last > self.t_first:
            m.decode_seconds.inc(self.t_last - self.t_first)
            m.decode_tokens.inc(g.num_generated - 1)
        steer = job.steering
        job.emit("done", {
            "finish_reason": g.finish_reason, "prompt_tokens": prompt, "completion_tokens": g.num_generated,
            "cached_tokens": g.cached_tokens, "reasoning_tokens": steer.think_tokens if steer is not None else 0,
            "think_forced_close": bool(steer and steer.forced_closed),
            "queue_s": self.t_start - job.submitted_s, "prefill_s": t_prefill - self.t_start,
            "decode_s": (self.t_last - self.t_first) if self.t_first is not None else 0.0,
            "total_s": t_end - job.submitted_s,
        })
        # After "done": the snapshots cost the client no latency, and the next job started by the
        # worker already sees them.
        g.close()
        if g.finish_reason == "cancelled":
            m.cancelled.inc()


class Engine:
    """Owns the model: one worker thread interleaves up to ``max_active`` generations."""

    def __init__(self, model, prefill_chunk_tokens: int, max_queue: int, prefix_cache_bytes: int, metrics,
                 max_active: int = 4):
        if max_active < 1:
            raise ValueError(f"max_active={max_active} must be >= 1")
        self.prefix_cache = PrefixCache(prefix_cache_bytes)
        self.generator = Generator(model, prefill_chunk_tokens, self.prefix_cache)
        self.max_queue = max_queue
        self.max_active = max_active
        self.metrics = metrics
        self._queue: collections.deque[Job] = collections.deque()
        self._active: list[_Run] = []
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._worker, name="lqf-engine", daemon=True)
        self._thread.start()

    # -- queue ----------------------------------------------------------------------------------

    @property
    def queue_depth(self) -> int:
        return len(self._queue)

    @property
    def active_count(self) -> int:
        return len(self._active)

    def submit(self, job: Job) -> None:
        """Queue ``job``; raises ``QueueFull`` when ``max_queue`` requests already wait."""
        with self._cond:
            if self._closed:
                raise QueueFull("the server is shutting down")
            busy = len(self._active) >= self.max_active or self._queue
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
            for run in self._active:
                run.job.cancel()
            self._cond.notify_all()
        self._thread.join(timeout_s)

    def _set_gauges(self) -> None:
        self.metrics.queue_depth.set(len(self._queue))
        self.metrics.running.set(len(self._active))

    def _admit(self, job: Job) -> None:
        """Start ``job`` (worker thread, without the lock: ``start`` validates the prompt and looks
        up the prefix cache, which ``submit`` on the event loop must not wait for)."""
        if job.cancelled.is_set():
            self.metrics.cancelled.inc()
            job.emit("done", {"finish_reason": "cancelled"})
            return
        try:
            generation = self.generator.start(job.prompt_ids, job.params, job.max_new_tokens, job.stop_token_ids,
                                              hooks=job.hooks, checkpoints=job.checkpoints)
        except Exception as exc:
            log.exception("generation failed to start")
            job.emit("error", f"generation failed: {type(exc).__name__}: {exc}")
            return
        with self._cond:
            if self._closed:            # close() came while it started: it ends as the others do
                job.cancel()
            self._active.append(_Run(job, generation, self.metrics))

    def _worker(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._active and not self._closed:
                    self._cond.wait()
                if self._closed and not self._active:
                    return
                admitting = [self._queue.popleft()
                             for _ in range(min(len(self._queue), self.max_active - len(self._active)))]
            for job in admitting:
                self._admit(job)
            with self._cond:
                self._set_gauges()
                runs = list(self._active)
            for run in runs:            # one step each, in turn
                try:
                    run.step()
                    if run.generation.done:
                        run.finish()
                        self.metrics.prefix_cache_bytes.set(self.prefix_cache.used_bytes)
                        self.metrics.prefix_cache_entries.set(len(self.prefix_cache))
                except Exception as exc:       # a failed generation must not take the worker down
                    log.exception("generation failed")
                    run.generation.done = True
                    run.job.emit("error", f"generation failed: {type(exc).__name__}")
                if run.generation.done:
                    with self._cond:
                        self._active.remove(run)
                        self._set_gauges()
