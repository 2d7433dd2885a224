// AVX2 + FMA + F16C dot products. Only called after moe.cpp checked the CPU for these features;
// everything here has internal linkage except the table, so no AVX2 code leaks into other paths.
//
// Block formats: int8 products via maddubs (u8 x s8 -> pairs of i16) and madd (-> i32), one float
// FMA per 32 weights with the combined (weight scale * activation scale). No i16 sum can saturate:
// |w| <= 128 for q8_0 (sign trick), q <= 63 elsewhere, activations in [-127, 127].
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "quant.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace lqf {
namespace {

#include "quant_columns.h"

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

inline float h2f(const uint8_t* p) { return _cvtsh_ss(load_u16(p)); }

inline __m256i loadu(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

// sum over pairs of u8 x s8, then pairs of i16 -> 8 x i32
inline __m256i dot_u8s8(__m256i u, __m256i s) { return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)); }

// signed x signed: |w| x (x with w's sign)
inline __m256i dot_s8s8(__m256i w, __m256i x) { return dot_u8s8(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)); }

// The float encodings: FloatN (quant_columns.h) on 8-lane registers, one and four columns.
struct V256 {
    using vec = __m256;
    static constexpr int W = 8;
    static vec zero() { return _mm256_setzero_ps(); }
    static vec loadx(const float* p) { return _mm256_loadu_ps(p); }
    static vec fma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
    static vec add(vec a, vec b) { return _mm256_add_ps(a, b); }
    static float sum(vec v) { return hsum(v); }
    static vec f32(const uint8_t* p) { return _mm256_loadu_ps(reinterpret_cast<const float*>(p)); }
    static vec f16(const uint8_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
    static vec bf16(const uint8_t* p) {
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
    }
};
using F32N = FloatN<V256, ENC_F32>;
using F16N = FloatN<V256, ENC_F16>;
using BF16N = FloatN<V256, ENC_BF16>;
float dot_f32(const uint8_t* row, const Act& a, int cols) { return F32N::one(row, a, cols); }
float dot_f16(const uint8_t* row, const Act& a, int cols) { return F16N::one(row, a, cols); }
float dot_bf16(const uint8_t* row, const Act& a, int cols) { return BF16N::one(row, a, cols); }

float dot_q8_0(const uint8_t* row, const Act& a, int cols) {
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < cols / 32; ++b, row += 34) {
        prefetch_ahead(row, 34);
        const __m256i s = dot_s8s8(loadu(row + 2), loadu(a.q8.q + 32 * b));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(h2f(row) * a.q8.d[b]), acc);
    }
    return hsum(acc);
}

float dot_q4_0(const uint8_t* row, const Act& a, int cols) {
    const __m128i m4 = _mm_set1_epi8(0xF);
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < cols / 32; ++b, row += 18) {
        prefetch_ahead(row, 18);
        const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2));
        __m256i w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m4), _mm_and_si128(q, m4));
        w = _mm256_sub_epi8(w, _mm256_set1_epi8(8));
        const __m256i s = dot_s8s8(w, loadu(a.q8.q + 32 * b));
        acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(h2f(row) * a.q8.d[b]), acc);
    }
    return hsum(acc);
}

// q6_k: half n of a 256-value block's 6-bit values (unsigned, 0..63) as four vectors of 32, from
// its low nibbles (ql) and high 2-bit pairs (qh).
static inline void q6_k_quants(const uint8_t* row, int n, __m256i m4, __m256i m30, __m256i q[4]) {
    const __m256i L0 = loadu(row + 64 * n), L1 = loadu(row + 64 * n + 32), H = loadu(row + 128 + 32 * n);
    q[0] = _mm256_or_si256(_mm256_and_si256(L0, m4), _mm256_and_si256(_mm256_slli_epi16(H, 4), m30));
    q[1] = _mm256_or_si256(_mm256_and_si256(L1, m4), _mm256_and_si256(_mm256_slli_epi16(H, 2), m30));
    q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(L0, 4), m4), _mm256_and_si256(H, m30));
    q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(L1, 4), m4), _mm256_and_si256(_mm256_srli_epi16(H, 2), m30));
}

