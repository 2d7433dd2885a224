"""The sparse MoE block: a router picks each token's experts, a provider serves their weights
(resident or streamed), ``routed_experts`` sums their outputs; plus an optional shared expert.
``ExpertBiasMoeBlock`` is AfMoE's block, whose selection bias lives on the block."""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from lean_qwenflash.models import kernels
from lean_qwenflash.models.layers.linear import Linear
from lean_qwenflash.models.layers.mlp import MLP
from lean_qwenflash.models.moe.routers import Router
from lean_qwenflash.models.policy import STANDALONE, ExecContext


def routed_experts(x: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, provider, layer_idx: int,
                   ctx: ExecContext = STANDALONE, expert_fn=None) -> torch.Tensor:
    """Sum over each token's selected experts of ``weight * down(silu(gate) * up)``.

    x [N, H], weights and indices [N, k]. The provider is asked once for the unique selected ids
    (sorted); the result depends only on the weights it returns, so any provider serving the same
    bytes gives the same bits. Decode is one ``kernels.experts_decode`` call (exact or fast as
    ``ctx.policy`` says); prefill groups tokens by expert: in fast mode on block-encoded records one
    native ``kernels.experts_prefill`` call per acquired group, otherwise one gather +
    ``kernels.expert_mlp`` per expert.
    """
    num_tokens, top_k = indices.shape
    if num_tokens == 1:
        ids, ws = one_token_lists(weights, indices)
        return routed_one(x, ids, ws, provider, layer_idx, ctx, expert_fn)
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat)
    all_counts = counts.tolist()                      # one device-to-host transfer
    expert_ids = [e for e, n in enumerate(all_counts) if n]
    counts = [all_counts[e] for e in expert_ids]
    token_of = order // top_k
    weight_of = weights.reshape(-1)[order]
    out = torch.zeros_like(x)
    x32 = out32 = None          # fast mode on encoded records: one native call per run, fp32
    pos = 0
    # A streaming provider may hold fewer experts at once than a long prefill selects; the
    # experts are then taken in groups, in the same order, so the sum is unchanged. One that can
    # serve a group in runs as their reads land (``acquire_runs``) lets the first runs compute
    # while the rest are read; the runs keep the order too.
    per_expert = flat.numel() / len(expert_ids)     # (float records: native below a few tokens each)
    group = getattr(provider, "max_experts_per_acquire", None) or len(expert_ids)
    acquire_runs = getattr(provider, "acquire_runs", None)
    for start in range(0, len(expert_ids), group):
        ids, group_counts = expert_ids[start:start + group], counts[start:start + group]
        runs = acquire_runs(layer_idx, ids, STREAM_RUN_EXPERTS) if acquire_runs is not None else \
            [(ids, provider.acquire(layer_idx, ids))]
        try:
            first = 0
            for run_ids, experts in runs:
                run_counts = group_counts[first:first + len(run_ids)]
                first += len(run_ids)
                if expert_fn is None and kernels.prefill_native(x, experts, ctx, per_expert):
                    if out32 is None:       # (fp32 compute: the native call adds straight into out)
                        x32 = x.float().contiguous()
                        out32 = out if out.dtype == torch.float32 else torch.zeros(x.shape, dtype=torch.float32)
                    n = sum(run_counts)
                    kernels.experts_prefill(x32, experts, torch.tensor(run_counts, dtype=torch.int32),
                                            token_of[pos:pos + n], weight_of[pos:pos + n], out32, ctx)
                    pos += n
                    continue
                for e, w, count in zip(run_ids, experts, run_counts):
                    rows = token_of[pos:pos + count]
                    xs = x.index_select(0, rows)
                    y = (kernels.expert_mlp(xs, w, ctx) if expert_fn is None else expert_fn(xs, w, e, ctx))
                    y = y.mul_(weight_of[pos:pos + count, None])
                    out.index_add_(0, rows, y)
                    pos += count
        finally:
            if hasattr(runs, "close"):      # (a run cut short: its reads land before the release)
                runs.close()
            provider.release(layer_idx, ids)
    return out if out32 is None or out32 is out else out.add_(out32.to(x.dtype))


# A streamed prefill computes the experts of a group in runs of this many as their reads land.
STREAM_RUN_EXPERTS = 16


def one_token_lists(weights: torch.Tensor, indices: torch.Tensor) -> tuple[list, list]:
    """One token's routing (weights and indices [1, k]) as (expert ids ascending, their weights):
    one device-to-host transfer (a sync on CUDA); float64 holds both exactly."""
    ids_and_weights = torch.stack((indices[0].to(torch.float64), weights[0].to(torch.float64))).tolist()
    pairs = sorted((int(e), w) for e, w in zip(*ids_and_weights))
    return [e for e, _ in pairs], [w for _, w in pairs]


