// Per-token operations of a decode step (declared in ops.h). Each is one pass over a few KiB, so
// they run on the calling thread; what they save is the dispatch of the torch ops they replace
// (F.rms_norm alone is ~40 us on one 1024-value row, this is ~1 us).
#include "ops.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <stdexcept>

#include "moe.h"

namespace lqf {

void rms_norm(const float* x, int rows, int n, const float* w, int weight_mode, float eps, float* out) {
    if (rows < 0 || n <= 0) throw std::invalid_argument("rms_norm: rows must be >= 0 and n > 0");
    if (weight_mode != 0 && w == nullptr) throw std::invalid_argument("rms_norm: weight_mode needs a weight");
    for (int r = 0; r < rows; ++r) {
        const float* xr = x + static_cast<size_t>(r) * n;
        float* yr = out + static_cast<size_t>(r) * n;
        // Eight partial sums in double: order-stable, and no worse than torch's fp32 reduction.
        double part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        int i = 0;
        for (; i + 8 <= n; i += 8)
            for (int l = 0; l < 8; ++l) part[l] += static_cast<double>(xr[i + l]) * xr[i + l];
        for (; i < n; ++i) part[0] += static_cast<double>(xr[i]) * xr[i];
        const double ss = ((part[0] + part[1]) + (part[2] + part[3])) + ((part[4] + part[5]) + (part[6] + part[7]));
        const float inv = static_cast<float>(1.0 / std::sqrt(ss / n + static_cast<double>(eps)));
        if (weight_mode == 0)
            for (int j = 0; j < n; ++j) yr[j] = xr[j] * inv;
        else if (weight_mode == 1)
            for (int j = 0; j < n; ++j) yr[j] = w[j] * (xr[j] * inv);
        else
            for (int j = 0; j < n; ++j) yr[j] = (xr[j] * inv) * (1.f + w[j]);
    }
}

void rope_rotate_half(const float* x, int outer, int tokens, int head_dim, int rotary_dim, const float* cos,
                      const float* sin, float* out) {
    if (rotary_dim <= 0 || rotary_dim % 2 || rotary_dim > head_dim)
        throw std::invalid_argument("rope: rotary_dim must be even and in 1..head_dim");
    const int half = rotary_dim / 2;
    for (int o = 0; o < outer; ++o)
        for (int t = 0; t < tokens; ++t) {
            const size_t base = (static_cast<size_t>(o) * tokens + t) * head_dim;
            const float* xr = x + base;
            float* yr = out + base;
            const float* c = cos + static_cast<size_t>(t) * rotary_dim;
            const float* s = sin + static_cast<size_t>(t) * rotary_dim;
            float tmp[1024];
            float* dst = (xr == yr) ? tmp : yr;      // in place: rotate into a copy first
            if (xr == yr && rotary_dim > 1024) throw std::invalid_argument("rope: in place needs rotary_dim <= 1024");
            for (int j = 0; j < half; ++j) {
                const float a = xr[j] * c[j], b = xr[j + half] * s[j];
                dst[j] = a + b;
            }
            for (int j = half; j < rotary_dim; ++j) {
                const float a = xr[j] * c[j], b = xr[j - half] * s[j];
                dst[j] = a + b;
            }
            if (dst == tmp) std::copy(tmp, tmp + rotary_dim, yr);
            if (xr != yr) std::copy(xr + rotary_dim, xr + head_dim, yr + rotary_dim);
        }
}

std::pair<std::vector<int>, std::vector<float>> route_softmax(const uint8_t* w, int enc, int experts, int hidden,
                                                              const float* x, const float* bias, int top_k,
                                                              bool renorm, bool by_rank, int num_threads,
                                                              const std::string& isa) {
    if (top_k <= 0 || top_k > experts) throw std::invalid_argument("route_softmax: top_k must be in 1..experts");
    std::vector<float> p(experts);
    gemv(w, enc, experts, hidden, x, p.data(), num_threads, isa);
    if (bias)
        for (int e = 0; e < experts; ++e) p[e] += bias[e];
    const float mx = *std::max_element(p.begin(), p.end());
    double total = 0;
    for (int e = 0; e < experts; ++e) {
        p[e] = std::exp(p[e] - mx);
        total += p[e];
    }
    const float inv = static_cast<float>(1.0 / total);
    for (int e = 0; e < experts; ++e) p[e] *= inv;
    std::vector<int> order(experts);
    std::iota(order.begin(), order.end(), 0);
    std::partial_sort(order.begin(), order.begin() + top_k, order.end(),
                      [&](int a, int b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
    order.resize(top_k);
    if (!by_rank) std::sort(order.begin(), order.end());
    std::vector<float> weights(top_k);
    float sum = 0.f;
    for (int i = 0; i < top_k; ++i) sum += p[order[i]];
    for (int i = 0; i < top_k; ++i) weights[i] = renorm ? p[order[i]] / sum : p[order[i]];
    return {order, weights};
}

}  // namespace lqf
