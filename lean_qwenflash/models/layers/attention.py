"""Causal GQA attention over a KV cache, via SDPA, and the variants families compose.

``Attention`` is the common layer (optional per-head q/k norm, sliding window, rope or not); each
family's oddity is a small subclass that overrides one step: ``QueryGatedAttention`` (Qwen3-Next:
q_proj also yields an output gate), ``GateProjAttention`` (AfMoE: an output gate of its own),
``SinkAttention`` (GPT-OSS: per-head sink logits), ``FlatQKNormAttention`` (OLMoE: q/k norms over
the whole projection, optional clipping).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from lean_qwenflash.models.layers.linear import Linear
from lean_qwenflash.models.layers.rope import apply_rotary


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
            cos, sin = rope
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = self.attend(q, k, v, state)
        out = out.transpose(1, 2).reshape(batch, num_tokens, -1)
        return self.o_proj(self.output_gate(out, x, gate))

    def query(self, x: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """q_proj's output and the output gate's logits it carries (None: none)."""
        return self.q_proj(x), None

    def project(self, x: torch.Tensor):
        """x [B, T, H] -> q [B, T, heads, D], k and v [B, T, kv_heads, D] (q and k normalised per
        head when there is a q/k norm), and the output gate's logits or None."""
        q, gate = self.query(x)
        k, v = self.k_proj(x), self.v_proj(x)
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
        if self.sliding_window is not None:
            return self.masked_attend(q, k, v, state)
        if state is not None:
            k, v = state.append(k, v)
        mask, causal = causal_mask(q.shape[2], k.shape[2], q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                              scale=self.head_dim ** -0.5,
                                              enable_gqa=self.num_heads != self.num_kv_heads)

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
        return self.masked_attend(q, k, v, state, self.sinks)


class QueryGatedAttention(Attention):
    """Qwen3-Next: q_proj also yields a per-head output gate, interleaved per head as [q_h, gate_h];
    the attention output is multiplied by sigmoid(gate) before o_proj."""

    q_parts = 2

    def query(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        batch, num_tokens, _ = x.shape
        q = self.q_proj(x).view(batch, num_tokens, self.num_heads, 2 * self.head_dim)
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
        q = self.q_proj(x)
        k, v = self.k_proj(x), self.v_proj(x)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        return self.split_heads(q, k, v) + (None,)