// ---- q4_k and q5_k in their one order (quant_columns.h), one row or eight rows at once (lanes = rows) ----

// A q4_k / q5_k block's values (lo[c], hi[c]: sub-blocks 2c and 2c + 1) and scales, decoded once
// for any number of columns.
template <bool FIVE>
inline void k_decode(const uint8_t* blk, __m256i lo[4], __m256i hi[4], __m256& dsc, __m256& dmf) {
    const __m256i m4 = _mm256_set1_epi8(0xF);
    q4_k_scales(blk, dsc, dmf);
    const __m256i qh = FIVE ? loadu(blk + 16) : _mm256_setzero_si256();
    for (int c = 0; c < 4; ++c) k_quants<FIVE>(loadu(blk + (FIVE ? 48 : 16) + 32 * c), qh, c, m4, lo[c], hi[c]);
}

// The block's sub-block totals against one column's 256 int8 values x.
inline __m256i q4_k_dots(const __m256i lo[4], const __m256i hi[4], const int8_t* x) {
    __m256i I[8];
    for (int c = 0; c < 4; ++c) {
        I[2 * c] = dot_u8s8(lo[c], loadu(x + 64 * c));
        I[2 * c + 1] = dot_u8s8(hi[c], loadu(x + 64 * c + 32));
    }
    return lane_totals8(I);
}

// One row against N <= 4 columns (a few tokens each expert: short prompts), the GEMV's bits.
template <bool FIVE>
struct KCols {
    static constexpr int BB = FIVE ? 176 : 144;
    template <int N>
    static void run(const uint8_t* row, const Act* const* acts, int cols, float* out, size_t stride) {
        const Columns<N> x(acts);
        float acc[N];
        for (int j = 0; j < N; ++j) acc[j] = 0.f;
        for (int b = 0; b < cols / QK; ++b, row += BB) {
            prefetch_ahead(row, BB);
            __m256i lo[4], hi[4];
            __m256 dsc, dmf;
            k_decode<FIVE>(row, lo, hi, dsc, dmf);
            for (int j = 0; j < N; ++j)
                acc[j] = acc[j] + q4_k_block(q4_k_dots(lo, hi, x.q[j] + QK * b), dsc, dmf, x.d[j] + 8 * b, x.s[j] + 8 * b);
        }
        for (int j = 0; j < N; ++j) out[j * stride] = acc[j];
    }
    static float one(const uint8_t* row, const Act& a, int cols) { return one_column<KCols>(row, a, cols); }
};

float dot_q4_k(const uint8_t* row, const Act& a, int cols) { return KCols<false>::one(row, a, cols); }
float dot_q5_k(const uint8_t* row, const Act& a, int cols) { return KCols<true>::one(row, a, cols); }

