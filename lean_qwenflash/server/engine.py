"""The server's generations on the model: a worker thread, a bounded queue, interleaved decoding.

The HTTP side builds a ``Job`` (prompt ids, sampling, per-token hooks such as thinking ``Steering``
from ``generate/steering.py`` and grammar masks, an output pipeline from ``output.py``) and
``submit``s it; the worker runs it through the one decode loop, ``generate.Generator``, and hands
events back to the job's asyncio loop: ``("delta", [deltas])`` as text appears, then
``("done", info)`` or ``("error", message)``. ``Job.cancel()`` (client gone) takes a waiting job out
of the queue at once (it never starts, and frees its place), and a running one stops before its
next step: a prefill chunk or a token.

Scheduling: up to ``max_active`` generations run at once, all advanced by one step per round
(``Generator.step_all``): the ones decoding feed their next tokens in one forward (rows of different
sequences share each expert's acquire, so an expert read for one stream serves the others), one
still prefilling runs its next chunk beside them. A short side request (an agent's title or
summary) finishes in about its own time instead of waiting behind a long answer, and a new prompt
delays the others by at most one chunk per round. Jobs beyond that wait in FIFO order.
With a memory budget (``context_budget``), a job also waits until the peak memory of its state
(prompt + max_new_tokens, ``ContextCost.peak_bytes``) fits beside the running ones' reservations;
a job alone always runs (the service refuses prompts past what fits alone, with a 400).

Prefix reuse is the generator's ``PrefixCache`` (``generate/prefix.py``). The server also asks for
snapshots at turn boundaries inside the prompt (``Job.checkpoints``: the end of the conversation so
far, and after the assistant header): chat templates re-render earlier assistant turns differently
(e.g. without their think block), so the previous prompt's end is often not a prefix of the next
one, while these points are. With a ``SnapshotDir`` (``server.snapshot_dir``) snapshots that leave
RAM go to disk, and the rest at shutdown; their fingerprint (``snapshot_fingerprint``) ties them to
the pack and to the settings that change numerics, so a restart with both unchanged reuses them.
"""
from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import logging
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

from lean_qwenflash.generate import Generation, Generator, PrefixCache, SamplingParams, Steering, TokenHook
from lean_qwenflash.generate.budget import ContextBudget, available_memory, run_budget
from lean_qwenflash.generate.snapshots import SnapshotDir

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
    on_cancel: Optional[Callable] = field(default=None, repr=False)   # set by Engine.submit
    # n > 1: the other choices (own params, hooks, output; same prompt), decoded from this job's
    # prefill (Generation.sibling); they share its cancelled event
    siblings: Sequence["Job"] = ()
    start_options: dict = field(default_factory=dict)   # more Generator.start arguments (echo, choice scoring)

    def __post_init__(self):
        if self.loop is None:
            self.loop = asyncio.get_running_loop()
        if self.events is None:
            self.events = asyncio.Queue()

    def cancel(self) -> None:
        """The client is gone: a queued job leaves the queue now, a running one stops at its next step.
        (The withdrawal is asked for every time: siblings share the ``cancelled`` event.)"""
        self.cancelled.set()
        if self.on_cancel is not None:
            self.on_cancel(self)

    def emit(self, kind: str, payload) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, payload))
        except RuntimeError:        # the loop is closed: nobody is listening any more
            self.cancel()


class _Run:
    """A job being generated: its ``Generation`` plus the timing and output bookkeeping."""

    def __init__(self, job: Job, generation: Generation, metrics, reserved: int = 0):
        self.job, self.generation, self.metrics = job, generation, metrics
        self.reserved = reserved            # bytes of the memory budget this run holds
        self.t_start = time.perf_counter()
        self.t_prefill = self.t_first = self.t_last = None

    # A step is ``before``, then ``Generator.step_all`` over the engine's runs, then ``after``.
    def before(self) -> None:
        if self.job.cancelled.is_set():
            self.generation.stop("cancelled")

    def after(self, token: Optional[int]) -> None:
        """Account for the step's outcome: the prefill's end, a token (its text to the client)."""
        job, g, m = self.job, self.generation, self.metrics
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


