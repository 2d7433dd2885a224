"""Sampling parameters (validated) and next-token selection from logits."""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from typing import Optional

import torch

from lean_qwenflash.common import check_sampling


@dataclass(frozen=True)
class SamplingParams:
    """How to pick each next token.

    ``temperature`` 0 means greedy. ``top_k`` 0 and ``top_p`` 1 and ``min_p`` 0 disable those
    filters. ``repetition_penalty`` (1 = off) divides positive / multiplies negative logits of every
    token seen in the prompt or output; ``presence_penalty`` and ``frequency_penalty`` (OpenAI
    semantics, 0 = off) subtract per output token. ``seed`` makes sampling reproducible.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: Optional[int] = None

    def __post_init__(self):
        check_sampling(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)})

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0


class Sampler:
    """Picks tokens for one sequence; keeps the token counts penalties need."""

    def __init__(self, params: SamplingParams, vocab_size: int, prompt_ids: list[int], device="cpu"):
        self.params = params
        self.generator = None
        if not params.greedy:
            self.generator = torch.Generator(device=device)
            # Without a seed draw one from the OS: torch.seed() would reseed the global RNG.
            seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
            self.generator.manual_seed(seed)
        self.seen = self.output_counts = None
        if params.has_penalties:
            self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            self.seen[torch.tensor(prompt_ids, device=device)] = True
            self.output_counts = torch.zeros(vocab_size, dtype=torch.float32, device=device)

    def observe(self, token_id: int) -> None:
        """Record an emitted token (for penalties)."""
        if self.seen is not None:
            self.seen[token_id] = True
            self.output_counts[token_id] += 1

    def sample(self, logits: torch.Tensor) -> int:
        """logits [V] -> next token id."""
        p = self.params
        logits = logits.float()
        if self.seen is not None:
            logits = logits.clone()
            if p.repetition_penalty != 1:
                penalised = torch.where(logits > 0, logits / p.repetition_penalty, logits * p.repetition_penalty)
                logits = torch.where(self.seen, penalised, logits)
            logits -= p.frequency_penalty * self.output_counts + p.presence_penalty * (self.output_counts > 0)
        if p.greedy:
            return int(torch.argmax(logits))
        scaled = logits / p.temperature
        if not bool(torch.isfinite(scaled.max())):
            # A tiny temperature overflows the division (or rounds to 0 in float32), and softmax
            # of inf is nan: sampling at that temperature is picking the best token.
            return int(torch.argmax(logits))
        logits = scaled
        if p.top_k and p.top_k < logits.shape[-1]:
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, -math.inf)
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1:
            sorted_probs, order = torch.sort(probs, descending=True)
            # Keep the smallest prefix whose mass reaches top_p (always at least the best token).
            drop = (sorted_probs.cumsum(-1) - sorted_probs) >= p.top_p
            probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
        if p.min_p > 0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        return int(torch.multinomial(probs, 1, generator=self.generator))
