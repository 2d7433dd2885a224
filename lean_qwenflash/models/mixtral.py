"""Mixtral: GQA without q/k norm; the router always renormalises its top-k; the sparse block is
``block_sparse_moe`` on disk."""
from __future__ import annotations

from lean_qwenflash.models.base import CausalLM
from lean_qwenflash.models.moe_transformer import build_moe_transformer


def build(config: dict) -> CausalLM:
    return build_moe_transformer(config, qk_norm=None, norm_topk_prob=True)
