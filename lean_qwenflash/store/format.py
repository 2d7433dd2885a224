"""Pack format v3: the manifest, the record table and the checksum index. Pure: no file I/O.

A pack directory holds

* ``manifest.json``        – written last; its presence marks a complete pack (see docs/FORMAT.md)
* ``resident.safetensors`` – every tensor that is not a routed expert
* ``experts.bin``          – one record per (layer, expert); record r of layer L starts at
                             ``layers[L].base_offset + r * layers[L].record_bytes``; both multiples
                             of 4096 so a record is one O_DIRECT read
* ``experts.idx``          – ``IDX_MAGIC``, u32 version, u32 count, then one u32 CRC-32C per
                             record (padding included), records in manifest layer order

Every tensor carries an ``encoding`` (see :mod:`lean_qwenflash.quant`: f32, f16, bf16, q8_0, q4_0,
q4_k, q5_k, q6_k) and its stored ``nbytes``; a record may mix encodings. Version 1 packs (float
records described by a torch ``dtype``) are still read: they parse into the same structures. A pack
is written as the oldest version that holds it: v3 only when a resident matrix keeps a column order
(``col_order``), which a v2 reader would ignore and compute wrong, so it refuses v3 instead.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from ..quant import ENCODINGS, get_encoding
from ..quant.floats import BY_DTYPE_NAME

FORMAT_MAGIC = "lean-qwenflash-pack"
FORMAT_VERSION = 3
READABLE_VERSIONS = (1, 2, 3)   # v1: float records described by "dtype"; read as the same structures
COL_ORDER_VERSION = 3           # the first version with resident col_order matrices
ALIGNMENT = 4096
IDX_MAGIC = b"LQFIDX\x00\x01"
IDX_VERSION = 1
IDX_HEADER = struct.Struct("<8sII")

MANIFEST = "manifest.json"
RESIDENT = "resident.safetensors"
EXPERTS = "experts.bin"
EXPERTS_IDX = "experts.idx"
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
    "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt", "tokenizer.model",
)

REPACK_HINT = "re-pack the checkpoint with `lean-qwenflash pack HF_DIR OUT_DIR`"


class ExpertWeights(NamedTuple):
    """One record's projections as views: each a float tensor or a ``QuantTensor`` of block rows."""

    gate_up: Any      # [2I, H]: gate rows then up rows
    down: Any         # [H, I]


class StoreError(ValueError):
    """A pack that cannot be used; the message says what is wrong and what to do."""


def align_up(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


@dataclass(frozen=True)
class TensorSlot:
    """One projection inside a record."""

    name: str          # "gate_up" [2I, H] or "down" [H, I]
    shape: tuple       # logical shape (values, not bytes)
    encoding: str      # a name in lean_qwenflash.quant.ENCODINGS
    offset: int        # bytes from the record start

    @property
    def nbytes(self) -> int:
        return get_encoding(self.encoding).nbytes(self.shape)

    def to_json(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "encoding": self.encoding,
                "nbytes": self.nbytes, "offset": self.offset}


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
            "tensors": [t.to_json() for t in self.tensors],
        }


# Block rows start on this boundary inside a record (the native kernels load 32 bytes at a time
# from any address, so this is for tidiness of the layout, not correctness).
TENSOR_ALIGNMENT = 64


