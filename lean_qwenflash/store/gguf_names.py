"""The one table between Hugging Face and GGUF: tensor names, data transforms and config keys, per
architecture. The GGUF importer (:mod:`.gguf_file`) and exporter (:mod:`.gguf_export`) both read it.

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
  need float data (these are small vectors, always f32 in GGUF files).
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


@dataclass(frozen=True)
class Joined:
    """One HF matrix stored as several GGUF tensors (``parts``, GGUF suffixes under blk.{L}.):
    their rows concatenated in ``parts`` order are HF rows[perm(config)] (as Permute); ``rows``
    gives each part's row count, for writing."""

    parts: tuple
    perm: Callable[[dict], torch.Tensor]
    rows: Callable[[dict], tuple]

    def to_gguf(self, rows, config: dict):
        return rows[self.perm(config)]

    def to_hf(self, rows, config: dict):
        return rows[torch.argsort(self.perm(config))]


def _rope_interleave(num_heads_key: str) -> Permute:
    """llama.cpp's llama rotary pairs neighbouring rows (2i, 2i+1) of each head where HF pairs
    (i, i + D/2): GGUF row h*D + 2i + s is HF row h*D + s*D/2 + i."""
    def perm(config: dict) -> torch.Tensor:
        heads = int(config[num_heads_key])
        head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // int(config["num_attention_heads"]))
        half = head_dim // 2
        i = torch.arange(half).repeat_interleave(2)          # 0 0 1 1 ...
        s = torch.arange(2).repeat(half)                     # 0 1 0 1 ...
        one = s * half + i
        return (torch.arange(heads)[:, None] * head_dim + one[None, :]).reshape(-1)
    return Permute(perm)


def _plus_one() -> Values:
    """Qwen3-Next's zero-centred norms: GGUF holds 1 + w (llama.cpp multiplies by the weight)."""
    return Values(lambda w, c: w + 1.0, lambda w, c: w - 1.0)


def _linear_dims(config: dict):
    nk, nv = int(config["linear_num_key_heads"]), int(config["linear_num_value_heads"])
    hk, hv = int(config["linear_key_head_dim"]), int(config["linear_value_head_dim"])
    return nk, nv, hk, hv


def _qkvz_perm(config: dict) -> torch.Tensor:
    """GGUF [all q, all k, all v | all z] rows -> HF rows grouped per key head [q_g, k_g, v_g, z_g]."""
    nk, nv, hk, hv = _linear_dims(config)
    rv = nv // nk * hv
    group = 2 * hk + 2 * rv
    segments = []
    for start, width in ((0, hk), (hk, hk), (2 * hk, rv), (2 * hk + rv, rv)):
        segments.append((torch.arange(nk)[:, None] * group + start + torch.arange(width)[None, :]).reshape(-1))
    return torch.cat(segments)


def _qkvz_rows(config: dict) -> tuple:
    nk, nv, hk, hv = _linear_dims(config)
    return (2 * nk * hk + nv * hv, nv * hv)


@dataclass(frozen=True)
class GGUFArch:
    family: str                   # our model family
    gguf_arch: str                # general.architecture
    hf_architecture: str          # config.json "architectures"
    # HF name under model.layers.{L}. -> GGUF name under blk.{L}. (resident tensors)
    layer_tensors: dict
    # our expert projection -> GGUF stacked tensor under blk.{L}.
    expert_tensors: dict = field(default_factory=lambda: {
        "gate": "ffn_gate_exps.weight", "up": "ffn_up_exps.weight", "down": "ffn_down_exps.weight"})
    # HF config key -> GGUF key (without the "{arch}." prefix)
    config_keys: dict = field(default_factory=dict)
    # HF suffix under model.layers.{L}. -> Permute or Values
    transforms: dict = field(default_factory=dict)
    # config keys llama.cpp does not store, with the value its graph implies for this arch
    implied_config: dict = field(default_factory=dict)
    # HF config keys of the expert count / expert width for this family
    num_experts_key: str = "num_experts"
    expert_width_key: str = "moe_intermediate_size"
    # extra config read from / written to GGUF metadata: (meta, tensors) -> dict, config -> dict
    extra_config: Optional[Callable] = None
    extra_metadata: Optional[Callable] = None


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

# GGUF keys of (expert count, experts per token, expert width), without the "{arch}." prefix.
EXPERT_KEYS = ("expert_count", "expert_used_count", "expert_feed_forward_length")

_MIXTRAL_TENSORS = {k.replace("mlp.gate.weight", "block_sparse_moe.gate.weight"): v
                    for k, v in _ATTENTION.items() if "_norm." not in k}

ARCHS = {a.family: a for a in (
    GGUFArch("qwen3_moe", "qwen3moe", "Qwen3MoeForCausalLM", dict(_ATTENTION), config_keys=dict(_COMMON_KEYS),
             implied_config={"norm_topk_prob": True}),
    GGUFArch("olmoe", "olmoe", "OlmoeForCausalLM", dict(_ATTENTION), config_keys=dict(_COMMON_KEYS),
             implied_config={"norm_topk_prob": False}, expert_width_key="intermediate_size"),
    # Mixtral is llama.cpp's "llama" with experts; its q/k rows are interleaved for llama's rotary.
    GGUFArch("mixtral", "llama", "MixtralForCausalLM", _MIXTRAL_TENSORS, config_keys=dict(_COMMON_KEYS),
             transforms={"self_attn.q_proj.weight": _rope_interleave("num_attention_heads"),
                         "self_attn.k_proj.weight": _rope_interleave("num_key_value_heads")},
             num_experts_key="num_local_experts", expert_width_key="intermediate_size"),
)}


