"""GPT-OSS (GptOssForCausalLM): GQA with biased projections and per-head attention sinks,
alternating sliding-window / full attention (``layer_types``; a window layer's cache holds only
the last ``sliding_window`` tokens), YaRN rope, every layer sparse: router logits with a bias, top-k,
softmax over the k; experts with biases and a clamped SwiGLU, stored stacked and transposed with
gate/up columns interleaved (``mlp.experts.gate_up_proj`` [E, H, 2I], ``down_proj`` [E, I, H]).

The expert biases stay resident; the expert math runs in torch (the native fused kernels compute
the plain SwiGLU only), so GPT-OSS does not get the native expert kernels yet.
"""
from __future__ import annotations

from lean_qwenflash.families.base import ConfigReader, ExpertLayout, Family, MoEFacts, dense_prefix_facts, periodic_layer_types


def facts(r: ConfigReader) -> MoEFacts:
    return dense_prefix_facts(r, r.positive("num_local_experts", aliases=("num_experts",)),
                              intermediate_key="intermediate_size", top_k_aliases=("experts_per_token",))


def build(config: dict):
    """GPT-OSS's oddities are their own classes: ``SinkAttention`` (per-head sinks),
    ``TopKSoftmaxRouter`` and ``ClampedSwiGLUExperts`` (the biased, clamped expert math)."""
    from lean_qwenflash.models.base import CausalLM, DecoderLayer
    from lean_qwenflash.models.layers.attention import SinkAttention
    from lean_qwenflash.models.layers.norm import RMSNorm
    from lean_qwenflash.models.layers.rope import Rotary, attention_head_dim, rope_config
    from lean_qwenflash.models.moe.block import SparseMoeBlock
    from lean_qwenflash.models.moe.experts import ClampedSwiGLUExperts
    from lean_qwenflash.models.moe.routers import TopKSoftmaxRouter

    r = FAMILY.reader(config)
    f = facts(r)
    hidden = f.hidden_size
    eps = r.get("rms_norm_eps", float, 1e-5)
    head_dim = attention_head_dim(r)
    types = periodic_layer_types(r, "sliding_attention", 2)
    window = r.positive("sliding_window") if "sliding_attention" in types else None
    layers = []
    for i, kind in enumerate(types):
        attn = SinkAttention(hidden, r.positive("num_attention_heads"), r.positive("num_key_value_heads"), head_dim,
                             bias=r.get("attention_bias", bool, True),
                             sliding_window=window if kind == "sliding_attention" else None)
        experts = ClampedSwiGLUExperts(f.num_experts, hidden, f.expert_intermediate,
                                       r.get("swiglu_alpha", float, 1.702), r.get("swiglu_limit", float, 7.0))
        block = SparseMoeBlock(TopKSoftmaxRouter(hidden, f.num_experts, f.top_k), i, hidden, router_name="router",
                               experts=experts)
        layers.append(DecoderLayer("self_attn", attn, "mlp", block, RMSNorm(hidden, eps), RMSNorm(hidden, eps)))
    return CausalLM(r.config, layers, types, RMSNorm(hidden, eps), Rotary(head_dim, rope_config(r)))


FAMILY = Family(name="gpt_oss", architectures=("GptOssForCausalLM",), model_types=("gpt_oss",),
                layout=ExpertLayout(stacked_transposed=True, gate_up_interleaved=True,
                                    resident_suffixes=("gate_up_proj_bias", "down_proj_bias")),
                facts_fn=facts, build_fn=build)
