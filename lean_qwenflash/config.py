"""Runtime configuration: YAML files under configs/ loaded into validated dataclasses.

Every knob lives here (none in environment variables) so `doctor` and `stats` can print them and
a typo is an error that names the key. Sizes accept integers or strings like "8GiB", "512MiB",
"1.5GB".
"""
from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import yaml

from .common import CPU_BINDS, EXPERT_KERNELS, KERNEL_ISAS, KV_CACHE_DTYPES, ConfigError, check_sampling, format_size, parse_size

IO_ENGINES = ("auto", "uring", "pread")
CACHE_POLICIES = ("lru", "lfu")
DTYPES = ("float32", "bfloat16", "float16")
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: Optional[str] = None
    max_queue: int = 8                  # waiting requests beyond the ones generating; more get 429
    max_active: int = 4                 # generations decoded at once, stepped together (side
                                        # requests don't wait behind a long answer); 1 = strict FIFO
    max_request_bytes: int = 4 * 1024 * 1024
    prefix_cache_bytes: int = 512 * 1024 * 1024
    model_name: Optional[str] = None    # name served at /v1/models (default: the pack's directory name)
    default_reasoning_effort: str = "none"  # when a request gives no reasoning_effort (none = thinking off)
    # Tokens a request without max_tokens may generate; None: until the turn ends or the context is
    # full (what agents that never send max_tokens, e.g. Aider, expect).
    max_output_tokens: Optional[int] = None
    # Reading a request is timed (the response is not): a connection must deliver a complete request
    # head within header_timeout_s of connecting or of its previous response finishing, and the whole
    # body within body_timeout_s after the head; otherwise it gets 408 and is closed.
    header_timeout_s: float = 30.0
    body_timeout_s: float = 60.0
    # Open connections one client address may hold (a flood of half-open sockets from one address
    # cannot use up the process's file descriptors); more get 503 at once and are closed.
    max_connections_per_client: int = 64
    # Prefix snapshots that leave RAM (prefix_cache_bytes) go to this directory, at most
    # snapshot_bytes of files (least recently used deleted); a restart with the same pack and
    # numerics reuses them. None: snapshots live in RAM only.
    snapshot_dir: Optional[str] = None
    snapshot_bytes: int = 8 * 1024**3


@dataclass
class GenerationConfig:
    max_tokens: int = 256
    temperature: float = 0.7
    top_p: float = 0.95
    top_k: int = 0
    min_p: float = 0.0
    prefill_chunk_tokens: int = 0       # tokens per prefill forward; 0: automatic (generate/budget.py)


