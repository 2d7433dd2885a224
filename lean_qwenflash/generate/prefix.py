"""Prefix reuse: an LRU of ``ModelState`` snapshots keyed by the token ids they cover.

DeltaNet recurrent state cannot be rewound, so a later prompt can only continue from a whole
snapshot taken at a point it extends. ``Generator`` takes snapshots where a later prompt is likely
to extend (prompt ends, turn boundaries the caller names, the last block boundary reached while
generating, the end of generation) and starts each prompt from the longest strict prefix held.
One cache serves the server and the terminal chat.
"""
from __future__ import annotations

import collections
from typing import Optional, Sequence

from lean_qwenflash.generate.state import ModelState


class PrefixCache:
    """Snapshots bounded in bytes (state bytes + 8 per key token), least recently used evicted.

    Not thread-safe: one thread (the server's engine worker, or the REPL) owns it.
    """

    def __init__(self, capacity_bytes: int):
        if capacity_bytes < 0:
            raise ValueError(f"prefix cache capacity {capacity_bytes} must be >= 0 (0 = off)")
        self.capacity_bytes = capacity_bytes
        self._entries: collections.OrderedDict[tuple, tuple[ModelState, int]] = collections.OrderedDict()
        self.used_bytes = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def enabled(self) -> bool:
        return self.capacity_bytes > 0

    def lookup(self, token_ids: Sequence[int]) -> Optional[ModelState]:
        """A fresh copy of the longest snapshot that is a strict prefix of ``token_ids``, or None."""
        best = None
        for key in self._entries:
            if len(key) < len(token_ids) and (best is None or len(key) > len(best)) and tuple(token_ids[:len(key)]) == key:
                best = key
        if best is None:
            return None
        self._entries.move_to_end(best)
        return self._entries[best][0].clone()

    def put(self, state: ModelState, copy: bool = True) -> None:
        """Keep ``state`` (a copy unless ``copy=False``: for a caller that will not touch it again),
        keyed by the tokens it covers (``state.tokens``)."""
        if state.tokens is None or len(state.tokens) != state.num_tokens:
            raise ValueError("a prefix snapshot must know the tokens it covers (state.tokens)")
        key = tuple(state.tokens)
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        if not key:
            return
        nbytes = state.nbytes() + 8 * len(key)
        if nbytes > self.capacity_bytes:
            return
        while self.used_bytes + nbytes > self.capacity_bytes and self._entries:
            _, (_, old) = self._entries.popitem(last=False)
            self.used_bytes -= old
            self.evictions += 1
        self._entries[key] = (state.clone() if copy else state, nbytes)
        self.used_bytes += nbytes
