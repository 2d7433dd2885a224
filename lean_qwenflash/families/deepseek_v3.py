"""DeepSeek-V3 (DeepseekV3ForCausalLM): multi-head latent attention with a compressed KV cache (the
latent and the shared rope key per token, not expanded K/V), YaRN rope on the rope part of each
head, the first ``first_k_dense_replace`` layers dense, then sparse layers routed by sigmoid scores
with ``e_score_correction_bias``, group-limited top-k and ``routed_scaling_factor``, plus ungated
shared experts. The multi-token-prediction layer (``model.layers.{num_hidden_layers}.*``) is skipped.
"""
from __future__ import annotations

from lean_qwenflash.families.base import ConfigReader, ExpertLayout, Family, MoEFacts, dense_prefix_facts
from lean_qwenflash.families.glm4_moe import grouped_router
from lean_qwenflash.models.base import CausalLM, DecoderLayer, mscale, rope_parameters, rotary_from_config
from lean_qwenflash.models.layers import MLP, LatentAttention, RMSNorm, SparseMoeBlock


def facts(r: ConfigReader) -> MoEFacts:
    return dense_prefix_facts(r, r.positive("n_routed_experts", aliases=("num_local_experts", "num_experts")),
                              r.get("first_k_dense_replace", int, 0), r.positive("moe_layer_freq", 1))


def latent_attention(config: dict, r: ConfigReader, interleaved: bool) -> LatentAttention:
    nope, rope_dim = r.positive("qk_nope_head_dim"), r.positive("qk_rope_head_dim")
    scaling = (nope + rope_dim) ** -0.5
    rope = rope_parameters(config)
    if rope["rope_type"] != "default" and rope.get("mscale_all_dim"):
        scaling *= mscale(float(rope["factor"]), float(rope["mscale_all_dim"])) ** 2
    return LatentAttention(r.positive("hidden_size"), r.positive("num_attention_heads"), r.get("q_lora_rank", int, None),
                           r.positive("kv_lora_rank"), nope, rope_dim, r.positive("v_head_dim"), scaling=scaling,
                           bias=r.get("attention_bias", bool, False), interleaved_rope=interleaved)


def build_deepseek(config: dict, architecture: str, router_fn, interleaved: bool) -> CausalLM:
    """The DeepSeek layer stack; ``router_fn(reader, facts)`` makes a sparse layer's router."""
    r = ConfigReader(config, architecture)
    f = facts(r)
    hidden = f.hidden_size
    eps = r.get("rms_norm_eps", float, 1e-6)
    sparse = set(f.moe_layers)
    shared = f.expert_intermediate * r.get("n_shared_experts", int, 1)
    layers = []
    for i in range(f.num_layers):
        attn = latent_attention(config, r, interleaved)
        if i in sparse:
            mlp = SparseMoeBlock(router_fn(r, f), i, hidden, shared, shared_gated=False)
        else:
            mlp = MLP(hidden, r.positive("intermediate_size"))
        layers.append(DecoderLayer("self_attn", attn, "mlp", mlp, RMSNorm(hidden, eps), RMSNorm(hidden, eps)))
    # The rope covers the qk_rope_head_dim part of each head only.
    rotary = rotary_from_config(config, r.positive("qk_rope_head_dim"))
    return CausalLM(config, layers, ["full_attention"] * f.num_layers, RMSNorm(hidden, eps), rotary)


def build(config: dict) -> CausalLM:
    return build_deepseek(config, "DeepseekV3ForCausalLM", grouped_router,
                          ConfigReader(config, "DeepseekV3ForCausalLM").get("rope_interleave", bool, True))


FAMILY = Family(name="deepseek_v3", architectures=("DeepseekV3ForCausalLM",), model_types=("deepseek_v3",),
                layout=ExpertLayout(), facts_fn=facts, build_fn=build)
