"""The interface between MoE blocks and wherever routed-expert weights live.

Models never own routed-expert weights. A sparse block routes, then asks its provider for the
selected experts of its layer, computes, and releases them. Between ``acquire`` and ``release`` the
returned tensors are guaranteed to hold those experts' weights (a streaming provider pins the slots
so they cannot be evicted mid-compute).
"""
from __future__ import annotations

from typing import NamedTuple, Sequence

import torch


class ExpertWeights(NamedTuple):
    gate_up: torch.Tensor   # [2I, H]: gate rows then up rows
    down: torch.Tensor      # [H, I]


RECORD_ALIGNMENT_BYTES = 4096


def aligned_record(gate_up: torch.Tensor, down: torch.Tensor,
                   alignment_bytes: int = RECORD_ALIGNMENT_BYTES) -> ExpertWeights:
    """Copy one expert into a fresh ``alignment_bytes``-aligned buffer laid out like a store record:
    ``gate_up`` at the start, ``down`` right after it.

    BLAS kernels pick code paths by pointer alignment, so the same weights at different alignments
    can give different low-order bits. Keeping resident experts in record layout makes them
    bit-identical to a streaming provider that returns views into aligned slots.
    """
    dtype, device = gate_up.dtype, gate_up.device
    elt = gate_up.element_size()
    num_bytes = (gate_up.numel() + down.numel()) * elt
    raw = torch.empty(num_bytes + alignment_bytes, dtype=torch.uint8, device=device)
    start = (-raw.data_ptr()) % alignment_bytes
    flat = raw[start:start + num_bytes].view(dtype)
    out_gate_up = flat[:gate_up.numel()].view(gate_up.shape)
    out_down = flat[gate_up.numel():].view(down.shape)
    out_gate_up.copy_(gate_up)
    out_down.copy_(down)
    return ExpertWeights(out_gate_up, out_down)


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

    def acquire(self, layer_idx: int, expert_ids: Sequence[int]) -> list[ExpertWeights]:
        experts = self.layers[layer_idx]
        return [experts[e] for e in expert_ids]

    def to(self, device=None, dtype=None) -> "ResidentExperts":
        return ResidentExperts({
            layer: [aligned_record(w.gate_up.to(device=device, dtype=dtype),
                                   w.down.to(device=device, dtype=dtype)) for w in ws]
            for layer, ws in self.layers.items()
        })

    def nbytes(self) -> int:
        return sum(w.gate_up.nbytes + w.down.nbytes for ws in self.layers.values() for w in ws)
