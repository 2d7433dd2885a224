"""DeepSeek-V3 (DeepseekV3ForCausalLM): multi-head latent attention with a compressed KV cache (the
latent and the shared rope key per token, not expanded K/V), YaRN rope on the rope part of each
head, the first ``first_k_dense_replace`` layers dense, then sparse layers routed by sigmoid scores
with ``e_score_correction_bias``, group-limited top-k and ``routed_scaling_factor``, plus ungated
shared experts. The multi-token-prediction layer (``model.layers.{num_hidden_layers}.*``) is skipped.
"""
from __future__ import annotations

import torch

from lean_qwenflash.families.base import ConfigReader, ExpertLayout, Family, MoEFacts, dense_prefix_facts
from lean_qwenflash.families.glm4_moe import MOE_KEYS, grouped_router
from lean_qwenflash.families.gguf import (ATTENTION, COMMON_KEYS, GATING_SIGMOID, SHARED_EXPERTS, GGUFArch, Permute,
                                          Split)


def facts(r: ConfigReader) -> MoEFacts:
    return dense_prefix_facts(r, r.positive("n_routed_experts", aliases=("num_local_experts", "num_experts")),
                              r.get("first_k_dense_replace", int, 0), r.positive("moe_layer_freq", 1))


def latent_attention(r: ConfigReader, rope, interleaved: bool):
    """A layer's ``LatentAttention``; ``rope``: the config's ``RopeConfig`` (YaRN's mscale_all_dim
    scales the softmax)."""
    from lean_qwenflash.models.layers.latent_attention import LatentAttention
    from lean_qwenflash.models.layers.rope import mscale

    nope, rope_dim = r.positive("qk_nope_head_dim"), r.positive("qk_rope_head_dim")
    scaling = (nope + rope_dim) ** -0.5
    if rope.type != "default" and rope.mscale_all_dim:
        scaling *= mscale(rope.factor, rope.mscale_all_dim) ** 2
    return LatentAttention(r.positive("hidden_size"), r.positive("num_attention_heads"), r.get("q_lora_rank", int, None),
                           r.positive("kv_lora_rank"), nope, rope_dim, r.positive("v_head_dim"), scaling=scaling,
                           bias=r.get("attention_bias", bool, False), interleaved_rope=interleaved)


def build_deepseek(r: ConfigReader, router_fn, interleaved: bool):
    """The DeepSeek layer stack; ``router_fn(reader, facts)`` makes a sparse layer's router."""
    from lean_qwenflash.models.base import CausalLM, DecoderLayer
    from lean_qwenflash.models.layers.mlp import MLP
    from lean_qwenflash.models.layers.norm import RMSNorm
    from lean_qwenflash.models.layers.rope import Rotary, rope_config
    from lean_qwenflash.models.moe.block import SparseMoeBlock

    f = facts(r)
    rope = rope_config(r)
    hidden = f.hidden_size
    eps = r.get("rms_norm_eps", float, 1e-6)
    sparse = set(f.moe_layers)
    shared = f.expert_intermediate * r.get("n_shared_experts", int, 1)
    layers = []
    for i in range(f.num_layers):
        attn = latent_attention(r, rope, interleaved)
        if i in sparse:
            mlp = SparseMoeBlock(router_fn(r, f), i, hidden, shared, shared_gated=False)
        else:
            mlp = MLP(hidden, r.positive("intermediate_size"))
        layers.append(DecoderLayer("self_attn", attn, "mlp", mlp, RMSNorm(hidden, eps), RMSNorm(hidden, eps)))
    # The rope covers the qk_rope_head_dim part of each head only.
    rotary = Rotary(r.positive("qk_rope_head_dim"), rope)
    return CausalLM(r.config, layers, ["full_attention"] * f.num_layers, RMSNorm(hidden, eps), rotary)


def build(config: dict):
    r = FAMILY.reader(config)
    return build_deepseek(r, grouped_router, r.get("rope_interleave", bool, True))