// q4_k / q5_k against n columns, eight rows at a time with a lane per row: each group's values are
// unpacked once into [block][sub-block k][step s] vectors of 32 bytes (rows 0..7 x values
// 4s..4s+3), its scales into [block][k] vectors over the rows; a column's four activation bytes are
// broadcast against them, and products stay in int16 until a madd: a q4_k sub-block's eight steps
// (|sum| <= 8 * 2 * 15 * 128 < 2^15), q5_k's four at a time (4 * 2 * 31 * 128 < 2^15). Every row
// gets the GEMV's bits (the same integers, the same float tree).
template <bool FIVE>
struct KRows8 {
    static constexpr int BB = FIVE ? 176 : 144;
    struct Group {
        std::vector<uint8_t> w;     // [blocks][8 k][8 s] x 32 bytes
        std::vector<float> e, m;    // [blocks][8 k] x 8 rows: d * sc_k and dmin * m_k
    };
    static void unpack(const uint8_t* w, size_t row_bytes, int nblocks, Group& g) {
        const __m256i m4 = _mm256_set1_epi8(0xF);
        g.w.resize(static_cast<size_t>(nblocks) * 64 * 32);
        g.e.resize(static_cast<size_t>(nblocks) * 64);
        g.m.resize(static_cast<size_t>(nblocks) * 64);
        for (int b = 0; b < nblocks; ++b) {
            __m256 es[8], ms[8];
            alignas(32) __m256 q[8][8];      // [k][row] as float lanes for the transpose (bits only)
            for (int r = 0; r < 8; ++r) {
                const uint8_t* blk = w + r * row_bytes + static_cast<size_t>(b) * BB;
                q4_k_scales(blk, es[r], ms[r]);
                const __m256i qh = FIVE ? loadu(blk + 16) : _mm256_setzero_si256();
                for (int c = 0; c < 4; ++c) {
                    __m256i lo, hi;
                    k_quants<FIVE>(loadu(blk + (FIVE ? 48 : 16) + 32 * c), qh, c, m4, lo, hi);
                    q[2 * c][r] = _mm256_castsi256_ps(lo);
                    q[2 * c + 1][r] = _mm256_castsi256_ps(hi);
                }
            }
            transpose8(es);
            transpose8(ms);
            for (int k = 0; k < 8; ++k) {
                _mm256_storeu_ps(g.e.data() + 8 * (8 * b + k), es[k]);
                _mm256_storeu_ps(g.m.data() + 8 * (8 * b + k), ms[k]);
                transpose8(q[k]);               // row r's values 4s..4s+3 -> vector s, lane r
                for (int s = 0; s < 8; ++s) _mm256_storeu_ps(reinterpret_cast<float*>(g.w.data() + 32 * (64 * b + 8 * k + s)), q[k][s]);
            }
        }
    }
    template <int N>
    static void run(const Group& g, int nblocks, const Act* const* acts, float* out, size_t ld) {
        const Columns<N> x(acts);
        __m256 acc[N];
        for (int j = 0; j < N; ++j) acc[j] = _mm256_setzero_ps();
        for (int b = 0; b < nblocks; ++b) {
            __m256 p[N][8];
            for (int k = 0; k < 8; ++k) {
                const uint8_t* wk = g.w.data() + 32 * (64 * b + 8 * k);
                __m256i a16[N];
                for (int j = 0; j < N; ++j) {
                    const int8_t* xk = x.q[j] + QK * b + 32 * k;
                    int32_t v;
                    std::memcpy(&v, xk, 4);
                    a16[j] = _mm256_maddubs_epi16(loadu(wk), _mm256_set1_epi32(v));
                }
                __m256i a32[N];
                for (int s = 1; s < 8; ++s) {
                    const __m256i ws = loadu(wk + 32 * s);
                    for (int j = 0; j < N; ++j) {
                        int32_t v;
                        std::memcpy(&v, x.q[j] + QK * b + 32 * k + 4 * s, 4);
                        const __m256i m = _mm256_maddubs_epi16(ws, _mm256_set1_epi32(v));
                        if (FIVE && s == 4) {           // q5_k: the first four steps to int32
                            a32[j] = _mm256_madd_epi16(a16[j], _mm256_set1_epi16(1));
                            a16[j] = m;
                        } else {
                            a16[j] = _mm256_add_epi16(a16[j], m);
                        }
                    }
                }
                for (int j = 0; j < N; ++j) {
                    const __m256 eff = _mm256_mul_ps(_mm256_loadu_ps(g.e.data() + 8 * (8 * b + k)), _mm256_set1_ps(x.d[j][8 * b + k]));
                    __m256i tot = _mm256_madd_epi16(a16[j], _mm256_set1_epi16(1));
                    if (FIVE) tot = _mm256_add_epi32(a32[j], tot);
                    p[j][k] = _mm256_mul_ps(_mm256_cvtepi32_ps(tot), eff);
                }
            }
            for (int j = 0; j < N; ++j) {
                __m256 mm[8];
                for (int k = 0; k < 8; ++k)
                    mm[k] = _mm256_mul_ps(_mm256_loadu_ps(g.m.data() + 8 * (8 * b + k)), _mm256_set1_ps(x.s[j][8 * b + k]));
                acc[j] = _mm256_add_ps(acc[j], _mm256_sub_ps(tree(p[j]), tree(mm)));
            }
        }
        for (int j = 0; j < N; ++j) _mm256_storeu_ps(out + j * ld, acc[j]);
    }
    // tree over eight vectors, lane by lane (tree8's order)
    static __m256 tree(const __m256 v[8]) {
        return _mm256_add_ps(_mm256_add_ps(_mm256_add_ps(v[0], v[1]), _mm256_add_ps(v[2], v[3])),
                             _mm256_add_ps(_mm256_add_ps(v[4], v[5]), _mm256_add_ps(v[6], v[7])));
    }
};

