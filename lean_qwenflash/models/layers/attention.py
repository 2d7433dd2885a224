"""Causal GQA attention over a KV cache, via SDPA, and the variants families compose.

``Attention`` is the common layer (optional per-head q/k norm, sliding window, rope or not); each
family's oddity is a small subclass that overrides one step: ``QueryGatedAttention`` (Qwen3-Next:
q_proj also yields an output gate), ``GateProjAttention`` (AfMoE: an output gate of its own),
``SinkAttention`` (GPT-OSS: per-head sink logits), ``FlatQKNormAttention`` (OLMoE: q/k norms over
the whole projection, optional clipping).

The KV cache stores keys and values as the policy's ``kv_cache_dtype`` says (``KV_CODECS``): f32
(as computed), f16, bf16, or rows of GGUF's 32-value q8_0 / q4_0 blocks (a row whose width is not a
multiple of 32 is padded with zeros to whole blocks). Attention reads the cache in blocks of
``KV_BLOCK_KEYS`` keys with an online softmax (``blocked_attention``): each block is dequantized,
scored and folded into a running (max, sum, accumulator), so a step's memory is
O(queries x heads x KV_BLOCK_KEYS) whatever the context, and no full-precision copy of the cache is
ever made. One-token steps on CPU run the same algorithm natively (``native.attention_decode``,
csrc/attention.cpp). With an f32 cache, exact mode (every step: the bits of the first versions) and
fast mode's first prompt chunk (causal, no mask: SDPA's fused kernel, itself blocked) use SDPA while
a step sees at most ``EXACT_MAX_KEYS`` keys; past that, and for fast mode's later chunks and
one-token steps, the blocked path runs.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from lean_qwenflash.common import KV_CACHE_DTYPES
from lean_qwenflash.models import kernels, native
from lean_qwenflash.models.layers.linear import Linear
from lean_qwenflash.models.layers.norm import native_norm_args
from lean_qwenflash.models.layers.rope import apply_rotary
from lean_qwenflash.models.policy import STANDALONE
from lean_qwenflash.quant import ENCODINGS

KV_BLOCK_KEYS = 256      # cached keys per step of the blocked (online-softmax) attention
EXACT_MAX_KEYS = 4096    # exact mode, f32 cache: SDPA over at most this many keys per step
# Fast mode, f32 cache: a prompt chunk after the first, over up to this many cached keys, runs
# torch's CPU flash kernel (``Attention.chunk_over_cache``): two calls without masks merged by their
# log-sum-exps, 2-5x faster than the blocked loop's torch ops (256 x 32k keys at 4 heads: 84 vs
# 404 ms; 512 x 4096 at 32 heads: 384 vs 788 ms), in tiles of its own (never chunk x context
# scores). Beyond it, for the quantized caches, and where torch lacks the kernel: the blocked loop.
FAST_SDPA_MAX_KEYS = 1 << 20
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


_FLOAT_NATIVE_IDS = {d: ENCODINGS[n].native_id for d, n in ((torch.float32, "f32"), (torch.float16, "f16"),
                                                            (torch.bfloat16, "bf16"))}

class KVCodec:
    """How a KV cache stores rows of ``dim`` values: floats (``f32``: as computed; ``f16``,
    ``bf16``), or GGUF block rows (``q8_0``, ``q4_0``: uint8 [..., blocks * block_bytes], the row
    padded with zeros to whole 32-value blocks) encoded with ``quant.legacy``'s quantizer."""

    def __init__(self, name: str):
        self.name = name
        self.encoding = ENCODINGS[name] if name in ("q8_0", "q4_0") else None
        self.dtype = {"f16": torch.float16, "bf16": torch.bfloat16}.get(name)

    def padded(self, dim: int) -> int:
        return dim if self.encoding is None else -(-dim // 32) * 32

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """float [..., dim] -> what the cache stores."""
        if self.encoding is None:
            return x if self.dtype is None else x.to(self.dtype)
        pad = self.padded(x.shape[-1]) - x.shape[-1]
        return self.encoding.quantize(F.pad(x, (0, pad)) if pad else x)

    def decode(self, stored: torch.Tensor, dim: int) -> torch.Tensor:
        """Stored rows [..., row] -> fp32 [..., dim] (only the rows passed: a block of the cache)."""
        if self.encoding is None:
            return stored.float()
        return self.encoding.dequantize(stored, self.padded(dim))[..., :dim]

    def native_id(self, stored: torch.Tensor) -> int:
        if self.encoding is not None:
            return self.encoding.native_id
        return _FLOAT_NATIVE_IDS[stored.dtype]

    def bytes_per_value_row(self, dim: int, compute_itemsize: int = 4) -> int:
        """Bytes one cached row of ``dim`` values takes."""
        if self.encoding is not None:
            return self.padded(dim) // 32 * self.encoding.block_bytes
        return dim * (compute_itemsize if self.dtype is None else 2)


KV_CODECS = {name: KVCodec(name) for name in KV_CACHE_DTYPES}


def kv_codec(name: str) -> KVCodec:
    try:
        return KV_CODECS[name]
    except KeyError:
        raise ValueError(f"kv_cache_dtype {name!r}: must be one of {', '.join(KV_CACHE_DTYPES)}") from None


def blocked_attention(queries: list, keys: list, values, codec: KVCodec, *, scale: float, query_start: int,
                      key_pos: Optional[torch.Tensor] = None, window: Optional[int] = None,
                      sinks: Optional[torch.Tensor] = None, block: int = KV_BLOCK_KEYS) -> torch.Tensor:
    """Causal attention by online softmax over blocks of ``block`` cached keys -> fp32 [B, H, T, Dv].

    ``queries``: parts [B, H, T, d_i] whose scores add (one part; MLA: the latent and rope query),
    at positions query_start .. query_start + T - 1. ``keys``: (stored [B, kv_heads, L, row], d_i)
    per part, in the codec's storage; ``values``: (stored, Dv), or 0 for "the first key part" (MLA's
    latent: dequantized once per block). ``key_pos`` [L]: the keys' positions (-1: empty; a ring),
    None for 0..L-1 (then blocks wholly after the last query, or before the window, are skipped).
    ``window`` W: key j is visible from query i iff i - W < j <= i. ``sinks`` [H]: one more key per
    head, of that logit and a zero value. Per block only [B, H, T, block] scores and one block of
    dequantized keys and values exist.
    """
    batch, heads, num_q = queries[0].shape[:3]
    kv_heads, length = keys[0][0].shape[1], keys[0][0].shape[2]
    group, rows = heads // kv_heads, heads // kv_heads * num_q
    device = queries[0].device
    qs = [q.float().reshape(batch, kv_heads, rows, q.shape[-1]) for q in queries]   # row = (head in group, t)
    dv = keys[0][1] if isinstance(values, int) else values[1]
    qpos = torch.arange(query_start, query_start + num_q, device=device).repeat(group)[:, None]
    if sinks is None:
        m = torch.full((batch, kv_heads, rows, 1), float("-inf"), device=device)
        l = torch.zeros(batch, kv_heads, rows, 1, device=device)
    else:   # the sink's key: logit sinks[h], weight exp(sink - m), value zero
        m = sinks.float().view(1, kv_heads, group, 1).expand(batch, kv_heads, group, num_q).reshape(batch, kv_heads, rows, 1)
        l = torch.ones(batch, kv_heads, rows, 1, device=device)
    acc = torch.zeros(batch, kv_heads, rows, dv, device=device)
    last_q = query_start + num_q - 1
    for start in range(0, length, block):
        end = min(start + block, length)
        if key_pos is None:
            if start > last_q:
                break
            if window is not None and end - 1 <= query_start - window:
                continue
            kp = torch.arange(start, end, device=device)
        else:
            kp = key_pos[start:end]
        visible = (kp[None, :] <= qpos) & (kp[None, :] >= 0)
        if window is not None:
            visible &= kp[None, :] > qpos - window
        blocks = [codec.decode(stored[:, :, start:end], dim) for stored, dim in keys]
        scores = qs[0] @ blocks[0].transpose(-1, -2)
        for q, kb in zip(qs[1:], blocks[1:]):
            scores += q @ kb.transpose(-1, -2)
        scores.mul_(scale).masked_fill_(~visible, float("-inf"))
        m_new = torch.maximum(m, scores.amax(-1, keepdim=True))
        m_safe = m_new.masked_fill(m_new == float("-inf"), 0.0)     # rows that saw nothing yet
        p = scores.sub_(m_safe).exp_()
        alpha = (m - m_safe).exp_()
        l = l * alpha + p.sum(-1, keepdim=True)
        vb = blocks[0] if isinstance(values, int) else codec.decode(values[0][:, :, start:end], dv)
        acc = acc.mul_(alpha).add_(p @ vb)
        m = m_new
    out = acc / l
    return out.view(batch, kv_heads, group, num_q, dv).reshape(batch, heads, num_q, dv)


def native_decode_ok(q: torch.Tensor, *stored: torch.Tensor) -> bool:
    """Whether a one-token step can take the native kernel: CPU, one sequence, rows it reads."""
    return (native.available() and q.device.type == "cpu" and q.shape[0] == 1 and q.shape[2] == 1
            and all(t.device.type == "cpu" and t.stride(-1) == 1 and t.dtype in (torch.uint8, torch.float32,
                                                                                   torch.float16, torch.bfloat16)
                    for t in stored))


def causal_mask(num_queries: int, num_keys: int, device) -> tuple[Optional[torch.Tensor], bool]:
    """(attn_mask, is_causal) for SDPA when the queries are the last ``num_queries`` of
    ``num_keys`` positions: SDPA's is_causal aligns top-left, so with a cache (the query block
    sits bottom-right) an explicit mask is needed."""
    num_past = num_keys - num_queries
    if num_queries > 1 and num_past > 0:
        cols = torch.arange(num_keys, device=device)
        rows = torch.arange(num_queries, device=device) + num_past
        return cols[None, :] <= rows[:, None], False
    return None, num_queries > 1


class Attention(nn.Module):
    """Causal GQA attention with a KV cache, via SDPA.

    ``qk_norm``: makes the q and k norms from a width (e.g. ``partial(RMSNorm, eps=eps)``), applied
    per head (Qwen3). ``sliding_window`` W: key j is visible from query i iff i - W < j <= i (the
    layer's state is then a SlidingKVCache holding the last W tokens). ``use_rope`` False: this
    layer has no rope (AfMoE's global layers). ``o_bias``: o_proj's bias when it differs from q/k/v's.

    The forward is ``project`` (x -> q, k, v heads and an output gate's logits or None), rope,
    ``attend`` and ``output_gate``, then o_proj: a variant overrides the step it changes.
    """

    q_parts = 1          # q_proj rows per head, in head_dim units
    ctx = STANDALONE     # the model's ExecContext (CausalLM binds it): kernel mode, kv_cache_dtype

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
                 bias: bool = False, o_bias: Optional[bool] = None,
                 qk_norm: Optional[Callable[[int], nn.Module]] = None,
                 sliding_window: Optional[int] = None, use_rope: bool = True):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = Linear(hidden_size, num_heads * head_dim * self.q_parts, bias=bias)
        self.k_proj = Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = Linear(num_heads * head_dim, hidden_size, bias=bias if o_bias is None else o_bias)
        if qk_norm is not None:
            self.q_norm, self.k_norm = qk_norm(head_dim), qk_norm(head_dim)
        else:
            self.q_norm = self.k_norm = None
        self.sliding_window, self.use_rope = sliding_window, use_rope

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], state=None) -> torch.Tensor:
        """x [B, T, H]; ``state`` has ``append(k, v) -> (k_all, v_all)`` ([B, kv_heads, L, D])."""
        batch, num_tokens, _ = x.shape
        q, k, v, gate = self.project(x)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.transpose(1, 2)
        if self.use_rope:
            if rope is None:
                return None
            cos, sin = rope
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = self.attend(q, k, v, state)
        out = out.transpose(1, 2).reshape(batch, num_tokens, -1)
        return self.o_proj(self.output_gate(out, x, gate))

    def forward_rows(self, x: torch.Tensor, ropes: list, states: list) -> torch.Tensor:
        """One token of each of B sequences (x [B, 1, H]), each at its own position (``ropes``) over
        its own cache (``states``): the projections and o_proj for all rows at once, rope and
        attention per sequence."""
        batch = x.shape[0]
        q, k, v, gate = self.project(x)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        outs = []
        for b, state in enumerate(states):
            qb, kb = q[b:b + 1], k[b:b + 1]
            if self.use_rope:
                cos, sin = ropes[b]
                qb, kb = apply_rotary(qb, cos, sin), apply_rotary(kb, cos, sin)
            outs.append(self.attend(qb, kb, v[b:b + 1], state))
        out = torch.cat(outs).transpose(1, 2).reshape(batch, 1, -1)
        return self.o_proj(self.output_gate(out, x, gate))

    def query(self, q: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The queries and the output gate's logits (None: none) from q_proj's output ``q``."""
        return q, None

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q_proj, k_proj and v_proj of x: one native call for a decode step in fast mode
        (``kernels.linears``: x quantized once, one parallel run), else the three modules."""
        mods = (self.q_proj, self.k_proj, self.v_proj)
        if x.shape[-2] == 1:
            fused = kernels.linears(x, mods, self.q_proj.ctx)
            if fused is not None:
                return tuple(fused)
        return tuple(m(x) for m in mods)

    def project(self, x: torch.Tensor):
        """x [B, T, H] -> q [B, T, heads, D], k and v [B, T, kv_heads, D] (q and k normalised per
        head when there is a q/k norm), and the output gate's logits or None."""
        q, k, v = self.qkv(x)
        q, gate = self.query(q)
        q, k, v = self.split_heads(q, k, v)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v, gate

    def split_heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        batch, num_tokens = k.shape[:2]
        q = q.reshape(batch, num_tokens, self.num_heads, self.head_dim)
        k = k.view(batch, num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(batch, num_tokens, self.num_kv_heads, self.head_dim)
        return q, k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, state) -> torch.Tensor:
        """q [B, heads, T, D] over the cached keys and values plus k, v -> [B, heads, T, D]."""
        return self.attention(q, k, v, state)

    def attention(self, q, k, v, state, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The cache in the policy's kv_cache_dtype; SDPA (f32 cache, at most EXACT_MAX_KEYS keys:
        every step in exact mode; in fast mode every chunk of a prompt, see FAST_SDPA_MAX_KEYS) or the
        blocked online softmax (native for one-token CPU steps). (SDPA's fused causal kernel runs a
        512-token chunk faster than the blocked loop's torch ops: 22% of a Q4_K_M prefill's time
        went there.)"""
        policy = self.ctx.policy
        codec = kv_codec(policy.kv_cache_dtype)
        first_chunk = q.shape[2] > 1 and (state is None or state.num_tokens == 0)
        if codec.name == "f32" and (policy.kernel_mode == "exact" or first_chunk):
            past = 0 if state is None else state.num_tokens
            if self.sliding_window is not None:
                past = min(past, self.sliding_window)
            if past + q.shape[2] <= EXACT_MAX_KEYS:
                if self.sliding_window is not None or sinks is not None:
                    return self.masked_attend(q, k, v, state, sinks)
                return self.sdpa_attend(q, k, v, state)
        elif codec.name == "f32" and q.shape[2] > 1 and state is not None and state.num_tokens > 0 \
                and self.sliding_window is None and sinks is None and _FLASH_CPU is not None and q.device.type == "cpu" and q.dtype == torch.float32 \
                and state.num_tokens + q.shape[2] <= FAST_SDPA_MAX_KEYS:
            # fast mode, a later chunk of a prompt over an f32 cache
            return self.chunk_over_cache(q, k, v, state)
        return self.blocked_attend(q, k, v, state, sinks, codec)

    def blocked_attend(self, q, k, v, state, sinks, codec: KVCodec) -> torch.Tensor:
        """k, v stored as ``codec`` says; attention by blocks of the cache (``blocked_attention``)."""
        num_tokens, dim = q.shape[2], self.head_dim
        k, v = codec.encode(k), codec.encode(v)
        start, key_pos = 0, None
        if state is None:
            keys, values = k, v
        elif self.sliding_window is not None:
            start = state.num_tokens
            keys, values, key_pos = state.attend(k, v)
            if num_tokens == 1:     # the ring's filled slots (0..n-1) hold the window: all visible
                n = min(state.num_tokens, self.sliding_window)
                keys, values, key_pos = keys[:, :, :n], values[:, :, :n], key_pos[:n]
        else:
            start = state.num_tokens
            keys, values = state.append(k, v)
        scale = self.head_dim ** -0.5
        if native_decode_ok(q, keys, values):
            policy = self.ctx.policy
            out = native.attention_decode(q[0, :, 0].float().contiguous(), [(keys[0], codec.native_id(keys), dim)],
                                          (values[0], codec.native_id(values), dim), keys.shape[2], scale, sinks,
                                          policy.isa, policy.native_threads)
            return out.view(1, self.num_heads, 1, dim).to(q.dtype)
        return blocked_attention([q], [(keys, dim)], (values, dim), codec, scale=scale, query_start=start,
                                 key_pos=key_pos, window=self.sliding_window, sinks=sinks).to(q.dtype)

    def sdpa_attend(self, q, k, v, state) -> torch.Tensor:
        """Full-precision keys and values, SDPA over the whole cache (exact mode's short path)."""
        if state is not None:
            k, v = state.append(k, v)
        mask, causal = causal_mask(q.shape[2], k.shape[2], q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                              scale=self.head_dim ** -0.5,
                                              enable_gqa=self.num_heads != self.num_kv_heads)

    def chunk_over_cache(self, q, k, v, state) -> torch.Tensor:
        """A prompt chunk over an f32 cache without masks: the cached keys, which every query of the
        chunk sees, in one flash call (a GQA group's queries folded into rows: no copies of the
        keys), the chunk's own keys in a causal one, and the two merged by their log-sum-exps."""
        batch, heads, num_q, dim = q.shape
        kv_heads = self.num_kv_heads
        group, past, scale = heads // kv_heads, state.num_tokens, self.head_dim ** -0.5
        keys, values = state.append(k, v)
        o_past, lse_past = _FLASH_CPU(q.reshape(batch, kv_heads, group * num_q, dim), keys[:, :, :past],
                                      values[:, :, :past], 0.0, False, scale=scale)
        k_own, v_own = (k, v) if group == 1 else (k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))
        o_own, lse_own = _FLASH_CPU(q, k_own, v_own, 0.0, True, scale=scale)
        lse_past = lse_past.reshape(batch, heads, num_q, 1)
        lse = torch.logaddexp(lse_past, lse_own.unsqueeze(-1))
        return o_past.reshape(batch, heads, num_q, dim) * (lse_past - lse).exp_() + o_own * (lse_own.unsqueeze(-1) - lse).exp_()

    def output_gate(self, out: torch.Tensor, x: torch.Tensor, gate: Optional[torch.Tensor]) -> torch.Tensor:
        """The attention output [B, T, heads*D] before o_proj: times sigmoid(gate) when there is one."""
        return out if gate is None else out * torch.sigmoid(gate)

    def masked_attend(self, q, k, v, state, sinks: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Attention with an explicit mask from token positions: the sliding window and/or ``sinks``
        (per-head logits of one more key, zero with a zero value)."""
        num_tokens = q.shape[2]
        has_zero_slot = False           # the keys/values already end with the sink's zero slot
        if state is not None:
            num_past = state.num_tokens
            if self.sliding_window is not None:
                k, v, key_pos = state.attend(k, v)
            else:
                has_zero_slot = sinks is not None
                k, v = state.append(k, v, zero_slot=has_zero_slot)
                key_pos = torch.arange(k.shape[2] - has_zero_slot, device=q.device)
        else:
            num_past, key_pos = 0, torch.arange(num_tokens, device=q.device)
        query_pos = torch.arange(num_past, num_past + num_tokens, device=q.device)
        visible = (key_pos[None, :] >= 0) & (key_pos[None, :] <= query_pos[:, None])
        if self.sliding_window is not None:
            visible &= key_pos[None, :] > query_pos[:, None] - self.sliding_window
        mask = visible
        if sinks is not None:
            # The sink: one more key (zero, with a zero value) whose logit is the head's sink.
            if not has_zero_slot:       # (a full layer's cache keeps it: no copy of the cache per step)
                zero = k.new_zeros(k.shape[:2] + (1, k.shape[3]))
                k, v = torch.cat((k, zero), dim=2), torch.cat((v, zero), dim=2)
            bias = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill(~visible, float("-inf"))
            sink = sinks.to(q.dtype).view(1, -1, 1, 1).expand(1, self.num_heads, num_tokens, 1)
            mask = torch.cat((bias.expand(1, self.num_heads, -1, -1), sink), dim=-1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.head_dim ** -0.5,
                                              enable_gqa=self.num_heads != self.num_kv_heads)


class SinkAttention(Attention):
    """GPT-OSS: per-head attention sinks (HF ``self_attn.sinks`` [heads]), an extra softmax column
    per head whose value is zero, on full and sliding-window layers alike."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, **options):
        super().__init__(hidden_size, num_heads, num_kv_heads, head_dim, **options)
        self.sinks = nn.Parameter(torch.zeros(num_heads))

    def attend(self, q, k, v, state) -> torch.Tensor:
        return self.attention(q, k, v, state, self.sinks)


class QueryGatedAttention(Attention):
    """Qwen3-Next: q_proj also yields a per-head output gate, interleaved per head as [q_h, gate_h];
    the attention output is multiplied by sigmoid(gate) before o_proj."""

    q_parts = 2

    def query(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch, num_tokens, _ = q.shape
        q = q.view(batch, num_tokens, self.num_heads, 2 * self.head_dim)
        q, gate = q[..., :self.head_dim], q[..., self.head_dim:]
        return q, gate.reshape(batch, num_tokens, -1)


class GateProjAttention(Attention):
    """AfMoE: an output gate of its own, ``out * sigmoid(gate_proj(x))`` before o_proj (HF
    ``self_attn.gate_proj``)."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, **options):
        super().__init__(hidden_size, num_heads, num_kv_heads, head_dim, **options)
        self.gate_proj = Linear(hidden_size, num_heads * head_dim, bias=False)

    def output_gate(self, out: torch.Tensor, x: torch.Tensor, gate=None) -> torch.Tensor:
        return out * torch.sigmoid(self.gate_proj(x))


class FlatQKNormAttention(Attention):
    """OLMoE: the q/k norms run over the whole projection (all heads at once, before the split into
    heads), and q, k, v are clipped to [-clip_qkv, clip_qkv] when ``clip_qkv`` is set."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
                 qk_norm: Callable[[int], nn.Module], clip_qkv: Optional[float] = None, **options):
        super().__init__(hidden_size, num_heads, num_kv_heads, head_dim, **options)
        self.q_norm, self.k_norm = qk_norm(num_heads * head_dim), qk_norm(num_kv_heads * head_dim)
        self.clip_qkv = clip_qkv

    def project(self, x: torch.Tensor):
        q, k, v = self.qkv(x)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        return self.split_heads(q, k, v) + (None,)


class AttentionStep:
    """A layer's attention sub-block for one-token fast-mode CPU steps as one native call
    (csrc/decode_step.h): the input norm, q/k/v, the per-head q/k norms, rope, the new cache row,
    attention, the output gate, o_proj and the residual add — the kernels the separate calls use,
    in their order, without the ~15 Python dispatches between them.

    ``build`` returns None where the sub-block is not one it covers: another kernel mode, a KV
    cache dtype other than f32, a matrix or norm the native kernels would not take in the separate
    calls either (so the bits stay theirs), or an attention variant with more to it (OLMoE's flat
    q/k norms and clipping, AfMoE's gate projection, MLA). A step whose sequence does not fit
    (a batch, a sliding-window ring, another dtype) is refused by ``__call__`` (None): the caller
    runs the separate calls."""

    def __init__(self, attn: Attention, norm, handle, keep: list):
        self.attn, self.policy = attn, attn.ctx.policy
        # The tensors the handle points at, held: a model whose weights are replaced after this
        # was built (not something a runtime does) still computes with these, never freed memory.
        self.handle, self._keep = handle, keep
        self._like = torch.empty(1, attn.num_kv_heads, 0, attn.head_dim)
        self.hidden, self.use_rope = attn.q_proj.in_features, attn.use_rope

    @classmethod
    def build(cls, attn, norm) -> Optional["AttentionStep"]:
        policy = attn.ctx.policy
        if type(attn) not in (Attention, QueryGatedAttention, SinkAttention) or policy.kernel_mode != "fast" \
                or policy.kv_cache_dtype != "f32" or not native.available() or attn.sliding_window is not None:
            return None
        weights = []
        for i, m in enumerate((attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj)):
            if m.qweight is not None:
                w = m.qweight
            elif policy.float_native and (i < 3 or m.weight.nbytes >= kernels.SPLIT_MIN_BYTES):
                w = m.weight        # (as kernels.linears and Linear.forward take float weights)
            else:
                return None
            if not native.supports(w) or (m.bias is not None and not native.is_f32(m.bias)):
                return None
            weights.append((w, m))
        hidden, dim = attn.q_proj.in_features, attn.head_dim
        in_norm = native_norm_args(norm, hidden)
        if in_norm is None:
            return None
        qk = (None, 1, 0.0)
        if attn.q_norm is not None:
            from lean_qwenflash.models.layers.norm import RMSNorm
            if attn.num_heads * dim > RMSNorm.NATIVE_MAX_VALUES:    # (the separate calls' norm runs torch)
                return None
            qn, kn = native_norm_args(attn.q_norm, dim), native_norm_args(attn.k_norm, dim)
            if qn is None or kn is None or qn[1:] != kn[1:]:
                return None
            qk = (qn[0], qn[1], qn[2], kn[0])
        sinks = getattr(attn, "sinks", None) if isinstance(attn, SinkAttention) else None
        if sinks is not None and not native.is_f32(sinks.data):
            return None
        handle = native._K.AttentionStep(
            hidden=hidden, heads=attn.num_heads, kv_heads=attn.num_kv_heads, head_dim=dim,
            gated=isinstance(attn, QueryGatedAttention), in_norm=in_norm[0].data_ptr(), in_norm_mode=in_norm[1],
            in_eps=in_norm[2], w=[native._address(w) for w, _ in weights],
            enc=[native.encoding_id(w) for w, _ in weights], rows=[m.out_features for _, m in weights],
            bias=[0 if m.bias is None else m.bias.data_ptr() for _, m in weights],
            q_norm=0 if qk[0] is None else qk[0].data_ptr(), k_norm=0 if qk[0] is None else qk[3].data_ptr(),
            qk_mode=qk[1], qk_eps=qk[2], scale=float(dim ** -0.5),
            sinks=0 if sinks is None else sinks.data_ptr())
        keep = [w for w, _ in weights] + [m.bias for _, m in weights] + [in_norm[0], qk[0], qk[-1], sinks]
        return cls(attn, norm, handle, keep)

    def __call__(self, x: torch.Tensor, rope, cache) -> Optional[torch.Tensor]:
        """x + the sub-block of x [1, 1, H] continuing ``cache`` (a KVCache, updated), or None."""
        from lean_qwenflash.generate.state import KVCache
        if type(cache) is not KVCache or x.shape != (1, 1, self.hidden) or not native.is_f32(x):
            return None
        n = cache.num_tokens
        if cache.keys is not None and (cache.keys.dtype != torch.float32 or cache.keys.shape[0] != 1):
            return None
        cos_p = sin_p = 0
        rotary_dim = 0
        if self.use_rope:
            if rope is None:
                return None
            cos, sin = rope
            if not (native.is_f32(cos) and native.is_f32(sin)) or cos.dim() != 2 or cos.shape[0] != 1 \
                    or sin.shape != cos.shape:
                return None
            cos_p, sin_p, rotary_dim = cos.data_ptr(), sin.data_ptr(), cos.shape[1]
        keys, values = cache.reserve(n + 1, self._like, self._like)
        out = torch.empty_like(x)
        policy = self.policy
        self.handle.run(x.data_ptr(), rotary_dim, cos_p, sin_p, keys.data_ptr(), values.data_ptr(), keys.stride(1),
                        keys.stride(2), n, out.data_ptr(), native._threads(policy.native_threads), policy.isa)
        cache.num_tokens = n + 1
        return out
