"""A pack opened for generation: store, resident model, expert provider and tokenizer together.

This is what the CLI, the server and the benchmarks open; everything below it (models, experts,
store) knows nothing of configs.
"""
from __future__ import annotations

import warnings
from pathlib import Path
from typing import Optional

import torch

from .config import ConfigError, RuntimeConfig, load_config
from .experts.provider import ResidentExperts
from .experts.tiered import TieredExperts
from .families import moe_facts
from .generate.budget import prefill_chunk_tokens, run_room
from .generate.sampling import SamplingParams
from .loader import build_model
from .models.policy import ExecPolicy, torch_spin_unbound, torch_threads_spin
from .store.checkpoint import TORCH_DTYPES
from .store.reader import ExpertStore

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent / "default_model"


def sampling_params(gen_cfg, **overrides) -> SamplingParams:
    """SamplingParams from the config's generation defaults; an override that is not None wins.
    (The CLI and the server both build their sampling this way.)"""
    fields = ("temperature", "top_p", "top_k", "min_p")
    values = {k: getattr(gen_cfg, k) for k in fields}
    values.update({k: v for k, v in overrides.items() if v is not None})
    return SamplingParams(**values)


def default_pack(cache_root: Optional[Path] = None) -> Path:
    """The built-in default model as a pack: shipped packed, or packed once on first use into
    ``~/.cache/lean-qwenflash`` (keyed by the weights' and the config/tokenizer files' sizes and
    mtimes, so an update of any of them re-packs)."""
    src = DEFAULT_MODEL_DIR
    if (src / "manifest.json").is_file():
        return src
    if not (src / "config.json").is_file():
        raise ConfigError(f"model: no pack given and the built-in default model is missing from {src}; "
                          "pass --model PACK or set `model:` in the config")
    files = sorted(src.glob("*.safetensors")) + sorted(src.glob("*.json"))
    stamp = "-".join(f"{w.name}:{w.stat().st_size}x{int(w.stat().st_mtime)}" for w in files)
    import hashlib
    key = hashlib.sha256(stamp.encode()).hexdigest()[:12]
    root = cache_root or Path.home() / ".cache" / "lean-qwenflash"
    out = root / f"default-model-{key}"
    if not (out / "manifest.json").is_file():
        from .store.packer import pack
        root.mkdir(parents=True, exist_ok=True)
        pack(src, out, progress=False, force=out.exists())
    return out


class Runtime:
    def __init__(self, cfg: RuntimeConfig, store: ExpertStore, model, provider, tokenizer=None):
        self.cfg = cfg
        self.store = store
        self.model = model
        self.provider = provider
        self.tokenizer = tokenizer
        # Tokens per prefill forward, fixed for the run: generation.prefill_chunk_tokens, or (0) the
        # automatic chunk for this model's shape and the memory left once it is loaded
        # (generate/budget.py). Runs with the same chunk compute the same outputs, streamed or resident.
        self.prefill_chunk_tokens = prefill_chunk_tokens(model.config, cfg.generation.prefill_chunk_tokens,
                                                         run_room(cfg))

    @classmethod
    def open(cls, cfg: Optional[RuntimeConfig] = None, resident_experts: bool = False) -> "Runtime":
        """Open ``cfg.model`` (a pack directory). ``resident_experts`` loads every expert into
        memory instead of streaming (the lossless reference)."""
        cfg = cfg or load_config()
        if cfg.model is None:
            cfg.model = str(default_pack())
        store = ExpertStore.open(cfg.model, engine=cfg.io_engine, queue_depth=cfg.io_queue_depth,
                                 verify_checksums=cfg.verify_checksums)
        config = store.config
        # Records of the compute dtype are used as stored; float records of another dtype (a GGUF's
        # f16/bf16 fallback rows at dtype float32) are converted per call, block-encoded ones
        # dequantized to it (models/kernels.as_float).
        dtype = TORCH_DTYPES[cfg.dtype]
        device = torch.device(cfg.device)
        # (as stored: build_model converts to ``dtype``, or keeps f16 / bf16 matrices encoded where the
        # policy says so)
        resident = store.load_resident(device=device)
        top_k = moe_facts(config).top_k if store.manifest.layers else 1
        if resident_experts:
            provider = ResidentExperts.from_store(store)
            if device.type != "cpu":
                provider = provider.to(device=device)
        else:
            provider = TieredExperts(
                store, host_cache_bytes=cfg.host_cache_bytes, top_k=top_k,
                device=device, device_cache_bytes=cfg.device_cache_bytes, prefetch=cfg.prefetch,
                prefetch_lookahead=cfg.prefetch_lookahead, prefetch_extra=cfg.prefetch_extra,
                cache_policy=cfg.cache_policy)
        policy = ExecPolicy.from_config(cfg)
        model = build_model(config, resident, provider, dtype=dtype, device=device, policy=policy)
        for spin in (torch_threads_spin(), torch_spin_unbound(policy)) if device.type == "cpu" else ():
            if spin:
                warnings.warn(spin, RuntimeWarning, stacklevel=2)
        if isinstance(provider, TieredExperts):
            provider.set_predictors(model.expert_predictors())     # prefetch with the family's routing rule
        tokenizer = None
        if (Path(cfg.model) / "tokenizer.json").is_file():
            from .chat import Tokenizer
            tokenizer = Tokenizer.from_dir(cfg.model)
        return cls(cfg, store, model, provider, tokenizer)

    def stats(self) -> dict:
        if isinstance(self.provider, TieredExperts):
            return self.provider.stats.snapshot()
        return {}

    def stats_table(self, per_layer: bool = False) -> str:
        if isinstance(self.provider, TieredExperts):
            return self.provider.stats.table(per_layer=per_layer)
        return "(all experts resident: no tier statistics)"

    def close(self) -> None:
        if isinstance(self.provider, TieredExperts):
            self.provider.close()
        self.store.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


__all__ = ["Runtime", "ResidentExperts", "sampling_params", "DEFAULT_MODEL_DIR"]
