"""`lean-qwenflash doctor`: what this machine can do for streaming, and cache sizes for a pack."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Optional

from .config import format_size


def sizes_line(per_encoding: dict) -> str:
    """``{"q4_k": 123, "q6_k": 45}`` -> "q4_k 123B, q6_k 45B" (doctor, pack and inspect)."""
    return ", ".join(f"{enc} {format_size(n)}" for enc, n in sorted(per_encoding.items()))

MiB = 1 << 20


def _meminfo() -> dict:
    out = {}
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            k, v = line.split(":", 1)
            out[k] = int(v.split()[0]) * 1024
    except OSError:
        pass
    return out


def _cgroup_limit() -> Optional[int]:
    for p in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            v = Path(p).read_text().strip()
        except OSError:
            continue
        if v != "max" and int(v) < 1 << 60:
            return int(v)
    return None


# The largest buffer doctor's second read probe lands in (the host cache's size when a config gives it).
ARENA_PROBE_BYTES = 1 << 30


def _probe_engine(path: Path, kind: str, block: int, seconds: float, dest=None) -> tuple[Optional[float], str]:
    """(GB/s of record-sized random reads at depth 8, the engine's note); with ``dest`` the reads
    land across that buffer (``measure_random_reads``)."""
    from .io_engine import IoError, measure_random_reads, open_engine
    try:
        eng = open_engine(path, kind, queue_depth=8)
    except IoError as e:
        return None, str(e)
    note = eng.kind + ("" if eng.direct else " (no O_DIRECT: " + eng.fallback_reason.strip() + ")")
    if eng.kind != kind and kind != "auto":
        note += f" ({eng.fallback_reason.strip()})"
    try:
        done, dt = measure_random_reads(eng, block, seconds, dest=dest)
    except ValueError:
        return None, note
    finally:
        eng.close()
    return done * block / dt / 1e9, note


def context_lines(config: dict, cfg, available: int, where: str, caches: int) -> list[str]:
    """What a token of context costs for the model of ``config`` (its HF config) run as ``cfg``
    says, and the longest context that fits in ``available`` bytes of ``where`` beside ``caches``
    bytes of caches (``generate/budget.py`` does the arithmetic, as the server does)."""
    import torch

    from .families import family_for
    from .generate.budget import MARGIN_BYTES, run_budget
    with torch.device("meta"):
        model = family_for(config).build(config)
    budget = run_budget(model, cfg, int(config.get("max_position_embeddings") or 32768), available, where, caches)
    cost, kv = budget.cost, budget.cost.kv_dtype
    lines = [f"context:       {cost.per_token} bytes per token (KV as {kv}), {format_size(cost.fixed)} per sequence "
             f"(recurrent state, windows), {format_size(cost.working_per_token)} per token while a "
             f"{cost.chunk}-token prefill chunk runs (its activations: "
             f"{format_size(cost.activation_per_token * cost.chunk)}; generation.prefill_chunk_tokens)",
             f"               {budget.fit_tokens} tokens fit (the model's context: {budget.model_context}) in "
             f"{format_size(budget.budget_bytes)} of {where}: {format_size(available)} available less "
             f"{format_size(caches)} of caches and a {format_size(MARGIN_BYTES)} margin"]
    if budget.fit_tokens < budget.model_context:
        lines.append("               the server refuses longer prompts (400); a quantized kv_cache_dtype or smaller "
                     "caches make room")
    return lines


def run_doctor(pack: Optional[str], probe_seconds: float = 2.0, out=print, cfg=None, trace=None) -> int:
    """Print the report; returns 0 when the machine can stream, 1 when something blocks it.
    ``cfg`` (a RuntimeConfig): the caches and numerics the context figures assume (default: the
    suggested caches, default settings)."""
    from . import io_engine
    problems = 0
    out("lean-qwenflash doctor")
    out("=====================")
    uname = os.uname()
    out(f"kernel:        {uname.sysname} {uname.release} ({uname.machine})")
    try:
        disabled = Path("/proc/sys/kernel/io_uring_disabled").read_text().strip()
    except OSError:
        disabled = None
    out(f"liburing:      {'compiled in' if io_engine.uring_compiled() else 'NOT compiled in (install liburing-dev, reinstall)'}")
    from .models import native
    if native.available():
        out(f"CPU kernels:   {native.best_isa()} (this CPU can run: {', '.join(native.ISAS)}; cpu_isa: auto picks the last)")
    else:
        out("CPU kernels:   NOT built (reinstall: pip install -e .); quantized experts fall back to torch")
        problems += 1
    from .models.policy import available_cpus, cgroup_cpu_limit, torch_threads_spin
    quota = cgroup_cpu_limit()
    out(f"CPU budget:    {available_cpus()} threads for compute (affinity {len(os.sched_getaffinity(0))} cores"
        + (f", cgroup quota {quota:.2f} cores" if quota is not None else ", no cgroup CPU quota")
        + "; cpu_threads: 0 uses this, torch and the native kernels share it)")
    from .models.affinity import choose_cpus
    bind = choose_cpus("auto", available_cpus())
    out("CPU binding:   " + (f"cpu_bind: auto puts each compute thread on a core of its own (CPUs {', '.join(map(str, bind))}): "
                             "a busy neighbour cannot make two of them share one" if bind else
                             "cpu_bind: auto leaves threads unbound here (one thread, or a budget below the cores this "
                             "process may use); cpu_bind: on binds them to the first cores"))
    from . import TORCH_OMP_WAIT, TORCH_OMP_WAIT_OURS
    spin = torch_threads_spin()
    if spin:
        out(f"torch threads: {spin}")
    elif TORCH_OMP_WAIT_OURS:
        out(f"torch threads: OpenMP {TORCH_OMP_WAIT} (idle threads spin briefly, then sleep: a busy neighbour costs about its share; "
            + ("~2 ms, for threads bound one per core" if bind else "~0.2 ms, for unbound threads") + ")")
    else:
        out(f"torch threads: OpenMP {TORCH_OMP_WAIT} (set by you)")

    if pack:
        from .store import ExpertStore
        # Opened once (validates the pack): the probe block size and the cache-size inputs below.
        with ExpertStore.open(pack, verify_checksums=False) as st:
            experts = st.manifest.experts_bytes
            slot = st.max_record_bytes
            top_k = int(st.config.get("num_experts_per_tok", 1))
            hf_config = st.config
            encodings = {f"experts.{k}": v for k, v in st.manifest.encodings().items()}
            encodings.update(st.manifest.resident_groups())
        target = Path(pack) / "experts.bin"
        block = slot
    else:
        target = None
        block = 4 * MiB
    tmp = None
    if target is None:
        # Probe the filesystem packs usually live on: a scratch file in the temp directory.
        tmp = tempfile.NamedTemporaryFile(prefix="lqf-doctor-", dir=tempfile.gettempdir(), delete=False)
        chunk = os.urandom(MiB)
        for _ in range(64):
            tmp.write(chunk)
        tmp.flush()
        os.fsync(tmp.fileno())
        tmp.close()
        target = Path(tmp.name)
    try:
        gbps_u, note_u = _probe_engine(target, "uring", block, probe_seconds / 2)
        if gbps_u is None and "unavailable" in note_u:
            why = note_u.split("unavailable:", 1)[-1].strip()
            out(f"io_uring:      unavailable: {why}" + (f" (kernel.io_uring_disabled={disabled})" if disabled else ""))
            out("               the pread engine is used instead (io_engine: auto does this by itself)")
        else:
            out("io_uring:      available" + (f" (kernel.io_uring_disabled={disabled})" if disabled not in (None, "0") else ""))
        gbps_p, note_p = _probe_engine(target, "pread", block, probe_seconds / 2)
        if gbps_p is None and gbps_u is None:
            out(f"I/O:           cannot read {target}: {note_p}")
            problems += 1
        auto = _probe_engine(target, "auto", block, 0.01)[1]
        out(f"O_DIRECT:      {'yes' if 'no O_DIRECT' not in auto else 'NO — ' + auto} on the filesystem of {target.parent}")
        out(f"engine (auto): {auto.split(' ')[0]}")
        for name, g in (("uring", gbps_u), ("pread", gbps_p)):
            if g is not None:
                out(f"read probe:    {name:5s} {g:.2f} GB/s ({format_size(block)} random reads, depth 8, {probe_seconds / 2:.1f} s)")
        if gbps_u is not None or gbps_p is not None:
            # The same reads landing anywhere in a buffer the size of a host cache, as the cache's
            # do: the speed streaming can reach (some VMs read far slower into spread-out memory).
            size = cfg.host_cache_bytes if cfg is not None else ARENA_PROBE_BYTES
            room = min(_meminfo().get("MemAvailable", 0), _cgroup_limit() or 1 << 62)
            size = max(8 * block, min(size, ARENA_PROBE_BYTES, room // 4))
            gbps_a, _ = _probe_engine(target, "auto", block, probe_seconds / 2, dest=io_engine.AlignedBuffer(size))
            if gbps_a is not None:
                out(f"               {gbps_a:.2f} GB/s landing across a {format_size(size)} buffer, as the host "
                    "cache's reads do (the speed streaming can reach)")
                # (against the small-buffer figure of the engine auto uses, which this probe uses)
                small = gbps_u if auto.startswith("uring") else gbps_p
                if small and gbps_a < 0.85 * small:
                    out(f"               {gbps_a / small:.2f}x the small-buffer speed: this machine reads slower into "
                        "spread-out memory (common in VMs); expect streamed decode to follow the lower figure")
    finally:
        if tmp is not None:
            os.unlink(tmp.name)

    mem = _meminfo()
    avail = mem.get("MemAvailable", 0)
    limit = _cgroup_limit()
    out(f"RAM:           {format_size(mem.get('MemTotal', 0))} total, {format_size(avail)} available"
        + (f", cgroup limit {format_size(limit)}" if limit else ""))
    if limit:
        avail = min(avail, limit)

    import torch
    vram_free = 0
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        vram_free = free
        out(f"CUDA:          {torch.cuda.get_device_name(0)}, {format_size(free)} free of {format_size(total)}")
        for mod, what in (("fla", "flash-linear-attention"), ("causal_conv1d", "causal-conv1d"),
                          ("flash_attn", "flash-attn")):
            try:
                __import__(mod)
                out(f"               {what}: installed")
            except ImportError:
                out(f"               {what}: not installed (torch fallback; pip install {what})")
    else:
        out(f"CUDA:          not available (torch {torch.__version__}); CPU-only: the host cache is the compute tier")

    if pack:
        resident = (Path(pack) / "resident.safetensors").stat().st_size
        out(f"pack:          {pack}: {format_size(experts)} of experts ({format_size(slot)} records), "
            f"{format_size(resident)} resident")
        for name, per in encodings.items():
            out(f"               {name}: " + sizes_line(per))
        margin = 2 * 1024**3
        if vram_free:
            device = max(0, min(experts, vram_free - resident - margin))
            host = max(0, min(experts - device // 2, avail - margin))
        else:
            device = 0
            host = max(0, min(experts, avail - resident - margin))
        host = host // slot * slot
        device = device // slot * slot
        if host < top_k * slot:
            out(f"               NOT ENOUGH RAM: the host cache needs at least {format_size(top_k * slot)}")
            problems += 1
        out("suggested config:")
        out(f"  model: {Path(pack).resolve()}")
        out(f"  device: {'cuda' if vram_free else 'cpu'}")
        out(f"  host_cache_bytes: {format_size(host)}       # {host // slot} experts, "
            f"{100 * host / experts:.0f}% of the model's")
        out(f"  device_cache_bytes: {format_size(device)}")
        from .config import load_config
        run_cfg = cfg if cfg is not None else load_config(None)
        on_gpu = run_cfg.device.startswith("cuda") if cfg is not None else bool(vram_free)
        if on_gpu:
            caches = run_cfg.device_cache_bytes if cfg is not None else device
            room, where = vram_free - resident, "VRAM"
        else:
            caches = run_cfg.host_cache_bytes if cfg is not None else host
            room, where = avail - resident, "RAM"
        caches += run_cfg.server.prefix_cache_bytes
        try:
            for line in context_lines(hf_config, run_cfg, max(0, room), where, caches):
                out(line)
        except Exception as e:          # an unknown family: the rest of the report still stands
            out(f"context:       cannot size it for this model ({type(e).__name__}: {e})")
    else:
        out("(pass --model PACK for cache-size suggestions for a model)")
    if trace is not None:               # --trace: a host cache sized from the user's own routing
        measured = [g for g in (gbps_u, gbps_p) if g is not None]
        from .config import load_config
        policy = (cfg if cfg is not None else load_config(None)).cache_policy
        trace_advice(trace, max(measured) if measured else None, avail, out, policy=policy)
    out("status:        " + ("OK" if problems == 0 else f"{problems} problem(s) above"))
    return 0 if problems == 0 else 1


def measure_disk_gbps(pack, seconds: float = 2.0, dest=None) -> Optional[float]:
    """The read probe of ``run_doctor`` on a pack's experts.bin: GB/s of record-sized random reads
    through the engine ``auto`` picks (None when nothing could be read); with ``dest`` (e.g. a host
    cache's arena) landing across that buffer as the cache's reads do."""
    from .store import ExpertStore
    with ExpertStore.open(pack, verify_checksums=False) as st:
        block = st.max_record_bytes
    return _probe_engine(Path(pack) / "experts.bin", "auto", block, seconds, dest=dest)[0]


def trace_advice(path, disk_gbps: Optional[float], ram_available: int, out=print, policy: str = "lfu") -> None:
    """`doctor --trace FILE`: replay the trace through the runtime's host cache (``policy``: the
    config's ``cache_policy``) at the sizes that reach a few hit rates, and suggest the
    ``host_cache_bytes`` the RAM allows."""
    from .experts.trace import read_trace, simulate, suggest_cache
    t = read_trace(path)
    slot = t.header["slot_bytes"]
    distinct = len({(l, e) for l, ids in t.records for e in ids})
    room = max(0, ram_available - 2 * 1024**3)
    n_dec = len(t.decode_steps())
    out(f"trace:         {path}: {len(t.records)} acquires, {n_dec} decode tokens, {distinct} distinct experts "
        f"({format_size(distinct * slot)} to hold them all); replayed under cache_policy: {policy}")
    if not t.records:
        out("               (empty: nothing to size from)")
        return

    def speed(r) -> str:
        if not disk_gbps or not r.decode_tokens:
            return ""
        per = r.decode_bytes_per_token
        return ", I/O allows unbounded tok/s" if per == 0 else f", I/O allows {disk_gbps * 1e9 / per:.1f} tok/s"

    for target in (0.5, 0.8, 0.9, 0.95, 0.99):
        size, r = suggest_cache(t, target, policy=policy)
        out(f"               {100 * target:.0f}% hits: host_cache_bytes {format_size(size)} "
            f"(replayed {100 * r.hit_rate:.1f}%, {format_size(int(r.decode_bytes_per_token))} per token{speed(r)})")
    whole = distinct * slot
    if whole <= room:
        size = whole
        why = "every expert this traffic used fits in RAM"
    else:
        size = max(t.header["top_k"], room // slot) * slot
        why = f"the most the available RAM allows ({format_size(room)} after a 2 GiB margin)"
    r = simulate(t, size // slot, policy)
    out(f"  host_cache_bytes: {format_size(size)}       # from the trace: {why}; replayed hit rate "
        f"{100 * r.hit_rate:.1f}%{speed(r)}")
