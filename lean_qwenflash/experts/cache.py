"""A fixed set of record-sized slots with LRU replacement and pinning.

Invariant: a slot is evictable only when it is in the LRU order, i.e. it holds complete, verified
bytes (no read or copy in flight) and nothing is computing with it (pin count 0). Everything else
(pinned, reading, copying) is simply absent from it and so can never be handed to another expert.

Keys are ``(group, item)`` pairs of non-negative ints (a streaming provider's ``(layer, expert)``);
``held_in(group)`` counts the keys of a group that have a slot (READING or READY). The state lives
in a native ``SlotTable`` (csrc/slot_table.cpp): a decode step looks its experts up right after
kernels that flushed the CPU caches, where every Python object it touches costs a memory round trip.
"""
from __future__ import annotations

from collections import Counter
from typing import Optional

from ..io_engine import SlotTable

EMPTY, READING, READY = 0, 1, 2
_SHIFT = 32          # a key's native form: group << 32 | item


def _native(key) -> int:
    group, item = key
    if not (0 <= group < 1 << 31 and 0 <= item < 1 << _SHIFT):
        raise ValueError(f"slot cache key {key!r}: group and item must be non-negative ints")
    return (int(group) << _SHIFT) | int(item)


def _key(native: int):
    return (native >> _SHIFT, native & ((1 << _SHIFT) - 1))


class SlotCache:
    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self._t = SlotTable(num_slots)

    # -- one slot -------------------------------------------------------------------------------
    def lookup(self, key) -> Optional[int]:
        slot = self._t.lookup(_native(key))
        return None if slot < 0 else slot

    def pin(self, slot: int) -> None:
        self._t.pin(slot)

    def unpin(self, slot: int) -> None:
        self._t.unpin(slot)            # (RuntimeError when unpinned more often than pinned)

    def mark_ready(self, slot: int) -> None:
        self._t.mark_ready(slot)

    def make_cold(self, slot: int) -> None:
        """Put an evictable slot first in line for eviction (its contents live on elsewhere)."""
        self._t.make_cold(slot)

    def allocate(self, key):
        """A slot for ``key`` in state READING: a free one, else the least recently used
        evictable one. Returns (slot, evicted_key) or (None, None) when every slot is busy."""
        slot, old = self._t.allocate(_native(key))
        if slot < 0:
            return None, None
        return slot, (None if old < 0 else _key(old))

    def drop(self, slot: int) -> None:
        """Forget a slot's contents (after a failed read)."""
        self._t.drop(slot)

    def key_of(self, slot: int):
        k = self._t.key_of(slot)
        return None if k < 0 else _key(k)

    def state(self, slot: int) -> int:
        return self._t.state(slot)

    def pins(self, slot: int) -> int:
        return self._t.pins(slot)

    # -- many slots (a layer's experts in one call) ---------------------------------------------
    def pin_present(self, group: int, items: list) -> Optional[list]:
        """When every ``(group, item)`` has a slot: pin them in order and return the slots; else
        None, with nothing pinned. ``items``: a list of ints."""
        return self._t.pin_present(group, items)

    def unpin_all(self, slots: list) -> None:
        """``unpin`` of each slot, in order."""
        self._t.unpin_all(slots)

    # -- what it holds (statistics, tests) ------------------------------------------------------
    def held_in(self, group: int) -> int:
        return self._t.held(group)

    @property
    def held(self) -> Counter:
        """Keys with a slot, counted by group (the table's own counts)."""
        return Counter({g: n for g, n in enumerate(self._t.held_by_group()) if n})

    @property
    def slot_of(self) -> dict:
        """{key: slot} of every key with a slot (a copy)."""
        return {_key(k): s for k, s in self._t.items()}

    def num_keys(self) -> int:
        """How many keys have a slot."""
        return len(self._t)

    def num_pinned(self) -> int:
        return self._t.num_pinned()

    def lru_order(self) -> list:
        """The evictable slots, least recently used first."""
        return self._t.lru_order()
