"""Shared building blocks of every model family: norms, rotary, attention, Gated DeltaNet, MLP, MoE.

Families only declare modules (with Hugging Face attribute names, so ``state_dict()`` keys equal the
checkpoint's); the math lives here. Every layer takes an optional per-layer state object (see
``lean_qwenflash.generate.state``) and works on any device: layers only use duck-typed state
attributes so that this package never imports the generation package.

Shapes: B batch, T new tokens, L tokens in the cache, H hidden, E experts, I expert intermediate.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from lean_qwenflash.models import kernels, native


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """At least fp32 (bf16/fp16 math happens in fp32; fp64 stays fp64 for reference runs)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and keys) whose one-row products use every CPU thread.

    A block-quantized weight (``pack --quant``) replaces the parameter via :meth:`set_quantized`;
    products then go through ``kernels.quant_linear`` in ``kernel_mode`` (set by
    CausalLM.set_expert_kernels)."""

    qweight = None
    kernel_mode, kernel_isa = "fast", "auto"
    # "fast" (CausalLM.set_expert_kernels): one-row products with a float weight of at least
    # kernels.SPLIT_MIN_BYTES on CPU run the native kernel too (decode: torch is on one thread
    # then, the kernels use every core; below that size a thread hand-off costs more than it saves).
    float_kernel = None

    def set_quantized(self, qweight) -> None:
        if tuple(qweight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"quantized weight {tuple(qweight.shape)} does not fit Linear "
                             f"[{self.out_features}, {self.in_features}]")
        del self.weight                  # no float copy: the module's state is the encoded rows
        self.qweight = qweight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None:
            return kernels.quant_linear(x, self.qweight, self.bias, self.kernel_mode, self.kernel_isa)
        if self.float_kernel == "fast" and x.numel() == self.in_features and \
                self.weight.nbytes >= kernels.SPLIT_MIN_BYTES and native.supports(self.weight):
            out = native.gemv(self.weight, x, isa=self.kernel_isa).view(x.shape[:-1] + (self.out_features,))
            out = out.to(x.dtype)
            return out if self.bias is None else out + self.bias
        return kernels.linear(x, self.weight, self.bias)


class Embedding(nn.Embedding):
    """``nn.Embedding`` whose table may be block-quantized rows (GGUF files quantize it): a lookup
    then dequantizes only the rows asked for, exactly, and a tied output head multiplies by the
    encoded rows (``kernels.quant_linear``)."""

    qweight = None
    kernel_mode, kernel_isa = "fast", "auto"

    def set_quantized(self, qweight, dtype: torch.dtype) -> None:
        if tuple(qweight.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"quantized embeddings {tuple(qweight.shape)} do not fit "
                             f"[{self.num_embeddings}, {self.embedding_dim}]")
        del self.weight
        self.qweight, self.qdtype = qweight, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.qweight is None:
            return super().forward(ids)
        rows = self.qweight.raw[ids.reshape(-1)]
        values = self.qweight.encoding.dequantize(rows, self.embedding_dim)
        return values.to(self.qdtype).view(*ids.shape, self.embedding_dim)

    def as_head(self, x: torch.Tensor) -> torch.Tensor:
        """Logits through the (tied) table: x @ tableᵀ."""
        if self.qweight is None:
            return kernels.linear(x, self.weight)
        return kernels.quant_linear(x, self.qweight, None, self.kernel_mode, self.kernel_isa)


class RMSNorm(nn.Module):
    """``w * x / rms(x)``; ``zero_centred`` (Qwen3-Next) stores ``w - 1``, i.e. computes ``(1 + w)``."""

    def __init__(self, dim: int, eps: float, zero_centred: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centred else torch.ones(dim))
        self.eps = eps
        self.zero_centred = zero_centred

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = F.rms_norm(_upcast(x), (x.shape[-1],), None, self.eps)
        if self.zero_centred:
            # Multiply in fp32 before the downcast, as the architecture defines it.
            return (xf * (1.0 + _upcast(self.weight))).to(x.dtype)
        return self.weight * xf.to(x.dtype)


class GatedRMSNorm(nn.Module):
    """``w * rmsnorm(x) * silu(gate)``: the output norm of Gated DeltaNet (plain, not zero-centred)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        xf = F.rms_norm(_upcast(x), (x.shape[-1],), None, self.eps)
        out = (self.weight * xf.to(x.dtype)) * F.silu(_upcast(gate))
        return out.to(x.dtype)


