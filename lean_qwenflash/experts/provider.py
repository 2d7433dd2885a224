"""The interface between MoE blocks and wherever routed-expert weights live.

Models never own routed-expert weights. A sparse block routes, then asks its provider for the
selected experts of its layer, computes, and releases them. Between ``acquire`` and ``release`` the
returned tensors are guaranteed to hold those experts' weights (a streaming provider pins the slots
so they cannot be evicted mid-compute).
"""
from __future__ import annotations

from typing import Sequence, Union

import torch

from ..quant import QuantTensor
from ..store.format import ExpertWeights

# A projection as a provider serves it: a float tensor (f32/f16/bf16 records), or the raw rows of a
# block-quantized matrix. Providers never look inside; kernels.expert_mlp dispatches on it.
Weight = Union[torch.Tensor, QuantTensor]


RECORD_ALIGNMENT_BYTES = 4096


def _raw(w: Weight) -> torch.Tensor:
    return (w.raw if isinstance(w, QuantTensor) else w.contiguous()).reshape(-1).view(torch.uint8)


def _like(w: Weight, raw: torch.Tensor) -> Weight:
    if isinstance(w, QuantTensor):
        return QuantTensor(raw.view(w.shape[0], -1), w.encoding, w.shape)
    return raw.view(w.dtype).view(w.shape)


def aligned_record(gate_up: Weight, down: Weight, alignment_bytes: int = RECORD_ALIGNMENT_BYTES) -> ExpertWeights:
    """Copy one expert into a fresh ``alignment_bytes``-aligned buffer laid out like a store record:
    ``gate_up`` at the start, ``down`` right after it.

    BLAS kernels pick code paths by pointer alignment, so the same weights at different alignments
    can give different low-order bits. Keeping resident experts in record layout makes them
    bit-identical to a streaming provider that returns views into aligned slots.
    """
    gu, dn = _raw(gate_up), _raw(down)
    down_offset = gu.numel()
    num_bytes = down_offset + dn.numel()
    raw = torch.empty(num_bytes + alignment_bytes, dtype=torch.uint8, device=gu.device)
    start = (-raw.data_ptr()) % alignment_bytes
    flat = raw[start:start + num_bytes]
    flat[:gu.numel()].copy_(gu)
    flat[down_offset:].copy_(dn)
    return ExpertWeights(_like(gate_up, flat[:gu.numel()]), _like(down, flat[down_offset:]))


def _moved(w: Weight, device, dtype) -> Weight:
    if isinstance(w, QuantTensor):   # quantized bytes move as they are; dtype is the compute dtype
        return QuantTensor(w.raw.to(device=device), w.encoding, w.shape)
    return w.to(device=device, dtype=dtype)


class ExpertProvider:
    """Base class: serves ``(layer_idx, expert_ids) -> [ExpertWeights]``."""

    # Most experts one acquire may ask for (None: no limit); callers split larger requests.
    max_experts_per_acquire = None

    def acquire(self, layer_idx: int, expert_ids: Sequence[int]) -> list[ExpertWeights]:
        raise NotImplementedError

    def release(self, layer_idx: int, expert_ids: Sequence[int]) -> None:
        """Done computing with these experts; a cache may evict them again."""

    def layer_input(self, layer_idx: int, hidden_states: torch.Tensor) -> None:
        """Called by a sparse block with its router input before routing (prefetch hook)."""


class ResidentExperts(ExpertProvider):
    """All routed experts held in memory: the reference every other provider must equal."""

    def __init__(self, layers: dict[int, list[ExpertWeights]]):
        self.layers = layers

    @classmethod
    def from_store(cls, store) -> "ResidentExperts":
        """Every routed expert of an ``ExpertStore`` read into memory (the lossless reference):
        each layer in one aligned buffer, records at their store offsets."""
        layers = {}
        for rec in store.manifest.layers:
            buf = store.read_layer(rec.layer_idx)
            layers[rec.layer_idx] = [store.expert_views(rec.layer_idx, buf, e * rec.record_bytes)
                                     for e in range(rec.num_experts)]
        return cls(layers)

    def acquire(self, layer_idx: int, expert_ids: Sequence[int]) -> list[ExpertWeights]:
        experts = self.layers[layer_idx]
        return [experts[e] for e in expert_ids]

    def to(self, device=None, dtype=None) -> "ResidentExperts":
        return ResidentExperts({
            layer: [aligned_record(_moved(w.gate_up, device, dtype), _moved(w.down, device, dtype)) for w in ws]
            for layer, ws in self.layers.items()
        })

    def nbytes(self) -> int:
        return sum(w.gate_up.nbytes + w.down.nbytes for ws in self.layers.values() for w in ws)
