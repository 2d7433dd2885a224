"""The one switch between torch math and optional CUDA kernels.

On CUDA, flash-linear-attention's chunked gated delta rule and causal-conv1d are used when they
import; everything else (and every CPU run) uses torch. On CPU, one-row products (decode) are
spread over the intra-op threads by ``linear``.

Routed experts go through two calls, whatever their encoding: ``experts_decode`` (one token, all of
its experts, one call per layer) and ``expert_mlp`` (many tokens through one expert). Two modes:

* ``exact``: block-quantized weights are dequantized exactly (to fp32, then the compute dtype) and
  multiplied with torch, as float weights are. Bit-identity tests use it.
* ``fast`` (decode on CPU): the native fused kernels of csrc/ read the encoded rows directly, with
  activations quantized to int8 blocks of 32 for block encodings (float rows take fp32
  activations). Many-token products on block-encoded records take one native call per group of
  experts in fast mode (``experts_prefill``), otherwise the exact path (dequantize, then a GEMM).
  Attention always goes through SDPA, which
already dispatches to flash/memory-efficient kernels on CUDA. The CUDA branches run in
tests/test_cuda.py (on a GPU machine: scripts/device_check.sh).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..common import EXPERT_KERNELS  # noqa: F401  (the modes this module implements)
from ..quant import QuantCols, QuantRows, QuantTensor
from . import native
from .policy import STANDALONE, ExecContext, ExecPolicy, Workspace

try:  # pragma: no cover - CUDA-only optional dependency
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as _fla_chunk
except Exception:  # ImportError, or a broken triton install
    _fla_chunk = None

try:  # pragma: no cover
    from causal_conv1d import causal_conv1d_fn as _cc1d_fn
except Exception:
    _cc1d_fn = None


def depthwise_conv(window: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """window [B, C, K-1+T] (past inputs then new), weight [C, 1, K] -> [B, C, T] (no activation)."""
    if _cc1d_fn is not None and window.is_cuda:  # pragma: no cover
        kernel = weight.shape[-1]
        return _cc1d_fn(window, weight.squeeze(1), None, activation=None)[..., kernel - 1:]
    # A few multiply-adds per tap: oneDNN's depthwise conv costs milliseconds of setup per call.
    kernel = weight.shape[-1]
    num_tokens = window.shape[-1] - kernel + 1
    taps = weight[:, 0, :, None]                       # [C, K, 1]
    out = window[..., :num_tokens] * taps[:, 0]
    for i in range(1, kernel):
        out.addcmul_(window[..., i:i + num_tokens], taps[:, i])
    return out


def chunked_delta_rule(q, k, v, g, beta, state, torch_impl):
    """Dispatch the prefill delta rule; shapes as ``layers.deltanet.chunked_gated_delta_rule``."""
    if _fla_chunk is not None and q.is_cuda and q.dtype != torch.float64:  # pragma: no cover
        # fla wants [B, T, H, D] and already-normalised, already-scaled q, k.
        out, final = _fla_chunk(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), g.transpose(1, 2),
                                beta.transpose(1, 2), scale=1.0, initial_state=state,
                                output_final_state=True, use_qk_l2norm_in_kernel=False)
        return out.transpose(1, 2), final.float()
    return torch_impl(q, k, v, g, beta, state)


# Below this many weight bytes the split costs more than it gains (measured break-even ~200 KB).
SPLIT_MIN_BYTES = 256 << 10


def split_parts(weight: torch.Tensor) -> int:
    """Row blocks for a one-row product with ``weight`` (1: use a plain F.linear)."""
    parts = torch.get_num_threads()
    if (parts < 2 or weight.is_cuda or weight.shape[0] % parts or weight.nbytes < SPLIT_MIN_BYTES
            or not weight.is_contiguous()):
        return 1
    return parts


def split_input(x: torch.Tensor, parts: int) -> torch.Tensor:
    """One row x [1, cols] as ``split_gemv`` takes it: itself, or a [parts, 1, cols] view."""
    return x if parts == 1 else x.view(1, 1, x.shape[-1]).expand(parts, 1, x.shape[-1])


def split_gemv(x_in: torch.Tensor, weight: torch.Tensor, parts: int) -> torch.Tensor:
    """[1, rows] = one row times ``weight``ᵀ, the weight's rows split into ``parts`` blocks (one bmm)."""
    if parts == 1:
        return F.linear(x_in, weight)
    rows, cols = weight.shape
    return torch.bmm(x_in, weight.view(parts, rows // parts, cols).transpose(1, 2)).view(1, rows)


def linear(x: torch.Tensor, weight: torch.Tensor, bias=None) -> torch.Tensor:
    """``F.linear``, except that a one-row product on CPU uses every intra-op thread.

    A one-row F.linear (decode) runs as a GEMV on a single core: 10.6 GB/s of weights with 1 or 2
    threads on the 2-core dev machine. Viewing the weight as a batch of row blocks (no copy) makes
    it a bmm, which runs one block per thread: 20.7 GB/s for a 64 MB head, about 1.75x for
    256 KB-3 MB matrices. Results equal F.linear's up to summation order.
    """
    # (The native bf16 kernel is faster alone, but interleaved with torch ops in a decode step it
    # made bf16 decode slower, 20.7 -> 14.4 tok/s: the two thread pools contend. Float resident
    # weights stay on torch.)
    parts = split_parts(weight) if x.numel() == weight.shape[1] else 1
    if parts == 1:
        return F.linear(x, weight, bias)
    out = split_gemv(split_input(x.view(1, -1), parts), weight, parts).view(x.shape[:-1] + (weight.shape[0],))
    return out if bias is None else out + bias


# -- routed experts ----------------------------------------------------------------------------------

def as_float(weight, dtype: torch.dtype, role: str, workspace: Workspace) -> torch.Tensor:
    """A weight as a float matrix in ``dtype`` (float weights as they are; quantized: exact
    dequantization into the ``workspace``'s buffer for ``role`` and the weight's shape)."""
    if not isinstance(weight, QuantTensor):
        if weight.dtype == dtype:
            return weight
        if weight.device.type != "cpu":
            return weight.to(dtype)
        # float records of another dtype, converted per call into the workspace (page-aligned, as records are)
        return workspace.buffer(role, tuple(weight.shape), dtype).copy_(weight)
    if weight.device.type != "cpu" or not native.available():
        return weight.dequantize(dtype)
    buf = native.dequantize_into(weight, workspace.buffer(role, tuple(weight.shape)))
    return buf if dtype == torch.float32 else buf.to(dtype)


def _fast_ok(x: torch.Tensor, experts) -> bool:
    return x.device.type == "cpu" and native.supports(experts[0].gate_up) and native.supports(experts[0].down)


def experts_decode(x: torch.Tensor, experts, weights, ctx: ExecContext = STANDALONE) -> torch.Tensor:
    """One token x [1, H] through its experts: ``sum_e weights[e] * down_e(silu(gate_e x) * up_e x)``.

    The experts of one call come from one layer (same shapes and encodings). In ``fast`` mode
    (``ctx.policy``) one native call runs all of them; ``exact`` (and anything the native kernels
    cannot read) runs torch.
    """
    policy = ctx.policy
    if policy.kernel_mode == "fast" and _fast_ok(x, experts):
        return native.moe_decode(x, experts, weights, isa=policy.isa, threads=policy.native_threads).to(x.dtype)
    out = torch.zeros_like(x)
    for y, weight in zip(_torch_expert_outputs(x, experts, ctx.workspace), weights):
        out.add_(y, alpha=weight)
    return out


def _torch_expert_outputs(x: torch.Tensor, experts, workspace):
    """Each expert's unweighted output for one token x [1, H], in torch (``experts_decode``'s
    arithmetic). kernels.linear's row split is decided once per call: the experts of a layer share
    shapes (inline, since per-call overhead is ~10% of a small expert's GEMV)."""
    inter = experts[0].down.shape[1]
    up_parts = down_parts = x_in = None
    for w in experts:
        gate_up = as_float(w.gate_up, x.dtype, "gate_up", workspace)
        if up_parts is None:
            up_parts = split_parts(gate_up)
            x_in = split_input(x, up_parts)
        h = split_gemv(x_in, gate_up, up_parts)
        act = F.silu(h[:, :inter]).mul_(h[:, inter:])
        down = as_float(w.down, x.dtype, "down", workspace)
        if down_parts is None:
            down_parts = split_parts(down)
        yield split_gemv(split_input(act, down_parts), down, down_parts)


def experts_decode_parts(x: torch.Tensor, experts, ctx: ExecContext = STANDALONE) -> list:
    """``experts_decode`` in pieces: each expert's unweighted output (a row of H values), for
    ``experts_combine`` to sum once the rest of a token's experts have been computed. For the same
    experts in the same order the sum has ``experts_decode``'s bits however they were split: a
    streamed decode step computes the experts already in memory while the others are read."""
    policy = ctx.policy
    if policy.kernel_mode == "fast" and _fast_ok(x, experts):
        return list(native.moe_decode_parts(x, experts, isa=policy.isa, threads=policy.native_threads))
    return [y.reshape(-1) for y in _torch_expert_outputs(x, experts, ctx.workspace)]


def experts_combine(x: torch.Tensor, experts, parts: list, weights, ctx: ExecContext = STANDALONE) -> torch.Tensor:
    """[1, H] = sum_e weights[e] * parts[e] in order, with the arithmetic of ``experts_decode`` for
    these ``experts`` (the sum native where it would run natively, torch's ``add_`` otherwise)."""
    if ctx.policy.kernel_mode == "fast" and _fast_ok(x, experts):
        return native.moe_combine(parts, weights).to(x.dtype)
    out = torch.zeros_like(x)
    for y, weight in zip(parts, weights):
        out.add_(y.view_as(out), alpha=weight)
    return out


# Fast mode: float expert records run natively too when the experts get at most this many tokens
# each on average (a batched decode step, a short prompt): one native call instead of a gather, a
# conversion of each record to the compute dtype and two F.linear + index_add per expert (the
# default model, 4 sequences: those per-expert torch ops were 19% of a step). With more tokens per
# expert torch's GEMM beats per-token dot products.
FLOAT_NATIVE_MAX_TOKENS = 16

# ... except half-precision records (bf16, f16) where the ISA has the float multi-column kernels
# (csrc/quant_columns.h FloatN): torch's path first converts each record to fp32, a pass over twice
# the record's bytes (bf16 file, 512-token prompt: 20-25% of the prefill), and its GEMM over a few
# dozen rows ran at two speeds ~1.5x apart from one prompt to the next, while the native one held
# steady. bf16 file (128 experts, top-8), 2 threads, fresh processes, tok/s torch -> native:
# 32 tokens per expert (512-token prompt) avx512 185-251 -> 337-344, avx2 151-156 -> 270-275; 64
# (1024) avx512 202-305 -> 317-378, avx2 206-314 -> 278-296; 128 (2048) avx512 253-321 -> 298-307,
# avx2 281-331 -> 260-273 (torch ahead); 256 (4096 in one chunk) avx512 273-281 -> 261-275.
# One layer timed alone (random records, best of 3 calls in one process) favours torch sooner, bf16
# and f16 alike: 32 / 64 / 128 tokens per expert, native / torch, avx512 1.39 / 1.11 / 0.94, avx2
# 1.07 / 0.91 / 0.77. The limits follow the whole-model prompts, what users wait for.
# fp32 records (no conversion) keep FLOAT_NATIVE_MAX_TOKENS: not measured on a whole model.
HALF_FLOAT_NATIVE_MAX_TOKENS = {"avx512": 128, "avx2": 64}


def _kernel_isa(policy: ExecPolicy) -> str:
    """The native kernel path the policy runs (``auto``: the best this CPU has)."""
    return native.best_isa() if policy.isa == "auto" else policy.isa


def float_native_max_tokens(weight, policy: ExecPolicy) -> int:
    """Up to how many tokens per expert (on average over a layer) float records like ``weight`` run
    natively in fast mode (see FLOAT_NATIVE_MAX_TOKENS, HALF_FLOAT_NATIVE_MAX_TOKENS)."""
    if isinstance(weight, torch.Tensor) and weight.dtype in (torch.bfloat16, torch.float16):
        return HALF_FLOAT_NATIVE_MAX_TOKENS.get(_kernel_isa(policy), FLOAT_NATIVE_MAX_TOKENS)
    return FLOAT_NATIVE_MAX_TOKENS


def prefill_native(x: torch.Tensor, experts, ctx: ExecContext, tokens_per_expert: float) -> bool:
    """Whether many-token products with these experts run natively: fast mode on CPU and block-encoded
    records, or float records when the layer's selected experts get at most
    ``float_native_max_tokens`` tokens each on average (``tokens_per_expert``, the layer's figure: a
    provider serving the experts in groups takes the same path)."""
    if ctx.policy.kernel_mode != "fast" or x.device.type != "cpu":
        return False
    gate_up, down = experts[0].gate_up, experts[0].down
    encoded = isinstance(gate_up, QuantTensor) and isinstance(down, QuantTensor)
    return (encoded or tokens_per_expert <= min(float_native_max_tokens(gate_up, ctx.policy),
                                                float_native_max_tokens(down, ctx.policy))) \
        and _fast_ok(x, experts)


def experts_prefill(x: torch.Tensor, experts, counts, tokens, weights, out: torch.Tensor,
                    ctx: ExecContext = STANDALONE) -> None:
    """Fast mode, many tokens: one native call for every expert of a group (see native.moe_prefill):
    ``out`` [N, H] fp32 += each (token, weight) pair's expert output; int8 activations per token."""
    native.moe_prefill(x, experts, counts, tokens, weights, out, isa=ctx.policy.isa, threads=ctx.policy.native_threads)


def expert_mlp(x: torch.Tensor, expert, ctx: ExecContext = STANDALONE) -> torch.Tensor:
    """Many tokens x [n, H] through one expert: ``down(silu(gate x) * up x)`` -> [n, H]."""
    h = F.linear(x, as_float(expert.gate_up, x.dtype, "gate_up", ctx.workspace))
    inter = h.shape[-1] // 2
    act = F.silu(h[:, :inter]).mul_(h[:, inter:])
    return F.linear(act, as_float(expert.down, x.dtype, "down", ctx.workspace))


# Fast mode: up to this many tokens go through a quantized matrix natively (``native.gemm``: each
# weight block decoded once per four tokens, int8 activations); more are faster dequantized once into
# fp32 and multiplied by torch's SGEMM (1024x1024 q4_k on 2 cores: 32 tokens 1.8 vs 14 ms, 128 tokens
# 8 vs 13 ms, 512 tokens 32 vs 23 ms).
NATIVE_GEMM_MAX_TOKENS = 128

# ... except the K-quants whose SIMD kernels take rows in groups (csrc/quant_avx2.cpp KRows8 /
# Q6KRows8, quant_avx512.cpp KRows16 / Q6KRows16: eight or sixteen rows a lane each), which stay
# native up to this many tokens: their native products split into tasks claimed from a counter,
# where torch's SGEMM splits statically, and the grouped kernels now match it idle. Hybrid Q4_K_M file,
# one process, A/B rounds interleaved (tok/s, limit 128 -> 1024): 512 / 1024-token prompts idle
# 223 / 244 -> 243 / 253, beside a nice-19 busy loop 150 / 153 -> 167 / 169; uniform file idle 289 /
# 328 -> 302 / 323. All native at 2048 tokens was slower idle (uniform 368 -> 349), hence a limit.
GROUPED_GEMM_MAX_TOKENS = 1024
GROUPED_ENCODINGS = frozenset({"q4_k", "q5_k", "q6_k"})     # Encoding.name


def _native_gemm_limit(weight, policy: ExecPolicy) -> int:
    """How many tokens a resident matrix takes through the native GEMM in fast mode."""
    grouped = isinstance(weight, QuantTensor) and weight.encoding.name in GROUPED_ENCODINGS \
        and _kernel_isa(policy) in ("avx2", "avx512")
    return GROUPED_GEMM_MAX_TOKENS if grouped else NATIVE_GEMM_MAX_TOKENS


def quant_linear(x: torch.Tensor, weight: QuantTensor, bias=None, ctx: ExecContext = STANDALONE,
                 role: str = "linear") -> torch.Tensor:
    """``F.linear`` with a block-quantized (or float record) weight: on CPU in ``fast`` mode one row,
    and for a resident matrix (``role`` "linear") up to ``NATIVE_GEMM_MAX_TOKENS`` rows (several
    sequences' decode step, a short prompt; ``GROUPED_GEMM_MAX_TOKENS`` for the K-quants with
    grouped-rows kernels), run the native dot products on the rows as stored;
    otherwise the weight is dequantized exactly (into the workspace's buffer for ``role``) and
    multiplied."""
    if isinstance(weight, QuantRows):      # row groups in different encodings: one product each
        out = torch.cat([quant_linear(x, p, None, ctx, role) for p in weight.parts], dim=-1)
        out = out.index_select(-1, weight.order)
        return out if bias is None else out + bias
    if isinstance(weight, QuantCols):      # stored columns in another order: the input follows them
        return quant_linear(x.index_select(-1, weight.order), weight.inner, bias, ctx, role)
    policy = ctx.policy
    tokens = x.numel() // weight.shape[1]
    # (a family's own expert math, e.g. GPT-OSS's clamped SwiGLU, keeps exact products for many
    # tokens: its large clamped activations through int8 blocks moved a test model's prompt logits
    # by 13% of their range, past fast mode's bound)
    limit = _native_gemm_limit(weight, policy) if role == "linear" else 1
    if policy.kernel_mode == "fast" and tokens <= limit and x.device.type == "cpu" \
            and native.supports(weight):
        if tokens == 1:
            out = native.gemv(weight, x, isa=policy.isa, threads=policy.native_threads)
        else:
            out = native.gemm(weight, x.reshape(tokens, -1), isa=policy.isa, threads=policy.native_threads)
        out = out.view(x.shape[:-1] + (weight.shape[0],)).to(x.dtype)
    else:
        out = F.linear(x, as_float(weight, x.dtype, role, ctx.workspace))
    return out if bias is None else out + bias


def linears(x: torch.Tensor, modules, ctx: ExecContext = STANDALONE):
    """One token x through several ``Linear`` modules of the same input width (a layer's q, k, v):
    one native call in ``fast`` mode when every weight is one the kernels read (encoded rows, or
    float with ``float_native``); None otherwise (call the modules)."""
    policy = ctx.policy
    if policy.kernel_mode != "fast" or x.device.type != "cpu" or x.numel() != modules[0].in_features:
        return None
    weights = []
    for m in modules:
        w = m.qweight if m.qweight is not None else (m.weight if policy.float_native else None)
        if w is None or not native.supports(w):
            return None
        weights.append(w)
    outs = native.gemv_multi(weights, x, isa=policy.isa, threads=policy.native_threads)
    lead = x.shape[:-1]
    return [(o if m.bias is None else o + m.bias).view(lead + (m.out_features,)).to(x.dtype)
            for o, m in zip(outs, modules)]
