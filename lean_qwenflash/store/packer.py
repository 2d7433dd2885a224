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
from ..quant import get_encoding
from ..quant.floats import BY_DTYPE_NAME, DTYPE_NAME
from ..quant import row_encoding_error
from ..quant.presets import PRESETS, expert_encodings, resident_encoding, with_fallback
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


def plan_records(moe_layers, num_experts: int, hidden: int, inter: int, quant, float_encoding: str):
    """The record table for ``quant`` (a preset, or None: every projection in ``float_encoding``):
    (layers, experts_bytes, notes), where notes name the projections that fell back to float."""
    shapes = {"gate_up": (2 * inter, hidden), "down": (hidden, inter)}
    layers, offset, first, fallbacks = [], 0, 0, {}
    for i, layer_idx in enumerate(moe_layers):
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


def pack(hf_dir, out_dir, dtype: str | None = None, force: bool = False, progress: bool = True,
         quant: str | None = None) -> fmt.Manifest:
    """Pack ``hf_dir`` into ``out_dir``; returns the manifest. ``dtype`` (float32, float16,
    bfloat16) converts the routed experts; by default they keep the checkpoint's dtype. ``quant``
    (a preset of :mod:`lean_qwenflash.quant.presets`: q4_k_m, q4_k, q5_k, q6_k, q8_0, bf16, ...)
    encodes them instead; projections a block encoding cannot hold stay in the float dtype."""
    ckpt = HFCheckpoint(hf_dir)
    out_dir = Path(out_dir).resolve()
    if out_dir.exists() and not force:
        raise FileExistsError(f"{out_dir} already exists; choose another output directory or pass --force to replace it")
    if Path(hf_dir).resolve() == out_dir:
        raise ValueError("the output directory must differ from the checkpoint directory")
    ckpt.check_experts()
    if dtype is not None and dtype not in TORCH_DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(TORCH_DTYPES)}; got {dtype!r}")
    if quant is not None and quant not in PRESETS:
        raise ValueError(f"--quant must be one of {', '.join(PRESETS)}; got {quant!r}")
    expert_dtype = TORCH_DTYPES[dtype] if dtype else ckpt.expert_dtype()
    float_encoding = BY_DTYPE_NAME[TORCH_NAMES[expert_dtype]]
    if quant in DTYPE_NAME and dtype and quant != float_encoding:
        raise ValueError(f"--quant {quant} and --dtype {dtype} disagree; give one of them")

    num_experts, _, hidden, inter = ckpt.expert_dims()
    layers, offset, notes = plan_records(ckpt.moe_layers(), num_experts, hidden, inter, quant, float_encoding)
    resident = sorted(ckpt.resident_keys.items())
    resident_bytes = sum(ckpt.nbytes(k) for _, k in resident)   # progress counts source bytes
    bar = _progress(offset + resident_bytes, progress)

    tmp = out_dir.with_name(out_dir.name + ".tmp")
    if tmp.exists():
        print(f"removing {tmp}, left over from an interrupted pack", file=sys.stderr)
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)

    # Routed experts: one record at a time.
    crcs = []
    with open(tmp / fmt.EXPERTS, "wb") as f:
        for rec in layers:
            buf = bytearray(rec.record_bytes)  # zero padding stays zero; tensors overwrite the rest
            view = memoryview(buf)
            encoders = [get_encoding(slot.encoding) for slot in rec.tensors]
            for e in range(rec.num_experts):
                gate_up, down = ckpt.expert(rec.layer_idx, e)
                for slot, enc, t in zip(rec.tensors, encoders, (gate_up, down)):
                    data = enc.quantize(t).contiguous().view(torch.uint8).reshape(-1).numpy()
                    view[slot.offset:slot.offset + slot.nbytes] = data
                crcs.append(crc32c(buf))
                f.write(buf)
                bar.update(rec.record_bytes)
        f.flush()
        os.fsync(f.fileno())
    (tmp / fmt.EXPERTS_IDX).write_bytes(fmt.encode_idx(crcs))

    # Resident tensors: streamed into one safetensors file under their canonical names; matrices
    # --quant encodes are stored as uint8 block rows (the manifest's `resident` says how to read them).
    resident_enc, resident_fallback = {}, {}
    for canon, k in resident:
        enc = resident_encoding(quant, canon) if quant else None
        shape = tuple(ckpt.shape(k))
        if enc and len(shape) == 2:
            why = row_encoding_error(get_encoding(enc), shape[1])
            if why:
                resident_fallback.setdefault(why, []).append(canon)
                enc = None
        resident_enc[canon] = enc if len(shape) == 2 else None
    for why, names in resident_fallback.items():
        notes.append(f"resident {why}; kept float: {', '.join(names[:4])}" + (" ..." if len(names) > 4 else ""))
    entries = []
    for canon, k in resident:
        enc = resident_enc[canon]
        shape = tuple(ckpt.shape(k))
        entries.append((canon, (shape[0], get_encoding(enc).row_bytes(shape[1])), torch.uint8) if enc
                       else (canon, shape, ckpt.dtype(k)))
    writer = StreamingSafetensorsWriter(tmp / fmt.RESIDENT, entries)
    resident_meta = []
    for (canon, k), (_, stored_shape, dt) in zip(resident, entries):
        t = ckpt.get(k)
        enc = resident_enc[canon]
        data = get_encoding(enc).quantize(t).contiguous() if enc else t
        writer.write(canon, data)
        bar.update(t.nbytes)
        resident_meta.append(fmt.ResidentTensor(canon, tuple(ckpt.shape(k)), enc or BY_DTYPE_NAME[TORCH_NAMES[dt]],
                                                data.nbytes))
    writer.close()

    copied = []
    for name in fmt.TOKENIZER_FILES:
        src = Path(hf_dir) / name
        if src.is_file():
            shutil.copyfile(src, tmp / name)
            copied.append(name)
    for name in [fmt.EXPERTS_IDX] + copied:
        with open(tmp / name, "rb") as fh:
            os.fsync(fh.fileno())

    manifest = fmt.Manifest(architecture=ckpt.names.architecture, family=ckpt.names.family, config=ckpt.config,
                            layers=layers, experts_bytes=offset, tokenizer_files=copied,
                            created_by=f"lean-qwenflash {__version__}", notes=notes,
                            resident=resident_meta)
    with open(tmp / fmt.MANIFEST, "w") as fh:
        json.dump(manifest.to_json(), fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    _fsync_dir(tmp)
    bar.close()

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


__all__ = ["pack", "CheckpointError"]
