"""Model assembly: a family's model from resident tensors plus an expert provider, and HF
checkpoint loading.

This sits above ``models`` (which never sees files or families' key tables), ``families``,
``experts`` and ``store``, next to ``runtime``, which opens packs through it.

Resident tensors (everything but routed experts) become the model's parameters under their HF
names; routed experts go to an ``ExpertProvider``. The family (``lean_qwenflash.families``) builds
the model and declares the key layout the packer uses too, so both agree on every key.
"""
from __future__ import annotations

from typing import Mapping, Optional, Union

import torch

from lean_qwenflash.experts.provider import ExpertProvider, ResidentExperts, aligned_record
from lean_qwenflash.families import family_for
from lean_qwenflash.models.layers.linear import Embedding, Linear
from lean_qwenflash.models.policy import ExecPolicy
from lean_qwenflash.models.moe.routers import Router
from lean_qwenflash.quant import ENCODINGS, QuantCols, QuantRows, QuantTensor
from lean_qwenflash.store import naming
from lean_qwenflash.store.checkpoint import CheckpointError, HFCheckpoint


def _names_list(names, limit: int = 20) -> str:
    names = sorted(names)
    more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def check_resident(config: dict, shapes: Mapping[str, tuple]):
    """The family's model on the meta device, after checking that ``shapes`` (canonical name ->
    shape of every resident tensor) are exactly its parameters; CheckpointError names the
    missing, unexpected and misshapen tensors."""
    with torch.device("meta"):
        model = family_for(config).build(config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    missing = expected.keys() - shapes.keys()
    unexpected = shapes.keys() - expected.keys()
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensors: {_names_list(missing)}")
        if unexpected:
            parts.append(f"unexpected tensors: {_names_list(unexpected)}")
        raise CheckpointError(f"{config['architectures'][0]} checkpoint does not match the model; " + "; ".join(parts))
    for key, shape in expected.items():
        if tuple(shapes[key]) != shape:
            raise CheckpointError(f"tensor {key!r} has shape {tuple(shapes[key])}, the model expects {shape}")
    return model


def build_model(config: dict, resident_tensors: Mapping[str, torch.Tensor], provider: ExpertProvider,
                dtype: torch.dtype = torch.float32, device: Union[str, torch.device] = "cpu",
                policy: Optional[ExecPolicy] = None):
    """A ready-to-run model (eval mode) from an HF config dict and its resident tensors.

    ``resident_tensors`` are keyed by canonical checkpoint names (aliases are canonicalised);
    every model parameter must be present with the right shape, and nothing else. Routed-expert
    weights are never part of it: the model's sparse blocks ask ``provider``.
    """
    names = family_for(config).layout
    renamed = {naming.rename_key(names, k): v for k, v in resident_tensors.items()}
    tensors = {naming.canonical_resident_key(names, k): v for k, v in renamed.items()
               if not k.startswith(names.ignored_prefixes)}
    model = check_resident(config, {k: tuple(v.shape) for k, v in tensors.items()})
    expected = {k: v.shape for k, v in model.state_dict().items()}
    if policy is not None and policy.stored_floats and torch.device(device).type == "cpu":
        tensors = _keep_stored_floats(model, tensors, expected, dtype)
    # Block-quantized resident matrices (pack --quant) replace their Linear's float parameter.
    quantized = {k for k, v in tensors.items() if isinstance(v, (QuantTensor, QuantRows, QuantCols)) and k in expected}
    for key in quantized:
        module = model.get_submodule(key.rsplit(".", 1)[0])
        if not isinstance(module, (Linear, Embedding)) or not key.endswith(".weight"):
            raise CheckpointError(f"tensor {key!r} is block-quantized but is not a linear layer's or "
                                  "embedding's weight")
        q = tensors[key].to(device)
        if isinstance(module, Embedding):
            module.set_quantized(q, dtype)
        else:
            module.set_quantized(q)
    state = {k: tensors[k].to(device=device, dtype=dtype) for k in expected if k not in quantized}
    model.load_state_dict(state, strict=True, assign=True)
    model.set_expert_provider(provider)
    if policy is not None:
        model.set_policy(policy)
    return model.eval().requires_grad_(False)


_NARROW_FLOATS = {ENCODINGS[n].torch_dtype: ENCODINGS[n] for n in ("f16", "bf16")}     # torch dtype -> encoding


def _keep_stored_floats(model, tensors: dict, expected: dict, dtype: torch.dtype) -> dict:
    """``tensors`` with every f16 / bf16 linear or embedding weight narrower than ``dtype`` as a
    float-encoded QuantTensor over its stored bytes (``ExecPolicy.stored_floats``): it then takes the
    encoded matrices' path (``kernels.quant_linear``, the native decode steps) instead of an fp32 copy
    twice its size. Routers keep the compute dtype (their logits pick the experts)."""
    if dtype != torch.float32:
        return tensors
    out = dict(tensors)
    for key, v in tensors.items():
        if key not in expected or not key.endswith(".weight") or not isinstance(v, torch.Tensor) \
                or v.dtype not in _NARROW_FLOATS or v.dim() != 2:
            continue
        module = model.get_submodule(key.rsplit(".", 1)[0])
        if not isinstance(module, (Linear, Embedding)) or isinstance(module, Router):
            continue
        raw = v.contiguous().view(torch.uint8)
        out[key] = QuantTensor(raw.view(v.shape[0], -1), _NARROW_FLOATS[v.dtype], tuple(v.shape))
    return out


def load_hf_checkpoint(hf_dir: str, dtype: torch.dtype = torch.float32,
                       device: Union[str, torch.device] = "cpu", policy: Optional[ExecPolicy] = None):
    """(model, ResidentExperts) from an HF directory (config.json + *.safetensors shards).

    Read through the same ``HFCheckpoint`` the packer uses: tensors one at a time, routed experts
    saved per expert or stacked [E, ...], problems reported by tensor name.
    """
    ckpt = HFCheckpoint(hf_dir)
    ckpt.check_experts()
    resident = {canon: ckpt.get(key) for canon, key in ckpt.resident_keys.items()}
    num_experts = ckpt.expert_dims()[0] if ckpt.moe_layers() else 0
    layers = {layer: [aligned_record(*(t.to(device=device, dtype=dtype) for t in ckpt.expert(layer, e)))
                      for e in range(num_experts)]
              for layer in ckpt.moe_layers()}
    provider = ResidentExperts(layers)
    return build_model(ckpt.config, resident, provider, dtype, device, policy), provider
