"""OLMoE (OlmoeForCausalLM): q/k RMSNorm over the whole projection (not per head), optional
``clip_qkv``, softmax top-k router without renormalisation by default; every layer is sparse."""
from __future__ import annotations

from lean_qwenflash.families.base import ConfigReader, ExpertLayout, Family, MoEFacts, dense_prefix_facts
from lean_qwenflash.families.gguf import ATTENTION, GGUFArch


def facts(r: ConfigReader) -> MoEFacts:
    return dense_prefix_facts(r, r.positive("num_experts", aliases=("num_local_experts",)),
                              intermediate_key="intermediate_size")


def build(config: dict):
    from lean_qwenflash.models.layers.attention import FlatQKNormAttention
    from lean_qwenflash.models.moe_transformer import build_moe_transformer

    r = FAMILY.reader(config)
    return build_moe_transformer(r, facts(r), "mlp", qk_norm=True, norm_topk_prob=r.get("norm_topk_prob", bool, False),
                                 attention=FlatQKNormAttention, clip_qkv=r.get("clip_qkv", float, None))


# -- GGUF (llama.cpp's "olmoe"; expert count and width under the keys facts() reads) ---------------
GGUF = GGUFArch("olmoe", dict(ATTENTION), implied_config={"norm_topk_prob": False},
                expert_width_key="intermediate_size")


FAMILY = Family(name="olmoe", architectures=("OlmoeForCausalLM",), model_types=("olmoe",),
                layout=ExpertLayout(), facts_fn=facts, build_fn=build, gguf=GGUF)
