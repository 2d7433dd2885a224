"""Weight encodings: how a matrix's rows are stored as bytes (float, or GGUF's block layouts).

One :class:`~lean_qwenflash.quant.base.Encoding` per format, each in the module of its family
(``floats``: f32/f16/bf16; ``legacy``: q8_0/q4_0/q4_1/q5_0/q5_1; ``kquants``: q2_k/q3_k/q4_k/q5_k/
q6_k; ``iquants``: iq4_nl/iq4_xs/iq3_xxs/iq3_s/iq2_xxs/iq2_xs/iq2_s/iq1_s/iq1_m, whose lookup tables
come from the ``gguf`` package (``iquants.iq_tables``); ``mxfp4``). The block layouts
are GGUF's, byte for byte, so an expert imported from a GGUF file keeps its bytes and
``gguf.quants`` is an independent reference dequantizer. Everything here is torch only (runs on
CPU and CUDA) and knows nothing of packs, tiers or models.
"""
from .base import ENCODINGS, Encoding, QuantCols, QuantRows, QuantTensor, get_encoding, row_encoding_error
from . import floats, legacy, kquants, iquants, mxfp4  # noqa: F401  (registers the encodings)

__all__ = ["ENCODINGS", "Encoding", "QuantCols", "QuantRows", "QuantTensor", "get_encoding", "row_encoding_error"]
