"""Write a Hugging Face checkpoint as a GGUF file llama.cpp can run (benchmarks and test oracles).

Names and config keys come from the family's GGUF declaration (``Family.gguf``, looked up through
:mod:`.gguf_names`). Experts are stacked per layer into GGUF's 3-D tensors; matrices are written
in ``encoding`` (bf16, f16 or f32), norms and routers in f32 (as llama.cpp's own converter does).
The vocabulary is a stand-in (byte tokens plus numbered pieces, SentencePiece-style) sized to the
checkpoint's ``vocab_size``, unless the directory has a byte-level BPE ``tokenizer.json`` (then that
vocabulary, its merges and chat template go in, see :mod:`.gguf_tokenizer`). Tensors the
declaration marks as transformed (llama's q/k row order, Qwen3-Next's ``A_log``, Qwen3.5's value-head
order, DeepSeek's split ``kv_b_proj``, GPT-OSS's expert biases...) are written the way llama.cpp's
converter writes them; ``alternatives=True`` writes a family's older layout instead (DeepSeek's single
``attn_kv_b``). Rope scaling (YaRN, linear) goes into the ``rope.scaling.*`` keys. A config that
llama.cpp's graph for the architecture cannot compute (GPT-OSS layer types other than sliding/full
alternating, AfMoE without muP, GLM expert groups, ...) is refused by the family's declaration,
naming the key, before anything is written. (llama.cpp always rounds YaRN's correction range to
whole dims: a GPT-OSS config with ``truncate: false`` exports, but llama.cpp computes its rope as
``truncate: true`` would, and so does a pack of the file.)
The file is streamed tensor by tensor, so a checkpoint larger than RAM exports fine.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .checkpoint import HFCheckpoint
from .gguf_names import EXPERT_KEYS, Joined, Split, Values, gguf_arch, hf_to_gguf_tensor, split_layer_name, transform_for
from .gguf_tokenizer import TokenizerConversionError, gguf_tokenizer_metadata

ENCODINGS = ("bf16", "f16", "f32")


def _config_value(config: dict, key: str):
    if key == "rope_theta" and key not in config:
        return (config.get("rope_parameters") or {}).get("rope_theta")
    return config.get(key)


def _parts_once(compute, count: int) -> list:
    """``count`` makers of one computation's parts (``compute()`` returns them in order): the
    transform runs once, at the first part's write, and its result is dropped after the last."""
    held: dict = {}

    def maker(i: int):
        def make():
            if "parts" not in held:
                held["parts"], held["left"] = list(compute()), count
            part = held["parts"][i]
            held["left"] -= 1
            if not held["left"]:
                held.clear()
            return part
        return make
    return [maker(i) for i in range(count)]


def _stored(shape: tuple, encoding: str) -> str:
    return "f32" if len(shape) == 1 else encoding      # vectors (norms) always f32, as llama.cpp's converter


# tensors written in f32 whatever the encoding: routers, convolutions, biases (llama.cpp's
# quantizer leaves every tensor not named *.weight as it is)
_F32_SUFFIXES = ("ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight", "ssm_conv1d.weight", ".bias")


def _info(shape: tuple, encoding: str):
    """(numpy shape, numpy dtype, nbytes, GGML raw type or None) of a tensor as _array writes it."""
    import gguf
    enc = _stored(shape, encoding)
    n = 1
    for d in shape:
        n *= int(d)
    if enc == "bf16":   # raw bytes: rows of 2 * cols uint8
        return tuple(shape[:-1]) + (2 * shape[-1],), np.dtype(np.uint8), 2 * n, gguf.GGMLQuantizationType.BF16
    dt = np.dtype(np.float32 if enc == "f32" else np.float16)
    return tuple(shape), dt, n * dt.itemsize, None


def _array(t: torch.Tensor, encoding: str) -> np.ndarray:
    enc = _stored(tuple(t.shape), encoding)
    if enc == "f32":
        return t.float().contiguous().numpy()
    if enc == "f16":
        return t.half().contiguous().numpy()
    return t.to(torch.bfloat16).contiguous().view(torch.uint8).numpy()


