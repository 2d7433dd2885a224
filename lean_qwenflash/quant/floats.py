"""Float encodings: f32, f16, bf16 (one value per "block")."""
from __future__ import annotations

import torch

from .base import Encoding


class _Float(Encoding):
    def dequantize(self, raw: torch.Tensor, cols: int) -> torch.Tensor:
        blocks = self._blocks(raw, cols)
        return blocks.view(self.torch_dtype).float().reshape(raw.shape[:-1] + (cols,))

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.torch_dtype).contiguous().view(torch.uint8)


class F32(_Float):
    name, block_bytes, ggml_type, torch_dtype, native_id = "f32", 4, 0, torch.float32, 0


class F16(_Float):
    name, block_bytes, ggml_type, torch_dtype, native_id = "f16", 2, 1, torch.float16, 1


class BF16(_Float):
    name, block_bytes, ggml_type, torch_dtype, native_id = "bf16", 2, 30, torch.bfloat16, 2


# The float encodings by torch dtype name (the v1 manifest's "dtype", safetensors dtypes).
BY_DTYPE_NAME = {"float32": "f32", "float16": "f16", "bfloat16": "bf16"}
DTYPE_NAME = {v: k for k, v in BY_DTYPE_NAME.items()}
