// One decode step's Gated-DeltaNet sub-block as one call (declared in deltanet.h): the input norm,
// the projections (one parallel run over every matrix), the causal conv step, the l2-normalised
// q/k, the gated delta rule on the recurrent state (one task per value head), the gated output norm,
// out_proj and the residual add. The torch path spends ~35 dispatches on this per layer.
#include "deltanet.h"

#include <cmath>
#include <stdexcept>
#include <vector>

#include "moe.h"
#include "ops.h"

namespace lqf {

static inline float silu(float v) { return v / (1.f + std::exp(-v)); }

// x *= scale / |x| (with 1e-6 under the root), n values: layers/deltanet.py's _l2norm, then the scale.
static void l2_normalise(float* x, int n, float scale) {
    double ss = 0;
    for (int i = 0; i < n; ++i) ss += static_cast<double>(x[i]) * x[i];
    const float r = 1.f / std::sqrt(static_cast<float>(ss) + 1e-6f);
    for (int i = 0; i < n; ++i) x[i] = x[i] * r * scale;
}

void deltanet_step(const DeltaNetStep& s, const float* x, float* conv_state, float* recurrent, float* out,
                   int num_threads, const std::string& isa) {
    const int H = s.hidden, nk = s.k_heads, nv = s.v_heads, dk = s.k_dim, dv = s.v_dim, K = s.conv_kernel;
    if (H <= 0 || nk <= 0 || nv <= 0 || dk <= 0 || dv <= 0 || K < 1 || nv % nk)
        throw std::invalid_argument("deltanet_step: sizes must be positive (value heads a multiple of key heads)");
    const int ratio = nv / nk, key_dim = nk * dk, value_dim = nv * dv, C = 2 * key_dim + value_dim;
    const bool rows_ok = s.split ? (s.rows[0] == C && s.rows[1] == value_dim && s.rows[2] == nv && s.rows[3] == nv)
                                 : (s.rows[0] == 2 * key_dim + 2 * value_dim && s.rows[1] == 2 * nv);
    if (!rows_ok || s.rows[4] != H) throw std::invalid_argument("deltanet_step: projection row counts do not fit the heads");

    std::vector<float> h(H);
    rms_norm(x, 1, H, s.in_norm, s.in_norm_mode, s.in_eps, h.data());

    std::vector<float> mixed(C), z(value_dim), b(nv), a(nv);
    if (s.split) {
        gemv_multi({s.w[0], s.w[1], s.w[2], s.w[3]}, {s.enc[0], s.enc[1], s.enc[2], s.enc[3]},
                   {s.rows[0], s.rows[1], s.rows[2], s.rows[3]}, H, h.data(), {mixed.data(), z.data(), b.data(), a.data()},
                   num_threads, isa);
    } else {   // per key head [q, k, v, z] and [b, a]: regrouped as [q all, k all, v all], z, b, a
        std::vector<float> qkvz(s.rows[0]), ba(s.rows[1]);
        gemv_multi({s.w[0], s.w[1]}, {s.enc[0], s.enc[1]}, {s.rows[0], s.rows[1]}, H, h.data(), {qkvz.data(), ba.data()},
                   num_threads, isa);
        const int group = 2 * dk + 2 * ratio * dv;
        for (int g = 0; g < nk; ++g) {
            const float* src = qkvz.data() + static_cast<size_t>(g) * group;
            std::copy(src, src + dk, mixed.begin() + g * dk);
            std::copy(src + dk, src + 2 * dk, mixed.begin() + key_dim + g * dk);
            std::copy(src + 2 * dk, src + 2 * dk + ratio * dv, mixed.begin() + 2 * key_dim + g * ratio * dv);
            std::copy(src + 2 * dk + ratio * dv, src + group, z.begin() + g * ratio * dv);
            for (int r = 0; r < ratio; ++r) {
                b[g * ratio + r] = ba[g * 2 * ratio + r];
                a[g * ratio + r] = ba[g * 2 * ratio + ratio + r];
            }
        }
    }

    // The causal depthwise conv over [the last K-1 inputs, this one], then silu; the window slides.
    std::vector<float> conv(C);
    for (int c = 0; c < C; ++c) {
        float* past = conv_state + static_cast<size_t>(c) * (K - 1);
        const float* taps = s.conv + static_cast<size_t>(c) * K;
        float acc = (K > 1 ? past[0] : mixed[c]) * taps[0];
        for (int i = 1; i < K; ++i) acc = acc + (i < K - 1 ? past[i] : mixed[c]) * taps[i];
        for (int i = 0; i + 1 < K - 1; ++i) past[i] = past[i + 1];
        if (K > 1) past[K - 2] = mixed[c];
        conv[c] = silu(acc);
    }
    float* q = conv.data();
    float* k = conv.data() + key_dim;
    const float* v = conv.data() + 2 * key_dim;
    for (int g = 0; g < nk; ++g) {
        l2_normalise(q + g * dk, dk, 1.f / std::sqrt(static_cast<float>(dk)));
        l2_normalise(k + g * dk, dk, 1.f);
    }

    // The gated delta rule per value head h (key head h / ratio), state S [dk, dv]:
    //   S *= exp(g);  delta = beta (v - k^T S);  S += k delta^T;  o = q^T S   (two passes over S)
    std::vector<float> core(value_dim);
    parallel_run(num_threads, nv, [&](int hd) {
        const float* qh = q + (hd / ratio) * dk;
        const float* kh = k + (hd / ratio) * dk;
        const float* vh = v + static_cast<size_t>(hd) * dv;
        const float ax = a[hd] + s.dt_bias[hd];
        const float softplus = ax > 20.f ? ax : std::log1p(std::exp(ax));
        const float decay = std::exp(-std::exp(s.a_log[hd]) * softplus);
        const float beta = 1.f / (1.f + std::exp(-b[hd]));
        float* S = recurrent + static_cast<size_t>(hd) * dk * dv;
        std::vector<float> ks(dv, 0.f), delta(dv);
        for (int i = 0; i < dk; ++i) {
            float* row = S + static_cast<size_t>(i) * dv;
            const float ki = kh[i];
            for (int j = 0; j < dv; ++j) {
                row[j] *= decay;
                ks[j] += ki * row[j];
            }
        }
        for (int j = 0; j < dv; ++j) delta[j] = (vh[j] - ks[j]) * beta;
        float* o = core.data() + static_cast<size_t>(hd) * dv;
        std::fill(o, o + dv, 0.f);
        for (int i = 0; i < dk; ++i) {
            float* row = S + static_cast<size_t>(i) * dv;
            const float ki = kh[i], qi = qh[i];
            for (int j = 0; j < dv; ++j) {
                row[j] += ki * delta[j];
                o[j] += qi * row[j];
            }
        }
    });

    // norm(core) per value head times the weight, times silu(z); then out_proj and the residual.
    rms_norm(core.data(), nv, dv, s.out_norm, 1, s.out_eps, core.data());
    for (int i = 0; i < value_dim; ++i) core[i] *= silu(z[i]);
    std::vector<float> o(H);
    if (s.out_order) {
        std::vector<float> ordered(value_dim);
        for (int i = 0; i < value_dim; ++i) ordered[i] = core[s.out_order[i]];
        core.swap(ordered);
    }
    gemv(s.w[4], s.enc[4], H, value_dim, core.data(), o.data(), num_threads, isa);
    for (int i = 0; i < H; ++i) out[i] = x[i] + o[i];
}

}  // namespace lqf
