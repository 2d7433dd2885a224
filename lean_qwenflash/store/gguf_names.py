"""Between Hugging Face and GGUF: the names every architecture shares, and the lookups the GGUF
importer (:mod:`.gguf_file`) and exporter (:mod:`.gguf_export`) use.

Each family that llama.cpp runs declares its own GGUF architecture name, tensor-name table,
transforms and config keys in its file (``FAMILY.gguf``, a ``GGUFArch``:
``lean_qwenflash/families/*.py``), written in the vocabulary of
:mod:`lean_qwenflash.families.gguf` (the transform types ``Permute``/``Values``/``PermuteCols``/``Joined``/``Split``, the
common attention/norm names, the common config keys, the rope-interleave permutation), which this
module re-exports. The lookups below ask the family registry, which imports a family only when its
declaration is needed. (The store imports the families, never the other way round.)

GGUF names tensors ``blk.{L}.attn_q.weight`` where Hugging Face has
``model.layers.{L}.self_attn.q_proj.weight``; the global tensors and the expert metadata keys
below are the same for every architecture.
"""
from __future__ import annotations

from typing import Optional

from lean_qwenflash.families import RegistryView, gguf_architectures, gguf_families
from lean_qwenflash.families.gguf import (ATTENTION, COMMON_KEYS, GGUFArch, Joined, Permute, PermuteCols, Split, Values, head_dim,
                                          plus_one, rope_interleave)

GLOBAL_TENSORS = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}

# GGUF keys of (expert count, experts per token, expert width), without the "{arch}." prefix.
EXPERT_KEYS = ("expert_count", "expert_used_count", "expert_feed_forward_length")

# family name -> its GGUFArch; GGUF general.architecture -> GGUFArch (names import nothing; a
# value imports its family's module)
# (where families share a GGUF name, BY_GGUF_ARCH gives the first's; families.family_for_gguf picks
# a file's family by its metadata)
ARCHS = RegistryView({family: family for family in gguf_families()}, lambda f: f.gguf)
BY_GGUF_ARCH = RegistryView({g: names.split("/")[0] for g, names in gguf_architectures().items()}, lambda f: f.gguf)


def gguf_arch(family: str) -> GGUFArch:
    """The GGUF declaration of model family ``family``."""
    try:
        return ARCHS[family]
    except KeyError:
        raise ValueError(f"no GGUF name mapping for model family {family!r} (have: {', '.join(ARCHS)})") from None


def split_layer_name(name: str, prefix: str):
    """(layer, suffix) for ``{prefix}.{L}.{suffix}``, else None."""
    parts = name.split(".", 2) if prefix == "blk" else name.split(".", 3)
    if prefix == "blk" and len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit():
        return int(parts[1]), parts[2]
    if prefix == "model.layers" and len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[2].isdigit():
        return int(parts[2]), parts[3]
    return None


def hf_to_gguf_tensor(arch: GGUFArch, hf_name: str) -> str:
    """GGUF name of a resident HF tensor; ValueError names the tensor it cannot map."""
    if hf_name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[hf_name]
    split = split_layer_name(hf_name, "model.layers")
    if split and split[1] in arch.layer_tensors:
        g = arch.layer_tensors[split[1]]
        if isinstance(g, tuple):      # a Joined matrix: its parts, "+"-separated
            return "+".join(f"blk.{split[0]}.{p}" for p in g)
        return f"blk.{split[0]}.{g}"
    raise ValueError(f"{arch.gguf_arch}: no GGUF name for tensor {hf_name!r}")


def gguf_to_hf_tensor(arch: GGUFArch, gguf_name: str) -> Optional[str]:
    """HF name of a resident GGUF tensor, or None when the table has no entry for it."""
    for hf, g in GLOBAL_TENSORS.items():
        if g == gguf_name:
            return hf
    split = split_layer_name(gguf_name, "blk")
    if split:
        for hf, g in list(arch.layer_tensors.items()) + list(arch.alternatives.items()):
            if g == split[1] or (isinstance(g, tuple) and split[1] in g):
                return f"model.layers.{split[0]}.{hf}"
    return None


def is_alternative(arch: GGUFArch, gguf_name: str) -> bool:
    """True for a tensor stored under an older layout's name (a plain rename, no transform)."""
    split = split_layer_name(gguf_name, "blk")
    return bool(split) and split[1] in arch.alternatives.values()


def transform_for(arch: GGUFArch, hf_name: str):
    """The Permute/Values/Joined transform of a resident HF tensor, or None."""
    if hf_name in arch.transforms:
        return arch.transforms[hf_name]
    split = split_layer_name(hf_name, "model.layers")
    return arch.transforms.get(split[1]) if split else None


__all__ = ["ARCHS", "ATTENTION", "BY_GGUF_ARCH", "COMMON_KEYS", "EXPERT_KEYS", "GGUFArch", "GLOBAL_TENSORS", "Joined",
           "Permute", "PermuteCols", "Split", "Values", "gguf_arch", "gguf_to_hf_tensor", "head_dim", "hf_to_gguf_tensor", "is_alternative",
           "plus_one", "rope_interleave", "split_layer_name", "transform_for"]
