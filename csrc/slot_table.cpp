#include "slot_table.h"

#include <algorithm>
#include <functional>
#include <stdexcept>
#include <string>

namespace lqf {

SlotTable::Policy SlotTable::policy_named(const std::string& name) {
    if (name == "lru") return LRU;
    if (name == "lfu") return LFU;
    throw std::invalid_argument("cache policy must be one of lru, lfu, got '" + name + "'");
}

SlotTable::SlotTable(int num_slots, Policy policy, int64_t decay_every) : policy_(policy) {
    if (num_slots < 0) throw std::invalid_argument("SlotTable: negative number of slots");
    if (decay_every < 0) throw std::invalid_argument("SlotTable: decay_every must be >= 0");
    decay_every_ = decay_every ? decay_every : kDecaySlots * std::max(num_slots, 1);
    rank_.assign(num_slots, 0);
    order_.assign(num_slots, 0);
    key_.assign(num_slots, -1);
    state_.assign(num_slots, EMPTY);
    pins_.assign(num_slots, 0);
    prev_.assign(num_slots, -1);
    next_.assign(num_slots, -1);
    evictable_.assign(num_slots, 0);
    free_.reserve(num_slots);
    for (int s = num_slots - 1; s >= 0; --s) free_.push_back(s);
    slot_of_.reserve(static_cast<size_t>(num_slots) * 2);
}

int64_t SlotTable::key(int64_t group, int64_t item) {
    if (group < 0 || group >= (int64_t(1) << 31) || item < 0 || item >= (int64_t(1) << 32))
        throw std::invalid_argument("slot cache key (" + std::to_string(group) + ", " + std::to_string(item) +
                                    "): group and item must be non-negative ints");
    return (group << 32) | item;
}

int SlotTable::check(int slot) const {
    if (slot < 0 || slot >= num_slots())
        throw std::out_of_range("slot " + std::to_string(slot) + " out of range (" + std::to_string(num_slots()) + " slots)");
    return slot;
}

int SlotTable::lookup(int64_t key) const {
    auto it = slot_of_.find(key);
    return it == slot_of_.end() ? -1 : it->second;
}

void SlotTable::lru_remove(int s) {
    if (!evictable_[s]) return;
    int p = prev_[s], n = next_[s];
    (p >= 0 ? next_[p] : head_) = n;
    (n >= 0 ? prev_[n] : tail_) = p;
    prev_[s] = next_[s] = -1;
    evictable_[s] = 0;
}

void SlotTable::lru_push_back(int s) {
    lru_remove(s);
    prev_[s] = tail_;
    next_[s] = -1;
    (tail_ >= 0 ? next_[tail_] : head_) = s;
    tail_ = s;
    evictable_[s] = 1;
}

// LRU: to the back of the list. LFU: a fresh heap entry ranked by the key's uses (+ ahead).
void SlotTable::maybe_evictable(int s, int ahead) {
    if (pins_[s] != 0 || state_[s] != READY || key_[s] < 0) return;
    if (policy_ == LRU) {
        lru_push_back(s);
        return;
    }
    auto it = uses_.find(key_[s]);
    heap_push(s, (it == uses_.end() ? 0 : it->second) + ahead, ++tick_);
}

void SlotTable::evictable_remove(int s) {
    if (policy_ == LRU)
        lru_remove(s);
    else
        evictable_[s] = 0;                              // (its heap entry goes stale)
}

void SlotTable::heap_push(int s, int64_t rank, int64_t order) {
    rank_[s] = rank;
    order_[s] = order;
    evictable_[s] = 1;
    heap_.push_back({rank, order, s});
    std::push_heap(heap_.begin(), heap_.end(), std::greater<Entry>());
    if (heap_.size() > 4 * rank_.size() + 64) heap_rebuild();   // (stale entries: amortised away)
}

void SlotTable::heap_rebuild() {
    heap_.clear();
    for (int s = 0; s < num_slots(); ++s)
        if (evictable_[s]) heap_.push_back({rank_[s], order_[s], s});
    std::make_heap(heap_.begin(), heap_.end(), std::greater<Entry>());
}

// The next victim, taken out of the eviction order; -1 when nothing is evictable.
int SlotTable::take_victim() {
    if (policy_ == LRU) {
        int s = head_;
        if (s >= 0) lru_remove(s);
        return s;
    }
    while (!heap_.empty()) {
        Entry e = heap_.front();
        std::pop_heap(heap_.begin(), heap_.end(), std::greater<Entry>());
        heap_.pop_back();
        if (evictable_[e.slot] && order_[e.slot] == e.order) {
            evictable_[e.slot] = 0;
            return e.slot;
        }
    }
    return -1;
}

// A pin is a use of the slot's key (LFU); every decay_every uses, all counts are halved.
void SlotTable::used(int s) {
    if (policy_ != LFU || key_[s] < 0) return;
    ++uses_[key_[s]];
    if (++pins_since_decay_ < decay_every_) return;
    pins_since_decay_ = 0;
    for (auto& kv : uses_) kv.second >>= 1;
    for (int t = 0; t < num_slots(); ++t)
        if (evictable_[t] && rank_[t] > 0) rank_[t] >>= 1;
    heap_rebuild();
}

uint32_t SlotTable::uses(int64_t key) const {
    auto it = uses_.find(key);
    return it == uses_.end() ? 0 : it->second;
}

void SlotTable::count(int64_t key, int delta) {
    int64_t g = group_of(key);
    if (g >= static_cast<int64_t>(held_.size())) held_.resize(g + 1, 0);
    held_[g] += delta;
}

int SlotTable::held(int64_t group) const {
    return group >= 0 && group < static_cast<int64_t>(held_.size()) ? held_[group] : 0;
}

// A pin: out of the eviction order, and (lfu) one use of its key.
void SlotTable::pin_one(int s) {
    ++pins_[s];
    evictable_remove(s);
    used(s);
}

void SlotTable::pin(int slot) { pin_one(check(slot)); }

void SlotTable::unpin(int slot) {
    check(slot);
    if (pins_[slot] <= 0) throw std::logic_error("slot " + std::to_string(slot) + " unpinned more often than pinned");
    --pins_[slot];
    if (pins_[slot] == 0 && key_[slot] < 0 && state_[slot] == EMPTY) {
        free_.push_back(slot);                       // dropped while pinned: free once released
        return;
    }
    maybe_evictable(slot, 0);
}

void SlotTable::mark_ready(int slot) {
    check(slot);
    state_[slot] = READY;
    maybe_evictable(slot, 1);       // (unpinned: a speculative read, one use ahead)
}

void SlotTable::make_cold(int slot) {
    check(slot);
    if (!evictable_[slot]) return;
    if (policy_ == LFU) {
        heap_push(slot, -1, -(++tick_));             // before every warm slot, the latest first
        return;
    }
    lru_remove(slot);
    prev_[slot] = -1;
    next_[slot] = head_;
    (head_ >= 0 ? prev_[head_] : tail_) = slot;
    head_ = slot;
    evictable_[slot] = 1;
}

int SlotTable::allocate(int64_t key, int64_t* evicted) {
    *evicted = -1;
    int slot;
    if (!free_.empty()) {
        slot = free_.back();
        free_.pop_back();
    } else if ((slot = take_victim()) >= 0) {
        *evicted = key_[slot];
        slot_of_.erase(*evicted);
        count(*evicted, -1);
    } else {
        return -1;
    }
    count(key, +1);
    key_[slot] = key;
    slot_of_[key] = slot;
    state_[slot] = READING;
    return slot;
}

void SlotTable::drop(int slot) {
    check(slot);
    if (key_[slot] < 0) return;                      // (nothing held: already free or dropped)
    slot_of_.erase(key_[slot]);
    count(key_[slot], -1);
    key_[slot] = -1;
    state_[slot] = EMPTY;
    evictable_remove(slot);
    if (pins_[slot] == 0) free_.push_back(slot);
}

bool SlotTable::pin_present(const int64_t* keys, int n, int* slots) {
    for (int i = 0; i < n; ++i) {
        auto it = slot_of_.find(keys[i]);
        if (it == slot_of_.end()) return false;
        slots[i] = it->second;
    }
    for (int i = 0; i < n; ++i) pin_one(slots[i]);
    return true;
}

void SlotTable::unpin_all(const int* slots, int n) {
    for (int i = 0; i < n; ++i) unpin(slots[i]);
}

std::vector<std::pair<int64_t, int>> SlotTable::items() const {
    return {slot_of_.begin(), slot_of_.end()};
}

int SlotTable::num_pinned() const {
    int n = 0;
    for (int32_t p : pins_) n += p > 0;
    return n;
}

std::vector<int> SlotTable::eviction_order() const {
    std::vector<int> out;
    if (policy_ == LRU) {
        for (int s = head_; s >= 0; s = next_[s]) out.push_back(s);
        return out;
    }
    std::vector<Entry> live;
    for (int s = 0; s < num_slots(); ++s)
        if (evictable_[s]) live.push_back({rank_[s], order_[s], s});
    std::sort(live.begin(), live.end(), [](const Entry& a, const Entry& b) { return b > a; });
    for (const Entry& e : live) out.push_back(e.slot);
    return out;
}

}  // namespace lqf
