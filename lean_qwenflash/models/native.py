"""The native CPU kernels (``lean_qwenflash._kernels``, csrc/moe.cpp) behind checked calls.

Python hands C++ raw addresses, so everything is checked here first: CPU, contiguous, the dtype
the kernel reads, rows of the encoding's size. ``isa`` is "auto" (the best this CPU has) or one
of :data:`ISAS` to force a path (tests run every one).
"""
from __future__ import annotations

from typing import Sequence

import torch

from ..common import KERNEL_ISAS  # noqa: F401  (the paths a call may force)
from ..quant import ENCODINGS, QuantTensor

try:
    from .. import _kernels as _K
except ImportError:  # pragma: no cover - the extension is part of every build
    _K = None

ISAS: list = _K.supported_isas() if _K is not None else []


def _set_iq_tables() -> None:
    """Hand the I-quant lookup tables (from the gguf package, quant.iquants.iq_tables) to the
    kernels once. Without gguf the IQ kernels refuse by name instead of reading garbage."""
    from ..quant.iquants import iq_tables
    try:
        t = iq_tables()
    except RuntimeError:  # pragma: no cover - gguf is a dependency
        return
    for ours, theirs in (("iq2xxs", "iq2xxs_grid"), ("iq2xs", "iq2xs_grid"), ("iq2s", "iq2s_grid"),
                         ("iq3xxs", "iq3xxs_grid"), ("iq3s", "iq3s_grid"), ("iq1s", "iq1s_grid"),
                         ("ksigns", "ksigns"), ("iq4nl", "kvalues_iq4nl")):
        _K.set_iq_table(ours, t[theirs].tobytes())


if _K is not None:
    _set_iq_tables()
_FLOAT_IDS = {ENCODINGS[n].torch_dtype: ENCODINGS[n].native_id for n in ("f32", "f16", "bf16")}
# The encoding ids this build of the extension has kernels for (csrc/quant.h's Enc); an encoding
# outside it runs on torch (dequantize, then multiply). Builds that do not list them have the first 8.
NATIVE_IDS = frozenset(_K.encoding_ids()) if _K is not None else frozenset()


def knows(encoding) -> bool:
    """Whether the native kernels implement ``encoding`` (a quant Encoding)."""
    return encoding.native_id in NATIVE_IDS


def available() -> bool:
    return _K is not None


def best_isa() -> str:
    return _K.best_isa() if _K is not None else "none"


def encoding_id(weight) -> int:
    """The native encoding id of a weight (QuantTensor, or a float tensor)."""
    if isinstance(weight, QuantTensor):
        return weight.encoding.native_id
    try:
        return _FLOAT_IDS[weight.dtype]
    except KeyError:
        raise ValueError(f"no native kernel for {weight.dtype} weights") from None


def _address(weight) -> int:
    t = weight.raw if isinstance(weight, QuantTensor) else weight
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("native kernels need contiguous CPU weights")
    return t.data_ptr()


def is_f32(t) -> bool:
    """Whether ``t`` is a contiguous fp32 CPU tensor (what a native call may read or write as is)."""
    return t is not None and t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()


def supports(weight) -> bool:
    """Whether the native decode kernels can read this weight where it is (a QuantTensor or a float
    tensor; QuantRows / QuantCols go part by part or permute their input first)."""
    if _K is None or not isinstance(weight, (QuantTensor, torch.Tensor)):
        return False
    t = weight.raw if isinstance(weight, QuantTensor) else weight
    return t.device.type == "cpu" and t.is_contiguous() and (knows(weight.encoding) if isinstance(weight, QuantTensor)
                                                             else t.dtype in _FLOAT_IDS)


def set_spin(iterations: int) -> int:
    """Set how long idle kernel threads spin before sleeping; returns the previous setting."""
    return _K.set_spin(int(iterations)) if _K is not None else 0


