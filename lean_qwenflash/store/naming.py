"""Checkpoint tensor names: which tensors are routed experts, and how they map to records.

The generic key parsing; each family declares its layout (``families.base.ExpertLayout``: the
sparse block's name, the projection names, renames, ignored prefixes). The packer uses this to
split a checkpoint into resident tensors and expert records; the model loader to read a checkpoint
directly. Two on-disk expert layouts exist:

* per-expert keys:  ``{moe}.experts.{e}.{gate,up,down}_proj.weight`` (Mixtral: ``w1, w3, w2``)
* stacked 3-D keys: ``{moe}.experts.gate_up_proj`` [E, 2I, H] and ``{moe}.experts.down_proj``
  [E, H, I] (what transformers >= 5 keeps in memory and some tools save).

Whatever the layout, an expert is normalised to ``gate_up`` [2I, H] (gate rows first) and
``down`` [H, I]; that is also the record layout in ``experts.bin``.

Resident tensor names are the checkpoint's canonical on-disk names (what ``save_pretrained``
writes); runtime-style aliases (e.g. Mixtral's ``mlp.gate`` for ``block_sparse_moe.gate``) are
mapped back to them by :func:`canonical_resident_key`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:     # (the families import models/, which import the store: no import at run time)
    from lean_qwenflash.families.base import ExpertLayout


# The record's projections, in on-disk order inside a record.
EXPERT_TENSORS = ("gate_up", "down")


@dataclass(frozen=True)
class ExpertKey:
    """A checkpoint tensor that belongs to routed experts."""

    layer_idx: int
    expert_id: Optional[int]    # None for a stacked [E, ...] tensor
    part: str                   # "gate", "up", "down" (per-expert) or "gate_up", "down" (stacked)
    form: str = ""              # "blocks" / "scales": a stacked MXFP4 tensor (GPT-OSS checkpoints)


_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def layer_of(key: str) -> Optional[int]:
    """The decoder layer index of ``model.layers.{L}.*`` keys, else None."""
    m = _LAYER_RE.match(key)
    return int(m.group(1)) if m else None


def parse_expert_key(names: ExpertLayout, key: str) -> Optional[ExpertKey]:
    """ExpertKey for a routed-expert tensor name, None for anything resident."""
    m = _LAYER_RE.match(key)
    if not m:
        return None
    layer_idx, rest = int(m.group(1)), m.group(2)
    for module in (names.moe_module,) + names.moe_aliases:
        prefix = module + ".experts."
        if not rest.startswith(prefix):
            continue
        tail = rest[len(prefix):]
        if tail in names.resident_suffixes:
            return None
        for proj, part in (("gate_up_proj", "gate_up"), ("down_proj", "down")):
            for form in ("blocks", "scales"):
                if tail == f"{proj}_{form}":
                    return ExpertKey(layer_idx, None, part, form)
        if tail in ("gate_up_proj", "down_proj"):
            return ExpertKey(layer_idx, None, "gate_up" if tail == "gate_up_proj" else "down")
        parts = tail.split(".")
        if len(parts) == 3 and parts[0].isdigit() and parts[2] == "weight":
            role = dict(zip(names.proj_names, ("gate", "up", "down"))).get(parts[1])
            if role is not None:
                return ExpertKey(layer_idx, int(parts[0]), role)
        raise ValueError(f"tensor {key!r} looks like a routed expert but its name is not a known layout")
    return None


def canonical_resident_key(names: ExpertLayout, key: str) -> str:
    """Map runtime-style aliases of resident tensors to the canonical checkpoint name."""
    m = _LAYER_RE.match(key)
    if not m:
        return key
    layer_idx, rest = m.group(1), m.group(2)
    for alias in names.moe_aliases:
        for leaf in ("gate.weight",):
            if rest == f"{alias}.{leaf}":
                return f"model.layers.{layer_idx}.{names.moe_module}.{leaf}"
    return key


def expert_key(names: ExpertLayout, layer_idx: int, expert_id: int, role: str) -> str:
    """Canonical per-expert checkpoint key (role: gate, up or down)."""
    proj = dict(zip(("gate", "up", "down"), names.proj_names))[role]
    return f"model.layers.{layer_idx}.{names.moe_module}.experts.{expert_id}.{proj}.weight"


def rename_key(names: ExpertLayout, key: str) -> str:
    """``key`` after the layout's prefix renames (e.g. a multimodal checkpoint's text model)."""
    for prefix, replacement in names.key_renames:
        if key.startswith(prefix):
            return replacement + key[len(prefix):]
    return key

