"""DeepSeek-V3 (DeepseekV3ForCausalLM): multi-head latent attention with a compressed KV cache (the
latent and the shared rope key per token, not expanded K/V), YaRN rope on the rope part of each
head, the first ``first_k_dense_replace`` layers dense, then sparse layers routed by sigmoid scores
with ``e_score_correction_bias``, group-limited top-k and ``routed_scaling_factor``, plus ungated
shared experts. The multi-token-prediction layer (``model.layers.{num_hidden_layers}.*``) is skipped.
"""
from __future__ import annotations

from lean_qwenflash.families.base import ConfigReader, ExpertLayout, Family, MoEFacts, dense_prefix_facts
from lean_qwenflash.families.glm4_moe import grouped_router


def facts(r: ConfigReader) -> MoEFacts:
    return dense_prefix_facts(r, r.positive("n_routed_experts", aliases=("num_local_experts", "num_experts")),
                              r.get("first_k_dense_replace", int, 0), r.positive("moe_layer_freq", 1))


def latent_attention(r: ConfigReader, rope, interleaved: bool):
    """A layer's ``LatentAttention``; ``rope``: the config's ``RopeConfig`` (YaRN's mscale_all_dim
    scales the softmax)."""
    from lean_qwenflash.models.layers.latent_attention import LatentAttention
    from lean_qwenflash.models.layers.rope import mscale

    nope, rope_dim = r.positive("qk_nope_head_dim"), r.positive("qk_rope_head_dim")
    scaling = (nope + rope_dim) ** -0.5
    if rope.type != "default" and rope.mscale_all_dim:
        scaling *= mscale(rope.factor, rope.mscale_all_dim) ** 2
    return LatentAttention(r.positive("hidden_size"), r.positive("num_attention_heads"), r.get("q_lora_rank", int, None),
                           r.positive("kv_lora_rank"), nope, rope_dim, r.positive("v_head_dim"), scaling=scaling,
                           bias=r.get("attention_bias", bool, False), interleaved_rope=interleaved)


def build_deepseek(r: ConfigReader, router_fn, interleaved: bool):
    """The DeepSeek layer stack; ``router_fn(reader, facts)`` makes a sparse layer's router."""
    from lean_qwenflash.models.base import CausalLM, DecoderLayer
    from lean_qwenflash.models.layers.mlp import MLP
    from lean_qwenflash.models.layers.norm import RMSNorm
    from lean_qwenflash.models.layers.rope import Rotary, rope_config
    from lean_qwenflash.models.moe.block import SparseMoeBlock

    f = facts(r)
    rope = rope_config(r)
    hidden = f.hidden_size
    eps = r.get("rms_norm_eps", float, 1e-6)
    sparse = set(f.moe_layers)
    shared = f.expert_intermediate * r.get("n_shared_experts", int, 1)
    layers = []
    for i in range(f.num_layers):
        attn = latent_attention(r, rope, interleaved)
        if i in sparse:
            mlp = SparseMoeBlock(router_fn(r, f), i, hidden, shared, shared_gated=False)
        else:
            mlp = MLP(hidden, r.positive("intermediate_size"))
        layers.append(DecoderLayer("self_attn", attn, "mlp", mlp, RMSNorm(hidden, eps), RMSNorm(hidden, eps)))
    # The rope covers the qk_rope_head_dim part of each head only.
    rotary = Rotary(r.positive("qk_rope_head_dim"), rope)
    return CausalLM(r.config, layers, ["full_attention"] * f.num_layers, RMSNorm(hidden, eps), rotary)


def build(config: dict):
    r = FAMILY.reader(config)
    return build_deepseek(r, grouped_router, r.get("rope_interleave", bool, True))


FAMILY = Family(name="deepseek_v3", architectures=("DeepseekV3ForCausalLM",), model_types=("deepseek_v3",),
                layout=ExpertLayout(), facts_fn=facts, build_fn=build)
