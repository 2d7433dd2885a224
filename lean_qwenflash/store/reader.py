"""`ExpertStore`: a validated, read-only pack, read through the native engine.

Records are read with O_DIRECT straight into caller buffers (cache slots); each record is checked
against its CRC-32C the first time it is read (``verify_checksums``), which catches a corrupted
or half-copied ``experts.bin`` without paying the checksum on every later read.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import torch

from ..io_engine import AlignedBuffer, IoError, crc32c, open_engine
from . import format as fmt
from ..quant import QuantCols, QuantRows, QuantTensor, get_encoding


class ChecksumError(fmt.StoreError):
    def __init__(self, msg: str, layer_idx: int, expert_id: int):
        super().__init__(msg)
        self.layer_idx = layer_idx
        self.expert_id = expert_id


def tensor_view(t: fmt.TensorSlot, raw: torch.Tensor):
    """Zero-copy view of one projection of a record: a float tensor of its shape, or a
    QuantTensor over its raw rows."""
    enc = get_encoding(t.encoding)
    data = raw[t.offset:t.offset + t.nbytes]
    if enc.is_float:
        return data.view(enc.torch_dtype).view(t.shape)
    return QuantTensor(data.view(t.shape[0], -1), enc, t.shape)


def record_views(rec: fmt.LayerRecords, raw: torch.Tensor):
    """Zero-copy views (gate_up, down) of one record held in ``raw``, a uint8 tensor that starts
    at the record (a buffer, a cache slot, a device row)."""
    return fmt.ExpertWeights(*(tensor_view(t, raw) for t in rec.tensors))


class ExpertStore:
    """A pack directory opened for reading. Use :meth:`open`."""

    def __init__(self, path: Path, manifest: fmt.Manifest, crcs: tuple, engine, verify_checksums: bool):
        self.path = path
        self.manifest = manifest
        self.config = manifest.config
        self._crcs = crcs
        self.engine = engine
        self.verify_checksums = verify_checksums
        self._verified = bytearray(manifest.num_records)
        self._layers = {l.layer_idx: l for l in manifest.layers}

    # -- opening ------------------------------------------------------------------------------
    @classmethod
    def open(cls, path, engine: str = "auto", queue_depth: int = 32, verify_checksums: bool = True,
             num_threads: int = 0) -> "ExpertStore":
        path = Path(path)
        if not path.is_dir():
            raise fmt.StoreError(f"{path} does not exist or is not a directory; {fmt.REPACK_HINT}")
        mpath = path / fmt.MANIFEST
        if not mpath.is_file():
            hint = " (it looks like an interrupted pack)" if path.name.endswith(".tmp") else ""
            raise fmt.StoreError(f"{path} is not a complete lean-qwenflash pack: no {fmt.MANIFEST}{hint}; "
                                 f"{fmt.REPACK_HINT}")
        try:
            doc = json.loads(mpath.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise fmt.StoreError(f"{mpath} is not valid JSON ({e}); {fmt.REPACK_HINT}") from None
        manifest = fmt.parse_manifest(doc, str(path))
        experts = path / fmt.EXPERTS
        if not experts.is_file():
            raise fmt.StoreError(f"{path}: {fmt.EXPERTS} is missing; {fmt.REPACK_HINT}")
        size = experts.stat().st_size
        if size != manifest.experts_bytes:
            what = "truncated" if size < manifest.experts_bytes else "longer than its manifest says"
            raise fmt.StoreError(f"{experts} is {size} bytes but the manifest expects {manifest.experts_bytes}: "
                                 f"the file is {what} (an incomplete copy?); {fmt.REPACK_HINT}")
        if not (path / fmt.RESIDENT).is_file():
            raise fmt.StoreError(f"{path}: {fmt.RESIDENT} is missing; {fmt.REPACK_HINT}")
        idx = path / fmt.EXPERTS_IDX
        if not idx.is_file():
            raise fmt.StoreError(f"{path}: {fmt.EXPERTS_IDX} is missing; {fmt.REPACK_HINT}")
        crcs = fmt.decode_idx(idx.read_bytes(), manifest.num_records, str(idx))
        eng = open_engine(experts, engine=engine, queue_depth=queue_depth, num_threads=num_threads) \
            if manifest.experts_bytes else None
        return cls(path, manifest, crcs, eng, verify_checksums)

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- layout ---------------------------------------------------------------------------------
    def layer(self, layer_idx: int) -> fmt.LayerRecords:
        try:
            return self._layers[layer_idx]
        except KeyError:
            raise KeyError(f"layer {layer_idx} has no routed experts in {self.path}") from None

    @property
    def moe_layers(self) -> list[int]:
        return list(self._layers)

    def record_bytes(self, layer_idx: int) -> int:
        return self.layer(layer_idx).record_bytes

    @property
    def max_record_bytes(self) -> int:
        return max((l.record_bytes for l in self.manifest.layers), default=0)

    def _check_expert(self, layer_idx: int, expert_id: int) -> fmt.LayerRecords:
        rec = self.layer(layer_idx)
        if not 0 <= expert_id < rec.num_experts:
            raise IndexError(f"expert {expert_id} out of range for layer {layer_idx} ({rec.num_experts} experts)")
        return rec

    def tag(self, layer_idx: int, expert_id: int) -> int:
        """Request tag of a record: its index in experts.idx (errors carry it)."""
        return self._check_expert(layer_idx, expert_id).first_record + expert_id

    def describe_tag(self, tag: int) -> str:
        for l in self.manifest.layers:
            if l.first_record <= tag < l.first_record + l.num_experts:
                return f"layer {l.layer_idx} expert {tag - l.first_record}"
        return f"record {tag}"

    # -- reading --------------------------------------------------------------------------------
    def submit(self, layer_idx: int, expert_id: int, dest, dest_offset: int = 0, urgent: bool = True) -> int:
        """Start reading one record into ``dest[dest_offset:]``; returns a request id for :meth:`finish`."""
        rec = self._check_expert(layer_idx, expert_id)
        return self.engine.submit(dest, dest_offset, rec.offset(expert_id), rec.record_bytes,
                                  self.tag(layer_idx, expert_id), urgent)

    def finish(self, request_id: int, layer_idx: int, expert_id: int, dest, dest_offset: int = 0) -> float:
        """Wait for a read started by :meth:`submit`, verify its checksum if not yet verified, and
        return the read's service time in seconds."""
        try:
            service_s = self.engine.wait(request_id)
        except IoError as e:
            err = IoError(e.errno, f"{e.strerror} [{self.describe_tag(e.tag)} of {self.path}]")
            err.tag = e.tag
            raise err from e
        self.verify(layer_idx, expert_id, dest, dest_offset)
        return service_s

    def verify(self, layer_idx: int, expert_id: int, dest, dest_offset: int = 0) -> None:
        if not self.verify_checksums:
            return
        tag = self.tag(layer_idx, expert_id)
        if self._verified[tag]:
            return
        n = self.record_bytes(layer_idx)
        got = crc32c(memoryview(dest)[dest_offset:dest_offset + n])
        if got != self._crcs[tag]:
            raise ChecksumError(
                f"{self.path / fmt.EXPERTS}: layer {layer_idx} expert {expert_id} failed its checksum "
                f"(crc32c {got:08x}, expected {self._crcs[tag]:08x}): the record is corrupted; "
                f"re-copy the pack or {fmt.REPACK_HINT}", layer_idx, expert_id)
        self._verified[tag] = 1

    def read(self, items: Sequence[tuple], urgent: bool = True) -> None:
        """Read many records: ``items`` of (layer_idx, expert_id, dest, dest_offset). All are in
        flight together (up to the queue depth); every one finishes before this returns."""
        ids = [self.submit(l, e, d, o, urgent) for l, e, d, o in items]
        first = None
        for rid, (l, e, d, o) in zip(ids, items):
            try:
                self.finish(rid, l, e, d, o)
            except (IoError, ChecksumError) as err:
                first = first or err
        if first is not None:
            raise first

    def expert_views(self, layer_idx: int, dest, dest_offset: int = 0):
        """Zero-copy torch views (gate_up, down) of a record that sits in ``dest`` (a buffer)."""
        rec = self.layer(layer_idx)
        size = max(t.offset + t.nbytes for t in rec.tensors)
        return record_views(rec, torch.frombuffer(dest, dtype=torch.uint8, count=size, offset=dest_offset))

    def read_expert(self, layer_idx: int, expert_id: int):
        """One expert in a fresh aligned buffer (tests, tools; the cache uses its own slots)."""
        buf = AlignedBuffer(self.record_bytes(layer_idx))
        self.read([(layer_idx, expert_id, buf, 0)])
        return self.expert_views(layer_idx, buf)

    def read_layer(self, layer_idx: int):
        """Every record of one layer, checksums checked as by :meth:`read`, in a fresh aligned buffer
        (expert e at ``e * record_bytes``); returns the buffer (`inspect --verify-all` just drops it)."""
        rec = self.layer(layer_idx)
        buf = AlignedBuffer(rec.record_bytes * rec.num_experts)
        self.read([(layer_idx, e, buf, e * rec.record_bytes) for e in range(rec.num_experts)])
        return buf

    def load_resident(self, device="cpu", dtype=None) -> dict:
        """Every resident tensor (attention, DeltaNet, norms, routers, shared experts, head): float
        tensors in ``dtype``, and QuantTensor for matrices the packer encoded (``pack --quant``)."""
        from safetensors.torch import load_file
        tensors = load_file(str(self.path / fmt.RESIDENT), device=str(device))
        described = {t.name: t for t in self.manifest.resident}
        out = {}
        for k, v in tensors.items():
            q = described.get(k)
            if k.endswith((fmt.ROW_ORDER_SUFFIX, fmt.COL_ORDER_SUFFIX)) and k.rsplit(".", 1)[0] in described:
                continue           # consumed with its matrix
            if q is not None and q.encoding == fmt.MIXED:     # row groups in different encodings
                parts, at = [], 0
                for (enc, rows), (_, n) in zip(q.parts, q.part_bytes()):
                    parts.append(QuantTensor(v[at:at + n].view(rows, -1), get_encoding(enc), (rows, int(q.shape[1]))))
                    at += n
                out[k] = QuantRows(tuple(parts), tensors[k + fmt.ROW_ORDER_SUFFIX], tuple(q.shape))
            elif q is not None and not get_encoding(q.encoding).is_float:
                out[k] = QuantTensor(v, get_encoding(q.encoding), tuple(q.shape))   # block rows, for the kernels
                if q.col_order:
                    order = tensors.get(k + fmt.COL_ORDER_SUFFIX)
                    if order is None or tuple(order.shape) != (q.shape[1],) or order.dtype != torch.int64 or \
                            not torch.equal(torch.sort(order.cpu()).values, torch.arange(q.shape[1])):
                        raise fmt.StoreError(f"{self.path}: resident tensor {k} says col_order, but "
                                             f"{k}{fmt.COL_ORDER_SUFFIX} is missing or not a permutation of its "
                                             f"{q.shape[1]} columns; {fmt.REPACK_HINT}")
                    out[k] = QuantCols(out[k], order)
            else:
                out[k] = v.to(dtype) if dtype is not None else v
        return out
