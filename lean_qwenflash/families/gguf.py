"""The vocabulary a family's GGUF declaration is written in (the role of llama.cpp's llama-arch.cpp).

A family that llama.cpp can run declares, in its own file, a ``GGUFArch``: its GGUF architecture
name (``general.architecture``), its tensor names, the transforms llama.cpp's converter applies and
its metadata/config key mapping. This module holds the types and the names shared by every
architecture; it imports only torch and the standard library, so family files can use it without
importing :mod:`lean_qwenflash.store` (which imports the families: :mod:`lean_qwenflash.store.gguf_names`
asks the registry for these declarations and re-exports this vocabulary).

GGUF (llama.cpp's format) names tensors ``blk.{L}.attn_q.weight`` where Hugging Face has
``model.layers.{L}.self_attn.q_proj.weight``, stacks routed experts into 3-D tensors
(``blk.{L}.ffn_{gate,up,down}_exps.weight``, [E, rows, cols] in row-major terms), and keeps config
values under ``{arch}.`` keys. GGUF shapes are listed innermost-first (``ne``): a row-major HF
matrix [rows, cols] is GGUF [cols, rows], with the same bytes.

Some tensors are stored differently, not just renamed (llama.cpp's converter changes them):

* row permutations (``Permute``): llama's q/k rows are interleaved per head for its rotary
  convention. Block-quantized rows are independent, so a permutation moves whole encoded rows and
  stays byte-exact;
* value transforms (``Values``): e.g. Qwen3-Next's ``A_log`` is stored as ``-exp(A_log)``. They
  need float data (these are small vectors, always f32 in GGUF files);
* column permutations (``PermuteCols``): Qwen3.5's ``out_proj`` columns follow its value heads,
  which the converter reorders. A block encoding cannot move columns, so an encoded matrix is kept
  as stored with its column order (``quant.QuantCols``: the input is permuted instead, exact);
  float data is permuted (it is a ``Values``);
* joined matrices (``Joined``): one HF matrix stored as several GGUF tensors, rows concatenated;
* split tensors (``Split``): one HF tensor stored as several GGUF tensors by a float transform
  (DeepSeek's ``kv_b_proj`` as per-head ``attn_k_b`` (transposed) and ``attn_v_b``; GPT-OSS's
  interleaved gate/up expert biases as two tensors).

Some architectures have older file layouts llama.cpp still reads (DeepSeek's single
``attn_kv_b``): ``GGUFArch.alternatives`` names them; they are plain renames.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch


@dataclass(frozen=True)
class Permute:
    """GGUF rows = HF rows[perm(config)] (a row permutation; exact on encoded rows too)."""

    perm: Callable[[dict], torch.Tensor]

    def to_gguf(self, rows, config: dict):
        return rows[self.perm(config)]

    def to_hf(self, rows, config: dict):
        return rows[torch.argsort(self.perm(config))]


@dataclass(frozen=True)
class Values:
    """A float transform and its inverse (shape changes included)."""

    to_gguf: Callable[[torch.Tensor, dict], torch.Tensor]
    to_hf: Callable[[torch.Tensor, dict], torch.Tensor]


class PermuteCols(Values):
    """GGUF columns = HF columns[:, perm(config)] (a column permutation). As floats it is a
    ``Values``; a block-encoded matrix keeps its stored rows and this order (``get_encoded``:
    W x = stored (x[perm]), exact)."""

    def __init__(self, perm: Callable[[dict], torch.Tensor]):
        super().__init__(lambda w, c: w[:, perm(c)], lambda w, c: w[:, torch.argsort(perm(c))])
        object.__setattr__(self, "perm", perm)


@dataclass(frozen=True)
class Split(Values):
    """One HF tensor stored as several GGUF tensors (``parts``, GGUF suffixes under blk.{L}.) by a
    float transform: ``to_gguf(t, config)`` returns the parts' tensors in ``parts`` order and
    ``to_hf(tensors, config)`` rebuilds the HF tensor from them."""

    parts: tuple = ()


@dataclass(frozen=True)
class Joined(Permute):
    """One HF matrix stored as several GGUF tensors (``parts``, GGUF suffixes under blk.{L}.):
    their rows concatenated in ``parts`` order are HF rows[perm(config)] (the Permute it is);
    ``rows`` gives each part's row count, for writing."""

    parts: tuple
    rows: Callable[[dict], tuple]


