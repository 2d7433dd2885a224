"""GGUF's non-linear and lattice formats ("I-quants"): iq4_nl, iq4_xs, iq3_xxs, iq3_s, iq2_xxs,
iq2_xs, iq2_s, iq1_s, iq1_m.

    iq4_nl  (32 values, 18 bytes): f16 d, u8 qs[16]; value = d * KVALUES[q], q as q4_0's nibbles.
    iq4_xs  (256, 136): f16 d, u16 scales_h, u8 scales_l[4], u8 qs[128]; 8 sub-blocks of 32 with
            6-bit scales ls_j (low 4 bits: nibble j % 2 of scales_l[j // 2]; high 2: bits 2j..2j+1 of
            scales_h); value = d * (ls_j - 32) * KVALUES[q], sub-block j's codes in qs[16j..16j+15]
            as q4_0's nibbles.
    iq3_xxs (256, 98): f16 d, u8 qs[64], u32 aux[8]. Group g (32 values): 8 indexes qs[8g..8g+7]
            into the 4-value grid ``iq3xxs_grid``; aux[g]'s 4 x 7 bits (bits 0, 7, 14, 21) index
            KSIGNS (8 sign bits each, for 8 values), its top 4 bits s: value =
            d * (0.5 + s) * 0.5 * grid * sign.
    iq3_s   (256, 110): f16 d, u8 qs[64], u8 qh[8], u8 signs[32], u8 scales[4]; index i = qs[i] |
            (bit i % 8 of qh[i // 8]) << 8 into ``iq3s_grid`` (4 values); bit k of signs[j] is the
            sign of value 8j + k; group g's scale is nibble g % 2 of scales[g // 2]:
            value = d * (1 + 2 s) * grid * sign.
    iq2_xxs (256, 66): f16 d, then per group g of 32 u32 (a0, a1): a0's 4 bytes index
            ``iq2xxs_grid`` (8 values); a1 as iq3_xxs's aux: value = d * (0.5 + s) * 0.25 * grid * sign.
    iq2_xs  (256, 74): f16 d, u16 qs[32], u8 scales[8]: qs[i] & 511 indexes ``iq2xs_grid``, qs[i] >> 9
            KSIGNS; the 16 nibbles of scales give one scale per 16 values (value = d * (0.5 + s) * 0.25 *
            grid * sign).
    iq2_s   (256, 82): f16 d, u8 qs[32], u8 signs[32], u8 qh[8], u8 scales[8]: index i = qs[i] |
            (bits 2*(i % 4)..+1 of qh[i // 4]) << 8 into ``iq2s_grid``; sign bits as iq3_s; scales as iq2_xs.
    iq1_s   (256, 50): f16 d, u8 qs[32], u16 qh[8]: group g (32 values) takes index qs[4g + k] |
            ((qh[g] >> 3k) & 7) << 8 into ``iq1s_grid`` (8 values in -1, 0, 1), scale
            d * (2 * ((qh[g] >> 12) & 7) + 1) and delta -0.125 if bit 15 of qh[g] else +0.125:
            value = scale * (grid + delta).
    iq1_m   (256, 56): u8 qs[32], u8 qh[16], u16 sc[4]; the f16 d is the top nibbles of sc[0..3]
            (sc[0]'s the lowest); scale j (one per 16 values) is bits 3*(j % 4)..+2 of sc[j // 4];
            nibble h of qh[j] gives index 2j + h (8 values) its bits 8..10 (the nibble's low 3 bits)
            and its delta's sign (bit 3): value = d * (2 s + 1) * (grid + delta).

The grids and the sign table are not written here: they come at run time from the ``gguf``
package (``gguf.quants`` builds them for its reference dequantizers); :func:`iq_tables` hands
them out (numpy), e.g. for the native kernels.

Only iq4_nl and iq4_xs have quantizers here (a scale search over a fixed 16-value table). The
lattice formats (iq3_*, iq2_*, iq1_*) need an importance matrix to quantize well: they are
import-only (a GGUF file made by llama.cpp).
"""
from __future__ import annotations

import functools

import numpy as np
import torch

from .base import Encoding
from .kquants import CHUNK_VALUES, QK
from .legacy import F16_MAX, f16_bytes, f16_field, nibbles, pack_nibbles, safe_inverse, unpack_bits


