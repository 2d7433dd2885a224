"""The decoder skeleton every family shares: embed -> [norm, mixer, +, norm, mlp, +] x N -> norm -> head.

Families choose the modules and their HF attribute names; this file owns the forward pass and the
contract with per-layer state (``lean_qwenflash.generate.state``).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from lean_qwenflash.models import affinity, kernels, native
from lean_qwenflash.models.layers.attention import Attention, AttentionStep
from lean_qwenflash.models.layers.deltanet import DeltaNetStep, GatedDeltaNet
from lean_qwenflash.models.layers.linear import Embedding, Linear
from lean_qwenflash.models.layers.rope import Rotary
from lean_qwenflash.models.moe.block import SparseMoeBlock
from lean_qwenflash.models.moe.routers import Router
from lean_qwenflash.models.policy import ExecContext, ExecPolicy


class DecoderLayer(nn.Module):
    """Pre-norm residual block; ``mixer_name`` / ``mlp_name`` are the HF attribute names."""

    def __init__(self, mixer_name: str, mixer: nn.Module, mlp_name: str, mlp: nn.Module,
                 input_layernorm: nn.Module, post_attention_layernorm: nn.Module):
        super().__init__()
        setattr(self, mixer_name, mixer)
        setattr(self, mlp_name, mlp)
        self.input_layernorm = input_layernorm
        self.post_attention_layernorm = post_attention_layernorm
        # Plain references in a tuple (not registered again: no duplicate keys), so that the hot
        # path avoids nn.Module.__getattr__.
        self._blocks = (mixer, mlp)

    # (policy, AttentionStep / DeltaNetStep or None), built at the first one-token step under a policy
    _mixer_step = None

    def forward(self, x: torch.Tensor, rope, state) -> torch.Tensor:
        mixer, mlp = self._blocks
        if x.shape[1] == 1:
            step = self.mixer_step()
            y = None if step is None else step(x, rope, state)
            if y is not None:        # the mixer sub-block and its residual add in one native call
                return y + mlp(self.post_attention_layernorm(y))
        x = x + mixer(self.input_layernorm(x), rope, state)
        return x + mlp(self.post_attention_layernorm(x))

    def mixer_step(self):
        """This layer's fused one-token mixer sub-block under the mixer's current policy, or None
        where it has none (``AttentionStep.build``, ``DeltaNetStep.build``)."""
        mixer = self._blocks[0]
        kind = AttentionStep if isinstance(mixer, Attention) else DeltaNetStep if isinstance(mixer, GatedDeltaNet) \
            else None
        if kind is None:
            return None
        built = self._mixer_step
        if built is None or built[0] is not mixer.ctx.policy:
            built = self._mixer_step = (mixer.ctx.policy, kind.build(mixer, self.input_layernorm))
        return built[1]

    # The two branches as steps (``forward_rows``); ``forward`` inlines them (the hot path).
    def mixer_in(self, x: torch.Tensor) -> torch.Tensor:
        return self.input_layernorm(x)

    def mixer_out(self, y: torch.Tensor) -> torch.Tensor:
        return y

    def mlp_in(self, x: torch.Tensor) -> torch.Tensor:
        return self.post_attention_layernorm(x)

    def mlp_out(self, y: torch.Tensor) -> torch.Tensor:
        return y

    def forward_rows(self, x: torch.Tensor, ropes: list, states: list, row_exact: bool) -> torch.Tensor:
        """One token of each of B sequences, x [B, 1, H], each continuing its own layer state
        (``states``) at its own position (``ropes``). The mixer runs per sequence (its own cache);
        the MLP sees all rows at once: a sparse block acquires each expert once for the rows that
        chose it. ``row_exact``: every row keeps the bits it has decoded alone (per-row arithmetic,
        shared acquires); otherwise the rows go through the projections (a mixer with
        ``forward_rows``) and the MLP as one batch (one kernel call each)."""
        mixer, mlp = self._blocks
        if not row_exact:
            if hasattr(mixer, "forward_rows"):
                x = x + self.mixer_out(mixer.forward_rows(self.mixer_in(x), ropes, states))
            else:
                x = x + torch.cat([self.mixer_out(mixer(self.mixer_in(x[b:b + 1]), ropes[b], states[b]))
                                   for b in range(x.shape[0])])
            return x + self.mlp_out(mlp(self.mlp_in(x)))
        rows = [x[b:b + 1] + self.mixer_out(mixer(self.mixer_in(x[b:b + 1]), ropes[b], states[b]))
                for b in range(x.shape[0])]
        ins = [self.mlp_in(r) for r in rows]
        outs = mlp.forward_rows(ins) if isinstance(mlp, SparseMoeBlock) else [mlp(i) for i in ins]
        return torch.cat([r + self.mlp_out(o) for r, o in zip(rows, outs)])


class SandwichDecoderLayer(DecoderLayer):
    """Pre- and post-norms around both branches (AfMoE): ``x + post_attn(mixer(pre_attn(x)))`` then
    ``x + post_mlp(mlp(pre_mlp(x)))``; HF names input_layernorm, post_attention_layernorm,
    pre_mlp_layernorm, post_mlp_layernorm."""

    def __init__(self, mixer_name: str, mixer: nn.Module, mlp_name: str, mlp: nn.Module, norms: list):
        super().__init__(mixer_name, mixer, mlp_name, mlp, norms[0], norms[1])
        self.pre_mlp_layernorm, self.post_mlp_layernorm = norms[2], norms[3]

    def forward(self, x: torch.Tensor, rope, state) -> torch.Tensor:
        mixer, mlp = self._blocks
        x = x + self.post_attention_layernorm(mixer(self.input_layernorm(x), rope, state))
        return x + self.post_mlp_layernorm(mlp(self.pre_mlp_layernorm(x)))

    def mixer_out(self, y: torch.Tensor) -> torch.Tensor:
        return self.post_attention_layernorm(y)

    def mlp_in(self, x: torch.Tensor) -> torch.Tensor:
        return self.pre_mlp_layernorm(x)

    def mlp_out(self, y: torch.Tensor) -> torch.Tensor:
        return self.post_mlp_layernorm(y)


class CausalLM(nn.Module):
    """A decoder-only LM whose sparse blocks get routed experts from an ``ExpertProvider``.

    Attributes mirror HF: ``model.embed_tokens``, ``model.layers``, ``model.norm``, ``lm_head``
    (absent when ``tie_word_embeddings``: the checkpoint has no such tensor either).
    ``layer_types[i]`` is "full_attention", "sliding_attention" (then ``sliding_window`` is set) or
    "linear_attention" and tells the generator which state each layer needs.
    """

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
        self.exec = ExecContext()       # this model's policy and workspace, shared by its modules
        self._bind_exec()

    def _bind_exec(self) -> None:
        """Point every module that computes with the policy (those whose class has a ``ctx``) at
        this model's context."""
        for m in self.modules():
            if hasattr(type(m), "ctx"):
                m.ctx = self.exec

    @property
    def policy(self) -> ExecPolicy:
        return self.exec.policy

    def set_policy(self, policy: ExecPolicy) -> None:
        """How this model computes from now on (see ``models.policy``); other models are unaffected."""
        if not isinstance(policy, ExecPolicy):
            raise TypeError(f"set_policy: expected an ExecPolicy, got {type(policy).__name__}")
        self.exec.policy = policy
        self._bind_exec()          # (modules added after construction join too)

    def moe_blocks(self) -> list[SparseMoeBlock]:
        return [m for m in self.modules() if isinstance(m, SparseMoeBlock)]

    def expert_predictors(self) -> dict:
        """{layer: predict(hidden, n) -> expert ids [N, n]}: each sparse block's own routing rule,
        for a prefetcher that guesses a layer's experts from an earlier layer's input."""
        return {block.layer_idx: block.predict for block in self.moe_blocks()}

    def set_expert_provider(self, provider) -> None:
        """Route every sparse block's expert requests to ``provider`` (resident or streaming)."""
        for block in self.moe_blocks():
            block.provider = provider

    def forward(self, input_ids: torch.Tensor, state=None, last_logits_only: bool = False) -> torch.Tensor:
        """Logits [B, T, V] (see ``_forward``), on the policy's threads (``_on_threads``)."""
        return self._on_threads(input_ids, self._forward, input_ids, state, last_logits_only)

    def forward_rows(self, input_ids: torch.Tensor, states: list) -> torch.Tensor:
        """One decode step of several sequences at once: ``input_ids`` [B] (the next token of each),
        ``states`` their B ``ModelState``s (different lengths; each updated in place). Returns the
        logits [B, V]. Attention and recurrent state run per sequence, the MLPs over all rows (see
        ``DecoderLayer.forward_rows``). In exact mode each row has the bits of ``forward`` on that
        sequence alone; in fast mode the rows share kernel calls (experts, dense MLPs, the head)."""
        return self._on_threads(input_ids.view(-1, 1), self._forward_rows, input_ids.view(-1, 1), states)

    # whether the layers' projections are held as encoded rows (routers aside): a quantized model, or
    # stored bf16 / f16 matrices. A few float f32 exceptions do not count: a matrix a GGUF transform
    # had to dequantize (Qwen3.5's out_proj, whose columns llama.cpp reorders), a shared-expert gate
    # llama.cpp stores F32. Their SGEMM on one torch thread costs less than torch's second thread
    # spinning beside the native pool (hybrid Q4_K_M file, 32-token prompt, one process, torch on one
    # thread vs two: 130-132 vs 95-120 tok/s; 128 tokens 160-170 either way). Computed once.
    _encoded = None

    def _matrices_encoded(self) -> bool:
        if self._encoded is None:
            self._encoded = any(m.qweight is not None for layer in self._layers for m in layer.modules()
                                if isinstance(m, Linear) and not isinstance(m, Router))
        return self._encoded

    def _on_threads(self, input_ids: torch.Tensor, fn, *args):
        """``fn(*args)`` with torch on the policy's threads for this input. One-token CPU steps
        (decode, also of several sequences) run torch on ``decode_torch_threads`` (with the native
        kernels doing the heavy products on their own threads, torch's small per-token ops run
        faster on one thread than fighting them for the cores: q4_k_m decode 35 -> 43 tok/s) and
        keep the native pool spinning meanwhile. So do steps of at most NATIVE_GEMM_MAX_TOKENS
        tokens of a model whose projections are encoded, where the matrix products are native
        too (a short prompt, a prompt's last chunk): torch's two threads spinning beside the native
        pool's made its small ops take milliseconds (Q4_K_M, 32 tokens: 117 -> 173 tok/s; 128: 199 ->
        221; from 256 tokens the resident matrices are torch's SGEMM again and keep the budget)."""
        policy = self.exec.policy
        if input_ids.device.type != "cpu":
            return fn(*args)
        native_step = input_ids.shape[-1] == 1 or (input_ids.numel() <= kernels.NATIVE_GEMM_MAX_TOKENS
                                                   and self._matrices_encoded())
        threads = policy.decode_torch_threads if native_step else policy.torch_threads
        saved = torch.get_num_threads()
        if not threads or saved == threads:
            with affinity.bound(policy.bind_cpus, saved):
                return fn(*args)
        torch.set_num_threads(threads)
        # torch on one thread: keep the native workers awake across the step's many calls
        spin = native.set_spin(policy.decode_spin) if native_step and policy.decode_torch_threads else None
        try:
            with affinity.bound(policy.bind_cpus, threads):
                return fn(*args)
        finally:
            if spin is not None:
                native.set_spin(spin)
            torch.set_num_threads(saved)

    def _forward_rows(self, input_ids: torch.Tensor, states: list) -> torch.Tensor:
        if len(states) != input_ids.shape[0]:
            raise ValueError(f"forward_rows: {input_ids.shape[0]} tokens for {len(states)} states")
        row_exact = self.exec.policy.kernel_mode == "exact"
        x = self.model.embed_tokens(input_ids)             # [B, 1, H]
        if self.embed_scale != 1.0:
            x = x * self.embed_scale
        ropes = [None] * len(states)
        if self.rotary is not None:
            ropes = [self.rotary.tables(s.num_tokens, 1, x.dtype, x.device) for s in states]
        for i, layer in enumerate(self._layers):
            x = layer.forward_rows(x, ropes, [s.layers[i] for s in states], row_exact)
        for s in states:
            s.num_tokens += 1
        if row_exact:
            return torch.cat([self._head(self.model.norm(x[b:b + 1])) for b in range(x.shape[0])])[:, -1]
        return self._head(self.model.norm(x))[:, -1]

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        if self.lm_head is None:
            return self.model.embed_tokens.as_head(x)
        return self.lm_head(x)

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
        return self._head(self.model.norm(x))
