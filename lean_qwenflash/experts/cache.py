"""A fixed set of record-sized slots with LRU replacement and pinning.

Invariant: a slot is evictable only when it is in ``lru``, i.e. it holds complete, verified
bytes (no read or copy in flight) and nothing is computing with it (pin count 0). Everything else
(pinned, reading, copying) is simply absent from ``lru`` and so can never be handed to another
expert.
"""
from __future__ import annotations

from collections import Counter, OrderedDict
from typing import Callable, Hashable, Optional

EMPTY, READING, READY = 0, 1, 2


class SlotCache:
    """``group_of`` (optional): a key's group (a streaming provider's: the layer); ``held[g]`` then
    counts the keys of group g that have a slot (READING or READY)."""

    def __init__(self, num_slots: int, group_of: Optional[Callable] = None):
        self.num_slots = num_slots
        self.group_of = group_of
        self.held: Counter = Counter()
        self.key_of: list = [None] * num_slots
        self.slot_of: dict = {}
        self.state = [EMPTY] * num_slots
        self.pins = [0] * num_slots
        self.lru: "OrderedDict[int, None]" = OrderedDict()   # evictable slots, least recent first
        self.free = list(range(num_slots - 1, -1, -1))

    def lookup(self, key: Hashable) -> Optional[int]:
        return self.slot_of.get(key)

    def lookup_all(self, keys) -> list:
        """``lookup`` of each key (None where it has no slot)."""
        get = self.slot_of.get
        return [get(k) for k in keys]

    def pin(self, slot: int) -> None:
        self.pins[slot] += 1
        self.lru.pop(slot, None)

    def unpin(self, slot: int) -> None:
        self.pins[slot] -= 1
        assert self.pins[slot] >= 0, "slot unpinned more often than pinned"
        self._maybe_evictable(slot)

    def pin_all(self, slots) -> None:
        """``pin`` of each slot, in order (a hot path: one call for a layer's experts)."""
        pins, lru_pop = self.pins, self.lru.pop
        for slot in slots:
            pins[slot] += 1
            lru_pop(slot, None)

    def unpin_all(self, slots) -> None:
        """``unpin`` of each slot, in order."""
        pins, state, key_of, lru = self.pins, self.state, self.key_of, self.lru
        for slot in slots:
            n = pins[slot] - 1
            assert n >= 0, "slot unpinned more often than pinned"
            pins[slot] = n
            if n == 0 and state[slot] == READY and key_of[slot] is not None:
                lru[slot] = None          # (a pinned slot is never in lru: this appends it)

    def mark_ready(self, slot: int) -> None:
        self.state[slot] = READY
        self._maybe_evictable(slot)

    def _maybe_evictable(self, slot: int) -> None:
        if self.pins[slot] == 0 and self.state[slot] == READY and self.key_of[slot] is not None:
            self.lru[slot] = None
            self.lru.move_to_end(slot)

    def make_cold(self, slot: int) -> None:
        """Put an evictable slot first in line for eviction (its contents live on elsewhere)."""
        if slot in self.lru:
            self.lru.move_to_end(slot, last=False)

    def allocate(self, key: Hashable):
        """A slot for ``key`` in state READING: a free one, else the least recently used
        evictable one. Returns (slot, evicted_key) or (None, None) when every slot is busy."""
        if self.free:
            slot, old = self.free.pop(), None
        elif self.lru:
            slot, _ = self.lru.popitem(last=False)
            old = self.key_of[slot]
            del self.slot_of[old]
            if self.group_of is not None:
                self.held[self.group_of(old)] -= 1
        else:
            return None, None
        if self.group_of is not None:
            self.held[self.group_of(key)] += 1
        self.key_of[slot] = key
        self.slot_of[key] = slot
        self.state[slot] = READING
        return slot, old

    def drop(self, slot: int) -> None:
        """Forget a slot's contents (after a failed read)."""
        key = self.key_of[slot]
        if key is not None:
            self.slot_of.pop(key, None)
            if self.group_of is not None:
                self.held[self.group_of(key)] -= 1
        self.key_of[slot] = None
        self.state[slot] = EMPTY
        self.lru.pop(slot, None)
        if self.pins[slot] == 0:
            self.free.append(slot)
