"""Prefill (in chunks) + decode loop yielding token ids as they are produced."""
from __future__ import annotations

from typing import Iterable, Iterator, Optional, Sequence

import torch

from lean_qwenflash.generate.sampling import Sampler, SamplingParams
from lean_qwenflash.generate.state import ModelState, new_state


class Generator:
    """Runs one sequence at a time on a model built by ``lean_qwenflash.models``.

    ``prefill_chunk_tokens`` bounds the activations of one prefill forward (long prompts are fed
    in chunks that continue the same state).
    """

    def __init__(self, model, prefill_chunk_tokens: int = 512):
        if prefill_chunk_tokens < 1:
            raise ValueError(f"prefill_chunk_tokens={prefill_chunk_tokens} must be >= 1")
        self.model = model
        self.prefill_chunk_tokens = prefill_chunk_tokens
        embed = model.model.embed_tokens
        self.device = (embed.qweight.raw if embed.qweight is not None else embed.weight).device
        self.vocab_size = embed.num_embeddings

    def new_state(self) -> ModelState:
        return new_state(self.model)

    def prefill(self, token_ids: Sequence[int], state: ModelState) -> torch.Tensor:
        """Feed ``token_ids`` into ``state``; returns the logits [V] after the last one."""
        ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.device)
        logits = None
        for start in range(0, ids.shape[1], self.prefill_chunk_tokens):
            logits = self.model(ids[:, start:start + self.prefill_chunk_tokens], state, last_logits_only=True)
        return logits[0, -1]

    def generate(self, prompt_ids: Sequence[int], params: SamplingParams = SamplingParams(),
                 max_new_tokens: int = 256, stop_token_ids: Iterable[int] = (),
                 state: Optional[ModelState] = None) -> Iterator[int]:
        """Yield up to ``max_new_tokens`` new token ids; a stop token ends generation unyielded.

        ``state``, when given, already holds the first ``state.num_tokens`` tokens of
        ``prompt_ids`` (a prefix snapshot); only the rest is prefilled. It is updated in place:
        afterwards it covers the prompt and every yielded token except the last.
        """
        prompt_ids = [int(t) for t in prompt_ids]
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0")
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} outside the vocabulary [0, {self.vocab_size})")
        state = state if state is not None else self.new_state()
        if not state.num_tokens < len(prompt_ids):
            raise ValueError(f"the prompt ({len(prompt_ids)} tokens) must extend the state's "
                             f"{state.num_tokens} tokens by at least one")
        stop = set(int(t) for t in stop_token_ids)
        sampler = Sampler(params, self.vocab_size, prompt_ids, self.device)
        # Validation above runs at call time; the loop below runs as the caller iterates.
        return self._run(prompt_ids, sampler, max_new_tokens, stop, state)

    def _run(self, prompt_ids, sampler, max_new_tokens, stop, state) -> Iterator[int]:
        if max_new_tokens == 0:
            return
        logits = self.prefill(prompt_ids[state.num_tokens:], state)
        token_buf = torch.empty(1, 1, dtype=torch.long, device=self.device)
        for step in range(max_new_tokens):
            token = sampler.sample(logits)
            if token in stop:
                return
            yield token
            sampler.observe(token)
            if step + 1 == max_new_tokens:
                return
            token_buf.fill_(token)
            logits = self.model(token_buf, state)[0, -1]
