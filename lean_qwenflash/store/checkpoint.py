"""Reading a Hugging Face checkpoint directory lazily, and writing safetensors as a stream.

Both the packer and the model loader read checkpoints through :class:`HFCheckpoint`, which opens
every shard lazily (safetensors maps the file; a tensor is read only when asked for) and sorts the
tensor names into resident tensors and routed-expert tensors with :mod:`.naming`.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from lean_qwenflash.quant import mxfp4

from . import naming

ST_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
# uint8 and int64 only for writing packs: quantized resident matrices are stored as their raw block rows
# (mixed ones with an int64 row order).
ST_NAMES = {**{v: k for k, v in ST_DTYPES.items()}, torch.uint8: "U8", torch.int64: "I64"}
TORCH_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
TORCH_DTYPES = {v: k for k, v in TORCH_NAMES.items()}


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message names the file or tensor."""


@dataclass
class ExpertIndex:
    """Where each routed expert's tensors live, whatever the on-disk layout."""

    per_expert: dict = field(default_factory=dict)   # (layer, expert, role) -> key
    stacked: dict = field(default_factory=dict)      # (layer, "gate_up"|"down") -> key
    mxfp4: dict = field(default_factory=dict)        # (layer, "gate_up"|"down", "blocks"|"scales") -> key


class ConfigExperts:
    """What a checkpoint's config says about its routed experts (HF and GGUF sources alike)."""

    config: dict
    # True for a GGUF file: tensors come encoded (expert_raw, get_encoded), the tokenizer from its metadata
    is_gguf = False
    _family = None
    skipped: dict = {}                  # what the source holds and the runtime does not use (HF: prefix -> count)
    source_notes: list = []             # what the pack should say about how the source was read
    # The block encoding a checkpoint's routed experts are stored in (GPT-OSS: "mxfp4"), or None
    # (float). Such a source also answers expert_encodings(layer) and expert_raw(layer, expert).
    experts_encoded = None

    @property
    def family(self):
        """The model family (``lean_qwenflash.families``) of the config."""
        if self._family is None:
            self._family = _family_for(self.config)
        return self._family

    @property
    def architecture(self) -> str:
        """The config's architecture string that named the family."""
        return next((a for a in self.config.get("architectures") or [] if a in self.family.architectures),
                    self.family.architectures[0])

    def moe_layers(self) -> list[int]:
        return list(self.family.facts(self.config).moe_layers)

    def expert_dims(self) -> tuple[int, int, int, int]:
        """(num_experts, top_k, hidden_size, expert_intermediate_size)."""
        f = self.family.facts(self.config)
        return f.num_experts, f.top_k, f.hidden_size, f.expert_intermediate


