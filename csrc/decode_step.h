// A decode step's attention sub-block in one native call (decode_step.cpp).
#pragma once

#include <cstdint>
#include <string>

namespace lqf {

// What a layer's attention sub-block is made of, fixed once per layer (Python builds it; the
// weights and norm vectors it points at stay alive as long as it does).
struct AttentionStep {
    int hidden = 0, heads = 0, kv_heads = 0, head_dim = 0;
    bool gated = false;              // q_proj yields [q_h (D), gate_h (D)] per head; out *= sigmoid(gate)
    const float* in_norm = nullptr;  // the layer's input RMSNorm weight
    int in_norm_mode = 1;            // 1: times w, 2: times (1 + w)
    float in_eps = 1e-6f;
    const uint8_t* w[4] = {nullptr, nullptr, nullptr, nullptr};   // q, k, v, o rows
    int enc[4] = {0, 0, 0, 0};
    int rows[4] = {0, 0, 0, 0};
    const float* bias[4] = {nullptr, nullptr, nullptr, nullptr};
    const float* q_norm = nullptr;   // per-head RMSNorm weights (both or neither)
    const float* k_norm = nullptr;
    int qk_mode = 1;
    float qk_eps = 1e-6f;
    float scale = 1.f;
    const float* sinks = nullptr;    // per-head sink logits or null
};

// out[H] = x + o_proj(attention(rope(norm_h(q)), rope(norm_h(k)), v)) with q, k, v projected from
// rms_norm(x): the same kernels, in the same order, as the sub-block's separate one-token calls
// (gemv_multi, rms_norm, rope, attention_decode, gemv), so the bits are theirs. The new key and
// value rows are written at row `num_past` of the fp32 caches (row j of kv head h at
// cache + h * head_stride + j * row_stride floats), which must have room for it; attention then
// runs over num_past + 1 rows. cos / sin: this position's rope row (rotary_dim values; 0: no rope).
void attention_step(const AttentionStep& s, const float* x, int rotary_dim, const float* cos, const float* sin, float* k_cache,
                    float* v_cache, int64_t head_stride, int64_t row_stride, int num_past, float* out, int num_threads,
                    const std::string& isa);

}  // namespace lqf