def layout_layer(layer_idx: int, num_experts: int, hidden: int, intermediate: int, encoding,
                 base_offset: int, first_record: int) -> LayerRecords:
    """Record layout of one MoE layer: gate_up [2I, H] then down [H, I], padded to 4096.
    ``encoding`` is one encoding name for both, or ``{"gate_up": .., "down": ..}``."""
    enc = encoding if isinstance(encoding, dict) else {"gate_up": encoding, "down": encoding}
    gate_up = TensorSlot("gate_up", (2 * intermediate, hidden), enc["gate_up"], 0)
    down_at = -(-gate_up.nbytes // TENSOR_ALIGNMENT) * TENSOR_ALIGNMENT
    down = TensorSlot("down", (hidden, intermediate), enc["down"], down_at)
    return LayerRecords(layer_idx, num_experts, base_offset, align_up(down.offset + down.nbytes),
                        (gate_up, down), first_record)


MIXED = "mixed"          # a resident matrix whose row groups have different encodings (see parts)
ROW_ORDER_SUFFIX = ".row_order"
COL_ORDER_SUFFIX = ".col_order"


@dataclass(frozen=True)
class ResidentTensor:
    """One tensor of resident.safetensors as the manifest describes it. A ``mixed`` matrix is
    stored as its parts' block rows one after another (uint8, flat) plus an int64 tensor
    ``{name}.row_order``: row i of the matrix is stacked row row_order[i]. A block-encoded matrix
    with ``col_order`` (v3) has an int64 tensor ``{name}.col_order`` [cols]: stored column j is
    column col_order[j] of the matrix (``quant.QuantCols``)."""

    name: str
    shape: tuple
    encoding: str
    nbytes: int
    parts: tuple = ()      # ((encoding, rows), ...) for MIXED
    col_order: bool = False

    def part_bytes(self) -> list:
        return [(enc, rows * get_encoding(enc).row_bytes(int(self.shape[-1]))) for enc, rows in self.parts]

    def to_json(self) -> dict:
        out = {"name": self.name, "shape": list(self.shape), "encoding": self.encoding, "nbytes": self.nbytes}
        if self.parts:
            out["parts"] = [{"encoding": e, "rows": r} for e, r in self.parts]
        if self.col_order:
            out["col_order"] = True
        return out


@dataclass
class Manifest:
    architecture: str
    family: str
    config: dict
    layers: list                 # of LayerRecords, in file order
    experts_bytes: int
    tokenizer_files: list = field(default_factory=list)
    created_by: str = ""
    resident: list = field(default_factory=list)     # of ResidentTensor (empty for v1 packs)
    notes: list = field(default_factory=list)        # what the packer decided (fallback encodings, ...)
    version: int = FORMAT_VERSION

    def encodings(self) -> dict:
        """{tensor name: {encoding: bytes in the pack}} over every record (all experts)."""
        out: dict = {}
        for l in self.layers:
            for t in l.tensors:
                per = out.setdefault(t.name, {})
                per[t.encoding] = per.get(t.encoding, 0) + t.nbytes * l.num_experts
        return out

    def resident_encodings(self) -> dict:
        """{encoding: bytes} over resident.safetensors (empty for v1 packs)."""
        out: dict = {}
        for t in self.resident:
            for enc, n in (t.part_bytes() if t.parts else [(t.encoding, t.nbytes)]):
                out[enc] = out.get(enc, 0) + n
        return out

    def resident_groups(self) -> dict:
        """{group: {encoding: bytes}} over resident tensors, a group being a name with its layer
        index dropped (``layers.self_attn.q_proj.weight``)."""
        out: dict = {}
        for t in self.resident:
            parts = t.name.split(".")
            group = ".".join(p for p in parts if not p.isdigit() and p != "model")
            per = out.setdefault(group, {})
            for enc, n in (t.part_bytes() if t.parts else [(t.encoding, t.nbytes)]):
                per[enc] = per.get(enc, 0) + n
        return dict(sorted(out.items()))

    @property
    def num_records(self) -> int:
        return sum(l.num_experts for l in self.layers)

    def written_version(self) -> int:
        """The oldest format version that holds this pack (what ``to_json`` writes)."""
        return COL_ORDER_VERSION if any(t.col_order for t in self.resident) else 2

    def to_json(self) -> dict:
        return {
            "format": FORMAT_MAGIC, "version": self.written_version(), "alignment": ALIGNMENT,
            "architecture": self.architecture, "family": self.family, "created_by": self.created_by,
            "experts_file": EXPERTS, "experts_bytes": self.experts_bytes,
            "checksum": {"algorithm": "crc32c", "file": EXPERTS_IDX},
            "resident_file": RESIDENT, "tokenizer_files": self.tokenizer_files,
            "resident": [t.to_json() for t in self.resident], "notes": self.notes,
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
    if version not in READABLE_VERSIONS:
        raise bad(f"pack format version {version} is no longer supported (current: {FORMAT_VERSION})")
    if doc.get("alignment") != ALIGNMENT:
        raise bad(f"alignment {doc.get('alignment')!r} is not {ALIGNMENT}")
    try:
        layers, first, end = [], 0, 0
        for l in doc["layers"]:
            tensors = tuple(_parse_slot(t, version, l.get("layer_idx"), bad) for t in l["tensors"])
            rec = LayerRecords(int(l["layer_idx"]), int(l["num_experts"]), int(l["base_offset"]),
                               int(l["record_bytes"]), tensors, first)
            layers.append(rec)
            first += rec.num_experts
            for t in tensors:
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
            resident=[_parse_resident(t, version, bad) for t in doc.get("resident", [])],
            notes=[str(n) for n in doc.get("notes", [])], version=version,
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


def _parse_resident(t: dict, version: int, bad) -> ResidentTensor:
    shape = tuple(int(d) for d in t["shape"])
    parts = tuple((str(p["encoding"]), int(p["rows"])) for p in t.get("parts", []))
    col_order = t.get("col_order", False)
    r = ResidentTensor(str(t["name"]), shape, str(t["encoding"]), int(t["nbytes"]), parts, col_order is True)
    if col_order not in (True, False) or (r.col_order and (version < COL_ORDER_VERSION or len(shape) != 2 or parts
                                                           or r.encoding not in ENCODINGS
                                                           or get_encoding(r.encoding).is_float)):
        raise bad(f"resident tensor {r.name}: col_order {col_order!r} is not a v{COL_ORDER_VERSION} "
                  f"block-encoded matrix's (version {version}, encoding {r.encoding}, shape {list(shape)})")
    if r.encoding == MIXED:
        unknown = [e for e, _ in parts if e not in ENCODINGS]
        if not parts or unknown or sum(n for _, n in parts) != shape[0] or \
                sum(n for _, n in r.part_bytes()) != r.nbytes:
            raise bad(f"resident tensor {r.name}: its mixed parts {list(parts)} do not describe {list(shape)} "
                      f"in {r.nbytes} bytes" + (f" (unknown encodings {unknown})" if unknown else ""))
    return r


def _parse_slot(t: dict, version: int, layer_idx, bad) -> TensorSlot:
    shape = tuple(int(d) for d in t["shape"])
    if version == 1:
        if t["dtype"] not in BY_DTYPE_NAME:
            raise bad(f"layer {layer_idx} tensor {t['name']} has unknown dtype {t['dtype']!r}")
        return TensorSlot(t["name"], shape, BY_DTYPE_NAME[t["dtype"]], int(t["offset"]))
    encoding = t["encoding"]
    if encoding not in ENCODINGS:
        raise bad(f"layer {layer_idx} tensor {t['name']} has encoding {encoding!r}, which this lean-qwenflash "
                  f"does not know (known: {', '.join(ENCODINGS)}); upgrade lean-qwenflash")
    slot = TensorSlot(t["name"], shape, encoding, int(t["offset"]))
    try:
        nbytes = slot.nbytes
    except ValueError as e:
        raise bad(f"layer {layer_idx} tensor {t['name']}: {e}") from None
    if int(t["nbytes"]) != nbytes:
        raise bad(f"layer {layer_idx} tensor {t['name']} says {t['nbytes']} bytes but {encoding} {list(shape)} "
                  f"takes {nbytes}")
    return slot


def encode_idx(crcs) -> bytes:
    return IDX_HEADER.pack(IDX_MAGIC, IDX_VERSION, len(crcs)) + struct.pack(f"<{len(crcs)}I", *crcs)


def decode_idx(data: bytes, expected_count: int, where: str) -> tuple:
    if len(data) < IDX_HEADER.size:
        raise StoreError(f"{where}: checksum index is truncated; {REPACK_HINT}")
    magic, version, count = IDX_HEADER.unpack_from(data)
    if magic != IDX_MAGIC or version != IDX_VERSION:
        raise StoreError(f"{where}: not a v{IDX_VERSION} checksum index; {REPACK_HINT}")
    if count != expected_count or len(data) != IDX_HEADER.size + 4 * count:
        raise StoreError(f"{where}: checksum index lists {count} records ({len(data)} bytes) but the manifest "
                         f"has {expected_count}; {REPACK_HINT}")
    return struct.unpack_from(f"<{count}I", data, IDX_HEADER.size)
