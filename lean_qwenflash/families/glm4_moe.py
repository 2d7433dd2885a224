"""GLM-4.5 / 4.6 MoE (Glm4MoeForCausalLM): GQA with biased q/k/v (``attention_bias``) and an
unbiased o_proj, optional per-head q/k RMSNorm (``use_qk_norm``), partial rotary (half of each
head by default, rotate-half), the first ``first_k_dense_replace`` layers dense, then sparse layers
with DeepSeek-V3's routing (sigmoid, correction bias, group-limited top-k, scaling) and ungated
``shared_experts``. Multi-token-prediction layers (``model.layers.{num_hidden_layers}.*``) are
skipped."""
from __future__ import annotations

from lean_qwenflash.families.base import ConfigReader, ExpertLayout, Family, MoEFacts, dense_prefix_facts


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


FAMILY = Family(name="glm4_moe", architectures=("Glm4MoeForCausalLM",), model_types=("glm4_moe",),
                layout=ExpertLayout(), facts_fn=facts, build_fn=build)
