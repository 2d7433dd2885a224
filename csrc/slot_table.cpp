#include "slot_table.h"

#include <stdexcept>
#include <string>

namespace lqf {

SlotTable::SlotTable(int num_slots) {
    if (num_slots < 0) throw std::invalid_argument("SlotTable: negative number of slots");
    key_.assign(num_slots, -1);
    state_.assign(num_slots, EMPTY);
    pins_.assign(num_slots, 0);
    prev_.assign(num_slots, -1);
    next_.assign(num_slots, -1);
    in_lru_.assign(num_slots, 0);
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
    if (!in_lru_[s]) return;
    int p = prev_[s], n = next_[s];
    (p >= 0 ? next_[p] : head_) = n;
    (n >= 0 ? prev_[n] : tail_) = p;
    prev_[s] = next_[s] = -1;
    in_lru_[s] = 0;
}

void SlotTable::lru_push_back(int s) {
    lru_remove(s);
    prev_[s] = tail_;
    next_[s] = -1;
    (tail_ >= 0 ? next_[tail_] : head_) = s;
    tail_ = s;
    in_lru_[s] = 1;
}

void SlotTable::maybe_evictable(int s) {
    if (pins_[s] == 0 && state_[s] == READY && key_[s] >= 0) lru_push_back(s);
}

void SlotTable::count(int64_t key, int delta) {
    int64_t g = group_of(key);
    if (g >= static_cast<int64_t>(held_.size())) held_.resize(g + 1, 0);
    held_[g] += delta;
}

int SlotTable::held(int64_t group) const {
    return group >= 0 && group < static_cast<int64_t>(held_.size()) ? held_[group] : 0;
}

void SlotTable::pin(int slot) {
    check(slot);
    ++pins_[slot];
    lru_remove(slot);
}

void SlotTable::unpin(int slot) {
    check(slot);
    if (pins_[slot] <= 0) throw std::logic_error("slot " + std::to_string(slot) + " unpinned more often than pinned");
    --pins_[slot];
    maybe_evictable(slot);
}

void SlotTable::mark_ready(int slot) {
    check(slot);
    state_[slot] = READY;
    maybe_evictable(slot);
}

void SlotTable::make_cold(int slot) {
    check(slot);
    if (!in_lru_[slot]) return;
    lru_remove(slot);
    prev_[slot] = -1;
    next_[slot] = head_;
    (head_ >= 0 ? prev_[head_] : tail_) = slot;
    head_ = slot;
    in_lru_[slot] = 1;
}

int SlotTable::allocate(int64_t key, int64_t* evicted) {
    *evicted = -1;
    int slot;
    if (!free_.empty()) {
        slot = free_.back();
        free_.pop_back();
    } else if (head_ >= 0) {
        slot = head_;
        lru_remove(slot);
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
    lru_remove(slot);
    if (pins_[slot] == 0) free_.push_back(slot);
}

bool SlotTable::pin_present(const int64_t* keys, int n, int* slots) {
    for (int i = 0; i < n; ++i) {
        auto it = slot_of_.find(keys[i]);
        if (it == slot_of_.end()) return false;
        slots[i] = it->second;
    }
    for (int i = 0; i < n; ++i) {
        ++pins_[slots[i]];
        lru_remove(slots[i]);
    }
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

std::vector<int> SlotTable::lru_order() const {
    std::vector<int> out;
    for (int s = head_; s >= 0; s = next_[s]) out.push_back(s);
    return out;
}

}  // namespace lqf
