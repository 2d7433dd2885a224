"""Reading a GGUF model (one file, split shards, or a directory of shards) as a checkpoint.

:class:`GGUFCheckpoint` answers the packer's questions the way :class:`.checkpoint.HFCheckpoint`
does, in Hugging Face terms (names, shapes and config from the family's GGUF declaration, looked
up through :mod:`.gguf_names`), so the pack is the same kind of pack and ``models/`` does not know
GGUF exists. In addition it hands out tensors in their stored encoding: routed experts as the
exact bytes of the GGUF file (``expert_raw``), and resident matrices as
:class:`~lean_qwenflash.quant.QuantTensor` rows (``get_encoded``).

Files are read through ``gguf.GGUFReader``, which maps them: nothing is loaded until a tensor is
asked for. Before any tensor is used, every tensor's type and extent are checked, so a truncated
file, an unknown quantization type or a missing tensor is refused by name.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from lean_qwenflash.families import family_for_gguf

from ..quant import ENCODINGS, QuantCols, QuantRows, QuantTensor, get_encoding
from .checkpoint import ConfigExperts
from .gguf_io import GGUFError, field_value, gguf_shards, is_gguf, open_gguf  # noqa: F401  (also this module's API)
from .gguf_names import (BY_GGUF_ARCH, EXPERT_KEYS, GLOBAL_TENSORS, Joined, PermuteCols, Split, Values, gguf_to_hf_tensor,
                         is_alternative, split_layer_name, transform_for)

# GGML type number -> our encoding name
BY_GGML_TYPE = {e.ggml_type: name for name, e in ENCODINGS.items() if e.ggml_type >= 0}
# GGUF tensors we know and do not need (llama.cpp's precomputed rope frequencies).
IGNORED_TENSORS = ("rope_freqs.weight",)


class GGUFCheckpoint(ConfigExperts):
    """A GGUF model read as an HF-named checkpoint (see the module docstring)."""

    is_gguf = True

    def __init__(self, path):
        self.path = Path(path)
        self.shards = gguf_shards(path)
        self._readers = [open_gguf(s) for s in self.shards]
        self.metadata = {k: field_value(f) for k, f in self._readers[0].fields.items()
                         if not k.startswith("GGUF.")}
        self.tensors = {}
        for shard, r in zip(self.shards, self._readers):
            for t in r.tensors:
                if t.name in self.tensors:
                    raise GGUFError(f"tensor {t.name!r} appears in two shards (second: {shard.name})")
                self.tensors[t.name] = t
        arch_name = self.metadata.get("general.architecture")
        if arch_name not in BY_GGUF_ARCH:
            from lean_qwenflash.families.base import UnsupportedArchitecture
            raise UnsupportedArchitecture(
                f"{self.path.name}: GGUF architecture {arch_name!r} is not supported; supported: "
                f"{', '.join(sorted(BY_GGUF_ARCH))}")
        self.arch = BY_GGUF_ARCH[arch_name]
        # (its name and HF architecture go in the config; families sharing a GGUF name are told
        # apart by the metadata)
        self._family = family_for_gguf(arch_name, self._meta)
        self.arch = self._family.gguf
        self._expert_tensors = {}       # (layer, role) -> GGUF name
        # canonical HF name -> GGUF name ("a+b" for a matrix stored as several tensors)
        self.resident_keys: dict[str, str] = {}
        self._transforms = {}           # canonical HF name -> the transform this file's tensors need
        self.skipped = {}               # what the runtime does not use: prefix -> tensor count
        # Multi-token-prediction layers (after the model's own) are not run by HF's model either.
        blocks = int(self._meta("block_count"))
        num_layers = blocks - int(self._meta("nextn_predict_layers", 0) or 0)
        unknown, joined = [], {}
        for name in self.tensors:
            split = split_layer_name(name, "blk")
            if split and split[0] >= blocks:
                raise GGUFError(f"{self.path.name}: tensor {name!r} is for layer {split[0]}, but "
                                f"{arch_name}.block_count is {blocks}")
            if split and split[0] >= num_layers:       # a multi-token-prediction (nextn) layer
                prefix = f"blk.{split[0]}. (multi-token prediction)"
                self.skipped[prefix] = self.skipped.get(prefix, 0) + 1
                continue
            role = next((r for r, g in self.arch.expert_tensors.items() if split and g == split[1]), None)
            if role:
                self._expert_tensors[(split[0], role)] = name
                continue
            hf = gguf_to_hf_tensor(self.arch, name)
            if hf is None:
                if name not in IGNORED_TENSORS:
                    unknown.append(name)
                continue
            tr = transform_for(self.arch, hf)
            if is_alternative(self.arch, name):       # an older layout's name: a plain rename
                if hf in joined:
                    raise GGUFError(f"{self.path.name}: {name!r} and the newer tensors holding {hf} are both present")
                self.resident_keys[hf] = name
                self._transforms[hf] = None
            elif isinstance(tr, (Joined, Split)):
                if hf in self.resident_keys:
                    raise GGUFError(f"{self.path.name}: {name!r} and the older tensor "
                                    f"{self.resident_keys[hf]!r} holding {hf} are both present")
                joined.setdefault(hf, {})[split[1]] = name
            else:
                self.resident_keys[hf] = name
                self._transforms[hf] = tr
        for hf, parts in joined.items():
            tr = transform_for(self.arch, hf)
            missing = [p for p in tr.parts if p not in parts]
            if missing:
                layer = split_layer_name(hf, "model.layers")[0]
                raise GGUFError(f"{self.path.name}: tensor 'blk.{layer}.{missing[0]}' is missing "
                                f"(it holds part of {hf})")
            self.resident_keys[hf] = "+".join(parts[p] for p in tr.parts)
            self._transforms[hf] = tr
        self._canon_of = {k: c for c, k in self.resident_keys.items()}
        self._check_layers(num_layers)
        if unknown:
            raise GGUFError(f"{self.path.name}: tensors this {arch_name} mapping does not know: "
                            f"{', '.join(sorted(unknown)[:6])}" + (" ..." if len(unknown) > 6 else ""))
        self.config = self._config()
        self.names = self.family.layout

    def _check_layers(self, num_layers: int) -> None:
        """Every layer of a kind (same expert layout, same mixer) holds the same tensors, and the
        global ones are there: a tensor missing from a layer is named."""
        per_layer = {}
        for name in self.tensors:
            split = split_layer_name(name, "blk")
            if split and split[0] < num_layers:
                per_layer.setdefault(split[0], set()).add(split[1])
        kinds = {}
        for layer in range(num_layers):
            have = per_layer.get(layer, set())
            # kind: routed experts or dense MLP; DeltaNet (it has ssm_a) or attention
            kind = (any(s.endswith("_exps.weight") for s in have), "ssm_a" in have)
            kinds.setdefault(kind, []).append(layer)
        missing = [f"blk.{layer}.{s}" for layers in kinds.values() for layer in layers
                   for s in sorted(set().union(*(per_layer.get(l, set()) for l in layers)) - per_layer.get(layer, set()))]
        missing += [n for n in ("token_embd.weight", "output_norm.weight") if n not in self.tensors]
        if missing:
            raise GGUFError(f"{self.path.name}: tensor{'s' if len(missing) > 1 else ''} "
                            f"{', '.join(repr(m) for m in missing[:6])} {'are' if len(missing) > 1 else 'is'} missing"
                            " (other layers of the same kind have them)")

    # -- metadata -----------------------------------------------------------------------------------
    def _meta(self, key: str, default=KeyError):
        full = f"{self.arch.gguf_arch}.{key}"
        if full in self.metadata:
            return self.metadata[full]
        if default is KeyError:
            raise GGUFError(f"{self.path.name}: metadata key {full!r} is missing")
        return default

    def _config(self) -> dict:
        arch = self.arch
        cfg = {"architectures": [self.family.architectures[0]], "model_type": self.family.name}
        for hf_key, gkey in arch.config_keys.items():
            value = self._meta(gkey, None)
            if value is not None:
                cfg[hf_key] = value
        for required in ("num_hidden_layers", "hidden_size", "num_attention_heads"):
            if required not in cfg:
                raise GGUFError(f"{self.path.name}: metadata key {arch.gguf_arch}.{arch.config_keys[required]!r} is missing")
        cfg.setdefault("num_key_value_heads", cfg["num_attention_heads"])
        if isinstance(cfg["num_key_value_heads"], list):     # per-layer lists (hybrid models)
            cfg["num_key_value_heads"] = max(cfg["num_key_value_heads"])
        cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
        cfg["rope_parameters"] = {"rope_type": "default", "rope_theta": float(cfg.pop("rope_theta", 10000.0))}
        scaling = self._meta("rope.scaling.type", "none")
        if scaling in ("yarn", "linear"):
            rope = cfg["rope_parameters"]
            rope.update(rope_type=scaling, factor=float(self._meta("rope.scaling.factor")))
            if scaling == "yarn":
                # llama.cpp rounds the ends of YaRN's correction range to whole dims (ggml's
                # rope_yarn_corr_dims: floor / ceil), which is transformers' truncate=True
                rope.update(original_max_position_embeddings=int(self._meta("rope.scaling.original_context_length")),
                            beta_fast=float(self._meta("rope.scaling.yarn_beta_fast", 32.0)),
                            beta_slow=float(self._meta("rope.scaling.yarn_beta_slow", 1.0)), truncate=True)
                log_mul = self._meta("rope.scaling.yarn_log_multiplier", None)
                if log_mul:       # DeepSeek's mscale_all_dim, x 0.1 (llama.cpp has one factor for both)
                    rope.update(mscale=float(log_mul) / 0.1, mscale_all_dim=float(log_mul) / 0.1)
        elif scaling not in ("none", None):
            raise GGUFError(f"{self.path.name}: rope scaling {scaling!r} is not supported")
        rope_dims = self._meta("rope.dimension_count", None)
        # (a partial rotary where heads have one size: not MLA, whose rope dims are their own)
        if rope_dims and rope_dims != cfg["head_dim"] and "head_dim" in arch.config_keys:
            cfg["rope_parameters"]["partial_rotary_factor"] = rope_dims / cfg["head_dim"]
        if "token_embd.weight" not in self.tensors:
            raise GGUFError(f"{self.path.name}: tensor 'token_embd.weight' is missing")
        cfg["vocab_size"] = int(self.tensors["token_embd.weight"].shape[1])
        cfg["tie_word_embeddings"] = "output.weight" not in self.tensors
        num_experts, top_k, width = (self._meta(k, None) for k in EXPERT_KEYS)
        if not num_experts or not top_k:
            raise GGUFError(f"{self.path.name}: {arch.gguf_arch}.expert_count / expert_used_count missing: "
                            "this is not a mixture-of-experts model")
        if not width:
            gate = self._expert_tensors.get((min((l for l, _ in self._expert_tensors), default=0), "gate"))
            if gate is None:
                raise GGUFError(f"{self.path.name}: no routed-expert tensors (blk.N.ffn_gate_exps.weight)")
            width = int(self.tensors[gate].shape[1])
        cfg[arch.num_experts_key] = int(num_experts)
        cfg["num_experts_per_tok"] = int(top_k)
        cfg[arch.expert_width_key] = int(width)
        moe = sorted({l for l, _ in self._expert_tensors})
        dense = [i for i in range(cfg["num_hidden_layers"]) if i not in moe]
        if dense:
            cfg["mlp_only_layers"] = dense
        cfg.update(arch.implied_config)
        if arch.extra_config:
            cfg.update(arch.extra_config(self._meta, self.tensors))
        for key, hf in (("tokenizer.ggml.bos_token_id", "bos_token_id"), ("tokenizer.ggml.eos_token_id", "eos_token_id"),
                        ("tokenizer.ggml.padding_token_id", "pad_token_id")):
            if key in self.metadata:
                cfg[hf] = int(self.metadata[key])
        return cfg

    # -- resident tensors -----------------------------------------------------------------------------
    def _tensor(self, name: str):
        try:
            return self.tensors[name]
        except KeyError:
            raise GGUFError(f"{self.path.name}: tensor {name!r} is missing") from None

    def _parts(self, key: str) -> list:
        return [self._tensor(n) for n in key.split("+")]

    def stored_encoding(self, key: str):
        """Our encoding name for a tensor's GGML type, or None when we have no kernel for it (or
        the parts of a joined matrix differ)."""
        encs = {BY_GGML_TYPE.get(int(t.tensor_type)) for t in self._parts(key)}
        return encs.pop() if len(encs) == 1 else None

    def type_name(self, key: str) -> str:
        return " + ".join(f"{t.name.split('.')[-2]} {t.tensor_type.name}" if "+" in key else t.tensor_type.name
                          for t in self._parts(key))

    def _stored_shape(self, key: str) -> tuple:
        shapes = [tuple(int(d) for d in reversed(t.shape)) for t in self._parts(key)]
        if len(shapes) == 1:
            return shapes[0]
        return (sum(s[0] for s in shapes),) + shapes[0][1:]

    def _transform(self, key: str):
        return self._transforms.get(self._canon_of[key])

    def shape(self, key: str) -> tuple:
        tr = self._transform(key)
        if isinstance(tr, Split):
            parts = [torch.empty(tuple(int(d) for d in reversed(t.shape)), device="meta") for t in self._parts(key)]
            return tuple(tr.to_hf(parts, self.config).shape)
        shape = self._stored_shape(key)
        if isinstance(tr, Values):
            shape = tuple(tr.to_hf(torch.empty(shape, device="meta"), self.config).shape)
        return shape

    def dtype(self, key: str) -> torch.dtype:
        """The float dtype ``get`` returns (f32 for block-quantized tensors: exact dequantization)."""
        enc = self.stored_encoding(key)
        if enc in ("f16", "bf16") and not isinstance(self._transform(key), Values):
            return get_encoding(enc).torch_dtype
        return torch.float32

    def nbytes(self, key: str) -> int:
        return sum(int(t.n_bytes) for t in self._parts(key))

    @staticmethod
    def _bytes(t) -> np.ndarray:
        return np.asarray(t.data).reshape(-1).view(np.uint8)

    @staticmethod
    def _floats(raw: np.ndarray, ggml_type, shape: tuple) -> torch.Tensor:
        """Stored bytes of ``shape`` values as floats: their own float type, or exact f32 (our
        dequantizer, or gguf's reference one for types we have no kernel for)."""
        import gguf.quants
        enc = BY_GGML_TYPE.get(int(ggml_type))
        if enc is None:
            rows = raw.reshape(-1, raw.size // max(1, int(np.prod(shape[:-1]))))
            return torch.from_numpy(np.ascontiguousarray(gguf.quants.dequantize(rows, ggml_type),
                                                         dtype=np.float32)).reshape(shape)
        e = get_encoding(enc)
        data = torch.from_numpy(raw.copy())
        if e.is_float:
            return data.view(e.torch_dtype).reshape(shape)
        return e.dequantize(data.view(-1, e.row_bytes(shape[-1])), shape[-1]).reshape(shape)

    def _float_part(self, t) -> torch.Tensor:
        """One stored tensor as floats [rows, cols] (or [n])."""
        return self._floats(self._bytes(t), t.tensor_type, tuple(int(d) for d in reversed(t.shape)))

    def get(self, key: str) -> torch.Tensor:
        """The tensor as floats in HF layout (dequantized exactly when block-quantized)."""
        parts = [self._float_part(t) for t in self._parts(key)]
        tr = self._transform(key)
        if isinstance(tr, Split):
            return tr.to_hf([p.float() for p in parts], self.config).contiguous()
        if len({p.dtype for p in parts}) > 1:
            parts = [p.float() for p in parts]
        data = parts[0] if len(parts) == 1 else torch.cat(parts)
        if isinstance(tr, Values):
            data = tr.to_hf(data.float(), self.config)
        elif tr is not None:
            data = tr.to_hf(data, self.config)
        return data.contiguous()

    def stored_parts(self, key: str):
        """The encodings of a joined matrix's parts when they differ and are all block encodings we
        have kernels for (it can then be kept as stored, see ``get_rows``), else None."""
        encs = [BY_GGML_TYPE.get(int(t.tensor_type)) for t in self._parts(key)]
        if len(set(encs)) < 2 or None in encs or any(get_encoding(e).is_float for e in encs) \
                or isinstance(self._transform(key), Split):
            return None
        return encs

    def get_rows(self, key: str) -> QuantRows:
        """A joined matrix whose parts have different encodings, as stored: the parts' rows and
        the row order that puts them in HF order."""
        tr = self._transform(key)
        shape = self._stored_shape(key)
        parts = []
        for t in self._parts(key):
            e = get_encoding(BY_GGML_TYPE[int(t.tensor_type)])
            raw = torch.from_numpy(self._bytes(t).copy()).view(-1, e.row_bytes(shape[1]))
            parts.append(QuantTensor(raw, e, (raw.shape[0], shape[1])))
        order = torch.argsort(tr.perm(self.config)) if tr is not None else torch.arange(shape[0])
        return QuantRows(tuple(parts), order, shape)

    def get_encoded(self, key: str):
        """A block-quantized matrix as stored: a QuantTensor (rows permuted into HF order where the
        table says so), or a QuantCols over the stored rows where the table reorders columns."""
        enc = self.stored_encoding(key)
        shape = self._stored_shape(key)
        if enc is None or get_encoding(enc).is_float or len(shape) != 2:
            raise GGUFError(f"internal: {key} ({self.type_name(key)}) is not a block-quantized matrix")
        e = get_encoding(enc)
        raw = torch.cat([torch.from_numpy(self._bytes(t).copy()).view(-1, e.row_bytes(shape[1]))
                         for t in self._parts(key)])
        tr = self._transform(key)
        if isinstance(tr, PermuteCols):
            return QuantCols(QuantTensor(raw, e, shape), tr.perm(self.config).to(torch.int64))
        if isinstance(tr, Values):
            raise GGUFError(f"{key}: a value transform needs float data, but it is {enc}")
        if tr is not None:
            raw = tr.to_hf(raw, self.config).contiguous()
        return QuantTensor(raw, e, shape)

    # -- routed experts ------------------------------------------------------------------------------
    def check_experts(self) -> None:
        num_experts, _, hidden, inter = self.expert_dims()
        want = {"gate": (num_experts, inter, hidden), "up": (num_experts, inter, hidden),
                "down": (num_experts, hidden, inter)}
        problems = []
        for layer in self.moe_layers():
            for role, shape in want.items():
                name = self._expert_tensors.get((layer, role))
                if name is None:
                    problems.append(f"tensor 'blk.{layer}.{self.arch.expert_tensors[role]}' is missing")
                elif self._stored_shape(name) != shape:
                    problems.append(f"tensor {name!r} has shape {list(self._stored_shape(name))}, "
                                    f"the model expects {list(shape)}")
        if problems:
            raise GGUFError(f"{self.path.name}: " + "; ".join(problems[:5]) + (" ..." if len(problems) > 5 else ""))

    def expert_encodings(self, layer: int) -> dict:
        """{"gate_up": enc, "down": enc}: the layer's experts as stored. Refuses, naming the tensor,
        types we have no kernel for, and gate/up pairs stored in different types."""
        out = {}
        for role in ("gate", "up", "down"):
            name = self._expert_tensors[(layer, role)]
            enc = self.stored_encoding(name)
            if enc is None:
                supported = ", ".join(e.upper() for e in BY_GGML_TYPE.values())
                raise GGUFError(f"{self.path.name}: tensor {name!r} is {self.type_name(name)}, which lean-qwenflash "
                                f"has no kernel for (supported: {supported}); use a GGUF with one of these, "
                                "or re-pack from the original checkpoint with --quant")
            out[role] = enc
        if out["gate"] != out["up"]:
            raise GGUFError(f"{self.path.name}: layer {layer} stores gate experts as {out['gate']} and up experts as "
                            f"{out['up']}; records need one encoding for both (re-pack with --quant to convert)")
        return {"gate_up": out["gate"], "down": out["down"]}

    def _expert_bytes(self, layer: int, role: str, expert_id: int) -> np.ndarray:
        t = self.tensors[self._expert_tensors[(layer, role)]]
        raw = np.asarray(t.data).reshape(-1).view(np.uint8)
        per = raw.size // int(t.shape[2])
        return raw[expert_id * per:(expert_id + 1) * per]

    def expert_raw(self, layer: int, expert_id: int) -> tuple[np.ndarray, np.ndarray]:
        """(gate_up, down) bytes of one expert, exactly as in the file (gate rows then up rows)."""
        gate, up, down = (self._expert_bytes(layer, r, expert_id) for r in ("gate", "up", "down"))
        return np.concatenate([gate, up]), down

    def expert(self, layer: int, expert_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(gate_up [2I, H], down [H, I]) as floats (exact dequantization)."""
        _, _, hidden, inter = self.expert_dims()
        out = [self._floats(self._expert_bytes(layer, role, expert_id),
                            self.tensors[self._expert_tensors[(layer, role)]].tensor_type, shape)
               for role, shape in (("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter)))]
        if out[0].dtype != out[1].dtype:
            out[0], out[1] = out[0].float(), out[1].float()
        return torch.cat(out[:2]), out[2]

    def expert_dtype(self) -> torch.dtype:
        """The float dtype experts convert to when re-encoded (--quant / --dtype)."""
        encs = {self.stored_encoding(n) for n in self._expert_tensors.values()}
        if encs <= {"bf16"}:
            return torch.bfloat16
        if encs <= {"f16"}:
            return torch.float16
        return torch.float32


__all__ = ["GGUFCheckpoint", "GGUFError", "gguf_shards", "is_gguf", "GLOBAL_TENSORS"]
