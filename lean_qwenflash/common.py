"""Names and rules every layer shares, with no imports of ours (and none of torch).

The config validates against these, and the layers that implement them (``models`` for the kernel
modes and ISAs, ``experts`` for cache budgets, ``generate`` for sampling) import them from here, so
that ``config`` stays a leaf and no lower layer has to import it.
"""
from __future__ import annotations

import math
import re

EXPERT_KERNELS = ("fast", "exact")                 # config key expert_kernels (see models.kernels)
KERNEL_ISAS = ("auto", "scalar", "avx2", "avx512")  # config key cpu_isa (see models.native)
CPU_BINDS = ("auto", "on", "off")                   # config key cpu_bind (see models.affinity)
KV_CACHE_DTYPES = ("f32", "f16", "bf16", "q8_0", "q4_0")  # config key kv_cache_dtype (see models.layers.attention)

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}


class ConfigError(ValueError):
    """A bad configuration; the message names the key."""


def parse_size(value, key: str) -> int:
    """Bytes from an int or a string such as "8GiB", "512 MiB", "1.5GB"."""
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a size like 8GiB or 512MiB, got {value!r}")
    if isinstance(value, int):
        n = value
    elif isinstance(value, float) and value.is_integer():
        n = int(value)
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", value)
        if not m or m.group(2).lower() not in _UNITS:
            raise ConfigError(f"{key}: cannot read {value!r} as a size; write e.g. 8GiB, 512MiB, 1.5GB or a byte count")
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    else:
        raise ConfigError(f"{key}: expected a size like 8GiB or 512MiB, got {value!r}")
    if n < 0:
        raise ConfigError(f"{key}: size must not be negative, got {value!r}")
    return n


def format_size(n: int) -> str:
    for unit, f in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= f:
            return f"{n / f:.1f}{unit}"
    return f"{n}B"


def _number(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


# sampling parameter -> (rule, what is allowed); generate.sampling.SamplingParams and the config's
# generation section both check with it.
SAMPLING_RULES = {
    "temperature": (lambda v: _number(v) and v >= 0, "a number >= 0 (0 = greedy)"),
    "top_k": (lambda v: isinstance(v, int) and v >= 0, "an integer >= 0 (0 = off)"),
    "top_p": (lambda v: _number(v) and 0 < v <= 1, "a number in (0, 1]"),
    "min_p": (lambda v: _number(v) and 0 <= v < 1, "a number in [0, 1)"),
    "repetition_penalty": (lambda v: _number(v) and v > 0, "a number > 0 (1 = off)"),
    "presence_penalty": (lambda v: _number(v) and -2 <= v <= 2, "a number in [-2, 2]"),
    "frequency_penalty": (lambda v: _number(v) and -2 <= v <= 2, "a number in [-2, 2]"),
    "seed": (lambda v: v is None or (isinstance(v, int) and 0 <= v < 2 ** 63), "None or an integer in [0, 2**63)"),
}


def check_sampling(**values) -> None:
    """ValueError naming the first sampling parameter in ``values`` that breaks its rule."""
    for name, value in values.items():
        ok, allowed = SAMPLING_RULES[name]
        if isinstance(value, bool) or not ok(value):
            raise ValueError(f"sampling parameter {name}={value!r} is invalid; allowed: {allowed}")
