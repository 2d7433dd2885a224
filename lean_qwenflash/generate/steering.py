"""The thinking budget as a ``TokenHook``: the server and the REPL share it.

A reasoning model writes its thoughts in a think block (``<think>`` ... ``</think>``); once the
budget is spent inside it, the close (e.g. "\\n</think>\\n\\n") is forced and the answer follows.
"""
from __future__ import annotations

from typing import Optional, Sequence

from lean_qwenflash.generate.generator import TokenHook


class Steering(TokenHook):
    """The thinking budget: once ``think_budget`` tokens were generated inside the think block,
    ``close_ids`` (e.g. "\\n</think>\\n\\n") are forced.

    ``in_think``: the prompt opened ``<think>``. ``close_id`` is the single token that closes a
    think block (budgets need one; both Qwen3's and our tokenizer have it). ``in_think`` is also
    the gate of the answer's grammar (it applies once the think block is closed).
    """

    def __init__(self, open_id: Optional[int], close_id: Optional[int], close_ids: Sequence[int],
                 think_budget: Optional[int], in_think: bool):
        self.open_id, self.close_id = open_id, close_id
        self.close_ids = list(close_ids)
        self.think_budget = think_budget
        self.in_think = in_think
        self.think_tokens = 0           # tokens generated inside the think block (forced close included)
        self.forced_closed = False
        self.pending: list[int] = []

    def forced(self) -> Optional[int]:
        if (not self.pending and self.in_think and self.think_budget is not None and self.close_id is not None
                and self.think_tokens >= self.think_budget):
            self.pending = list(self.close_ids)
            self.forced_closed = True
        return self.pending.pop(0) if self.pending else None

    def observe(self, token_id: int) -> None:
        if self.in_think:
            self.think_tokens += 1
            if token_id == self.close_id:
                self.in_think = False
        elif token_id == self.open_id and self.think_tokens == 0:
            self.in_think = True
