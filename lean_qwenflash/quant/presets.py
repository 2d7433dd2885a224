"""`pack --quant` presets: which encoding each routed-expert projection of each layer gets.

``q4_k_m`` / ``q5_k_m`` follow the well-known "_M" recipe: ``down`` (whose errors hurt most) gets
q6_k in the first and last eighth of the MoE layers and in every third layer between, the base
type elsewhere; gate/up always get the base type. A projection whose row length is not a multiple
of the encoding's block falls back to the pack's float encoding (the summary says which).
"""
from __future__ import annotations

from .base import get_encoding, row_encoding_error

PRESETS = ("bf16", "f16", "f32", "q8_0", "q4_0", "q4_k", "q5_k", "q6_k", "q4_k_m", "q5_k_m")


def more_bits(i: int, n: int) -> bool:
    """Layer ``i`` of ``n`` gets the bigger ``down`` encoding in the _M recipes."""
    eighth = n // 8
    return i < eighth or i >= 7 * n // 8 or (i - eighth) % 3 == 2


def expert_encodings(preset: str, moe_index: int, num_moe_layers: int) -> dict:
    """{"gate_up": enc, "down": enc} for the ``moe_index``-th of ``num_moe_layers`` MoE layers."""
    if preset not in PRESETS:
        raise ValueError(f"--quant must be one of {', '.join(PRESETS)}; got {preset!r}")
    if preset.endswith("_m"):
        base = preset[:-2]
        return {"gate_up": base, "down": "q6_k" if more_bits(moe_index, num_moe_layers) else base}
    return {"gate_up": preset, "down": preset}


# Resident matrices that --quant encodes (name suffixes); everything else (embeddings, norms, routers,
# shared-expert gates, convolutions, DeltaNet gates) stays float.
QUANTIZED_RESIDENT = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                      "self_attn.o_proj.weight", "linear_attn.in_proj_qkvz.weight", "linear_attn.out_proj.weight",
                      "shared_expert.gate_proj.weight", "shared_expert.up_proj.weight",
                      "shared_expert.down_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
                      "mlp.down_proj.weight", "lm_head.weight")


def resident_encoding(preset: str, name: str):
    """The encoding --quant gives a resident tensor, or None (it stays float). The output head takes
    q6_k in the _k presets (its errors reach every logit), the other matrices the base type."""
    if preset in ("bf16", "f16", "f32") or not name.endswith(QUANTIZED_RESIDENT):
        return None
    base = preset[:-2] if preset.endswith("_m") else preset
    if name == "lm_head.weight" and base.endswith("_k"):
        return "q6_k"
    return base


def with_fallback(encodings: dict, shapes: dict, float_encoding: str) -> tuple[dict, list]:
    """Replace encodings that cannot hold a projection's rows by ``float_encoding``; returns the
    encodings and one note per replacement."""
    out, notes = {}, []
    for name, enc in encodings.items():
        why = row_encoding_error(get_encoding(enc), shapes[name][1])
        if why:
            notes.append(f"{name} {list(shapes[name])}: {why}; stored as {float_encoding}")
            enc = float_encoding
        out[name] = enc
    return out, notes
