"""Qwen3-Next (Qwen3NextForCausalLM): Gated DeltaNet layers with a gated full-attention layer every
few layers, zero-centred RMSNorms, partial rotary, many small routed experts (softmax top-k) plus a
sigmoid-gated shared expert. The checkpoint's multi-token-prediction head (``mtp.*``) is not used."""
from __future__ import annotations

import torch

from lean_qwenflash.families.base import ConfigReader, ExpertLayout, Family, MoEFacts, periodic_layer_types, sparse_layers
from lean_qwenflash.families.gguf import ATTENTION, GGUFArch, Joined, Values, plus_one
from lean_qwenflash.families.gguf import head_dim as gguf_head_dim


def layer_types(config: dict) -> list[str]:
    """``layer_types`` when the config has it, else full attention every ``full_attention_interval``."""
    return _layer_types(FAMILY.reader(config))


def _layer_types(r: ConfigReader) -> list[str]:
    return periodic_layer_types(r, "linear_attention", r.positive("full_attention_interval", 4))


def facts(r: ConfigReader) -> MoEFacts:
    experts = r.get("num_experts", int, 0, aliases=("num_local_experts",))
    return MoEFacts(r.positive("num_hidden_layers"), sparse_layers(r, experts), experts,
                    r.positive("num_experts_per_tok") if experts else 0, r.positive("hidden_size"),
                    r.positive("moe_intermediate_size") if experts else 0)


def build(config: dict):
    return build_hybrid(FAMILY.reader(config))


def build_hybrid(r: ConfigReader, split_projections: bool = False):
    """The Qwen3-Next layer stack (also Qwen3.5-MoE's text model, whose DeltaNet input projections
    are four flat tensors: ``split_projections``)."""
    from functools import partial

    from lean_qwenflash.models.base import CausalLM, DecoderLayer
    from lean_qwenflash.models.layers.attention import QueryGatedAttention
    from lean_qwenflash.models.layers.deltanet import GatedDeltaNet
    from lean_qwenflash.models.layers.mlp import MLP
    from lean_qwenflash.models.layers.norm import RMSNorm
    from lean_qwenflash.models.layers.rope import Rotary, attention_head_dim, rope_config
    from lean_qwenflash.models.moe.block import SparseMoeBlock
    from lean_qwenflash.models.moe.routers import SoftmaxRouter

    f = facts(r)
    hidden = f.hidden_size
    eps = r.get("rms_norm_eps", float, 1e-6)
    head_dim = attention_head_dim(r)
    types = _layer_types(r)
    moe_layers = set(f.moe_layers)
    layers = []
    for layer_idx, kind in enumerate(types):
        if kind == "linear_attention":
            mixer_name = "linear_attn"
            mixer = GatedDeltaNet(hidden, r.positive("linear_num_key_heads"), r.positive("linear_num_value_heads"),
                                  r.positive("linear_key_head_dim"), r.positive("linear_value_head_dim"),
                                  r.positive("linear_conv_kernel_dim", 4), eps, split_projections=split_projections)
        else:
            mixer_name = "self_attn"
            mixer = QueryGatedAttention(hidden, r.positive("num_attention_heads"), r.positive("num_key_value_heads"),
                                        head_dim, bias=r.get("attention_bias", bool, False),
                                        qk_norm=partial(RMSNorm, eps=eps, zero_centred=True))
        if layer_idx in moe_layers:
            router = SoftmaxRouter(hidden, f.num_experts, f.top_k, r.get("norm_topk_prob", bool, True))
            mlp = SparseMoeBlock(router, layer_idx, hidden, r.get("shared_expert_intermediate_size", int, 0))
        else:
            mlp = MLP(hidden, r.positive("intermediate_size"))
        layers.append(DecoderLayer(mixer_name, mixer, "mlp", mlp, RMSNorm(hidden, eps, zero_centred=True),
                                   RMSNorm(hidden, eps, zero_centred=True)))
    rotary = Rotary(head_dim, rope_config(r, default_partial=0.25)) if "full_attention" in types else None
    return CausalLM(r.config, layers, types, RMSNorm(hidden, eps, zero_centred=True), rotary)


# -- GGUF (llama.cpp's "qwen3next") ------------------------------------------------------------------
# DeltaNet sizes and layer types live under ssm.* keys; in_proj_qkvz is stored as two tensors with its
# rows regrouped, A_log as -exp(A_log), the conv weight squeezed and the zero-centred norms as 1 + w.

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


def _gguf_config(meta, tensors) -> dict:
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


def _gguf_metadata(config: dict) -> dict:
    nk, nv, hk, hv = _linear_dims(config)
    head_dim = gguf_head_dim(config)
    rope = dict(config.get("rope_parameters") or {})
    # the partial-rotary default build_hybrid gives rope_config (0.25)
    partial = float(rope.get("partial_rotary_factor", config.get("partial_rotary_factor", 0.25)))
    out = {"ssm.conv_kernel": int(config.get("linear_conv_kernel_dim", 4)), "ssm.state_size": hk,
           "ssm.group_count": nk, "ssm.time_step_rank": nv, "ssm.inner_size": nv * hv,
           "full_attention_interval": int(config.get("full_attention_interval", 4)),
           "rope.dimension_count": int(head_dim * partial),
           "expert_shared_feed_forward_length": int(config.get("shared_expert_intermediate_size", 0))}
    if config.get("layer_types"):
        out["attention.recurrent_layers"] = [t == "linear_attention" for t in config["layer_types"]]
    return out


_QKVZ = Joined(perm=_qkvz_perm, parts=("attn_qkv.weight", "attn_gate.weight"), rows=_qkvz_rows)

GGUF = GGUFArch(
    "qwen3next",
    {**{k: v for k, v in ATTENTION.items() if k != "post_attention_layernorm.weight"},
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
     "linear_attn.in_proj_qkvz.weight": _QKVZ.parts},
    transforms={"linear_attn.in_proj_qkvz.weight": _QKVZ,
                "linear_attn.A_log": Values(lambda a, c: -a.exp(), lambda a, c: (-a).log()),
                "linear_attn.conv1d.weight": Values(lambda w, c: w.squeeze(1), lambda w, c: w.unsqueeze(1)),
                # [1, H]; llama.cpp's quantizer rewrites it as a vector
                "mlp.shared_expert_gate.weight": Values(lambda w, c: w, lambda w, c: w.reshape(1, -1)),
                **{n: plus_one() for n in ("input_layernorm.weight", "post_attention_layernorm.weight",
                                           "self_attn.q_norm.weight", "self_attn.k_norm.weight",
                                           "model.norm.weight")}},
    implied_config={"norm_topk_prob": True}, extra_config=_gguf_config, extra_metadata=_gguf_metadata)


FAMILY = Family(
    name="qwen3_next", architectures=("Qwen3NextForCausalLM",), model_types=("qwen3_next",),
    layout=ExpertLayout(ignored_prefixes=("mtp.",)), facts_fn=facts, build_fn=build, gguf=GGUF)