class Rotary:
    """Rotary position tables (default RoPE, optionally only on the first ``partial`` of a head).

    Holds no parameters; tables are computed in fp32 and grown on demand, so decode only slices.
    ``sin`` is stored with the sign of rotate-half folded in: ``rot(x) * sin == swap(x) * sin_signed``.
    """

    def __init__(self, head_dim: int, theta: float, partial_rotary_factor: float = 1.0):
        self.rotary_dim = int(head_dim * partial_rotary_factor)
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.float32, device="cpu") / self.rotary_dim))
        self.attention_scaling = 1.0     # YaRN scales cos and sin
        self._cos = self._sin = None

    def tables(self, start: int, num_tokens: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin for positions ``start .. start+num_tokens``: each [T, rotary_dim]."""
        end = start + num_tokens
        if self._cos is None or self._cos.shape[0] < end or self._cos.device != torch.device(device) \
                or self._cos.dtype != dtype:
            size = max(end, 2 * (self._cos.shape[0] if self._cos is not None else 0), 256)
            pos = torch.arange(size, dtype=torch.float32, device="cpu")
            freqs = pos[:, None] * self.inv_freq[None, :]
            half = freqs.shape[-1]
            emb = torch.cat((freqs, freqs), dim=-1)
            sin = emb.sin() * self.attention_scaling
            sin[:, :half] = -sin[:, :half]
            self._cos = (emb.cos() * self.attention_scaling).to(device=device, dtype=dtype)
            self._sin = sin.to(device=device, dtype=dtype)
        return self._cos[start:end], self._sin[start:end]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, D] rotated on its first ``cos.shape[-1]`` dims (rotate-half convention)."""
    rotary_dim = cos.shape[-1]
    half = rotary_dim // 2
    x_rot = x[..., :rotary_dim]
    swapped = torch.cat((x_rot[..., half:], x_rot[..., :half]), dim=-1)
    rotated = x_rot * cos + swapped * sin
    if rotary_dim == x.shape[-1]:
        return rotated
    return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)


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

    Options cover the families: ``qk_norm`` "head" (Qwen3: RMSNorm per head) or "full" (OLMoE:
    RMSNorm over all heads), ``output_gate`` (Qwen3-Next: q_proj also yields a per-head sigmoid
    gate, interleaved per head as [q_h, gate_h]), ``clip_qkv`` (OLMoE).
    """

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, *,
                 norm_eps: float = 1e-6, bias: bool = False, qk_norm: Optional[str] = None,
                 zero_centred_norm: bool = False, output_gate: bool = False,
                 clip_qkv: Optional[float] = None, o_bias: Optional[bool] = None,
                 sliding_window: Optional[int] = None, sinks: bool = False, use_rope: bool = True,
                 gate_proj: bool = False):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.output_gate, self.qk_norm, self.clip_qkv = output_gate, qk_norm, clip_qkv
        self.q_proj = Linear(hidden_size, num_heads * head_dim * (2 if output_gate else 1), bias=bias)
        self.k_proj = Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = Linear(num_heads * head_dim, hidden_size, bias=bias if o_bias is None else o_bias)
        if qk_norm == "head":
            self.q_norm = RMSNorm(head_dim, norm_eps, zero_centred_norm)
            self.k_norm = RMSNorm(head_dim, norm_eps, zero_centred_norm)
        elif qk_norm == "full":
            self.q_norm = RMSNorm(num_heads * head_dim, norm_eps, zero_centred_norm)
            self.k_norm = RMSNorm(num_kv_heads * head_dim, norm_eps, zero_centred_norm)
        # GPT-OSS / AfMoE: a window (key j visible from query i iff i - W < j <= i; the layer's state
        # is then a SlidingKVCache holding the last W tokens), per-head sink logits (an extra
        # softmax column with a zero value), no rope on this layer, a separate output gate.
        self.sliding_window, self.use_rope = sliding_window, use_rope
        if sinks:
            self.sinks = nn.Parameter(torch.zeros(num_heads))
        else:
            self.sinks = None
        if gate_proj:
            self.gate_proj = Linear(hidden_size, num_heads * head_dim, bias=False)
        else:
            self.gate_proj = None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], state=None) -> torch.Tensor:
        """x [B, T, H]; ``state`` has ``append(k, v) -> (k_all, v_all)`` ([B, kv_heads, L, D])."""
        batch, num_tokens, _ = x.shape
        q = self.q_proj(x)
        gate = None
        if self.output_gate:
            q = q.view(batch, num_tokens, self.num_heads, 2 * self.head_dim)
            q, gate = q[..., :self.head_dim], q[..., self.head_dim:]
            gate = gate.reshape(batch, num_tokens, -1)
        k, v = self.k_proj(x), self.v_proj(x)
        if self.qk_norm == "full":
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        q = q.reshape(batch, num_tokens, self.num_heads, self.head_dim)
        k = k.view(batch, num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm == "head":
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = v.view(batch, num_tokens, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.use_rope:
            cos, sin = rope
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if self.sliding_window is not None or self.sinks is not None:
            out = self._masked_attention(q, k, v, state)
        else:
            if state is not None:
                k, v = state.append(k, v)
            mask, causal = causal_mask(num_tokens, k.shape[2], x.device)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal,
                                                 scale=self.head_dim ** -0.5,
                                                 enable_gqa=self.num_heads != self.num_kv_heads)
        out = out.transpose(1, 2).reshape(batch, num_tokens, -1)
        if gate is not None:
            out = out * torch.sigmoid(gate)
        if self.gate_proj is not None:
            out = out * torch.sigmoid(self.gate_proj(x))
        return self.o_proj(out)

    def _masked_attention(self, q, k, v, state) -> torch.Tensor:
        """Attention with an explicit mask from token positions: the sliding window and/or sinks."""
        num_tokens = q.shape[2]
        has_zero_slot = False           # the keys/values already end with the sink's zero slot
        if state is not None:
            num_past = state.num_tokens
            if self.sliding_window is not None:
                k, v, key_pos = state.attend(k, v)
            else:
                has_zero_slot = self.sinks is not None
                k, v = state.append(k, v, zero_slot=has_zero_slot)
                key_pos = torch.arange(k.shape[2] - has_zero_slot, device=q.device)
        else:
            num_past, key_pos = 0, torch.arange(num_tokens, device=q.device)
        query_pos = torch.arange(num_past, num_past + num_tokens, device=q.device)
        visible = (key_pos[None, :] >= 0) & (key_pos[None, :] <= query_pos[:, None])
        if self.sliding_window is not None:
            visible &= key_pos[None, :] > query_pos[:, None] - self.sliding_window
        mask = visible
        if self.sinks is not None:
            # The sink: one more key (zero, with a zero value) whose logit is the head's sink.
            if not has_zero_slot:       # (a full layer's cache keeps it: no copy of the cache per step)
                zero = k.new_zeros(k.shape[:2] + (1, k.shape[3]))
                k, v = torch.cat((k, zero), dim=2), torch.cat((v, zero), dim=2)
            bias = torch.zeros(visible.shape, dtype=q.dtype, device=q.device).masked_fill(~visible, float("-inf"))
            sink = self.sinks.to(q.dtype).view(1, -1, 1, 1).expand(1, self.num_heads, num_tokens, 1)
            mask = torch.cat((bias.expand(1, self.num_heads, -1, -1), sink), dim=-1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.head_dim ** -0.5,
                                              enable_gqa=self.num_heads != self.num_kv_heads)


class LatentAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2/V3). The cache holds, per token, only the compressed
    latent ``c`` (``kv_lora_rank`` values, after ``kv_a_layernorm``) and the roped key part shared by
    all heads (``qk_rope_head_dim``): a ``KVCache`` whose "keys" are c [B, 1, L, r] and "values" the
    rope keys [B, 1, L, dr].

    Attention runs on the latent directly ("absorbed"): ``kv_b_proj``'s key rows fold into the query
    (q_nope·W_k), its value rows apply after the softmax — equal in exact arithmetic to expanding
    every cached token's keys and values, without the per-step expansion of the whole cache.
    ``interleaved_rope``: the checkpoint's rope dims are (x0, x1) pairs; they are regrouped to the
    rotate-half layout first (an identical permutation of q and k leaves the scores unchanged).
    """

    def __init__(self, hidden_size: int, num_heads: int, q_lora_rank: Optional[int], kv_lora_rank: int,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, *, scaling: float,
                 bias: bool = False, interleaved_rope: bool = True, lora_eps: float = 1e-6):
        super().__init__()
        self.num_heads, self.kv_lora_rank = num_heads, kv_lora_rank
        self.nope, self.rope_dim, self.v_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.q_dim = qk_nope_head_dim + qk_rope_head_dim
        self.scaling, self.interleaved_rope = scaling, interleaved_rope
        if q_lora_rank:
            self.q_a_proj = Linear(hidden_size, q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, lora_eps)
            self.q_b_proj = Linear(q_lora_rank, num_heads * self.q_dim, bias=False)
            self.q_proj = None
        else:
            self.q_proj = Linear(hidden_size, num_heads * self.q_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(hidden_size, kv_lora_rank + qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, lora_eps)
        self.kv_b_proj = Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.o_proj = Linear(num_heads * v_head_dim, hidden_size, bias=bias)

    def _regroup(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1) if self.interleaved_rope else x

    def forward(self, x: torch.Tensor, rope, state=None) -> torch.Tensor:
        batch, num_tokens, _ = x.shape
        q = self.q_proj(x) if self.q_proj is not None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(batch, num_tokens, self.num_heads, self.q_dim).transpose(1, 2)
        q_nope, q_rope = q.split((self.nope, self.rope_dim), dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split((self.kv_lora_rank, self.rope_dim), dim=-1)
        latent = self.kv_a_layernorm(latent).unsqueeze(1)                  # [B, 1, T, r]
        k_rope = k_rope.view(batch, 1, num_tokens, self.rope_dim)
        cos, sin = rope
        q_rope = apply_rotary(self._regroup(q_rope), cos, sin)
        k_rope = apply_rotary(self._regroup(k_rope), cos, sin)
        if state is not None:
            latent, k_rope = state.append(latent, k_rope)                  # [B, 1, L, r], [B, 1, L, dr]
        if self.kv_b_proj.qweight is not None:
            raise NotImplementedError("a block-quantized kv_b_proj is not supported (keep it float)")
        w = self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.kv_lora_rank)
        w_k, w_v = w[:, :self.nope], w[:, self.nope:]
        q_latent = torch.einsum("bhtd,hdr->bhtr", q_nope, w_k)
        query = torch.cat((q_latent, q_rope), dim=-1)
        key = torch.cat((latent, k_rope), dim=-1)
        mask, causal = causal_mask(num_tokens, key.shape[2], x.device)
        out = F.scaled_dot_product_attention(query, key, latent, attn_mask=mask, is_causal=causal,
                                             scale=self.scaling, enable_gqa=True)   # [B, H, T, r]
        out = torch.einsum("bhtr,hvr->bthv", out, w_v).reshape(batch, num_tokens, -1)
        return self.o_proj(out)


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def recurrent_gated_delta_rule(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
    """One token: q, k [B, Hv, Dk], v [B, Hv, Dv], g, beta [B, Hv]; ``state`` [B, Hv, Dk, Dv] updated in place.

    S <- exp(g) S;  delta = beta (v - k^T S);  S <- S + k delta^T;  o = q^T S.
    """
    state.mul_(g.exp()[..., None, None])
    k_row = k.unsqueeze(-2)                                     # [B, Hv, 1, Dk]
    delta = (v.unsqueeze(-2) - k_row @ state) * beta[..., None, None]
    state.add_(k.unsqueeze(-1) @ delta)
    return (q.unsqueeze(-2) @ state).squeeze(-2)                # [B, Hv, Dv]


def chunked_gated_delta_rule(q, k, v, g, beta, state: torch.Tensor, chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Many tokens: q, k [B, Hv, T, Dk], v [B, Hv, T, Dv], g, beta [B, Hv, T]; state [B, Hv, Dk, Dv].

    Within a chunk the delta updates are solved at once (WY form): with Γ_t = exp(cumsum g),
    (I + strict_lower(β_i k_i·k_j Γ_i/Γ_j)) Δ = βv - βkΓ S_0, then o = qΓ S_0 + (qk^T ∘ Γ_i/Γ_j) Δ and
    S = Γ_C S_0 + (k Γ_C/Γ)^T Δ. Returns (o [B, Hv, T, Dv], final state).
    """
    num_tokens = q.shape[2]
    out = q.new_empty(q.shape[:-1] + (v.shape[-1],))
    for start in range(0, num_tokens, chunk_size):
        end = min(start + chunk_size, num_tokens)
        qc, kc, vc, bc = q[:, :, start:end], k[:, :, start:end], v[:, :, start:end], beta[:, :, start:end]
        log_decay = g[:, :, start:end].cumsum(-1)                  # [B, Hv, n]
        n = end - start
        causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
        pair_decay = (log_decay[..., :, None] - log_decay[..., None, :]).masked_fill(~causal, -math.inf).exp()
        k_beta = kc * bc[..., None]
        system = (k_beta @ kc.transpose(-1, -2)) * pair_decay      # only its strict lower part is read
        rhs = torch.cat((vc * bc[..., None], k_beta * log_decay.exp()[..., None]), dim=-1)
        solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        new_values, decayed_keys = solved[..., :vc.shape[-1]], solved[..., vc.shape[-1]:]
        delta = new_values - decayed_keys @ state
        attn = (qc @ kc.transpose(-1, -2)) * pair_decay
        out[:, :, start:end] = (qc * log_decay.exp()[..., None]) @ state + attn @ delta
        last = log_decay[..., -1:]
        state = state * last.exp()[..., None] + (kc * (last - log_decay).exp()[..., None]).transpose(-1, -2) @ delta
    return out, state


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet linear attention (Qwen3-Next): causal depthwise conv, then the gated delta rule.

    Qwen3-Next layout: ``in_proj_qkvz`` rows grouped per key head as [q, k, v (Hv/Hk heads), z
    (Hv/Hk heads)], ``in_proj_ba`` per key head as [b, a]. ``split_projections`` (Qwen3.5): four
    flat projections ``in_proj_qkv`` [q all, k all, v all], ``in_proj_z``, ``in_proj_b``,
    ``in_proj_a``. The conv runs on channels [q all, k all, v all] either way.
    State: ``conv`` [B, C, K-1] (last conv inputs) and ``recurrent`` [B, Hv, Dk, Dv] (fp32).
    """

    def __init__(self, hidden_size: int, num_k_heads: int, num_v_heads: int, head_k_dim: int,
                 head_v_dim: int, conv_kernel_size: int, norm_eps: float, split_projections: bool = False):
        super().__init__()
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel_size = conv_kernel_size
        self.split_projections = split_projections
        if split_projections:
            self.in_proj_qkv = Linear(hidden_size, self.conv_dim, bias=False)
            self.in_proj_z = Linear(hidden_size, self.value_dim, bias=False)
            self.in_proj_b = Linear(hidden_size, num_v_heads, bias=False)
            self.in_proj_a = Linear(hidden_size, num_v_heads, bias=False)
        else:
            self.in_proj_qkvz = Linear(hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False)
            self.in_proj_ba = Linear(hidden_size, 2 * num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel_size, groups=self.conv_dim,
                                bias=False, padding=conv_kernel_size - 1)
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(num_v_heads))
        self.norm = GatedRMSNorm(head_v_dim, norm_eps)
        self.out_proj = Linear(self.value_dim, hidden_size, bias=False)

    def _conv(self, mixed: torch.Tensor, state) -> torch.Tensor:
        """mixed [B, T, C] -> silu(causal depthwise conv) [B, T, C]; keeps the last K-1 inputs."""
        batch, num_tokens, channels = mixed.shape
        past = state.conv if state is not None and state.conv is not None else \
            mixed.new_zeros(batch, channels, self.conv_kernel_size - 1)
        window = torch.cat((past, mixed.transpose(1, 2)), dim=-1)   # [B, C, K-1+T]
        if state is not None:
            state.conv = window[..., num_tokens:].clone() if num_tokens > 1 else window[..., 1:]
        out = kernels.depthwise_conv(window, self.conv1d.weight)
        return F.silu(out).transpose(1, 2)

    def _project(self, x: torch.Tensor):
        """x -> (conv input [B, T, C] as [q all, k all, v all], z [B, T, Hv*Dv], b, a [B, T, Hv])."""
        batch, num_tokens, _ = x.shape
        if self.split_projections:
            return self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)
        ratio = self.num_v_heads // self.num_k_heads
        dk, dv, nk, nv = self.head_k_dim, self.head_v_dim, self.num_k_heads, self.num_v_heads
        qkvz = self.in_proj_qkvz(x).view(batch, num_tokens, nk, 2 * dk + 2 * ratio * dv)
        q, k, v, z = qkvz.split((dk, dk, ratio * dv, ratio * dv), dim=-1)
        ba = self.in_proj_ba(x).view(batch, num_tokens, nk, 2 * ratio)
        b, a = ba[..., :ratio].reshape(batch, num_tokens, nv), ba[..., ratio:].reshape(batch, num_tokens, nv)
        mixed = torch.cat((q.reshape(batch, num_tokens, -1), k.reshape(batch, num_tokens, -1),
                           v.reshape(batch, num_tokens, -1)), dim=-1)
        return mixed, z, b, a

    def forward(self, x: torch.Tensor, rope=None, state=None) -> torch.Tensor:
        batch, num_tokens, _ = x.shape
        ratio = self.num_v_heads // self.num_k_heads
        dk, dv, nk, nv = self.head_k_dim, self.head_v_dim, self.num_k_heads, self.num_v_heads
        mixed, z, b, a = self._project(x)
        mixed = self._conv(mixed, state)
        compute_dtype = torch.promote_types(x.dtype, torch.float32)   # fp32 at least, fp64 in tests
        q, k, v = mixed.to(compute_dtype).split((self.key_dim, self.key_dim, self.value_dim), dim=-1)
        q = _l2norm(q.reshape(batch, num_tokens, nk, dk)) * dk ** -0.5
        k = _l2norm(k.reshape(batch, num_tokens, nk, dk))
        v = v.reshape(batch, num_tokens, nv, dv)
        if ratio > 1:
            q, k = q.repeat_interleave(ratio, dim=2), k.repeat_interleave(ratio, dim=2)
        beta = b.to(compute_dtype).sigmoid()
        g = -self.A_log.to(compute_dtype).exp() * F.softplus(a.to(compute_dtype) + self.dt_bias.to(compute_dtype))
        recurrent = state.recurrent if state is not None else None
        if recurrent is None:
            recurrent = torch.zeros(batch, nv, dk, dv, dtype=compute_dtype, device=x.device)
        if num_tokens == 1 and state is not None:
            core = recurrent_gated_delta_rule(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], recurrent)
            core = core.unsqueeze(1)                                # [B, 1, Hv, Dv]
        else:
            core, recurrent = kernels.chunked_delta_rule(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), g.transpose(1, 2),
                beta.transpose(1, 2), recurrent, chunked_gated_delta_rule)
            core = core.transpose(1, 2)
        if state is not None:
            state.recurrent = recurrent
        core = self.norm(core.to(x.dtype), z.reshape(batch, num_tokens, nv, dv))
        return self.out_proj(core.reshape(batch, num_tokens, -1))


