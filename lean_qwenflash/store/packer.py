"""`lean-qwenflash pack`: Hugging Face checkpoint -> pack directory (see store/format.py).

The packer streams: it holds one expert (or one resident tensor) in memory at a time, so a
checkpoint larger than RAM packs fine. It writes into ``OUT_DIR.tmp``, fsyncs every file, writes
the manifest last and renames the directory into place, so an interrupted pack never looks valid.
"""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch

from .. import __version__
from ..io_engine import crc32c
from . import format as fmt
from ..quant import QuantCols, get_encoding
from ..quant.floats import BY_DTYPE_NAME, DTYPE_NAME
from ..quant.presets import FLOAT_PRESETS, check_preset, expert_encodings, fallback, resident_encoding, with_fallback
from .checkpoint import (TORCH_DTYPES, TORCH_NAMES, CheckpointError, HFCheckpoint,
                         StreamingSafetensorsWriter)


def _fsync_dir(path: Path) -> None:
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _progress(total_bytes: int, enabled: bool):
    try:
        from tqdm import tqdm
    except ImportError:  # pragma: no cover
        enabled = False
    if not enabled:
        class _Null:
            def update(self, n):
                pass

            def close(self):
                pass
        return _Null()
    return tqdm(total=total_bytes, unit="B", unit_scale=True, unit_divisor=1024, desc="packing",
                file=sys.stderr, dynamic_ncols=True)


def plan_records(moe_layers, num_experts: int, hidden: int, inter: int, quant, float_encoding: str,
                 stored=None):
    """The record table for ``quant`` (a preset, or None: every projection in ``float_encoding``,
    or as ``stored(layer_idx)`` says: the encodings the source already holds):
    (layers, experts_bytes, notes), where notes name the projections that fell back to another
    encoding (``float_encoding`` where no block type fits) and why."""
    shapes = {"gate_up": (2 * inter, hidden), "down": (hidden, inter)}
    layers, offset, first, fallbacks = [], 0, 0, {}
    for i, layer_idx in enumerate(moe_layers):
        if stored is not None:
            encodings = stored(layer_idx)
        else:
            encodings = expert_encodings(quant, i, len(moe_layers)) if quant else \
                {"gate_up": float_encoding, "down": float_encoding}
            encodings, why = with_fallback(encodings, shapes, float_encoding)
            for n in why:
                fallbacks.setdefault(n, []).append(layer_idx)
        rec = fmt.layout_layer(layer_idx, num_experts, hidden, inter, encodings, offset, first)
        layers.append(rec)
        offset += rec.num_experts * rec.record_bytes
        first += rec.num_experts
    notes = [f"{why} (layers {', '.join(map(str, ls))})" for why, ls in fallbacks.items()]
    return layers, offset, notes


def open_checkpoint(path):
    """The checkpoint at ``path``: an HF directory, or a GGUF file / first shard / shard directory."""
    from .gguf_file import GGUFCheckpoint, is_gguf
    return GGUFCheckpoint(path) if is_gguf(path) else HFCheckpoint(path)


def _stored_resident(ckpt) -> tuple[dict, list]:
    """For a GGUF source packed as stored: {canonical name: encoding or None (float)} and notes.
    Block-quantized matrices keep their encoding (every 2-D resident weight of our families is a
    linear layer's or the embedding table, which the kernels read encoded; the loader checks);
    types we have no kernel for, and matrices a value transform must change, are dequantized to
    f32, and said. A matrix whose columns the file reorders (``PermuteCols``) keeps its rows as
    stored and the column order (``fmt.COL_ORDER_SUFFIX``)."""
    out, dequantized = {}, {}
    for canon, k in ckpt.resident_keys.items():
        enc = ckpt.stored_encoding(k)
        out[canon] = None
        if enc is None and ckpt.stored_parts(k):
            out[canon] = fmt.MIXED       # row groups kept in their encodings (QuantRows)
        elif enc is None:
            why = "(parts in different encodings)" if "+" in k else "(no kernel for it)"
            dequantized.setdefault(f"{ckpt.type_name(k)} {why}", []).append(canon)
        elif not get_encoding(enc).is_float:
            if len(ckpt.shape(k)) == 2 and canon.endswith(".weight") and transform_kind(ckpt, canon) != "values":
                out[canon] = enc
            else:
                dequantized.setdefault(f"{enc} (not a matrix the kernels read)", []).append(canon)
    notes = [f"resident {why}: dequantized to f32: {', '.join(sorted(names)[:4])}" + (" ..." if len(names) > 4 else "")
             for why, names in dequantized.items()]
    return out, notes


