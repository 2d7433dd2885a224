"""The plain attention + sparse-MoE decoder that Qwen3-MoE, Mixtral and OLMoE share; the family
files (``lean_qwenflash/families/``) only say how they differ (q/k norms, router normalisation,
HF module names)."""
from __future__ import annotations

from typing import Optional

from lean_qwenflash.models.base import CausalLM, DecoderLayer, attention_head_dim, rotary_from_config
from lean_qwenflash.models.layers import MLP, Attention, RMSNorm, SoftmaxRouter, SparseMoeBlock


def build_moe_transformer(config: dict, r, facts, moe_module: str, *, qk_norm: Optional[str], norm_topk_prob: bool,
                          clip_qkv: Optional[float] = None) -> CausalLM:
    """``r``: the family's ``ConfigReader``; ``facts``: its ``MoEFacts`` (sparse layers, expert
    sizes); ``moe_module``: the HF name of the sparse block."""
    hidden = facts.hidden_size
    eps = r.get("rms_norm_eps", float, 1e-6)
    head_dim = attention_head_dim(config)
    # Mixtral: a window on every layer when sliding_window is set; Qwen3-MoE: when use_sliding_window.
    # A window that covers the whole context changes nothing: plain causal attention then.
    window = r.get("sliding_window", int, None) if r.get("use_sliding_window", bool, True) else None
    if window and window >= r.get("max_position_embeddings", int, 0):
        window = None
    moe_layers = set(facts.moe_layers)
    layers = []
    for layer_idx in range(facts.num_layers):
        attn = Attention(hidden, r.positive("num_attention_heads"), r.positive("num_key_value_heads"), head_dim,
                         norm_eps=eps, bias=r.get("attention_bias", bool, False), qk_norm=qk_norm, clip_qkv=clip_qkv,
                         sliding_window=window)
        if layer_idx in moe_layers:
            mlp = SparseMoeBlock(SoftmaxRouter(hidden, facts.num_experts, facts.top_k, norm_topk_prob), layer_idx, hidden)
        else:
            mlp = MLP(hidden, r.positive("intermediate_size"))
        layers.append(DecoderLayer("self_attn", attn, moe_module if layer_idx in moe_layers else "mlp", mlp,
                                   RMSNorm(hidden, eps), RMSNorm(hidden, eps)))
    types = ["sliding_attention" if window else "full_attention"] * facts.num_layers
    return CausalLM(config, layers, types, RMSNorm(hidden, eps), rotary_from_config(config, head_dim))
