"""Where compute threads run: one core per thread of the budget (``csrc/affinity.cpp``).

A CPU step runs on three kinds of threads: the thread that calls the model, the native kernel
pool's workers and torch's OpenMP workers. They sleep and wake hundreds of times per prompt (between
parallel regions), and at each wake-up the scheduler places them again. Beside a busy neighbour,
even one at nice 19, it now and then put two of ours on one core while the neighbour had the
other: a 512-token prompt of the hybrid Q4_K_M file ran at 0.75-0.87x of its idle speed in one
process (llama.cpp, whose threads never sleep, ~0.97x). With each compute thread bound to a core of
its own, it ran at 0.92-1.00x, and idle 0-3% faster.

So when a policy binds (``ExecPolicy.bind_cpus``, from the ``cpu_bind`` config key), a step binds
the calling thread to the first CPU for its duration (its own mask comes back afterwards), the
native pool's worker i to CPU i, and torch's OpenMP team member i of the calling thread to CPU i.
torch's workers stay bound after the step (they run only torch's parallel regions); the calling
thread does not.

``cpu_bind: auto`` binds when the budget is every CPU this process may use (then no choice of
cores can collide with another process's); ``on`` binds to the first ``budget`` CPUs of the mask;
``off`` never binds.
"""
from __future__ import annotations

import functools
import os
import threading
import warnings
from contextlib import contextmanager
from typing import Optional, Sequence

import torch

from ..common import CPU_BINDS
from . import native


def allowed_cpus() -> list:
    """The CPUs this process may run on (its affinity mask), ascending."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return []


def choose_cpus(mode: str, budget: int, allowed: Optional[Sequence[int]] = None) -> tuple:
    """The CPUs compute threads bind to, one per thread of ``budget`` (``()``: no binding).
    ``allowed`` defaults to this process's mask. Binding needs at least two threads."""
    if mode not in CPU_BINDS:
        raise ValueError(f"cpu_bind must be one of {', '.join(CPU_BINDS)}; got {mode!r}")
    cpus = list(allowed) if allowed is not None else allowed_cpus()
    if mode == "off" or budget < 2 or not native.available() or len(cpus) < budget:
        return ()
    if mode == "auto" and len(cpus) != budget:
        return ()
    return tuple(cpus[:budget])


@functools.lru_cache(maxsize=1)
def openmp_runtime() -> Optional[str]:
    """The path of the OpenMP runtime torch loaded (GNU libgomp, or one exporting its entry
    points), read from this process's memory map once (torch loads it with itself, before any
    step); None when there is none."""
    try:
        with open("/proc/self/maps") as f:
            paths = {fields[5] for fields in (line.split(None, 5) for line in f) if len(fields) == 6}
    except OSError:
        return None
    found = sorted(p.strip() for p in paths if os.path.basename(p.strip()).startswith(("libgomp", "libiomp")))
    under_torch = [p for p in found if os.path.dirname(torch.__file__) in p]
    return (under_torch or found or [None])[0]


_warned = set()


def _warn_once(what: str, err: Exception) -> None:
    if what not in _warned:
        _warned.add(what)
        warnings.warn(f"cpu_bind: could not bind {what} ({err}); compute threads run unbound "
                      f"(set cpu_bind: off to silence this)", RuntimeWarning, stacklevel=3)


# (calling thread, team size) pairs whose OpenMP team a bound step pinned: an unbound step on that
# thread lets them run anywhere again
_pinned_teams: set = set()


def _bind_team(threads: int, cpus: list) -> None:
    runtime = openmp_runtime()
    if runtime is None:
        return
    key = (threading.get_ident(), threads)
    if not cpus and key not in _pinned_teams:
        return
    try:
        native.bind_openmp_team(runtime, threads, cpus, allowed_cpus())
    except (RuntimeError, OSError) as e:
        _warn_once("torch's OpenMP threads", e)
        return
    (_pinned_teams.add if cpus else _pinned_teams.discard)(key)


@contextmanager
def bound(cpus: Sequence[int], torch_threads: int):
    """Run the body with the calling thread on ``cpus[0]``, the native workers and torch's
    ``torch_threads``-thread team of this thread on the others (see the module's docstring). With
    an empty ``cpus``, threads an earlier bound step pinned may run anywhere again. The calling
    thread's mask is restored afterwards."""
    cpus = list(cpus)
    if native.kernel_thread_cpus() != cpus:
        native.bind_kernel_threads(cpus, allowed_cpus())
    if torch_threads > 1:
        # every multi-threaded step: an OpenMP runtime may have made new workers since, and those
        # inherit the mask of the thread that made them
        _bind_team(torch_threads, cpus)
    if not cpus:
        yield
        return
    try:
        saved = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {cpus[0]})
    except OSError as e:
        _warn_once("the calling thread", e)
        saved = None
    try:
        yield
    finally:
        if saved is not None:
            os.sched_setaffinity(0, saved)


def thread_cpus() -> dict:
    """{thread id: sorted CPUs it may run on} for every thread of this process (doctor, tests)."""
    out = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            out[int(tid)] = sorted(os.sched_getaffinity(int(tid)))
        except OSError:
            pass
    return out