class MLP(nn.Module):
    """SwiGLU feed-forward: ``down(silu(gate(x)) * up(x))`` (dense layers and shared experts)."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def routed_experts(x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, provider, layer_idx: int,
                   mode: str = "exact", isa: str = "auto", expert_fn=None) -> torch.Tensor:
    """Sum over each token's selected experts of ``weight * down(silu(gate) * up)``.

    x [N, H], weights and indices [N, k]. The provider is asked once for the unique selected ids
    (sorted); the result depends only on the weights it returns, so any provider serving the same
    bytes gives the same bits. Decode is one ``kernels.experts_decode`` call (``mode``: exact or
    fast, see kernels); prefill groups tokens by expert: one gather + ``kernels.expert_mlp`` each.
    """
    num_tokens, top_k = indices.shape
    if num_tokens == 1:
        # One device-to-host transfer (a sync on CUDA) for ids and weights; float64 holds both exactly.
        ids_and_weights = torch.stack((indices[0].to(torch.float64), weights[0].to(torch.float64))).tolist()
        pairs = sorted((int(e), w) for e, w in zip(*ids_and_weights))
        expert_ids = [e for e, _ in pairs]
        experts = provider.acquire(layer_idx, expert_ids)
        try:
            if expert_fn is None:
                out = kernels.experts_decode(x, experts, [w for _, w in pairs], mode, isa)
            else:
                out = torch.zeros_like(x)
                for e, w, (_, weight) in zip(expert_ids, experts, pairs):
                    out.add_(expert_fn(x, w, e, mode, isa), alpha=weight)
        finally:
            provider.release(layer_idx, expert_ids)
        return out
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat)
    all_counts = counts.tolist()                      # one device-to-host transfer
    expert_ids = [e for e, n in enumerate(all_counts) if n]
    counts = [all_counts[e] for e in expert_ids]
    token_of = order // top_k
    weight_of = weights.reshape(-1)[order]
    out = torch.zeros_like(x)
    pos = 0
    # A streaming provider may hold fewer experts at once than a long prefill selects; the
    # experts are then taken in groups, in the same order, so the sum is unchanged.
    group = getattr(provider, "max_experts_per_acquire", None) or len(expert_ids)
    for start in range(0, len(expert_ids), group):
        ids = expert_ids[start:start + group]
        experts = provider.acquire(layer_idx, ids)
        try:
            for e, w, count in zip(ids, experts, counts[start:start + group]):
                rows = token_of[pos:pos + count]
                xs = x.index_select(0, rows)
                y = (kernels.expert_mlp(xs, w) if expert_fn is None else expert_fn(xs, w, e, mode, isa))
                y = y.mul_(weight_of[pos:pos + count, None])
                out.index_add_(0, rows, y)
                pos += count
        finally:
            provider.release(layer_idx, ids)
    return out


class Router(Linear):
    """A router: the linear layer of expert logits (HF keys ``{block}.{name}.weight`` [E, H], and
    ``.bias`` when it has one) plus the rule that picks experts. Subclasses own the rule.

    ``route(x)`` -> (weights [N, k], indices [N, k]) is what the block computes; ``predict(x, n)`` ->
    indices [N, n] ranks experts by the same rule (the first k are exactly ``route``'s), which the
    prefetcher applies to a stale layer input to guess the next layer's experts.
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, bias: bool = False):
        super().__init__(hidden_size, num_experts, bias=bias)
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be in 1..num_experts={num_experts}")
        self.num_experts, self.top_k = num_experts, top_k

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def fp32_logits(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 logits from fp32 inputs, as the sigmoid / grouped rules define them (an encoded
        router: its own kernel)."""
        return F.linear(x.float(), self.weight.float()) if self.qweight is None else self(x).float()

    def selection_scores(self, x: torch.Tensor) -> torch.Tensor:
        """[N, E]: larger = chosen first (experts the rule cannot choose are -inf)."""
        return self(x).float()

    def predict(self, x: torch.Tensor, n: int) -> torch.Tensor:
        scores = self.selection_scores(x)
        return torch.topk(scores, min(n, scores.shape[-1]), dim=-1).indices


class SoftmaxRouter(Router):
    """Softmax over all experts, top-k, optionally renormalised (Qwen3-MoE, Qwen3-Next, Mixtral, OLMoE)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, norm_topk_prob: bool):
        super().__init__(hidden_size, num_experts, top_k)
        self.norm_topk_prob = norm_topk_prob

    def route(self, x):
        probs = F.softmax(self(x), dim=-1, dtype=torch.float32)
        weights, indices = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, indices