@functools.lru_cache(maxsize=None)
def _gguf_quants():
    try:
        import gguf.quants as q
    except ImportError:  # pragma: no cover - gguf is a dependency
        raise RuntimeError("the I-quant grids come from the `gguf` package: pip install gguf") from None
    missing = [c for c in ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS", "IQ3_S", "IQ1_S", "IQ4_NL", "MXFP4")
               if not hasattr(q, c)]
    if missing:
        import gguf
        raise RuntimeError(f"gguf {getattr(gguf, '__version__', '(unknown version)')} lacks {', '.join(missing)}, "
                           "whose tables the I-quant and mxfp4 encodings read: pip install -U gguf")
    return q


def _grid(cls_name: str) -> np.ndarray:
    q = getattr(_gguf_quants(), cls_name)
    q.init_grid()
    return np.asarray(q.grid).reshape(q.grid_shape)


@functools.lru_cache(maxsize=None)
def iq_tables() -> dict:
    """The lookup tables of the I-quant formats and of mxfp4, as numpy arrays (read-only), taken
    from the ``gguf`` package. Each grid row is one index's values, in order, so a C-contiguous
    uint8 grid [N, 8] is also ggml's table of N little-endian u64 words (and [N, 4] of u32 words).

    * ``iq2xxs_grid`` uint8 [256, 8]  values in {8, 25, 43}
    * ``iq2xs_grid``  uint8 [512, 8]  values in {8, 25, 43}
    * ``iq2s_grid``   uint8 [1024, 8] values in {8, 25, 43}
    * ``iq3xxs_grid`` uint8 [256, 4]  values in {4, 12, 20, 28, 36, 44, 52, 62}
    * ``iq3s_grid``   uint8 [512, 4]  values in {1, 3, 5, ..., 15}
    * ``iq1s_grid``   int8 [2048, 8]  values in {-1, 0, 1} (iq1_s and iq1_m)
    * ``ksigns``      uint8 [128]     a 7-bit sign index -> 8 sign bits (bit k set: value k is negative;
                                       bit 7 makes the count of set bits even) (iq2_xxs, iq2_xs, iq3_xxs)
    * ``kvalues_iq4nl`` int8 [16]     the iq4_nl / iq4_xs code values
    * ``kvalues_mxfp4`` int8 [16]     e2m1 code values doubled (value = code value x 2^(e - 128))
    """
    q = _gguf_quants()
    out = {
        "iq2xxs_grid": _grid("IQ2_XXS").astype(np.uint8),
        "iq2xs_grid": _grid("IQ2_XS").astype(np.uint8),
        "iq2s_grid": _grid("IQ2_S").astype(np.uint8),
        "iq3xxs_grid": _grid("IQ3_XXS").astype(np.uint8),
        "iq3s_grid": _grid("IQ3_S").astype(np.uint8),
        "iq1s_grid": _grid("IQ1_S").astype(np.int8),
        "ksigns": np.frombuffer(q.IQ2_XXS.ksigns, dtype=np.uint8).copy(),
        "kvalues_iq4nl": np.array(q.IQ4_NL.kvalues, dtype=np.int8),
        "kvalues_mxfp4": np.array(q.MXFP4.kvalues, dtype=np.int8),
    }
    for a in out.values():
        a.setflags(write=False)
    return out


_DEVICE_TABLES: dict = {}


def table(name: str, device) -> torch.Tensor:
    """:func:`iq_tables`' ``name`` as a float32 tensor on ``device`` (kept; the values are small
    integers, exact in float32); ``ksigns`` stays uint8."""
    key = (name, str(device))
    t = _DEVICE_TABLES.get(key)
    if t is None:
        a = iq_tables()[name]
        t = torch.from_numpy(a.copy())
        t = (t if name == "ksigns" else t.float()).to(device)
        _DEVICE_TABLES[key] = t
    return t


def _u16(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 2k] -> int64 [..., k] (little-endian u16)."""
    b = b.to(torch.int64).reshape(*b.shape[:-1], -1, 2)
    return b[..., 0] | (b[..., 1] << 8)


def _u32(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 4k] -> int64 [..., k] (little-endian u32)."""
    b = b.to(torch.int64).reshape(*b.shape[:-1], -1, 4)
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)


def _ksign_values(idx: torch.Tensor) -> torch.Tensor:
    """7-bit sign indexes [...] -> +-1.0 [..., 8]."""
    signs = table("ksigns", idx.device)[idx]
    return 1.0 - 2.0 * unpack_bits(signs[..., None]).float()


def _bit_signs(b: torch.Tensor) -> torch.Tensor:
    """Sign bytes [N, k] -> +-1.0 [N, 8k] (bit i % 8 of byte i // 8 set: value i is negative)."""
    return 1.0 - 2.0 * unpack_bits(b).float()


