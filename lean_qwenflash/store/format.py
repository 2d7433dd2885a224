"""Pack format v1: the manifest, the record table and the checksum index. Pure: no file I/O.

A pack directory holds

* ``manifest.json``        – written last; its presence marks a complete pack (see docs/FORMAT.md)
* ``resident.safetensors`` – every tensor that is not a routed expert
* ``experts.bin``          – one record per (layer, expert); record r of layer L starts at
                             ``layers[L].base_offset + r * layers[L].record_bytes``; both multiples
                             of 4096 so a record is one O_DIRECT read
* ``experts.idx``          – ``IDX_MAGIC``, u32 version, u32 count, then one u32 CRC-32C per
                             record (padding included), records in manifest layer order
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field

FORMAT_MAGIC = "lean-qwenflash-pack"
FORMAT_VERSION = 1
ALIGNMENT = 4096
IDX_MAGIC = b"LQFIDX\x00\x01"
IDX_HEADER = struct.Struct("<8sII")

MANIFEST = "manifest.json"
RESIDENT = "resident.safetensors"
EXPERTS = "experts.bin"
EXPERTS_IDX = "experts.idx"
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
    "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model",
)

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
REPACK_HINT = "re-pack the checkpoint with `lean-qwenflash pack HF_DIR OUT_DIR`"


class StoreError(ValueError):
    """A pack that cannot be used; the message says what is wrong and what to do."""


def align_up(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


@dataclass(frozen=True)
class TensorSlot:
    """One projection inside a record."""

    name: str          # "gate_up" [2I, H] or "down" [H, I]
    shape: tuple
    dtype: str
    offset: int        # bytes from the record start

    @property
    def nbytes(self) -> int:
        n = DTYPE_BYTES[self.dtype]
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class LayerRecords:
    layer_idx: int
    num_experts: int
    base_offset: int
    record_bytes: int
    tensors: tuple     # of TensorSlot
    first_record: int  # index of this layer's expert 0 in experts.idx

    def offset(self, expert_id: int) -> int:
        return self.base_offset + expert_id * self.record_bytes

    def to_json(self) -> dict:
        return {
            "layer_idx": self.layer_idx, "num_experts": self.num_experts,
            "base_offset": self.base_offset, "record_bytes": self.record_bytes,
            "tensors": [{"name": t.name, "shape": list(t.shape), "dtype": t.dtype, "offset": t.offset}
                        for t in self.tensors],
        }


def layout_layer(layer_idx: int, num_experts: int, hidden: int, intermediate: int, dtype: str,
                 base_offset: int, first_record: int) -> LayerRecords:
    """Record layout of one MoE layer: gate_up [2I, H] then down [H, I], padded to 4096."""
    gate_up = TensorSlot("gate_up", (2 * intermediate, hidden), dtype, 0)
    down = TensorSlot("down", (hidden, intermediate), dtype, gate_up.nbytes)
    return LayerRecords(layer_idx, num_experts, base_offset, align_up(gate_up.nbytes + down.nbytes),
                        (gate_up, down), first_record)


@dataclass
class Manifest:
    architecture: str
    family: str
    config: dict
    layers: list                 # of LayerRecords, in file order
    experts_bytes: int
    tokenizer_files: list = field(default_factory=list)
    created_by: str = ""

    @property
    def num_records(self) -> int:
        return sum(l.num_experts for l in self.layers)

    def to_json(self) -> dict:
        return {
            "format": FORMAT_MAGIC, "version": FORMAT_VERSION, "alignment": ALIGNMENT,
            "architecture": self.architecture, "family": self.family, "created_by": self.created_by,
            "experts_file": EXPERTS, "experts_bytes": self.experts_bytes,
            "checksum": {"algorithm": "crc32c", "file": EXPERTS_IDX},
            "resident_file": RESIDENT, "tokenizer_files": self.tokenizer_files,
            "layers": [l.to_json() for l in self.layers],
            "config": self.config,
        }


def parse_manifest(doc, where: str) -> Manifest:
    """Validate a decoded manifest.json; raise StoreError saying what is wrong and what to do."""
    def bad(msg: str) -> StoreError:
        return StoreError(f"{where}: {msg}; {REPACK_HINT}")

    if not isinstance(doc, dict) or doc.get("format") != FORMAT_MAGIC:
        got = doc.get("format") if isinstance(doc, dict) else type(doc).__name__
        raise bad(f"not a lean-qwenflash pack manifest (format is {got!r}, expected {FORMAT_MAGIC!r})")
    version = doc.get("version")
    if not isinstance(version, int):
        raise bad(f"manifest has no integer version (got {version!r})")
    if version > FORMAT_VERSION:
        raise StoreError(f"{where}: pack format version {version} is newer than this lean-qwenflash "
                         f"understands (up to {FORMAT_VERSION}); upgrade lean-qwenflash or {REPACK_HINT}")
    if version < FORMAT_VERSION:
        raise bad(f"pack format version {version} is no longer supported (current: {FORMAT_VERSION})")
    if doc.get("alignment") != ALIGNMENT:
        raise bad(f"alignment {doc.get('alignment')!r} is not {ALIGNMENT}")
    try:
        layers, first, end = [], 0, 0
        for l in doc["layers"]:
            tensors = tuple(TensorSlot(t["name"], tuple(int(d) for d in t["shape"]), t["dtype"], int(t["offset"]))
                            for t in l["tensors"])
            rec = LayerRecords(int(l["layer_idx"]), int(l["num_experts"]), int(l["base_offset"]),
                               int(l["record_bytes"]), tensors, first)
            layers.append(rec)
            first += rec.num_experts
            for t in tensors:
                if t.dtype not in DTYPE_BYTES:
                    raise bad(f"layer {rec.layer_idx} tensor {t.name} has unknown dtype {t.dtype!r}")
                if t.offset < 0 or t.offset + t.nbytes > rec.record_bytes:
                    raise bad(f"layer {rec.layer_idx} tensor {t.name} does not fit in its {rec.record_bytes}-byte record")
            if rec.base_offset % ALIGNMENT or rec.record_bytes % ALIGNMENT or rec.record_bytes <= 0:
                raise bad(f"layer {rec.layer_idx} records are not {ALIGNMENT}-byte aligned")
            if rec.base_offset < end:
                raise bad(f"layer {rec.layer_idx} records overlap the previous layer's")
            end = rec.base_offset + rec.num_experts * rec.record_bytes
        manifest = Manifest(
            architecture=str(doc["architecture"]), family=str(doc["family"]), config=dict(doc["config"]),
            layers=layers, experts_bytes=int(doc["experts_bytes"]),
            tokenizer_files=list(doc.get("tokenizer_files", [])), created_by=str(doc.get("created_by", "")),
        )
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, StoreError):
            raise
        raise bad(f"manifest is malformed ({type(e).__name__}: {e})") from None
    if end > manifest.experts_bytes:
        raise bad(f"record table ends at byte {end} but experts_bytes is {manifest.experts_bytes}")
    if len({l.layer_idx for l in layers}) != len(layers):
        raise bad("a layer appears twice in the record table")
    return manifest


def encode_idx(crcs) -> bytes:
    return IDX_HEADER.pack(IDX_MAGIC, FORMAT_VERSION, len(crcs)) + struct.pack(f"<{len(crcs)}I", *crcs)


def decode_idx(data: bytes, expected_count: int, where: str) -> tuple:
    if len(data) < IDX_HEADER.size:
        raise StoreError(f"{where}: checksum index is truncated; {REPACK_HINT}")
    magic, version, count = IDX_HEADER.unpack_from(data)
    if magic != IDX_MAGIC or version != FORMAT_VERSION:
        raise StoreError(f"{where}: not a v{FORMAT_VERSION} checksum index; {REPACK_HINT}")
    if count != expected_count or len(data) != IDX_HEADER.size + 4 * count:
        raise StoreError(f"{where}: checksum index lists {count} records ({len(data)} bytes) but the manifest "
                         f"has {expected_count}; {REPACK_HINT}")
    return struct.unpack_from(f"<{count}I", data, IDX_HEADER.size)