def _add_value(w, key: str, value) -> None:
    if isinstance(value, bool):
        w.add_bool(key, value)
    elif isinstance(value, float):
        w.add_float32(key, value)
    elif isinstance(value, str):
        w.add_string(key, value)
    elif isinstance(value, (list, tuple)):
        w.add_array(key, list(value))
    else:
        w.add_uint32(key, int(value))


def _add_tokenizer(w, hf_dir: Path, vocab: int) -> None:
    """The directory's byte-level BPE tokenizer when it has one, else a stand-in SPM vocabulary."""
    if (hf_dir / "tokenizer.json").is_file():
        try:
            meta = gguf_tokenizer_metadata(hf_dir)
        except TokenizerConversionError:
            meta = None
        if meta and len(meta["tokenizer.ggml.tokens"]) <= vocab:
            tokens = meta["tokenizer.ggml.tokens"] + [f"[PAD{i}]" for i in range(len(meta["tokenizer.ggml.tokens"]), vocab)]
            types = meta["tokenizer.ggml.token_type"] + [5] * (vocab - len(meta["tokenizer.ggml.token_type"]))
            w.add_tokenizer_model("gpt2")
            w.add_tokenizer_pre(meta["tokenizer.ggml.pre"])
            w.add_token_list(tokens)
            w.add_token_types(types)
            w.add_token_merges(meta["tokenizer.ggml.merges"])
            for key, add in (("bos", w.add_bos_token_id), ("eos", w.add_eos_token_id), ("padding", w.add_pad_token_id)):
                if f"tokenizer.ggml.{key}_token_id" in meta:
                    add(meta[f"tokenizer.ggml.{key}_token_id"])
            w.add_add_bos_token(meta["tokenizer.ggml.add_bos_token"])
            if "tokenizer.chat_template" in meta:
                w.add_chat_template(meta["tokenizer.chat_template"])
            return
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    tokens += [f"\u2581t{i}" for i in range(vocab - len(tokens))]
    types = [2, 3, 3] + [6] * 256 + [1] * (vocab - 259)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens[:vocab])
    w.add_token_scores([-float(i) for i in range(vocab)])
    w.add_token_types(types[:vocab])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)


def _metadata(arch, cfg: dict, ckpt, alternatives: bool) -> dict:
    """The ``{arch}.*`` keys (without the prefix): the config keys of the declaration, the expert
    keys, rope scaling, then the family's own (which win)."""
    meta = {}
    for hf_key, gkey in arch.config_keys.items():
        value = _config_value(cfg, hf_key)
        if value is not None:
            meta[gkey] = value
    if ckpt.moe_layers():
        num_experts, top_k, _, inter = ckpt.expert_dims()
        meta.update(zip(EXPERT_KEYS, (num_experts, top_k, inter)))
    if cfg.get("head_dim"):
        meta["attention.value_length"] = int(cfg["head_dim"])
    rope = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in ("yarn", "linear"):
        meta["rope.scaling.type"] = kind
        meta["rope.scaling.factor"] = float(rope["factor"])
        if kind == "yarn":
            meta["rope.scaling.original_context_length"] = int(rope.get("original_max_position_embeddings")
                                                               or cfg["max_position_embeddings"])
            for key, default in (("beta_fast", 32.0), ("beta_slow", 1.0)):
                if rope.get(key) is not None and float(rope[key]) != default:
                    meta[f"rope.scaling.yarn_{key}"] = float(rope[key])
    elif kind != "default":
        raise ValueError(f"{ckpt.family.name}: rope_type {kind!r} has no GGUF form here")
    if arch.extra_metadata:
        meta.update(arch.extra_metadata(dict(cfg, _gguf_alternatives=alternatives)))
    return meta