class SigmoidGroupRouter(Router):
    """DeepSeek-V3 / GLM-4.5 routing: sigmoid scores; the selection adds ``e_score_correction_bias``
    and keeps only the ``topk_group`` best of ``n_group`` expert groups (a group scores the sum of
    its two best); the weights are the un-biased scores of the chosen experts, renormalised
    (``norm_topk_prob``, +1e-20) and scaled by ``routed_scaling_factor``. All in fp32."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, norm_topk_prob: bool,
                 routed_scaling_factor: float = 1.0, n_group: int = 1, topk_group: int = 1, own_bias: bool = True):
        super().__init__(hidden_size, num_experts, top_k)
        if num_experts % n_group or not 0 < topk_group <= n_group:
            raise ValueError(f"n_group={n_group} must divide num_experts={num_experts} and topk_group={topk_group} "
                             f"be in 1..n_group")
        if own_bias:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts))
        self.norm_topk_prob, self.routed_scaling_factor = norm_topk_prob, routed_scaling_factor
        self.n_group, self.topk_group = n_group, topk_group

    def selection_bias(self) -> torch.Tensor:
        return self.e_score_correction_bias

    def _scores(self, x):
        """(sigmoid scores, selection scores with groups masked) [N, E], fp32."""
        scores = self.fp32_logits(x).sigmoid()
        choice = scores + self.selection_bias().float()
        if self.n_group > 1:
            grouped = choice.view(-1, self.n_group, self.num_experts // self.n_group)
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
            keep = torch.topk(group_scores, self.topk_group, dim=-1).indices
            mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
            choice = choice.masked_fill(~mask.repeat_interleave(self.num_experts // self.n_group, dim=-1),
                                        float("-inf"))
        return scores, choice

    def route(self, x):
        scores, choice = self._scores(x)
        indices = torch.topk(choice, self.top_k, dim=-1).indices
        weights = scores.gather(1, indices)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, indices

    def selection_scores(self, x):
        return self._scores(x)[1]


class SoftmaxGroupRouter(Router):
    """DeepSeek-V2 routing: softmax over all experts (fp32); ``group_limited_greedy`` keeps the
    ``topk_group`` of ``n_group`` groups with the highest single score; the top-k scores, times
    ``routed_scaling_factor``, are the weights (not renormalised)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, routed_scaling_factor: float = 1.0,
                 topk_method: str = "greedy", n_group: int = 1, topk_group: int = 1):
        super().__init__(hidden_size, num_experts, top_k)
        if topk_method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"topk_method {topk_method!r} is not supported (greedy, group_limited_greedy)")
        if topk_method == "group_limited_greedy" and (num_experts % n_group or not 0 < topk_group <= n_group):
            raise ValueError(f"n_group={n_group} must divide num_experts={num_experts} and topk_group={topk_group} "
                             "be in 1..n_group")
        self.routed_scaling_factor, self.topk_method = routed_scaling_factor, topk_method
        self.n_group, self.topk_group = n_group, topk_group

    def selection_scores(self, x):
        scores = self.fp32_logits(x).softmax(dim=-1)
        if self.topk_method == "group_limited_greedy":
            grouped = scores.view(-1, self.n_group, self.num_experts // self.n_group)
            keep = torch.topk(grouped.max(dim=-1).values, self.topk_group, dim=-1).indices
            mask = torch.zeros(grouped.shape[:2], dtype=torch.bool, device=x.device).scatter_(1, keep, True)
            scores = scores.masked_fill(~mask.repeat_interleave(self.num_experts // self.n_group, dim=-1), 0.0)
        return scores

    def route(self, x):
        weights, indices = torch.topk(self.selection_scores(x), self.top_k, dim=-1)
        return weights * self.routed_scaling_factor, indices


class TopKSoftmaxRouter(Router):
    """GPT-OSS routing: logits with a bias, top-k of the logits, softmax over those k only."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int):
        super().__init__(hidden_size, num_experts, top_k, bias=True)

    def route(self, x):
        values, indices = torch.topk(self(x).float(), self.top_k, dim=-1)
        return torch.softmax(values, dim=-1), indices


class SigmoidBiasRouter(SigmoidGroupRouter):
    """AfMoE routing: DeepSeek-V3's rule with one group, always renormalised, scaled by
    ``route_scale``, whose selection bias lives on the block (HF ``mlp.expert_bias``; set by
    ``SparseMoeBlock.add_expert_bias``)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, route_scale: float):
        super().__init__(hidden_size, num_experts, top_k, True, route_scale, own_bias=False)
        self._owner = None              # the block holding expert_bias

    def selection_bias(self) -> torch.Tensor:
        return self._owner.expert_bias


class ClampedSwiGLUExperts(nn.Module):
    """GPT-OSS expert math, with the experts' biases resident (HF ``mlp.experts.gate_up_proj_bias``
    [E, 2I] with gate/up interleaved, ``mlp.experts.down_proj_bias`` [E, H]); the weights come from the
    provider as usual (gate rows first). ``down((up + 1) * g * sigmoid(alpha * g)) + b`` with
    g = min(gate, limit) and up clamped to [-limit, limit]."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate: int, alpha: float, limit: float):
        super().__init__()
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(num_experts, 2 * intermediate))
        self.down_proj_bias = nn.Parameter(torch.zeros(num_experts, hidden_size))
        self.alpha, self.limit, self.intermediate = alpha, limit, intermediate
        self._gate_first_bias = None

    def __call__(self, x: torch.Tensor, expert, expert_id: int, mode: str = "exact", isa: str = "auto") -> torch.Tensor:
        if self._gate_first_bias is None or self._gate_first_bias.device != x.device:
            b = self.gate_up_proj_bias.detach()
            self._gate_first_bias = torch.cat((b[:, 0::2], b[:, 1::2]), dim=1)      # the records' row order
        # (quant_linear: one row in fast mode runs the native GEMV on the record as stored)
        h = kernels.quant_linear(x, expert.gate_up, None, mode, isa, "gate_up") + \
            self._gate_first_bias[expert_id].to(x.dtype)
        gate = h[:, :self.intermediate].clamp(max=self.limit)
        up = h[:, self.intermediate:].clamp(-self.limit, self.limit)
        act = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        return kernels.quant_linear(act, expert.down, None, mode, isa, "down") + self.down_proj_bias[expert_id].to(x.dtype)


class SparseMoeBlock(nn.Module):
    """Routed experts served by a provider, chosen by ``router`` (HF attribute ``router_name``), plus
    an optional shared expert: sigmoid-gated (Qwen3-Next: ``shared_expert`` + ``shared_expert_gate``)
    or plain (``shared_experts``, DeepSeek / GLM style, when ``shared_gated`` is False)."""

    # Routed-expert math (kernels.experts_decode): "fast" or "exact", and the native ISA to use.
    # Class-level defaults; CausalLM.set_expert_kernels sets them per block.
    expert_kernels = "fast"
    kernel_isa = "auto"

    def __init__(self, router: Router, layer_idx: int, hidden_size: int, shared_intermediate_size: int = 0,
                 router_name: str = "gate", shared_gated: bool = True):
        super().__init__()
        self.layer_idx = layer_idx
        if "." in router_name:          # nested in a container (AfMoE: mlp.router.gate)
            outer, inner = router_name.split(".")
            container = nn.Module()
            setattr(container, inner, router)
            setattr(self, outer, container)
        else:
            setattr(self, router_name, router)
        if router_name != "router":
            # An unregistered alias (instance attributes win over registered submodules): no duplicate keys.
            object.__setattr__(self, "router", router)
        self.shared_expert = self.shared_expert_gate = None
        if shared_intermediate_size and shared_gated:
            self.shared_expert = MLP(hidden_size, shared_intermediate_size)
            self.shared_expert_gate = Linear(hidden_size, 1, bias=False)
        elif shared_intermediate_size:
            self.shared_experts = MLP(hidden_size, shared_intermediate_size)
            object.__setattr__(self, "shared_expert", self.shared_experts)
        self.provider = None    # set by the model; not a submodule, owns no weights
        self.expert_fn = None   # a family's own expert math (e.g. ClampedSwiGLUExperts); None: SwiGLU

    def set_expert_fn(self, module: nn.Module, name: str = "experts") -> None:
        """Use ``module(x, expert, expert_id)`` for the routed experts (registered as ``name``, so its
        resident tensors, e.g. expert biases, have the checkpoint's keys)."""
        setattr(self, name, module)
        object.__setattr__(self, "expert_fn", module)      # an alias, not a second registration

    def add_expert_bias(self) -> None:
        """A selection-only router bias on the block (AfMoE: ``mlp.expert_bias`` [E], fp32)."""
        self.expert_bias = nn.Parameter(torch.zeros(self.router.num_experts))
        object.__setattr__(self.router, "_owner", self)

    @property
    def top_k(self) -> int:
        return self.router.top_k

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.router.route(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        self.provider.layer_input(self.layer_idx, flat)
        weights, indices = self.router.route(flat)
        out = routed_experts(flat, weights.to(x.dtype), indices, self.provider, self.layer_idx,
                             self.expert_kernels, self.kernel_isa, self.expert_fn)
        if self.shared_expert is not None:
            shared = self.shared_expert(flat)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(flat)) * shared
            out = out + shared
        return out.view(shape)
