"""The decode loop (it exists once): prefill in chunks, then sample token by token.

``Generator.start`` returns a ``Generation``: iterate it for token ids, or drive it with ``step()``
(the server interleaves several generations, one step each in turn). Per-token control comes from
``TokenHook``s — forced tokens (a thinking budget running out), logit masks (grammar-constrained
tool calls and JSON) — and the caller may ``stop()`` a generation between tokens (a stop string
matched, the client left). With a ``PrefixCache`` the generator starts each prompt from the longest
snapshot it extends and takes new snapshots (see ``generate/prefix.py``).
"""
from __future__ import annotations

from typing import Iterable, Iterator, Optional, Sequence

import torch

from lean_qwenflash.generate.prefix import PrefixCache
from lean_qwenflash.generate.sampling import Sampler, SamplingParams
from lean_qwenflash.generate.state import ModelState, new_state


class TokenHook:
    """Per-token control of one generation; every method is optional (the defaults do nothing).

    Called in this order for each new token: ``forced()`` (a token to emit without sampling, or
    None), then, only when sampling, ``mask(logits)`` (return the logits with disallowed tokens at
    -inf), then ``observe(token)`` for the token emitted, forced or sampled.
    """

    def forced(self) -> Optional[int]:
        return None

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def observe(self, token_id: int) -> None:
        pass


class Generation:
    """One running generation. Iterating yields token ids; ``step()`` advances by one unit of work
    (a prefill chunk or one token) and returns the new token id or None.

    After it ends, ``finish_reason`` is "stop" (a stop token, or ``stop("stop")``), "length", or
    what ``stop()`` was given; ``state`` covers the prompt and every yielded token but the last.
    """

    def __init__(self, gen: "Generator", prompt_ids: list[int], sampler: Sampler, max_new_tokens: int,
                 stop: set, state: ModelState, hooks: Sequence[TokenHook], checkpoints: Sequence[int]):
        self.generator = gen
        self.prompt_ids = prompt_ids
        self.sampler = sampler
        self.max_new_tokens = max_new_tokens
        self.stop_ids = stop
        self.state = state
        self.hooks = list(hooks)
        self.cached_tokens = state.num_tokens       # prompt tokens reused from a snapshot
        # where snapshots go: nowhere when the state cannot say which tokens it holds
        self.cache = gen.prefix_cache if state.tokens is not None else None
        self.checkpoints = sorted(p for p in set(checkpoints) if self.cached_tokens < p < len(prompt_ids))
        self.num_generated = 0
        self.prefilled = False
        self.done = False
        self.finish_reason: Optional[str] = None
        self._stop_request: Optional[str] = None
        self._boundary: Optional[ModelState] = None
        self._closed = False
        self._steps = self._run()

    # -- driving ------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[int]:
        while not self.done:
            token = self.step()
            if token is not None:
                yield token
        self.close()

    def step(self) -> Optional[int]:
        """One unit of work; the new token id, or None (a prefill chunk, or the end: see ``done``)."""
        if self.done:
            return None
        try:
            return next(self._steps)
        except StopIteration:
            self.done = True
            return None
        except BaseException:
            self.done = True
            self.finish_reason = self.finish_reason or "error"
            raise

    def stop(self, reason: str = "stop") -> None:
        """End before the next token is computed; ``reason`` becomes ``finish_reason``."""
        if self._stop_request is None:
            self._stop_request = reason

    def close(self) -> None:
        """Store the end-of-generation snapshots in the prefix cache (once; after the caller has
        answered its client, so this costs the client no latency). The state is not used again."""
        if self._closed:
            return
        self._closed = True
        cache = self.cache
        if cache is None or self.finish_reason == "error":
            return      # (an interrupted step may have left the state half-updated: never keep it)
        if self._boundary is not None:
            cache.put(self._boundary, copy=False)
        if self.prefilled:
            cache.put(self.state, copy=False)

    # -- the loop -------------------------------------------------------------------------------

    def _run(self):
        gen, state, prompt, cache = self.generator, self.state, self.prompt_ids, self.cache
        if self.max_new_tokens == 0:
            self.finish_reason = "length"
            return
        pos = state.num_tokens
        logits = None
        # Prefill in chunks, snapshotting at the caller's checkpoints and at the prompt's end.
        for mark in self.checkpoints + [len(prompt)]:
            while pos < mark:
                if self._stop_request is not None:      # e.g. the client left during a long prefill
                    self.finish_reason = self._stop_request
                    return
                end = min(mark, pos + gen.prefill_chunk_tokens)
                logits = gen.feed(prompt[pos:end], state)
                pos = end
                if pos < len(prompt):
                    yield None
            if cache is not None:
                cache.put(state)
        self.prefilled = True
        for step in range(self.max_new_tokens):
            if self._stop_request is not None:
                self.finish_reason = self._stop_request
                return
            token = None
            for hook in self.hooks:
                token = hook.forced()
                if token is not None:
                    break
            if token is None:
                for hook in self.hooks:
                    logits = hook.mask(logits)
                token = self.sampler.sample(logits)
                if token in self.stop_ids:
                    self.finish_reason = "stop"
                    return
            self.sampler.observe(token)
            for hook in self.hooks:
                hook.observe(token)
            self.num_generated += 1
            yield token
            if self._stop_request is not None:
                self.finish_reason = self._stop_request
                return
            if step + 1 == self.max_new_tokens:
                break
            logits = gen.feed([token], state)
            if cache is not None and state.num_tokens % gen.block_tokens == 0:
                self._boundary = state.clone()
        self.finish_reason = "length"


