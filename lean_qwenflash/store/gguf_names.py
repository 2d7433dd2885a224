"""The one table between Hugging Face and GGUF names: tensors and config keys, per architecture.

GGUF (llama.cpp's format) names tensors ``blk.{L}.attn_q.weight`` where Hugging Face has
``model.layers.{L}.self_attn.q_proj.weight``, stacks routed experts into 3-D tensors
(``blk.{L}.ffn_{gate,up,down}_exps.weight``, [E, rows, cols] in row-major terms), and keeps config
values under ``{arch}.`` keys. Everything that maps one to the other reads it from here.
GGUF shapes are listed innermost-first (``ne``): a row-major HF matrix [rows, cols] is GGUF
[cols, rows], with the same bytes.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class GGUFArch:
    family: str                   # our model family
    gguf_arch: str                # general.architecture
    # HF name under model.layers.{L}. -> GGUF name under blk.{L}. (resident tensors)
    layer_tensors: dict
    # our expert projection -> GGUF stacked tensor under blk.{L}.
    expert_tensors: dict = field(default_factory=lambda: {
        "gate": "ffn_gate_exps.weight", "up": "ffn_up_exps.weight", "down": "ffn_down_exps.weight"})
    # HF config key -> GGUF key (without the "{arch}." prefix)
    config_keys: dict = field(default_factory=dict)


GLOBAL_TENSORS = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}

_ATTENTION = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",             # the router
    "mlp.gate_proj.weight": "ffn_gate.weight",            # dense layers
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}

_COMMON_KEYS = {
    "num_hidden_layers": "block_count",
    "max_position_embeddings": "context_length",
    "hidden_size": "embedding_length",
    "intermediate_size": "feed_forward_length",
    "num_attention_heads": "attention.head_count",
    "num_key_value_heads": "attention.head_count_kv",
    "rms_norm_eps": "attention.layer_norm_rms_epsilon",
    "rope_theta": "rope.freq_base",
    "head_dim": "attention.key_length",
}

# Expert counts come from naming.expert_dims (the HF key differs per family).
EXPERT_KEYS = ("expert_count", "expert_used_count", "expert_feed_forward_length")

ARCHS = {a.family: a for a in (
    GGUFArch("qwen3_moe", "qwen3moe", dict(_ATTENTION), config_keys=dict(_COMMON_KEYS)),
)}


def gguf_arch(family: str) -> GGUFArch:
    try:
        return ARCHS[family]
    except KeyError:
        raise ValueError(f"no GGUF name mapping for model family {family!r} (have: {', '.join(ARCHS)})") from None


def hf_to_gguf_tensor(arch: GGUFArch, hf_name: str) -> str:
    """GGUF name of a resident HF tensor; ValueError names the tensor it cannot map."""
    if hf_name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[hf_name]
    parts = hf_name.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in arch.layer_tensors:
        return f"blk.{parts[2]}.{arch.layer_tensors[parts[3]]}"
    raise ValueError(f"{arch.gguf_arch}: no GGUF name for tensor {hf_name!r}")
