"""Checkpoint tensor names: which tensors are routed experts, and how they map to records.

This is the single place that knows Hugging Face key layouts. The packer uses it to split a
checkpoint into resident tensors and expert records; the model loader uses it to read a checkpoint
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
from typing import Optional

# The record's projections, in on-disk order inside a record.
EXPERT_TENSORS = ("gate_up", "down")


@dataclass(frozen=True)
class ArchNames:
    """Naming facts for one Hugging Face architecture string."""

    architecture: str
    family: str                 # our model family: "qwen3_next", "qwen3_moe", "mixtral", "olmoe"
    moe_module: str             # name of the sparse block under model.layers.{L}
    proj_names: tuple           # per-expert names of (gate, up, down)
    moe_aliases: tuple = ()     # other sparse-block names that may appear (stacked layout)
    num_experts_key: str = "num_experts"
    # Checkpoint tensors the runtime does not use (e.g. Qwen3-Next's multi-token-prediction head).
    ignored_prefixes: tuple = ()
    top_k_key: str = "num_experts_per_tok"
    intermediate_key: str = "moe_intermediate_size"


ARCHITECTURES = {
    a.architecture: a
    for a in (
        ArchNames("Qwen3NextForCausalLM", "qwen3_next", "mlp", ("gate_proj", "up_proj", "down_proj"),
                  ignored_prefixes=("mtp.",)),
        ArchNames("Qwen3MoeForCausalLM", "qwen3_moe", "mlp", ("gate_proj", "up_proj", "down_proj")),
        ArchNames("MixtralForCausalLM", "mixtral", "block_sparse_moe", ("w1", "w3", "w2"),
                  moe_aliases=("mlp",), num_experts_key="num_local_experts",
                  intermediate_key="intermediate_size"),
        ArchNames("OlmoeForCausalLM", "olmoe", "mlp", ("gate_proj", "up_proj", "down_proj"),
                  intermediate_key="intermediate_size"),
    )
}


class UnsupportedArchitecture(ValueError):
    pass


def arch_names(config: dict) -> ArchNames:
    """The naming facts for an HF config dict; a clear error for anything we do not know."""
    archs = config.get("architectures") or []
    for a in archs:
        if a in ARCHITECTURES:
            return ARCHITECTURES[a]
    # A config without "architectures" (saved from a bare config object) still names its model_type.
    by_type = {a.family: a for a in ARCHITECTURES.values()}
    if not archs and config.get("model_type") in by_type:
        return by_type[config["model_type"]]
    what = ", ".join(archs) if archs else "none (config.json has no 'architectures')"
    raise UnsupportedArchitecture(
        f"unsupported architecture: {what}; supported: {', '.join(sorted(ARCHITECTURES))}"
    )


@dataclass(frozen=True)
class ExpertKey:
    """A checkpoint tensor that belongs to routed experts."""

    layer_idx: int
    expert_id: Optional[int]    # None for a stacked [E, ...] tensor
    part: str                   # "gate", "up", "down" (per-expert) or "gate_up", "down" (stacked)


_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def parse_expert_key(names: ArchNames, key: str) -> Optional[ExpertKey]:
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
        if tail in ("gate_up_proj", "down_proj"):
            return ExpertKey(layer_idx, None, "gate_up" if tail == "gate_up_proj" else "down")
        parts = tail.split(".")
        if len(parts) == 3 and parts[0].isdigit() and parts[2] == "weight":
            role = dict(zip(names.proj_names, ("gate", "up", "down"))).get(parts[1])
            if role is not None:
                return ExpertKey(layer_idx, int(parts[0]), role)
        raise ValueError(f"tensor {key!r} looks like a routed expert but its name is not a known layout")
    return None


def canonical_resident_key(names: ArchNames, key: str) -> str:
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


def expert_key(names: ArchNames, layer_idx: int, expert_id: int, role: str) -> str:
    """Canonical per-expert checkpoint key (role: gate, up or down)."""
    proj = dict(zip(("gate", "up", "down"), names.proj_names))[role]
    return f"model.layers.{layer_idx}.{names.moe_module}.experts.{expert_id}.{proj}.weight"


def moe_layer_indices(config: dict) -> list[int]:
    """Indices of the layers whose MLP is a routed sparse block (others are dense MLPs)."""
    names = arch_names(config)
    n = int(config["num_hidden_layers"])
    if names.family in ("mixtral", "olmoe"):
        return list(range(n))
    step = int(config.get("decoder_sparse_step", 1) or 1)
    mlp_only = set(config.get("mlp_only_layers") or [])
    if num_experts(config) <= 0:
        return []
    return [i for i in range(n) if i not in mlp_only and (i + 1) % step == 0]


def num_experts(config: dict) -> int:
    """Routed experts per sparse layer (0 when the config has none).

    transformers >= 5 saves Qwen3-MoE configs with ``num_local_experts`` (its attribute_map alias)
    while the released checkpoints say ``num_experts``; both spellings mean the same count.
    """
    names = arch_names(config)
    for key in (names.num_experts_key, "num_experts", "num_local_experts"):
        if config.get(key) is not None:
            return int(config[key])
    return 0


def expert_dims(config: dict) -> tuple[int, int, int, int]:
    """(num_experts, top_k, hidden_size, expert_intermediate_size) from an HF config dict."""
    names = arch_names(config)
    return (
        num_experts(config),
        int(config[names.top_k_key]),
        int(config["hidden_size"]),
        int(config[names.intermediate_key]),
    )
