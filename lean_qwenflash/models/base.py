"""The decoder skeleton every family shares: embed -> [norm, mixer, +, norm, mlp, +] x N -> norm -> head.

Families choose the modules and their HF attribute names; this file owns the forward pass and the
contract with per-layer state (``lean_qwenflash.generate.state``).
"""
from __future__ import annotations

import math
from typing import Optional

import torch
from torch import nn

from lean_qwenflash.models import kernels, native
from lean_qwenflash.models.layers import Attention, Embedding, Linear, Rotary, SparseMoeBlock


class DecoderLayer(nn.Module):
    """Pre-norm residual block; ``mixer_name`` / ``mlp_name`` are the HF attribute names."""

    def __init__(self, mixer_name: str, mixer: nn.Module, mlp_name: str, mlp: nn.Module,
                 input_layernorm: nn.Module, post_attention_layernorm: nn.Module):
        super().__init__()
        setattr(self, mixer_name, mixer)
        setattr(self, mlp_name, mlp)
        self.input_layernorm = input_layernorm
        self.post_attention_layernorm = post_attention_layernorm
        # Unregistered references: avoid nn.Module.__getattr__ on the hot path, no duplicate keys.
        object.__setattr__(self, "_mixer", mixer)
        object.__setattr__(self, "_mlp", mlp)

    def forward(self, x: torch.Tensor, rope, state) -> torch.Tensor:
        x = x + self._mixer(self.input_layernorm(x), rope, state)
        return x + self._mlp(self.post_attention_layernorm(x))


class SandwichDecoderLayer(DecoderLayer):
    """Pre- and post-norms around both branches (AfMoE): ``x + post_attn(mixer(pre_attn(x)))`` then
    ``x + post_mlp(mlp(pre_mlp(x)))``; HF names input_layernorm, post_attention_layernorm,
    pre_mlp_layernorm, post_mlp_layernorm."""

    def __init__(self, mixer_name: str, mixer: nn.Module, mlp_name: str, mlp: nn.Module, norms: list):
        super().__init__(mixer_name, mixer, mlp_name, mlp, norms[0], norms[1])
        self.pre_mlp_layernorm, self.post_mlp_layernorm = norms[2], norms[3]

    def forward(self, x: torch.Tensor, rope, state) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self._mixer(self.input_layernorm(x), rope, state))
        return x + self.post_mlp_layernorm(self._mlp(self.pre_mlp_layernorm(x)))


class CausalLM(nn.Module):
    """A decoder-only LM whose sparse blocks get routed experts from an ``ExpertProvider``.

    Attributes mirror HF: ``model.embed_tokens``, ``model.layers``, ``model.norm``, ``lm_head``
    (absent when ``tie_word_embeddings``: the checkpoint has no such tensor either).
    ``layer_types[i]`` is "full_attention", "sliding_attention" (then ``sliding_window`` is set) or
    "linear_attention" and tells the generator which state each layer needs.
    """

    # Torch intra-op threads during one-token steps on CPU (None: leave torch's setting). With the
    # native kernels doing the heavy products on their own threads, torch's small per-token ops run
    # faster on one thread than fighting them for the cores (q4_k_m decode 35 -> 43 tok/s).
    decode_torch_threads = None

    def __init__(self, config: dict, layers: list[DecoderLayer], layer_types: list[str], norm: nn.Module,
                 rotary: Optional[Rotary]):
        super().__init__()
        self.config = config
        vocab_size, hidden_size = int(config["vocab_size"]), int(config["hidden_size"])
        self.model = nn.Module()
        self.model.embed_tokens = Embedding(vocab_size, hidden_size)
        self.model.layers = nn.ModuleList(layers)
        self.model.norm = norm
        self.tie_word_embeddings = bool(config.get("tie_word_embeddings", False))
        self.lm_head = None if self.tie_word_embeddings else Linear(hidden_size, vocab_size, bias=False)
        self.layer_types = list(layer_types)
        # the window of the sliding_attention layers (new_state sizes their caches by it)
        windows = {m.sliding_window for m in self.modules() if isinstance(m, Attention) and m.sliding_window}
        if len(windows) > 1:
            raise ValueError(f"sliding-window layers with different windows {sorted(windows)} are not supported")
        self.sliding_window: Optional[int] = windows.pop() if windows else None
        self.embed_scale = 1.0          # muP input scaling (AfMoE): embeddings times this
        self.rotary = rotary
        self._layers = list(layers)

    def moe_blocks(self) -> list[SparseMoeBlock]:
        return [m for m in self.modules() if isinstance(m, SparseMoeBlock)]

    def expert_predictors(self) -> dict:
        """{layer: predict(hidden, n) -> expert ids [N, n]}: each sparse block's own routing rule,
        for a prefetcher that guesses a layer's experts from an earlier layer's input."""
        return {block.layer_idx: block.router.predict for block in self.moe_blocks()}

    def set_expert_provider(self, provider) -> None:
        """Route every sparse block's expert requests to ``provider`` (resident or streaming)."""
        for block in self.moe_blocks():
            block.provider = provider

    @torch.inference_mode()
    def set_expert_kernels(self, mode: str = "fast", isa: str = "auto") -> None:
        """Math on quantized weights (routed experts, quantized resident linears): ``exact`` or ``fast``
        (see models.kernels);
        ``isa`` forces a native kernel path (auto, scalar, avx2, avx512)."""
        if mode not in kernels.EXPERT_KERNELS or isa not in native.KERNEL_ISAS:
            raise ValueError(f"expert kernels must be one of {kernels.EXPERT_KERNELS} and isa one of {native.KERNEL_ISAS}; "
                             f"got {mode!r}, {isa!r}")
        for block in self.moe_blocks():
            block.expert_kernels, block.kernel_isa = mode, isa
        for m in self.modules():
            if isinstance(m, (Linear, Embedding)) and m.qweight is not None:
                m.kernel_mode, m.kernel_isa = mode, isa
            elif isinstance(m, Linear):
                m.float_kernel, m.kernel_isa = mode, isa

    def forward(self, input_ids: torch.Tensor, state=None, last_logits_only: bool = False) -> torch.Tensor:
        """Logits [B, T, V] (see ``_forward``); one-token CPU steps honour ``decode_torch_threads``."""
        threads = self.decode_torch_threads
        if threads and input_ids.shape[-1] == 1 and input_ids.device.type == "cpu":
            saved = torch.get_num_threads()
            if saved != threads:
                torch.set_num_threads(threads)
                spin = native.set_spin(native.DECODE_SPIN)   # torch is on one thread: keep ours awake
                try:
                    return self._forward(input_ids, state, last_logits_only)
                finally:
                    native.set_spin(spin)
                    torch.set_num_threads(saved)
        return self._forward(input_ids, state, last_logits_only)

    def _forward(self, input_ids: torch.Tensor, state=None, last_logits_only: bool = False) -> torch.Tensor:
        """Logits for ``input_ids`` [B, T] that continue ``state`` (a ``ModelState``, updated in place).

        Positions start at ``state.num_tokens`` (0 without state). Without a state the call is a
        stateless full-sequence forward. ``last_logits_only`` returns [B, 1, V] (prefill).
        """
        num_past = state.num_tokens if state is not None else 0
        num_tokens = input_ids.shape[1]
        x = self.model.embed_tokens(input_ids)
        if self.embed_scale != 1.0:
            x = x * self.embed_scale
        rope = None
        if self.rotary is not None:
            rope = self.rotary.tables(num_past, num_tokens, x.dtype, x.device)
        layer_states = state.layers if state is not None else [None] * len(self._layers)
        for layer, layer_state in zip(self._layers, layer_states):
            x = layer(x, rope, layer_state)
        if state is not None:
            state.num_tokens = num_past + num_tokens
        if last_logits_only:
            x = x[:, -1:]
        x = self.model.norm(x)
        if self.lm_head is None:
            return self.model.embed_tokens.as_head(x)
        return self.lm_head(x)


