"""Prefix reuse: an LRU of ``ModelState`` snapshots keyed by the token ids they cover.

DeltaNet recurrent state cannot be rewound, so a later prompt can only continue from a whole
snapshot taken at a point it extends. ``Generator`` takes snapshots where a later prompt is likely
to extend (prompt ends, turn boundaries the caller names, the last block boundary reached while
generating, the end of generation) and starts each prompt from the longest strict prefix held.
One cache serves the server and the terminal chat.

With a ``SnapshotDir`` (``generate/snapshots.py``) the cache has a second tier: a snapshot pushed
out of RAM is written to disk (and ``flush()`` writes the rest, at shutdown), a lookup considers
both tiers and a snapshot found only on disk is read back (checked) into RAM. Files survive the
process: a new cache over the same directory and fingerprint finds them.
"""
from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Optional, Sequence

from lean_qwenflash.generate.state import ModelState

if TYPE_CHECKING:
    from lean_qwenflash.generate.snapshots import SnapshotDir


class PrefixCache:
    """Snapshots bounded in bytes (state bytes + 8 per key token), least recently used evicted.

    Not thread-safe: one thread (the server's engine worker, or the REPL) owns it.
    """

    def __init__(self, capacity_bytes: int, disk: Optional["SnapshotDir"] = None):
        if capacity_bytes < 0:
            raise ValueError(f"prefix cache capacity {capacity_bytes} must be >= 0 (0 = off)")
        self.capacity_bytes = capacity_bytes
        self.disk = disk if disk is not None and disk.capacity_bytes > 0 else None
        self._entries: collections.OrderedDict[tuple, tuple[ModelState, int]] = collections.OrderedDict()
        self.used_bytes = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def enabled(self) -> bool:
        return self.capacity_bytes > 0 or self.disk is not None

    @staticmethod
    def _prefixes(keys, token_ids: Sequence[int]) -> list:
        """The keys that are strict prefixes of ``token_ids``, longest first."""
        n = len(token_ids)
        found = [k for k in keys if 0 < len(k) < n and token_ids[len(k) - 1] == k[-1]
                 and tuple(token_ids[:len(k)]) == k]
        return sorted(found, key=len, reverse=True)

    def lookup(self, token_ids: Sequence[int]) -> Optional[ModelState]:
        """A fresh copy of the longest snapshot that is a strict prefix of ``token_ids``, or None.
        One held only on disk is restored (and kept in RAM); a file that fails its checks is
        deleted and the next longest is tried."""
        ram = self._prefixes(self._entries, token_ids)
        best = ram[0] if ram else None
        if self.disk is not None:
            for key in self._prefixes(self.disk.keys(), token_ids):
                if best is not None and len(key) <= len(best):
                    break
                state = self.disk.read(key)
                if state is not None:
                    # kept in RAM: the caller gets a copy; too big for RAM: the only copy
                    return state.clone() if self._insert(key, state, state.nbytes() + 8 * len(key)) else state
        if best is None:
            return None
        self._entries.move_to_end(best)
        return self._entries[best][0].clone()

    def _insert(self, key: tuple, state: ModelState, nbytes: int) -> bool:
        """Hold ``state`` (counted as ``nbytes``) in RAM, evicting the least recently used (to disk,
        when there is one); False when it is larger than the whole RAM tier."""
        if nbytes > self.capacity_bytes:
            return False
        while self.used_bytes + nbytes > self.capacity_bytes and self._entries:
            _, (old, old_bytes) = self._entries.popitem(last=False)
            self.used_bytes -= old_bytes
            self.evictions += 1
            if self.disk is not None:
                self.disk.write(old)
        self._entries[key] = (state, nbytes)
        self.used_bytes += nbytes
        return True

    def flush(self) -> int:
        """Write every snapshot held only in RAM to the disk tier (at shutdown, so a restart finds
        them); returns how many were written."""
        if self.disk is None:
            return 0
        written = 0
        for key, (state, _) in list(self._entries.items()):
            if key not in self.disk:
                written += self.disk.write(state)
        return written

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
        nbytes = state.nbytes() + 8 * len(key)     # (what was put, spare KV capacity included)
        if nbytes > self.capacity_bytes:
            if self.disk is not None:       # too big for RAM: straight to disk (no copy needed)
                self.disk.write(state)
            return
        self._insert(key, state.clone() if copy else state, nbytes)
