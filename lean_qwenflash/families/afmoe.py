"""Arcee Trinity / AfMoE (AfmoeForCausalLM), as transformers implements it:

- attention: GQA with per-head q/k RMSNorm before the rope, a sigmoid output gate from its own
  ``gate_proj``, sliding-window layers (rope, window ``sliding_window``) and every
  ``global_attn_every_n_layers``-th layer full attention *without* rope (``layer_types``);
- sandwich norms: RMSNorms before and after both the attention and the MLP branch;
- the first ``num_dense_layers`` layers dense, then sparse layers: sigmoid router
  (``mlp.router.gate``) whose selection adds ``mlp.expert_bias``, weights renormalised (+1e-20) times
  ``route_scale``; ungated shared experts (``num_shared_experts`` x ``moe_intermediate_size``);
- muP input scaling (embeddings x sqrt(hidden_size)) when ``mup_enabled``.
"""
from __future__ import annotations

from lean_qwenflash.families.base import ConfigReader, ExpertLayout, Family, MoEFacts, dense_prefix_facts, periodic_layer_types
from lean_qwenflash.families.gguf import ATTENTION, COMMON_KEYS, GATING_SIGMOID, SHARED_EXPERTS, GGUFArch


def facts(r: ConfigReader) -> MoEFacts:
    return dense_prefix_facts(r, r.positive("num_experts"), r.get("num_dense_layers", int, 1))


def build(config: dict):
    """AfMoE's oddities are their own classes: ``GateProjAttention`` (the output gate's own
    projection), ``ExpertBiasMoeBlock`` with ``SigmoidBiasRouter`` (the block's expert bias) and
    ``SandwichDecoderLayer``."""
    from functools import partial

    from lean_qwenflash.models.base import CausalLM, SandwichDecoderLayer
    from lean_qwenflash.models.layers.attention import GateProjAttention
    from lean_qwenflash.models.layers.mlp import MLP
    from lean_qwenflash.models.layers.norm import RMSNorm
    from lean_qwenflash.models.layers.rope import Rotary, attention_head_dim, rope_config
    from lean_qwenflash.models.moe.block import ExpertBiasMoeBlock
    from lean_qwenflash.models.moe.routers import SigmoidBiasRouter

    r = FAMILY.reader(config)
    f = facts(r)
    hidden = f.hidden_size
    eps = r.get("rms_norm_eps", float, 1e-5)
    head_dim = attention_head_dim(r)
    types = periodic_layer_types(r, "sliding_attention", r.positive("global_attn_every_n_layers", 4))
    window = r.positive("sliding_window") if "sliding_attention" in types else None
    heads = r.positive("num_attention_heads")
    sparse = set(f.moe_layers)
    shared = f.expert_intermediate * r.get("num_shared_experts", int, 0)
    layers = []
    for i, kind in enumerate(types):
        local = kind == "sliding_attention"
        attn = GateProjAttention(hidden, heads, r.get("num_key_value_heads", int, heads), head_dim,
                                 bias=r.get("attention_bias", bool, False), qk_norm=partial(RMSNorm, eps=eps),
                                 sliding_window=window if local else None, use_rope=local)
        if i in sparse:
            router = SigmoidBiasRouter(hidden, f.num_experts, f.top_k, r.get("route_scale", float, 1.0))
            mlp = ExpertBiasMoeBlock(router, i, hidden, shared, router_name="router.gate", shared_gated=False)
        else:
            mlp = MLP(hidden, r.positive("intermediate_size"))
        layers.append(SandwichDecoderLayer("self_attn", attn, "mlp", mlp, [RMSNorm(hidden, eps) for _ in range(4)]))
    model = CausalLM(r.config, layers, types, RMSNorm(hidden, eps), Rotary(head_dim, rope_config(r)))
    if r.get("mup_enabled", bool, False):
        model.embed_scale = hidden ** 0.5
    return model


# -- GGUF (llama.cpp's "afmoe") ----------------------------------------------------------------------
# llama.cpp's afmoe graph fixes what the HF config may vary: three sliding-window layers (with rope)
# then one full-attention layer (without rope), i.e. global_attn_every_n_layers 4, and the muP input
# scaling always on. Sandwich norms: attn_norm / post_attention_norm around attention, ffn_norm /
# post_ffw_norm around the MLP; the output gate's projection is attn_gate, the selection bias
# exp_probs_b.bias.

_EVERY = 4     # llama.cpp's sliding-window pattern for afmoe


def _gguf_config(meta, tensors) -> dict:
    return {"global_attn_every_n_layers": _EVERY, "mup_enabled": True,
            "sliding_window": int(meta("attention.sliding_window"))}


def _gguf_metadata(config: dict) -> dict:
    r = FAMILY.reader(config)
    types = periodic_layer_types(r, "sliding_attention", r.positive("global_attn_every_n_layers", 4))
    want = ["full_attention" if (i + 1) % _EVERY == 0 else "sliding_attention" for i in range(len(types))]
    if types != want:
        raise ValueError(f"afmoe: llama.cpp runs full attention (no rope) on every {_EVERY}th layer and sliding-window "
                         f"attention elsewhere; this config's layer types are {types}")
    if not r.get("mup_enabled", bool, False):
        raise ValueError("afmoe: llama.cpp always scales the embeddings by sqrt(hidden_size) (muP); this config has "
                         "mup_enabled false")
    return {"expert_gating_func": GATING_SIGMOID, "expert_weights_norm": True,
            "expert_weights_scale": r.get("route_scale", float, 1.0),
            "leading_dense_block_count": r.get("num_dense_layers", int, 1),
            "expert_shared_count": r.get("num_shared_experts", int, 0),
            "attention.sliding_window": r.positive("sliding_window")}


GGUF = GGUFArch(
    "afmoe",
    {**{k: v for k, v in ATTENTION.items() if k not in ("post_attention_layernorm.weight", "mlp.gate.weight")},
     "post_attention_layernorm.weight": "post_attention_norm.weight",
     "pre_mlp_layernorm.weight": "ffn_norm.weight",
     "post_mlp_layernorm.weight": "post_ffw_norm.weight",
     "self_attn.gate_proj.weight": "attn_gate.weight",
     "mlp.router.gate.weight": "ffn_gate_inp.weight",
     "mlp.expert_bias": "exp_probs_b.bias",
     **SHARED_EXPERTS},
    config_keys={**COMMON_KEYS, "num_dense_layers": "leading_dense_block_count",
                 "num_shared_experts": "expert_shared_count", "route_scale": "expert_weights_scale"},
    extra_config=_gguf_config, extra_metadata=_gguf_metadata)


FAMILY = Family(name="afmoe", architectures=("AfmoeForCausalLM",), model_types=("afmoe",),
                layout=ExpertLayout(), facts_fn=facts, build_fn=build, gguf=GGUF)
