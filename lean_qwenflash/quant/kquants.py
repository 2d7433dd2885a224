"""GGUF's 256-value super-block formats ("K-quants"): q2_k, q3_k, q4_k, q5_k, q6_k.

    q2_k (84 bytes): u8 scales[16], u8 qs[64], f16 d, f16 dmin
        16 sub-blocks of 16; scales[j] low nibble sc_j, high nibble m_j; value = d*sc_j * q - dmin*m_j,
        q in 0..3. In half h (weights 128h..128h+127), position p: bits 2*(p // 32)..+1 of qs[32h + p % 32].
    q3_k (110 bytes): u8 hmask[32], u8 qs[64], u8 scales[12], f16 d
        16 sub-blocks of 16 with signed 6-bit scales s_j (stored + 32: low 4 bits of sub-block j are
        nibble j // 8 of scales[j % 8], its top 2 bits are bits 2*(j // 4)..+1 of scales[8 + j % 4]);
        value = d*s_j * (q - 4), q in 0..7: bits 0-1 as q2_k's qs, bit 2 is bit (p // 32) of hmask[p % 32]
        (weight p of the super-block).

    q4_k (144 bytes): f16 d, f16 dmin, u8 scales[12], u8 qs[128]
        8 sub-blocks of 32; sub-block j has a 6-bit scale sc_j and min m_j packed in ``scales``;
        value = d*sc_j * q - dmin*m_j with q in 0..15. qs[32c + l] holds q of weight 64c + l
        (low nibble) and of weight 64c + 32 + l (high nibble).
    q5_k (176 bytes): f16 d, f16 dmin, u8 scales[12], u8 qh[32], u8 qs[128]
        as q4_k, q in 0..31; bit j of qh[l] is bit 4 of weight 32j + l's q.
    q6_k (210 bytes): u8 ql[128], u8 qh[64], int8 scales[16], f16 d
        16 sub-blocks of 16; value = d*sc_j * (q - 32), q in 0..63 (low 4 bits in ql, high 2 in qh).
        In half n (weights 128n..128n+127), position p: ql[64n + p % 64] low nibble for p < 64, high
        nibble for p >= 64; qh[32n + p % 32] bits 2*(p // 32)..+1.
"""
from __future__ import annotations

import torch

from .base import Encoding
from .legacy import F16_MAX, f16_bytes, f16_field, safe_inverse, unpack_bits

QK = 256
CHUNK_VALUES = 1 << 18      # values per chunk of a scale search


def unpack_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """scales [N, 12] -> (sc, m) each [N, 8] as int64 (6 bits each)."""
    s = s.to(torch.int64)
    lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat((lo & 63, (hi & 0xF) | ((lo >> 6) << 4)), dim=1)
    m = torch.cat((mid & 63, (hi >> 4) | ((mid >> 6) << 4)), dim=1)
    return sc, m


