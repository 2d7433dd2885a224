"""Generation core: per-layer state, sampling, the prefill/decode loop, prefix reuse, thinking budget."""
from lean_qwenflash.generate.generator import Generation, Generator, TokenHook
from lean_qwenflash.generate.prefix import PrefixCache
from lean_qwenflash.generate.sampling import Sampler, SamplingParams
from lean_qwenflash.generate.state import DeltaNetState, KVCache, ModelState, SlidingKVCache, new_state
from lean_qwenflash.generate.steering import Steering

__all__ = ["Generation", "Generator", "TokenHook", "PrefixCache", "Sampler", "SamplingParams", "DeltaNetState",
           "KVCache", "ModelState", "SlidingKVCache", "new_state", "Steering"]
