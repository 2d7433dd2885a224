"""Generation core: per-layer state, sampling, and the prefill/decode loop."""
from lean_qwenflash.generate.generator import Generator
from lean_qwenflash.generate.sampling import Sampler, SamplingParams
from lean_qwenflash.generate.state import DeltaNetState, KVCache, ModelState, new_state

__all__ = ["Generator", "Sampler", "SamplingParams", "DeltaNetState", "KVCache", "ModelState", "new_state"]