def _scale_nibbles(b: torch.Tensor) -> torch.Tensor:
    """uint8 [N, k] -> float32 [N, 2k]: low nibble of byte i is entry 2i, its high nibble 2i + 1."""
    return torch.stack((b & 0xF, b >> 4), dim=-1).reshape(b.shape[0], -1).float()


class _ImportOnly(Encoding):
    def quantize(self, x):
        raise ValueError(f"{self.name} cannot be produced by `pack --quant`: its quantizer needs an importance "
                         "matrix (llama.cpp's llama-imatrix) to be any good. Quantize the model with llama.cpp "
                         f"(llama-quantize --imatrix ... {self.name.upper()}) and pack the GGUF file it writes; "
                         "its blocks are imported byte for byte")


class IQ2_XXS(_ImportOnly):
    name, block_size, block_bytes, ggml_type, native_id = "iq2_xxs", QK, 66, 16, 18

    def dequantize(self, raw, cols):
        b = self._blocks(raw, cols)
        g = b[:, 2:].reshape(-1, 8, 8)                                  # [N, group, (a0, a1) bytes]
        a1 = _u32(g[:, :, 4:])[..., 0]                                  # [N, 8]
        db = (f16_field(b, 0) * (0.5 + (a1 >> 28).float()) * 0.25)[..., None, None]
        shifts = torch.tensor([0, 7, 14, 21], dtype=torch.int64, device=raw.device)
        signs = _ksign_values((a1[..., None] >> shifts) & 127)          # [N, 8, 4, 8]
        grid = table("iq2xxs_grid", raw.device)[g[:, :, :4].long()]     # [N, 8, 4, 8]
        return (db * grid * signs).reshape(raw.shape[:-1] + (cols,))


class IQ2_XS(_ImportOnly):
    name, block_size, block_bytes, ggml_type, native_id = "iq2_xs", QK, 74, 17, 19

    def dequantize(self, raw, cols):
        b = self._blocks(raw, cols)
        qs = _u16(b[:, 2:66])                                           # [N, 32]
        db = (f16_field(b, 0) * (0.5 + _scale_nibbles(b[:, 66:74])) * 0.25).reshape(-1, 16, 1, 1)
        signs = _ksign_values(qs >> 9).reshape(-1, 16, 2, 8)
        grid = table("iq2xs_grid", raw.device)[qs & 511].reshape(-1, 16, 2, 8)
        return (db * grid * signs).reshape(raw.shape[:-1] + (cols,))


class IQ2_S(_ImportOnly):
    name, block_size, block_bytes, ggml_type, native_id = "iq2_s", QK, 82, 22, 20

    def dequantize(self, raw, cols):
        b = self._blocks(raw, cols)
        db = (f16_field(b, 0) * (0.5 + _scale_nibbles(b[:, 74:82])) * 0.25).reshape(-1, 16, 1, 1)
        signs = _bit_signs(b[:, 34:66]).reshape(-1, 16, 2, 8)
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=raw.device)
        qh = ((b[:, 66:74, None] >> shifts) & 3).reshape(-1, 32).to(torch.int64)
        idx = b[:, 2:34].to(torch.int64) | (qh << 8)
        grid = table("iq2s_grid", raw.device)[idx].reshape(-1, 16, 2, 8)
        return (db * grid * signs).reshape(raw.shape[:-1] + (cols,))


class IQ3_XXS(_ImportOnly):
    name, block_size, block_bytes, ggml_type, native_id = "iq3_xxs", QK, 98, 18, 16

    def dequantize(self, raw, cols):
        b = self._blocks(raw, cols)
        aux = _u32(b[:, 66:98])                                         # [N, 8]
        db = (f16_field(b, 0) * (0.5 + (aux >> 28).float()) * 0.5)[..., None, None]
        shifts = torch.tensor([0, 7, 14, 21], dtype=torch.int64, device=raw.device)
        signs = _ksign_values((aux[..., None] >> shifts) & 127)         # [N, 8, 4, 8]
        grid = table("iq3xxs_grid", raw.device)[b[:, 2:66].long()].reshape(-1, 8, 4, 8)
        return (db * grid * signs).reshape(raw.shape[:-1] + (cols,))


class IQ3_S(_ImportOnly):
    name, block_size, block_bytes, ggml_type, native_id = "iq3_s", QK, 110, 21, 17

    def dequantize(self, raw, cols):
        b = self._blocks(raw, cols)
        db = (f16_field(b, 0) * (1 + 2 * _scale_nibbles(b[:, 106:110])))[..., None, None]    # [N, 8, 1, 1]
        signs = _bit_signs(b[:, 74:106]).reshape(-1, 8, 4, 8)
        idx = b[:, 2:66].to(torch.int64) | (unpack_bits(b[:, 66:74]).to(torch.int64) << 8)
        grid = table("iq3s_grid", raw.device)[idx].reshape(-1, 8, 4, 8)
        return (db * grid * signs).reshape(raw.shape[:-1] + (cols,))