def pack_scale_min(sc: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`unpack_scale_min`: sc, m [N, 8] in 0..63 -> uint8 [N, 12]."""
    sc, m = sc.to(torch.int64), m.to(torch.int64)
    lo = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    mid = (m[:, :4] & 63) | ((m[:, 4:] >> 4) << 6)
    hi = (sc[:, 4:] & 0xF) | ((m[:, 4:] & 0xF) << 4)
    return torch.cat((lo, mid, hi), dim=1).to(torch.uint8)


def _nibble_pairs(q: torch.Tensor) -> torch.Tensor:
    """q [N, 256] (values < 16) -> qs [N, 128]: chunk c's byte l = q[64c+l] | q[64c+32+l] << 4."""
    q = q.view(-1, 4, 2, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)


def _unpack_nibble_pairs(qs: torch.Tensor) -> torch.Tensor:
    """qs [N, 128] -> q [N, 8, 32] (sub-block j = 2c + high)."""
    qs = qs.reshape(-1, 4, 1, 32)
    return torch.cat((qs & 0xF, qs >> 4), dim=2).reshape(-1, 8, 32)


def _affine_fit(xb: torch.Tensor, levels: int, iterations: int = 2):
    """Per sub-block (scale, min) for x ~= scale * q - min, q in 0..levels: start from the range,
    then alternate rounding q and a least-squares refit of (scale, min) with min >= 0."""
    mn = xb.amin(-1, keepdim=True).clamp(max=0)
    scale = (xb.amax(-1, keepdim=True) - mn) / levels
    mins = -mn
    n = xb.shape[-1]
    for _ in range(iterations):
        q = torch.round((xb + mins) * safe_inverse(scale)).clamp(0, levels)
        sq, sx, sqq, sqx = q.sum(-1, keepdim=True), xb.sum(-1, keepdim=True), (q * q).sum(-1, keepdim=True), \
            (q * xb).sum(-1, keepdim=True)
        det = n * sqq - sq * sq
        fit_scale = (n * sqx - sq * sx) / torch.where(det > 0, det, torch.ones_like(det))
        fit_min = (fit_scale * sq - sx) / n
        # min must stay >= 0 (the format stores it unsigned): refit the scale alone where it is not
        alone = sqx / torch.where(sqq > 0, sqq, torch.ones_like(sqq))
        use_alone = fit_min < 0
        fit_scale = torch.where(use_alone, alone, fit_scale)
        fit_min = torch.where(use_alone, torch.zeros_like(fit_min), fit_min)
        ok = (det > 0) & (fit_scale > 0)
        scale = torch.where(ok, fit_scale, scale)
        mins = torch.where(ok, fit_min, mins)
    return scale[..., 0], mins[..., 0]


def _affine_quantize(xb: torch.Tensor, levels: int, scale_levels: int = 63):
    """xb [N, S, n] -> (d16 [N], dmin16 [N], sc [N, S], m [N, S], q [N, S, n]) for
    value = d*sc*q - dmin*m, q in 0..levels, sc and m in 0..scale_levels."""
    scale, mins = _affine_fit(xb, levels)                       # [N, S]
    d16 = (scale.amax(-1) / scale_levels).clamp(max=F16_MAX).half().float()
    dmin16 = (mins.amax(-1) / scale_levels).clamp(max=F16_MAX).half().float()
    sc = torch.round(scale * safe_inverse(d16)[:, None]).clamp(0, scale_levels)
    m = torch.round(mins * safe_inverse(dmin16)[:, None]).clamp(0, scale_levels)
    eff_d = d16[:, None] * sc
    eff_m = dmin16[:, None] * m
    q = torch.round((xb + eff_m[..., None]) * safe_inverse(eff_d)[..., None]).clamp(0, levels)
    return d16, dmin16, sc.to(torch.int64), m.to(torch.int64), q.to(torch.uint8)


def _crumbs(qs: torch.Tensor) -> torch.Tensor:
    """qs [N, 64] -> q [N, 16, 16] (0..3): the 2-bit codes of q2_k / the low bits of q3_k."""
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=qs.device).view(1, 1, 4, 1)
    return ((qs.reshape(-1, 2, 1, 32) >> shifts) & 3).reshape(-1, 16, 16)


