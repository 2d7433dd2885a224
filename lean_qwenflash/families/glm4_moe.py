"""GLM-4.5 / 4.6 MoE (Glm4MoeForCausalLM): GQA with biased q/k/v (``attention_bias``) and an
unbiased o_proj, optional per-head q/k RMSNorm (``use_qk_norm``), partial rotary (half of each
head by default, rotate-half), the first ``first_k_dense_replace`` layers dense, then sparse layers
with DeepSeek-V3's routing (sigmoid, correction bias, group-limited top-k, scaling) and ungated
``shared_experts``. Multi-token-prediction layers (``model.layers.{num_hidden_layers}.*``) are
skipped."""
from __future__ import annotations

from lean_qwenflash.families.base import ConfigReader, ExpertLayout, Family, MoEFacts, dense_prefix_facts
from lean_qwenflash.families.gguf import (ATTENTION, COMMON_KEYS, GATING_SIGMOID, SHARED_EXPERTS, GGUFArch, head_dim,
                                          rope_partial)


def facts(r: ConfigReader) -> MoEFacts:
    return dense_prefix_facts(r, r.positive("n_routed_experts", aliases=("num_local_experts", "num_experts")),
                              r.get("first_k_dense_replace", int, 1))


def grouped_router(r: ConfigReader, f: MoEFacts):
    """The DeepSeek-V3 rule's router (a ``SigmoidGroupRouter``) from its config keys (GLM-4.5 and
    DeepSeek-V3 share them)."""
    from lean_qwenflash.models.moe.routers import SigmoidGroupRouter

    return SigmoidGroupRouter(f.hidden_size, f.num_experts, f.top_k, r.get("norm_topk_prob", bool, True),
                              r.get("routed_scaling_factor", float, 1.0), r.positive("n_group", 1),
                              r.positive("topk_group", 1))


def build(config: dict):
    from functools import partial

    from lean_qwenflash.models.base import CausalLM, DecoderLayer
    from lean_qwenflash.models.layers.attention import Attention
    from lean_qwenflash.models.layers.mlp import MLP
    from lean_qwenflash.models.layers.norm import RMSNorm
    from lean_qwenflash.models.layers.rope import Rotary, attention_head_dim, rope_config
    from lean_qwenflash.models.moe.block import SparseMoeBlock

    r = FAMILY.reader(config)
    f = facts(r)
    hidden = f.hidden_size
    eps = r.get("rms_norm_eps", float, 1e-5)
    head_dim = attention_head_dim(r)
    sparse = set(f.moe_layers)
    shared = f.expert_intermediate * r.get("n_shared_experts", int, 1)
    layers = []
    for i in range(f.num_layers):
        attn = Attention(hidden, r.positive("num_attention_heads"), r.positive("num_key_value_heads"), head_dim,
                         bias=r.get("attention_bias", bool, False), o_bias=False,
                         qk_norm=partial(RMSNorm, eps=eps) if r.get("use_qk_norm", bool, False) else None)
        if i in sparse:
            mlp = SparseMoeBlock(grouped_router(r, f), i, hidden, shared, shared_gated=False)
        else:
            mlp = MLP(hidden, r.positive("intermediate_size"))
        layers.append(DecoderLayer("self_attn", attn, "mlp", mlp, RMSNorm(hidden, eps), RMSNorm(hidden, eps)))
    rotary = Rotary(head_dim, rope_config(r, default_partial=0.5))
    return CausalLM(r.config, layers, ["full_attention"] * f.num_layers, RMSNorm(hidden, eps), rotary)


# -- GGUF (llama.cpp's "glm4moe") --------------------------------------------------------------------
# The router's correction bias is exp_probs_b.bias; sigmoid gating (expert_gating_func 2). llama.cpp's
# glm4moe graph has no expert groups: a config with n_group > 1 is refused on export. Files of the
# released models carry their MTP layer (block_count includes it, nextn_predict_layers says how
# many): it is skipped, as the HF model skips model.layers.{num_hidden_layers}.

# (HF key, GGUF key) of the MoE settings shared with DeepSeek (deepseek_v3.py reads them too)
MOE_KEYS = {"first_k_dense_replace": "leading_dense_block_count", "n_shared_experts": "expert_shared_count",
            "routed_scaling_factor": "expert_weights_scale", "norm_topk_prob": "expert_weights_norm"}


def _gguf_config(meta, tensors) -> dict:
    return {"num_hidden_layers": int(meta("block_count")) - int(meta("nextn_predict_layers", 0) or 0),
            "attention_bias": "blk.0.attn_q.bias" in tensors, "use_qk_norm": "blk.0.attn_q_norm.weight" in tensors,
            "n_group": 1, "topk_group": 1}


def _gguf_metadata(config: dict) -> dict:
    r = FAMILY.reader(config)
    if r.positive("n_group", 1) > 1:
        raise ValueError(f"glm4moe: llama.cpp's graph has no expert groups; this config has n_group {r.get('n_group')}")
    partial = rope_partial(config) if (config.get("rope_parameters") or {}).get("partial_rotary_factor") \
        or config.get("partial_rotary_factor") else 0.5
    return {"expert_gating_func": GATING_SIGMOID, "rope.dimension_count": int(head_dim(config) * partial),
            "expert_weights_norm": r.get("norm_topk_prob", bool, True),
            "expert_weights_scale": r.get("routed_scaling_factor", float, 1.0),
            "leading_dense_block_count": r.get("first_k_dense_replace", int, 1),
            "expert_shared_count": r.get("n_shared_experts", int, 1)}


GGUF = GGUFArch(
    "glm4moe",
    {**{k: v for k, v in ATTENTION.items() if k != "post_attention_layernorm.weight"},
     "post_attention_layernorm.weight": "post_attention_norm.weight",
     **{f"self_attn.{p}_proj.bias": f"attn_{p}.bias" for p in "qkv"},
     "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
     **SHARED_EXPERTS},
    config_keys={**COMMON_KEYS, **MOE_KEYS}, num_experts_key="n_routed_experts",
    extra_config=_gguf_config, extra_metadata=_gguf_metadata)


FAMILY = Family(name="glm4_moe", architectures=("Glm4MoeForCausalLM",), model_types=("glm4_moe",),
                layout=ExpertLayout(), facts_fn=facts, build_fn=build, gguf=GGUF)
