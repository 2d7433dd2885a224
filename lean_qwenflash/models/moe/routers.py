"""Routers: the linear layer of expert logits plus the rule that picks each token's experts.

``route(x)`` -> (weights [N, k], indices [N, k]) is what the sparse block computes; ``predict(x, n)``
-> indices [N, n] ranks experts by the same rule (the first k are exactly ``route``'s), which the
prefetcher applies to a stale layer input to guess the next layer's experts. A rule that needs more
than x is handed it by its block (``SigmoidBiasRouter``: AfMoE's block-level expert bias).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lean_qwenflash.models import native
from lean_qwenflash.models.layers.linear import Linear


class Router(Linear):
    """A router: the linear layer of expert logits (HF keys ``{block}.{name}.weight`` [E, H], and
    ``.bias`` when it has one) plus the rule that picks experts. Subclasses own the rule.

    ``*selection``: what a rule takes beyond x (the block hands it over; none for most rules).
    """

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, bias: bool = False):
        super().__init__(hidden_size, num_experts, bias=bias)
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k={top_k} must be in 1..num_experts={num_experts}")
        self.num_experts, self.top_k = num_experts, top_k

    def route(self, x: torch.Tensor, *selection) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def route_lists(self, x: torch.Tensor):
        """One token x [1, H]: (expert ids ascending, fp32 weights) as lists from one native call,
        or None (the rule has no native form, or the policy / the tensors do not allow it: then
        ``route``)."""
        return None

    def fp32_logits(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 logits from fp32 inputs, as the sigmoid / grouped rules define them (an encoded
        router: its own kernel)."""
        return F.linear(x.float(), self.weight.float()) if self.qweight is None else self(x).float()

    def selection_scores(self, x: torch.Tensor, *selection) -> torch.Tensor:
        """[N, E]: larger = chosen first (experts the rule cannot choose are -inf)."""
        return self(x).float()

    def predict(self, x: torch.Tensor, n: int, *selection) -> torch.Tensor:
        scores = self.selection_scores(x, *selection)
        return torch.topk(scores, min(n, scores.shape[-1]), dim=-1).indices


class SoftmaxRouter(Router):
    """Softmax over all experts, top-k, optionally renormalised (Qwen3-MoE, Qwen3-Next, Mixtral, OLMoE)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, norm_topk_prob: bool):
        super().__init__(hidden_size, num_experts, top_k)
        self.norm_topk_prob = norm_topk_prob

    def _native_weight(self, x):
        """The weight the native router reads, or None (not fast mode, not one fp32 CPU row, ...)."""
        if self.ctx.policy.kernel_mode != "fast" or x.dtype != torch.float32 or x.device.type != "cpu" \
                or x.numel() != self.in_features:
            return None
        weight = self.weight if self.qweight is None else self.qweight
        if not native.supports(weight) or (self.bias is not None and self.bias.dtype != torch.float32):
            return None
        return weight

    def route_lists(self, x):
        weight = self._native_weight(x)
        if weight is None:
            return None
        return native.route_softmax(weight, x, self.bias, self.top_k, self.norm_topk_prob,
                                    isa=self.ctx.policy.isa, threads=self.ctx.policy.native_threads)

    def predict(self, x, n, *selection):
        weight = self._native_weight(x)
        if weight is None:
            return super().predict(x, n, *selection)
        ids, _ = native.route_softmax(weight, x, self.bias, min(n, self.num_experts), False, by_rank=True,
                                      isa=self.ctx.policy.isa, threads=self.ctx.policy.native_threads)
        return torch.tensor([ids])

    def route(self, x):
        probs = F.softmax(self(x), dim=-1, dtype=torch.float32)
        weights, indices = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, indices


class SigmoidRouter(Router):
    """DeepSeek-V3's rule with the selection bias given: sigmoid scores; the selection adds the bias
    and keeps only the ``topk_group`` best of ``n_group`` expert groups (a group scores the sum of
    its two best); the weights are the un-biased scores of the chosen experts, renormalised
    (``norm_topk_prob``, +1e-20) and scaled by ``routed_scaling_factor``. All in fp32."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, norm_topk_prob: bool,
                 routed_scaling_factor: float = 1.0, n_group: int = 1, topk_group: int = 1):
        super().__init__(hidden_size, num_experts, top_k)
        if num_experts % n_group or not 0 < topk_group <= n_group:
            raise ValueError(f"n_group={n_group} must divide num_experts={num_experts} and topk_group={topk_group} "
                             f"be in 1..n_group")
        self.norm_topk_prob, self.routed_scaling_factor = norm_topk_prob, routed_scaling_factor
        self.n_group, self.topk_group = n_group, topk_group

    def _scores(self, x, bias):
        """(sigmoid scores, selection scores with groups masked) [N, E], fp32."""
        scores = self.fp32_logits(x).sigmoid()
        choice = scores + bias.float()
        if self.n_group > 1:
            grouped = choice.view(-1, self.n_group, self.num_experts // self.n_group)
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
            keep = torch.topk(group_scores, self.topk_group, dim=-1).indices
            mask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep, True)
            choice = choice.masked_fill(~mask.repeat_interleave(self.num_experts // self.n_group, dim=-1),
                                        float("-inf"))
        return scores, choice

    def route(self, x, bias):
        scores, choice = self._scores(x, bias)
        indices = torch.topk(choice, self.top_k, dim=-1).indices
        weights = scores.gather(1, indices)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.routed_scaling_factor, indices

    def selection_scores(self, x, bias):
        return self._scores(x, bias)[1]


class SigmoidGroupRouter(SigmoidRouter):
    """DeepSeek-V3 / GLM-4.5 routing: the sigmoid rule whose selection bias is the router's own
    ``e_score_correction_bias`` [E]."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, norm_topk_prob: bool,
                 routed_scaling_factor: float = 1.0, n_group: int = 1, topk_group: int = 1):
        super().__init__(hidden_size, num_experts, top_k, norm_topk_prob, routed_scaling_factor, n_group, topk_group)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts))

    def route(self, x):
        return super().route(x, self.e_score_correction_bias)

    def selection_scores(self, x):
        return super().selection_scores(x, self.e_score_correction_bias)


class SigmoidBiasRouter(SigmoidRouter):
    """AfMoE routing: the sigmoid rule with one group, always renormalised, scaled by
    ``route_scale``; its selection bias lives on the block (HF ``mlp.expert_bias``), which hands it
    to ``route`` / ``predict`` (``ExpertBiasMoeBlock``)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, route_scale: float):
        super().__init__(hidden_size, num_experts, top_k, True, route_scale)


