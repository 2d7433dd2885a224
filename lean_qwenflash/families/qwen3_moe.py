"""Qwen3-MoE (Qwen3MoeForCausalLM): GQA with per-head q/k RMSNorm, softmax top-k router (optionally
renormalised), dense layers via ``mlp_only_layers`` / ``decoder_sparse_step``."""
from __future__ import annotations

from lean_qwenflash.families.base import ConfigReader, ExpertLayout, Family
from lean_qwenflash.families.qwen3_next import facts      # the same keys and sparse-layer rule
from lean_qwenflash.models.moe_transformer import build_moe_transformer


def build(config: dict):
    r = ConfigReader(config, "Qwen3MoeForCausalLM")
    return build_moe_transformer(config, r, facts(r), "mlp", qk_norm="head",
                                 norm_topk_prob=r.get("norm_topk_prob", bool, False))


FAMILY = Family(name="qwen3_moe", architectures=("Qwen3MoeForCausalLM",), model_types=("qwen3_moe",),
                layout=ExpertLayout(), facts_fn=facts, build_fn=build)
