// Decode attention (one query row per head) over a KV cache of float or q8_0 / q4_0 rows.
//
// Work is split into tasks of (kv head, span of SPAN keys); a task walks its span in tiles of TILE
// keys: it dequantizes the tile's key rows (fp32 rows are read where they are), takes the dot products with every
// query head of its group, rescales its running (max, sum, accumulator) once per tile (online
// softmax) and adds the tile's value rows (dequantized once, or the key rows themselves when the
// values are the keys: MLA's latent). The spans' partial results are merged per head in span order,
// with the sink if there is one. No task reads more than its span, no buffer grows with the context,
// and the result does not depend on the thread count (spans are fixed).
//
// ISA: AVX2 + FMA + F16C (per-function target, reached only after the CPU check in moe.cpp's
// kernels_for) or scalar (the exact row decoders of quant_scalar.cpp and plain loops).
#include "attention.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

#include "moe.h"
#include "quant.h"

namespace lqf {
namespace {

constexpr int SPAN = 256;              // keys per task
constexpr int TILE = 32;               // keys per online-softmax step
constexpr int MAX_DIM = 4096;          // widest cached row (padded)
constexpr int MAX_GROUP = 128;         // query heads per kv head
constexpr int PARALLEL_MIN_ROWS = 1024;    // kv heads x keys below which one thread does it all

int padded_dim(int enc, int dim) { return enc_is_float(enc) ? dim : (dim + 31) / 32 * 32; }

// ---- scalar ----

void dequant_scalar(int enc, const uint8_t* row, int dim, float* out) {
    dequantize_row(enc, row, padded_dim(enc, dim), out);
}

float dot_scalar(const float* a, const float* b, int n) {
    float s = 0.f;
    for (int i = 0; i < n; ++i) s += a[i] * b[i];
    return s;
}

void axpy_scalar(float* acc, float p, const float* x, int n) {
    for (int i = 0; i < n; ++i) acc[i] += p * x[i];
}

void scale_scalar(float* x, float a, int n) {
    for (int i = 0; i < n; ++i) x[i] *= a;
}

// s[j] = exp(s[j] - m) for n scores; returns their sum (in order).
float exp_sum_scalar(float* s, int n, float m) {
    float total = 0.f;
    for (int j = 0; j < n; ++j) {
        s[j] = std::exp(s[j] - m);
        total += s[j];
    }
    return total;
}

// ---- AVX2 ----

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

void dequant_avx2(int enc, const uint8_t* row, int dim, float* out) {
    const int blocks = (dim + 31) / 32;
    if (enc == ENC_Q8_0) {
        for (int b = 0; b < blocks; ++b, row += 34, out += 32) {
            const __m256 d = _mm256_set1_ps(_cvtsh_ss(load_u16(row)));
            for (int k = 0; k < 4; ++k) {
                const __m128i q = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + 2 + 8 * k));
                _mm256_storeu_ps(out + 8 * k, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q))));
            }
        }
    } else if (enc == ENC_Q4_0) {
        const __m128i low4 = _mm_set1_epi8(0x0F);
        const __m256i eight = _mm256_set1_epi32(8);
        for (int b = 0; b < blocks; ++b, row += 18, out += 32) {
            const __m256 d = _mm256_set1_ps(_cvtsh_ss(load_u16(row)));
            const __m128i qs = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2));
            const __m128i lo = _mm_and_si128(qs, low4), hi = _mm_and_si128(_mm_srli_epi16(qs, 4), low4);
            const __m128i parts[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
            for (int k = 0; k < 4; ++k) {
                const __m256i q = _mm256_sub_epi32(_mm256_cvtepu8_epi32(parts[k]), eight);
                _mm256_storeu_ps(out + 8 * k, _mm256_mul_ps(d, _mm256_cvtepi32_ps(q)));
            }
        }
    } else if (enc == ENC_F16) {
        int i = 0;
        for (; i + 8 <= dim; i += 8)
            _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * i))));
        for (; i < dim; ++i) out[i] = _cvtsh_ss(load_u16(row + 2 * i));
    } else if (enc == ENC_BF16) {
        int i = 0;
        for (; i + 8 <= dim; i += 8) {
            const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * i)));
            _mm256_storeu_ps(out + i, _mm256_castsi256_ps(_mm256_slli_epi32(h, 16)));
        }
        for (; i < dim; ++i) out[i] = bf16_to_fp32(load_u16(row + 2 * i));
    } else {
        std::memcpy(out, row, sizeof(float) * dim);
    }
}

float dot_avx2(const float* a, const float* b, int n) {
    __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= n; i += 16) {
        s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
        s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i + 8), _mm256_loadu_ps(b + i + 8), s1);
    }
    for (; i + 8 <= n; i += 8) s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), s0);
    float s = hsum8(_mm256_add_ps(s0, s1));
    for (; i < n; ++i) s += a[i] * b[i];
    return s;
}

void axpy_avx2(float* acc, float p, const float* x, int n) {
    const __m256 pv = _mm256_set1_ps(p);
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(acc + i, _mm256_fmadd_ps(pv, _mm256_loadu_ps(x + i), _mm256_loadu_ps(acc + i)));
    for (; i < n; ++i) acc[i] += p * x[i];
}

