// A decode step's Gated-DeltaNet sub-block in one native call (deltanet.cpp).
#pragma once

#include <cstdint>
#include <string>

namespace lqf {

// What a layer's DeltaNet sub-block is made of, fixed once per layer (Python builds it and keeps
// the tensors it points at alive).
struct DeltaNetStep {
    int hidden = 0, k_heads = 0, v_heads = 0, k_dim = 0, v_dim = 0, conv_kernel = 0;
    // split (Qwen3.5): w = qkv [q all, k all, v all], z, b, a, out. joined (Qwen3-Next): w = qkvz
    // grouped per key head as [q, k, v (ratio heads), z (ratio heads)], ba per key head as
    // [b (ratio), a (ratio)], -, -, out.
    bool split = false;
    const float* in_norm = nullptr;  // the layer's input RMSNorm weight
    int in_norm_mode = 1;            // 1: times w, 2: times (1 + w)
    float in_eps = 1e-6f;
    const uint8_t* w[5] = {nullptr, nullptr, nullptr, nullptr, nullptr};
    int enc[5] = {0, 0, 0, 0, 0};
    int rows[5] = {0, 0, 0, 0, 0};
    const float* conv = nullptr;     // depthwise conv taps [channels, conv_kernel]
    const float* a_log = nullptr;    // [v_heads]
    const float* dt_bias = nullptr;  // [v_heads]
    const float* out_norm = nullptr; // the gated output norm's weight [v_dim]
    float out_eps = 1e-6f;
    // null, or out_proj's stored column order [v_heads * v_dim]: stored column j is column
    // out_order[j] (quant.QuantCols), so out_proj reads its input permuted
    const int64_t* out_order = nullptr;
};

// out[H] = x + out_proj(norm(core) * silu(z)) for one token, where core is the gated delta rule
// over the causal conv of the projections of rms_norm(x) (the arithmetic of layers/deltanet.py's
// one-token path, fp32). conv_state [channels, conv_kernel - 1] (the last inputs, oldest first)
// and recurrent [v_heads, k_dim, v_dim] are updated in place.
void deltanet_step(const DeltaNetStep& s, const float* x, float* conv_state, float* recurrent, float* out,
                   int num_threads, const std::string& isa);

}  // namespace lqf
