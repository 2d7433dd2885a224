"""Per-layer inference state: a KV cache for attention layers, conv + recurrent state for DeltaNet.

Layers read and write these objects by attribute (``append`` for attention; ``conv`` and
``recurrent`` for DeltaNet) and allocate lazily, so the state needs no model dimensions.
``clone()`` copies everything (prefix-reuse snapshots); ``num_tokens`` counts tokens consumed and
``ModelState.tokens`` lists them (the generator records what it feeds; the prefix cache keys on it).
"""
from __future__ import annotations

from typing import Optional

import torch


class KVCache:
    """Keys/values [B, kv_heads, capacity, D], grown by doubling so decode rarely allocates."""

    def __init__(self):
        self.keys: Optional[torch.Tensor] = None
        self.values: Optional[torch.Tensor] = None
        self.num_tokens = 0

    def append(self, k: torch.Tensor, v: torch.Tensor, zero_slot: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, kv_heads, T, D]; return views of all cached keys and values [B, kv_heads, L, D].
        ``zero_slot``: the views also hold one zeroed slot after the last token (an attention sink's
        key and value), so the caller need not copy the cache to add it."""
        end = self.num_tokens + k.shape[2]
        self.reserve(end + zero_slot, k, v)
        self.keys[:, :, self.num_tokens:end] = k
        self.values[:, :, self.num_tokens:end] = v
        self.num_tokens = end
        if zero_slot:
            self.keys[:, :, end] = 0
            self.values[:, :, end] = 0
            return self.keys[:, :, :end + 1], self.values[:, :, :end + 1]
        return self.keys[:, :, :end], self.values[:, :, :end]

    def reserve(self, size: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Room for ``size`` tokens in all (growing by doubling, the cached ones kept), buffers shaped
        and typed like k and v [B, kv_heads, *, D]; returns the whole buffers. (A native decode
        step writes its token's row into them itself.)"""
        capacity = 0 if self.keys is None else self.keys.shape[2]
        if size > capacity:
            new_capacity = max(size, 2 * capacity, 64)
            keys = k.new_empty(k.shape[:2] + (new_capacity, k.shape[3]))
            values = v.new_empty(v.shape[:2] + (new_capacity, v.shape[3]))
            if self.num_tokens:
                keys[:, :, :self.num_tokens] = self.keys[:, :, :self.num_tokens]
                values[:, :, :self.num_tokens] = self.values[:, :, :self.num_tokens]
            self.keys, self.values = keys, values
        return self.keys, self.values

    def clone(self) -> "KVCache":
        other = KVCache()
        if self.keys is not None:
            other.keys = self.keys[:, :, :self.num_tokens].clone()
            other.values = self.values[:, :, :self.num_tokens].clone()
        other.num_tokens = self.num_tokens
        return other

    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


class SlidingKVCache:
    """The keys/values of a sliding-window attention layer: the last ``window`` tokens only, in a
    ring [B, kv_heads, window, D] with each slot's token position (-1: empty). Memory is bounded by
    the window however long the sequence grows."""

    def __init__(self, window: int):
        if window < 1:
            raise ValueError(f"sliding window {window} must be >= 1")
        self.window = window
        self.keys: Optional[torch.Tensor] = None
        self.values: Optional[torch.Tensor] = None
        self.positions: Optional[torch.Tensor] = None
        self.num_tokens = 0

    def attend(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Add k, v [B, kv_heads, T, D]; return (keys, values, their positions) that the T new
        queries may need: the ring's past tokens plus the new ones (the caller masks by position)."""
        num_new = k.shape[2]
        if self.keys is None:
            self.keys = k.new_zeros(k.shape[:2] + (self.window, k.shape[3]))
            self.values = v.new_zeros(v.shape[:2] + (self.window, v.shape[3]))
            self.positions = torch.full((self.window,), -1, dtype=torch.long, device=k.device)
        if num_new == 1:       # decode: the new token takes the oldest slot, then the ring is the window
            slot = self.num_tokens % self.window
            self.keys[:, :, slot] = k[:, :, 0]
            self.values[:, :, slot] = v[:, :, 0]
            self.positions[slot] = self.num_tokens
            self.num_tokens += 1
            return self.keys, self.values, self.positions
        new_pos = torch.arange(self.num_tokens, self.num_tokens + num_new, device=k.device)
        keys, values = torch.cat((self.keys, k), dim=2), torch.cat((self.values, v), dim=2)
        positions = torch.cat((self.positions, new_pos))
        keep = min(num_new, self.window)
        slots = new_pos[-keep:] % self.window
        self.keys[:, :, slots] = k[:, :, -keep:]
        self.values[:, :, slots] = v[:, :, -keep:]
        self.positions[slots] = new_pos[-keep:]
        self.num_tokens += num_new
        return keys, values, positions

    def clone(self) -> "SlidingKVCache":
        other = SlidingKVCache(self.window)
        if self.keys is not None:
            other.keys, other.values, other.positions = self.keys.clone(), self.values.clone(), self.positions.clone()
        other.num_tokens = self.num_tokens
        return other

    def nbytes(self) -> int:
        return 0 if self.keys is None else self.keys.nbytes + self.values.nbytes


class DeltaNetState:
    """conv [B, conv_channels, kernel-1] (last conv inputs) and recurrent [B, Hv, Dk, Dv] (fp32)."""

    def __init__(self):
        self.conv: Optional[torch.Tensor] = None
        self.recurrent: Optional[torch.Tensor] = None

    def clone(self) -> "DeltaNetState":
        other = DeltaNetState()
        other.conv = None if self.conv is None else self.conv.clone()
        other.recurrent = None if self.recurrent is None else self.recurrent.clone()
        return other

    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.conv, self.recurrent) if t is not None)


