"""Multi-head latent attention (DeepSeek-V2/V3): a compressed KV cache, attention on the latent."""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from lean_qwenflash.models.layers.attention import causal_mask
from lean_qwenflash.models.layers.linear import Linear
from lean_qwenflash.models.layers.norm import RMSNorm
from lean_qwenflash.models.layers.rope import apply_rotary


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
