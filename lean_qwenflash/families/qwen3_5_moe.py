"""Qwen3.5-MoE (Qwen3_5MoeForCausalLM; Qwen3_5MoeForConditionalGeneration checkpoints): Qwen3-Next's
hybrid stack — Gated DeltaNet layers, a gated full-attention layer every ``full_attention_interval``
layers, zero-centred norms, partial rotary, softmax top-k (always renormalised) routed experts plus a
sigmoid-gated shared expert — with the DeltaNet input projections stored as four flat tensors
(``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``) and every layer sparse.

Multimodal checkpoints nest the text model (``text_config``; keys under ``model.language_model.``):
we run the text model and skip the vision tower (``model.visual.*``) and the MTP head (``mtp.*``);
the pack says so. For text-only input the multimodal rotary (``mrope_section``) is the plain
partial rotary, so ``Rotary`` covers it.
"""
from __future__ import annotations

from lean_qwenflash.families.base import ExpertLayout, Family
from lean_qwenflash.families.qwen3_next import build_hybrid, facts


def text_config(config: dict) -> dict:
    """A ConditionalGeneration config's ``text_config``, flattened, keeping the top-level
    ``architectures`` (and ``tie_word_embeddings`` when only the top level says it)."""
    if not isinstance(config.get("text_config"), dict):
        return config
    flat = dict(config["text_config"])
    flat["architectures"] = config.get("architectures") or flat.get("architectures")
    if "tie_word_embeddings" not in flat and "tie_word_embeddings" in config:
        flat["tie_word_embeddings"] = config["tie_word_embeddings"]
    return flat


def build(config: dict):
    return build_hybrid(FAMILY.reader(config), split_projections=True)


FAMILY = Family(
    name="qwen3_5_moe", architectures=("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"),
    model_types=("qwen3_5_moe", "qwen3_5_moe_text"),
    layout=ExpertLayout(key_renames=(("model.language_model.", "model."),),
                        ignored_prefixes=("mtp.", "model.visual.")),
    facts_fn=facts, build_fn=build, text_config_fn=text_config,
    notes=("the vision tower (model.visual.*) is not used: lean-qwenflash runs the text model",))