// dot_columns for q4_k / q5_k: groups of eight rows through KRows8 (two columns at a time), the rows
// left over (fewer than eight) through KCols; so are all rows against fewer than
// K_ROWS8_MIN_COLS columns, where unpacking a group costs more than it saves.
constexpr int K_ROWS8_MIN_COLS = 4;
template <bool FIVE>
void dot_columns_k(const uint8_t* w, size_t row_bytes, int rows, const Act* const* acts, int n, int cols, float* out,
                      size_t ld) {
    const int nblocks = cols / QK;
    thread_local typename KRows8<FIVE>::Group g;
    int r = 0;
    for (; n >= K_ROWS8_MIN_COLS && r + 8 <= rows; r += 8) {
        KRows8<FIVE>::unpack(w + r * row_bytes, row_bytes, nblocks, g);
        int j = 0;
        for (; j + 2 <= n; j += 2) KRows8<FIVE>::template run<2>(g, nblocks, acts + j, out + j * ld + r, ld);
        if (j < n) KRows8<FIVE>::template run<1>(g, nblocks, acts + j, out + j * ld + r, ld);
    }
    if (r < rows) dot_columns<KCols<FIVE>>(w + r * row_bytes, row_bytes, rows - r, acts, n, cols, out + r, ld);
}

// ---- many columns: one row against n activation vectors (prefill; see quant_columns.h) ----


// q8_0 and q4_0: the weight block's |w| and signs once, then per column dot_s8s8's remaining work.
template <bool FOUR>
struct Blocks32N {
    static float one(const uint8_t* row, const Act& a, int cols) { return FOUR ? dot_q4_0(row, a, cols) : dot_q8_0(row, a, cols); }
    template <int N>
    static void run(const uint8_t* row, const Act* const* acts, int cols, float* out, size_t stride) {
        constexpr int BB = FOUR ? 18 : 34;
        const Columns<N> x(acts);
        __m256 acc[N];
        for (int j = 0; j < N; ++j) acc[j] = _mm256_setzero_ps();
        for (int b = 0; b < cols / 32; ++b, row += BB) {
            prefetch_ahead(row, BB);
            __m256i w;
            if (FOUR) {
                const __m128i m4 = _mm_set1_epi8(0xF);
                const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2));
                w = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m4), _mm_and_si128(q, m4));
                w = _mm256_sub_epi8(w, _mm256_set1_epi8(8));
            } else {
                w = loadu(row + 2);
            }
            const __m256i aw = _mm256_sign_epi8(w, w);
            const float dw = h2f(row);
            for (int j = 0; j < N; ++j) {
                const __m256i s = dot_u8s8(aw, _mm256_sign_epi8(loadu(x.q[j] + 32 * b), w));
                acc[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_set1_ps(dw * x.d[j][b]), acc[j]);
            }
        }
        for (int j = 0; j < N; ++j) out[j * stride] = hsum(acc[j]);
    }
};

