// Small per-token operations of a decode step, native so that a layer's work outside the expert
// products costs microseconds, not a dozen torch dispatches each (see ops.cpp).
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace lqf {

// out[r] = x[r] / rms(x[r]) for `rows` rows of n fp32 values, then times w (weight_mode 1) or
// (1 + w) (weight_mode 2, zero-centred), or nothing (0). out may be x.
void rms_norm(const float* x, int rows, int n, const float* w, int weight_mode, float eps, float* out);

// Rotary embedding, rotate-half convention, on x [outer, tokens, head_dim] (outer = batch x heads):
// the first rotary_dim dims of token t become x * cos[t] + swap(x) * sin[t] (sin signed: its first
// half negated), the rest are copied. The same three roundings as torch's fp32 ops: bit-equal.
void rope_rotate_half(const float* x, int outer, int tokens, int head_dim, int rotary_dim, const float* cos,
                      const float* sin, float* out);

// One token's softmax router: logits = W x (+ bias) through gemv, softmax over the experts in fp32,
// the top k (ties: the lower id first), renormalised if asked. Returns (ids, their weights): ids
// ascending, or by_rank: best first (a prefetcher's ranking).
std::pair<std::vector<int>, std::vector<float>> route_softmax(const uint8_t* w, int enc, int experts, int hidden,
                                                              const float* x, const float* bias, int top_k,
                                                              bool renorm, bool by_rank, int num_threads,
                                                              const std::string& isa);

}  // namespace lqf
