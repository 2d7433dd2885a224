"""Mixtral (MixtralForCausalLM): GQA without q/k norm; the router always renormalises its top-k; the
sparse block is ``block_sparse_moe`` on disk with experts ``w1`` (gate), ``w3`` (up), ``w2`` (down);
every layer is sparse."""
from __future__ import annotations

from lean_qwenflash.families.base import ConfigReader, ExpertLayout, Family, MoEFacts
from lean_qwenflash.models.moe_transformer import build_moe_transformer


def facts(r: ConfigReader) -> MoEFacts:
    n = r.positive("num_hidden_layers")
    experts = r.positive("num_local_experts", aliases=("num_experts",))
    return MoEFacts(n, tuple(range(n)), experts, r.positive("num_experts_per_tok"), r.positive("hidden_size"),
                    r.positive("intermediate_size"))


def build(config: dict):
    return build_moe_transformer(config, facts(ConfigReader(config, "MixtralForCausalLM")), "block_sparse_moe",
                                 qk_norm=None, norm_topk_prob=True)


FAMILY = Family(name="mixtral", architectures=("MixtralForCausalLM",), model_types=("mixtral",),
                layout=ExpertLayout(moe_module="block_sparse_moe", proj_names=("w1", "w3", "w2"), moe_aliases=("mlp",)),
                facts_fn=facts, build_fn=build)
