"""Python face of the native I/O engine (csrc/, built as ``lean_qwenflash._io``).

``open_engine`` opens one file read-only for O_DIRECT reads through io_uring (``uring``), a pread
thread pool (``pread``), or whichever works (``auto``: io_uring first, pread when the kernel or a
container's seccomp profile refuses it; ``engine.fallback_reason`` says why). Reads land directly
in caller-owned buffers such as :class:`AlignedBuffer`, which ``torch.frombuffer`` views without a
copy. Every failure is an :class:`IoError` (an ``OSError``) carrying ``errno`` and the request's
``tag``.
"""
from __future__ import annotations

import time

try:
    from . import _io
except ImportError as e:  # pragma: no cover - only without a build
    raise ImportError(
        "lean_qwenflash's native extension is not built; run `pip install -e .` "
        "(or scripts/setup.sh) in the repository first"
    ) from e

AlignedBuffer = _io.AlignedBuffer
Engine = _io.Engine
IoError = _io.IoError
ALIGNMENT = _io.ALIGNMENT
crc32c = _io.crc32c
SlotTable = _io.SlotTable      # an expert cache tier's slot states (experts/cache.py)
ENGINES = ("auto", "uring", "pread")


def open_engine(path: str, engine: str = "auto", queue_depth: int = 32, num_threads: int = 0,
                direct: bool = True) -> "_io.Engine":
    """Open ``path`` read-only with the named engine; see the module docstring."""
    if engine not in ENGINES:
        raise ValueError(f"io_engine must be one of {', '.join(ENGINES)}; got {engine!r}")
    return _io.Engine(str(path), engine, int(queue_depth), int(num_threads), bool(direct))


def uring_compiled() -> bool:
    return _io.uring_compiled()


def measure_random_reads(engine, block: int, seconds: float, dest=None) -> tuple[int, float]:
    """Keep ``engine.queue_depth`` reads of ``block`` bytes at random block-aligned offsets in
    flight for about ``seconds``; returns (reads completed, elapsed seconds). Used by `doctor`
    and the benchmarks so they all measure bandwidth the same way.

    The reads land in ``queue_depth`` fixed slots of a small buffer, or, with ``dest`` (a buffer
    of at least ``queue_depth`` blocks, e.g. a host cache's arena), in block-sized slots of
    ``dest`` picked at random as a cache's evictions pick them. The two can differ: some virtual
    machines read markedly slower into memory spread over a large buffer than into a few hot
    megabytes."""
    import random
    depth = engine.queue_depth
    nblocks = engine.file_size // block
    if nblocks == 0:
        raise ValueError(f"{engine.path} is smaller than one {block}-byte block")
    rng = random.Random()            # fresh offsets each run: no help from host-side caching
    if dest is None:
        slots, nslots = AlignedBuffer(block * depth), depth
    else:
        slots, nslots = dest, len(memoryview(dest).cast("B")) // block
        if nslots < depth:
            raise ValueError(f"the destination holds {nslots} blocks of {block} bytes; the probe needs "
                             f"at least the queue depth ({depth})")
    free = list(range(nslots))
    inflight, k, done = [], 0, 0
    t0 = time.perf_counter()
    while True:
        while len(inflight) < depth:
            # a free slot: with a small buffer, the one just completed (FIFO); in ``dest``, any
            slot = free.pop(rng.randrange(len(free)) if dest is not None else 0)
            inflight.append((engine.submit(slots, slot * block, rng.randrange(nblocks) * block, block, k), slot))
            k += 1
        rid, slot = inflight.pop(0)
        engine.wait(rid)
        free.append(slot)
        done += 1
        if time.perf_counter() - t0 >= seconds:
            break
    engine.wait_all([rid for rid, _ in inflight])
    return done + len(inflight), time.perf_counter() - t0