// ---- q6_k in its one order (quant_avx512.cpp's: the same bits), one row or eight rows at once ----
//
// Per 256-value block, per activation block a (32 values: sub-blocks 2a, 2a + 1 of 16):
//   J_a = sc_2a * I_2a + sc_2a+1 * I_2a+1,  I_g = sum of (q - 32) * x over sub-block g (exact int32),
//   block = tree(cvt(J_a) * (d * dx_a)),  acc = acc + block  (tree8, quant_columns.h).
// |J_a| < 2^24, so J_a is the same float whether made in int32 or from float products.

// A q6_k block's values q[a] (activation block a: 32 values, 0..63) and scales s16[a] (int16
// lanes 0..7: sc_2a, 8..15: sc_2a+1).
inline void q6_k_decode(const uint8_t* row, __m256i q[8], __m256i s16[8]) {
    const __m256i m4 = _mm256_set1_epi8(0xF), m30 = _mm256_set1_epi8(0x30);
    q6_k_quants(row, 0, m4, m30, q);
    q6_k_quants(row, 1, m4, m30, q + 4);
    const int8_t* sc = reinterpret_cast<const int8_t*>(row + 192);
    for (int a = 0; a < 8; ++a) s16[a] = _mm256_set_m128i(_mm_set1_epi16(sc[2 * a + 1]), _mm_set1_epi16(sc[2 * a]));
}

// One row against N <= 4 columns.
struct Q6KCols {
    template <int N>
    static void run(const uint8_t* row, const Act* const* acts, int cols, float* out, size_t stride) {
        const __m256i k32 = _mm256_set1_epi8(32);
        const Columns<N> x(acts);
        float acc[N];
        for (int j = 0; j < N; ++j) acc[j] = 0.f;
        for (int b = 0; b < cols / QK; ++b, row += 210) {
            prefetch_ahead(row, 210);
            __m256i q[8], s16[8];
            q6_k_decode(row, q, s16);
            const __m256 d = _mm256_set1_ps(h2f(row + 208));
            for (int j = 0; j < N; ++j) {
                __m256i P[8];
                for (int a = 0; a < 8; ++a) {
                    const __m256i xa = loadu(x.q[j] + QK * b + QA * a);
                    P[a] = _mm256_madd_epi16(_mm256_sub_epi16(_mm256_maddubs_epi16(q[a], xa), _mm256_maddubs_epi16(k32, xa)), s16[a]);
                }
                acc[j] = acc[j] + tree8(_mm256_mul_ps(_mm256_cvtepi32_ps(lane_totals8(P)), _mm256_mul_ps(d, _mm256_loadu_ps(x.d[j] + 8 * b))));
            }
        }
        for (int j = 0; j < N; ++j) out[j * stride] = acc[j];
    }
    static float one(const uint8_t* row, const Act& a, int cols) { return one_column<Q6KCols>(row, a, cols); }
};

float dot_q6_k(const uint8_t* row, const Act& a, int cols) { return Q6KCols::one(row, a, cols); }

