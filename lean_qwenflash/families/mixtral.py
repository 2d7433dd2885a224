"""Mixtral (MixtralForCausalLM): GQA without q/k norm; the router always renormalises its top-k; the
sparse block is ``block_sparse_moe`` on disk with experts ``w1`` (gate), ``w3`` (up), ``w2`` (down);
every layer is sparse."""
from __future__ import annotations

from lean_qwenflash.families.base import ConfigReader, ExpertLayout, Family, MoEFacts, dense_prefix_facts
from lean_qwenflash.families.gguf import ATTENTION, GGUFArch, rope_interleave


def facts(r: ConfigReader) -> MoEFacts:
    return dense_prefix_facts(r, r.positive("num_local_experts", aliases=("num_experts",)),
                              intermediate_key="intermediate_size")


def build(config: dict):
    from lean_qwenflash.models.moe_transformer import build_moe_transformer

    r = FAMILY.reader(config)
    return build_moe_transformer(r, facts(r), "block_sparse_moe", qk_norm=False, norm_topk_prob=True)


# -- GGUF: llama.cpp's "llama" with experts; no q/k norms, the router under block_sparse_moe, and
# q/k rows interleaved for llama's rotary. Expert count and width under the keys facts() reads.
GGUF = GGUFArch(
    "llama", {k.replace("mlp.gate.weight", "block_sparse_moe.gate.weight"): v
              for k, v in ATTENTION.items() if "_norm." not in k},
    transforms={"self_attn.q_proj.weight": rope_interleave("num_attention_heads"),
                "self_attn.k_proj.weight": rope_interleave("num_key_value_heads")},
    num_experts_key="num_local_experts", expert_width_key="intermediate_size")


FAMILY = Family(name="mixtral", architectures=("MixtralForCausalLM",), model_types=("mixtral",),
                layout=ExpertLayout(moe_module="block_sparse_moe", proj_names=("w1", "w3", "w2"), moe_aliases=("mlp",)),
                facts_fn=facts, build_fn=build, gguf=GGUF)