@dataclass
class RuntimeConfig:
    model: Optional[str] = None         # pack directory; None = the built-in default model
    device: str = "cpu"                 # "cpu", "cuda", "cuda:1"
    dtype: str = "float32"              # compute dtype of resident weights
    host_cache_bytes: int = 1024**3     # RAM expert cache (the compute tier on a CPU-only machine)
    device_cache_bytes: int = 0         # VRAM expert cache; 0 = no device tier
    io_engine: str = "auto"
    io_queue_depth: int = 32
    verify_checksums: bool = True
    prefetch: bool = True
    prefetch_lookahead: int = 1         # layers ahead whose experts are predicted and read
    # Experts guessed per layer: top-k + this many (at least one); auto (null): the surest three
    # quarters of top-k, rounded up (6 of 8, 2 of 2): when the disk is the bottleneck, a wrong guess
    # costs a whole read, and the least sure guesses are wrong most often (docs/DESIGN.md).
    prefetch_extra: Optional[int] = None
    # Which cached expert makes room (experts/cache.py): lfu = the one the model used least lately
    # (keeps the experts a layer's routing favours), lru = the least recently used.
    cache_policy: str = "lfu"
    expert_kernels: str = "fast"        # fast: native decode kernels (int8 activations for quantized
                                        # experts); exact: dequantize, then torch (bit-identity tests)
    cpu_isa: str = "auto"               # force a native kernel path: auto, scalar, avx2, avx512
    cpu_threads: int = 0                # native kernel threads; 0 = torch's intra-op thread count
    # Bind each compute thread to a core of its own (models/affinity.py): auto = when the thread
    # budget is every CPU this process may use; on = the first cpu_threads CPUs; off = never.
    cpu_bind: str = "auto"
    # How attention layers store keys and values: f32 (as computed: full precision), f16, bf16, or
    # GGUF's 32-value blocks q8_0 / q4_0 (~3.8x / ~7x smaller than f32), dequantized block by block
    # inside attention.
    kv_cache_dtype: str = "f32"
    server: ServerConfig = field(default_factory=ServerConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    source: Optional[str] = None        # file it was loaded from (not a key)

    def validate(self) -> "RuntimeConfig":
        if self.io_engine not in IO_ENGINES:
            raise ConfigError(f"io_engine: must be one of {', '.join(IO_ENGINES)}, got {self.io_engine!r}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"dtype: must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.expert_kernels not in EXPERT_KERNELS:
            raise ConfigError(f"expert_kernels: must be one of {', '.join(EXPERT_KERNELS)}, got {self.expert_kernels!r}")
        if self.cpu_threads < 0:
            raise ConfigError(f"cpu_threads: must be >= 0 (0: as many as torch uses), got {self.cpu_threads}")
        if self.cpu_bind not in CPU_BINDS:
            raise ConfigError(f"cpu_bind: must be one of {', '.join(CPU_BINDS)}, got {self.cpu_bind!r}")
        if self.cpu_isa not in KERNEL_ISAS:
            raise ConfigError(f"cpu_isa: must be one of {', '.join(KERNEL_ISAS)}, got {self.cpu_isa!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError(f"kv_cache_dtype: must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r} "
                              f"(q8_0 / q4_0 store keys and values in GGUF's 32-value blocks)")
        if not re.fullmatch(r"cpu|cuda(:[0-9]+)?", self.device):
            raise ConfigError(f"device: must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if not 1 <= self.io_queue_depth <= 4096:
            raise ConfigError(f"io_queue_depth: must be in 1..4096, got {self.io_queue_depth}")
        if self.prefetch_lookahead < 1 or self.prefetch_lookahead > 8:
            raise ConfigError(f"prefetch_lookahead: must be in 1..8, got {self.prefetch_lookahead}")
        if self.prefetch_extra is not None and not -1024 <= self.prefetch_extra <= 1024:
            raise ConfigError(f"prefetch_extra: must be in -1024..1024 (experts guessed per layer beyond top-k; "
                              f"at least one is guessed), got {self.prefetch_extra}")
        if self.cache_policy not in CACHE_POLICIES:
            raise ConfigError(f"cache_policy: must be one of {', '.join(CACHE_POLICIES)}, got {self.cache_policy!r} "
                              "(lfu keeps the experts the routing uses most; lru the most recent)")
        if self.host_cache_bytes <= 0:
            raise ConfigError("host_cache_bytes: must be positive (it holds the experts being computed)")
        if self.device == "cpu" and self.device_cache_bytes:
            raise ConfigError("device_cache_bytes: must be 0 when device is 'cpu' (the host cache is the compute tier)")
        if not 0 < self.server.port < 65536:
            raise ConfigError(f"server.port: must be in 1..65535, got {self.server.port}")
        if self.server.max_active < 1:
            raise ConfigError(f"server.max_active: must be >= 1, got {self.server.max_active}")
        if self.server.max_queue < 0:
            raise ConfigError(f"server.max_queue: must be >= 0, got {self.server.max_queue}")
        if self.server.default_reasoning_effort not in REASONING_EFFORTS:
            raise ConfigError(f"server.default_reasoning_effort: must be one of {', '.join(REASONING_EFFORTS)}, "
                              f"got {self.server.default_reasoning_effort!r}")
        if self.server.max_output_tokens is not None and self.server.max_output_tokens < 1:
            raise ConfigError(f"server.max_output_tokens: must be >= 1 (or null: up to the context), "
                              f"got {self.server.max_output_tokens}")
        if self.server.max_request_bytes < 1024:
            raise ConfigError(f"server.max_request_bytes: must be at least 1KiB, got {self.server.max_request_bytes}")
        if self.server.max_connections_per_client < 1:
            raise ConfigError(f"server.max_connections_per_client: must be >= 1, got {self.server.max_connections_per_client}")
        if self.server.snapshot_bytes < 0:
            raise ConfigError(f"server.snapshot_bytes: must be >= 0, got {self.server.snapshot_bytes}")
        for key in ("header_timeout_s", "body_timeout_s"):
            seconds = getattr(self.server, key)
            if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not 0 < seconds < math.inf:
                raise ConfigError(f"server.{key}: must be a positive number of seconds, got {seconds!r}")
        gen = self.generation
        if gen.max_tokens < 1:
            raise ConfigError(f"generation.max_tokens: must be >= 1, got {gen.max_tokens}")
        if gen.prefill_chunk_tokens < 0:
            raise ConfigError(f"generation.prefill_chunk_tokens: must be >= 1, or 0 for the automatic chunk "
                              f"(256 to 2048 tokens, as long as 512 MiB of activations and the memory left allow); "
                              f"got {gen.prefill_chunk_tokens}")
        # Sampling values are checked by the rules SamplingParams uses (common.SAMPLING_RULES).
        try:
            check_sampling(temperature=gen.temperature, top_p=gen.top_p, top_k=gen.top_k, min_p=gen.min_p)
        except ValueError as err:
            raise ConfigError(f"generation: {err}") from None
        return self

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        d.pop("source")
        if d["server"].get("api_key"):
            d["server"]["api_key"] = "***"
        return d


_AUTO_KEYS = {"prefetch_extra"}          # "auto" in a file means null (the automatic choice)
_SIZE_KEYS = {"host_cache_bytes", "device_cache_bytes", "max_request_bytes", "prefix_cache_bytes", "snapshot_bytes"}


def _fill(cls, data: dict, prefix: str):
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "source"}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(f"unknown config key{'s' if len(unknown) > 1 else ''} "
                          f"{', '.join(prefix + k for k in unknown)}; known keys: {', '.join(sorted(fields))}")
    kwargs = {}
    for name, value in data.items():
        key = prefix + name
        f = fields[name]
        if name in ("server", "generation"):
            kwargs[name] = _fill(ServerConfig if name == "server" else GenerationConfig, value or {}, key + ".")
            continue
        if name in _SIZE_KEYS:
            kwargs[name] = parse_size(value, key)
            continue
        if name in _AUTO_KEYS and value == "auto":
            value = None
        want = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        if value is None:
            if "Optional" not in want:
                raise ConfigError(f"{key}: must not be empty")
        elif "bool" in want:
            if not isinstance(value, bool):
                raise ConfigError(f"{key}: expected true or false, got {value!r}")
        elif "int" in want:
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{key}: expected an integer{' or auto' if name in _AUTO_KEYS else ''}, got {value!r}")
        elif "float" in want:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"{key}: expected a number, got {value!r}")
            value = float(value)
        elif "str" in want and not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        kwargs[name] = value
    return cls(**kwargs)


