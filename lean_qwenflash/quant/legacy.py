"""GGUF's 32-value block formats: q8_0 and q4_0.

    q8_0 block (34 bytes): f16 d, int8 q[32]          value = d * q
    q4_0 block (18 bytes): f16 d, u8 qs[16]           value = d * (nibble - 8); q[j] is the low
                           nibble of qs[j], q[j + 16] its high nibble
"""
from __future__ import annotations

import torch

from .base import Encoding

F16_MAX = 65504.0


def f16_field(blocks: torch.Tensor, start: int) -> torch.Tensor:
    """The f16 at byte ``start`` of each block, as float32 [N, 1]."""
    return blocks[:, start:start + 2].contiguous().view(torch.float16).float()


def f16_bytes(x: torch.Tensor) -> torch.Tensor:
    """float [N] -> uint8 [N, 2] (little-endian f16)."""
    return x.clamp(-F16_MAX, F16_MAX).to(torch.float16).contiguous().view(torch.uint8).view(-1, 2)


def safe_inverse(d: torch.Tensor) -> torch.Tensor:
    """1 / d, and 0 where d is 0 (an all-zero block quantizes to zeros, not NaN)."""
    nonzero = d != 0
    return torch.where(nonzero, 1.0 / torch.where(nonzero, d, torch.ones_like(d)), torch.zeros_like(d))


class Q8_0(Encoding):
    name, block_size, block_bytes, ggml_type, native_id = "q8_0", 32, 34, 8, 3

    def dequantize(self, raw, cols):
        b = self._blocks(raw, cols)
        q = b[:, 2:].contiguous().view(torch.int8).float()
        return (f16_field(b, 0) * q).reshape(raw.shape[:-1] + (cols,))

    def quantize(self, x):
        cols = x.shape[-1]
        xb = x.float().reshape(-1, 32)
        d = xb.abs().amax(-1) / 127
        d16 = d.clamp(max=F16_MAX).half().float()
        q = torch.round(xb * safe_inverse(d16)[:, None]).clamp(-127, 127).to(torch.int8)
        out = torch.cat((f16_bytes(d16), q.view(torch.uint8)), dim=1)
        return out.reshape(x.shape[:-1] + (self.row_bytes(cols),))


class Q4_0(Encoding):
    name, block_size, block_bytes, ggml_type, native_id = "q4_0", 32, 18, 2, 4

    def dequantize(self, raw, cols):
        b = self._blocks(raw, cols)
        qs = b[:, 2:]
        q = torch.cat((qs & 0xF, qs >> 4), dim=1).to(torch.int16) - 8
        return (f16_field(b, 0) * q.float()).reshape(raw.shape[:-1] + (cols,))

    def quantize(self, x):
        cols = x.shape[-1]
        xb = x.float().reshape(-1, 32)
        # The value of largest magnitude maps to -8 (the format's one extra negative level).
        idx = xb.abs().argmax(-1, keepdim=True)
        extreme = xb.gather(1, idx)[:, 0]
        d16 = (extreme / -8).clamp(-F16_MAX, F16_MAX).half().float()
        q = (torch.round(xb * safe_inverse(d16)[:, None]) + 8).clamp(0, 15).to(torch.uint8)
        qs = q[:, :16] | (q[:, 16:] << 4)
        out = torch.cat((f16_bytes(d16), qs), dim=1)
        return out.reshape(x.shape[:-1] + (self.row_bytes(cols),))
