"""Expert math other than the plain SwiGLU of ``kernels`` (the sparse block's ``experts``)."""
from __future__ import annotations

import torch
from torch import nn

from lean_qwenflash.models import kernels
from lean_qwenflash.models.policy import ExecContext


class ClampedSwiGLUExperts(nn.Module):
    """GPT-OSS expert math, with the experts' biases resident (HF ``mlp.experts.gate_up_proj_bias``
    [E, 2I] with gate/up interleaved, ``mlp.experts.down_proj_bias`` [E, H]); the weights come from the
    provider as usual (gate rows first). ``down((up + 1) * g * sigmoid(alpha * g)) + b`` with
    g = min(gate, limit) and up clamped to [-limit, limit].

    The block calls ``forward`` directly (no module hooks on the per-expert path)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate: int, alpha: float, limit: float):
        super().__init__()
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(num_experts, 2 * intermediate))
        self.down_proj_bias = nn.Parameter(torch.zeros(num_experts, hidden_size))
        self.alpha, self.limit, self.intermediate = alpha, limit, intermediate
        self._gate_first_bias = None

    def forward(self, x: torch.Tensor, expert, expert_id: int, ctx: ExecContext) -> torch.Tensor:
        if self._gate_first_bias is None or self._gate_first_bias.device != x.device:
            b = self.gate_up_proj_bias.detach()
            self._gate_first_bias = torch.cat((b[:, 0::2], b[:, 1::2]), dim=1)      # the records' row order
        # (quant_linear: one row in fast mode runs the native GEMV on the record as stored)
        h = kernels.quant_linear(x, expert.gate_up, None, ctx, "gate_up") + \
            self._gate_first_bias[expert_id].to(x.dtype)
        gate = h[:, :self.intermediate].clamp(max=self.limit)
        up = h[:, self.intermediate:].clamp(-self.limit, self.limit)
        act = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        return kernels.quant_linear(act, expert.down, None, ctx, "down") + self.down_proj_bias[expert_id].to(x.dtype)