def one_token_experts(x: torch.Tensor, expert_ids: list, experts: list, weights: list,
                      ctx: ExecContext = STANDALONE, expert_fn=None) -> torch.Tensor:
    """One token x [1, H] through its acquired ``experts`` (ids ascending) with ``weights``: one
    ``kernels.experts_decode`` call (or the family's expert math per expert)."""
    if expert_fn is None:
        return kernels.experts_decode(x, experts, weights, ctx)
    out = torch.zeros_like(x)
    for e, w, weight in zip(expert_ids, experts, weights):
        out.add_(expert_fn(x, w, e, ctx), alpha=weight)
    return out


def routed_one(x: torch.Tensor, expert_ids: list, weights: list, provider, layer_idx: int,
               ctx: ExecContext = STANDALONE, expert_fn=None) -> torch.Tensor:
    """One token x [1, H] through its experts ``expert_ids`` (ascending) with ``weights`` (floats):
    one acquire, then ``one_token_experts``. A provider that hands out experts as they become
    ready (``acquire_as_ready``: a streaming one) has the cached experts computed while the others
    are read, then the pieces summed in expert order: the bits of ``one_token_experts``."""
    as_ready = getattr(provider, "acquire_as_ready", None)
    if as_ready is None:
        experts = provider.acquire(layer_idx, expert_ids)
        try:
            return one_token_experts(x, expert_ids, experts, weights, ctx, expert_fn)
        finally:
            provider.release(layer_idx, expert_ids)
    batches = as_ready(layer_idx, expert_ids)
    try:
        parts, held = [None] * len(expert_ids), [None] * len(expert_ids)
        for pos, views in batches:
            if len(pos) == len(expert_ids):           # everything at once: one call
                return one_token_experts(x, expert_ids, views, weights, ctx, expert_fn)
            if not pos:
                continue
            ids = [expert_ids[i] for i in pos]
            outs = ([expert_fn(x, w, e, ctx).reshape(-1) for e, w in zip(ids, views)] if expert_fn is not None
                    else kernels.experts_decode_parts(x, views, ctx))
            for i, w, y in zip(pos, views, outs):
                parts[i], held[i] = y, w
        if expert_fn is not None:                     # one_token_experts' sum, in order
            out = torch.zeros_like(x)
            for y, weight in zip(parts, weights):
                out.add_(y.view_as(out), alpha=weight)
            return out
        return kernels.experts_combine(x, held, parts, weights, ctx)
    finally:
        if hasattr(batches, "close"):       # (a generator: its reads land before the release)
            batches.close()
        provider.release(layer_idx, expert_ids)


def routed_rows(xs: list, routes: list, provider, layer_idx: int, ctx: ExecContext = STANDALONE,
                expert_fn=None) -> list:
    """Several sequences' tokens (``xs``: each [1, H]; ``routes``: each one's (expert ids ascending,
    weights)) through their experts with the arithmetic of ``routed_one`` row by row (each result
    has the bits of that token decoded alone), but one acquire for the experts the rows share: an
    expert read for one sequence serves the others. Rows are taken in runs whose union of experts
    fits one acquire (``max_experts_per_acquire``)."""
    group = getattr(provider, "max_experts_per_acquire", None)
    outs = [None] * len(xs)
    start = 0
    while start < len(xs):
        union = set(routes[start][0])
        end = start + 1
        while end < len(xs) and (group is None or len(union | set(routes[end][0])) <= group):
            union |= set(routes[end][0])
            end += 1
        ids = sorted(union)
        experts = provider.acquire(layer_idx, ids)
        try:
            held = dict(zip(ids, experts))
            for r in range(start, end):
                row_ids, row_weights = routes[r]
                outs[r] = one_token_experts(xs[r], row_ids, [held[e] for e in row_ids], row_weights, ctx, expert_fn)
        finally:
            provider.release(layer_idx, ids)
        start = end
    return outs