class Generator:
    """Runs sequences on a model built by ``lean_qwenflash.models``.

    ``prefill_chunk_tokens`` bounds the activations of one prefill forward (long prompts are fed
    in chunks that continue the same state). ``prefix_cache`` (optional) enables prefix reuse.
    """

    block_tokens = 64       # while generating, a snapshot is kept at the last multiple of this

    def __init__(self, model, prefill_chunk_tokens: int = 512, prefix_cache: Optional[PrefixCache] = None):
        if prefill_chunk_tokens < 1:
            raise ValueError(f"prefill_chunk_tokens={prefill_chunk_tokens} must be >= 1")
        self.model = model
        self.prefill_chunk_tokens = prefill_chunk_tokens
        # None when there is no cache or it is off (capacity 0): one test everywhere below
        self.prefix_cache = prefix_cache if prefix_cache is not None and prefix_cache.enabled else None
        embed = model.model.embed_tokens
        self.device = (embed.qweight.raw if embed.qweight is not None else embed.weight).device
        self.vocab_size = embed.num_embeddings
        self._token_buf = torch.empty(1, 1, dtype=torch.long, device=self.device)

    def new_state(self) -> ModelState:
        return new_state(self.model)

    def feed(self, token_ids: Sequence[int], state: ModelState) -> torch.Tensor:
        """Run ``token_ids`` through the model, continuing ``state``; the logits [V] after the last."""
        if len(token_ids) == 1:
            self._token_buf.fill_(int(token_ids[0]))
            ids = self._token_buf
        else:
            ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.device)
        logits = self.model(ids, state, last_logits_only=True)[0, -1]
        if state.tokens is not None:
            state.tokens.extend(int(t) for t in token_ids)
        return logits

    def prefill(self, token_ids: Sequence[int], state: ModelState) -> torch.Tensor:
        """Feed ``token_ids`` into ``state`` in chunks; returns the logits [V] after the last one."""
        logits = None
        for start in range(0, len(token_ids), self.prefill_chunk_tokens):
            logits = self.feed(token_ids[start:start + self.prefill_chunk_tokens], state)
        return logits

    def start(self, prompt_ids: Sequence[int], params: SamplingParams = SamplingParams(),
              max_new_tokens: int = 256, stop_token_ids: Iterable[int] = (),
              state: Optional[ModelState] = None, hooks: Sequence[TokenHook] = (),
              checkpoints: Sequence[int] = ()) -> Generation:
        """A ``Generation`` of up to ``max_new_tokens`` new tokens; a sampled stop token ends it
        unyielded (a forced one does not). Nothing runs until it is iterated or stepped.

        ``state``, when given, already holds the first ``state.num_tokens`` tokens of
        ``prompt_ids``; only the rest is prefilled, and the state is updated in place. Without one,
        the prefix cache (if any) supplies the longest snapshot the prompt extends.
        ``checkpoints``: prompt lengths worth a snapshot (e.g. turn boundaries).
        """
        prompt_ids = [int(t) for t in prompt_ids]
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0")
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} outside the vocabulary [0, {self.vocab_size})")
        if state is None and self.prefix_cache is not None:
            state = self.prefix_cache.lookup(prompt_ids)
        if state is None:
            state = self.new_state()
        if not state.num_tokens < len(prompt_ids):
            raise ValueError(f"the prompt ({len(prompt_ids)} tokens) must extend the state's "
                             f"{state.num_tokens} tokens by at least one")
        if state.tokens is not None and (len(state.tokens) != state.num_tokens
                                         or state.tokens != prompt_ids[:state.num_tokens]):
            state.tokens = None      # the caller's state holds other tokens than it claims: don't cache it
        sampler = Sampler(params, self.vocab_size, prompt_ids, self.device)
        return Generation(self, prompt_ids, sampler, max_new_tokens, set(int(t) for t in stop_token_ids),
                          state, hooks, checkpoints)

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams = SamplingParams(),
                 max_new_tokens: int = 256, stop_token_ids: Iterable[int] = (),
                 state: Optional[ModelState] = None, hooks: Sequence[TokenHook] = ()) -> Generation:
        """``start`` under its older name: iterate the result for the token ids."""
        return self.start(prompt_ids, params, max_new_tokens, stop_token_ids, state, hooks)