def load_config(path=None, **overrides) -> RuntimeConfig:
    """Load and validate a YAML config (or the defaults when ``path`` is None); keyword overrides
    (e.g. ``model=...``) are applied before validation."""
    data = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist (see configs/ for examples)")
        try:
            data = yaml.safe_load(p.read_text()) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{p} is not valid YAML: {e}") from None
    data.update({k: v for k, v in overrides.items() if v is not None})
    cfg = _fill(RuntimeConfig, data, "")
    if cfg.model is not None and path is not None and not Path(cfg.model).is_absolute() and "model" not in overrides:
        # Relative pack paths in a config file are relative to the file.
        cfg.model = str((Path(path).parent / cfg.model).resolve())
    snap = cfg.server.snapshot_dir
    if snap is not None and path is not None and not Path(snap).expanduser().is_absolute():
        cfg.server.snapshot_dir = str((Path(path).parent / snap).resolve())   # (relative to the file too)
    cfg.source = str(path) if path else None
    return cfg.validate()


__all__ = ["ConfigError", "DTYPES", "EXPERT_KERNELS", "GenerationConfig", "IO_ENGINES", "KERNEL_ISAS", "REASONING_EFFORTS",
           "RuntimeConfig", "ServerConfig", "format_size", "load_config", "parse_size"]
