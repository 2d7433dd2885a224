"""Qwen3-MoE (Qwen3MoeForCausalLM): GQA with per-head q/k RMSNorm, softmax top-k router (optionally
renormalised), dense layers via ``mlp_only_layers`` / ``decoder_sparse_step``."""
from __future__ import annotations

from lean_qwenflash.families.base import ExpertLayout, Family
from lean_qwenflash.families.gguf import ATTENTION, GGUFArch
from lean_qwenflash.families.qwen3_next import facts      # the same keys and sparse-layer rule


def build(config: dict):
    from lean_qwenflash.models.moe_transformer import build_moe_transformer

    r = FAMILY.reader(config)
    return build_moe_transformer(r, facts(r), "mlp", qk_norm=True, norm_topk_prob=r.get("norm_topk_prob", bool, False))


# -- GGUF (llama.cpp's "qwen3moe"; its router always renormalises the top-k) ----------------------
GGUF = GGUFArch("qwen3moe", dict(ATTENTION), implied_config={"norm_topk_prob": True})


FAMILY = Family(name="qwen3_moe", architectures=("Qwen3MoeForCausalLM",), model_types=("qwen3_moe",),
                layout=ExpertLayout(), facts_fn=facts, build_fn=build, gguf=GGUF)
