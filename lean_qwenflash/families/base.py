"""What a model family declares: its architectures, checkpoint key layout, typed config, builder
and, where llama.cpp runs it, its GGUF names (a ``GGUFArch``, see :mod:`.gguf`).

A family is one file in this package that creates one ``Family``; ``families/__init__.py`` maps
architecture strings, model types and GGUF architecture names to those files and imports one only
when asked. Everything else asks the registry: the packer and the checkpoint readers for the key
layout and the MoE layers, the model loader for ``build``, the GGUF importer and exporter for the
GGUF names, the tests for the list of families.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

if TYPE_CHECKING:     # (the vocabulary imports torch; base does not need it at run time)
    from lean_qwenflash.families.gguf import GGUFArch


class UnsupportedArchitecture(ValueError):
    pass


class FamilyConfigError(ValueError):
    """A config.json value a family cannot use; the message names the key."""


@dataclass(frozen=True)
class ExpertLayout:
    """Checkpoint key layout of the routed experts and routers of one family.

    Per-expert keys: ``model.layers.{L}.{moe_module}.experts.{e}.{proj}.weight`` with ``proj_names``
    for (gate, up, down); stacked keys: ``{moe_module}.experts.gate_up_proj`` [E, 2I, H] and
    ``down_proj`` [E, H, I]. ``moe_aliases``: other names of the sparse block that may appear (their
    router maps back to ``moe_module``). ``key_renames``: (prefix, replacement) applied to every key
    first (e.g. a multimodal checkpoint's ``model.language_model.`` -> ``model.``);
    ``ignored_prefixes``: tensors the runtime does not use (after renaming: MTP heads, vision towers).
    """

    moe_module: str = "mlp"
    proj_names: tuple = ("gate_proj", "up_proj", "down_proj")
    moe_aliases: tuple = ()
    key_renames: tuple = ()
    ignored_prefixes: tuple = ()
    # Stacked tensors stored as the products' transposes ([E, H, 2I] and [E, I, H]: GPT-OSS), and
    # gate/up rows alternating instead of gate rows first (GPT-OSS).
    stacked_transposed: bool = False
    gate_up_interleaved: bool = False
    # Tensors under ``{moe}.experts.`` that are resident, not expert records (e.g. expert biases).
    resident_suffixes: tuple = ()


_REQUIRED = object()


class ConfigReader:
    """Reads an HF config dict with types and defaults; errors name the key and the architecture."""

    def __init__(self, config: dict, architecture: str):
        self.config = config
        self.architecture = architecture

    def _fail(self, key: str, why: str):
        raise FamilyConfigError(f"config.json {key!r} ({self.architecture}): {why}")

    def get(self, key: str, kind: type = int, default: Any = _REQUIRED, aliases: Sequence[str] = ()):
        for k in (key,) + tuple(aliases):
            value = self.config.get(k)
            if value is not None:
                break
        else:
            if default is _REQUIRED:
                self._fail(key, "missing (required)")
            return default
        if kind is bool:
            if not isinstance(value, bool):
                self._fail(k, f"must be true or false, got {value!r}")
            return value
        if kind is int:
            if isinstance(value, bool) or not isinstance(value, int) and not (isinstance(value, float) and value.is_integer()):
                self._fail(k, f"must be an integer, got {value!r}")
            return int(value)
        if kind is float:
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                self._fail(k, f"must be a number, got {value!r}")
            return float(value)
        if kind is list:
            if not isinstance(value, list):
                self._fail(k, f"must be a list, got {value!r}")
            return value
        if kind is dict:
            if not isinstance(value, dict):
                self._fail(k, f"must be an object, got {value!r}")
            return value
        return value

    def positive(self, key: str, default: Any = _REQUIRED, aliases: Sequence[str] = ()) -> int:
        value = self.get(key, int, default, aliases)
        if value is not None and value < 1:
            self._fail(key, f"must be >= 1, got {value}")
        return value


@dataclass(frozen=True)
class MoEFacts:
    """What the store and the prefetcher need of a config: the sparse layers and expert sizes."""

    num_layers: int
    moe_layers: tuple
    num_experts: int
    top_k: int
    hidden_size: int
    expert_intermediate: int


@dataclass(frozen=True)
class Family:
    """One model family: everything the rest of the runtime asks about it.

    ``facts(config)`` reads the MoE facts (typed; errors name the key); ``build(config)`` makes the
    ``CausalLM`` on the current default device, with HF attribute names so that its
    ``state_dict()`` keys are the checkpoint's resident keys. ``text_config(config)`` returns the
    config of the part we run (a multimodal checkpoint's text model), used before anything else.
    ``gguf``: the family's GGUF declaration (llama.cpp architecture name, tensor names, transforms,
    metadata keys; :mod:`.gguf`), for families llama.cpp runs.
    """

    name: str
    architectures: tuple
    model_types: tuple
    layout: ExpertLayout
    facts_fn: Callable[[ConfigReader], MoEFacts]
    build_fn: Callable[[dict], Any]
    text_config_fn: Optional[Callable[[dict], dict]] = None
    notes: tuple = field(default_factory=tuple)    # what the runtime skips and says so (e.g. a vision tower)
    # GGUF tensor names, transforms and metadata keys (None: no llama.cpp architecture for it)
    gguf: Optional[GGUFArch] = None

    def text_config(self, config: dict) -> dict:
        return self.text_config_fn(config) if self.text_config_fn else config

    def reader(self, config: dict) -> ConfigReader:
        archs = config.get("architectures") or [self.architectures[0]]
        return ConfigReader(self.text_config(config), archs[0])

    def facts(self, config: dict) -> MoEFacts:
        return self.facts_fn(self.reader(config))

    def build(self, config: dict):
        return self.build_fn(self.text_config(config))


def sparse_layers(r: ConfigReader, num_experts: int) -> tuple:
    """The Qwen rule for which layers are sparse: ``decoder_sparse_step`` (every step-th layer),
    minus ``mlp_only_layers``; none without experts."""
    n = r.positive("num_hidden_layers")
    if num_experts <= 0:
        return ()
    step = r.get("decoder_sparse_step", int, 1) or 1
    dense = set(r.get("mlp_only_layers", list, []))
    return tuple(i for i in range(n) if i not in dense and (i + 1) % step == 0)


def dense_prefix_facts(r: ConfigReader, num_experts: int, first_dense: int = 0, every: int = 1,
                       intermediate_key: str = "moe_intermediate_size", top_k_aliases: tuple = ()) -> MoEFacts:
    """The facts of a model whose first ``first_dense`` layers are dense and every ``every``-th
    layer after them is sparse (DeepSeek, GLM, AfMoE; 0 and 1: every layer, as Mixtral, GPT-OSS)."""
    n = r.positive("num_hidden_layers")
    return MoEFacts(n, tuple(i for i in range(first_dense, n) if i % every == 0), num_experts,
                    r.positive("num_experts_per_tok", aliases=top_k_aliases), r.positive("hidden_size"),
                    r.positive(intermediate_key))


def periodic_layer_types(r: ConfigReader, other: str, every: int, periodic: str = "full_attention") -> list[str]:
    """``layer_types`` when the config has it, else ``periodic`` on every ``every``-th layer and
    ``other`` elsewhere; checked to name one of the two for each layer."""
    num_layers = r.positive("num_hidden_layers")
    types = r.get("layer_types", list, None)
    if types is None:
        types = [periodic if (i + 1) % every == 0 else other for i in range(num_layers)]
    if len(types) != num_layers or set(types) - {periodic, other}:
        raise ValueError(f"config layer_types {types!r} must list '{other}'/'{periodic}' "
                         f"for each of the {num_layers} layers")
    return list(types)