def export_gguf(hf_dir, out_path, encoding: str = "bf16", split_max_tensors: int = 0,
                alternatives: bool = False) -> Path:
    """Write ``hf_dir`` to ``out_path`` (GGUF v3); returns the path. ``split_max_tensors`` > 0
    writes llama.cpp-style shards (``NAME-00001-of-0000N.gguf``, ...) instead; returns the first.
    ``alternatives``: write the older layout where the family declares one (DeepSeek's single
    ``attn_kv_b`` instead of ``attn_k_b`` + ``attn_v_b``). A config llama.cpp's graph for the
    architecture cannot compute is refused (ValueError naming the key)."""
    import gguf

    if encoding not in ENCODINGS:
        raise ValueError(f"encoding must be one of {', '.join(ENCODINGS)}; got {encoding!r}")
    ckpt = HFCheckpoint(hf_dir)
    arch = gguf_arch(ckpt.family.name)
    cfg = ckpt.config
    meta = _metadata(arch, cfg, ckpt, alternatives)
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_path if split_max_tensors else out_path.with_name(out_path.name + ".tmp")
    w = gguf.GGUFWriter(str(tmp), arch.gguf_arch, split_max_tensors=split_max_tensors)
    w.add_name(Path(hf_dir).name)
    for key, value in meta.items():
        _add_value(w, f"{arch.gguf_arch}.{key}", value)
    _add_tokenizer(w, Path(hf_dir), int(cfg["vocab_size"]))

    # (name, shape, encoding, callable producing the data), in file order: the header needs every
    # tensor's shape and type before any data, so the data is made once, when it is written.
    writes = []
    for canon, key in sorted(ckpt.resident_keys.items()):
        name = hf_to_gguf_tensor(arch, canon)
        tr = transform_for(arch, canon)
        split = split_layer_name(canon, "model.layers")
        if alternatives and split and split[1] in arch.alternatives:     # the older layout: a plain rename
            name, tr = f"blk.{split[0]}.{arch.alternatives[split[1]]}", None
        enc = "f32" if name.endswith(_F32_SUFFIXES) else encoding
        if isinstance(tr, Split):      # one HF tensor -> several GGUF tensors by a float transform
            metas = tr.to_gguf(torch.empty(tuple(ckpt.shape(key)), device="meta"), cfg)
            parts = name.split("+")
            makers = _parts_once(lambda key=key, tr=tr: tr.to_gguf(ckpt.get(key).float(), cfg), len(parts))
            for part, m, make in zip(parts, metas, makers):
                writes.append((part, tuple(m.shape), "f32" if part.endswith(_F32_SUFFIXES) else encoding, make))
            continue
        if isinstance(tr, Joined):     # one HF matrix -> several GGUF tensors (rows permuted, then split)
            parts, counts = name.split("+"), tr.rows(cfg)
            makers = _parts_once(lambda key=key, tr=tr, counts=tuple(counts):
                                 tr.to_gguf(ckpt.get(key), cfg).split(counts), len(parts))
            for part, rows, make in zip(parts, counts, makers):
                writes.append((part, (rows,) + tuple(ckpt.shape(key))[1:], enc, make))
            continue
        make = (lambda key=key: ckpt.get(key)) if tr is None else \
            (lambda key=key, tr=tr: tr.to_gguf(ckpt.get(key).float(), cfg))
        shape = tuple(ckpt.shape(key))
        if isinstance(tr, Values):       # (shape only: nothing is read until the tensor is written)
            shape = tuple(tr.to_gguf(torch.empty(shape, device="meta"), cfg).shape)
        writes.append((name, shape, enc, make))
    if ckpt.moe_layers():
        num_experts, _, hidden, inter = ckpt.expert_dims()
        for layer in ckpt.moe_layers():
            def stacked(layer=layer, part=0):
                parts = []
                for e in range(num_experts):
                    gate_up, down = ckpt.expert(layer, e)
                    parts.append((gate_up[:inter], gate_up[inter:], down)[part])
                return torch.stack(parts)
            for part, role in enumerate(("gate", "up", "down")):
                shape = (num_experts, hidden, inter) if role == "down" else (num_experts, inter, hidden)
                writes.append((f"blk.{layer}.{arch.expert_tensors[role]}", shape, encoding,
                               lambda layer=layer, part=part: stacked(layer, part)))

    for name, shape, enc, _ in writes:
        np_shape, np_dtype, nbytes, raw = _info(shape, enc)
        w.add_tensor_info(name, np_shape, np_dtype, nbytes, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for _, _, enc, make in writes:
        w.write_tensor_data(_array(make(), enc))
    w.close()
    if split_max_tensors:
        shards = sorted(out_path.parent.glob(f"{out_path.stem}-*-of-*.gguf"))
        return shards[0] if shards else out_path
    tmp.rename(out_path)
    return out_path