def context_budget(runtime, cfg, model_context: Optional[int] = None,
                   available: Optional[tuple[int, str]] = None) -> ContextBudget:
    """The ``ContextBudget`` (``budget.run_budget``) of a server on ``runtime`` (its model already
    loaded) with ``cfg``, in the memory its device has (``available_memory``)."""
    if model_context is None:
        model_context = int(runtime.store.config.get("max_position_embeddings") or 32768)
    avail, where = available if available is not None else available_memory(cfg.device)
    return run_budget(runtime.model, cfg, model_context, avail, where, chunk=runtime.prefill_chunk_tokens)


def snapshot_fingerprint(runtime, cfg) -> str:
    """What a prefix snapshot is valid for: the pack (its manifest, and the size and mtime of its
    data files) and every setting that changes the numbers a state holds (dtype, device, kernels,
    ISA, KV storage, prefill chunk, the torch and lean-qwenflash versions)."""
    import torch

    import lean_qwenflash
    pack = Path(runtime.store.path)
    h = hashlib.sha256((pack / "manifest.json").read_bytes())
    for name in ("resident.safetensors", "experts.bin"):
        f = pack / name
        if f.exists():
            st = f.stat()
            h.update(f"{name}:{st.st_size}:{st.st_mtime_ns}".encode())
    policy = getattr(runtime.model, "policy", None)
    numerics = {"dtype": cfg.dtype, "device": cfg.device, "expert_kernels": cfg.expert_kernels,
                "cpu_isa": cfg.cpu_isa, "resolved_isa": getattr(policy, "isa", None),
                "kv_cache_dtype": getattr(cfg, "kv_cache_dtype", None),
                "prefill_chunk_tokens": cfg.generation.prefill_chunk_tokens or runtime.prefill_chunk_tokens,
                "torch": torch.__version__, "lean_qwenflash": lean_qwenflash.__version__}
    h.update(json.dumps(numerics, sort_keys=True).encode())
    return h.hexdigest()


def engine_options(runtime, cfg, model_context: Optional[int] = None) -> dict:
    """The keyword arguments of ``Engine`` that come from the runtime: the snapshot directory (if
    ``server.snapshot_dir``) and the memory budget (for contexts up to ``model_context``)."""
    s = cfg.server
    snapshots = None
    if s.snapshot_dir and s.snapshot_bytes > 0:
        snapshots = SnapshotDir(Path(s.snapshot_dir).expanduser(), s.snapshot_bytes,
                                snapshot_fingerprint(runtime, cfg))
    return {"snapshots": snapshots, "budget": context_budget(runtime, cfg, model_context)}