def mscale(scale: float, m: float = 1.0) -> float:
    """YaRN's attention scale for a context ``scale``-times longer: 0.1 * m * ln(scale) + 1."""
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def rope_parameters(config: dict) -> dict:
    """The rope settings: ``rope_parameters`` (transformers >= 5) over the older ``rope_scaling`` and
    top-level keys, with ``rope_type`` and ``rope_theta`` filled in."""
    rope = dict(config.get("rope_scaling") or {})
    rope.update(config.get("rope_parameters") or {})
    rope["rope_type"] = rope.get("rope_type", rope.get("type", "default"))
    rope["rope_theta"] = float(rope.get("rope_theta", config.get("rope_theta", 10000.0)))
    return rope


def yarn_inv_freq(rope: dict, config: dict, dim: int) -> tuple[torch.Tensor, float]:
    """YaRN: (inverse frequencies [dim/2], attention factor). Frequencies blend extrapolation (fast
    dims) and interpolation by ``factor`` (slow dims) over the correction range set by
    ``beta_fast`` / ``beta_slow``; the factor (``mscale``, ``mscale_all_dim``) scales cos and sin."""
    base = rope["rope_theta"]
    original = rope.get("original_max_position_embeddings") or config.get("max_position_embeddings")
    factor = rope.get("factor")
    if factor is None:
        factor = float(config["max_position_embeddings"]) / float(original)
    factor = float(factor)
    attention_factor = rope.get("attention_factor")
    if attention_factor is None:
        m, m_all = rope.get("mscale"), rope.get("mscale_all_dim")
        attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def correction_dim(rotations):
        return dim * math.log(float(original) / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)
    extrapolate = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attention_factor)


def rotary_from_config(config: dict, head_dim: int, default_partial: float = 1.0) -> Rotary:
    """RoPE from the config: ``default``, ``linear`` (positions divided by ``factor``) or ``yarn``."""
    rope = rope_parameters(config)
    rope_type, theta = rope["rope_type"], rope["rope_theta"]
    partial = float(rope.get("partial_rotary_factor", config.get("partial_rotary_factor", default_partial)))
    rotary = Rotary(head_dim, theta, partial)
    if rope_type == "default":
        return rotary
    if rope_type == "linear":
        rotary.inv_freq = rotary.inv_freq / float(rope["factor"])
        return rotary
    if rope_type == "yarn":
        rotary.inv_freq, rotary.attention_scaling = yarn_inv_freq(rope, config, rotary.rotary_dim)
        return rotary
    raise NotImplementedError(f"rope_type {rope_type!r} is not supported (supported: default, linear, yarn)")


def attention_head_dim(config: dict) -> int:
    return int(config.get("head_dim") or int(config["hidden_size"]) // int(config["num_attention_heads"]))