class ModelState:
    """Everything a model needs to continue a sequence: one state per layer, the token count and,
    when it was fed by a ``Generator``, the token ids it covers (``tokens``; None if unknown)."""

    def __init__(self, layers: list):
        self.layers = layers
        self.num_tokens = 0
        self.tokens: Optional[list[int]] = []

    def clone(self) -> "ModelState":
        other = ModelState([layer.clone() for layer in self.layers])
        other.num_tokens = self.num_tokens
        other.tokens = None if self.tokens is None else list(self.tokens)
        return other

    def nbytes(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)


def new_state(model) -> ModelState:
    """An empty state for ``model`` (uses its ``layer_types``)."""
    layers = []
    for kind in model.layer_types:
        if kind == "full_attention":
            layers.append(KVCache())
        elif kind == "linear_attention":
            layers.append(DeltaNetState())
        elif kind == "sliding_attention":
            layers.append(SlidingKVCache(int(model.sliding_window)))
        else:
            raise ValueError(f"unknown layer type {kind!r}")
    return ModelState(layers)


# -- a state as plain parts (prefix snapshots on disk: generate/snapshots.py) ---------------------

# The classes a spilled state may name (a file cannot make us build anything else).
STATE_CLASSES = {cls.__name__: cls for cls in (KVCache, SlidingKVCache, DeltaNetState)}
_SCALARS = (int, float, str, bool, type(None))


def state_parts(state: ModelState) -> tuple[list, list]:
    """``state`` as (layers, tensors): per layer its class name and its attributes, each a scalar
    or the index of a tensor in ``tensors``. Generic over the layer classes' attributes, so a new
    kind of cache (registered in ``STATE_CLASSES``) spills without changes here."""
    layers, tensors = [], []
    for layer in state.layers:
        name = type(layer).__name__
        if STATE_CLASSES.get(name) is not type(layer):
            raise ValueError(f"cannot spill a {name} layer state (not in STATE_CLASSES)")
        attrs = {}
        for key, value in vars(layer).items():
            if isinstance(value, torch.Tensor):
                if key in ("keys", "values") and isinstance(layer, KVCache):
                    value = value[:, :, :layer.num_tokens]      # the tokens, not the spare capacity
                attrs[key] = {"tensor": len(tensors)}
                tensors.append(value)
            elif isinstance(value, _SCALARS):
                attrs[key] = value
            else:
                raise ValueError(f"cannot spill {name}.{key} (a {type(value).__name__})")
        layers.append({"class": name, "attrs": attrs})
    return layers, tensors


def state_from_parts(layers: list, tensors: list, num_tokens: int, tokens: Optional[list]) -> ModelState:
    """The inverse of ``state_parts`` (tensors already on the right device)."""
    out = []
    for entry in layers:
        cls = STATE_CLASSES.get(entry.get("class"))
        if cls is None:
            raise ValueError(f"unknown layer state class {entry.get('class')!r}")
        layer = cls.__new__(cls)
        for key, value in entry["attrs"].items():
            setattr(layer, key, tensors[value["tensor"]] if isinstance(value, dict) else value)
        out.append(layer)
    state = ModelState(out)
    state.num_tokens = num_tokens
    state.tokens = None if tokens is None else list(tokens)
    return state
