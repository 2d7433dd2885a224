// One decode step's attention sub-block as one call (declared in decode_step.h). It strings the
// per-token kernels together in the order the Python sub-block calls them one by one; what it
// saves is the ~15 dispatches between them (wrappers, allocations, views, torch adds), each of
// which also lets the kernel pool's workers fall asleep.
#include "decode_step.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <vector>

#include "attention.h"
#include "moe.h"
#include "ops.h"
#include "quant.h"

namespace lqf {

static void add_bias(float* y, const float* b, int n) {
    if (b)
        for (int i = 0; i < n; ++i) y[i] += b[i];
}

void attention_step(const AttentionStep& s, const float* x, int rotary_dim, const float* cos, const float* sin, float* k_cache,
                    float* v_cache, int64_t head_stride, int64_t row_stride, int num_past, float* out, int num_threads,
                    const std::string& isa) {
    const int H = s.hidden, D = s.head_dim, heads = s.heads, kvh = s.kv_heads;
    const int q_cols = heads * D * (s.gated ? 2 : 1);
    if (H <= 0 || D <= 0 || heads <= 0 || kvh <= 0 || heads % kvh)
        throw std::invalid_argument("attention_step: hidden, head_dim, heads and kv_heads must be positive (heads a multiple of kv_heads)");
    if (s.rows[0] != q_cols || s.rows[1] != kvh * D || s.rows[2] != kvh * D || s.rows[3] != H)
        throw std::invalid_argument("attention_step: q/k/v/o row counts do not fit the heads");
    if (num_past < 0 || row_stride < D || head_stride < row_stride)
        throw std::invalid_argument("attention_step: bad cache layout");
    if (rotary_dim < 0 || rotary_dim % 2 || rotary_dim > D || (rotary_dim && (!cos || !sin)))
        throw std::invalid_argument("attention_step: rotary_dim must be even and in 0..head_dim, with cos and sin");

    std::vector<float> h(H);
    rms_norm(x, 1, H, s.in_norm, s.in_norm_mode, s.in_eps, h.data());

    std::vector<float> qg(q_cols), k(kvh * D), v(kvh * D);
    gemv_multi({s.w[0], s.w[1], s.w[2]}, {s.enc[0], s.enc[1], s.enc[2]}, {s.rows[0], s.rows[1], s.rows[2]}, H, h.data(),
               {qg.data(), k.data(), v.data()}, num_threads, isa);
    add_bias(qg.data(), s.bias[0], q_cols);
    add_bias(k.data(), s.bias[1], kvh * D);
    add_bias(v.data(), s.bias[2], kvh * D);

    std::vector<float> q(heads * D), gate;
    if (s.gated) {
        gate.resize(heads * D);
        for (int hd = 0; hd < heads; ++hd) {
            std::copy(qg.begin() + 2 * hd * D, qg.begin() + (2 * hd + 1) * D, q.begin() + hd * D);
            std::copy(qg.begin() + (2 * hd + 1) * D, qg.begin() + (2 * hd + 2) * D, gate.begin() + hd * D);
        }
    } else {
        q.swap(qg);
    }
    if (s.q_norm) rms_norm(q.data(), heads, D, s.q_norm, s.qk_mode, s.qk_eps, q.data());
    if (s.k_norm) rms_norm(k.data(), kvh, D, s.k_norm, s.qk_mode, s.qk_eps, k.data());
    if (rotary_dim) {
        rope_rotate_half(q.data(), heads, 1, D, rotary_dim, cos, sin, q.data());
        rope_rotate_half(k.data(), kvh, 1, D, rotary_dim, cos, sin, k.data());
    }
    for (int g = 0; g < kvh; ++g) {
        const int64_t at = g * head_stride + static_cast<int64_t>(num_past) * row_stride;
        std::copy(k.begin() + g * D, k.begin() + (g + 1) * D, k_cache + at);
        std::copy(v.begin() + g * D, v.begin() + (g + 1) * D, v_cache + at);
    }
    const KVRows keys{reinterpret_cast<const uint8_t*>(k_cache), ENC_F32, D, head_stride * 4, row_stride * 4};
    const KVRows values{reinterpret_cast<const uint8_t*>(v_cache), ENC_F32, D, head_stride * 4, row_stride * 4};
    std::vector<float> att(heads * D);
    attention_decode(q.data(), heads, kvh, {keys}, values, num_past + 1, s.scale, s.sinks, att.data(), num_threads, isa);
    if (s.gated)
        for (int i = 0; i < heads * D; ++i) att[i] *= 1.f / (1.f + std::exp(-gate[i]));

    std::vector<float> o(H);
    gemv(s.w[3], s.enc[3], H, heads * D, att.data(), o.data(), num_threads, isa);
    add_bias(o.data(), s.bias[3], H);
    for (int i = 0; i < H; ++i) out[i] = x[i] + o[i];
}

}  // namespace lqf