class HFCheckpoint(ConfigExperts):
    """A checkpoint directory: config.json plus one or more .safetensors shards."""

    def __init__(self, path):
        self.path = Path(path)
        cfg = self.path / "config.json"
        if not cfg.is_file():
            raise CheckpointError(f"{self.path} has no config.json: pass a Hugging Face checkpoint directory")
        try:
            self.source_config = json.loads(cfg.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{cfg} is not valid JSON: {e}") from None
        self._family = _family_for(self.source_config)
        # The config of the model we run (a multimodal checkpoint's text model), flat.
        self.config = self.family.text_config(self.source_config)
        self.names = self.family.layout
        self.skipped: dict[str, int] = {}               # what is not used: prefix -> tensor count
        shards = sorted(self.path.glob("*.safetensors"))
        if not shards:
            raise CheckpointError(f"{self.path} has no .safetensors files (other weight formats are not supported)")
        self._handles = {}
        self.key_shard: dict[str, Path] = {}           # name (after the family's renames) -> shard
        self.file_key: dict[str, str] = {}             # name -> the key in the file
        for shard in shards:
            try:
                h = safe_open(str(shard), framework="pt")
            except Exception as e:  # safetensors raises its own error types
                raise CheckpointError(f"cannot read {shard}: {e}") from None
            self._handles[shard] = h
            for k in h.keys():
                name = naming.rename_key(self.names, k)
                if name in self.key_shard:
                    raise CheckpointError(f"tensor {k} appears in both {self.key_shard[name].name} and {shard.name}")
                self.key_shard[name] = shard
                self.file_key[name] = k
        self.experts = ExpertIndex()
        self.resident_keys: dict[str, str] = {}          # canonical name -> key in the files
        num_layers = self.config.get("num_hidden_layers")
        for k in list(self.key_shard):
            skip = next((p for p in self.names.ignored_prefixes if k.startswith(p)), None)
            layer = naming.layer_of(k)
            if skip is None and layer is not None and isinstance(num_layers, int) and layer >= num_layers:
                skip = "model.layers.N>=num_hidden_layers (multi-token prediction)"
            if skip is not None:
                self.skipped[skip] = self.skipped.get(skip, 0) + 1
                del self.key_shard[k]
                continue
            ek = naming.parse_expert_key(self.names, k)
            if ek is None:
                canon = naming.canonical_resident_key(self.names, k)
                if canon in self.resident_keys:
                    raise CheckpointError(f"tensors {self.resident_keys[canon]} and {k} are the same weight")
                self.resident_keys[canon] = k
            elif ek.form:
                self.experts.mxfp4[(ek.layer_idx, ek.part, ek.form)] = k
            elif ek.expert_id is None:
                self.experts.stacked[(ek.layer_idx, ek.part)] = k
            else:
                self.experts.per_expert[(ek.layer_idx, ek.expert_id, ek.part)] = k

    # -- metadata ---------------------------------------------------------------------------
    def _slice(self, key: str):
        return self._handles[self.key_shard[key]].get_slice(self.file_key[key])

    def shape(self, key: str) -> tuple:
        return tuple(self._slice(key).get_shape())

    def dtype(self, key: str) -> torch.dtype:
        name = self._slice(key).get_dtype()
        if name not in ST_DTYPES:
            raise CheckpointError(f"tensor {key} has dtype {name}; supported: {', '.join(ST_DTYPES)}")
        return ST_DTYPES[name]

    def nbytes(self, key: str) -> int:
        n = torch.tensor([], dtype=self.dtype(key)).element_size()
        for d in self.shape(key):
            n *= d
        return n

    def get(self, key: str) -> torch.Tensor:
        self.dtype(key)  # refuse unsupported dtypes by name
        return self._handles[self.key_shard[key]].get_tensor(self.file_key[key])

    # -- routed experts ---------------------------------------------------------------------
    def check_experts(self) -> None:
        """Every MoE layer has every expert's tensors with the right shapes, nothing extra."""
        num_experts, _, hidden, inter = self.expert_dims()
        layers = set(self.moe_layers())
        missing, wrong = [], []
        want = {"gate": (inter, hidden), "up": (inter, hidden), "down": (hidden, inter)}
        want_stacked = {"gate_up": (num_experts, 2 * inter, hidden), "down": (num_experts, hidden, inter)}
        if self.names.stacked_transposed:
            want_stacked = {"gate_up": (num_experts, hidden, 2 * inter), "down": (num_experts, inter, hidden)}
        for layer in sorted(layers):
            if (layer, "gate_up", "blocks") in self.experts.mxfp4:
                rows_cols = {"gate_up": (2 * inter, hidden), "down": (hidden, inter)}
                for p, (rows, cols) in rows_cols.items():
                    for form, shape in (("blocks", (num_experts, rows, cols // 32, 16)),
                                        ("scales", (num_experts, rows, cols // 32))):
                        k = self.experts.mxfp4.get((layer, p, form))
                        if k is None:
                            missing.append(f"model.layers.{layer}.{self.names.moe_module}.experts.{p}_proj_{form}")
                        elif self.shape(k) != shape:
                            wrong.append(f"tensor {k!r} has shape {self.shape(k)}, the model expects {shape}")
                continue
            stacked = {p: self.experts.stacked.get((layer, p)) for p in ("gate_up", "down")}
            if all(stacked.values()):
                for p, k in stacked.items():
                    if self.shape(k) != want_stacked[p]:
                        wrong.append(f"tensor {k!r} has shape {self.shape(k)}, the model expects {want_stacked[p]}")
                continue
            for e in range(num_experts):
                for role, shape in want.items():
                    k = self.experts.per_expert.get((layer, e, role))
                    if k is None:
                        missing.append(naming.expert_key(self.names, layer, e, role))
                    elif self.shape(k) != shape:
                        wrong.append(f"tensor {k!r} has shape {self.shape(k)}, the model expects {shape}")
        extra = sorted({k for (l, _, _), k in self.experts.per_expert.items() if l not in layers} |
                       {k for (l, _), k in self.experts.stacked.items() if l not in layers} |
                       {k for (l, _, _), k in self.experts.mxfp4.items() if l not in layers})
        problems = []
        if missing:
            problems.append(f"missing routed-expert tensors ({len(missing)}): {', '.join(missing[:5])}"
                            + (" ..." if len(missing) > 5 else ""))
        if wrong:
            problems.append("wrong shapes: " + "; ".join(wrong[:5]))
        if extra:
            problems.append(f"unexpected routed-expert tensors (layers the config says are dense): {', '.join(extra[:5])}")
        if problems:
            raise CheckpointError(f"{self.path}: " + " | ".join(problems))

    @property
    def experts_encoded(self):
        return "mxfp4" if self.experts.mxfp4 else None

    def expert_encodings(self, layer_idx: int) -> dict:
        """The encodings of a layer's experts as stored (block-encoded checkpoints only)."""
        if not self.experts.mxfp4:
            raise CheckpointError(f"internal: {self.path} stores float experts; read them with expert()")
        return {"gate_up": "mxfp4", "down": "mxfp4"}

    def expert_raw(self, layer_idx: int, expert_id: int) -> list:
        """One MXFP4 expert's (gate_up, down) as mxfp4 block rows (flat uint8 numpy): the checkpoint's
        codes and scale bytes, rearranged into the block layout (gate rows then up rows); no arithmetic."""
        q = self.experts.mxfp4
        out = []
        for p in ("gate_up", "down"):
            rows = mxfp4.from_hf(self._slice(q[(layer_idx, p, "blocks")])[expert_id],
                                 self._slice(q[(layer_idx, p, "scales")])[expert_id])
            if p == "gate_up" and self.names.gate_up_interleaved:
                rows = torch.cat((rows[0::2], rows[1::2]), dim=0)
            out.append(rows.contiguous().reshape(-1).numpy())
        return out

    def expert(self, layer_idx: int, expert_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [2I, H], down [H, I]) of one expert, read from whichever layout is on disk
        (MXFP4 experts dequantized to bfloat16, which holds every MXFP4 value exactly)."""
        stacked = self.experts.stacked
        if (layer_idx, "gate_up", "blocks") in self.experts.mxfp4:
            q = self.experts.mxfp4
            # Stored as the products' own [rows, cols] (not transposed); exact in bf16.
            gate_up, down = (mxfp4.dequantize(self._slice(q[(layer_idx, p, "blocks")])[expert_id],
                                              self._slice(q[(layer_idx, p, "scales")])[expert_id]).to(torch.bfloat16)
                             for p in ("gate_up", "down"))
            if self.names.gate_up_interleaved:
                gate_up = torch.cat((gate_up[0::2], gate_up[1::2]), dim=0)
            return gate_up, down
        if (layer_idx, "gate_up") in stacked:
            gate_up = self._slice(stacked[(layer_idx, "gate_up")])[expert_id]
            down = self._slice(stacked[(layer_idx, "down")])[expert_id]
            if self.names.stacked_transposed:
                gate_up, down = gate_up.t().contiguous(), down.t().contiguous()
            if self.names.gate_up_interleaved:
                gate_up = torch.cat((gate_up[0::2], gate_up[1::2]), dim=0)
            return gate_up, down
        k = self.experts.per_expert
        gate = self.get(k[(layer_idx, expert_id, "gate")])
        up = self.get(k[(layer_idx, expert_id, "up")])
        return torch.cat([gate, up], dim=0), self.get(k[(layer_idx, expert_id, "down")])

    def expert_dtype(self) -> torch.dtype:
        if self.experts.mxfp4:
            return torch.bfloat16
        keys = list(self.experts.stacked.values()) + list(self.experts.per_expert.values())
        dtypes = {self.dtype(k) for k in keys}
        if len(dtypes) > 1:
            raise CheckpointError(f"{self.path}: routed experts mix dtypes {sorted(map(str, dtypes))}; "
                                  "choose one with --dtype")
        return dtypes.pop() if dtypes else torch.float32


class StreamingSafetensorsWriter:
    """Writes a .safetensors file one tensor at a time (the header is fixed up front from the
    shapes and dtypes), so a checkpoint larger than RAM can be repacked."""

    def __init__(self, path, entries: list[tuple[str, tuple, torch.dtype]]):
        self.path = Path(path)
        header, offset = {}, 0
        self.order = []
        for name, shape, dtype in entries:
            n = torch.tensor([], dtype=dtype).element_size()
            for d in shape:
                n *= d
            header[name] = {"dtype": ST_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
            self.order.append((name, tuple(shape), dtype, n))
            offset += n
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # the data section starts 8-byte aligned
        self.f = open(self.path, "wb")
        self.f.write(struct.pack("<Q", len(blob)) + blob)
        self.next = 0

    def write(self, name: str, tensor: torch.Tensor) -> None:
        want_name, shape, dtype, n = self.order[self.next]
        if name != want_name or tuple(tensor.shape) != shape or tensor.dtype != dtype:
            raise CheckpointError(f"internal: expected {want_name} {shape} {dtype}, got {name} "
                                  f"{tuple(tensor.shape)} {tensor.dtype}")
        self.f.write(tensor.contiguous().view(torch.uint8).numpy().tobytes() if n else b"")
        self.next += 1

    def close(self) -> None:
        if self.next != len(self.order):
            raise CheckpointError(f"internal: {len(self.order) - self.next} tensors never written to {self.path}")
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()


def _family_for(config: dict):
    # Imported at call time: the families import models/, which imports this module.
    from lean_qwenflash.families import family_for
    return family_for(config)