void scale_avx2(float* x, float a, int n) {
    const __m256 av = _mm256_set1_ps(a);
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, _mm256_mul_ps(av, _mm256_loadu_ps(x + i)));
    for (; i < n; ++i) x[i] *= a;
}

// exp of 8 lanes: x = k ln2 + r (|r| <= ln2 / 2, ln2 split in two for the reduction), e^r by its
// Taylor polynomial to r^6 (relative error ~2e-7), times 2^k built in the exponent bits; below
// -87.3 (under FLT_MIN) the result is 0.
inline __m256 exp8(__m256 x) {
    const __m256 lo = _mm256_set1_ps(-87.3f);
    const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
    x = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(88.3f));
    const __m256 k = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(k, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(k, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.f / 720);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
    const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)), 23);
    return _mm256_andnot_ps(under, _mm256_mul_ps(p, _mm256_castsi256_ps(bits)));
}

float exp_sum_avx2(float* s, int n, float m) {
    const __m256 mv = _mm256_set1_ps(m);
    __m256 acc = _mm256_setzero_ps();
    int j = 0;
    for (; j + 8 <= n; j += 8) {
        const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + j), mv));
        _mm256_storeu_ps(s + j, e);
        acc = _mm256_add_ps(acc, e);
    }
    float total = hsum8(acc);
    for (; j < n; ++j) {
        s[j] = std::exp(s[j] - m);
        total += s[j];
    }
    return total;
}

#pragma GCC pop_options

struct Ops {
    void (*dequant)(int enc, const uint8_t* row, int dim, float* out);
    float (*dot)(const float* a, const float* b, int n);
    void (*axpy)(float* acc, float p, const float* x, int n);
    void (*scale)(float* x, float a, int n);
    float (*exp_sum)(float* s, int n, float m);
};

const Ops& ops_for(const std::string& isa) {
    static const Ops scalar{dequant_scalar, dot_scalar, axpy_scalar, scale_scalar, exp_sum_scalar};
    static const Ops avx2{dequant_avx2, dot_avx2, axpy_avx2, scale_avx2, exp_sum_avx2};
    const std::string name = kernels_for(isa).name;   // validates the ISA against this CPU
    return name == "scalar" ? scalar : avx2;          // AVX-512 CPUs take the AVX2 path here
}

const uint8_t* row_at(const KVRows& r, int head, int j) { return r.base + head * r.head_stride + j * r.row_stride; }

// One (kv head, span) task: its partial max, sum and accumulator per query head of the group.
void span_task(const Ops& op, const float* q, int qcols, int group, int head, const std::vector<KVRows>& keys,
               const KVRows& values, bool values_are_key0, int first, int last, float scale, float* m_out,
               float* l_out, float* acc_out) {
    const int parts = static_cast<int>(keys.size());
    int offset[4] = {0, 0, 0, 0};
    for (int p = 1; p < parts; ++p) offset[p] = offset[p - 1] + keys[p - 1].dim;
    int width = padded_dim(values.enc, values.dim);
    for (const auto& k : keys) width = std::max(width, padded_dim(k.enc, k.dim));
    // One tile of dequantized key rows per part, a value row, scores: O(TILE x row) per task.
    std::vector<float> buf(static_cast<size_t>(parts * TILE + 1) * width + static_cast<size_t>(group) * (TILE + 2));
    auto krow_buf = [&](int p, int j) { return &buf[(static_cast<size_t>(p) * TILE + j) * width]; };
    const float* kptr[4][TILE];          // this tile's key rows: the cache's own fp32 rows, or decoded ones
    auto krow = [&](int p, int j) { return kptr[p][j]; };
    float* vrow = &buf[static_cast<size_t>(parts) * TILE * width];
    float* scores = vrow + width;
    float* m = scores + static_cast<size_t>(group) * TILE;
    float* l = m + group;
    auto s = [&](int g, int j) -> float& { return scores[g * TILE + j]; };
    const int dv = values.dim;
    for (int g = 0; g < group; ++g) {
        m[g] = -std::numeric_limits<float>::infinity();
        l[g] = 0.f;
        std::fill(acc_out + g * dv, acc_out + (g + 1) * dv, 0.f);
    }
    for (int t0 = first; t0 < last; t0 += TILE) {
        const int n = std::min(TILE, last - t0);
        for (int p = 0; p < parts; ++p)
            for (int j = 0; j < n; ++j) {
                const uint8_t* row = row_at(keys[p], head, t0 + j);
                if (keys[p].enc == ENC_F32) {
                    kptr[p][j] = reinterpret_cast<const float*>(row);
                } else {
                    op.dequant(keys[p].enc, row, keys[p].dim, krow_buf(p, j));
                    kptr[p][j] = krow_buf(p, j);
                }
            }
        for (int g = 0; g < group; ++g) {
            const float* qg = q + (static_cast<int64_t>(head) * group + g) * qcols;
            float tile_max = -std::numeric_limits<float>::infinity();
            for (int j = 0; j < n; ++j) {
                float dot = 0.f;
                for (int p = 0; p < parts; ++p) dot += op.dot(qg + offset[p], krow(p, j), keys[p].dim);
                s(g, j) = dot * scale;
                tile_max = std::max(tile_max, s(g, j));
            }
            if (tile_max > m[g]) {
                const float alpha = std::exp(m[g] - tile_max);   // 0 on the first tile
                l[g] *= alpha;
                op.scale(acc_out + g * dv, alpha, dv);
                m[g] = tile_max;
            }
            l[g] += op.exp_sum(&s(g, 0), n, m[g]);
        }
        for (int j = 0; j < n; ++j) {
            const float* v = krow(0, j);
            if (!values_are_key0) {
                const uint8_t* row = row_at(values, head, t0 + j);
                if (values.enc == ENC_F32) {
                    v = reinterpret_cast<const float*>(row);
                } else {
                    op.dequant(values.enc, row, dv, vrow);
                    v = vrow;
                }
            }
            for (int g = 0; g < group; ++g) op.axpy(acc_out + g * dv, s(g, j), v, dv);
        }
    }
    for (int g = 0; g < group; ++g) {
        m_out[g] = m[g];
        l_out[g] = l[g];
    }
}

