"""Qwen3-MoE: GQA with per-head q/k RMSNorm; softmax top-k router with optional renormalisation;
dense MLP layers via ``mlp_only_layers`` / ``decoder_sparse_step``."""
from __future__ import annotations

from lean_qwenflash.models.base import CausalLM
from lean_qwenflash.models.moe_transformer import build_moe_transformer


def build(config: dict) -> CausalLM:
    return build_moe_transformer(config, qk_norm="head", norm_topk_prob=bool(config.get("norm_topk_prob", False)))
