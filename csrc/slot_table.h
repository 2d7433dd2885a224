// The state of a fixed set of record-sized cache slots (an expert cache tier): which key each slot
// holds, its state (EMPTY / READING / READY), its pin count, and the order in which the evictable
// slots are evicted, by one of two policies:
//   LRU: least recently released first (a linked list over slot indices);
//   LFU: fewest uses first, then least recently released. A use is a pin (a lookup by the model);
//        every key's count is halved every decay_every pins, so that popularity fades; a slot
//        that becomes evictable by mark_ready (a speculative read landing, nothing pinned) counts
//        one use ahead (the one it was read for). A binary heap with stale entries skipped.
//   Both: make_cold puts a slot first in line (the latest first).
// Python's experts/cache.py SlotCache is the API; this is its storage, kept native because a decode
// step looks its experts up right after kernels that flushed the CPU caches, where every
// Python object touched costs a memory round trip.
//
// Keys are (group, item) pairs of non-negative ints (a streaming provider's (layer, expert));
// held(group) counts the keys of a group that have a slot.
//
// Invariant: a slot is evictable (in the eviction order) exactly when it holds a key, is READY and
// has no pins.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace lqf {

class SlotTable {
   public:
    enum State : uint8_t { EMPTY = 0, READING = 1, READY = 2 };
    enum Policy : uint8_t { LRU = 0, LFU = 1 };
    static constexpr int64_t kDecaySlots = 32;      // LFU's default decay_every: this many pins per slot

    // decay_every (LFU): pins between two halvings of the use counts; 0: kDecaySlots * num_slots.
    explicit SlotTable(int num_slots, Policy policy = LRU, int64_t decay_every = 0);
    static Policy policy_named(const std::string& name);   // "lru" / "lfu"; std::invalid_argument else
    Policy policy() const { return policy_; }
    int64_t decay_every() const { return decay_every_; }

    int num_slots() const { return static_cast<int>(key_.size()); }
    int lookup(int64_t key) const;                  // -1: no slot holds it
    void pin(int slot);
    void unpin(int slot);                            // throws std::logic_error below zero
    void mark_ready(int slot);
    void make_cold(int slot);                        // first in line for eviction, if evictable
    // A slot for `key` in state READING: a free one, else the first evictable one in the policy's
    // order (its old key in *evicted, else -1). Returns -1 when every slot is busy.
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
    std::vector<int> eviction_order() const;                       // the next victim first
    uint32_t uses(int64_t key) const;                              // LFU's count of a key (0: LRU)

    // A key's one encoding: group << 32 | item (std::invalid_argument unless 0 <= group < 2^31
    // and 0 <= item < 2^32).
    static int64_t key(int64_t group, int64_t item);
    static int64_t group_of(int64_t key) { return key >> 32; }
    static int64_t item_of(int64_t key) { return key & 0xffffffffLL; }

   private:
    int check(int slot) const;
    void lru_remove(int slot);
    void lru_push_back(int slot);
    void maybe_evictable(int slot, int ahead);
    void evictable_remove(int slot);
    void pin_one(int slot);
    int take_victim();
    void count(int64_t key, int delta);
    void used(int slot);
    // LFU: an entry of the heap; valid while its slot is evictable with this very order stamp.
    struct Entry {
        int64_t rank, order;
        int32_t slot;
        bool operator>(const Entry& o) const { return rank != o.rank ? rank > o.rank : order > o.order; }
    };
    void heap_push(int slot, int64_t rank, int64_t order);
    void heap_rebuild();

    std::vector<int64_t> key_;
    std::vector<uint8_t> state_;
    std::vector<int32_t> pins_;
    std::vector<int32_t> prev_, next_;               // LRU links; -1 ends
    std::vector<uint8_t> evictable_;
    int head_ = -1, tail_ = -1;
    std::vector<int32_t> free_;                      // popped from the back: slot 0 first
    std::unordered_map<int64_t, int32_t> slot_of_;
    std::vector<int32_t> held_;                      // by group
    // LFU
    Policy policy_ = LRU;
    int64_t decay_every_ = 0, pins_since_decay_ = 0, tick_ = 0;
    std::unordered_map<int64_t, uint32_t> uses_;     // key -> uses (decayed)
    std::vector<int64_t> rank_, order_;              // per evictable slot: its entry's (rank, order)
    std::vector<Entry> heap_;                        // min-heap by (rank, order), stale entries inside
};

}  // namespace lqf
