"""RMS norms: ``RMSNorm`` (optionally zero-centred, Qwen3-Next) and Gated DeltaNet's ``GatedRMSNorm``."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lean_qwenflash.models import native
from lean_qwenflash.models.policy import STANDALONE


def _upcast(x: torch.Tensor) -> torch.Tensor:
    """At least fp32 (bf16/fp16 math happens in fp32; fp64 stays fp64 for reference runs)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()


def native_norm_args(norm, dim: int):
    """(weight, mode, eps) of a norm whose one-token calls run natively (``RMSNorm.native_args``),
    for a fused native step; None for any other norm."""
    return norm.native_args(dim) if isinstance(norm, RMSNorm) else None


class RMSNorm(nn.Module):
    """``w * x / rms(x)``; ``zero_centred`` (Qwen3-Next) stores ``w - 1``, i.e. computes ``(1 + w)``.

    In ``fast`` mode (the model's ExecPolicy) one token's fp32 rows on CPU (x [B, 1, ...]: a decode
    step's hidden row, or its q/k heads) take one native call instead of torch's ~8 dispatches
    (~40 us -> ~2 us); its float64 sum of squares differs from torch's fp32 order by an ulp, so
    prompts (many tokens) keep torch's arithmetic and match transformers as before."""

    ctx = STANDALONE     # the model's ExecContext (CausalLM binds it)
    NATIVE_MAX_VALUES = 1 << 14

    def __init__(self, dim: int, eps: float, zero_centred: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centred else torch.ones(dim))
        self.eps = eps
        self.zero_centred = zero_centred

    def native_args(self, dim: int):
        """(weight, mode, eps) for a fused native step that norms rows of ``dim`` values as this
        norm's own one-token calls do natively, else None."""
        if type(self) is not RMSNorm or self.weight.numel() != dim or not native.is_f32(self.weight) \
                or dim > self.NATIVE_MAX_VALUES:
            return None
        return self.weight, 2 if self.zero_centred else 1, float(self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() >= 3 and x.shape[1] == 1 and x.numel() <= self.NATIVE_MAX_VALUES and x.dtype == torch.float32 \
                and self.ctx.policy.kernel_mode == "fast" and x.device.type == "cpu" and native.available() \
                and self.weight.dtype == torch.float32:
            return native.rms_norm(x.contiguous(), self.weight, self.eps, self.zero_centred)
        xf = F.rms_norm(_upcast(x), (x.shape[-1],), None, self.eps)
        if self.zero_centred:
            # Multiply in fp32 before the downcast, as the architecture defines it.
            return (xf * (1.0 + _upcast(self.weight))).to(x.dtype)
        return self.weight * xf.to(x.dtype)


class GatedRMSNorm(nn.Module):
    """``w * rmsnorm(x) * silu(gate)``: the output norm of Gated DeltaNet (plain, not zero-centred)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        xf = F.rms_norm(_upcast(x), (x.shape[-1],), None, self.eps)
        out = (self.weight * xf.to(x.dtype)) * F.silu(_upcast(gate))
        return out.to(x.dtype)
