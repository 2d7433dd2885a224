"""DeepSeek-V2 / V2-Lite (DeepseekV2ForCausalLM): DeepSeek-V3's latent attention and layer stack
(V2-Lite: no query compression, ``q_lora_rank`` null), rope dims always interleaved, softmax routing
(``greedy`` or ``group_limited_greedy``) whose top-k scores times ``routed_scaling_factor`` are the
weights, and ungated shared experts."""
from __future__ import annotations

from lean_qwenflash.families.base import ConfigReader, ExpertLayout, Family, MoEFacts
from lean_qwenflash.families.deepseek_v3 import build_deepseek, deepseek_gguf, facts
from lean_qwenflash.families.gguf import GATING_SIGMOID, GATING_SOFTMAX


def softmax_router(r: ConfigReader, f: MoEFacts):
    """DeepSeek-V2's router (a ``SoftmaxGroupRouter``) from its config keys."""
    from lean_qwenflash.models.moe.routers import SoftmaxGroupRouter

    return SoftmaxGroupRouter(f.hidden_size, f.num_experts, f.top_k, r.get("routed_scaling_factor", float, 1.0),
                              r.get("topk_method", str, "greedy"), r.get("n_group", int, 1) or 1,
                              r.get("topk_group", int, 1) or 1)


def build(config: dict):
    return build_deepseek(FAMILY.reader(config), softmax_router, interleaved=True)


# -- GGUF: llama.cpp's "deepseek2" (deepseek_v3.py holds the table); V2 files have softmax gating
# (expert_gating_func 1, or no key: the files made before the key existed). llama.cpp's expert groups
# rank a group by the sum of its top-2 scores (V3's rule), where V2's group_limited_greedy takes the
# group's best score: a V2 config with several groups is refused on export.

def _accepts(meta) -> bool:
    return int(meta("expert_gating_func", 0) or 0) != GATING_SIGMOID


def _gguf():
    base = deepseek_gguf(GATING_SOFTMAX, _accepts)

    def extra_config(meta, tensors) -> dict:
        cfg = base.extra_config(meta, tensors)
        cfg["topk_method"] = "group_limited_greedy" if cfg["n_group"] > 1 else "greedy"
        return cfg

    def extra_metadata(config: dict) -> dict:
        grouped = config.get("topk_method", "greedy") == "group_limited_greedy"
        if int(config.get("n_group") or 1) > 1 and grouped:
            raise ValueError("deepseek2: llama.cpp ranks expert groups by the sum of their top-2 scores (V3); "
                             f"DeepSeek-V2's group_limited_greedy takes the best score (n_group {config['n_group']})")
        # greedy routing ignores n_group / topk_group: no groups for llama.cpp
        return {**base.extra_metadata(config), **({} if grouped else {"expert_group_count": 1,
                                                                      "expert_group_used_count": 1})}
    from dataclasses import replace
    return replace(base, extra_config=extra_config, extra_metadata=extra_metadata)


GGUF = _gguf()


FAMILY = Family(name="deepseek_v2", architectures=("DeepseekV2ForCausalLM",), model_types=("deepseek_v2",),
                layout=ExpertLayout(), facts_fn=facts, build_fn=build, gguf=GGUF)
