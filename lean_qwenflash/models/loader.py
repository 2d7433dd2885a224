"""Registry of supported architectures, model construction from resident tensors, HF checkpoint loading.

Resident tensors (everything but routed experts) become the model's parameters under their HF
names; routed experts go to an ``ExpertProvider``. Names and layouts come from
``lean_qwenflash.store.naming`` so the packer and this loader agree on every key.
"""
from __future__ import annotations

import glob
import importlib
import json
import os
from typing import Mapping, Union

import torch

from lean_qwenflash.experts.provider import ExpertProvider, ExpertWeights, ResidentExperts, aligned_record
from lean_qwenflash.store import naming

# HF architecture string -> module under lean_qwenflash.models with a ``build(config)`` function.
REGISTRY = {
    "Qwen3NextForCausalLM": "qwen3_next",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
    "OlmoeForCausalLM": "olmoe",
}


class CheckpointError(ValueError):
    """A checkpoint that does not fit the model: missing/unexpected tensors or wrong shapes."""


def supported_architectures() -> list[str]:
    return sorted(REGISTRY)


def family_module(config: dict):
    """The family module (with ``build(config) -> CausalLM``) for an HF config dict."""
    for arch in config.get("architectures") or []:
        if arch in REGISTRY:
            return importlib.import_module(f"lean_qwenflash.models.{REGISTRY[arch]}")
    raise naming.UnsupportedArchitecture(
        f"unsupported architecture {config.get('architectures')!r}; supported: {', '.join(supported_architectures())}")


_family_module = family_module   # older private name, used by bench/stream.py


def _names_list(names, limit: int = 20) -> str:
    names = sorted(names)
    more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def build_model(config: dict, resident_tensors: Mapping[str, torch.Tensor], provider: ExpertProvider,
                dtype: torch.dtype = torch.float32, device: Union[str, torch.device] = "cpu"):
    """A ready-to-run model (eval mode) from an HF config dict and its resident tensors.

    ``resident_tensors`` are keyed by canonical checkpoint names (aliases are canonicalised);
    every model parameter must be present with the right shape, and nothing else. Routed-expert
    weights are never part of it: the model's sparse blocks ask ``provider``.
    """
    family = family_module(config)
    names = naming.arch_names(config)
    ignored = getattr(family, "IGNORED_KEY_PREFIXES", ())
    tensors = {naming.canonical_resident_key(names, k): v for k, v in resident_tensors.items()
               if not k.startswith(ignored)}
    with torch.device("meta"):
        model = family.build(config)
    expected = {k: v.shape for k, v in model.state_dict().items()}
    missing = expected.keys() - tensors.keys()
    unexpected = tensors.keys() - expected.keys()
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensors: {_names_list(missing)}")
        if unexpected:
            parts.append(f"unexpected tensors: {_names_list(unexpected)}")
        raise CheckpointError(f"{config['architectures'][0]} checkpoint does not match the model; " + "; ".join(parts))
    for key, shape in expected.items():
        if tuple(tensors[key].shape) != tuple(shape):
            raise CheckpointError(f"tensor {key!r} has shape {tuple(tensors[key].shape)}, "
                                  f"the model expects {tuple(shape)}")
    state = {k: tensors[k].to(device=device, dtype=dtype) for k in expected}
    model.load_state_dict(state, strict=True, assign=True)
    model.set_expert_provider(provider)
    return model.eval().requires_grad_(False)


def read_config(hf_dir: str) -> dict:
    path = os.path.join(hf_dir, "config.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} not found: expected a Hugging Face checkpoint directory")
    with open(path) as f:
        return json.load(f)


def load_hf_checkpoint(hf_dir: str, dtype: torch.dtype = torch.float32,
                       device: Union[str, torch.device] = "cpu"):
    """(model, ResidentExperts) from an HF directory (config.json + *.safetensors shards).

    Tensors are read one at a time; routed experts may be saved per expert or stacked [E, ...].
    """
    from safetensors import safe_open

    config = read_config(hf_dir)
    family = family_module(config)  # unsupported architectures fail before any tensor is read
    ignored = getattr(family, "IGNORED_KEY_PREFIXES", ())
    names = naming.arch_names(config)
    shards = sorted(glob.glob(os.path.join(hf_dir, "*.safetensors")))
    if not shards:
        raise FileNotFoundError(f"no *.safetensors files in {hf_dir}")
    resident: dict[str, torch.Tensor] = {}
    parts: dict[tuple[int, int], dict[str, torch.Tensor]] = {}   # (layer, expert) -> role -> tensor
    for shard in shards:
        with safe_open(shard, framework="pt") as f:
            for key in f.keys():
                if key.startswith(ignored):
                    continue
                expert = naming.parse_expert_key(names, key)
                tensor = f.get_tensor(key)
                if expert is None:
                    resident[naming.canonical_resident_key(names, key)] = tensor
                elif expert.expert_id is None:
                    for expert_id in range(tensor.shape[0]):
                        parts.setdefault((expert.layer_idx, expert_id), {})[expert.part] = (f"{key}[{expert_id}]",
                                                                                            tensor[expert_id])
                else:
                    parts.setdefault((expert.layer_idx, expert.expert_id), {})[expert.part] = (key, tensor)
    provider = ResidentExperts(_assemble_experts(config, names, parts, dtype, device))
    return build_model(config, resident, provider, dtype, device), provider


def _assemble_experts(config, names, parts, dtype, device) -> dict[int, list[ExpertWeights]]:
    """Per-layer expert lists in (gate_up [2I, H], down [H, I]) form; every expert accounted for."""
    moe_layers = naming.moe_layer_indices(config)
    num_experts, _, hidden, inter = naming.expert_dims(config) if moe_layers else (0, 0, 0, 0)
    unexpected = [f"model.layers.{layer}.{names.moe_module}.experts.{e}" for layer, e in parts
                  if layer not in moe_layers or e >= num_experts]
    if unexpected:
        raise CheckpointError(f"unexpected routed-expert tensors: {_names_list(unexpected)}")
    layers, missing = {}, []
    for layer in moe_layers:
        experts = []
        for e in range(num_experts):
            got = parts.pop((layer, e), {})   # pop: originals are freed as records are made
            roles = ("gate_up", "down") if "gate_up" in got else ("gate", "up", "down")
            absent = [r for r in roles if r not in got]
            if absent:
                for role in absent:
                    missing += [naming.expert_key(names, layer, e, r)
                                for r in (("gate", "up") if role == "gate_up" else (role,))]
                continue
            shapes = {"gate_up": (2 * inter, hidden), "gate": (inter, hidden), "up": (inter, hidden),
                      "down": (hidden, inter)}
            for role in roles:
                key, tensor = got[role]
                if tuple(tensor.shape) != shapes[role]:
                    raise CheckpointError(f"tensor {key!r} has shape {tuple(tensor.shape)}, "
                                          f"the model expects {shapes[role]}")
            gate_up = got["gate_up"][1] if "gate_up" in got else torch.cat((got["gate"][1], got["up"][1]), dim=0)
            experts.append(aligned_record(gate_up.to(device=device, dtype=dtype),
                                          got["down"][1].to(device=device, dtype=dtype)))
        layers[layer] = experts
    if missing:
        raise CheckpointError(f"missing routed-expert tensors: {_names_list(missing)}")
    return layers
