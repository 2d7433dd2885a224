"""What a context costs in memory, and how long a context fits: ``doctor``, the server's startup
line and its limit (a prompt past what fits is a 400, and the engine admits jobs by it).

``context_cost(model, kv_dtype)`` walks a built model's layers (the meta device will do: no
weights needed) and adds up what their states hold (``generate/state.py``): per token of context
(full-attention K and V, latent attention's latent + rope key) and per sequence (DeltaNet's conv and
recurrent state, sliding-window rings). ``ContextCost.peak_bytes(n)`` is the most a sequence of n
tokens holds at once, ``ContextBudget`` the longest context that fits beside the configured caches
in the memory ``available_memory()`` reports.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

from lean_qwenflash._host import cgroup_dirs
from lean_qwenflash.common import format_size

# Bytes per stored element of a KV cache by its dtype (block encodings: GGUF's 32-value blocks).
KV_ELEMENT_BYTES = {"float32": 4.0, "float16": 2.0, "bfloat16": 2.0, "f16": 2.0, "bf16": 2.0,
                    "q8_0": 34 / 32, "q4_0": 18 / 32}


def kv_storage(kv_cache_dtype: Optional[str], compute_dtype: str) -> str:
    """What a cache's elements are stored as: config ``kv_cache_dtype`` ("f32", the default, keeps
    them as computed, i.e. in the compute ``dtype``)."""
    return compute_dtype if kv_cache_dtype in (None, "f32") else kv_cache_dtype


class ContextCost:
    """What a sequence's state costs in memory, from the model's layers (``context_cost``).

    ``per_token``: bytes each token of context adds (full-attention K+V, latent attention's latent +
    rope key); ``fixed``: bytes a sequence holds whatever its length (DeltaNet conv + recurrent
    state, sliding-window rings); ``working_per_token``: transient bytes per token of context while
    a prefill chunk runs (one layer at a time: fp32 attention scores for the chunk's queries, the
    latent layers' concatenated keys); ``chunk``: the prefill chunk that assumes;
    ``activation_per_token``: transient bytes per token of that chunk (``chunk_activation_bytes``);
    ``copies``: whole copies of the state a generation holds beside it (with a prefix cache, the
    generator keeps a block-boundary snapshot and makes the next before dropping the last: 2).
    """

    def __init__(self, per_token: int, fixed: int, working_per_token: int, chunk: int, kv_dtype: str,
                 copies: int = 0, activation_per_token: int = 0):
        self.per_token, self.fixed, self.working_per_token = per_token, fixed, working_per_token
        self.chunk, self.kv_dtype, self.copies = chunk, kv_dtype, copies
        self.activation_per_token = activation_per_token

    def __repr__(self) -> str:
        return (f"ContextCost(per_token={self.per_token}, fixed={self.fixed}, "
                f"working_per_token={self.working_per_token}, chunk={self.chunk}, kv_dtype={self.kv_dtype!r}, "
                f"copies={self.copies}, activation_per_token={self.activation_per_token})")

    def peak_bytes(self, tokens: int) -> int:
        """The most a sequence of ``tokens`` tokens holds at once while it is prefilled and decoded:
        the KV cache grows by doubling (``KVCache.append``: old and new buffers live together while
        it is copied), plus the fixed state, the last step's working memory and the activations of
        its largest prefill chunk."""
        return (self.per_token * kv_peak_slots(tokens, self.chunk) + self.fixed + self.working_per_token * tokens
                + self.activation_per_token * min(tokens, self.chunk)
                + self.copies * (self.per_token * tokens + self.fixed))

    def tokens_fitting(self, budget_bytes: int, limit: int) -> int:
        """The largest context <= ``limit`` whose ``peak_bytes`` fits in ``budget_bytes`` (0: none)."""
        if self.peak_bytes(1) > budget_bytes:
            return 0
        lo, hi = 1, max(1, limit)
        if self.peak_bytes(hi) <= budget_bytes:
            return hi
        while hi - lo > 1:          # peak_bytes grows with tokens
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self.peak_bytes(mid) <= budget_bytes else (lo, mid)
        return lo


def kv_peak_slots(tokens: int, chunk: int) -> int:
    """Token slots a ``KVCache`` holds at its peak (old + new buffer while growing) when ``tokens``
    tokens arrive as prefill chunks of ``chunk``: the capacity rule of ``KVCache.append``."""
    capacity = peak = end = 0
    while end < tokens:
        end = min(tokens, end + chunk)
        if end > capacity:
            new = max(end, 2 * capacity, 64)
            peak = max(peak, capacity + new)
            capacity = new
    return max(peak, capacity)


# The prefill chunk (config ``generation.prefill_chunk_tokens``; 0: automatic). Each chunk reads
# every routed expert its tokens pick once, from RAM when resident and from the SSD when streamed,
# so a longer chunk reads the weights fewer times: on the bench's random 16-layer x 128-expert
# model (resident, 2 threads) a 4096-token prompt ran 203 -> 297 -> 362 tok/s at 256 / 1024 / 2048
# tokens with bf16 experts, 245 -> 259 with Q4_K_M (peak RSS +300 MiB); streamed, each doubling
# halves the reads of a prompt. The cost is the chunk's activations (``chunk_activation_bytes``),
# and in the server the wait of other requests' decode steps behind one chunk. Automatic: the
# longest multiple of CHUNK_MIN tokens, at most CHUNK_MAX, whose activations fit CHUNK_WORKING_BYTES
# and half the memory left beside the caches (``run_room``; the estimate is ~5% under what was
# measured): under a tight memory cap a 2048-token chunk's activations were what pushed a capped run
# over it (killed by the cgroup: Q4_K_M file capped at 0.94 GiB, host cache 0.47 GiB).
CHUNK_MIN, CHUNK_MAX = 256, 2048
CHUNK_WORKING_BYTES = 512 * 1024**2


def chunk_activation_bytes(config: dict) -> int:
    """Transient bytes per token of a prefill chunk (fp32, one layer at a time) of a model of HF
    ``config``: its hidden states and a layer's projections (~12 rows of the hidden size) and the
    routed experts' rows (top-k x (gate/up and activation, 3 x the expert width, plus their input
    and output, 2 x the hidden size)). Estimated 164 KiB on a hidden-1024, top-8, width-512 model;
    measured there ~170 KiB (peak RSS of a 2048- against a 256-token chunk)."""
    from lean_qwenflash.families import moe_facts
    facts = moe_facts(config)
    return 4 * (12 * facts.hidden_size + facts.top_k * (3 * facts.expert_intermediate + 2 * facts.hidden_size))


def prefill_chunk_tokens(config: dict, configured: int = 0, room_bytes: Optional[int] = None) -> int:
    """The prefill chunk of a model of HF ``config``: ``configured`` when > 0, else the automatic
    one: the longest multiple of CHUNK_MIN up to CHUNK_MAX whose activations fit CHUNK_WORKING_BYTES
    and, when ``room_bytes`` (the memory left beside the caches, ``run_room``) is given, half of it;
    never under CHUNK_MIN."""
    if configured > 0:
        return int(configured)
    limit = CHUNK_WORKING_BYTES if room_bytes is None else min(CHUNK_WORKING_BYTES, max(0, room_bytes) // 2)
    fits = limit // max(1, chunk_activation_bytes(config))
    return max(CHUNK_MIN, min(CHUNK_MAX, fits // CHUNK_MIN * CHUNK_MIN))


def context_cost(model, kv_dtype: str, prefill_chunk_tokens: int = 256, copies: int = 0) -> ContextCost:
    """The ``ContextCost`` of ``model``'s layers (a built model; the meta device will do) with its
    caches stored as ``kv_dtype`` (a compute dtype name, or a KV encoding in ``KV_ELEMENT_BYTES``)."""
    from lean_qwenflash.models.layers.attention import Attention
    from lean_qwenflash.models.layers.deltanet import GatedDeltaNet
    from lean_qwenflash.models.layers.latent_attention import LatentAttention

    if kv_dtype not in KV_ELEMENT_BYTES:
        raise ValueError(f"unknown KV cache dtype {kv_dtype!r}; known: {', '.join(KV_ELEMENT_BYTES)}")
    elem = KV_ELEMENT_BYTES[kv_dtype]
    compute = 2 if kv_dtype in ("float16", "bfloat16", "f16", "bf16") else 4    # conv state: the activations' dtype
    chunk = max(1, int(prefill_chunk_tokens))
    per_token = fixed = 0.0
    working = 0
    for layer, kind in zip(model.model.layers, model.layer_types):
        for m in layer.modules():
            if isinstance(m, Attention):
                row = 2 * m.num_kv_heads * m.head_dim * elem
                if kind == "sliding_attention":
                    fixed += row * m.sliding_window + 8 * m.sliding_window
                else:
                    per_token += row
                working = max(working, m.num_heads * chunk * 4)
            elif isinstance(m, LatentAttention):
                row = (m.kv_lora_rank + m.rope_dim) * elem
                per_token += row
                working = max(working, m.num_heads * chunk * 4 + int(row))
            elif isinstance(m, GatedDeltaNet):
                fixed += m.conv_dim * (m.conv_kernel_size - 1) * compute
                fixed += m.num_v_heads * m.head_k_dim * m.head_v_dim * 4        # fp32 recurrent state
    return ContextCost(int(math.ceil(per_token)), int(math.ceil(fixed)), working, chunk, kv_dtype, copies,
                       chunk_activation_bytes(model.config))


class ContextBudget:
    """How long a context fits in memory: ``cost`` (a ``ContextCost``), ``budget_bytes`` (what
    states may use: ``available_bytes`` less ``caches_bytes`` — configured caches not yet filled —
    and a margin) and ``fit_tokens`` (the longest context one sequence may reach in it, at most
    ``model_context``)."""

    def __init__(self, cost: ContextCost, available_bytes: int, caches_bytes: int, margin_bytes: int,
                 model_context: int, where: str = "RAM"):
        self.cost, self.available_bytes, self.caches_bytes = cost, available_bytes, caches_bytes
        self.margin_bytes, self.model_context, self.where = margin_bytes, model_context, where
        self.budget_bytes = max(0, available_bytes - caches_bytes - margin_bytes)
        self.fit_tokens = cost.tokens_fitting(self.budget_bytes, model_context)

    def describe(self) -> str:
        """The figures in one line (the server's startup, ``doctor``)."""
        c = self.cost
        limit = ("the model's whole context" if self.fit_tokens >= self.model_context
                 else f"of the model's {self.model_context}")
        return (f"{c.per_token} bytes per token (KV as {c.kv_dtype}) + {format_size(c.fixed)} per sequence "
                f"(recurrent state, windows); {self.fit_tokens} tokens fit ({limit}) in "
                f"{format_size(self.budget_bytes)} of {self.where}: {format_size(self.available_bytes)} available "
                f"less {format_size(self.caches_bytes)} of caches and a {format_size(self.margin_bytes)} margin")


MARGIN_BYTES = 256 * 1024**2     # left free beside the states (allocator slack, buffers, the HTTP side)


def run_budget(model, cfg, model_context: int, available: int, where: str, caches: Optional[int] = None,
               chunk: Optional[int] = None) -> ContextBudget:
    """The ``ContextBudget`` of ``model`` run as ``cfg`` (a RuntimeConfig) says, in ``available``
    bytes of ``where`` ("RAM" or "VRAM"): KV stored as ``kv_cache_dtype`` says, two copies of the
    state with a prefix cache or snapshot directory, and the caches not yet filled subtracted
    (``caches``; default: the prefix cache plus the expert cache of that memory, counted whole:
    pages already filled are counted twice, on the safe side) and the prefill chunk ``chunk`` (a
    runtime's ``prefill_chunk_tokens``; default: the one ``prefill_chunk_tokens`` picks for this
    room). The server and ``doctor`` both ask this."""
    kv = kv_storage(getattr(cfg, "kv_cache_dtype", None), cfg.dtype)
    copies = 2 if cfg.server.prefix_cache_bytes > 0 or cfg.server.snapshot_dir else 0
    if caches is None:
        caches = run_caches(cfg, where)
    if chunk is None:
        chunk = prefill_chunk_tokens(model.config, cfg.generation.prefill_chunk_tokens, available - caches - MARGIN_BYTES)
    cost = context_cost(model, kv, chunk, copies)
    return ContextBudget(cost, available, caches, MARGIN_BYTES, model_context, where)


def run_caches(cfg, where: str) -> int:
    """The caches a run as ``cfg`` says fills in ``where`` ("RAM" or "VRAM"), counted whole: the
    prefix cache and the expert cache of that memory."""
    return cfg.server.prefix_cache_bytes + (cfg.device_cache_bytes if where == "VRAM" else cfg.host_cache_bytes)


def run_room(cfg) -> int:
    """The memory a run as ``cfg`` says has left for states and activations, asked once its model
    and expert caches are loaded (``Runtime.open``; they are in use already): what
    ``available_memory`` reports on its device less the margin. (A chunk takes half of it: the
    rest is for states and, in the server, the prefix cache, which the budget counts.)"""
    available, _ = available_memory(cfg.device)
    return available - MARGIN_BYTES


def cgroup_memory(root: str = "/sys/fs/cgroup", proc: str = "/proc/self/cgroup") -> tuple[Optional[int], Optional[int]]:
    """(limit, usage) in bytes of the memory cgroup that leaves this process the least room: its
    own group or a parent (``_host.cgroup_dirs``; v2 ``memory.max`` / ``memory.current``, v1
    ``memory.limit_in_bytes`` / ``memory.usage_in_bytes``), usage less the inactive page cache the
    kernel reclaims first (``memory.stat``, as ``docker stats`` counts it: the page cache alone
    fills a capped group to its limit); (None, None) where none is limited."""
    best = (None, None)
    for d in cgroup_dirs("memory", root, proc):
        for limit_name, usage_name in (("memory.max", "memory.current"),
                                       ("memory.limit_in_bytes", "memory.usage_in_bytes")):
            limit = _read_int(d / limit_name)
            if limit is None:
                continue                     # not this version's file (or "max": unlimited)
            if limit >= 1 << 60:
                break
            usage = _read_int(d / usage_name)
            if usage is not None:
                usage = max(0, usage - _inactive_file(d))
            if best[0] is None or limit - (usage or 0) < best[0] - (best[1] or 0):
                best = (limit, usage)
            break
    return best


def _read_int(path: Path) -> Optional[int]:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _inactive_file(group: Path) -> int:
    """The inactive page cache of a memory cgroup (v1 ``total_inactive_file``, v2 ``inactive_file``)."""
    try:
        stat = dict(line.split()[:2] for line in (group / "memory.stat").read_text().splitlines() if " " in line)
        return int(stat.get("total_inactive_file", stat.get("inactive_file", 0)))
    except (OSError, ValueError):
        return 0


def available_memory(device: str = "cpu") -> tuple[int, str]:
    """(bytes, "RAM" or "VRAM"): what a state may still take on ``device``: free memory on CUDA; on
    the CPU MemAvailable, or what the cgroup limit leaves when that is less."""
    if device.startswith("cuda"):
        import torch
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free), "VRAM"
    avail = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    limit, usage = cgroup_memory()
    if limit is not None:
        left = max(0, limit - (usage or 0))
        avail = left if avail is None else min(avail, left)
    return avail or 0, "RAM"
