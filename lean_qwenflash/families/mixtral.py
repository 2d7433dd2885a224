"""Mixtral (MixtralForCausalLM): GQA without q/k norm; the router always renormalises its top-k; the
sparse block is ``block_sparse_moe`` on disk with experts ``w1`` (gate), ``w3`` (up), ``w2`` (down);
every layer is sparse."""
from __future__ import annotations

from lean_qwenflash.families.base import ConfigReader, ExpertLayout, Family, MoEFacts, dense_prefix_facts
from lean_qwenflash.models.moe_transformer import build_moe_transformer


def facts(r: ConfigReader) -> MoEFacts:
    return dense_prefix_facts(r, r.positive("num_local_experts", aliases=("num_experts",)),
                              intermediate_key="intermediate_size")


def build(config: dict):
    r = ConfigReader(config, "MixtralForCausalLM")
    return build_moe_transformer(config, r, facts(r), "block_sparse_moe", qk_norm=None, norm_topk_prob=True)


FAMILY = Family(name="mixtral", architectures=("MixtralForCausalLM",), model_types=("mixtral",),
                layout=ExpertLayout(moe_module="block_sparse_moe", proj_names=("w1", "w3", "w2"), moe_aliases=("mlp",)),
                facts_fn=facts, build_fn=build)
