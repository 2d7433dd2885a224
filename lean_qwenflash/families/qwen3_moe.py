"""Qwen3-MoE (Qwen3MoeForCausalLM): GQA with per-head q/k RMSNorm, softmax top-k router (optionally
renormalised), dense layers via ``mlp_only_layers`` / ``decoder_sparse_step``."""
from __future__ import annotations

from lean_qwenflash.families.base import ConfigReader, ExpertLayout, Family, MoEFacts, sparse_layers
from lean_qwenflash.models.moe_transformer import build_moe_transformer


def facts(r: ConfigReader) -> MoEFacts:
    experts = r.get("num_experts", int, 0, aliases=("num_local_experts",))
    return MoEFacts(r.positive("num_hidden_layers"), sparse_layers(r, experts), experts,
                    r.positive("num_experts_per_tok") if experts else 0, r.positive("hidden_size"),
                    r.positive("moe_intermediate_size") if experts else 0)


def build(config: dict):
    r = ConfigReader(config, "Qwen3MoeForCausalLM")
    return build_moe_transformer(config, facts(r), "mlp", qk_norm="head",
                                 norm_topk_prob=r.get("norm_topk_prob", bool, False))


FAMILY = Family(name="qwen3_moe", architectures=("Qwen3MoeForCausalLM",), model_types=("qwen3_moe",),
                layout=ExpertLayout(), facts_fn=facts, build_fn=build)
