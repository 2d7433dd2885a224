"""MXFP4 (OCP microscaling FP4): the ``mxfp4`` encoding in GGML's block layout, and the layout
GPT-OSS Hugging Face checkpoints store their experts in.

    mxfp4 block (32 values, 17 bytes): u8 e, u8 qs[16]; value = KVALUES[q] * 2^(e - 128), where
    KVALUES are the e2m1 code values doubled (``iq_tables()["kvalues_mxfp4"]``: 0, 1, 2, 3, 4, 6,
    8, 12 and their negatives; bit 3 of a code is the sign); q[j] (j < 16) is the low nibble of
    qs[j], q[j + 16] its high nibble (q4_0's order).

A Hugging Face checkpoint stores the same codes and scales differently: ``blocks`` uint8
[..., rows, cols/32, 16] with element 2i in the low nibble of byte i and 2i + 1 in the high one,
and ``scales`` uint8 [..., rows, cols/32] (the same e byte: value = e2m1 value x 2^(e - 127)).
:func:`from_hf` moves those nibbles into the block layout (no arithmetic), so a checkpoint's
experts pack byte for byte. Every MXFP4 value is a bfloat16 value.
"""
from __future__ import annotations

import torch

from .base import Encoding
from .legacy import nibbles, pack_nibbles

BLOCK = 32
# e2m1 code -> value (bit 3 is the sign).
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def _half_scale(e: torch.Tensor) -> torch.Tensor:
    """e8m0 bytes -> float32 2^(e - 128), built from its bits (exact, subnormal for e < 2)."""
    e = e.to(torch.int32)
    bits = torch.where(e < 2, torch.bitwise_left_shift(torch.full_like(e, 0x00200000), e), (e - 1) << 23)
    return bits.view(torch.float32)


def _kvalues(device) -> torch.Tensor:
    from .iquants import table     # the table lives with the other lookup tables (from gguf)
    return table("kvalues_mxfp4", device)


class MXFP4(Encoding):
    name, block_size, block_bytes, ggml_type, native_id = "mxfp4", BLOCK, 17, 39, 15

    def dequantize(self, raw, cols):
        b = self._blocks(raw, cols)
        q = _kvalues(raw.device)[nibbles(b[:, 1:]).long()]
        return (_half_scale(b[:, :1]) * q).reshape(raw.shape[:-1] + (cols,))

    def quantize(self, x):
        """Per block the exponent that puts the largest magnitude at 6 or below (e2m1's top), or the
        one above (llama.cpp's choice, which clips it to 6): whichever gives the smaller squared
        error; then the nearest code."""
        cols = x.shape[-1]
        xb = x.float().reshape(-1, BLOCK)
        amax = xb.abs().amax(-1)
        # exponent of 2^(e - 127) with amax / 2^(e - 127) <= 6
        exp = torch.ceil(torch.log2(torch.where(amax > 0, amax, torch.ones_like(amax)) / 6.0))
        best_e, best_q, best_err = None, None, None
        for shift in (0, -1):
            e = (exp + shift + 127).clamp(0, 254)
            e = torch.where(amax > 0, e, torch.zeros_like(e)).to(torch.uint8)
            q = _nearest_e2m1(xb, e)
            err = ((self._values(e, q) - xb) ** 2).sum(-1)
            if best_e is None:
                best_e, best_q, best_err = e, q, err
            else:
                take = err < best_err
                best_e = torch.where(take, e, best_e)
                best_q = torch.where(take[:, None], q, best_q)
                best_err = torch.where(take, err, best_err)
        out = torch.cat((best_e[:, None], pack_nibbles(best_q)), dim=1)
        return out.reshape(x.shape[:-1] + (self.row_bytes(cols),))

    @staticmethod
    def _values(e: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        return _half_scale(e[:, None]) * _kvalues(q.device)[q.long()]


_NEAREST: dict = {}


def _nearest_e2m1(xb: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
    """The nearest code (0..15) of each value of xb [N, 32] at block exponents e [N]. In units of
    the doubled table (0, 1, 2, 3, 4, 6, 8, 12) the midpoints are multiples of 1/2, so a lookup on
    floor(2 |v|) is exact."""
    lut = _NEAREST.get(str(xb.device))
    if lut is None:
        pos = _kvalues("cpu")[:8]
        centres = (torch.arange(26, dtype=torch.float32) + 0.5) / 2
        lut = _NEAREST[str(xb.device)] = (centres[:, None] - pos).abs().argmin(-1).to(torch.uint8).to(xb.device)
    v = xb / _half_scale(e)[:, None]
    code = lut[torch.floor(v.abs() * 2).clamp_(max=25).long()]
    return code | ((v < 0).to(torch.uint8) << 3)


# -- the Hugging Face checkpoint layout ----------------------------------------------------------

def _check_hf(blocks: torch.Tensor, scales: torch.Tensor) -> None:
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} "
                         f"(blocks must be [..., rows, groups, {BLOCK // 2}], scales [..., rows, groups])")


def from_hf(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """A checkpoint's ``blocks`` [..., rows, groups, 16] and ``scales`` [..., rows, groups] ->
    mxfp4 rows uint8 [..., rows, groups * 17]: the same codes and scale bytes, rearranged."""
    _check_hf(blocks, scales)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).reshape(*blocks.shape[:-1], BLOCK)
    out = torch.cat((scales[..., None], codes[..., :16] | (codes[..., 16:] << 4)), dim=-1)
    return out.reshape(*scales.shape[:-1], scales.shape[-1] * MXFP4.block_bytes)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 [..., rows, cols] from a checkpoint's ``blocks`` [..., rows, cols/32, 16] and
    ``scales`` [..., rows, cols/32]."""
    _check_hf(blocks, scales)
    lut = torch.tensor(E2M1, dtype=torch.float32, device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).reshape(*blocks.shape[:-1], BLOCK)
    values = lut[codes.long()]
    values = torch.ldexp(values, scales.to(torch.int32)[..., None] - 127)
    return values.reshape(*blocks.shape[:-2], blocks.shape[-2] * BLOCK)


def quantize(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks, scales) in the checkpoint layout of ``values`` [..., rows, cols] (cols a multiple
    of 32): per block the scale that fits the largest magnitude in e2m1's range (max 6), then the
    nearest code (ties: the first). For tests and converters; ``dequantize(*quantize(x))`` is x
    rounded to MXFP4."""
    if values.shape[-1] % BLOCK:
        raise ValueError(f"MXFP4 rows must be a multiple of {BLOCK} values, got {values.shape[-1]}")
    x = values.float().reshape(*values.shape[:-1], values.shape[-1] // BLOCK, BLOCK)
    amax = x.abs().amax(dim=-1).clamp_min(2.0 ** -126)
    exp = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127).to(torch.int32)
    scaled = x / torch.ldexp(torch.ones_like(amax), exp)[..., None]
    lut = torch.tensor(E2M1, dtype=torch.float32)
    codes = (scaled[..., None] - lut).abs().argmin(dim=-1).to(torch.uint8)
    pairs = codes.reshape(*codes.shape[:-1], BLOCK // 2, 2)
    blocks = (pairs[..., 0] | (pairs[..., 1] << 4)).to(torch.uint8)
    return blocks, (exp + 127).to(torch.uint8)