void check_rows(const KVRows& r, const char* what) {
    if (r.enc != ENC_F32 && r.enc != ENC_F16 && r.enc != ENC_BF16 && r.enc != ENC_Q8_0 && r.enc != ENC_Q4_0)
        throw std::invalid_argument(std::string("attention_decode: ") + what + " must be f32, f16, bf16, q8_0 or q4_0 rows");
    if (r.dim < 1 || padded_dim(r.enc, r.dim) > MAX_DIM)
        throw std::invalid_argument(std::string("attention_decode: ") + what + " rows must hold 1.." +
                                    std::to_string(MAX_DIM) + " values");
}

}  // namespace

void attention_decode(const float* q, int num_heads, int num_kv_heads, const std::vector<KVRows>& keys,
                      const KVRows& values, int num_keys, float scale, const float* sinks, float* out,
                      int num_threads, const std::string& isa) {
    if (keys.empty() || keys.size() > 4) throw std::invalid_argument("attention_decode: 1..4 key parts");
    for (const auto& k : keys) check_rows(k, "keys");
    check_rows(values, "values");
    if (num_kv_heads < 1 || num_heads % num_kv_heads || num_heads / num_kv_heads > MAX_GROUP)
        throw std::invalid_argument("attention_decode: heads must be a multiple of kv heads (at most 128 per kv head)");
    if (num_keys < 1) throw std::invalid_argument("attention_decode: no keys to attend to");
    const Ops& op = ops_for(isa);
    const int group = num_heads / num_kv_heads, dv = values.dim;
    int qcols = 0;
    for (const auto& k : keys) qcols += k.dim;
    const bool values_are_key0 = values.base == keys[0].base && values.enc == keys[0].enc && values.dim == keys[0].dim &&
                                 values.head_stride == keys[0].head_stride && values.row_stride == keys[0].row_stride;
    const int spans = (num_keys + SPAN - 1) / SPAN;
    const int tasks = num_kv_heads * spans;
    std::vector<float> m(static_cast<size_t>(tasks) * group), l(m.size()), acc(m.size() * dv);
    auto run = [&](int t) {
        const int head = t / spans, span = t % spans;
        const size_t at = static_cast<size_t>(t) * group;
        span_task(op, q, qcols, group, head, keys, values, values_are_key0, span * SPAN,
                  std::min(num_keys, (span + 1) * SPAN), scale, &m[at], &l[at], &acc[at * dv]);
    };
    const int64_t rows = static_cast<int64_t>(num_kv_heads) * num_keys;
    if (rows < PARALLEL_MIN_ROWS || num_threads <= 1 || tasks == 1) {
        for (int t = 0; t < tasks; ++t) run(t);
    } else {   // the kernel pool's threads claim the tasks (the caller too)
        parallel_run(num_threads, tasks, run);
    }
    // Merge the spans of each query head in order, with the sink (a key of logit sinks[h], value 0).
    for (int h = 0; h < num_heads; ++h) {
        const int head = h / group, g = h % group;
        float mx = sinks ? sinks[h] : -std::numeric_limits<float>::infinity();
        for (int s = 0; s < spans; ++s) mx = std::max(mx, m[(static_cast<size_t>(head) * spans + s) * group + g]);
        float total = sinks ? std::exp(sinks[h] - mx) : 0.f;
        float* o = out + static_cast<int64_t>(h) * dv;
        std::fill(o, o + dv, 0.f);
        for (int s = 0; s < spans; ++s) {
            const size_t at = (static_cast<size_t>(head) * spans + s) * group + g;
            const float w = std::exp(m[at] - mx);
            total += l[at] * w;
            op.axpy(o, w, &acc[at * dv], dv);
        }
        op.scale(o, 1.f / total, dv);
    }
}

}  // namespace lqf
