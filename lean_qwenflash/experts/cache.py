"""A fixed set of record-sized slots with pinning and LRU or LFU replacement.

Policies (``cache_policy``): ``lru`` evicts the least recently released expert; ``lfu`` the one
the model used least (its use counts halve every ``DECAY_SLOTS`` x slots uses, so popularity
fades; a speculative read counts the use it was read for), least recently released among equals.
Routing that favours some experts (real MoE models do, per layer) keeps them cached under
``lfu``; ``experts/trace.py`` replays a routing trace under either rule.

Invariant: a slot is evictable only when it is in the eviction order, i.e. it holds complete, verified
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

EMPTY, READING, READY = SlotTable.EMPTY, SlotTable.READING, SlotTable.READY
DECAY_SLOTS = SlotTable.DECAY_SLOTS     # lfu: use counts halve every DECAY_SLOTS * slots uses


class SlotCache:
    """The table's calls under their cache names; keys as (group, item) tuples, None for "none".

    Straight to the table (no Python frame in between: a decode step's hot path):
    ``pin(slot)``, ``unpin(slot)`` (RuntimeError below zero), ``mark_ready(slot)``,
    ``make_cold(slot)`` (first in line for eviction, its contents living on elsewhere),
    ``drop(slot)`` (forget its contents after a failed read), ``pin_present(group, items)`` (when
    every (group, item) has a slot: pin them in order and return the slots; else None, nothing
    pinned), ``unpin_all(slots)``, ``key_of(slot)``, ``state(slot)``, ``pins(slot)``,
    ``held_in(group)``, ``num_keys()``, ``num_pinned()``, ``eviction_order()`` (evictable slots,
    the next victim first), ``uses(group, item)`` (lfu: a key's decayed use count).
    """

    def __init__(self, num_slots: int, policy: str = "lru", decay_every: int = 0):
        self.num_slots = num_slots
        t = self._t = SlotTable(num_slots, policy, decay_every)     # (ValueError naming an unknown policy)
        self.policy = t.policy
        self.pin, self.unpin, self.mark_ready, self.make_cold, self.drop = t.pin, t.unpin, t.mark_ready, t.make_cold, t.drop
        self.pin_present, self.unpin_all = t.pin_present, t.unpin_all
        self.key_of, self.state, self.pins = t.key_of, t.state, t.pins
        self.held_in, self.num_keys, self.num_pinned = t.held, t.__len__, t.num_pinned
        self.eviction_order, self.uses = t.eviction_order, t.uses

    def lookup(self, key) -> Optional[int]:
        slot = self._t.lookup(*key)
        return None if slot < 0 else slot

    def allocate(self, key):
        """A slot for ``key`` in state READING: a free one, else the policy's next victim.
        Returns (slot, evicted_key) or (None, None) when every slot is busy."""
        slot, old = self._t.allocate(*key)
        return (None, None) if slot < 0 else (slot, old)

    @property
    def held(self) -> Counter:
        """Keys with a slot, counted by group (the table's own counts)."""
        return Counter({g: n for g, n in enumerate(self._t.held_by_group()) if n})

    @property
    def slot_of(self) -> dict:
        """{key: slot} of every key with a slot (a copy)."""
        return self._t.items()
