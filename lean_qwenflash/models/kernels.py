"""The one switch between torch math and optional CUDA kernels.

On CUDA, flash-linear-attention's chunked gated delta rule and causal-conv1d are used when they
import; everything else (and every CPU run) uses torch. Attention always goes through SDPA, which
already dispatches to flash/memory-efficient kernels on CUDA. Untested here (no GPU): keep small.
"""
from __future__ import annotations

import torch

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
    """Dispatch the prefill delta rule; shapes as ``layers.chunked_gated_delta_rule``."""
    if _fla_chunk is not None and q.is_cuda:  # pragma: no cover
        # fla wants [B, T, H, D] and already-normalised, already-scaled q, k.
        out, final = _fla_chunk(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), g.transpose(1, 2),
                                beta.transpose(1, 2), scale=1.0, initial_state=state,
                                output_final_state=True, use_qk_l2norm_in_kernel=False)
        return out.transpose(1, 2), final.float()
    return torch_impl(q, k, v, g, beta, state)
