"""Model runtime: device-agnostic torch implementations of the supported MoE families' layers.

Models never see files, families' key tables or configs: ``lean_qwenflash.loader`` assembles a
model from a family's ``build`` and resident tensors, and hands it an expert provider.
"""
from lean_qwenflash.models.base import CausalLM

__all__ = ["CausalLM"]
