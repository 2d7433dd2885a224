"""Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5): the gated delta rule, one token at a time
(decode) and chunked (prefill), and the layer around it (projections, causal conv, output norm)."""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from typing import Optional

from lean_qwenflash.models import kernels, native
from lean_qwenflash.models.layers.linear import Linear
from lean_qwenflash.models.layers.norm import GatedRMSNorm, native_norm_args
from lean_qwenflash.models.policy import STANDALONE


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


def recurrent_gated_delta_rule(q, k, v, g, beta, state: torch.Tensor) -> torch.Tensor:
    """One token: q, k [B, Hv, Dk], v [B, Hv, Dv], g, beta [B, Hv]; ``state`` [B, Hv, Dk, Dv] updated in place.

    S <- exp(g) S;  delta = beta (v - k^T S);  S <- S + k delta^T;  o = q^T S.
    """
    state.mul_(g.exp()[..., None, None])
    k_row = k.unsqueeze(-2)                                     # [B, Hv, 1, Dk]
    delta = (v.unsqueeze(-2) - k_row @ state) * beta[..., None, None]
    state.add_(k.unsqueeze(-1) @ delta)
    return (q.unsqueeze(-2) @ state).squeeze(-2)                # [B, Hv, Dv]


# Decays below e^-60 count as zero in the chunked rule: such a term is under 1e-26 of the terms it
# is summed with (fp32 keeps 1e-7), and left in, its exp and products are denormal floats, which
# made the rule's batched matmuls 2-4x slower (a random Qwen3.5-shaped model: 23 -> 10 ms per
# 256-token chunk of a layer, same outputs bit for bit).
DECAY_FLOOR = -60.0


def _decay(log_decay: torch.Tensor) -> torch.Tensor:
    return log_decay.masked_fill(log_decay < DECAY_FLOOR, -math.inf).exp()