def _pack_crumbs(q: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_crumbs`: q [N, 256] (values < 4) -> qs [N, 64]."""
    q = q.to(torch.uint8).reshape(-1, 2, 4, 32)
    return (q[:, :, 0] | (q[:, :, 1] << 2) | (q[:, :, 2] << 4) | (q[:, :, 3] << 6)).reshape(-1, 64)


def _symmetric_search(xb: torch.Tensor, lo: int, hi: int, steps: int = 4) -> torch.Tensor:
    """Per group (last dim) the float scale s for x ~= s * q, q in lo..hi (integers): candidates map
    the value of largest magnitude to lo (or to hi, the other sign) times a factor in (0.75, 1];
    each is refit by least squares to its rounded codes; the one of least squared error wins.
    (Runs over chunks of groups: the candidates multiply the working memory by ``2 * steps``.)"""
    if xb.numel() > CHUNK_VALUES:
        rows = max(1, CHUNK_VALUES // max(1, xb[0].numel()))
        return torch.cat([_symmetric_search(xb[i:i + rows], lo, hi, steps) for i in range(0, xb.shape[0], rows)])
    idx = xb.abs().argmax(-1, keepdim=True)
    extreme = xb.gather(-1, idx)                                   # [..., 1]
    f = torch.linspace(0.75, 1.0, steps, device=xb.device)
    cands = torch.cat((extreme / lo * f, extreme / hi * f), dim=-1)  # [..., 2*steps]
    x = xb.unsqueeze(-2)                                           # [..., 1, n]
    q = torch.round(x * safe_inverse(cands)[..., None]).clamp(lo, hi)
    qq = (q * q).sum(-1)
    fit = (q * x).sum(-1) / torch.where(qq > 0, qq, torch.ones_like(qq))
    err = ((fit[..., None] * q - x) ** 2).sum(-1)
    best = err.argmin(-1, keepdim=True)
    return fit.gather(-1, best)[..., 0]


class Q2_K(Encoding):
    name, block_size, block_bytes, ggml_type, native_id = "q2_k", QK, 84, 10, 11

    def dequantize(self, raw, cols):
        b = self._blocks(raw, cols)
        sc = b[:, :16]
        dl = (f16_field(b, 80) * (sc & 0xF).float())[..., None]     # [N, 16, 1]
        ml = (f16_field(b, 82) * (sc >> 4).float())[..., None]
        q = _crumbs(b[:, 16:80]).float()
        return (dl * q - ml).reshape(raw.shape[:-1] + (cols,))

    def quantize(self, x):
        cols = x.shape[-1]
        d16, dmin16, sc, m, q = _affine_quantize(x.float().reshape(-1, 16, 16), 3, 15)
        out = torch.cat(((sc | (m << 4)).to(torch.uint8), _pack_crumbs(q.reshape(-1, 256)),
                         f16_bytes(d16), f16_bytes(dmin16)), dim=1)
        return out.reshape(x.shape[:-1] + (self.row_bytes(cols),))


def _q3_scales(s: torch.Tensor) -> torch.Tensor:
    """q3_k's scales [N, 12] -> signed sub-block scales [N, 16] (int16)."""
    low = torch.cat((s[:, :8] & 0xF, s[:, :8] >> 4), dim=1)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=s.device).view(1, 4, 1)
    high = ((s[:, 8:12].reshape(-1, 1, 4) >> shifts) & 3).reshape(-1, 16)
    return (low | (high << 4)).to(torch.int16) - 32


def _pack_q3_scales(sc: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_q3_scales`: sc [N, 16] in -32..31 -> uint8 [N, 12]."""
    u = (sc.to(torch.int64) + 32)
    low = (u[:, :8] & 0xF) | ((u[:, 8:] & 0xF) << 4)
    high = (u >> 4).reshape(-1, 4, 4)                  # [N, j // 4, j % 4]
    high = high[:, 0] | (high[:, 1] << 2) | (high[:, 2] << 4) | (high[:, 3] << 6)
    return torch.cat((low, high), dim=1).to(torch.uint8)


class Q3_K(Encoding):
    name, block_size, block_bytes, ggml_type, native_id = "q3_k", QK, 110, 11, 12

    def dequantize(self, raw, cols):
        b = self._blocks(raw, cols)
        dl = (f16_field(b, 108) * _q3_scales(b[:, 96:108]).float())[..., None]     # [N, 16, 1]
        high = unpack_bits(b[:, :32].reshape(-1, 32, 1)).reshape(-1, 32, 8).transpose(1, 2).reshape(-1, 16, 16)
        q = (_crumbs(b[:, 32:96]).to(torch.int8) - ((high ^ 1) << 2).to(torch.int8)).float()
        return (dl * q).reshape(raw.shape[:-1] + (cols,))

    def quantize(self, x):
        cols = x.shape[-1]
        xb = x.float().reshape(-1, 16, 16)
        scale = _symmetric_search(xb, -4, 3)                           # [N, 16]
        idx = scale.abs().argmax(-1, keepdim=True)
        d16 = (scale.gather(-1, idx)[:, 0] / -32).clamp(-F16_MAX, F16_MAX).half().float()
        sc = torch.round(scale * safe_inverse(d16)[:, None]).clamp(-32, 31)
        eff = d16[:, None] * sc
        q = (torch.round(xb * safe_inverse(eff)[..., None]).clamp(-4, 3) + 4).to(torch.uint8).reshape(-1, 256)
        hmask = ((q >> 2).reshape(-1, 8, 32).to(torch.int64) << torch.arange(8, device=q.device).view(1, 8, 1))
        out = torch.cat((hmask.sum(1).to(torch.uint8), _pack_crumbs(q & 3), _pack_q3_scales(sc),
                         f16_bytes(d16)), dim=1)
        return out.reshape(x.shape[:-1] + (self.row_bytes(cols),))


class Q4_K(Encoding):
    name, block_size, block_bytes, ggml_type, native_id = "q4_k", QK, 144, 12, 5

    def dequantize(self, raw, cols):
        b = self._blocks(raw, cols)
        sc, m = unpack_scale_min(b[:, 4:16])
        d = (f16_field(b, 0) * sc.float())[..., None]           # [N, 8, 1]
        dm = (f16_field(b, 2) * m.float())[..., None]
        q = _unpack_nibble_pairs(b[:, 16:]).float()
        return (d * q - dm).reshape(raw.shape[:-1] + (cols,))

    def quantize(self, x):
        cols = x.shape[-1]
        d16, dmin16, sc, m, q = _affine_quantize(x.float().reshape(-1, 8, 32), 15)
        out = torch.cat((f16_bytes(d16), f16_bytes(dmin16), pack_scale_min(sc, m),
                         _nibble_pairs(q.reshape(-1, 256))), dim=1)
        return out.reshape(x.shape[:-1] + (self.row_bytes(cols),))


class Q5_K(Encoding):
    name, block_size, block_bytes, ggml_type, native_id = "q5_k", QK, 176, 13, 6

    def dequantize(self, raw, cols):
        b = self._blocks(raw, cols)
        sc, m = unpack_scale_min(b[:, 4:16])
        d = (f16_field(b, 0) * sc.float())[..., None]
        dm = (f16_field(b, 2) * m.float())[..., None]
        qh = b[:, 16:48].reshape(-1, 1, 32)
        bits = torch.arange(8, dtype=torch.uint8, device=raw.device).view(1, 8, 1)
        high = ((qh >> bits) & 1) << 4                           # [N, 8, 32]
        q = (_unpack_nibble_pairs(b[:, 48:]) | high).float()
        return (d * q - dm).reshape(raw.shape[:-1] + (cols,))

    def quantize(self, x):
        cols = x.shape[-1]
        d16, dmin16, sc, m, q = _affine_quantize(x.float().reshape(-1, 8, 32), 31)   # q [N, 8, 32]
        bits = torch.arange(8, dtype=torch.uint8, device=q.device).view(1, 8, 1)
        qh = (((q >> 4) & 1) << bits).sum(1, dtype=torch.int64).to(torch.uint8)      # [N, 32]
        out = torch.cat((f16_bytes(d16), f16_bytes(dmin16), pack_scale_min(sc, m), qh,
                         _nibble_pairs((q & 0xF).reshape(-1, 256))), dim=1)
        return out.reshape(x.shape[:-1] + (self.row_bytes(cols),))


class Q6_K(Encoding):
    name, block_size, block_bytes, ggml_type, native_id = "q6_k", QK, 210, 14, 7

    def dequantize(self, raw, cols):
        b = self._blocks(raw, cols)
        ql = b[:, :128].reshape(-1, 2, 64)
        low = torch.cat((ql & 0xF, ql >> 4), dim=2)                   # [N, 2, 128]
        qh = b[:, 128:192].reshape(-1, 2, 1, 32)
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=raw.device).view(1, 1, 4, 1)
        high = ((qh >> shifts) & 3).reshape(-1, 2, 128)
        q = ((low | (high << 4)).to(torch.int16) - 32).float().reshape(-1, 16, 16)
        sc = b[:, 192:208].contiguous().view(torch.int8).float()      # [N, 16]
        d = (f16_field(b, 208) * sc)[..., None]
        return (d * q).reshape(raw.shape[:-1] + (cols,))

    def quantize(self, x):
        cols = x.shape[-1]
        xb = x.float().reshape(-1, 16, 16)
        idx = xb.abs().argmax(-1, keepdim=True)
        scale = xb.gather(-1, idx)[..., 0] / -32                      # [N, 16]: extreme -> -32
        d16 = (scale.abs().amax(-1) / 127).clamp(max=F16_MAX).half().float()
        sc = torch.round(scale * safe_inverse(d16)[:, None]).clamp(-128, 127)
        eff = d16[:, None] * sc
        q = (torch.round(xb * safe_inverse(eff)[..., None]) + 32).clamp(0, 63).to(torch.uint8).reshape(-1, 2, 4, 32)
        ql = torch.cat(((q[:, :, 0] & 0xF) | ((q[:, :, 2] & 0xF) << 4),
                        (q[:, :, 1] & 0xF) | ((q[:, :, 3] & 0xF) << 4)), dim=2).reshape(-1, 128)
        qh = ((q[:, :, 0] >> 4) | ((q[:, :, 1] >> 4) << 2) | ((q[:, :, 2] >> 4) << 4)
              | ((q[:, :, 3] >> 4) << 6)).reshape(-1, 64)
        out = torch.cat((ql, qh, sc.to(torch.int8).view(torch.uint8), f16_bytes(d16)), dim=1)
        return out.reshape(x.shape[:-1] + (self.row_bytes(cols),))