# -- GGUF (llama.cpp's "deepseek2", shared with DeepSeek-V2: V3 files say expert_gating_func 2) -------
# Latent attention: q_proj is attn_q (no query compression) or attn_q_a / attn_q_a_norm / attn_q_b;
# kv_a_proj_with_mqa is attn_kv_a_mqa; kv_b_proj [heads * (nope + v), kv_lora] is stored per head as
# attn_k_b [heads, kv_lora, nope] (its nope rows, transposed) and attn_v_b [heads, v, kv_lora]
# (current converter), or whole as attn_kv_b (older files; llama.cpp reads both). The metadata then
# says key_length = kv_lora + rope and value_length = kv_lora (the absorbed "MQA" view), and
# key_length_mla / value_length_mla the per-head sizes; older files give the per-head sizes as
# key_length / value_length. llama.cpp's rope pairs neighbouring rope dims (the HF checkpoints'
# rope_interleave layout); a checkpoint with rope_interleave false has its rope rows interleaved on
# export (a row permutation), so every GGUF-born config says rope_interleave true. YaRN's mscale_all_dim
# is rope.scaling.yarn_log_multiplier (x 0.1).

def _mla_dims(config: dict):
    return (int(config["num_attention_heads"]), int(config["qk_nope_head_dim"]), int(config["qk_rope_head_dim"]),
            int(config["v_head_dim"]), int(config["kv_lora_rank"]))


def _split_kv_b(w, config: dict):
    heads, nope, _, v, rank = _mla_dims(config)
    per_head = w.reshape(heads, nope + v, rank)
    return per_head[:, :nope].transpose(1, 2), per_head[:, nope:]


def _join_kv_b(parts, config: dict):
    heads, nope, _, v, rank = _mla_dims(config)
    k_b, v_b = parts
    return torch.cat([k_b.transpose(1, 2), v_b], dim=1).reshape(heads * (nope + v), rank)


def _rope_rows(count_rows: int, rope: int, blocks: int, offset: int):
    """GGUF rows of ``blocks`` blocks of ``count_rows`` rows whose last ``rope`` rows are rope dims:
    those interleaved (GGUF row 2i + s is HF row s * rope/2 + i), the others in place."""
    half = rope // 2
    one = torch.arange(count_rows)
    one[offset:] = offset + (torch.arange(2).repeat(half) * half + torch.arange(half).repeat_interleave(2))
    return (torch.arange(blocks)[:, None] * count_rows + one[None, :]).reshape(-1)


def _rope_perm(which: str) -> Permute:
    """Interleave the rope rows of q ("q": per head) or of kv_a ("kv") when the HF checkpoint keeps
    them in rotate-half order (rope_interleave false); the identity otherwise."""
    def perm(config: dict) -> torch.Tensor:
        heads, nope, rope, _, rank = _mla_dims(config)
        rows, blocks, offset = (nope + rope, heads, nope) if which == "q" else (rank + rope, 1, rank)
        if config.get("rope_interleave", True):
            return torch.arange(rows * blocks)
        return _rope_rows(rows, rope, blocks, offset)
    return Permute(perm)


def _gguf_config(meta, tensors) -> dict:
    rope = int(meta("rope.dimension_count"))
    split = "blk.0.attn_k_b.weight" in tensors
    key = int(meta("attention.key_length_mla", 0) or 0) or (0 if split else int(meta("attention.key_length")))
    value = int(meta("attention.value_length_mla", 0) or 0) or (0 if split else int(meta("attention.value_length")))
    if not key or not value:
        raise ValueError("deepseek2: attention.key_length_mla / value_length_mla are missing (a file with "
                         "attn_k_b / attn_v_b needs them)")
    heads = int(meta("attention.head_count"))
    q_lora = int(meta("attention.q_lora_rank", 0) or 0)
    cfg = {"kv_lora_rank": int(meta("attention.kv_lora_rank")), "q_lora_rank": q_lora or None,
           "qk_rope_head_dim": rope, "qk_nope_head_dim": key - rope, "v_head_dim": value,
           "num_key_value_heads": heads, "head_dim": rope, "rope_interleave": True,
           "n_group": int(meta("expert_group_count", 1) or 1), "topk_group": int(meta("expert_group_used_count", 1) or 1),
           "norm_topk_prob": bool(meta("expert_weights_norm", False)),
           "routed_scaling_factor": float(meta("expert_weights_scale", 1.0))}
    return cfg