def bind_kernel_threads(cpus, anywhere) -> None:
    """Pin the kernel pools' worker i to ``cpus[i % len]`` (pools made later too); with ``cpus``
    empty, let them run on ``anywhere`` again (see ``models.affinity``)."""
    if _K is not None:
        _K.bind_kernel_threads([int(c) for c in cpus], [int(c) for c in anywhere])


def kernel_thread_cpus() -> list:
    """The kernel pools' binding (``[]``: unbound)."""
    return list(_K.kernel_thread_cpus()) if _K is not None else []


def kernel_thread_ids() -> list:
    """Thread ids of the kernel pools' workers (made on first use)."""
    return list(_K.kernel_thread_ids()) if _K is not None else []


def bind_openmp_team(runtime: str, threads: int, cpus, anywhere=()) -> list:
    """Pin member i >= 1 of the calling thread's ``threads``-thread OpenMP team (torch's intra-op
    pool) to ``cpus[i % len]`` (``cpus`` empty: let them run on ``anywhere``) through the loaded
    runtime at ``runtime``; their thread ids."""
    if _K is None:
        return []
    return list(_K.bind_openmp_team(runtime, int(threads), [int(c) for c in cpus], [int(c) for c in anywhere]))


def _threads(threads) -> int:
    """A call's thread count (its model's ``ExecPolicy.native_threads``); 0: torch's intra-op count."""
    return threads or torch.get_num_threads()


def _f32(x: torch.Tensor) -> torch.Tensor:
    if x.dtype == torch.float32 and x.is_contiguous():
        return x            # (decode: already so; no dispatches)
    return x.detach().to(torch.float32).contiguous()


def gemv(weight, x: torch.Tensor, isa: str = "auto", threads: int = 0) -> torch.Tensor:
    """``weight [rows, cols] . x [cols]`` -> fp32 [rows] (block encodings quantize x to int8 blocks)."""
    rows, cols = weight.shape
    xf = _f32(x).reshape(-1)
    if xf.numel() != cols:
        raise ValueError(f"gemv: x has {xf.numel()} values, the weight has {cols} columns")
    out = torch.empty(rows, dtype=torch.float32)
    _K.gemv(_address(weight), encoding_id(weight), rows, cols, xf.data_ptr(), out.data_ptr(), _threads(threads), isa)
    return out


def gemm(weight, x: torch.Tensor, isa: str = "auto", threads: int = 0) -> torch.Tensor:
    """Many tokens through one matrix: x [n, cols] -> fp32 [n, rows], each row exactly ``gemv``'s for
    that token (block encodings: int8 activation blocks; each weight block decoded once per four
    tokens)."""
    rows, cols = weight.shape
    xf = _f32(x).reshape(-1, cols) if x.shape[-1] == cols else None
    if xf is None:
        raise ValueError(f"gemm: x {tuple(x.shape)} does not end in the weight's {cols} columns")
    xf = xf.contiguous()
    out = torch.empty(xf.shape[0], rows, dtype=torch.float32)
    _K.gemm(_address(weight), encoding_id(weight), rows, cols, xf.data_ptr(), xf.shape[0], out.data_ptr(),
            _threads(threads), isa)
    return out


def moe_decode(x: torch.Tensor, experts: Sequence, weights: Sequence[float], isa: str = "auto",
               threads: int = 0) -> torch.Tensor:
    """One token through its experts: ``sum_e w_e * down_e(silu(gate_e x) * up_e x)``; x [1, H] -> fp32 [1, H].
    The experts of one call share encodings and shapes (those of a layer)."""
    gu0, dn0 = experts[0].gate_up, experts[0].down
    hidden, inter = dn0.shape
    xf = _f32(x).reshape(-1)
    if xf.numel() != hidden or tuple(gu0.shape) != (2 * inter, hidden):
        raise ValueError(f"moe_decode: x has {xf.numel()} values; gate_up {tuple(gu0.shape)}, down {tuple(dn0.shape)}")
    out = torch.empty(1, hidden, dtype=torch.float32)
    _K.moe_decode(xf.data_ptr(), hidden, inter, [_address(w.gate_up) for w in experts],
                  [_address(w.down) for w in experts], [float(w) for w in weights], encoding_id(gu0),
                  encoding_id(dn0), out.data_ptr(), _threads(threads), isa)
    return out