def transform_kind(ckpt, canon: str):
    """"cols" for a column permutation (kept encoded, with its order), "values" for another float
    transform (needs float data), else None."""
    from .gguf_names import PermuteCols, Values, transform_for
    tr = transform_for(ckpt.arch, canon)
    return "cols" if isinstance(tr, PermuteCols) else "values" if isinstance(tr, Values) else None


def pack(hf_dir, out_dir, dtype: str | None = None, force: bool = False, progress: bool = True,
         quant: str | None = None, tokenizer_dir=None) -> fmt.Manifest:
    """Pack ``hf_dir`` into ``out_dir``; returns the manifest.

    ``hf_dir`` is a Hugging Face checkpoint directory, or a GGUF file (first shard, or a directory
    of shards). ``dtype`` (float32, float16, bfloat16) converts the routed experts; by default they
    keep the checkpoint's dtype, and a GGUF file's experts and quantized matrices are copied as
    stored, byte for byte, and so are a GPT-OSS checkpoint's MXFP4 experts (as the mxfp4 encoding).
    ``quant`` (a preset of :mod:`lean_qwenflash.quant.presets`: q4_k_m, q4_k, q3_k_m, iq4_xs,
    mxfp4, q8_0, bf16, ...) encodes them instead; projections a block encoding cannot hold take
    the nearest block type that can, else bf16 (or ``dtype``). ``tokenizer_dir`` takes the tokenizer files from an HF
    directory instead of the checkpoint (or the GGUF metadata)."""
    src = Path(hf_dir)
    out_dir = Path(out_dir).resolve()
    if out_dir.exists() and not force:
        raise FileExistsError(f"{out_dir} already exists; choose another output directory or pass --force to replace it")
    if src.resolve() == out_dir:
        raise ValueError("the output directory must differ from the checkpoint directory")
    ckpt = open_checkpoint(src)
    ckpt.check_experts()
    if dtype is not None and dtype not in TORCH_DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(TORCH_DTYPES)}; got {dtype!r}")
    if quant is not None:
        check_preset(quant)
    expert_dtype = TORCH_DTYPES[dtype] if dtype else ckpt.expert_dtype()
    float_encoding = BY_DTYPE_NAME[TORCH_NAMES[expert_dtype]]
    if quant in DTYPE_NAME and dtype and quant != float_encoding:
        raise ValueError(f"--quant {quant} and --dtype {dtype} disagree; give one of them")
    if quant is not None and quant not in FLOAT_PRESETS and dtype is None and float_encoding == "f32":
        float_encoding = "bf16"      # rows no block type holds: the default compute dtype, not 4 bytes a value
    # A GGUF source keeps its encodings unless --quant/--dtype asks for a conversion; so do a
    # checkpoint's block-encoded experts (GPT-OSS's MXFP4), also under --quant of their own encoding.
    as_stored = ckpt.is_gguf and quant is None and dtype is None
    encoded = None if ckpt.is_gguf else ckpt.experts_encoded
    experts_as_stored = as_stored or (encoded is not None and dtype is None and quant in (None, encoded))

    num_experts, _, hidden, inter = ckpt.expert_dims()
    layers, offset, notes = plan_records(ckpt.moe_layers(), num_experts, hidden, inter, quant, float_encoding,
                                         stored=ckpt.expert_encodings if experts_as_stored else None)
    if encoded is not None:
        notes.append(f"routed experts stored as {encoded} in the checkpoint: " +
                     (f"packed byte for byte as the {encoded} encoding" if experts_as_stored else
                      f"dequantized (exactly) and re-encoded as {quant or float_encoding}"))
    resident = sorted(ckpt.resident_keys.items())
    if as_stored:
        stored_enc, stored_notes = _stored_resident(ckpt)
    resident_bytes = sum(ckpt.nbytes(k) for _, k in resident)   # progress counts source bytes
    bar = _progress(offset + resident_bytes, progress)

    tmp = out_dir.with_name(out_dir.name + ".tmp")
    if tmp.exists():
        print(f"removing {tmp}, left over from an interrupted pack", file=sys.stderr)
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    try:
        return _write_pack(ckpt, src, tmp, out_dir, layers, offset, notes, resident, quant, as_stored,
                           experts_as_stored, stored_enc if as_stored else None, stored_notes if as_stored else [],
                           float_encoding, bar, tokenizer_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)     # nothing half-written stays behind
        raise
    finally:
        bar.close()