def chunked_gated_delta_rule(q, k, v, g, beta, state: torch.Tensor, chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Many tokens: q, k [B, Hv, T, Dk], v [B, Hv, T, Dv], g, beta [B, Hv, T]; state [B, Hv, Dk, Dv].

    Within a chunk the delta updates are solved at once (WY form): with Γ_t = exp(cumsum g),
    (I + strict_lower(β_i k_i·k_j Γ_i/Γ_j)) Δ = βv - βkΓ S_0, then o = qΓ S_0 + (qk^T ∘ Γ_i/Γ_j) Δ and
    S = Γ_C S_0 + (k Γ_C/Γ)^T Δ. Everything but the state is computed for all chunks at once
    (the last chunk padded with tokens that change nothing: k = v = β = g = 0); only the products
    with the state run chunk by chunk. Returns (o [B, Hv, T, Dv], final state).
    """
    batch, heads, num_tokens, _ = q.shape
    dv = v.shape[-1]
    n = min(chunk_size, num_tokens)
    pad = (-num_tokens) % n
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
    chunks = (num_tokens + pad) // n
    q, k, v = (t.reshape(batch, heads, chunks, n, t.shape[-1]) for t in (q, k, v))
    g, beta = g.reshape(batch, heads, chunks, n), beta.reshape(batch, heads, chunks, n)
    log_decay = g.cumsum(-1)                                       # [B, Hv, C, n]
    causal = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()
    pair_decay = _decay((log_decay[..., :, None] - log_decay[..., None, :]).masked_fill(~causal, -math.inf))
    decay = _decay(log_decay)[..., None]
    k_beta = k * beta[..., None]
    system = (k_beta @ k.transpose(-1, -2)) * pair_decay           # only its strict lower part is read
    rhs = torch.cat((v * beta[..., None], k_beta * decay), dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    new_values, decayed_keys = solved[..., :dv], solved[..., dv:]
    attn = (q @ k.transpose(-1, -2)) * pair_decay
    q_decayed = q * decay
    last = log_decay[..., -1:]
    k_tail = (k * _decay(last - log_decay)[..., None]).transpose(-1, -2)
    last = _decay(last)[..., None]                                 # [B, Hv, C, 1, 1]
    out = q.new_empty(batch, heads, chunks, n, dv)
    for c in range(chunks):
        delta = new_values[:, :, c] - decayed_keys[:, :, c] @ state
        out[:, :, c] = q_decayed[:, :, c] @ state + attn[:, :, c] @ delta
        state = state * last[:, :, c] + k_tail[:, :, c] @ delta
    return out.reshape(batch, heads, chunks * n, dv)[:, :, :num_tokens], state


class GatedDeltaNet(nn.Module):
    """Gated DeltaNet linear attention (Qwen3-Next): causal depthwise conv, then the gated delta rule.

    Qwen3-Next layout: ``in_proj_qkvz`` rows grouped per key head as [q, k, v (Hv/Hk heads), z
    (Hv/Hk heads)], ``in_proj_ba`` per key head as [b, a]. ``split_projections`` (Qwen3.5): four
    flat projections ``in_proj_qkv`` [q all, k all, v all], ``in_proj_z``, ``in_proj_b``,
    ``in_proj_a``. The conv runs on channels [q all, k all, v all] either way.
    State: ``conv`` [B, C, K-1] (last conv inputs) and ``recurrent`` [B, Hv, Dk, Dv] (fp32).
    """

    ctx = STANDALONE     # the model's ExecContext (CausalLM binds it): whether the fused step runs

    def __init__(self, hidden_size: int, num_k_heads: int, num_v_heads: int, head_k_dim: int,
                 head_v_dim: int, conv_kernel_size: int, norm_eps: float, split_projections: bool = False):
        super().__init__()
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel_size = conv_kernel_size
        self.split_projections = split_projections
        if split_projections:
            self.in_proj_qkv = Linear(hidden_size, self.conv_dim, bias=False)
            self.in_proj_z = Linear(hidden_size, self.value_dim, bias=False)
            self.in_proj_b = Linear(hidden_size, num_v_heads, bias=False)
            self.in_proj_a = Linear(hidden_size, num_v_heads, bias=False)
        else:
            self.in_proj_qkvz = Linear(hidden_size, 2 * self.key_dim + 2 * self.value_dim, bias=False)
            self.in_proj_ba = Linear(hidden_size, 2 * num_v_heads, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel_size, groups=self.conv_dim,
                                bias=False, padding=conv_kernel_size - 1)
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(num_v_heads))
        self.norm = GatedRMSNorm(head_v_dim, norm_eps)
        self.out_proj = Linear(self.value_dim, hidden_size, bias=False)

    def _conv(self, mixed: torch.Tensor, state) -> torch.Tensor:
        """mixed [B, T, C] -> silu(causal depthwise conv) [B, T, C]; keeps the last K-1 inputs."""
        batch, num_tokens, channels = mixed.shape
        past = state.conv if state is not None and state.conv is not None else \
            mixed.new_zeros(batch, channels, self.conv_kernel_size - 1)
        window = torch.cat((past, mixed.transpose(1, 2)), dim=-1)   # [B, C, K-1+T]
        if state is not None:
            state.conv = window[..., num_tokens:].clone() if num_tokens > 1 else window[..., 1:]
        out = kernels.depthwise_conv(window, self.conv1d.weight)
        return F.silu(out).transpose(1, 2)

    def _project(self, x: torch.Tensor):
        """x -> (conv input [B, T, C] as [q all, k all, v all], z [B, T, Hv*Dv], b, a [B, T, Hv])."""
        batch, num_tokens, _ = x.shape
        if self.split_projections:
            return self.in_proj_qkv(x), self.in_proj_z(x), self.in_proj_b(x), self.in_proj_a(x)
        ratio = self.num_v_heads // self.num_k_heads
        dk, dv, nk, nv = self.head_k_dim, self.head_v_dim, self.num_k_heads, self.num_v_heads
        qkvz = self.in_proj_qkvz(x).view(batch, num_tokens, nk, 2 * dk + 2 * ratio * dv)
        q, k, v, z = qkvz.split((dk, dk, ratio * dv, ratio * dv), dim=-1)
        ba = self.in_proj_ba(x).view(batch, num_tokens, nk, 2 * ratio)
        b, a = ba[..., :ratio].reshape(batch, num_tokens, nv), ba[..., ratio:].reshape(batch, num_tokens, nv)
        mixed = torch.cat((q.reshape(batch, num_tokens, -1), k.reshape(batch, num_tokens, -1),
                           v.reshape(batch, num_tokens, -1)), dim=-1)
        return mixed, z, b, a

    def forward(self, x: torch.Tensor, rope=None, state=None) -> torch.Tensor:
        mixed, z, b, a = self._project(x)
        return self._output(self._core(mixed, b, a, state, x.dtype), z)

    def forward_rows(self, x: torch.Tensor, ropes, states: list) -> torch.Tensor:
        """One token of each of B sequences (x [B, 1, H]): the projections and the output for all
        rows at once, the convolution and the recurrent step per sequence on its own state."""
        mixed, z, b, a = self._project(x)
        core = torch.cat([self._core(mixed[i:i + 1], b[i:i + 1], a[i:i + 1], state, x.dtype)
                          for i, state in enumerate(states)])
        return self._output(core, z)

    def _output(self, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        batch, num_tokens = core.shape[:2]
        core = self.norm(core, z.reshape(batch, num_tokens, self.num_v_heads, self.head_v_dim))
        return self.out_proj(core.reshape(batch, num_tokens, -1))

    def _core(self, mixed: torch.Tensor, b: torch.Tensor, a: torch.Tensor, state, dtype: torch.dtype) -> torch.Tensor:
        """The convolution and the gated delta rule over the projections -> [B, T, Hv, Dv] in ``dtype``
        (``state`` updated)."""
        batch, num_tokens, _ = mixed.shape
        ratio = self.num_v_heads // self.num_k_heads
        dk, dv, nk, nv = self.head_k_dim, self.head_v_dim, self.num_k_heads, self.num_v_heads
        mixed = self._conv(mixed, state)
        compute_dtype = torch.promote_types(dtype, torch.float32)   # fp32 at least, fp64 in tests
        q, k, v = mixed.to(compute_dtype).split((self.key_dim, self.key_dim, self.value_dim), dim=-1)
        q = _l2norm(q.reshape(batch, num_tokens, nk, dk)) * dk ** -0.5
        k = _l2norm(k.reshape(batch, num_tokens, nk, dk))
        v = v.reshape(batch, num_tokens, nv, dv)
        if ratio > 1:
            q, k = q.repeat_interleave(ratio, dim=2), k.repeat_interleave(ratio, dim=2)
        beta = b.to(compute_dtype).sigmoid()
        g = -self.A_log.to(compute_dtype).exp() * F.softplus(a.to(compute_dtype) + self.dt_bias.to(compute_dtype))
        recurrent = state.recurrent if state is not None else None
        if recurrent is None:
            recurrent = torch.zeros(batch, nv, dk, dv, dtype=compute_dtype, device=mixed.device)
        if num_tokens == 1 and state is not None:
            core = recurrent_gated_delta_rule(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], recurrent)
            core = core.unsqueeze(1)                                # [B, 1, Hv, Dv]
        else:
            core, recurrent = kernels.chunked_delta_rule(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), g.transpose(1, 2),
                beta.transpose(1, 2), recurrent, chunked_gated_delta_rule)
            core = core.transpose(1, 2)
        if state is not None:
            state.recurrent = recurrent
        return core.to(dtype)


class DeltaNetStep:
    """A layer's Gated-DeltaNet sub-block for one-token fast-mode CPU steps as one native call
    (csrc/deltanet.h): the input norm, the projections, the conv step, the l2-normalised q/k, the
    gated delta rule on the recurrent state, the gated output norm, out_proj and the residual add,
    in fp32, instead of ~35 torch dispatches. Not bit-equal to the separate calls (its sums run in
    another order): within ~1e-6 relative (tests/test_decode_step.py).

    ``build`` returns None where the sub-block is not one it covers: another kernel mode, a matrix
    or norm the native kernels cannot read. ``__call__`` refuses (None) a step it cannot take: a
    batch, a state not in fp32; the caller then runs the separate calls."""

    def __init__(self, net: GatedDeltaNet, handle, keep: list):
        self.net, self.policy = net, net.ctx.policy
        self.handle, self._keep = handle, keep       # (the tensors the handle points at, held)
        self.hidden = net.out_proj.out_features
        self._conv_shape = (1, net.conv_dim, net.conv_kernel_size - 1)
        self._state_shape = (1, net.num_v_heads, net.head_k_dim, net.head_v_dim)

    @classmethod
    def build(cls, net, norm) -> Optional["DeltaNetStep"]:
        policy = net.ctx.policy
        if type(net) is not GatedDeltaNet or policy.kernel_mode != "fast" or not native.available():
            return None
        from lean_qwenflash.quant.base import QuantCols
        names = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a") if net.split_projections else \
            ("in_proj_qkvz", "in_proj_ba")
        mods = [getattr(net, n) for n in names] + ([] if net.split_projections else [None, None]) + [net.out_proj]
        weights, out_order = [], None
        for m in mods:
            if m is None:
                weights.append(None)
                continue
            w = m.qweight if m.qweight is not None else m.weight
            if m is net.out_proj and isinstance(w, QuantCols):    # its input permuted, natively
                w, out_order = w.inner, w.order
            if not native.supports(w) or m.bias is not None or (m.qweight is None and w.dtype != torch.float32):
                return None
            weights.append(w)
        if out_order is not None and not (out_order.dtype == torch.int64 and out_order.device.type == "cpu"
                                          and out_order.is_contiguous()):
            return None
        in_norm = native_norm_args(norm, net.out_proj.out_features)
        tensors = (net.conv1d.weight, net.A_log, net.dt_bias, net.norm.weight)
        if in_norm is None or not all(native.is_f32(t) for t in tensors) or net.conv1d.bias is not None:
            return None
        conv = net.conv1d.weight.reshape(net.conv_dim, net.conv_kernel_size)
        handle = native._K.DeltaNetStep(
            hidden=net.out_proj.out_features, k_heads=net.num_k_heads, v_heads=net.num_v_heads,
            k_dim=net.head_k_dim, v_dim=net.head_v_dim, conv_kernel=net.conv_kernel_size,
            split=net.split_projections, in_norm=in_norm[0].data_ptr(), in_norm_mode=in_norm[1], in_eps=in_norm[2],
            w=[0 if w is None else native._address(w) for w in weights],
            enc=[0 if w is None else native.encoding_id(w) for w in weights],
            rows=[0 if m is None else m.out_features for m in mods], conv=conv.data_ptr(),
            a_log=net.A_log.data_ptr(), dt_bias=net.dt_bias.data_ptr(), out_norm=net.norm.weight.data_ptr(),
            out_eps=float(net.norm.eps), out_order=0 if out_order is None else out_order.data_ptr())
        kept = [w for w in weights if w is not None] + [in_norm[0], conv, *tensors]
        return cls(net, handle, kept + ([] if out_order is None else [out_order]))

    def __call__(self, x: torch.Tensor, rope, state) -> Optional[torch.Tensor]:
        """x + the sub-block of x [1, 1, H] continuing ``state`` (a DeltaNetState, updated), or None."""
        if state is None or x.shape != (1, 1, self.hidden) or not native.is_f32(x):
            return None
        conv, recurrent = state.conv, state.recurrent
        if conv is None:
            conv = torch.zeros(self._conv_shape)
        elif tuple(conv.shape) != self._conv_shape or conv.dtype != torch.float32 or conv.device.type != "cpu":
            return None
        elif not conv.is_contiguous():          # (the torch path's one-token step leaves a view)
            conv = conv.contiguous()
        if recurrent is None:
            recurrent = torch.zeros(self._state_shape)
        elif tuple(recurrent.shape) != self._state_shape or not native.is_f32(recurrent):
            return None
        out = torch.empty_like(x)
        policy = self.policy
        self.handle.run(x.data_ptr(), conv.data_ptr(), recurrent.data_ptr(), out.data_ptr(),
                        native._threads(policy.native_threads), policy.isa)
        state.conv, state.recurrent = conv, recurrent
        return out