class SoftmaxGroupRouter(Router):
    """DeepSeek-V2 routing: softmax over all experts (fp32); ``group_limited_greedy`` keeps the
    ``topk_group`` of ``n_group`` groups with the highest single score; the top-k scores, times
    ``routed_scaling_factor``, are the weights (not renormalised)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, routed_scaling_factor: float = 1.0,
                 topk_method: str = "greedy", n_group: int = 1, topk_group: int = 1):
        super().__init__(hidden_size, num_experts, top_k)
        if topk_method not in ("greedy", "group_limited_greedy"):
            raise ValueError(f"topk_method {topk_method!r} is not supported (greedy, group_limited_greedy)")
        if topk_method == "group_limited_greedy" and (num_experts % n_group or not 0 < topk_group <= n_group):
            raise ValueError(f"n_group={n_group} must divide num_experts={num_experts} and topk_group={topk_group} "
                             "be in 1..n_group")
        self.routed_scaling_factor, self.topk_method = routed_scaling_factor, topk_method
        self.n_group, self.topk_group = n_group, topk_group

    def selection_scores(self, x):
        scores = self.fp32_logits(x).softmax(dim=-1)
        if self.topk_method == "group_limited_greedy":
            grouped = scores.view(-1, self.n_group, self.num_experts // self.n_group)
            keep = torch.topk(grouped.max(dim=-1).values, self.topk_group, dim=-1).indices
            mask = torch.zeros(grouped.shape[:2], dtype=torch.bool, device=x.device).scatter_(1, keep, True)
            scores = scores.masked_fill(~mask.repeat_interleave(self.num_experts // self.n_group, dim=-1), 0.0)
        return scores

    def route(self, x):
        weights, indices = torch.topk(self.selection_scores(x), self.top_k, dim=-1)
        return weights * self.routed_scaling_factor, indices


class TopKSoftmaxRouter(Router):
    """GPT-OSS routing: logits with a bias, top-k of the logits, softmax over those k only."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int):
        super().__init__(hidden_size, num_experts, top_k, bias=True)

    def route(self, x):
        values, indices = torch.topk(self(x).float(), self.top_k, dim=-1)
        return torch.softmax(values, dim=-1), indices