// q6_k against n columns, eight rows at a time with a lane per row (KRows8's layout): values
// [block][activation block a][step s] x 32 bytes, d and the sixteen scales as floats over the rows;
// per sub-block, sums of q * x (two steps' products in int16: at most 2 * 2 * 63 * 128 < 2^15,
// then madd) less 32 times the column's sum of x over it; J_a from float products, exact (above).
// dot_q6_k's bits.
struct Q6KRows8 {
    struct Group {
        std::vector<uint8_t> w;     // [blocks][8 a][8 s] x 32 bytes
        std::vector<float> d, sc;   // [blocks] x 8 rows: d; [blocks][16 g] x 8 rows: sc_g
    };
    static void unpack(const uint8_t* w, size_t row_bytes, int nblocks, Group& g) {
        const __m256i m4 = _mm256_set1_epi8(0xF), m30 = _mm256_set1_epi8(0x30);
        g.w.resize(static_cast<size_t>(nblocks) * 64 * 32);
        g.d.resize(static_cast<size_t>(nblocks) * 8);
        g.sc.resize(static_cast<size_t>(nblocks) * 128);
        for (int b = 0; b < nblocks; ++b) {
            __m256 v[8][8];                             // [a][row] as float lanes for the transpose (bits only)
            for (int r = 0; r < 8; ++r) {
                const uint8_t* blk = w + r * row_bytes + static_cast<size_t>(b) * 210;
                g.d[8 * b + r] = h2f(blk + 208);
                for (int k = 0; k < 16; ++k) g.sc[128 * b + 8 * k + r] = static_cast<float>(static_cast<int8_t>(blk[192 + k]));
                __m256i q[8];
                q6_k_quants(blk, 0, m4, m30, q);
                q6_k_quants(blk, 1, m4, m30, q + 4);
                for (int a = 0; a < 8; ++a) v[a][r] = _mm256_castsi256_ps(q[a]);
            }
            for (int a = 0; a < 8; ++a) {
                transpose8(v[a]);                       // row r's values 4s..4s+3 -> vector s, lane r
                for (int s = 0; s < 8; ++s) _mm256_storeu_ps(reinterpret_cast<float*>(g.w.data() + 32 * (64 * b + 8 * a + s)), v[a][s]);
            }
        }
    }
    static __m256i bcast4(const int8_t* p) {
        int32_t v;
        std::memcpy(&v, p, 4);
        return _mm256_set1_epi32(v);
    }
    // the sum over one 16-value sub-block (four steps from ws) for the eight rows
    static __m256i sub_block(const uint8_t* ws, const int8_t* x) {
        const __m256i ones = _mm256_set1_epi16(1);
        const __m256i m0 = _mm256_add_epi16(_mm256_maddubs_epi16(loadu(ws), bcast4(x)), _mm256_maddubs_epi16(loadu(ws + 32), bcast4(x + 4)));
        const __m256i m1 = _mm256_add_epi16(_mm256_maddubs_epi16(loadu(ws + 64), bcast4(x + 8)), _mm256_maddubs_epi16(loadu(ws + 96), bcast4(x + 12)));
        return _mm256_add_epi32(_mm256_madd_epi16(m0, ones), _mm256_madd_epi16(m1, ones));
    }
    template <int N>
    static void run(const Group& g, int nblocks, const Act* const* acts, const int32_t* const* xs, float* out, size_t ld) {
        const Columns<N> x(acts);
        __m256 acc[N];
        for (int j = 0; j < N; ++j) acc[j] = _mm256_setzero_ps();
        for (int b = 0; b < nblocks; ++b) {
            const __m256 db = _mm256_loadu_ps(g.d.data() + 8 * b);
            __m256 left[N], right[N];   // (p0 + p1) + (p2 + p3) and (p4 + p5) + (p6 + p7), built in that order
            for (int j = 0; j < N; ++j) left[j] = right[j] = _mm256_setzero_ps();     // (set at a = 0 and 4)
            for (int a = 0; a < 8; a += 2) {
                __m256 pair[N][2];
                for (int h = 0; h < 2; ++h) {
                    const uint8_t* wa = g.w.data() + 32 * (64 * b + 8 * (a + h));
                    const int ga = 16 * b + 2 * (a + h);
                    const __m256 s0 = _mm256_loadu_ps(g.sc.data() + 8 * ga), s1 = _mm256_loadu_ps(g.sc.data() + 8 * (ga + 1));
                    for (int j = 0; j < N; ++j) {
                        const int8_t* xa = x.q[j] + QK * b + QA * (a + h);
                        const __m256i i0 = _mm256_sub_epi32(sub_block(wa, xa), _mm256_set1_epi32(xs[j][ga]));
                        const __m256i i1 = _mm256_sub_epi32(sub_block(wa + 128, xa + 16), _mm256_set1_epi32(xs[j][ga + 1]));
                        const __m256 J = _mm256_add_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(i0), s0), _mm256_mul_ps(_mm256_cvtepi32_ps(i1), s1));
                        pair[j][h] = _mm256_mul_ps(J, _mm256_mul_ps(db, _mm256_set1_ps(x.d[j][8 * b + a + h])));
                    }
                }
                for (int j = 0; j < N; ++j) {
                    const __m256 pr = _mm256_add_ps(pair[j][0], pair[j][1]);
                    if (a == 0) left[j] = pr;
                    else if (a == 2) left[j] = _mm256_add_ps(left[j], pr);
                    else if (a == 4) right[j] = pr;
                    else right[j] = _mm256_add_ps(right[j], pr);
                }
            }
            for (int j = 0; j < N; ++j) acc[j] = _mm256_add_ps(acc[j], _mm256_add_ps(left[j], right[j]));
        }
        for (int j = 0; j < N; ++j) _mm256_storeu_ps(out + j * ld, acc[j]);
    }
};