def _write_pack(ckpt, src, tmp, out_dir, layers, offset, notes, resident, quant, as_stored, experts_as_stored,
                stored_enc, stored_notes, float_encoding, bar, tokenizer_dir) -> fmt.Manifest:
    # Routed experts: one record at a time.
    crcs = []
    with open(tmp / fmt.EXPERTS, "wb") as f:
        for rec in layers:
            buf = bytearray(rec.record_bytes)  # zero padding stays zero; tensors overwrite the rest
            view = memoryview(buf)
            encoders = [get_encoding(slot.encoding) for slot in rec.tensors]
            for e in range(rec.num_experts):
                if experts_as_stored:   # the file's bytes, unchanged (or only rearranged)
                    parts = ckpt.expert_raw(rec.layer_idx, e)
                else:
                    parts = [enc.quantize(t).contiguous().view(torch.uint8).reshape(-1).numpy()
                             for enc, t in zip(encoders, ckpt.expert(rec.layer_idx, e))]
                for slot, data in zip(rec.tensors, parts):
                    if data.size != slot.nbytes:
                        raise CheckpointError(f"internal: layer {rec.layer_idx} expert {e} {slot.name} has "
                                              f"{data.size} bytes, its slot {slot.nbytes}")
                    view[slot.offset:slot.offset + slot.nbytes] = data
                crcs.append(crc32c(buf))
                f.write(buf)
                bar.update(rec.record_bytes)
        f.flush()
        os.fsync(f.fileno())
    (tmp / fmt.EXPERTS_IDX).write_bytes(fmt.encode_idx(crcs))

    # Resident tensors: streamed into one safetensors file under their canonical names; block-encoded
    # matrices are stored as uint8 block rows (the manifest's `resident` says how to read them).
    # A matrix whose rows its preset's block type cannot hold takes the fallback block type, else
    # the pack's float encoding (see quant.presets.fallback).
    resident_enc, resident_fallback, float_dtype = {}, {}, TORCH_DTYPES[DTYPE_NAME[float_encoding]]
    resident_float = {}                  # canonical name -> dtype a fallen-back matrix is stored in
    for canon, k in resident:
        shape = tuple(ckpt.shape(k))
        if as_stored:
            resident_enc[canon] = stored_enc[canon]
            continue
        enc = resident_encoding(quant, canon) if quant else None
        if enc and len(shape) == 2:
            got, why = fallback(enc, shape[1], float_encoding)
            if why:
                resident_fallback.setdefault(f"{why}; stored as {got}", []).append(canon)
                if get_encoding(got).is_float:
                    resident_float[canon] = float_dtype
                    got = None
            enc = got
        resident_enc[canon] = enc if len(shape) == 2 else None
    for why, names in resident_fallback.items():
        notes.append(f"resident {why}: {', '.join(names[:4])}" + (" ..." if len(names) > 4 else ""))
    notes.extend(stored_notes)
    notes.extend(ckpt.source_notes)
    for prefix, count in ckpt.skipped.items():
        notes.append(f"skipped {count} tensor{'s' if count > 1 else ''} under {prefix} (not used by the runtime)")
    if ckpt.skipped:
        notes.extend(ckpt.family.notes)
    entries = []
    for canon, k in resident:
        enc = resident_enc[canon]
        shape = tuple(ckpt.shape(k))
        if enc == fmt.MIXED:
            entries.append((canon, (ckpt.nbytes(k),), torch.uint8))
            entries.append((canon + fmt.ROW_ORDER_SUFFIX, (shape[0],), torch.int64))
        else:
            entries.append((canon, (shape[0], get_encoding(enc).row_bytes(shape[1])), torch.uint8) if enc
                           else (canon, shape, resident_float.get(canon, ckpt.dtype(k))))
            if as_stored and enc and transform_kind(ckpt, canon) == "cols":
                entries.append((canon + fmt.COL_ORDER_SUFFIX, (shape[1],), torch.int64))
    writer = StreamingSafetensorsWriter(tmp / fmt.RESIDENT, entries)
    resident_meta = []
    dtypes = {name: dt for name, _, dt in entries}
    for canon, k in resident:
        enc, dt = resident_enc[canon], dtypes[canon]
        if enc == fmt.MIXED:
            rows = ckpt.get_rows(k)
            writer.write(canon, torch.cat([p.raw.reshape(-1) for p in rows.parts]))
            writer.write(canon + fmt.ROW_ORDER_SUFFIX, rows.order)
            bar.update(ckpt.nbytes(k))
            resident_meta.append(fmt.ResidentTensor(canon, tuple(rows.shape), fmt.MIXED, rows.nbytes,
                                                    tuple((p.encoding.name, p.shape[0]) for p in rows.parts)))
            continue
        if as_stored and enc:
            q = ckpt.get_encoded(k)               # the file's rows, unchanged (permuted where the table says)
            if isinstance(q, QuantCols):          # ... and the column order they keep
                writer.write(canon, q.inner.raw)
                writer.write(canon + fmt.COL_ORDER_SUFFIX, q.order)
                bar.update(ckpt.nbytes(k))
                resident_meta.append(fmt.ResidentTensor(canon, tuple(q.shape), enc, q.nbytes, col_order=True))
                continue
            data = q.raw
        else:
            t = ckpt.get(k)
            data = get_encoding(enc).quantize(t).contiguous() if enc else t.to(dt)
        writer.write(canon, data)
        bar.update(ckpt.nbytes(k))
        resident_meta.append(fmt.ResidentTensor(canon, tuple(ckpt.shape(k)), enc or BY_DTYPE_NAME[TORCH_NAMES[dt]],
                                                data.nbytes))
    writer.close()

    copied = _tokenizer_files(ckpt, src, tmp, tokenizer_dir, notes)
    for name in [fmt.EXPERTS_IDX] + copied:
        with open(tmp / name, "rb") as fh:
            os.fsync(fh.fileno())

    manifest = fmt.Manifest(architecture=ckpt.architecture, family=ckpt.family.name, config=ckpt.config,
                            layers=layers, experts_bytes=offset, tokenizer_files=copied,
                            created_by=f"lean-qwenflash {__version__}", notes=notes,
                            resident=resident_meta)
    with open(tmp / fmt.MANIFEST, "w") as fh:
        json.dump(manifest.to_json(), fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    _fsync_dir(tmp)

    if out_dir.exists():  # --force: swap in the new pack, then drop the old one
        old = out_dir.with_name(out_dir.name + ".old")
        if old.exists():
            shutil.rmtree(old)
        os.rename(out_dir, old)
        os.rename(tmp, out_dir)
        shutil.rmtree(old)
    else:
        os.rename(tmp, out_dir)
    _fsync_dir(out_dir.parent)
    return manifest


def _tokenizer_files(ckpt, src: Path, tmp: Path, tokenizer_dir, notes: list) -> list:
    """Tokenizer files into the pack: from ``tokenizer_dir`` when given, else from the HF checkpoint
    directory, else converted from the GGUF metadata (a conversion we cannot do is a note, not a
    failure: the pack runs from token ids, and ``--tokenizer HF_DIR`` adds one)."""
    source = Path(tokenizer_dir) if tokenizer_dir else (None if ckpt.is_gguf else src)
    if tokenizer_dir and not (source / "tokenizer.json").is_file():
        raise CheckpointError(f"--tokenizer {source}: no tokenizer.json there (pass an HF model directory)")
    if source is not None:
        copied = []
        for name in fmt.TOKENIZER_FILES:
            if (source / name).is_file():
                shutil.copyfile(source / name, tmp / name)
                copied.append(name)
        return copied
    from .gguf_tokenizer import TokenizerConversionError, write_tokenizer
    try:
        return write_tokenizer(ckpt.metadata, tmp)
    except TokenizerConversionError as e:
        notes.append(f"no tokenizer: {e}; add one with --tokenizer HF_DIR")
        print(f"warning: {e}; the pack has no tokenizer (pass --tokenizer HF_DIR to add one)", file=sys.stderr)
        return []


__all__ = ["pack", "open_checkpoint", "CheckpointError"]
