"""The plain attention + sparse-MoE decoder that Qwen3-MoE, Mixtral and OLMoE share; the family
files (``lean_qwenflash/families/``) only say how they differ (q/k norms, attention variant, router
normalisation, HF module names)."""
from __future__ import annotations

from functools import partial
from typing import Callable

from lean_qwenflash.models.base import CausalLM, DecoderLayer
from lean_qwenflash.models.layers.attention import Attention
from lean_qwenflash.models.layers.mlp import MLP
from lean_qwenflash.models.layers.norm import RMSNorm
from lean_qwenflash.models.layers.rope import Rotary, attention_head_dim, rope_config
from lean_qwenflash.models.moe.block import SparseMoeBlock
from lean_qwenflash.models.moe.routers import SoftmaxRouter


def build_moe_transformer(r, facts, moe_module: str, *, qk_norm: bool, norm_topk_prob: bool,
                          attention: Callable[..., Attention] = Attention, **attention_options) -> CausalLM:
    """``r``: the family's ``ConfigReader``; ``facts``: its ``MoEFacts`` (sparse layers, expert
    sizes); ``moe_module``: the HF name of the sparse block; ``qk_norm``: q/k RMSNorms (per head,
    unless the ``attention`` variant places them otherwise); ``attention_options``: the variant's own."""
    hidden = facts.hidden_size
    eps = r.get("rms_norm_eps", float, 1e-6)
    head_dim = attention_head_dim(r)
    # Mixtral: a window on every layer when sliding_window is set; Qwen3-MoE: when use_sliding_window.
    # A window that covers the whole context changes nothing: plain causal attention then.
    window = r.get("sliding_window", int, None) if r.get("use_sliding_window", bool, True) else None
    if window and window >= r.get("max_position_embeddings", int, 0):
        window = None
    moe_layers = set(facts.moe_layers)
    layers = []
    for layer_idx in range(facts.num_layers):
        attn = attention(hidden, r.positive("num_attention_heads"), r.positive("num_key_value_heads"), head_dim,
                         bias=r.get("attention_bias", bool, False), qk_norm=partial(RMSNorm, eps=eps) if qk_norm else None,
                         sliding_window=window, **attention_options)
        if layer_idx in moe_layers:
            mlp = SparseMoeBlock(SoftmaxRouter(hidden, facts.num_experts, facts.top_k, norm_topk_prob), layer_idx, hidden)
        else:
            mlp = MLP(hidden, r.positive("intermediate_size"))
        layers.append(DecoderLayer("self_attn", attn, moe_module if layer_idx in moe_layers else "mlp", mlp,
                                   RMSNorm(hidden, eps), RMSNorm(hidden, eps)))
    types = ["sliding_attention" if window else "full_attention"] * facts.num_layers
    return CausalLM(r.config, layers, types, RMSNorm(hidden, eps), Rotary(head_dim, rope_config(r)))
