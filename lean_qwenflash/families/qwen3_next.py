"""Qwen3-Next (Qwen3NextForCausalLM): Gated DeltaNet layers with a gated full-attention layer every
few layers, zero-centred RMSNorms, partial rotary, many small routed experts (softmax top-k) plus a
sigmoid-gated shared expert. The checkpoint's multi-token-prediction head (``mtp.*``) is not used."""
from __future__ import annotations

from lean_qwenflash.families.base import ConfigReader, ExpertLayout, Family, MoEFacts, periodic_layer_types, sparse_layers
from lean_qwenflash.models.base import CausalLM, DecoderLayer, attention_head_dim, rotary_from_config
from lean_qwenflash.models.layers import MLP, Attention, GatedDeltaNet, RMSNorm, SoftmaxRouter, SparseMoeBlock


def layer_types(config: dict) -> list[str]:
    """``layer_types`` when the config has it, else full attention every ``full_attention_interval``."""
    r = ConfigReader(config, (config.get("architectures") or ["Qwen3NextForCausalLM"])[0])
    return periodic_layer_types(r, "linear_attention", r.positive("full_attention_interval", 4))


def facts(r: ConfigReader) -> MoEFacts:
    experts = r.get("num_experts", int, 0, aliases=("num_local_experts",))
    return MoEFacts(r.positive("num_hidden_layers"), sparse_layers(r, experts), experts,
                    r.positive("num_experts_per_tok") if experts else 0, r.positive("hidden_size"),
                    r.positive("moe_intermediate_size") if experts else 0)


def build_hybrid(config: dict, deltanet_kw: dict = None) -> CausalLM:
    """The Qwen3-Next layer stack (also Qwen3.5-MoE's text model)."""
    r = ConfigReader(config, (config.get("architectures") or ["Qwen3NextForCausalLM"])[0])
    f = facts(r)
    hidden = f.hidden_size
    eps = r.get("rms_norm_eps", float, 1e-6)
    head_dim = attention_head_dim(config)
    types = layer_types(config)
    moe_layers = set(f.moe_layers)
    layers = []
    for layer_idx, kind in enumerate(types):
        if kind == "linear_attention":
            mixer_name = "linear_attn"
            mixer = GatedDeltaNet(hidden, r.positive("linear_num_key_heads"), r.positive("linear_num_value_heads"),
                                  r.positive("linear_key_head_dim"), r.positive("linear_value_head_dim"),
                                  r.positive("linear_conv_kernel_dim", 4), eps, **(deltanet_kw or {}))
        else:
            mixer_name = "self_attn"
            mixer = Attention(hidden, r.positive("num_attention_heads"), r.positive("num_key_value_heads"), head_dim,
                              norm_eps=eps, bias=r.get("attention_bias", bool, False), qk_norm="head",
                              zero_centred_norm=True, output_gate=True)
        if layer_idx in moe_layers:
            router = SoftmaxRouter(hidden, f.num_experts, f.top_k, r.get("norm_topk_prob", bool, True))
            mlp = SparseMoeBlock(router, layer_idx, hidden, r.get("shared_expert_intermediate_size", int, 0))
        else:
            mlp = MLP(hidden, r.positive("intermediate_size"))
        layers.append(DecoderLayer(mixer_name, mixer, "mlp", mlp, RMSNorm(hidden, eps, zero_centred=True),
                                   RMSNorm(hidden, eps, zero_centred=True)))
    rotary = rotary_from_config(config, head_dim, default_partial=0.25) if "full_attention" in types else None
    return CausalLM(config, layers, types, RMSNorm(hidden, eps, zero_centred=True), rotary)


FAMILY = Family(
    name="qwen3_next", architectures=("Qwen3NextForCausalLM",), model_types=("qwen3_next",),
    layout=ExpertLayout(ignored_prefixes=("mtp.",)), facts_fn=facts, build_fn=build_hybrid)
