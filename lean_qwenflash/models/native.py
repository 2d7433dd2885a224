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
_FLOAT_IDS = {ENCODINGS[n].torch_dtype: ENCODINGS[n].native_id for n in ("f32", "f16", "bf16")}


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


def supports(weight) -> bool:
    """Whether the native decode kernels can read this weight where it is."""
    if _K is None:
        return False
    t = weight.raw if isinstance(weight, QuantTensor) else weight
    return t.device.type == "cpu" and t.is_contiguous() and (isinstance(weight, QuantTensor) or t.dtype in _FLOAT_IDS)


def set_spin(iterations: int) -> int:
    """Set how long idle kernel threads spin before sleeping; returns the previous setting."""
    return _K.set_spin(int(iterations)) if _K is not None else 0


def _threads(threads) -> int:
    """A call's thread count (its model's ``ExecPolicy.native_threads``); 0: torch's intra-op count."""
    return threads or torch.get_num_threads()


def _f32(x: torch.Tensor) -> torch.Tensor:
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
    """Exact fp32 rows of ``weight`` into ``out`` (contiguous fp32 of the weight's shape)."""
    if out.dtype != torch.float32 or not out.is_contiguous() or tuple(out.shape) != tuple(weight.shape):
        raise ValueError(f"dequantize_into: out must be contiguous fp32 {tuple(weight.shape)}")
    rows, cols = weight.shape
    _K.dequantize(_address(weight), weight.encoding.native_id, rows, cols, out.data_ptr(), _threads(threads))
    return out
