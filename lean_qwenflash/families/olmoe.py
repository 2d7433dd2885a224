"""OLMoE (OlmoeForCausalLM): q/k RMSNorm over the whole projection (not per head), optional
``clip_qkv``, softmax top-k router without renormalisation by default; every layer is sparse."""
from __future__ import annotations

from lean_qwenflash.families.base import ConfigReader, ExpertLayout, Family, MoEFacts, dense_prefix_facts
from lean_qwenflash.models.moe_transformer import build_moe_transformer


def facts(r: ConfigReader) -> MoEFacts:
    return dense_prefix_facts(r, r.positive("num_experts", aliases=("num_local_experts",)),
                              intermediate_key="intermediate_size")


def build(config: dict):
    r = ConfigReader(config, "OlmoeForCausalLM")
    return build_moe_transformer(config, r, facts(r), "mlp", qk_norm="full",
                                 norm_topk_prob=r.get("norm_topk_prob", bool, False),
                                 clip_qkv=r.get("clip_qkv", float, None))


FAMILY = Family(name="olmoe", architectures=("OlmoeForCausalLM",), model_types=("olmoe",),
                layout=ExpertLayout(), facts_fn=facts, build_fn=build)
