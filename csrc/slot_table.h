// The state of a fixed set of record-sized cache slots (an expert cache tier): which key each slot
// holds, its state (EMPTY / READING / READY), its pin count, and the LRU order of the evictable
// slots. Python's experts/cache.py SlotCache is the API; this is its storage, kept native because
// a decode step looks its experts up right after kernels that flushed the CPU caches, where every
// Python object touched costs a memory round trip.
//
// Keys are (group, item) pairs of non-negative ints (a streaming provider's (layer, expert));
// held(group) counts the keys of a group that have a slot.
//
// Invariant: a slot is in the LRU list exactly when it holds a key, is READY and has no pins.
#pragma once

#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <utility>
#include <vector>

namespace lqf {

class SlotTable {
   public:
    enum State : uint8_t { EMPTY = 0, READING = 1, READY = 2 };

    explicit SlotTable(int num_slots);

    int num_slots() const { return static_cast<int>(key_.size()); }
    int lookup(int64_t key) const;                  // -1: no slot holds it
    void pin(int slot);
    void unpin(int slot);                            // throws std::logic_error below zero
    void mark_ready(int slot);
    void make_cold(int slot);                        // first in line for eviction, if evictable
    // A slot for `key` in state READING: a free one, else the least recently used evictable one
    // (its old key in *evicted, else -1). Returns -1 when every slot is busy.
    int allocate(int64_t key, int64_t* evicted);
    void drop(int slot);                             // forget its contents (a failed read)
    // All-or-nothing: when every key has a slot, pin them in order and write the slots; else
    // pin nothing and return false.
    bool pin_present(const int64_t* keys, int n, int* slots);
    void unpin_all(const int* slots, int n);

    int64_t key_of(int slot) const { return key_[check(slot)]; }   // -1: none
    int state(int slot) const { return state_[check(slot)]; }
    int pins(int slot) const { return pins_[check(slot)]; }
    int held(int64_t group) const;
    const std::vector<int32_t>& held_by_group() const { return held_; }
    size_t size() const { return slot_of_.size(); }
    int num_pinned() const;
    std::vector<std::pair<int64_t, int>> items() const;            // (key, slot), any order
    std::vector<int> lru_order() const;                            // least recent first

    // A key's one encoding: group << 32 | item (std::invalid_argument unless 0 <= group < 2^31
    // and 0 <= item < 2^32).
    static int64_t key(int64_t group, int64_t item);
    static int64_t group_of(int64_t key) { return key >> 32; }
    static int64_t item_of(int64_t key) { return key & 0xffffffffLL; }

   private:
    int check(int slot) const;
    void lru_remove(int slot);
    void lru_push_back(int slot);
    void maybe_evictable(int slot);
    void count(int64_t key, int delta);

    std::vector<int64_t> key_;
    std::vector<uint8_t> state_;
    std::vector<int32_t> pins_;
    std::vector<int32_t> prev_, next_;               // LRU links; -1 ends
    std::vector<uint8_t> in_lru_;
    int head_ = -1, tail_ = -1;
    std::vector<int32_t> free_;                      // popped from the back: slot 0 first
    std::unordered_map<int64_t, int32_t> slot_of_;
    std::vector<int32_t> held_;                      // by group
};

}  // namespace lqf