def moe_decode_parts(x: torch.Tensor, experts: Sequence, isa: str = "auto", threads: int = 0) -> torch.Tensor:
    """``moe_decode`` without the weighted sum: fp32 [E, H], row e the unweighted output of expert e.
    ``moe_combine`` of such rows gives ``moe_decode``'s bits for the same experts in the same order."""
    gu0, dn0 = experts[0].gate_up, experts[0].down
    hidden, inter = dn0.shape
    xf = _f32(x).reshape(-1)
    if xf.numel() != hidden or tuple(gu0.shape) != (2 * inter, hidden):
        raise ValueError(f"moe_decode_parts: x has {xf.numel()} values; gate_up {tuple(gu0.shape)}, down {tuple(dn0.shape)}")
    parts = torch.empty(len(experts), hidden, dtype=torch.float32)
    _K.moe_decode_parts(xf.data_ptr(), hidden, inter, [_address(w.gate_up) for w in experts],
                        [_address(w.down) for w in experts], encoding_id(gu0), encoding_id(dn0), parts.data_ptr(),
                        _threads(threads), isa)
    return parts


def moe_combine(parts: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """fp32 [1, H] = sum_e weights[e] * parts[e] in order; each part a contiguous fp32 row of H values."""
    hidden = parts[0].numel()
    if len(parts) != len(weights) or any(p.dtype != torch.float32 or not p.is_contiguous() or p.numel() != hidden
                                         for p in parts):
        raise ValueError("moe_combine: one contiguous fp32 row of the same length per weight")
    out = torch.empty(1, hidden, dtype=torch.float32)
    _K.moe_combine([p.data_ptr() for p in parts], [float(w) for w in weights], hidden, out.data_ptr())
    return out


def moe_prefill(x: torch.Tensor, experts: Sequence, counts: torch.Tensor, tokens: torch.Tensor, weights: torch.Tensor,
                out: torch.Tensor, isa: str = "auto", threads: int = 0) -> torch.Tensor:
    """Many tokens through experts of one layer, added into ``out`` [N, H] (fp32, in place): expert
    e takes the next ``counts[e]`` entries of ``tokens`` (row indices of x) and ``weights``;
    ``out[t] += w * down_e(silu(gate_e x_t) * up_e x_t)``, expert by expert in order. x [N, H]."""
    gu0, dn0 = experts[0].gate_up, experts[0].down
    hidden, inter = dn0.shape
    if x.dtype != torch.float32 or not x.is_contiguous() or x.dim() != 2 or x.shape[1] != hidden:
        raise ValueError(f"moe_prefill: x must be contiguous fp32 [N, {hidden}], got {x.dtype} {tuple(x.shape)}")
    if out.dtype != torch.float32 or not out.is_contiguous() or out.shape != x.shape:
        raise ValueError(f"moe_prefill: out must be contiguous fp32 {tuple(x.shape)}")
    if tuple(gu0.shape) != (2 * inter, hidden):
        raise ValueError(f"moe_prefill: gate_up {tuple(gu0.shape)}, down {tuple(dn0.shape)}")
    counts, tokens = counts.to(torch.int32).contiguous(), tokens.to(torch.int32).contiguous()
    weights = weights.to(torch.float32).contiguous()
    if counts.numel() != len(experts) or tokens.numel() != weights.numel() or int(counts.sum()) != tokens.numel():
        raise ValueError("moe_prefill: counts must have one entry per expert and sum to the number of tokens/weights")
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= x.shape[0]):
        raise ValueError(f"moe_prefill: token indices must be rows of x (0..{x.shape[0] - 1})")
    _K.moe_prefill(x.data_ptr(), hidden, inter, [_address(w.gate_up) for w in experts],
                   [_address(w.down) for w in experts], counts.data_ptr(), tokens.data_ptr(), weights.data_ptr(),
                   encoding_id(gu0), encoding_id(dn0), out.data_ptr(), _threads(threads), isa)
    return out


