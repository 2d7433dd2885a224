"""The registry of model families: one file per family in this package, each declaring a ``FAMILY``.

The tables below map each family to its module, and architecture strings, model types and GGUF
architecture names to families; a family's module (which imports ``models/``) is imported only
when that family is asked for, and is checked then to declare what its row here says.

``family_for(config)`` finds a config's family (by ``architectures``, else ``model_type``);
``family_for_gguf(name, meta)`` a GGUF file's (by ``general.architecture``; DeepSeek-V2 and V3 share
"deepseek2" and are told apart by the metadata, ``GGUFArch.accepts``); ``FAMILIES`` maps family
names to families, in registry order (tests take their family list from here; iterating its names
imports nothing); ``supported_architectures()`` and ``gguf_architectures()`` list what we read;
``gguf_families()`` the families with a GGUF declaration; ``moe_facts(config)`` is what the store
needs (sparse layers, expert sizes), read with the family's typed config.
"""
from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any, Callable

from lean_qwenflash.families.base import (ConfigReader, ExpertLayout, Family, FamilyConfigError, MoEFacts,
                                          UnsupportedArchitecture)

# family name -> (module under lean_qwenflash.families, HF architectures, model types, GGUF architectures)
_REGISTRY: dict[str, tuple[str, tuple, tuple, tuple]] = {
    "qwen3_next": ("qwen3_next", ("Qwen3NextForCausalLM",), ("qwen3_next",), ("qwen3next",)),
    "qwen3_moe": ("qwen3_moe", ("Qwen3MoeForCausalLM",), ("qwen3_moe",), ("qwen3moe",)),
    # Mixtral is llama.cpp's "llama" with experts
    "mixtral": ("mixtral", ("MixtralForCausalLM",), ("mixtral",), ("llama",)),
    "olmoe": ("olmoe", ("OlmoeForCausalLM",), ("olmoe",), ("olmoe",)),
    "qwen3_5_moe": ("qwen3_5_moe", ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeForConditionalGeneration"),
                    ("qwen3_5_moe", "qwen3_5_moe_text"), ("qwen35moe",)),
    "glm4_moe": ("glm4_moe", ("Glm4MoeForCausalLM",), ("glm4_moe",), ("glm4moe",)),
    # DeepSeek-V2 and V3 are both llama.cpp's "deepseek2" (told apart by expert_gating_func)
    "deepseek_v3": ("deepseek_v3", ("DeepseekV3ForCausalLM",), ("deepseek_v3",), ("deepseek2",)),
    "deepseek_v2": ("deepseek_v2", ("DeepseekV2ForCausalLM",), ("deepseek_v2",), ("deepseek2",)),
    "gpt_oss": ("gpt_oss", ("GptOssForCausalLM",), ("gpt_oss",), ("gpt-oss",)),
    "afmoe": ("afmoe", ("AfmoeForCausalLM",), ("afmoe",), ("afmoe",)),
}
_BY_ARCHITECTURE = {a: name for name, row in _REGISTRY.items() for a in row[1]}
_BY_MODEL_TYPE = {t: name for name, row in _REGISTRY.items() for t in row[2]}
_BY_GGUF_ARCH: dict[str, tuple] = {}     # GGUF architecture -> the families sharing it, in registry order
for _name, _row in _REGISTRY.items():
    for _g in _row[3]:
        _BY_GGUF_ARCH[_g] = _BY_GGUF_ARCH.get(_g, ()) + (_name,)
_LOADED: dict[str, Family] = {}


def _load(name: str) -> Family:
    """The ``FAMILY`` of family ``name``'s module (imported on first use), checked against its row."""
    family = _LOADED.get(name)
    if family is None:
        module, archs, model_types, gguf_archs = _REGISTRY[name]
        family = importlib.import_module(f"{__name__}.{module}").FAMILY
        declared = (family.name, tuple(family.architectures), tuple(family.model_types),
                    (family.gguf.gguf_arch,) if family.gguf is not None else ())
        if declared != (name, archs, model_types, gguf_archs):
            raise RuntimeError(f"internal: lean_qwenflash.families.{module} declares {declared}, but the registry "
                               f"says {(name, archs, model_types, gguf_archs)}")
        _LOADED[name] = family
    return family