IQ1_DELTA = 0.125


class IQ1_S(_ImportOnly):
    name, block_size, block_bytes, ggml_type, native_id = "iq1_s", QK, 50, 19, 21

    def dequantize(self, raw, cols):
        b = self._blocks(raw, cols)
        qh = _u16(b[:, 34:50])                                          # [N, 8]
        dl = (f16_field(b, 0) * (2 * ((qh >> 12) & 7) + 1).float())[..., None, None]
        delta = torch.where((qh & 0x8000) == 0, IQ1_DELTA, -IQ1_DELTA)[..., None, None]
        shifts = torch.tensor([0, 3, 6, 9], dtype=torch.int64, device=raw.device)
        idx = b[:, 2:34].to(torch.int64).reshape(-1, 8, 4) | (((qh[..., None] >> shifts) & 7) << 8)
        grid = table("iq1s_grid", raw.device)[idx]                       # [N, 8, 4, 8]
        return (dl * (grid + delta)).reshape(raw.shape[:-1] + (cols,))


class IQ1_M(_ImportOnly):
    name, block_size, block_bytes, ggml_type, native_id = "iq1_m", QK, 56, 29, 22

    def dequantize(self, raw, cols):
        b = self._blocks(raw, cols)
        sc = _u16(b[:, 48:56])                                          # [N, 4]
        bits = ((sc[:, 0] >> 12) | ((sc[:, 1] >> 8) & 0xF0) | ((sc[:, 2] >> 4) & 0xF00) | (sc[:, 3] & 0xF000))
        d = torch.where(bits >= 1 << 15, bits - (1 << 16), bits).to(torch.int16).view(torch.float16).float()[:, None]
        shifts = torch.tensor([0, 3, 6, 9], dtype=torch.int64, device=raw.device)
        s = ((sc[..., None] >> shifts) & 7).reshape(-1, 16)
        dl = (d * (2 * s + 1).float()).reshape(-1, 8, 2, 1, 1)
        qh = torch.stack((b[:, 32:48] & 0xF, b[:, 32:48] >> 4), dim=-1).reshape(-1, 32)   # one nibble per index
        idx = b[:, :32].to(torch.int64) | ((qh & 7).to(torch.int64) << 8)
        delta = torch.where((qh & 8) == 0, IQ1_DELTA, -IQ1_DELTA).reshape(-1, 8, 2, 2, 1)
        grid = table("iq1s_grid", raw.device)[idx].reshape(-1, 8, 2, 2, 8)
        return (dl * (grid + delta)).reshape(raw.shape[:-1] + (cols,))


# -- iq4_nl / iq4_xs: a 16-value non-linear table with one scale per 32 values --------------------

_NEAREST: dict = {}


def _nearest_codes(v: torch.Tensor) -> torch.Tensor:
    """v (x / scale) -> the index of the nearest KVALUES entry (int64, same shape). The midpoints
    between the table's (integer) values are multiples of 1/2, so a lookup on floor(2 v) is exact."""
    lut = _NEAREST.get(str(v.device))
    if lut is None:
        kv = table("kvalues_iq4nl", "cpu")
        bins = (torch.arange(-256, 256, dtype=torch.float32) + 0.5) / 2          # bin centres
        lut = _NEAREST[str(v.device)] = (bins[:, None] - kv).abs().argmin(-1).to(v.device)
    return lut[(torch.floor(v * 2).clamp_(-256, 255) + 256).long()]


