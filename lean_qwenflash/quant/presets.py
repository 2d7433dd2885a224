"""`pack --quant` presets: which encoding each routed-expert projection of each layer gets, and
which the resident matrices get.

The "_M" recipes give the tensors whose errors hurt most more bits (our own rule, after the
well-known llama.cpp recipes of the same names):

* ``q4_k_m`` / ``q5_k_m``: ``down`` gets q6_k in the first and last eighth of the MoE layers and
  in every third layer between, the base type elsewhere; gate/up always get the base type.
* ``q3_k_m``: gate/up q3_k; ``down`` q5_k in the first sixteenth of the MoE layers, q4_k in the
  others; the attention value and output projections q4_k, the other resident matrices q3_k.

The output head takes q6_k in every block preset but q8_0 / the legacy 32-value ones; ``mxfp4``
encodes the routed experts only in mxfp4 (GPT-OSS's own format) and the resident matrices in q8_0.

A projection whose rows a block type cannot hold (a row length that is not a multiple of its
block) falls back to the nearest type whose block fits — a 256-value type to a 32-value one of
about as many bits (q4_k -> q5_0, q5_k -> q5_1, q6_k -> q8_0, q2_k / q3_k / iq4_xs -> iq4_nl), as
llama.cpp does — and, where no block type fits, to the pack's float encoding (bf16 unless
``--dtype`` says otherwise; never f32 by default). The summary says what fell back and why.

The I-quant lattice formats (iq1_*, iq2_*, iq3_*) are not offered: their quantizers need an
importance matrix. They are imported from GGUF files made by llama.cpp, byte for byte.
"""
from __future__ import annotations

from .base import get_encoding, row_encoding_error

PRESETS = ("bf16", "f16", "f32", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q2_k", "q3_k_m", "q4_k", "q5_k", "q6_k",
           "q4_k_m", "q5_k_m", "iq4_nl", "iq4_xs", "mxfp4")
FLOAT_PRESETS = ("bf16", "f16", "f32")
# Encodings (and llama.cpp preset names) --quant does not make, and why.
NOT_OFFERED = {n: "its quantizer needs an importance matrix" for n in
               ("iq1_s", "iq1_m", "iq2_xxs", "iq2_xs", "iq2_s", "iq2_m", "iq3_xxs", "iq3_xs", "iq3_s", "iq3_m")}
# The type a 256-value block type falls back to when a row is not a multiple of 256.
FALLBACK = {"q2_k": "iq4_nl", "q3_k": "iq4_nl", "iq4_xs": "iq4_nl", "q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0"}


def check_preset(preset: str) -> str:
    """``preset`` if --quant offers it, else a ValueError that says why not and what to do."""
    if preset in PRESETS:
        return preset
    key = preset.lower()
    if key in NOT_OFFERED:
        raise ValueError(f"--quant {preset}: not offered, {NOT_OFFERED[key]} (llama.cpp's llama-imatrix) to give "
                         f"usable weights. Quantize with llama.cpp (llama-quantize --imatrix FILE ... "
                         f"{key.upper()}) and pack the GGUF file it writes: its blocks are imported byte for byte. "
                         f"--quant offers {', '.join(PRESETS)}")
    raise ValueError(f"--quant must be one of {', '.join(PRESETS)}; got {preset!r}")


def more_bits(i: int, n: int) -> bool:
    """Layer ``i`` of ``n`` gets the bigger ``down`` encoding in the q4_k_m / q5_k_m recipes."""
    eighth = n // 8
    return i < eighth or i >= 7 * n // 8 or (i - eighth) % 3 == 2


def expert_encodings(preset: str, moe_index: int, num_moe_layers: int) -> dict:
    """{"gate_up": enc, "down": enc} for the ``moe_index``-th of ``num_moe_layers`` MoE layers."""
    check_preset(preset)
    if preset == "q3_k_m":
        return {"gate_up": "q3_k", "down": "q5_k" if moe_index < num_moe_layers // 16 else "q4_k"}
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
# Presets whose output head takes q6_k (its errors reach every logit).
_HEAD_Q6_K = ("q2_k", "q3_k_m", "q4_k", "q5_k", "q6_k", "q4_k_m", "q5_k_m", "iq4_nl", "iq4_xs")


def resident_encoding(preset: str, name: str):
    """The encoding --quant gives a resident tensor, or None (it stays float)."""
    if preset in FLOAT_PRESETS or not name.endswith(QUANTIZED_RESIDENT):
        return None
    if name == "lm_head.weight" and preset in _HEAD_Q6_K:
        return "q6_k"
    if preset == "mxfp4":
        return "q8_0"
    if preset == "q3_k_m":
        return "q4_k" if name.endswith(("self_attn.v_proj.weight", "self_attn.o_proj.weight")) else "q3_k"
    return preset[:-2] if preset.endswith("_m") else preset


def fallback(encoding: str, cols: int, float_encoding: str) -> tuple[str, str]:
    """The encoding rows of ``cols`` values get when ``encoding`` is asked for: itself, else its
    fallback block type if that fits, else ``float_encoding``; and why (empty when it fits)."""
    why = row_encoding_error(get_encoding(encoding), cols)
    if not why:
        return encoding, ""
    alt = FALLBACK.get(encoding)
    if alt is not None and not row_encoding_error(get_encoding(alt), cols):
        return alt, why
    return float_encoding, why


def with_fallback(encodings: dict, shapes: dict, float_encoding: str) -> tuple[dict, list]:
    """Replace encodings that cannot hold a projection's rows (see :func:`fallback`); returns the
    encodings and one note per replacement."""
    out, notes = {}, []
    for name, enc in encodings.items():
        got, why = fallback(enc, shapes[name][1], float_encoding)
        if why:
            notes.append(f"{name} {list(shapes[name])}: {why}; stored as {got}")
        out[name] = got
    return out, notes