@dataclass(frozen=True)
class GGUFArch:
    """A family's GGUF declaration (``Family.gguf``); the family's name and HF architecture come
    from its ``Family`` (the registry pairs them)."""

    gguf_arch: str                # general.architecture
    # HF name under model.layers.{L}. -> GGUF name under blk.{L}. (resident tensors); a tuple of
    # GGUF names for a Joined matrix
    layer_tensors: dict
    # our expert projection -> GGUF stacked tensor under blk.{L}.
    expert_tensors: dict = field(default_factory=lambda: {
        "gate": "ffn_gate_exps.weight", "up": "ffn_up_exps.weight", "down": "ffn_down_exps.weight"})
    # HF config key -> GGUF key (without the "{arch}." prefix)
    config_keys: dict = field(default_factory=lambda: dict(COMMON_KEYS))
    # HF suffix under model.layers.{L}. (or a global HF name) -> Permute, Values, PermuteCols, Joined or Split
    transforms: dict = field(default_factory=dict)
    # HF suffix -> GGUF suffix of an older layout llama.cpp still reads (a plain rename: a file
    # holding it gets no transform for that tensor), e.g. DeepSeek's single attn_kv_b
    alternatives: dict = field(default_factory=dict)
    # config keys llama.cpp does not store, with the value its graph implies for this arch
    implied_config: dict = field(default_factory=dict)
    # HF config keys of the expert count / expert width for this family
    num_experts_key: str = "num_experts"
    expert_width_key: str = "moe_intermediate_size"
    # extra config read from / written to GGUF metadata: (meta, tensors) -> dict, config -> dict
    # (extra_metadata raises ValueError for a config llama.cpp's graph cannot compute)
    extra_config: Optional[Callable] = None
    extra_metadata: Optional[Callable] = None
    # where families share a GGUF architecture name: whether a file is this family's, from its
    # metadata (meta(key, default), keys without the "{arch}." prefix)
    accepts: Optional[Callable] = None


# The common per-layer names: HF suffix under model.layers.{L}. -> GGUF suffix under blk.{L}.
ATTENTION = {
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

# The common config keys: HF key -> GGUF key (without the "{arch}." prefix).
COMMON_KEYS = {
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


# llama.cpp's expert gating functions (``{arch}.expert_gating_func``)
GATING_SOFTMAX, GATING_SIGMOID, GATING_SOFTMAX_WEIGHT = 1, 2, 3

# The shared-expert names of the families that have them (HF ``mlp.shared_experts.*``, DeepSeek's
# spelling; Qwen's ``mlp.shared_expert.*`` is in qwen3_next.py)
SHARED_EXPERTS = {f"mlp.shared_experts.{p}_proj.weight": f"ffn_{p}_shexp.weight" for p in ("gate", "up", "down")}


def rope_partial(config: dict) -> float:
    """The HF config's partial rotary factor (``rope_parameters`` first), 1.0 when it has none."""
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    return float(rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 1.0)) or 1.0)


def head_dim(config: dict) -> int:
    """The attention head size of an HF config: ``head_dim``, else hidden_size / num_attention_heads
    (the rule of ``models.layers.rope.attention_head_dim``)."""
    return int(config.get("head_dim") or int(config["hidden_size"]) // int(config["num_attention_heads"]))


def rope_interleave(num_heads_key: str) -> Permute:
    """llama.cpp's llama rotary pairs neighbouring rows (2i, 2i+1) of each head where HF pairs
    (i, i + D/2): GGUF row h*D + 2i + s is HF row h*D + s*D/2 + i."""
    def perm(config: dict) -> torch.Tensor:
        heads = int(config[num_heads_key])
        dim = head_dim(config)
        half = dim // 2
        i = torch.arange(half).repeat_interleave(2)          # 0 0 1 1 ...
        s = torch.arange(2).repeat(half)                     # 0 1 0 1 ...
        one = s * half + i
        return (torch.arange(heads)[:, None] * dim + one[None, :]).reshape(-1)
    return Permute(perm)


def plus_one() -> Values:
    """Zero-centred norms (Qwen3-Next): GGUF holds 1 + w (llama.cpp multiplies by the weight)."""
    return Values(lambda w, c: w + 1.0, lambda w, c: w - 1.0)


__all__ = ["ATTENTION", "COMMON_KEYS", "GATING_SIGMOID", "GATING_SOFTMAX", "GATING_SOFTMAX_WEIGHT", "GGUFArch", "Joined",
           "Permute", "PermuteCols", "SHARED_EXPERTS", "Split", "Values", "head_dim", "plus_one", "rope_interleave", "rope_partial"]
