"""Tiny random Hugging Face checkpoints for tests (shared with the streaming tests).

``make_hf_model(family, variant)`` builds a transformers model from a small config and perturbs
every parameter (norms, A_log, dt_bias included, so a missing ``+1`` or a skipped term cannot pass);
``save_checkpoint(model, path)`` saves it with ``save_pretrained`` (per-expert keys) or, with
``stacked=True``, writes ``model.state_dict()`` with safetensors ``save_file`` (stacked [E, ...]
expert tensors). ``case(family, variant)`` holds both layouts and transformers' reference outputs,
made once per session.

Router near-ties would let fp32 rounding flip an expert choice, so a seed is accepted only when,
on the test sequence, every router's k-th and (k+1)-th probabilities differ by at least
``ROUTER_MARGIN`` (checked with hooks on the transformers model).
"""
from __future__ import annotations

import json
import math
import os

import torch

ROUTER_MARGIN = 1e-5

# First perturbation seed tried per family (default 0). Qwen3.5-MoE: seed 0's fp32 DeltaNet runs
# chunked vs recurrent 1.9e-5 apart on one logit (transformers' own fp32 logits are 2.2e-5 from its
# fp64 ones on that model): rounding, not a bug, but past the 1e-5 tolerance.
SEED_START = {"qwen3_5_moe": 1}

from lean_qwenflash.families import FAMILIES as _REGISTRY  # noqa: E402

# Every registered family is tested: the list comes from the registry (test_models checks that each
# has a tiny config here).
FAMILIES = tuple(_REGISTRY)