def dequantize_into(weight: QuantTensor, out: torch.Tensor, threads: int = 0) -> torch.Tensor:
    """Exact fp32 rows of ``weight`` into ``out`` (contiguous fp32 of the weight's shape); torch's
    dequantizer where the native kernels do not know the encoding."""
    if out.dtype != torch.float32 or not out.is_contiguous() or tuple(out.shape) != tuple(weight.shape):
        raise ValueError(f"dequantize_into: out must be contiguous fp32 {tuple(weight.shape)}")
    if not knows(weight.encoding):
        return out.copy_(weight.dequantize())
    rows, cols = weight.shape
    _K.dequantize(_address(weight), weight.encoding.native_id, rows, cols, out.data_ptr(), _threads(threads))
    return out


def _kv_rows(rows: torch.Tensor, enc: int, dim: int, kv_heads: int, num_keys: int, what: str) -> tuple:
    """(address, encoding, dim, head stride, row stride) of cached rows [kv_heads, >= num_keys, row]
    (bytes); each row contiguous, rows and heads at any stride (a cache's capacity, a ring)."""
    if rows.device.type != "cpu" or rows.dim() != 3 or rows.stride(-1) != 1:
        raise ValueError(f"attention_decode: {what} must be CPU rows [kv_heads, keys, row] with contiguous rows")
    if rows.shape[0] != kv_heads or rows.shape[1] < num_keys:
        raise ValueError(f"attention_decode: {what} {tuple(rows.shape)} do not hold {kv_heads} kv heads x {num_keys} keys")
    item = rows.element_size()
    width = rows.shape[2] * item
    block = _K.block_bytes(enc), _K.block_values(enc)
    want = -(-dim // block[1]) * block[0]
    if width != want:
        raise ValueError(f"attention_decode: {what} rows are {width} bytes; encoding {enc} with {dim} values needs {want}")
    return rows.data_ptr(), enc, dim, rows.stride(0) * item, rows.stride(1) * item


def attention_decode(q: torch.Tensor, keys: Sequence[tuple], values: tuple, num_keys: int, scale: float,
                     sinks=None, isa: str = "auto", threads: int = 0) -> torch.Tensor:
    """One query row per head over the first ``num_keys`` cached rows, all visible (csrc/attention.cpp).

    q [heads, sum of the key parts' dims] fp32; ``keys``: (rows [kv_heads, L, row], native encoding
    id, dim) per part (the scores add over parts: MLA's latent and rope key); ``values`` likewise
    (the same tensor as the first key part: MLA). ``sinks`` [heads] or None. -> fp32 [heads, values dim]."""
    heads = q.shape[0]
    kv_heads = keys[0][0].shape[0]
    if q.dtype != torch.float32 or not q.is_contiguous() or q.dim() != 2 or q.shape[1] != sum(k[2] for k in keys):
        raise ValueError(f"attention_decode: q must be contiguous fp32 [heads, {sum(k[2] for k in keys)}], "
                         f"got {q.dtype} {tuple(q.shape)}")
    if num_keys < 1 or heads % kv_heads:
        raise ValueError(f"attention_decode: {num_keys} keys, {heads} heads over {kv_heads} kv heads")
    key_rows = [_kv_rows(r, e, d, kv_heads, num_keys, "keys") for r, e, d in keys]
    value_rows = _kv_rows(*values, kv_heads, num_keys, "values")
    sink_ptr = 0
    if sinks is not None:
        sinks = _f32(sinks).reshape(-1)
        if sinks.numel() != heads:
            raise ValueError(f"attention_decode: {sinks.numel()} sinks for {heads} heads")
        sink_ptr = sinks.data_ptr()
    out = torch.empty(heads, values[2], dtype=torch.float32)
    _K.attention_decode(q.data_ptr(), heads, kv_heads, key_rows, value_rows, int(num_keys), float(scale), sink_ptr,
                        out.data_ptr(), _threads(threads), isa)
    return out


# ---- per-token operations of a decode step (csrc/ops.h) ----

def _plain_f32(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and t.dtype == torch.float32 and t.is_contiguous()


def rms_norm(x: torch.Tensor, weight, eps: float, zero_centred: bool = False) -> torch.Tensor:
    """``x / rms(x)`` over the last dim, times ``weight`` (``1 + weight`` if ``zero_centred``; no
    weight: None); x fp32 contiguous on CPU (fast mode: the sum of squares is in float64, not
    torch's fp32 order)."""
    if not _plain_f32(x) or (weight is not None and not _plain_f32(weight)):
        raise ValueError("native rms_norm needs contiguous fp32 CPU tensors")
    n = x.shape[-1]
    if weight is not None and weight.numel() != n:
        raise ValueError(f"rms_norm: weight has {weight.numel()} values, rows have {n}")
    out = torch.empty_like(x)
    mode = 0 if weight is None else (2 if zero_centred else 1)
    _K.rms_norm(x.data_ptr(), x.numel() // n, n, 0 if weight is None else weight.data_ptr(), mode, float(eps),
                out.data_ptr())
    return out


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``apply_rotary`` of x [B, heads, T, D] with cos / signed sin [T, rotary_dim], bit-equal to
    the torch expression (same roundings)."""
    if not (_plain_f32(x) and _plain_f32(cos) and _plain_f32(sin)) or x.dim() != 4:
        raise ValueError("native rope needs contiguous fp32 CPU tensors, x [B, heads, T, D]")
    tokens, rotary_dim = cos.shape
    if x.shape[2] != tokens or sin.shape != cos.shape or rotary_dim > x.shape[3]:
        raise ValueError(f"rope: x {tuple(x.shape)} does not fit tables {tuple(cos.shape)}")
    out = torch.empty_like(x)
    _K.rope(x.data_ptr(), x.shape[0] * x.shape[1], tokens, x.shape[3], rotary_dim, cos.data_ptr(), sin.data_ptr(),
            out.data_ptr())
    return out


def route_softmax(weight, x: torch.Tensor, bias, top_k: int, renorm: bool, isa: str = "auto",
                  threads: int = 0, by_rank: bool = False) -> tuple[list, list]:
    """One token's softmax routing through a router weight [E, H] (float or encoded): (expert ids
    ascending — ``by_rank``: best first —, their fp32 weights), as lists (no tensor round trip)."""
    experts, hidden = weight.shape
    xf = _f32(x).reshape(-1)
    if xf.numel() != hidden:
        raise ValueError(f"route_softmax: x has {xf.numel()} values, the router has {hidden} columns")
    if bias is not None and (not _plain_f32(bias) or bias.numel() != experts):
        raise ValueError("route_softmax: bias must be fp32 [experts] on CPU")
    return _K.route_softmax(_address(weight), encoding_id(weight), experts, hidden, xf.data_ptr(),
                            0 if bias is None else bias.data_ptr(), int(top_k), bool(renorm), bool(by_rank),
                            _threads(threads), isa)


def gemv_multi(weights: Sequence, x: torch.Tensor, isa: str = "auto", threads: int = 0) -> list:
    """``[w . x for w in weights]`` (each [rows_m, cols], the same cols) in one call: x quantized
    once for all block encodings, every matrix's rows in one parallel run; fp32 [rows_m] each."""
    cols = weights[0].shape[1]
    xf = _f32(x).reshape(-1)
    if xf.numel() != cols or any(w.shape[1] != cols for w in weights):
        raise ValueError(f"gemv_multi: x has {xf.numel()} values; matrices {[tuple(w.shape) for w in weights]}")
    outs = [torch.empty(w.shape[0], dtype=torch.float32) for w in weights]
    _K.gemv_multi([_address(w) for w in weights], [encoding_id(w) for w in weights], [w.shape[0] for w in weights],
                  cols, xf.data_ptr(), [o.data_ptr() for o in outs], _threads(threads), isa)
    return outs
