"""Rotary position embedding, in one place: a config's rope settings as a typed ``RopeConfig``
(read once, by ``rope_config``), the position tables built from it (``Rotary``: default RoPE,
linear scaling or YaRN) and their application to queries and keys (``apply_rotary``).

The readers here take the family's ``ConfigReader`` (``families.base``; duck-typed, so that this
package does not import the families), whose errors name the key and the architecture.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from lean_qwenflash.models import native

ROPE_TYPES = ("default", "linear", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    """The rope settings of a config.

    ``type``: ``default``, ``linear`` (positions divided by ``factor``) or ``yarn``; ``theta`` the
    base; ``partial_rotary_factor`` the fraction of each head that is rotated. ``factor`` is the
    context extension (for YaRN without one in the config: max_position_embeddings / original).
    YaRN: ``original_max_position_embeddings`` (the pre-extension context), ``attention_factor``
    (else from ``mscale`` / ``mscale_all_dim``), the correction range ``beta_fast`` /
    ``beta_slow`` and whether its ends are rounded to whole dims (``truncate``).
    """

    type: str = "default"
    theta: float = 10000.0
    partial_rotary_factor: float = 1.0
    factor: Optional[float] = None
    original_max_position_embeddings: Optional[float] = None
    attention_factor: Optional[float] = None
    mscale: Optional[float] = None
    mscale_all_dim: Optional[float] = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True


def _number(rope: dict, key: str) -> Optional[float]:
    value = rope.get(key)
    return None if value is None else float(value)


def rope_config(r, default_partial: float = 1.0) -> RopeConfig:
    """The rope settings through the family's ``ConfigReader`` ``r``: ``rope_parameters``
    (transformers >= 5) over the older ``rope_scaling``, then the top-level ``rope_theta`` and
    ``partial_rotary_factor`` (default: ``default_partial``, the family's)."""
    rope = dict(r.get("rope_scaling", dict, None) or {})
    rope.update(r.get("rope_parameters", dict, None) or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ROPE_TYPES:
        raise NotImplementedError(f"rope_type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
    theta = float(rope.get("rope_theta", r.get("rope_theta", float, 10000.0)))
    partial = float(rope.get("partial_rotary_factor", r.get("partial_rotary_factor", float, default_partial)))
    factor = _number(rope, "factor")
    max_positions = r.get("max_position_embeddings", int, None)
    original = rope.get("original_max_position_embeddings") or max_positions
    original = None if original is None else float(original)
    if rope_type == "linear" and factor is None:
        raise ValueError("rope_type 'linear' needs a 'factor' (config rope_parameters / rope_scaling)")
    if rope_type == "yarn":
        if original is None:
            raise ValueError("rope_type 'yarn' needs original_max_position_embeddings or max_position_embeddings")
        if factor is None:
            factor = float(r.positive("max_position_embeddings")) / original
    return RopeConfig(rope_type, theta, partial, factor, original, _number(rope, "attention_factor"),
                      _number(rope, "mscale"), _number(rope, "mscale_all_dim"),
                      _number(rope, "beta_fast") or 32.0, _number(rope, "beta_slow") or 1.0,
                      bool(rope.get("truncate", True)))


def attention_head_dim(r) -> int:
    """The width of an attention head: ``head_dim``, else hidden_size / num_attention_heads."""
    return r.get("head_dim", int, None) or r.positive("hidden_size") // r.positive("num_attention_heads")


def mscale(scale: float, m: float = 1.0) -> float:
    """YaRN's attention scale for a context ``scale``-times longer: 0.1 * m * ln(scale) + 1."""
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def yarn_inv_freq(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """YaRN: (inverse frequencies [dim/2], attention factor). Frequencies blend extrapolation (fast
    dims) and interpolation by ``factor`` (slow dims) over the correction range set by
    ``beta_fast`` / ``beta_slow``; the factor (``mscale``, ``mscale_all_dim``) scales cos and sin."""
    base, original, factor = rope.theta, rope.original_max_position_embeddings, rope.factor
    attention_factor = rope.attention_factor
    if attention_factor is None:
        m, m_all = rope.mscale, rope.mscale_all_dim
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

    def correction_dim(rotations):
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)
    extrapolate = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attention_factor)


class Rotary:
    """Rotary position tables for heads of ``head_dim`` under ``rope`` (only the first
    ``partial_rotary_factor`` of each head rotates).

    Holds no parameters; tables are computed in fp32 and grown on demand, so decode only slices.
    ``sin`` is stored with the sign of rotate-half folded in: ``rot(x) * sin == swap(x) * sin_signed``.
    """

    def __init__(self, head_dim: int, rope: RopeConfig = RopeConfig()):
        self.rotary_dim = int(head_dim * rope.partial_rotary_factor)
        self.inv_freq = 1.0 / (rope.theta ** (torch.arange(0, self.rotary_dim, 2, dtype=torch.float32, device="cpu") / self.rotary_dim))
        self.attention_scaling = 1.0     # YaRN scales cos and sin
        if rope.type == "linear":
            self.inv_freq = self.inv_freq / rope.factor
        elif rope.type == "yarn":
            self.inv_freq, self.attention_scaling = yarn_inv_freq(rope, self.rotary_dim)
        self._cos = self._sin = None

    def tables(self, start: int, num_tokens: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin for positions ``start .. start+num_tokens``: each [T, rotary_dim]. The
        first ``TABLE_POSITIONS`` positions come from a cached table; later ones are computed for
        the positions asked (a table of every position would grow with the context: 131 MiB at
        128k tokens for rotary_dim 64, more than a q4_0 KV cache of that length)."""
        end = start + num_tokens
        if end > self.TABLE_POSITIONS:
            return self._compute(start, end, dtype, device)
        if self._cos is None or self._cos.shape[0] < end or self._cos.device != torch.device(device) \
                or self._cos.dtype != dtype:
            size = min(max(end, 2 * (self._cos.shape[0] if self._cos is not None else 0), 256), self.TABLE_POSITIONS)
            self._cos, self._sin = self._compute(0, size, dtype, device)
        return self._cos[start:end], self._sin[start:end]

    TABLE_POSITIONS = 8192

    def _compute(self, start: int, end: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(start, end, dtype=torch.float32, device="cpu")
        freqs = pos[:, None] * self.inv_freq[None, :]
        half = freqs.shape[-1]
        emb = torch.cat((freqs, freqs), dim=-1)
        sin = emb.sin() * self.attention_scaling
        sin[:, :half] = -sin[:, :half]
        return (emb.cos() * self.attention_scaling).to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, D] rotated on its first ``cos.shape[-1]`` dims (rotate-half convention).
    A few fp32 tokens on CPU (decode) take one native call that rounds exactly as these torch ops do
    (bit-equal, so in every kernel mode)."""
    if x.dtype == torch.float32 and x.device.type == "cpu" and x.dim() == 4 and x.shape[2] <= 4 \
            and native.available() and cos.dtype == torch.float32 and cos.is_contiguous() and sin.is_contiguous():
        return native.rope(x.contiguous(), cos, sin)
    rotary_dim = cos.shape[-1]
    half = rotary_dim // 2
    x_rot = x[..., :rotary_dim]
    swapped = torch.cat((x_rot[..., half:], x_rot[..., :half]), dim=-1)
    rotated = x_rot * cos + swapped * sin
    if rotary_dim == x.shape[-1]:
        return rotated
    return torch.cat((rotated, x[..., rotary_dim:]), dim=-1)