def _nl_search(xb: torch.Tensor, factors=(0.9, 1.0)) -> torch.Tensor:
    """Per group of 32 (xb [..., 32]) the float scale s for x ~= s * KVALUES[q]: candidates put
    the value of largest magnitude at either end of the table (-127 or +113) times a factor a bit
    below 1; each is refit by least squares to its nearest codes; the least squared error wins."""
    if xb.numel() > CHUNK_VALUES:
        rows = max(1, CHUNK_VALUES // max(1, xb[0].numel()))
        return torch.cat([_nl_search(xb[i:i + rows], factors) for i in range(0, xb.shape[0], rows)])
    kv = table("kvalues_iq4nl", xb.device)
    idx = xb.abs().argmax(-1, keepdim=True)
    extreme = xb.gather(-1, idx)
    f = torch.tensor(factors, device=xb.device)
    cands = torch.cat((extreme / kv[0] * f, extreme / kv[-1] * f), dim=-1)      # [..., C]
    x = xb.unsqueeze(-2)
    k = kv[_nearest_codes(x * safe_inverse(cands)[..., None])]                 # [..., C, 32]
    kk = (k * k).sum(-1)
    fit = (k * x).sum(-1) / torch.where(kk > 0, kk, torch.ones_like(kk))
    err = ((fit[..., None] * k - x) ** 2).sum(-1)
    return fit.gather(-1, err.argmin(-1, keepdim=True))[..., 0]


class IQ4_NL(Encoding):
    name, block_size, block_bytes, ggml_type, native_id = "iq4_nl", 32, 18, 20, 13

    def dequantize(self, raw, cols):
        b = self._blocks(raw, cols)
        q = table("kvalues_iq4nl", raw.device)[nibbles(b[:, 2:]).long()]
        return (f16_field(b, 0) * q).reshape(raw.shape[:-1] + (cols,))

    def quantize(self, x):
        cols = x.shape[-1]
        xb = x.float().reshape(-1, 32)
        d16 = _nl_search(xb).clamp(-F16_MAX, F16_MAX).half().float()
        q = _nearest_codes(xb * safe_inverse(d16)[:, None])
        out = torch.cat((f16_bytes(d16), pack_nibbles(q)), dim=1)
        return out.reshape(x.shape[:-1] + (self.row_bytes(cols),))


def _refine_sub_scales(xb: torch.Tensor, d16: torch.Tensor, ls: torch.Tensor):
    """iq4_xs: per sub-block the 6-bit scale among ls - 1, ls, ls + 1 whose nearest codes give the
    least squared error (the rounding of the float scale to d's grid is not the best choice per se);
    returns (ls [N, 8], codes [N, 8, 32])."""
    kv = table("kvalues_iq4nl", xb.device)
    best_ls, best_q, best_err = None, None, None
    for step in (0, -1, 1):
        cand = (ls + step).clamp(-32, 31)
        eff = d16[:, None] * cand
        q = _nearest_codes(xb * safe_inverse(eff)[..., None])
        err = ((eff[..., None] * kv[q] - xb) ** 2).sum(-1)
        if best_ls is None:
            best_ls, best_q, best_err = cand, q, err
        else:
            take = err < best_err
            best_ls = torch.where(take, cand, best_ls)
            best_q = torch.where(take[..., None], q, best_q)
            best_err = torch.where(take, err, best_err)
    return best_ls, best_q


class IQ4_XS(Encoding):
    name, block_size, block_bytes, ggml_type, native_id = "iq4_xs", QK, 136, 23, 14

    def dequantize(self, raw, cols):
        b = self._blocks(raw, cols)
        low = torch.stack((b[:, 4:8] & 0xF, b[:, 4:8] >> 4), dim=-1).reshape(-1, 8).to(torch.int64)
        shifts = torch.arange(0, 16, 2, dtype=torch.int64, device=raw.device)
        high = (_u16(b[:, 2:4]) >> shifts) & 3                           # [N, 8]
        ls = (low | (high << 4)) - 32
        dl = (f16_field(b, 0) * ls.float())[..., None]                   # [N, 8, 1]
        q = nibbles(b[:, 8:].reshape(-1, 16)).reshape(-1, 8, 32).long()
        return (dl * table("kvalues_iq4nl", raw.device)[q]).reshape(raw.shape[:-1] + (cols,))

    def quantize(self, x):
        cols = x.shape[-1]
        xb = x.float().reshape(-1, 8, 32)
        scale = _nl_search(xb)                                           # [N, 8]
        idx = scale.abs().argmax(-1, keepdim=True)
        d16 = (scale.gather(-1, idx)[:, 0] / -32).clamp(-F16_MAX, F16_MAX).half().float()
        ls = torch.round(scale * safe_inverse(d16)[:, None]).clamp(-32, 31)
        ls, q = _refine_sub_scales(xb, d16, ls)
        u = (ls + 32).to(torch.int64)
        low = (u[:, 0::2] | (u[:, 1::2] << 4)).to(torch.uint8)          # [N, 4]
        high = ((u >> 4) << torch.arange(0, 16, 2, device=x.device)).sum(-1)
        high = torch.stack((high & 0xFF, high >> 8), dim=-1).to(torch.uint8)
        qs = pack_nibbles(q.reshape(-1, 32)).reshape(-1, 128)
        out = torch.cat((f16_bytes(d16), high, low, qs), dim=1)
        return out.reshape(x.shape[:-1] + (self.row_bytes(cols),))