def _qwen3_next_config(meta, tensors) -> dict:
    """Qwen3-Next's DeltaNet sizes and layer types from its ``ssm.*`` keys."""
    blocks = int(meta("block_count")) - int(meta("nextn_predict_layers", 0) or 0)
    nv = int(meta("ssm.time_step_rank"))
    cfg = {"num_hidden_layers": blocks, "linear_conv_kernel_dim": int(meta("ssm.conv_kernel")),
           "linear_key_head_dim": int(meta("ssm.state_size")), "linear_num_key_heads": int(meta("ssm.group_count")),
           "linear_num_value_heads": nv, "linear_value_head_dim": int(meta("ssm.inner_size")) // nv,
           "shared_expert_intermediate_size": int(meta("expert_shared_feed_forward_length", 0) or 0)}
    recurrent = meta("attention.recurrent_layers", None)
    if recurrent is not None:
        cfg["layer_types"] = ["linear_attention" if r else "full_attention" for r in list(recurrent)[:blocks]]
    else:
        interval = int(meta("full_attention_interval", 4))
        cfg["full_attention_interval"] = interval
    return cfg


def _qwen3_next_metadata(config: dict) -> dict:
    nk, nv, hk, hv = _linear_dims(config)
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // int(config["num_attention_heads"]))
    rope = dict(config.get("rope_parameters") or {})
    partial = float(rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.25)))
    out = {"ssm.conv_kernel": int(config.get("linear_conv_kernel_dim", 4)), "ssm.state_size": hk,
           "ssm.group_count": nk, "ssm.time_step_rank": nv, "ssm.inner_size": nv * hv,
           "full_attention_interval": int(config.get("full_attention_interval", 4)),
           "rope.dimension_count": int(head_dim * partial),
           "expert_shared_feed_forward_length": int(config.get("shared_expert_intermediate_size", 0))}
    if config.get("layer_types"):
        out["attention.recurrent_layers"] = [t == "linear_attention" for t in config["layer_types"]]
    return out


_QWEN3_NEXT_TENSORS = {
    **{k: v for k, v in _ATTENTION.items() if k != "post_attention_layernorm.weight"},
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "linear_attn.in_proj_ba.weight": "ssm_ba.weight",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight",
    "linear_attn.dt_bias": "ssm_dt.bias",
    "linear_attn.A_log": "ssm_a",
    "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
}
_QWEN3_NEXT_QKVZ = Joined(("attn_qkv.weight", "attn_gate.weight"), _qkvz_perm, _qkvz_rows)
_QWEN3_NEXT_TENSORS["linear_attn.in_proj_qkvz.weight"] = _QWEN3_NEXT_QKVZ.parts
ARCHS["qwen3_next"] = GGUFArch(
    "qwen3_next", "qwen3next", "Qwen3NextForCausalLM", _QWEN3_NEXT_TENSORS, config_keys=dict(_COMMON_KEYS),
    transforms={"linear_attn.in_proj_qkvz.weight": _QWEN3_NEXT_QKVZ,
                "linear_attn.A_log": Values(lambda a, c: -a.exp(), lambda a, c: (-a).log()),
                "linear_attn.conv1d.weight": Values(lambda w, c: w.squeeze(1), lambda w, c: w.unsqueeze(1)),
                # [1, H]; llama.cpp's quantizer rewrites it as a vector
                "mlp.shared_expert_gate.weight": Values(lambda w, c: w, lambda w, c: w.reshape(1, -1)),
                **{n: _plus_one() for n in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                            "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                                            "model.norm.weight")}},
    implied_config={"norm_topk_prob": True}, extra_config=_qwen3_next_config, extra_metadata=_qwen3_next_metadata)

BY_GGUF_ARCH = {a.gguf_arch: a for a in ARCHS.values()}


def gguf_arch(family: str) -> GGUFArch:
    try:
        return ARCHS[family]
    except KeyError:
        raise ValueError(f"no GGUF name mapping for model family {family!r} (have: {', '.join(ARCHS)})") from None


def split_layer_name(name: str, prefix: str):
    """(layer, suffix) for ``{prefix}.{L}.{suffix}``, else None."""
    parts = name.split(".", 2) if prefix == "blk" else name.split(".", 3)
    if prefix == "blk" and len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
        return int(parts[1]), parts[2]
    if prefix == "model.layers" and len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
        return int(parts[2]), parts[3]
    return None


def hf_to_gguf_tensor(arch: GGUFArch, hf_name: str) -> str:
    """GGUF name of a resident HF tensor; ValueError names the tensor it cannot map."""
    if hf_name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[hf_name]
    split = split_layer_name(hf_name, "model.layers")
    if split and split[1] in arch.layer_tensors:
        g = arch.layer_tensors[split[1]]
        if isinstance(g, tuple):      # a Joined matrix: its parts, "+"-separated
            return "+".join(f"blk.{split[0]}.{p}" for p in g)
        return f"blk.{split[0]}.{g}"
    raise ValueError(f"{arch.gguf_arch}: no GGUF name for tensor {hf_name!r}")


def gguf_to_hf_tensor(arch: GGUFArch, gguf_name: str) -> Optional[str]:
    """HF name of a resident GGUF tensor, or None when the table has no entry for it."""
    for hf, g in GLOBAL_TENSORS.items():
        if g == gguf_name:
            return hf
    split = split_layer_name(gguf_name, "blk")
    if split:
        for hf, g in arch.layer_tensors.items():
            if g == split[1] or (isinstance(g, tuple) and split[1] in g):
                return f"model.layers.{split[0]}.{hf}"
    return None


def transform_for(arch: GGUFArch, hf_name: str):
    """The Permute/Values/Joined transform of a resident HF tensor, or None."""
    if hf_name in arch.transforms:
        return arch.transforms[hf_name]
    split = split_layer_name(hf_name, "model.layers")
    return arch.transforms.get(split[1]) if split else None
