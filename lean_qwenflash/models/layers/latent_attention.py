"""Multi-head latent attention (DeepSeek-V2/V3): a compressed KV cache, attention on the latent."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from lean_qwenflash.models import native
from lean_qwenflash.models.layers.attention import EXACT_MAX_KEYS, blocked_attention, causal_mask, kv_codec, native_decode_ok
from lean_qwenflash.models.layers.linear import Linear
from lean_qwenflash.models.layers.norm import RMSNorm
from lean_qwenflash.models.layers.rope import apply_rotary
from lean_qwenflash.models.policy import STANDALONE


class LatentAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2/V3). The cache holds, per token, only the compressed
    latent ``c`` (``kv_lora_rank`` values, after ``kv_a_layernorm``) and the roped key part shared by
    all heads (``qk_rope_head_dim``): a ``KVCache`` whose "keys" are c [B, 1, L, r] and "values" the
    rope keys [B, 1, L, dr].

    Attention runs on the latent directly ("absorbed"): ``kv_b_proj``'s key rows fold into the query
    (q_nope·W_k), its value rows apply after the softmax — equal in exact arithmetic to expanding
    every cached token's keys and values, without the per-step expansion of the whole cache.
    The cache stores the latent and the rope key in the policy's ``kv_cache_dtype`` and attention
    reads it as ``layers.attention`` does (SDPA in exact mode with an f32 cache up to
    ``EXACT_MAX_KEYS`` keys; otherwise blocks with an online softmax, natively for one-token CPU steps).
    ``interleaved_rope``: the checkpoint's rope dims are (x0, x1) pairs; they are regrouped to the
    rotate-half layout first (an identical permutation of q and k leaves the scores unchanged).
    """

    ctx = STANDALONE     # the model's ExecContext (CausalLM binds it)

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
        q_latent, q_rope, latent, k_rope = self._project(x)
        cos, sin = rope
        q_rope, k_rope = apply_rotary(q_rope, cos, sin), apply_rotary(k_rope, cos, sin)
        return self._output(self.attend(q_latent, q_rope, latent, k_rope, state).to(q_latent.dtype))

    def forward_rows(self, x: torch.Tensor, ropes: list, states: list) -> torch.Tensor:
        """One token of each of B sequences (x [B, 1, H]): the projections, the value absorption
        and o_proj for all rows at once; rope and attention per sequence on its own cache."""
        q_latent, q_rope, latent, k_rope = self._project(x)
        outs = []
        for b, state in enumerate(states):
            cos, sin = ropes[b]
            qr, kr = apply_rotary(q_rope[b:b + 1], cos, sin), apply_rotary(k_rope[b:b + 1], cos, sin)
            outs.append(self.attend(q_latent[b:b + 1], qr, latent[b:b + 1], kr, state).to(q_latent.dtype))
        return self._output(torch.cat(outs))

    def _project(self, x: torch.Tensor):
        """x [B, T, H] -> (q absorbed into the latent space [B, H, T, r], q's rope part [B, H, T, dr],
        the normalised latent [B, 1, T, r], the rope key [B, 1, T, dr]); rope parts not yet rotated."""
        batch, num_tokens, _ = x.shape
        q = self.q_proj(x) if self.q_proj is not None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(batch, num_tokens, self.num_heads, self.q_dim).transpose(1, 2)
        q_nope, q_rope = q.split((self.nope, self.rope_dim), dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split((self.kv_lora_rank, self.rope_dim), dim=-1)
        latent = self.kv_a_layernorm(latent).unsqueeze(1)                  # [B, 1, T, r]
        k_rope = k_rope.view(batch, 1, num_tokens, self.rope_dim)
        if self.kv_b_proj.qweight is not None:
            raise NotImplementedError("a block-quantized kv_b_proj is not supported (keep it float)")
        w_k = self._kv_b()[:, :self.nope]
        q_latent = torch.einsum("bhtd,hdr->bhtr", q_nope, w_k)
        return q_latent, self._regroup(q_rope), latent, self._regroup(k_rope)

    def _kv_b(self) -> torch.Tensor:
        return self.kv_b_proj.weight.view(self.num_heads, self.nope + self.v_dim, self.kv_lora_rank)

    def _output(self, out: torch.Tensor) -> torch.Tensor:
        """Attention output in the latent space [B, H, T, r] -> values (absorbed w_v) -> o_proj."""
        batch, _, num_tokens, _ = out.shape
        w_v = self._kv_b()[:, self.nope:]
        return self.o_proj(torch.einsum("bhtr,hvr->bthv", out, w_v).reshape(batch, num_tokens, -1))

    def attend(self, q_latent, q_rope, latent, k_rope, state) -> torch.Tensor:
        """Absorbed attention: scores q_latent . c + q_rope . k_rope, values c -> [B, H, T, r]."""
        policy = self.ctx.policy
        codec = kv_codec(policy.kv_cache_dtype)
        num_tokens = q_latent.shape[2]
        past = 0 if state is None else state.num_tokens
        first_chunk = num_tokens > 1 and past == 0       # (fast mode too: SDPA's fused causal kernel, as Attention)
        if codec.name == "f32" and (policy.kernel_mode == "exact" or first_chunk) and past + num_tokens <= EXACT_MAX_KEYS:
            if state is not None:
                latent, k_rope = state.append(latent, k_rope)              # [B, 1, L, r], [B, 1, L, dr]
            query = torch.cat((q_latent, q_rope), dim=-1)
            key = torch.cat((latent, k_rope), dim=-1)
            mask, causal = causal_mask(num_tokens, key.shape[2], query.device)
            return F.scaled_dot_product_attention(query, key, latent, attn_mask=mask, is_causal=causal,
                                                  scale=self.scaling, enable_gqa=True)
        latent, k_rope = codec.encode(latent), codec.encode(k_rope)
        if state is not None:
            latent, k_rope = state.append(latent, k_rope)
        r, dr = self.kv_lora_rank, self.rope_dim
        if native_decode_ok(q_latent, latent, k_rope):
            q = torch.cat((q_latent, q_rope), dim=-1)[0, :, 0].float().contiguous()
            lid, rid = codec.native_id(latent), codec.native_id(k_rope)
            out = native.attention_decode(q, [(latent[0], lid, r), (k_rope[0], rid, dr)], (latent[0], lid, r),
                                          latent.shape[2], self.scaling, None, policy.isa, policy.native_threads)
            return out.view(1, self.num_heads, 1, r)
        return blocked_attention([q_latent, q_rope], [(latent, r), (k_rope, dr)], 0, codec, scale=self.scaling,
                                 query_start=past)
