"""Model runtime: device-agnostic torch implementations of the supported MoE families."""
from lean_qwenflash.models.base import CausalLM
from lean_qwenflash.models.loader import (CheckpointError, build_model, family_of, load_hf_checkpoint,
                                          supported_architectures)

__all__ = ["CausalLM", "CheckpointError", "build_model", "family_of", "load_hf_checkpoint",
           "supported_architectures"]