# family -> variant -> config overrides (on top of BASE[family])
BASE = {
    "qwen3_next": dict(
        architectures=["Qwen3NextForCausalLM"], vocab_size=96, hidden_size=48, intermediate_size=40,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=12, linear_num_key_heads=2,
        linear_num_value_heads=4, moe_intermediate_size=20, shared_expert_intermediate_size=24, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    ),
    "qwen3_5_moe": dict(
        architectures=["Qwen3_5MoeForCausalLM"], vocab_size=96, hidden_size=48, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_conv_kernel_dim=4, linear_key_head_dim=16,
        linear_value_head_dim=12, linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=20,
        shared_expert_intermediate_size=24, num_experts=8, num_experts_per_tok=2, rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    ),
    "glm4_moe": dict(
        architectures=["Glm4MoeForCausalLM"], vocab_size=96, hidden_size=48, intermediate_size=40,
        moe_intermediate_size=24, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, n_group=1,
        topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, attention_bias=True, use_qk_norm=True,
        rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    ),
    "deepseek_v3": dict(
        architectures=["DeepseekV3ForCausalLM"], vocab_size=96, hidden_size=48, intermediate_size=40,
        moe_intermediate_size=24, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8,
        n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, rms_norm_eps=1e-6, tie_word_embeddings=False,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
                         "mscale": 1.0, "mscale_all_dim": 0.707, "beta_fast": 32.0, "beta_slow": 1.0},
    ),
    "deepseek_v2": dict(
        architectures=["DeepseekV2ForCausalLM"], vocab_size=96, hidden_size=48, intermediate_size=40,
        moe_intermediate_size=24, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12, n_routed_experts=8,
        n_shared_experts=2, num_experts_per_tok=2, first_k_dense_replace=1, topk_method="group_limited_greedy",
        n_group=4, topk_group=2, routed_scaling_factor=1.5, rms_norm_eps=1e-6, tie_word_embeddings=False,
        max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    "gpt_oss": dict(
        architectures=["GptOssForCausalLM"], vocab_size=96, hidden_size=48, intermediate_size=24, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
        sliding_window=8, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64},
    ),
    "afmoe": dict(
        architectures=["AfmoeForCausalLM"], vocab_size=96, hidden_size=48, intermediate_size=40,
        moe_intermediate_size=24, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_experts=8, num_experts_per_tok=2, num_shared_experts=1, num_dense_layers=1, global_attn_every_n_layers=2,
        sliding_window=8, route_scale=2.0, mup_enabled=True, rms_norm_eps=1e-5, tie_word_embeddings=False,
        max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    "qwen3_moe": dict(
        architectures=["Qwen3MoeForCausalLM"], vocab_size=96, hidden_size=48, intermediate_size=40,
        moe_intermediate_size=24, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, rms_norm_eps=1e-6,
        tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    "mixtral": dict(
        architectures=["MixtralForCausalLM"], vocab_size=96, hidden_size=48, intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
    "olmoe": dict(
        architectures=["OlmoeForCausalLM"], vocab_size=96, hidden_size=48, intermediate_size=24,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=False, rms_norm_eps=1e-5, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
}

# Expert rows of 256 values, so every block encoding (K-quants: 256-value super-blocks) applies.
QUANT_SHAPES = {
    "qwen3_next": dict(hidden_size=256, moe_intermediate_size=256),
    "qwen3_moe": dict(hidden_size=256, moe_intermediate_size=256),
    "qwen3_5_moe": dict(hidden_size=256, moe_intermediate_size=256),
    "afmoe": dict(hidden_size=256, moe_intermediate_size=256),
    "gpt_oss": dict(hidden_size=256, intermediate_size=256),
    "deepseek_v3": dict(hidden_size=256, moe_intermediate_size=256),
    "deepseek_v2": dict(hidden_size=256, moe_intermediate_size=256),
    "glm4_moe": dict(hidden_size=256, moe_intermediate_size=256),
    "mixtral": dict(hidden_size=256, intermediate_size=256),
    "olmoe": dict(hidden_size=256, intermediate_size=256),
}

VARIANTS = {
    "qwen3_next": {
        # GQA 2, Hv/Hk = 2, renormalised top-k, layer types from full_attention_interval.
        "base": {},
        # odd hidden, Hv == Hk, top-3 without renormalisation, a dense layer, explicit layer_types.
        "dense_layer": dict(hidden_size=72, num_attention_heads=3, num_key_value_heads=1, head_dim=24,
                            linear_num_key_heads=3, linear_num_value_heads=3, num_experts_per_tok=3,
                            norm_topk_prob=False, mlp_only_layers=[1],
                            layer_types=["linear_attention", "full_attention", "linear_attention",
                                         "full_attention"]),
    },
    "qwen3_5_moe": {
        # GQA 2, Hv/Hk = 2, layer types from full_attention_interval.
        "base": {},
        # odd hidden, Hv == Hk, top-3, explicit layer_types.
        "mixed": dict(hidden_size=72, num_attention_heads=3, num_key_value_heads=1, head_dim=24,
                      linear_num_key_heads=3, linear_num_value_heads=3, num_experts_per_tok=3,
                      layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"]),
    },
    "glm4_moe": {
        # one dense layer, biased q/k/v, q/k norms, renormalised and scaled weights.
        "base": {},
        # 4 groups of 2 experts, 2 kept, top-3 without renormalisation, no q/k norm or bias, no dense layer.
        "grouped": dict(n_group=4, topk_group=2, num_experts_per_tok=3, norm_topk_prob=False, use_qk_norm=False,
                        attention_bias=False, first_k_dense_replace=0, n_shared_experts=2,
                        routed_scaling_factor=1.0),
    },
    "deepseek_v3": {
        # query compression, YaRN with mscale_all_dim, 2 groups (1 kept), renormalised x 2.5.
        "base": {},
        # no query compression, default rope in rotate-half layout, one group, no renormalisation,
        # every layer sparse.
        "lite": dict(q_lora_rank=None, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                     rope_interleave=False, n_group=1, topk_group=1, norm_topk_prob=False, first_k_dense_replace=0,
                     num_experts_per_tok=3),
    },
    "deepseek_v2": {
        # V2-Lite-like: no query compression, group-limited greedy softmax routing.
        "base": {},
        # query compression, greedy routing, YaRN.
        "greedy": dict(q_lora_rank=24, topk_method="greedy", rope_parameters={
            "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
            "mscale": 0.707, "mscale_all_dim": 0.707}),
    },
    "gpt_oss": {
        # window 8 (the 40-token prompt is 5 windows), layers sliding, full, sliding, full.
        "base": {},
        # window 16, top-3, explicit layer types, the swiglu clamp tighter.
        "window16": dict(sliding_window=16, num_experts_per_tok=3, swiglu_limit=1.5,
                         layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"]),
    },
    "afmoe": {
        # window 8 on layers 0 and 2 (rope), full attention without rope on 1 and 3, muP, one dense layer.
        "base": {},
        # no muP, no dense layer, two shared experts, top-3, every layer but the last sliding.
        "wide": dict(mup_enabled=False, num_dense_layers=0, num_shared_experts=2, num_experts_per_tok=3,
                     global_attn_every_n_layers=4, route_scale=1.0, sliding_window=16),
    },
    "qwen3_moe": {
        "base": {},
        # hidden 72, GQA 3, no renormalisation, layer 0 dense via mlp_only_layers, q/k norms.
        "dense_layer": dict(hidden_size=72, num_attention_heads=6, num_key_value_heads=2, head_dim=12,
                            norm_topk_prob=False, mlp_only_layers=[0], tie_word_embeddings=True),
        # every second layer sparse.
        "sparse_step": dict(decoder_sparse_step=2, num_experts_per_tok=3),
        # sliding-window attention (window 8 < the 40-token prompt) on every layer.
        "window": dict(use_sliding_window=True, sliding_window=8),
    },
    "mixtral": {
        "base": {},
        "gqa4": dict(hidden_size=72, num_attention_heads=8, num_key_value_heads=2, head_dim=12,
                     num_local_experts=6, num_experts_per_tok=3),
        # Mistral-style sliding window on every layer (window 8 < the 40-token prompt).
        "window": dict(sliding_window=8),
    },
    "olmoe": {
        "base": {},
        "norm_topk": dict(norm_topk_prob=True, num_experts_per_tok=3, clip_qkv=4.0),
    },
}


for _family, _shape in QUANT_SHAPES.items():
    VARIANTS[_family]["quant"] = _shape

# tests/test_gguf*.py: the quant shapes, and what llama.cpp's loaders and graphs need (Qwen3-Next /
# Qwen3.5: equal DeltaNet key and value head sizes; AfMoE: full attention every 4th layer; DeepSeek:
# one YaRN mscale, V2 greedy routing; GPT-OSS: YaRN's correction range rounded to whole dims, as
# llama.cpp always does). Not in ALL_CASES: those tests compare these against llama.cpp.
GGUF_VARIANT = "gguf"
GGUF_OVERRIDES = {
    "qwen3_next": dict(linear_value_head_dim=16),
    "qwen3_5_moe": dict(linear_value_head_dim=16),
    "afmoe": dict(global_attn_every_n_layers=4),
    "gpt_oss": dict(rope_parameters=dict(BASE["gpt_oss"]["rope_parameters"], truncate=True)),
    "deepseek_v3": dict(rope_parameters=dict(BASE["deepseek_v3"]["rope_parameters"], mscale=0.707)),
    "deepseek_v2": dict(q_lora_rank=24, topk_method="greedy", rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 0.707, "mscale_all_dim": 0.707}),
}
for _family, _shape in QUANT_SHAPES.items():
    VARIANTS[_family][GGUF_VARIANT] = dict(_shape, **GGUF_OVERRIDES.get(_family, {}))


def hf_config(family: str, variant: str = "base"):
    """A transformers config object for ``family`` / ``variant``."""
    import transformers

    values = dict(BASE[family])
    values.update(VARIANTS[family][variant])
    values.pop("architectures")
    cls = hf_model_class(family).config_class
    config = cls(**values, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    config.architectures = list(BASE[family]["architectures"])
    config._attn_implementation = "eager"
    return config


def _import_qwen3_next_modeling_without_fla() -> None:
    """Import transformers' Qwen3-Next modeling module with flash-linear-attention hidden.

    transformers binds the gated delta rule (and its gated norm) when that module is first imported:
    to fla's Triton kernels whenever ``fla`` imports, and ``lean_qwenflash.models.kernels`` imports it
    first on a GPU machine. Those kernels need CUDA tensors and our references run on the CPU, so
    hide fla for that one import; transformers then keeps its torch code (our kernels keep fla).
    """
    import importlib
    import sys

    from transformers.utils import import_utils

    name = "transformers.models.qwen3_next.modeling_qwen3_next"
    if name in sys.modules:
        return
    saved = {k: m for k, m in sys.modules.items() if k == "fla" or k.startswith("fla.")}
    available = getattr(import_utils, "is_flash_linear_attention_available", None)
    for k in saved:
        del sys.modules[k]
    sys.modules["fla"] = None                    # `import fla` raises ImportError (newer transformers)
    if available is not None:                    # older transformers ask this first
        import_utils.is_flash_linear_attention_available = lambda: False
    try:
        importlib.import_module(name)
    finally:
        del sys.modules["fla"]
        sys.modules.update(saved)
        if available is not None:
            import_utils.is_flash_linear_attention_available = available


def hf_model_class(family: str):
    import transformers

    if family == "qwen3_next":
        _import_qwen3_next_modeling_without_fla()
    return getattr(transformers, BASE[family]["architectures"][0])


def perturb_(model, seed: int) -> None:
    """Give every parameter non-trivial random values with activations of order one."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):      # selection-only router bias (a buffer in HF)
                b.copy_(0.2 * torch.randn(b.shape, generator=gen))
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if name.endswith("norm.weight") or "layernorm" in name:
                # Zero-centred norms (Qwen3-Next) store w-1: small values; others scale around 1.
                zero_centred = model.config.model_type in ("qwen3_next", "qwen3_5_moe_text")
                centre = 0.0 if (zero_centred and "linear_attn.norm" not in name) else 1.0
                p.copy_(centre + 0.2 * torch.randn(p.shape, generator=gen))
            elif leaf == "A_log":
                p.copy_(torch.empty(p.shape).uniform_(0.1, 2.0, generator=gen).log())
            elif leaf == "dt_bias":
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif "conv1d" in name:
                p.copy_(0.5 * torch.randn(p.shape, generator=gen))
            elif "embed_tokens" in name:
                # Tied embeddings double as the head: keep its logits of order one.
                scale = p.shape[-1] ** -0.5 if model.config.tie_word_embeddings else 1.0
                p.copy_(scale * torch.randn(p.shape, generator=gen))
            elif name.endswith(("mlp.gate.weight", "block_sparse_moe.gate.weight", "mlp.router.weight",
                                "mlp.router.gate.weight")):
                p.copy_(3.0 * torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[-1]))
            else:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(fan_in))


def router_margin(model, input_ids: torch.Tensor) -> float:
    """Smallest gap between k-th and (k+1)-th router probability over all tokens and MoE layers."""
    margins = []
    top_k = model.config.num_experts_per_tok

    def hook(module, args, output):
        logits = output[0] if isinstance(output, tuple) else output
        logits = logits.float().reshape(-1, logits.shape[-1])
        bias = getattr(module, "e_score_correction_bias", None)
        if bias is None and len(args) > 1 and torch.is_tensor(args[1]):
            bias = args[1]          # AfMoE: the block hands its expert_bias to the router
        if bias is None and getattr(module, "topk_method", None) == "group_limited_greedy":
            probs = torch.softmax(logits, dim=-1)      # DeepSeek-V2: groups ranked by their best expert
            grouped = probs.view(-1, module.num_group, probs.shape[-1] // module.num_group)
            gscore = grouped.max(-1).values
            keep = gscore.topk(module.topk_group, dim=-1).indices
            mask = torch.zeros(gscore.shape, dtype=torch.bool).scatter_(1, keep, True)
            margins.append(float((gscore.gather(1, keep).min(-1).values
                                  - gscore.masked_fill(mask, -math.inf).max(-1).values).min()))
            probs = probs.masked_fill(~mask.repeat_interleave(probs.shape[-1] // module.num_group, dim=-1), 0.0)
        elif bias is None:
            probs = torch.softmax(logits, dim=-1)
        else:       # sigmoid + correction bias, groups masked (DeepSeek-V3 / GLM): what selection ranks
            probs = logits.sigmoid() + bias
            groups = getattr(module, "num_group", None) or getattr(module, "n_group", 1) or 1
            if groups > 1:
                grouped = probs.view(-1, groups, probs.shape[-1] // groups)
                keep = grouped.topk(2, dim=-1).values.sum(-1).topk(module.topk_group, dim=-1).indices
                mask = torch.zeros(grouped.shape[:2], dtype=torch.bool).scatter_(1, keep, True)
                gscore = grouped.topk(2, dim=-1).values.sum(-1)
                # the kept groups' margin to the best dropped group matters too
                kth = gscore.gather(1, keep).min(-1).values
                dropped = gscore.masked_fill(mask, -math.inf).max(-1).values
                margins.append(float((kth - dropped).min()))
                probs = probs.masked_fill(~mask.repeat_interleave(probs.shape[-1] // groups, dim=-1), -math.inf)
        top = torch.topk(probs, min(top_k + 1, probs.shape[-1]), dim=-1).values
        if top.shape[-1] > top_k:
            margins.append(float((top[:, top_k - 1] - top[:, top_k]).min()))

    handles = [m.register_forward_hook(hook) for n, m in model.named_modules()
               if n.endswith(("mlp.gate", "block_sparse_moe.gate", "mlp.router"))]
    with torch.no_grad():
        model(input_ids)
    for h in handles:
        h.remove()
    return min(margins) if margins else math.inf


def logit_margin(logits: torch.Tensor) -> float:
    """Smallest gap between the best and second-best logit over positions (greedy-flip guard)."""
    top = torch.topk(logits.float(), 2, dim=-1).values
    return float((top[..., 0] - top[..., 1]).min())


def prompt_ids(vocab_size: int, num_tokens: int = 40, seed: int = 1234) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (1, num_tokens), generator=gen)


def make_hf_model(family: str, variant: str = "base", seed: int = None, check_tokens: int = 72):
    """(transformers model, seed used): the first seed from ``seed`` whose routing has margins.

    Margins are checked on the test prompt followed by HF's own greedy continuation, so the
    logits, chunk/decode and greedy comparisons all run on inputs without router near-ties.
    """
    config = hf_config(family, variant)
    cls = hf_model_class(family)
    seed = SEED_START.get(family, 0) if seed is None else seed
    for attempt in range(seed, seed + 50):
        torch.manual_seed(attempt)
        model = cls(config).eval()
        perturb_(model, attempt)
        prompt = prompt_ids(config.vocab_size)
        with torch.no_grad():
            seq = model.generate(prompt, max_new_tokens=check_tokens - prompt.shape[1], do_sample=False,
                                 min_new_tokens=check_tokens - prompt.shape[1])
            logits = model(seq).logits
        if router_margin(model, seq) >= ROUTER_MARGIN and logit_margin(logits[:, prompt.shape[1] - 1:]) >= 1e-4:
            return model, attempt
    raise RuntimeError(f"no seed with router margins for {family}/{variant}")


def save_checkpoint(model, path: str, stacked: bool = False) -> str:
    """Save ``model`` to ``path``: ``save_pretrained`` layout, or the stacked in-memory layout."""
    os.makedirs(path, exist_ok=True)
    if not stacked:
        model.save_pretrained(path)
        return path
    from safetensors.torch import save_file

    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(path)
    return path


def read_config(path: str) -> dict:
    with open(os.path.join(path, "config.json")) as f:
        return json.load(f)


class Case:
    """A tiny checkpoint saved in both layouts plus transformers' reference outputs on it."""

    def __init__(self, family: str, variant: str):
        import tempfile

        self.family, self.variant = family, variant
        self._tmp = tempfile.TemporaryDirectory(prefix=f"lqf-{family}-{variant}-")
        self.hf_model, self.seed = make_hf_model(family, variant)
        self.path = save_checkpoint(self.hf_model, os.path.join(self._tmp.name, "per_expert"))
        self.stacked_path = save_checkpoint(self.hf_model, os.path.join(self._tmp.name, "stacked"), stacked=True)
        self.config = read_config(self.path)
        self.prompt = prompt_ids(self.hf_model.config.vocab_size)
        with torch.no_grad():
            self.hf_logits = self.hf_model(self.prompt).logits
        self._greedy: dict[int, list[int]] = {}   # num_tokens -> continuation

    def hf_greedy(self, num_tokens: int = 32) -> list[int]:
        # Keyed by length: a cached 32-token answer is not the answer to a 16-token request.
        if num_tokens not in self._greedy:
            with torch.no_grad():
                out = self.hf_model.generate(self.prompt, max_new_tokens=num_tokens, min_new_tokens=num_tokens,
                                             do_sample=False)
            self._greedy[num_tokens] = out[0, self.prompt.shape[1]:].tolist()
        return self._greedy[num_tokens]


_CASES: dict = {}


def case(family: str, variant: str = "base") -> Case:
    """The session-wide cached Case for family/variant (made on first use)."""
    key = (family, variant)
    if key not in _CASES:
        _CASES[key] = Case(family, variant)
    return _CASES[key]


ALL_CASES = [(f, v) for f in FAMILIES for v in VARIANTS[f] if v != GGUF_VARIANT]
