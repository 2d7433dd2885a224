"""The Encoding interface, the registry, and QuantTensor (raw rows + their encoding)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

ENCODINGS: dict[str, "Encoding"] = {}


class Encoding:
    """A row-wise weight format. A matrix ``[rows, cols]`` is stored as ``rows`` rows of
    ``row_bytes(cols)`` bytes; each row is ``cols // block_size`` blocks of ``block_bytes``.

    Subclasses set the class attributes and implement :meth:`dequantize` / :meth:`quantize`.
    """

    name: str = ""
    block_size: int = 1              # weights per block
    block_bytes: int = 4             # bytes per block
    ggml_type: int = -1              # GGMLQuantizationType value (GGUF import, gguf reference)
    torch_dtype: Optional[torch.dtype] = None   # float encodings only
    native_id: int = -1              # the id csrc/quant.h knows this encoding by

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if cls.name:
            ENCODINGS[cls.name] = cls()

    @property
    def is_float(self) -> bool:
        return self.torch_dtype is not None

    def row_bytes(self, cols: int) -> int:
        if cols % self.block_size:
            raise ValueError(f"{self.name} rows must be a multiple of {self.block_size} values, got {cols}")
        return cols // self.block_size * self.block_bytes

    def nbytes(self, shape) -> int:
        rows = 1
        for d in shape[:-1]:
            rows *= int(d)
        return rows * self.row_bytes(int(shape[-1]))

    def dequantize(self, raw: torch.Tensor, cols: int) -> torch.Tensor:
        """``raw`` uint8 [..., row_bytes] -> float32 [..., cols] (the reference; CPU or CUDA)."""
        raise NotImplementedError

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """float [..., cols] -> uint8 [..., row_bytes] (for the packer)."""
        raise NotImplementedError

    def _blocks(self, raw: torch.Tensor, cols: int) -> torch.Tensor:
        """raw [..., row_bytes] -> uint8 [N, block_bytes] (checked)."""
        if raw.dtype != torch.uint8 or raw.shape[-1] != self.row_bytes(cols):
            raise ValueError(f"{self.name}: expected uint8 rows of {self.row_bytes(cols)} bytes for {cols} values, "
                             f"got {raw.dtype} [..., {raw.shape[-1]}]")
        return raw.reshape(-1, self.block_bytes)

    def __repr__(self) -> str:
        return f"Encoding({self.name})"


def get_encoding(name: str) -> Encoding:
    try:
        return ENCODINGS[name]
    except KeyError:
        raise ValueError(f"unknown encoding {name!r}; known: {', '.join(ENCODINGS)}") from None


def row_encoding_error(encoding: Encoding, cols: int) -> Optional[str]:
    """Why ``encoding`` cannot hold rows of ``cols`` values (None if it can)."""
    if cols % encoding.block_size:
        return f"row length {cols} is not a multiple of {encoding.name}'s block of {encoding.block_size}"
    return None


@dataclass(frozen=True)
class QuantTensor:
    """A block-quantized matrix ``[rows, cols]`` held as its raw rows (a view of a record, a cache
    slot or a device row). Float encodings are served as plain tensors instead."""

    raw: torch.Tensor        # uint8 [rows, row_bytes]
    encoding: Encoding
    shape: tuple             # (rows, cols)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        out = self.encoding.dequantize(self.raw, self.shape[1])
        return out if dtype == torch.float32 else out.to(dtype)

    @property
    def device(self) -> torch.device:
        return self.raw.device

    def to(self, device) -> "QuantTensor":
        return QuantTensor(self.raw.to(device), self.encoding, self.shape)

    @property
    def nbytes(self) -> int:
        return self.raw.numel()


@dataclass(frozen=True)
class QuantRows:
    """A matrix ``[rows, cols]`` whose row groups are stored in different encodings (a GGUF file
    may store the pieces of one Hugging Face matrix in different types): ``parts`` (QuantTensor)
    stacked give the rows in stored order; row i of the matrix is stacked row ``order[i]``.
    Products run part by part, then the output columns are put in order (exact)."""

    parts: tuple             # of QuantTensor, same cols
    order: torch.Tensor      # int64 [rows]
    shape: tuple             # (rows, cols)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.cat([p.dequantize(dtype) for p in self.parts]).index_select(0, self.order.to(self.device))

    def to(self, device) -> "QuantRows":
        return QuantRows(tuple(p.to(device) for p in self.parts), self.order.to(device), self.shape)

    @property
    def device(self) -> torch.device:
        return self.parts[0].device

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    @property
    def encodings(self) -> tuple:
        return tuple(p.encoding.name for p in self.parts)


@dataclass(frozen=True)
class QuantCols:
    """A matrix ``[rows, cols]`` stored encoded with its columns in another order (a GGUF converter
    may reorder a matrix's input columns, which block encodings cannot move): column j of
    ``inner`` is column ``order[j]`` of the matrix, so ``W @ x = inner @ x[order]``. Products
    permute the input, then run on the rows as stored (exact)."""

    inner: QuantTensor
    order: torch.Tensor      # int64 [cols]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return self.inner.dequantize(dtype).index_select(1, torch.argsort(self.order).to(self.device))

    def to(self, device) -> "QuantCols":
        return QuantCols(self.inner.to(device), self.order.to(device))

    @property
    def shape(self) -> tuple:
        return self.inner.shape

    @property
    def encoding(self):
        return self.inner.encoding

    @property
    def device(self) -> torch.device:
        return self.inner.device

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes
