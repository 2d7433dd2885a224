"""The plain attention + sparse-MoE decoder that Qwen3-MoE, Mixtral and OLMoE share; the family
files (``lean_qwenflash/families/``) only say how they differ (q/k norms, router normalisation,
HF module names)."""
from __future__ import annotations

from typing import Optional

from lean_qwenflash.models.base import (CausalLM, DecoderLayer, attention_head_dim, config_value,
                                        rotary_from_config)
from lean_qwenflash.models.layers import MLP, Attention, RMSNorm, SoftmaxRouter, SparseMoeBlock


def build_moe_transformer(config: dict, facts, moe_module: str, *, qk_norm: Optional[str], norm_topk_prob: bool,
                          clip_qkv: Optional[float] = None) -> CausalLM:
    """``facts``: the family's ``MoEFacts`` (sparse layers, expert sizes); ``moe_module``: the HF
    name of the sparse block."""
    hidden = facts.hidden_size
    eps = float(config.get("rms_norm_eps", 1e-6))
    head_dim = attention_head_dim(config)
    # Mixtral: a window on every layer when sliding_window is set; Qwen3-MoE: when use_sliding_window.
    window = config.get("sliding_window") if config.get("use_sliding_window", True) else None
    window = int(window) if window else None
    moe_layers = set(facts.moe_layers)
    layers = []
    for layer_idx in range(facts.num_layers):
        attn = Attention(hidden, int(config_value(config, "num_attention_heads")),
                         int(config_value(config, "num_key_value_heads")), head_dim, norm_eps=eps,
                         bias=bool(config.get("attention_bias", False)), qk_norm=qk_norm, clip_qkv=clip_qkv,
                         sliding_window=window)
        if layer_idx in moe_layers:
            mlp = SparseMoeBlock(SoftmaxRouter(hidden, facts.num_experts, facts.top_k, norm_topk_prob), layer_idx, hidden)
        else:
            mlp = MLP(hidden, int(config_value(config, "intermediate_size")))
        layers.append(DecoderLayer("self_attn", attn, moe_module if layer_idx in moe_layers else "mlp", mlp,
                                   RMSNorm(hidden, eps), RMSNorm(hidden, eps)))
    types = ["sliding_attention" if window else "full_attention"] * facts.num_layers
    model = CausalLM(config, layers, types, RMSNorm(hidden, eps), rotary_from_config(config, head_dim))
    model.sliding_window = window
    return model