class SparseMoeBlock(nn.Module):
    """Routed experts served by a provider, chosen by ``router`` (HF attribute ``router_name``; a
    dotted name nests it in a container, AfMoE's ``router.gate``), plus an optional shared expert:
    sigmoid-gated (Qwen3-Next: ``shared_expert`` + ``shared_expert_gate``) or plain
    (``shared_experts``, DeepSeek / GLM style, when ``shared_gated`` is False).

    ``experts``: a family's own expert math (a module called as ``experts(x, expert, expert_id,
    mode, isa)``, e.g. GPT-OSS's ``ClampedSwiGLUExperts``), registered as ``experts`` so that its
    resident tensors (expert biases) have the checkpoint's keys; None: SwiGLU (``kernels``).
    """

    ctx = STANDALONE     # how the routed experts compute: the model's ExecContext (CausalLM binds it)

    def __init__(self, router: Router, layer_idx: int, hidden_size: int, shared_intermediate_size: int = 0,
                 router_name: str = "gate", shared_gated: bool = True, experts: Optional[nn.Module] = None):
        super().__init__()
        self.layer_idx = layer_idx
        if "." in router_name:          # nested in a container (AfMoE: mlp.router.gate)
            outer, inner = router_name.split(".")
            container = nn.Module()
            setattr(container, inner, router)
            setattr(self, outer, container)
        else:
            setattr(self, router_name, router)
        # Plain references for the hot path, in tuples (not registered again: no duplicate keys).
        self._router = (router,)
        self._shared = None             # (shared MLP, its sigmoid gate or None)
        if shared_intermediate_size and shared_gated:
            self.shared_expert = MLP(hidden_size, shared_intermediate_size)
            self.shared_expert_gate = Linear(hidden_size, 1, bias=False)
            self._shared = (self.shared_expert, self.shared_expert_gate)
        elif shared_intermediate_size:
            self.shared_experts = MLP(hidden_size, shared_intermediate_size)
            self._shared = (self.shared_experts, None)
        self.provider = None    # set by the model; not a submodule, owns no weights
        self.expert_fn = None   # the family's expert math (``experts.forward``); None: SwiGLU
        if experts is not None:
            self.experts = experts
            self.expert_fn = experts.forward

    @property
    def router(self) -> Router:
        """The router, whatever its HF name."""
        return self._router[0]

    @property
    def top_k(self) -> int:
        return self.router.top_k

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [N, k], expert ids [N, k]) of the tokens x [N, H]."""
        return self.router.route(x)

    def predict(self, x: torch.Tensor, n: int) -> torch.Tensor:
        """The ``n`` experts the routing rule ranks first for x [N, H] (a prefetcher's guess)."""
        return self.router.predict(x, n)

    def route_lists(self, x: torch.Tensor):
        """One token's (expert ids ascending, weights) as lists from the native router, or None
        where this block's rule or the policy does not allow it (see ``Router.route_lists``)."""
        return self.router.route_lists(x)

    def one_token_route(self, flat: torch.Tensor) -> tuple[list, list]:
        """One token's (expert ids ascending, weights) — from the native router when this block's
        rule and the policy allow it (no softmax / topk / sort / tensor-to-list dispatches)."""
        routed = self.route_lists(flat)
        if routed is not None:
            return routed
        weights, indices = self.route(flat)
        return one_token_lists(weights.to(flat.dtype), indices)

    def _add_shared(self, out: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        if self._shared is None:
            return out
        expert, gate = self._shared
        shared = expert(flat)
        if gate is not None:
            shared = torch.sigmoid(gate(flat)) * shared
        return out + shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        self.provider.layer_input(self.layer_idx, flat)
        if flat.shape[0] == 1:
            ids, ws = self.one_token_route(flat)
            out = routed_one(flat, ids, ws, self.provider, self.layer_idx, self.ctx, self.expert_fn)
        else:
            weights, indices = self.route(flat)
            out = routed_experts(flat, weights.to(x.dtype), indices, self.provider, self.layer_idx,
                                 self.ctx, self.expert_fn)
        return self._add_shared(out, flat).view(shape)

    def forward_rows(self, xs: list) -> list:
        """One token of each of several sequences (``xs``: each [1, 1, H]), each with the bits it
        has alone (``forward``), the experts acquired once for all of them (``routed_rows``)."""
        flats = [x.reshape(1, -1) for x in xs]
        self.provider.layer_input(self.layer_idx, torch.cat(flats))
        routes = [self.one_token_route(f) for f in flats]
        outs = routed_rows(flats, routes, self.provider, self.layer_idx, self.ctx, self.expert_fn)
        return [self._add_shared(o, f).view(x.shape) for o, f, x in zip(outs, flats, xs)]


class ExpertBiasMoeBlock(SparseMoeBlock):
    """AfMoE: a selection-only router bias on the block (HF ``mlp.expert_bias`` [E], fp32), handed to
    the router's rule (``SigmoidBiasRouter``) with every input."""

    def __init__(self, router: Router, layer_idx: int, hidden_size: int, shared_intermediate_size: int = 0,
                 **options):
        super().__init__(router, layer_idx, hidden_size, shared_intermediate_size, **options)
        self.expert_bias = nn.Parameter(torch.zeros(router.num_experts))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.router.route(x, self.expert_bias)

    def route_lists(self, x: torch.Tensor):
        return None          # (the block's bias: the torch rule)

    def predict(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return self.router.predict(x, n, self.expert_bias)