class Engine:
    """Owns the model: one worker thread steps up to ``max_active`` generations together."""

    def __init__(self, model, prefill_chunk_tokens: int, max_queue: int, prefix_cache_bytes: int, metrics,
                 max_active: int = 4, snapshots: Optional[SnapshotDir] = None,
                 budget: Optional[ContextBudget] = None):
        if max_active < 1:
            raise ValueError(f"max_active={max_active} must be >= 1")
        self.prefix_cache = PrefixCache(prefix_cache_bytes, snapshots)
        self.generator = Generator(model, prefill_chunk_tokens, self.prefix_cache)
        self.max_queue = max_queue
        self.max_active = max_active
        self.metrics = metrics
        self.budget = budget
        self.withdrawn = 0              # queued jobs whose client left before they started
        self._reserved = 0              # bytes of the budget the running jobs hold
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

    @property
    def context_fit(self) -> Optional[int]:
        """The longest context that fits in memory (None: no budget known)."""
        return None if self.budget is None else self.budget.fit_tokens

    def submit(self, job: Job) -> None:
        """Queue ``job``; raises ``QueueFull`` when ``max_queue`` requests already wait. A job
        cancelled before this is answered "cancelled" at once and never queued."""
        with self._cond:
            if self._closed:
                raise QueueFull("the server is shutting down")
            if job.cancelled.is_set():
                self._withdrawn(job)
                return
            busy = len(self._active) >= self.max_active or self._queue
            if busy and len(self._queue) >= self.max_queue:
                raise QueueFull(f"{len(self._queue)} requests are already waiting (server.max_queue={self.max_queue})")
            job.on_cancel = self._withdraw
            self._queue.append(job)
            self._set_gauges()
            self._cond.notify()

    def _withdraw(self, job: Job) -> None:
        """``job.cancel()``: a job still waiting leaves the queue (from any thread)."""
        with self._cond:
            if job in self._queue:
                self._queue.remove(job)
                self._withdrawn(job)
                self._set_gauges()

    def _withdrawn(self, job: Job) -> None:
        self.withdrawn += 1
        self.metrics.cancelled.inc()
        job.emit("done", {"finish_reason": "cancelled", "prompt_tokens": len(job.prompt_ids),
                          "completion_tokens": 0, "cached_tokens": 0})

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop: waiting jobs get an error, running ones are cancelled; then the snapshots still
        only in RAM are written to the snapshot directory (if there is one)."""
        with self._cond:
            self._closed = True
            waiting = list(self._queue)
            self._queue.clear()
            for job in waiting:
                job.on_cancel = None
                job.cancel()
                job.emit("error", "the server is shutting down")
            for run in self._active:
                run.job.cancel()
            self._cond.notify_all()
        self._thread.join(timeout_s)
        if not self._thread.is_alive() and self.prefix_cache.disk is not None:
            try:
                written = self.prefix_cache.flush()
                log.info("snapshots: %d written to %s at shutdown", written, self.prefix_cache.disk.path)
            except Exception:
                log.exception("writing the prefix snapshots at shutdown failed")

    def _set_gauges(self) -> None:
        self.metrics.queue_depth.set(len(self._queue))
        self.metrics.running.set(len(self._active))

    def _need(self, job: Job) -> int:
        """Bytes of the memory budget ``job`` reserves while it runs (0 without a budget)."""
        if self.budget is None:
            return 0
        return self.budget.cost.peak_bytes(len(job.prompt_ids) + job.max_new_tokens) * (1 + len(job.siblings))

    def _admit(self, job: Job, reserved: int) -> None:
        """Start ``job`` (worker thread, without the lock: ``start`` validates the prompt and looks
        up the prefix cache, which ``submit`` on the event loop must not wait for)."""
        if job.cancelled.is_set():
            self._release(reserved)
            self.metrics.cancelled.inc()
            job.emit("done", {"finish_reason": "cancelled"})
            return
        try:
            generation = self.generator.start(job.prompt_ids, job.params, job.max_new_tokens, job.stop_token_ids,
                                              hooks=job.hooks, checkpoints=job.checkpoints, **job.start_options)
            siblings = [_Run(sib, generation.sibling(sib.params, sib.hooks), self.metrics) for sib in job.siblings]
        except Exception as exc:
            self._release(reserved)
            log.exception("generation failed to start")
            job.emit("error", f"generation failed: {type(exc).__name__}: {exc}")
            return
        with self._cond:
            if self._closed:            # close() came while it started: it ends as the others do
                job.cancel()
            self._active.append(_Run(job, generation, self.metrics, reserved))
            self._active.extend(siblings)

    def _release(self, reserved: int) -> None:
        with self._cond:
            self._reserved -= reserved

    def _take(self) -> list:
        """(job, reserved bytes) for each job to start now (with the lock held): FIFO, while there
        are free places and the head's memory fits beside the running jobs' (or nothing runs)."""
        taken = []
        while self._queue and len(self._active) + len(taken) < self.max_active:
            need = self._need(self._queue[0])
            if need and (self._active or taken) and self._reserved + need > self.budget.budget_bytes:
                break
            taken.append((self._queue.popleft(), need))
            self._reserved += need
        return taken

    def _worker(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._active and not self._closed:
                    self._cond.wait()
                if self._closed and not self._active:
                    return
                admitting = self._take()
            for job, reserved in admitting:
                self._admit(job, reserved)
            with self._cond:
                self._set_gauges()
                runs = list(self._active)
            for run in runs:
                run.before()
            # one step each, together: the decoding runs in one forward, a prefilling one its chunk
            outcomes = self.generator.step_all([run.generation for run in runs])
            for run, outcome in zip(runs, outcomes):
                try:
                    if isinstance(outcome, BaseException):
                        raise outcome
                    run.after(outcome)
                    if run.generation.done:
                        run.finish()
                        self.metrics.prefix_cache_bytes.set(self.prefix_cache.used_bytes)
                        self.metrics.prefix_cache_entries.set(len(self.prefix_cache))
                except Exception as exc:       # a failed generation must not take the worker down
                    log.error("generation failed", exc_info=exc)
                    run.generation.done = True
                    run.job.emit("error", f"generation failed: {type(exc).__name__}")
                if run.generation.done:
                    with self._cond:
                        self._active.remove(run)
                        self._reserved -= run.reserved
                        self._set_gauges()