class RegistryView(Mapping):
    """A read-only mapping over the registry: ``keys`` maps each key to a family name, and a value
    is ``pick(family)``. Keys, ``in`` and ``len`` import nothing; a value imports its family."""

    def __init__(self, keys: dict[str, str], pick: Callable[[Family], Any] = lambda f: f):
        self._keys = dict(keys)
        self._pick = pick

    def __getitem__(self, key: str):
        return self._pick(_load(self._keys[key]))

    def __contains__(self, key) -> bool:
        return key in self._keys

    def __iter__(self):
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __repr__(self) -> str:
        return f"RegistryView({list(self._keys)})"


FAMILIES: Mapping[str, Family] = RegistryView({name: name for name in _REGISTRY})
ARCHITECTURES: Mapping[str, Family] = RegistryView(_BY_ARCHITECTURE)


def supported_architectures() -> list[str]:
    return sorted(_BY_ARCHITECTURE)


def gguf_architectures() -> dict[str, str]:
    """GGUF architecture names we read (``general.architecture``), sorted, each with its family's name
    (names joined by "/" where families share one)."""
    return {g: "/".join(_BY_GGUF_ARCH[g]) for g in sorted(_BY_GGUF_ARCH)}


def gguf_families() -> list[str]:
    """The families with a GGUF declaration, in registry order."""
    return [name for name, row in _REGISTRY.items() if row[3]]


def family_for(config: dict) -> Family:
    """The family of an HF config dict; a clear error for anything we do not know."""
    archs = config.get("architectures") or []
    for a in archs:
        if a in _BY_ARCHITECTURE:
            return _load(_BY_ARCHITECTURE[a])
    # A config without "architectures" (saved from a bare config object) still names its model_type.
    model_type = config.get("model_type")
    if not archs and isinstance(model_type, str) and model_type in _BY_MODEL_TYPE:
        return _load(_BY_MODEL_TYPE[model_type])
    what = ", ".join(archs) if archs else "none (config.json has no 'architectures')"
    raise UnsupportedArchitecture(f"unsupported architecture: {what}; supported: {', '.join(supported_architectures())}")


def family_for_gguf(gguf_arch: str, meta: Callable | None = None) -> Family:
    """The family of a GGUF ``general.architecture`` name. Where families share the name, the
    first whose declaration ``accepts`` the file's metadata (``meta(key, default)``, keys without
    the ``{arch}.`` prefix); without ``meta``, the first."""
    if gguf_arch not in _BY_GGUF_ARCH:
        raise UnsupportedArchitecture(f"GGUF architecture {gguf_arch!r} is not supported; supported: "
                                      f"{', '.join(gguf_architectures())}")
    names = _BY_GGUF_ARCH[gguf_arch]
    if len(names) > 1 and meta is not None:
        for name in names:
            family = _load(name)
            if family.gguf.accepts is None or family.gguf.accepts(meta):
                return family
        raise UnsupportedArchitecture(f"GGUF architecture {gguf_arch!r}: the file's metadata matches none of "
                                      f"{', '.join(names)}")
    return _load(names[0])


def moe_facts(config: dict) -> MoEFacts:
    return family_for(config).facts(config)


__all__ = ["FAMILIES", "ARCHITECTURES", "ConfigReader", "ExpertLayout", "Family", "FamilyConfigError", "MoEFacts",
           "RegistryView", "UnsupportedArchitecture", "family_for", "family_for_gguf", "gguf_architectures", "gguf_families",
           "moe_facts", "supported_architectures"]
