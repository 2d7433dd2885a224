"""GPT-OSS (GptOssForCausalLM): GQA with biased projections and per-head attention sinks,
alternating sliding-window / full attention (``layer_types``; a window layer's cache holds only
the last ``sliding_window`` tokens), YaRN rope, every layer sparse: router logits with a bias, top-k,
softmax over the k; experts with biases and a clamped SwiGLU, stored stacked and transposed with
gate/up columns interleaved (``mlp.experts.gate_up_proj`` [E, H, 2I], ``down_proj`` [E, I, H]).
Released checkpoints store the experts as MXFP4 (``*_blocks`` [E, rows, cols/32, 16] and ``*_scales``,
rows not transposed, gate/up rows interleaved): the packer keeps them as the ``mxfp4`` encoding,
nibbles and scale bytes rearranged into GGML's block layout (store/checkpoint.py ``expert_raw``).

The expert biases stay resident; the expert math runs in torch (the native fused kernels compute
the plain SwiGLU only), so GPT-OSS does not get the native expert kernels yet.
"""
from __future__ import annotations

import torch

from lean_qwenflash.families.base import ConfigReader, ExpertLayout, Family, MoEFacts, dense_prefix_facts, periodic_layer_types
from lean_qwenflash.families.gguf import COMMON_KEYS, GGUFArch, Split


def facts(r: ConfigReader) -> MoEFacts:
    return dense_prefix_facts(r, r.positive("num_local_experts", aliases=("num_experts",)),
                              intermediate_key="intermediate_size", top_k_aliases=("experts_per_token",))


def build(config: dict):
    """GPT-OSS's oddities are their own classes: ``SinkAttention`` (per-head sinks),
    ``TopKSoftmaxRouter`` and ``ClampedSwiGLUExperts`` (the biased, clamped expert math)."""
    from lean_qwenflash.models.base import CausalLM, DecoderLayer
    from lean_qwenflash.models.layers.attention import SinkAttention
    from lean_qwenflash.models.layers.norm import RMSNorm
    from lean_qwenflash.models.layers.rope import Rotary, attention_head_dim, rope_config
    from lean_qwenflash.models.moe.block import SparseMoeBlock
    from lean_qwenflash.models.moe.experts import ClampedSwiGLUExperts
    from lean_qwenflash.models.moe.routers import TopKSoftmaxRouter

    r = FAMILY.reader(config)
    f = facts(r)
    hidden = f.hidden_size
    eps = r.get("rms_norm_eps", float, 1e-5)
    head_dim = attention_head_dim(r)
    types = periodic_layer_types(r, "sliding_attention", 2)
    window = r.positive("sliding_window") if "sliding_attention" in types else None
    layers = []
    for i, kind in enumerate(types):
        attn = SinkAttention(hidden, r.positive("num_attention_heads"), r.positive("num_key_value_heads"), head_dim,
                             bias=r.get("attention_bias", bool, True),
                             sliding_window=window if kind == "sliding_attention" else None)
        experts = ClampedSwiGLUExperts(f.num_experts, hidden, f.expert_intermediate,
                                       r.get("swiglu_alpha", float, 1.702), r.get("swiglu_limit", float, 7.0))
        block = SparseMoeBlock(TopKSoftmaxRouter(hidden, f.num_experts, f.top_k), i, hidden, router_name="router",
                               experts=experts)
        layers.append(DecoderLayer("self_attn", attn, "mlp", block, RMSNorm(hidden, eps), RMSNorm(hidden, eps)))
    return CausalLM(r.config, layers, types, RMSNorm(hidden, eps), Rotary(head_dim, rope_config(r)))


# -- GGUF (llama.cpp's "gpt-oss") -------------------------------------------------------------------
# llama.cpp's graph fixes what the HF config may vary: sliding-window attention on even layers and
# full attention on odd ones (its swa pattern 2), the clamped SwiGLU with alpha 1.702 and limit 7.0,
# softmax over the top-k router logits. The experts' gate/up biases (HF: one [E, 2I] tensor with
# gate and up interleaved) are two GGUF tensors, ffn_gate_exps.bias and ffn_up_exps.bias [E, I].

def _split_gate_up_bias(b, config: dict):
    return b[..., 0::2], b[..., 1::2]


def _join_gate_up_bias(parts, config: dict):
    gate, up = parts
    return torch.stack((gate, up), dim=-1).reshape(*gate.shape[:-1], 2 * gate.shape[-1])


def _layer_types(num_layers: int) -> list[str]:
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]


def _gguf_config(meta, tensors) -> dict:
    return {"layer_types": _layer_types(int(meta("block_count"))), "attention_bias": "blk.0.attn_q.bias" in tensors}


def _gguf_metadata(config: dict) -> dict:
    r = FAMILY.reader(config)
    types = periodic_layer_types(r, "sliding_attention", 2)
    if types != _layer_types(len(types)):
        raise ValueError(f"gpt-oss: llama.cpp runs sliding-window attention on even layers and full attention on odd "
                         f"ones; this config's layer_types are {types}")
    for key, want in (("swiglu_limit", 7.0), ("swiglu_alpha", 1.702)):
        if r.get(key, float, want) != want:
            raise ValueError(f"gpt-oss: llama.cpp's expert activation uses {key} {want}; this config has {r.get(key, float)}")
    if not r.get("attention_bias", bool, True):
        raise ValueError("gpt-oss: llama.cpp's gpt-oss graph expects attention biases (attention_bias true)")
    return {"attention.sliding_window": r.positive("sliding_window")}


GGUF = GGUFArch(
    "gpt-oss",
    {"input_layernorm.weight": "attn_norm.weight",
     "post_attention_layernorm.weight": "post_attention_norm.weight",
     **{f"self_attn.{p}_proj.{w}": f"attn_{g}.{w}" for p, g in (("q", "q"), ("k", "k"), ("v", "v"), ("o", "output"))
        for w in ("weight", "bias")},
     "self_attn.sinks": "attn_sinks.weight",
     "mlp.router.weight": "ffn_gate_inp.weight",
     "mlp.router.bias": "ffn_gate_inp.bias",
     "mlp.experts.gate_up_proj_bias": ("ffn_gate_exps.bias", "ffn_up_exps.bias"),
     "mlp.experts.down_proj_bias": "ffn_down_exps.bias"},
    config_keys={**COMMON_KEYS, "sliding_window": "attention.sliding_window"},
    transforms={"mlp.experts.gate_up_proj_bias": Split(_split_gate_up_bias, _join_gate_up_bias,
                                                       parts=("ffn_gate_exps.bias", "ffn_up_exps.bias"))},
    implied_config={"swiglu_limit": 7.0, "swiglu_alpha": 1.702},
    num_experts_key="num_local_experts", expert_width_key="intermediate_size",
    extra_config=_gguf_config, extra_metadata=_gguf_metadata)


FAMILY = Family(name="gpt_oss", architectures=("GptOssForCausalLM",), model_types=("gpt_oss",),
                layout=ExpertLayout(stacked_transposed=True, gate_up_interleaved=True,
                                    resident_suffixes=("gate_up_proj_bias", "down_proj_bias")),
                facts_fn=facts, build_fn=build, gguf=GGUF)
