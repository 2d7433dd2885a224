"""MXFP4 (OCP microscaling FP4), as GPT-OSS checkpoints store their experts.

A block is 32 consecutive values of a row: 16 bytes of e2m1 codes (element 2i in the low nibble of
byte i, element 2i+1 in the high nibble) and one e8m0 scale byte s (the block's values are code
value x 2^(s - 127)). Tensors: ``blocks`` uint8 [..., rows, cols/32, 16], ``scales`` uint8
[..., rows, cols/32]. Every MXFP4 value is exactly representable in bf16, so dequantizing to bf16
loses nothing. Not a pack encoding yet: the packer dequantizes (see store/checkpoint.py).
"""
from __future__ import annotations

import torch

BLOCK = 32
# e2m1 code -> value (bit 3 is the sign).
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 [..., rows, cols] from ``blocks`` [..., rows, cols/32, 16] and ``scales`` [..., rows, cols/32]."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != BLOCK // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)} "
                         f"(blocks must be [..., rows, groups, {BLOCK // 2}], scales [..., rows, groups])")
    lut = torch.tensor(E2M1, dtype=torch.float32)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).reshape(*blocks.shape[:-1], BLOCK)
    values = lut[codes.long()]
    values = torch.ldexp(values, scales.to(torch.int32)[..., None] - 127)
    return values.reshape(*blocks.shape[:-2], blocks.shape[-2] * BLOCK)


def quantize(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks, scales) of ``values`` [..., rows, cols] (cols a multiple of 32): per block the scale
    that fits the largest magnitude in e2m1's range (max 6), then the nearest code (ties: the
    first). For tests and converters; ``dequantize(*quantize(x))`` is x rounded to MXFP4."""
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
