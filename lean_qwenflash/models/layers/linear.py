"""``Linear`` and ``Embedding``: torch's, with the same parameters and keys, whose weights may be
block-quantized rows (``pack --quant``, GGUF files) and whose one-row products use the native kernels."""
from __future__ import annotations

import torch
from torch import nn

from lean_qwenflash.models import kernels, native
from lean_qwenflash.quant import QuantTensor
from lean_qwenflash.models.policy import STANDALONE


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and keys) whose one-row products use every CPU thread.

    A block-quantized weight (``pack --quant``) replaces the parameter via :meth:`set_quantized`;
    products then go through ``kernels.quant_linear`` as the model's ``ExecPolicy`` says. With
    ``float_native``, one-row products with a float weight of at least kernels.SPLIT_MIN_BYTES on
    CPU run the native kernel too (decode: torch is on one thread then, the kernels use every
    core; below that size a thread hand-off costs more than it saves)."""

    qweight = None
    ctx = STANDALONE     # the model's ExecContext (CausalLM binds it)

    def set_quantized(self, qweight) -> None:
        if tuple(qweight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"quantized weight {tuple(qweight.shape)} does not fit Linear "
                             f"[{self.out_features}, {self.in_features}]")
        del self.weight                  # no float copy: the module's state is the encoded rows
        self.qweight = qweight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.qweight is not None:
            return kernels.quant_linear(x, self.qweight, self.bias, self.ctx)
        policy = self.ctx.policy
        if policy.float_native and x.numel() == self.in_features and \
                self.weight.nbytes >= kernels.SPLIT_MIN_BYTES and native.supports(self.weight):
            out = native.gemv(self.weight, x, isa=policy.isa, threads=policy.native_threads)
            out = out.view(x.shape[:-1] + (self.out_features,))
            out = out.to(x.dtype)
            return out if self.bias is None else out + self.bias
        return kernels.linear(x, self.weight, self.bias)


class Embedding(nn.Embedding):
    """``nn.Embedding`` whose table may be block-quantized rows (GGUF files quantize it): a lookup
    then dequantizes only the rows asked for, exactly, and a tied output head multiplies by the
    encoded rows (``kernels.quant_linear``)."""

    qweight = None
    ctx = STANDALONE

    def set_quantized(self, qweight, dtype: torch.dtype) -> None:
        if tuple(qweight.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"quantized embeddings {tuple(qweight.shape)} do not fit "
                             f"[{self.num_embeddings}, {self.embedding_dim}]")
        del self.weight
        self.qweight, self.qdtype = qweight, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.qweight is None:
            return super().forward(ids)
        rows = self.qweight.raw[ids.reshape(-1)]
        if rows.device.type == "cpu" and native.available() and self.qweight.encoding.native_id >= 0:
            # the native exact dequantization (bit-equal to the torch one; one call, not a dozen ops)
            values = native.dequantize_into(QuantTensor(rows, self.qweight.encoding, (rows.shape[0], self.embedding_dim)),
                                            torch.empty(rows.shape[0], self.embedding_dim), threads=1)
        else:
            values = self.qweight.encoding.dequantize(rows, self.embedding_dim)
        return values.to(self.qdtype).view(*ids.shape, self.embedding_dim)

    def as_head(self, x: torch.Tensor) -> torch.Tensor:
        """Logits through the (tied) table: x @ tableᵀ."""
        if self.qweight is None:
            return kernels.linear(x, self.weight)
        return kernels.quant_linear(x, self.qweight, None, self.ctx)
