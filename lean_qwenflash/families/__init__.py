"""The registry of model families: one file per family in this package, each declaring a ``FAMILY``.

``family_for(config)`` finds a config's family (by ``architectures``, else ``model_type``);
``FAMILIES`` lists them (tests take their family list from here); ``moe_facts(config)`` is what the
store needs (sparse layers, expert sizes), read with the family's typed config.
"""
from __future__ import annotations

from lean_qwenflash.families import (afmoe, deepseek_v2, deepseek_v3, glm4_moe, gpt_oss, mixtral, olmoe,
                                     qwen3_5_moe, qwen3_moe, qwen3_next)
from lean_qwenflash.families.base import (ConfigReader, ExpertLayout, Family, FamilyConfigError, MoEFacts,
                                          UnsupportedArchitecture)

FAMILIES: dict[str, Family] = {f.name: f for f in (qwen3_next.FAMILY, qwen3_moe.FAMILY, mixtral.FAMILY, olmoe.FAMILY,
                                                   qwen3_5_moe.FAMILY, glm4_moe.FAMILY, deepseek_v3.FAMILY,
                                                   deepseek_v2.FAMILY, gpt_oss.FAMILY, afmoe.FAMILY)}
ARCHITECTURES: dict[str, Family] = {a: f for f in FAMILIES.values() for a in f.architectures}


def supported_architectures() -> list[str]:
    return sorted(ARCHITECTURES)


def family_for(config: dict) -> Family:
    """The family of an HF config dict; a clear error for anything we do not know."""
    archs = config.get("architectures") or []
    for a in archs:
        if a in ARCHITECTURES:
            return ARCHITECTURES[a]
    # A config without "architectures" (saved from a bare config object) still names its model_type.
    if not archs:
        for f in FAMILIES.values():
            if config.get("model_type") in f.model_types:
                return f
    what = ", ".join(archs) if archs else "none (config.json has no 'architectures')"
    raise UnsupportedArchitecture(f"unsupported architecture: {what}; supported: {', '.join(supported_architectures())}")


def moe_facts(config: dict) -> MoEFacts:
    return family_for(config).facts(config)


__all__ = ["FAMILIES", "ARCHITECTURES", "ConfigReader", "ExpertLayout", "Family", "FamilyConfigError", "MoEFacts",
           "UnsupportedArchitecture", "family_for", "moe_facts", "supported_architectures"]
