"""DeepSeek-V2 / V2-Lite (DeepseekV2ForCausalLM): DeepSeek-V3's latent attention and layer stack
(V2-Lite: no query compression, ``q_lora_rank`` null), rope dims always interleaved, softmax routing
(``greedy`` or ``group_limited_greedy``) whose top-k scores times ``routed_scaling_factor`` are the
weights, and ungated shared experts."""
from __future__ import annotations

from lean_qwenflash.families.base import ConfigReader, ExpertLayout, Family, MoEFacts
from lean_qwenflash.families.deepseek_v3 import build_deepseek, facts


def softmax_router(r: ConfigReader, f: MoEFacts):
    """DeepSeek-V2's router (a ``SoftmaxGroupRouter``) from its config keys."""
    from lean_qwenflash.models.moe.routers import SoftmaxGroupRouter

    return SoftmaxGroupRouter(f.hidden_size, f.num_experts, f.top_k, r.get("routed_scaling_factor", float, 1.0),
                              r.get("topk_method", str, "greedy"), r.get("n_group", int, 1) or 1,
                              r.get("topk_group", int, 1) or 1)


def build(config: dict):
    return build_deepseek(FAMILY.reader(config), softmax_router, interleaved=True)


FAMILY = Family(name="deepseek_v2", architectures=("DeepseekV2ForCausalLM",), model_types=("deepseek_v2",),
                layout=ExpertLayout(), facts_fn=facts, build_fn=build)
