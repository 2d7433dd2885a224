"""GGUF's 32-value block formats ("legacy" quants): q8_0, q4_0, q4_1, q5_0, q5_1.

    q8_0 block (34 bytes): f16 d, int8 q[32]                 value = d * q
    q4_0 block (18 bytes): f16 d, u8 qs[16]                  value = d * (q - 8), q in 0..15
    q4_1 block (20 bytes): f16 d, f16 m, u8 qs[16]           value = d * q + m, q in 0..15
    q5_0 block (22 bytes): f16 d, u8 qh[4], u8 qs[16]        value = d * (q - 16), q in 0..31
    q5_1 block (24 bytes): f16 d, f16 m, u8 qh[4], u8 qs[16] value = d * q + m, q in 0..31

In every one, q[j] (j < 16) is the low nibble of qs[j] and q[j + 16] its high nibble; for the
5-bit ones bit 4 of q[j] is bit j of qh read as a little-endian u32 (bit j % 8 of byte j // 8).
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


def nibbles(qs: torch.Tensor) -> torch.Tensor:
    """qs [N, 16] -> q [N, 32] uint8: the low nibbles (values 0..15), then the high ones (16..31)."""
    return torch.cat((qs & 0xF, qs >> 4), dim=1)


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`nibbles`: q [N, 32] (values < 16) -> qs [N, 16]."""
    q = q.to(torch.uint8)
    return q[:, :16] | (q[:, 16:] << 4)


def unpack_bits(b: torch.Tensor) -> torch.Tensor:
    """uint8 [N, k] -> [N, 8k] of 0/1: bit i of the result is bit i % 8 of byte i // 8."""
    shifts = torch.arange(8, dtype=torch.uint8, device=b.device)
    return ((b[..., None] >> shifts) & 1).reshape(*b.shape[:-1], b.shape[-1] * 8)


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`unpack_bits`: [N, 8k] of 0/1 -> uint8 [N, k]."""
    shifts = torch.arange(8, dtype=torch.int64, device=bits.device)
    b = bits.to(torch.int64).reshape(*bits.shape[:-1], bits.shape[-1] // 8, 8) << shifts
    return b.sum(-1).to(torch.uint8)


def _symmetric_fit(xb: torch.Tensor, most_negative: int) -> torch.Tensor:
    """The f16 scale d (float32 [N]) that maps each block's value of largest magnitude to
    ``most_negative`` (the format's one extra negative level), as ggml's reference quantizers do."""
    idx = xb.abs().argmax(-1, keepdim=True)
    extreme = xb.gather(1, idx)[:, 0]
    return (extreme / most_negative).clamp(-F16_MAX, F16_MAX).half().float()


def _affine_fit(xb: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(d, m) as f16-rounded float32 [N] for value = d * q + m, q in 0..levels: m the block's
    minimum, d its range over the levels; d is then refit (least squares with m fixed) to the
    rounded codes, which never raises the error of the plain range fit by much and usually lowers it."""
    mn, mx = xb.amin(-1), xb.amax(-1)
    m16 = mn.clamp(-F16_MAX, F16_MAX).half().float()
    d16 = ((mx - m16) / levels).clamp(0, F16_MAX).half().float()
    q = torch.round((xb - m16[:, None]) * safe_inverse(d16)[:, None]).clamp(0, levels)
    r = xb - m16[:, None]
    qq = (q * q).sum(-1)
    fit = ((q * r).sum(-1) / torch.where(qq > 0, qq, torch.ones_like(qq))).clamp(0, F16_MAX).half().float()
    err = lambda d: ((torch.round(r * safe_inverse(d)[:, None]).clamp(0, levels) * d[:, None] - r) ** 2).sum(-1)
    d16 = torch.where((qq > 0) & (err(fit) < err(d16)), fit, d16)
    return d16, m16


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
        q = nibbles(qs).to(torch.int16) - 8
        return (f16_field(b, 0) * q.float()).reshape(raw.shape[:-1] + (cols,))

    def quantize(self, x):
        cols = x.shape[-1]
        xb = x.float().reshape(-1, 32)
        d16 = _symmetric_fit(xb, -8)
        q = (torch.round(xb * safe_inverse(d16)[:, None]) + 8).clamp(0, 15)
        out = torch.cat((f16_bytes(d16), pack_nibbles(q)), dim=1)
        return out.reshape(x.shape[:-1] + (self.row_bytes(cols),))


class Q4_1(Encoding):
    name, block_size, block_bytes, ggml_type, native_id = "q4_1", 32, 20, 3, 8

    def dequantize(self, raw, cols):
        b = self._blocks(raw, cols)
        q = nibbles(b[:, 4:]).float()
        return (f16_field(b, 0) * q + f16_field(b, 2)).reshape(raw.shape[:-1] + (cols,))

    def quantize(self, x):
        cols = x.shape[-1]
        xb = x.float().reshape(-1, 32)
        d16, m16 = _affine_fit(xb, 15)
        q = torch.round((xb - m16[:, None]) * safe_inverse(d16)[:, None]).clamp(0, 15)
        out = torch.cat((f16_bytes(d16), f16_bytes(m16), pack_nibbles(q)), dim=1)
        return out.reshape(x.shape[:-1] + (self.row_bytes(cols),))


def _five_bits(b: torch.Tensor, qh_at: int) -> torch.Tensor:
    """q [N, 32] (0..31) of a 5-bit block whose qh starts at byte ``qh_at`` (qs follows it)."""
    return nibbles(b[:, qh_at + 4:]) | (unpack_bits(b[:, qh_at:qh_at + 4]) << 4)


def _split_five_bits(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, 32] (0..31) -> (qh [N, 4], qs [N, 16])."""
    q = q.to(torch.uint8)
    return pack_bits(q >> 4), pack_nibbles(q & 0xF)


class Q5_0(Encoding):
    name, block_size, block_bytes, ggml_type, native_id = "q5_0", 32, 22, 6, 9

    def dequantize(self, raw, cols):
        b = self._blocks(raw, cols)
        q = _five_bits(b, 2).to(torch.int16) - 16
        return (f16_field(b, 0) * q.float()).reshape(raw.shape[:-1] + (cols,))

    def quantize(self, x):
        cols = x.shape[-1]
        xb = x.float().reshape(-1, 32)
        d16 = _symmetric_fit(xb, -16)
        q = (torch.round(xb * safe_inverse(d16)[:, None]) + 16).clamp(0, 31)
        qh, qs = _split_five_bits(q)
        out = torch.cat((f16_bytes(d16), qh, qs), dim=1)
        return out.reshape(x.shape[:-1] + (self.row_bytes(cols),))


class Q5_1(Encoding):
    name, block_size, block_bytes, ggml_type, native_id = "q5_1", 32, 24, 7, 10

    def dequantize(self, raw, cols):
        b = self._blocks(raw, cols)
        q = _five_bits(b, 4).float()
        return (f16_field(b, 0) * q + f16_field(b, 2)).reshape(raw.shape[:-1] + (cols,))

    def quantize(self, x):
        cols = x.shape[-1]
        xb = x.float().reshape(-1, 32)
        d16, m16 = _affine_fit(xb, 31)
        q = torch.round((xb - m16[:, None]) * safe_inverse(d16)[:, None]).clamp(0, 31)
        qh, qs = _split_five_bits(q)
        out = torch.cat((f16_bytes(d16), f16_bytes(m16), qh, qs), dim=1)
        return out.reshape(x.shape[:-1] + (self.row_bytes(cols),))
