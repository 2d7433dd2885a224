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

import torch

from lean_qwenflash.families.base import ExpertLayout, Family
from lean_qwenflash.families.gguf import GGUFArch, Permute, PermuteCols, Values
from lean_qwenflash.families.qwen3_next import GGUF as QWEN3_NEXT_GGUF
from lean_qwenflash.families.qwen3_next import _gguf_metadata as qwen3_next_metadata
from lean_qwenflash.families.qwen3_next import _linear_dims, build_hybrid, facts


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


# -- GGUF (llama.cpp's "qwen35moe": the text model) --------------------------------------------------
# Qwen3-Next's names and transforms (norms as 1 + w, ssm_a = -exp(A_log), the conv squeezed), with
# the four flat DeltaNet projections as attn_qkv (in_proj_qkv), attn_gate (in_proj_z), ssm_beta
# (in_proj_b), ssm_alpha (in_proj_a). Where a key head has several value heads, llama.cpp's
# converter reorders the value heads from grouped by key head (HF: k0's v0..v(r-1), k1's ...) to
# tiled (k0 v0, k1 v0, ..., k0 v1, ...), in every tensor indexed by value head: rows of the V part
# of in_proj_qkv, of in_proj_z / in_proj_a / in_proj_b, of the conv's V channels, A_log and
# dt_bias, and the columns of out_proj. Rows move whole (exact on encoded rows too); an encoded out_proj
# keeps its stored columns and their order (PermuteCols: the input is permuted instead). The rotary is llama.cpp's
# interleaved M-RoPE, whose sections (rope.dimension_sections) are required; for text all
# positions are equal and it is the plain partial rotary.

def _v_tiled(config: dict, width: int) -> torch.Tensor:
    """GGUF index -> HF index over value heads of ``width`` values: grouped to tiled."""
    nk, nv, _, _ = _linear_dims(config)
    r = nv // nk
    return torch.arange(nk * r * width).view(nk, r, width).transpose(0, 1).reshape(-1)


def _value_dim(config: dict) -> int:
    return int(config["linear_value_head_dim"])


def _qkv_perm(config: dict) -> torch.Tensor:
    nk, _, hk, _ = _linear_dims(config)
    qk = 2 * nk * hk
    return torch.cat([torch.arange(qk), qk + _v_tiled(config, _value_dim(config))])


def _rows(width) -> Permute:
    return Permute(lambda c: _v_tiled(c, width(c)))


def _cols() -> PermuteCols:
    return PermuteCols(lambda c: _v_tiled(c, _value_dim(c)))


def _gguf_metadata(config: dict) -> dict:
    out = qwen3_next_metadata(config)
    rope = dict(config.get("rope_parameters") or {})
    sections = list(rope.get("mrope_section") or config.get("mrope_section") or [])
    if not sections:         # llama.cpp requires them; a split of the rotary pairs like Qwen's 11/11/10
        pairs = out["rope.dimension_count"] // 2
        first = -(-pairs // 3)
        sections = [first, first, pairs - 2 * first]
    return {**out, "rope.dimension_sections": (sections + [0, 0, 0, 0])[:4]}


_NEXT = QWEN3_NEXT_GGUF
GGUF = GGUFArch(
    "qwen35moe",
    {**{k: v for k, v in _NEXT.layer_tensors.items() if k not in ("linear_attn.in_proj_qkvz.weight",
                                                                  "linear_attn.in_proj_ba.weight")},
     "linear_attn.in_proj_qkv.weight": "attn_qkv.weight",
     "linear_attn.in_proj_z.weight": "attn_gate.weight",
     "linear_attn.in_proj_b.weight": "ssm_beta.weight",
     "linear_attn.in_proj_a.weight": "ssm_alpha.weight"},
    transforms={
        **{k: v for k, v in _NEXT.transforms.items() if k not in ("linear_attn.in_proj_qkvz.weight",
                                                                  "linear_attn.A_log", "linear_attn.conv1d.weight")},
        "linear_attn.in_proj_qkv.weight": Permute(_qkv_perm),
        "linear_attn.in_proj_z.weight": _rows(_value_dim),
        "linear_attn.in_proj_b.weight": _rows(lambda c: 1),
        "linear_attn.in_proj_a.weight": _rows(lambda c: 1),
        "linear_attn.dt_bias": _rows(lambda c: 1),
        "linear_attn.A_log": Values(lambda a, c: -a.exp()[_v_tiled(c, 1)],
                                    lambda a, c: (-a).log()[torch.argsort(_v_tiled(c, 1))]),
        "linear_attn.conv1d.weight": Values(lambda w, c: w.squeeze(1)[_qkv_perm(c)],
                                            lambda w, c: w[torch.argsort(_qkv_perm(c))].unsqueeze(1)),
        "linear_attn.out_proj.weight": _cols()},
    implied_config={"norm_topk_prob": True}, extra_config=_NEXT.extra_config, extra_metadata=_gguf_metadata)


FAMILY = Family(
    name="qwen3_5_moe", architectures=("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"),
    model_types=("qwen3_5_moe", "qwen3_5_moe_text"),
    layout=ExpertLayout(key_renames=(("model.language_model.", "model."),),
                        ignored_prefixes=("mtp.", "model.visual.")),
    facts_fn=facts, build_fn=build, text_config_fn=text_config, gguf=GGUF,
    notes=("the vision tower (model.visual.*) is not used: lean-qwenflash runs the text model",))
