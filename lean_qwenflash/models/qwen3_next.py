"""Qwen3-Next: Gated DeltaNet layers with a gated full-attention layer every few layers, zero-centred
RMSNorms, partial rotary, many small routed experts plus a sigmoid-gated shared expert."""
from __future__ import annotations

from lean_qwenflash.models.base import (CausalLM, DecoderLayer, attention_head_dim, config_value,
                                        rotary_from_config)
from lean_qwenflash.models.layers import MLP, Attention, GatedDeltaNet, RMSNorm, SparseMoeBlock
from lean_qwenflash.store.naming import expert_dims, moe_layer_indices


def layer_types(config: dict) -> list[str]:
    """``layer_types`` when the config has it, else full attention every ``full_attention_interval``."""
    num_layers = int(config_value(config, "num_hidden_layers"))
    types = config.get("layer_types")
    if types is None:
        interval = int(config.get("full_attention_interval", 4))
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(num_layers)]
    if len(types) != num_layers or set(types) - {"full_attention", "linear_attention"}:
        raise ValueError(f"config layer_types {types!r} must list 'full_attention'/'linear_attention' "
                         f"for each of the {num_layers} layers")
    return list(types)


def build(config: dict) -> CausalLM:
    hidden = int(config_value(config, "hidden_size"))
    eps = float(config.get("rms_norm_eps", 1e-6))
    head_dim = attention_head_dim(config)
    types = layer_types(config)
    moe_layers = set(moe_layer_indices(config))
    num_experts, top_k = expert_dims(config)[:2]
    layers = []
    for layer_idx, kind in enumerate(types):
        if kind == "linear_attention":
            mixer_name = "linear_attn"
            mixer = GatedDeltaNet(hidden, int(config_value(config, "linear_num_key_heads")),
                                  int(config_value(config, "linear_num_value_heads")),
                                  int(config_value(config, "linear_key_head_dim")),
                                  int(config_value(config, "linear_value_head_dim")),
                                  int(config.get("linear_conv_kernel_dim", 4)), eps)
        else:
            mixer_name = "self_attn"
            mixer = Attention(hidden, int(config_value(config, "num_attention_heads")),
                              int(config_value(config, "num_key_value_heads")), head_dim, norm_eps=eps,
                              bias=bool(config.get("attention_bias", False)), qk_norm="head",
                              zero_centred_norm=True, output_gate=True)
        if layer_idx in moe_layers:
            mlp = SparseMoeBlock(hidden, num_experts, top_k, bool(config.get("norm_topk_prob", True)), layer_idx,
                                 int(config.get("shared_expert_intermediate_size", 0)))
        else:
            mlp = MLP(hidden, int(config_value(config, "intermediate_size")))
        layers.append(DecoderLayer(mixer_name, mixer, "mlp", mlp, RMSNorm(hidden, eps, zero_centred=True),
                                   RMSNorm(hidden, eps, zero_centred=True)))
    rotary = rotary_from_config(config, head_dim, default_partial=0.25) if "full_attention" in types else None
    return CausalLM(config, layers, types, RMSNorm(hidden, eps, zero_centred=True), rotary)