// dot_columns for q6_k: eight-row groups through Q6KRows8 for >= Q6K_ROWS8_MIN_COLS columns (each
// column's offsets once for the call, two columns a pass), the rest through Q6KCols.
constexpr int Q6K_ROWS8_MIN_COLS = 4;
void dot_columns_q6_k(const uint8_t* w, size_t row_bytes, int rows, const Act* const* acts, int n, int cols, float* out,
                      size_t ld) {
    const int nblocks = cols / QK;
    int r = 0;
    if (n >= Q6K_ROWS8_MIN_COLS && rows >= 8) {
        thread_local Q6KRows8::Group g;
        thread_local std::vector<int32_t> xs;
        xs.resize(static_cast<size_t>(n) * 16 * nblocks);
        std::vector<const int32_t*> xp(n);
        for (int j = 0; j < n; ++j) {
            xp[j] = xs.data() + static_cast<size_t>(j) * 16 * nblocks;
            q6_k_offsets(acts[j]->q8.q, nblocks, xs.data() + static_cast<size_t>(j) * 16 * nblocks);
        }
        for (; r + 8 <= rows; r += 8) {
            Q6KRows8::unpack(w + r * row_bytes, row_bytes, nblocks, g);
            int j = 0;
            for (; j + 2 <= n; j += 2) Q6KRows8::run<2>(g, nblocks, acts + j, xp.data() + j, out + j * ld + r, ld);
            if (j < n) Q6KRows8::run<1>(g, nblocks, acts + j, xp.data() + j, out + j * ld + r, ld);
        }
    }
    if (r < rows) dot_columns<Q6KCols>(w + r * row_bytes, row_bytes, rows - r, acts, n, cols, out + r, ld);
}

// the added block types (256-bit kernels, compiled here for this ISA)
#include "quant_simd_types.h"

}  // namespace

const KernelTable& avx2_kernels() {
    static const KernelTable t = [] {
        KernelTable k = {"avx2", {dot_f32, dot_f16, dot_bf16, dot_q8_0, dot_q4_0, dot_q4_k, dot_q5_k, dot_q6_k}, {}};
        t_fill(k.dot);
        k.dotn[ENC_F32] = dot_columns<F32N>;
        k.dotn[ENC_F16] = dot_columns<F16N>;
        k.dotn[ENC_BF16] = dot_columns<BF16N>;
        k.dotn[ENC_Q8_0] = dot_columns<Blocks32N<false>>;
        k.dotn[ENC_Q4_0] = dot_columns<Blocks32N<true>>;
        k.dotn[ENC_Q4_K] = dot_columns_k<false>;
        k.dotn[ENC_Q5_K] = dot_columns_k<true>;
        k.dotn[ENC_Q6_K] = dot_columns_q6_k;
        return k;
    }();
    return t;
}

}  // namespace lqf

#pragma GCC pop_options
