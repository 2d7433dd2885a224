"""OLMoE: q/k RMSNorm over all heads (before the head split), optional ``clip_qkv``."""
from __future__ import annotations

from lean_qwenflash.models.base import CausalLM
from lean_qwenflash.models.moe_transformer import build_moe_transformer


def build(config: dict) -> CausalLM:
    return build_moe_transformer(config, qk_norm="full", norm_topk_prob=bool(config.get("norm_topk_prob", False)),
                                 clip_qkv=config.get("clip_qkv"))