def _gguf_metadata(config: dict) -> dict:
    heads, nope, rope, v, rank = _mla_dims(config)
    out = {"attention.kv_lora_rank": rank, "rope.dimension_count": rope, "attention.head_count_kv": 1,
           "leading_dense_block_count": int(config.get("first_k_dense_replace") or 0),
           "expert_shared_count": int(1 if config.get("n_shared_experts") is None else config["n_shared_experts"]),
           "expert_weights_scale": float(config.get("routed_scaling_factor") or 1.0),
           "expert_weights_norm": bool(config.get("norm_topk_prob", False)),
           "expert_group_count": int(config.get("n_group") or 1), "expert_group_used_count": int(config.get("topk_group") or 1)}
    # 0: no query compression (llama.cpp asks for the key unless the model has V2-Lite's 27 layers)
    out["attention.q_lora_rank"] = int(config.get("q_lora_rank") or 0)
    if config.get("_gguf_alternatives"):      # the older layout: attn_kv_b, per-head sizes, every head's K/V
        out.update({"attention.key_length": nope + rope, "attention.value_length": v, "attention.head_count_kv": heads})
    else:
        out.update({"attention.key_length": rank + rope, "attention.value_length": rank,
                    "attention.key_length_mla": nope + rope, "attention.value_length_mla": v})
    rp = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rp.get("rope_type", rp.get("type")) == "yarn":
        m, m_all = rp.get("mscale"), rp.get("mscale_all_dim")
        if m_all:
            if m is not None and float(m) != float(m_all):
                raise ValueError(f"deepseek2: llama.cpp's YaRN takes one mscale (rope.scaling.yarn_log_multiplier); "
                                 f"this config has mscale {m} and mscale_all_dim {m_all}")
            out["rope.scaling.yarn_log_multiplier"] = 0.1 * float(m_all)
    return out


def deepseek_gguf(gating: int, accepts) -> GGUFArch:
    """The "deepseek2" declaration with ``gating`` (llama.cpp's expert_gating_func)."""
    def metadata(config: dict) -> dict:
        return {**_gguf_metadata(config), "expert_gating_func": gating}
    return GGUFArch(
        "deepseek2",
        {**{k: v for k, v in ATTENTION.items() if not k.startswith("self_attn.")},
         "self_attn.q_proj.weight": "attn_q.weight",
         "self_attn.q_a_proj.weight": "attn_q_a.weight",
         "self_attn.q_a_layernorm.weight": "attn_q_a_norm.weight",
         "self_attn.q_b_proj.weight": "attn_q_b.weight",
         "self_attn.kv_a_proj_with_mqa.weight": "attn_kv_a_mqa.weight",
         "self_attn.kv_a_layernorm.weight": "attn_kv_a_norm.weight",
         "self_attn.kv_b_proj.weight": ("attn_k_b.weight", "attn_v_b.weight"),
         "self_attn.o_proj.weight": "attn_output.weight",
         "mlp.gate.e_score_correction_bias": "exp_probs_b.bias",
         **SHARED_EXPERTS},
        config_keys={k: v for k, v in {**COMMON_KEYS, **MOE_KEYS}.items()
                     if k not in ("head_dim", "num_key_value_heads")},
        transforms={"self_attn.kv_b_proj.weight": Split(_split_kv_b, _join_kv_b,
                                                        parts=("attn_k_b.weight", "attn_v_b.weight")),
                    "self_attn.q_proj.weight": _rope_perm("q"), "self_attn.q_b_proj.weight": _rope_perm("q"),
                    "self_attn.kv_a_proj_with_mqa.weight": _rope_perm("kv")},
        alternatives={"self_attn.kv_b_proj.weight": "attn_kv_b.weight"},
        num_experts_key="n_routed_experts",
        extra_config=_gguf_config, extra_metadata=metadata,
        accepts=accepts)


GGUF = deepseek_gguf(GATING_SIGMOID, lambda meta: int(meta("expert_gating_func", 0) or 0) == GATING_SIGMOID)


FAMILY = Family(name="deepseek_v3", architectures=("DeepseekV3ForCausalLM",), model_types=("deepseek_v3",),
                layout=ExpertLayout(), facts_fn=facts, build_fn=build, gguf=GGUF)
