// AVX-512 (F + BW + VL + VNNI) dot products: the AVX2 scheme on 64-byte registers, two sub-blocks of 32
// per instruction. AVX-512 has no sign_epi8, so signed x signed products negate the activation
// under the weight's sign mask instead. Internal linkage except the table (see quant_avx2.cpp).
#include <immintrin.h>

#include <cstring>
#include <vector>

#include "quant.h"

// GCC 12's AVX-512 headers trip -Wuninitialized on their own _mm512_undefined_* helpers.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")

namespace lqf {
namespace {

#include "quant_columns.h"

inline float h2f(const uint8_t* p) { return _cvtsh_ss(load_u16(p)); }
inline __m512i loadu(const void* p) { return _mm512_loadu_si512(p); }
inline __m256i loadu256(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline __m512i join(__m256i lo, __m256i hi) { return _mm512_inserti64x4(_mm512_castsi256_si512(lo), hi, 1); }
// lanes 0-7 = a, lanes 8-15 = b
inline __m512 halves(float a, float b) { return _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(a), _mm512_set1_ps(b)); }

// u8 x s8, groups of 4 summed into i32 (VNNI: one instruction for maddubs + madd, no i16 step).
inline __m512i dot_u8s8(__m512i u, __m512i s) { return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s); }

inline __m512i dot_s8s8(__m512i w, __m512i x) {
    const __mmask64 neg = _mm512_movepi8_mask(w);
    return dot_u8s8(_mm512_abs_epi8(w), _mm512_mask_sub_epi8(x, neg, _mm512_setzero_si512(), x));
}

// The float encodings: FloatN (quant_columns.h) on 16-lane registers, one and four columns.
struct V512 {
    using vec = __m512;
    static constexpr int W = 16;
    static vec zero() { return _mm512_setzero_ps(); }
    static vec loadx(const float* p) { return _mm512_loadu_ps(p); }
    static vec fma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
    static vec add(vec a, vec b) { return _mm512_add_ps(a, b); }
    static float sum(vec v) { return _mm512_reduce_add_ps(v); }
    static vec f32(const uint8_t* p) { return _mm512_loadu_ps(reinterpret_cast<const float*>(p)); }
    static vec f16(const uint8_t* p) { return _mm512_cvtph_ps(loadu256(p)); }
    static vec bf16(const uint8_t* p) {
        return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(loadu256(p)), 16));
    }
};
using F32N = FloatN<V512, ENC_F32>;
using F16N = FloatN<V512, ENC_F16>;
using BF16N = FloatN<V512, ENC_BF16>;
float dot_f32(const uint8_t* row, const Act& a, int cols) { return F32N::one(row, a, cols); }
float dot_f16(const uint8_t* row, const Act& a, int cols) { return F16N::one(row, a, cols); }
float dot_bf16(const uint8_t* row, const Act& a, int cols) { return BF16N::one(row, a, cols); }

// One 32-value block's weights as signed bytes (w), for the 32-value formats.
inline __m256i q8_0_block(const uint8_t* blk) { return loadu256(blk + 2); }

inline __m256i q4_0_block(const uint8_t* blk) {
    const __m128i m4 = _mm_set1_epi8(0xF);
    const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 2));
    return _mm256_sub_epi8(_mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m4), _mm_and_si128(q, m4)), _mm256_set1_epi8(8));
}

inline float f16_scale(const uint8_t* blk) { return h2f(blk); }

// q8_0 and q4_0 (and q5_0, iq4_nl, mxfp4): blocks of BB bytes, a scale (SCALE: the f16 at byte 0
// unless told) then 32 values; two blocks per 512-bit step, an odd last block with 256-bit ops.
template <int BB, __m256i (*BLOCK)(const uint8_t*), float (*SCALE)(const uint8_t*) = f16_scale>
float dot_blocks32(const uint8_t* row, const Act& a, int cols) {
    __m512 acc = _mm512_setzero_ps();
    const int nb = cols / 32;
    int b = 0;
    for (; b + 2 <= nb; b += 2, row += 2 * BB) {
        prefetch_ahead(row, 2 * BB);
        const __m512i s = dot_s8s8(join(BLOCK(row), BLOCK(row + BB)), loadu(a.q8.q + 32 * b));
        acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), halves(SCALE(row) * a.q8.d[b], SCALE(row + BB) * a.q8.d[b + 1]), acc);
    }
    float out = _mm512_reduce_add_ps(acc);
    if (b < nb) {
        const __m256i w = BLOCK(row), x = loadu256(a.q8.q + 32 * b);
        const __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)), _mm256_set1_epi16(1));
        __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
        out += SCALE(row) * a.q8.d[b] * static_cast<float>(_mm_cvtsi128_si32(t));
    }
    return out;
}

float dot_q8_0(const uint8_t* row, const Act& a, int cols) { return dot_blocks32<34, q8_0_block>(row, a, cols); }
float dot_q4_0(const uint8_t* row, const Act& a, int cols) { return dot_blocks32<18, q4_0_block>(row, a, cols); }

// q4_k / q5_k sub-block pair c: [low nibbles = sub-block 2c | high nibbles = sub-block 2c+1], 64
// weights whose activations are contiguous; q5_k adds the fifth bit from qh (broadcast to both halves).
template <bool FIVE>
inline __m512i k_pair(const uint8_t* qs, __m512i qh2, int c, __m512i m4) {
    const __m512i v = _mm512_broadcast_i64x4(loadu256(qs + 32 * c));
    __m512i q = _mm512_and_si512(_mm512_mask_blend_epi64(0xF0, v, _mm512_srli_epi16(v, 4)), m4);
    if (FIVE) {
        const __m512i bits = _mm512_mask_blend_epi64(0xF0, _mm512_set1_epi8(static_cast<char>(1 << (2 * c))),
                                                     _mm512_set1_epi8(static_cast<char>(1 << (2 * c + 1))));
        q = _mm512_mask_add_epi8(q, _mm512_test_epi8_mask(qh2, bits), q, _mm512_set1_epi8(16));
    }
    return q;
}


// ---- q4_k and q5_k in their one order (quant_columns.h; the AVX2 kernels' bits), one row or
// sixteen rows at once (lanes = rows) ----

// Eight int32 totals in order from four vectors whose 128-bit lanes L = 0, 1 hold partial sums of
// total 2c and L = 2, 3 of total 2c + 1 (p[c]): three unpack-and-add steps leave lane 4L + c = the
// sum over lane L of p[c], then the halves are paired and the totals put in order (integer sums:
// exact in any order).
inline __m256i totals8(const __m512i p[4]) {
    const __m512i a = _mm512_add_epi32(_mm512_unpacklo_epi32(p[0], p[1]), _mm512_unpackhi_epi32(p[0], p[1]));
    const __m512i b = _mm512_add_epi32(_mm512_unpacklo_epi32(p[2], p[3]), _mm512_unpackhi_epi32(p[2], p[3]));
    const __m512i r = _mm512_add_epi32(_mm512_unpacklo_epi64(a, b), _mm512_unpackhi_epi64(a, b));
    const __m512i t = _mm512_add_epi32(r, _mm512_shuffle_i32x4(r, r, _MM_SHUFFLE(2, 3, 0, 1)));   // lanes c: 2c, 8 + c: 2c + 1
    const __m512i order = _mm512_setr_epi32(0, 8, 1, 9, 2, 10, 3, 11, 0, 0, 0, 0, 0, 0, 0, 0);
    return _mm512_castsi512_si256(_mm512_permutexvar_epi32(order, t));
}

// The block's sub-block totals against one column's 256 int8 values x, from its four pairs q[c]
// (k_pair: sub-blocks 2c | 2c + 1).
inline __m256i q4_k_dots(const __m512i q[4], const int8_t* x) {
    __m512i p[4];
    for (int c = 0; c < 4; ++c) p[c] = dot_u8s8(q[c], loadu(x + 64 * c));
    return totals8(p);
}

// q4_k_block (quant_columns.h) with its two trees in one 512-bit register: the products in lanes
// 0..7, the mins in 8..15; each add pairs the same two values as tree8's, so the bits are its.
inline float q4_k_block512(__m256i tot, __m256 dsc, __m256 dmf, const float* d, const float* s) {
    const __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(tot), _mm256_mul_ps(dsc, _mm256_loadu_ps(d)));
    const __m256 m = _mm256_mul_ps(dmf, _mm256_loadu_ps(s));
    __m512 z = _mm512_castpd_ps(_mm512_insertf64x4(_mm512_castpd256_pd512(_mm256_castps_pd(v)), _mm256_castps_pd(m), 1));
    z = _mm512_add_ps(z, _mm512_permute_ps(z, 0xB1));
    z = _mm512_add_ps(z, _mm512_permute_ps(z, 0x4E));
    z = _mm512_add_ps(z, _mm512_shuffle_f32x4(z, z, _MM_SHUFFLE(2, 3, 0, 1)));
    return _mm512_cvtss_f32(z) - _mm_cvtss_f32(_mm512_extractf32x4_ps(z, 2));
}

// One row against N <= 4 columns (a few tokens each expert: short prompts, and decode).
template <bool FIVE>
struct KCols {
    static constexpr int BB = FIVE ? 176 : 144;
    template <int N>
    static void run(const uint8_t* row, const Act* const* acts, int cols, float* out, size_t stride) {
        const __m512i m4 = _mm512_set1_epi8(0xF);
        const Columns<N> x(acts);
        float acc[N];
        for (int j = 0; j < N; ++j) acc[j] = 0.f;
        for (int b = 0; b < cols / QK; ++b, row += BB) {
            prefetch_ahead(row, BB);
            __m256 dsc, dmf;
            q4_k_scales(row, dsc, dmf);
            const __m512i qh2 = FIVE ? _mm512_broadcast_i64x4(loadu256(row + 16)) : _mm512_setzero_si512();
            __m512i q[4];
            for (int c = 0; c < 4; ++c) q[c] = k_pair<FIVE>(row + (FIVE ? 48 : 16), qh2, c, m4);
            for (int j = 0; j < N; ++j)
                acc[j] = acc[j] + q4_k_block512(q4_k_dots(q, x.q[j] + QK * b), dsc, dmf, x.d[j] + 8 * b, x.s[j] + 8 * b);
        }
        for (int j = 0; j < N; ++j) out[j * stride] = acc[j];
    }
    static float one(const uint8_t* row, const Act& a, int cols) { return one_column<KCols>(row, a, cols); }
};

float dot_q4_k(const uint8_t* row, const Act& a, int cols) { return KCols<false>::one(row, a, cols); }
float dot_q5_k(const uint8_t* row, const Act& a, int cols) { return KCols<true>::one(row, a, cols); }

// q4_k / q5_k against n columns, sixteen rows at a time with a lane per row: each group's values are
// unpacked once into [block][sub-block k][step s] vectors of 64 bytes (rows 0..15 x values
// 4s..4s+3), its scales into [block][k] vectors over the rows; a column's four activation bytes are
// broadcast against them and VNNI adds each lane's four products into its int32 (two chains a
// column, even and odd steps). Every row gets the GEMV's bits.
template <bool FIVE>
struct KRows16 {
    static constexpr int BB = FIVE ? 176 : 144;
    struct Group {
        std::vector<uint8_t> w;     // [blocks][8 k][8 s] x 64 bytes
        std::vector<float> e, m;    // [blocks][8 k] x 16 rows: d * sc_k and dmin * m_k
    };
    static void unpack(const uint8_t* w, size_t row_bytes, int nblocks, Group& g) {
        const __m256i m4 = _mm256_set1_epi8(0xF);
        g.w.resize(static_cast<size_t>(nblocks) * 64 * 64);
        g.e.resize(static_cast<size_t>(nblocks) * 128);
        g.m.resize(static_cast<size_t>(nblocks) * 128);
        for (int b = 0; b < nblocks; ++b) {
            for (int half = 0; half < 2; ++half) {      // rows 0..7, then 8..15: lanes 8 * half + r
                __m256 es[8], ms[8];
                __m256 q[8][8];                         // [k][row] as float lanes for the transpose (bits only)
                for (int r = 0; r < 8; ++r) {
                    const uint8_t* blk = w + (8 * half + r) * row_bytes + static_cast<size_t>(b) * BB;
                    q4_k_scales(blk, es[r], ms[r]);
                    const __m256i qh = FIVE ? loadu256(blk + 16) : _mm256_setzero_si256();
                    for (int c = 0; c < 4; ++c) {
                        __m256i lo, hi;
                        k_quants<FIVE>(loadu256(blk + (FIVE ? 48 : 16) + 32 * c), qh, c, m4, lo, hi);
                        q[2 * c][r] = _mm256_castsi256_ps(lo);
                        q[2 * c + 1][r] = _mm256_castsi256_ps(hi);
                    }
                }
                transpose8(es);
                transpose8(ms);
                for (int k = 0; k < 8; ++k) {
                    _mm256_storeu_ps(g.e.data() + 16 * (8 * b + k) + 8 * half, es[k]);
                    _mm256_storeu_ps(g.m.data() + 16 * (8 * b + k) + 8 * half, ms[k]);
                    transpose8(q[k]);           // row r's values 4s..4s+3 -> vector s, lane r
                    for (int s = 0; s < 8; ++s)
                        _mm256_storeu_ps(reinterpret_cast<float*>(g.w.data() + 64 * (64 * b + 8 * k + s) + 32 * half), q[k][s]);
                }
            }
        }
    }
    static __m512i bcast4(const int8_t* p) {
        int32_t v;
        std::memcpy(&v, p, 4);
        return _mm512_set1_epi32(v);
    }
    template <int N>
    static void run(const Group& g, int nblocks, const Act* const* acts, float* out, size_t ld) {
        const Columns<N> x(acts);
        __m512 acc[N];
        for (int j = 0; j < N; ++j) acc[j] = _mm512_setzero_ps();
        for (int b = 0; b < nblocks; ++b) {
            __m512 left[N], right[N];   // (p0 + p1) + (p2 + p3) and (p4 + p5) + (p6 + p7), built in that order
            for (int k = 0; k < 8; k += 2) {
                __m512 pair[N][2];
                for (int h = 0; h < 2; ++h) {
                    const uint8_t* wk = g.w.data() + 64 * (64 * b + 8 * (k + h));
                    __m512i i0[N], i1[N];
                    for (int j = 0; j < N; ++j) i0[j] = i1[j] = _mm512_setzero_si512();
                    for (int s = 0; s < 8; s += 2) {
                        const __m512i w0 = loadu(wk + 64 * s), w1 = loadu(wk + 64 * (s + 1));
                        for (int j = 0; j < N; ++j) {
                            const int8_t* xk = x.q[j] + QK * b + 32 * (k + h) + 4 * s;
                            i0[j] = _mm512_dpbusd_epi32(i0[j], w0, bcast4(xk));
                            i1[j] = _mm512_dpbusd_epi32(i1[j], w1, bcast4(xk + 4));
                        }
                    }
                    const __m512 e = _mm512_loadu_ps(g.e.data() + 16 * (8 * b + k + h));
                    for (int j = 0; j < N; ++j)
                        pair[j][h] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(i0[j], i1[j])),
                                                   _mm512_mul_ps(e, _mm512_set1_ps(x.d[j][8 * b + k + h])));
                }
                for (int j = 0; j < N; ++j) {
                    const __m512 pr = _mm512_add_ps(pair[j][0], pair[j][1]);
                    if (k == 0) left[j] = pr;
                    else if (k == 2) left[j] = _mm512_add_ps(left[j], pr);
                    else if (k == 4) right[j] = pr;
                    else right[j] = _mm512_add_ps(right[j], pr);
                }
            }
            const float* mb = g.m.data() + 128 * b;
            for (int j = 0; j < N; ++j) {
                const float* sj = x.s[j] + 8 * b;
                __m512 mm[8];
                for (int k = 0; k < 8; ++k) mm[k] = _mm512_mul_ps(_mm512_loadu_ps(mb + 16 * k), _mm512_set1_ps(sj[k]));
                const __m512 mt = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(mm[0], mm[1]), _mm512_add_ps(mm[2], mm[3])),
                                                _mm512_add_ps(_mm512_add_ps(mm[4], mm[5]), _mm512_add_ps(mm[6], mm[7])));
                acc[j] = _mm512_add_ps(acc[j], _mm512_sub_ps(_mm512_add_ps(left[j], right[j]), mt));
            }
        }
        for (int j = 0; j < N; ++j) _mm512_storeu_ps(out + j * ld, acc[j]);
    }
};

// dot_columns for q4_k / q5_k: groups of sixteen rows through KRows16 (four columns at a time, then
// two, then one), the rows left over through KCols; so are all rows against fewer than
// K_ROWS16_MIN_COLS columns, where unpacking a group costs more than it saves.
constexpr int K_ROWS16_MIN_COLS = 4;
template <bool FIVE>
void dot_columns_k(const uint8_t* w, size_t row_bytes, int rows, const Act* const* acts, int n, int cols, float* out,
                      size_t ld) {
    const int nblocks = cols / QK;
    thread_local typename KRows16<FIVE>::Group g;
    int r = 0;
    for (; n >= K_ROWS16_MIN_COLS && r + 16 <= rows; r += 16) {
        KRows16<FIVE>::unpack(w + r * row_bytes, row_bytes, nblocks, g);
        int j = 0;
        for (; j + 4 <= n; j += 4) KRows16<FIVE>::template run<4>(g, nblocks, acts + j, out + j * ld + r, ld);
        if (j + 2 <= n) {
            KRows16<FIVE>::template run<2>(g, nblocks, acts + j, out + j * ld + r, ld);
            j += 2;
        }
        if (j < n) KRows16<FIVE>::template run<1>(g, nblocks, acts + j, out + j * ld + r, ld);
    }
    if (r < rows) dot_columns<KCols<FIVE>>(w + r * row_bytes, row_bytes, rows - r, acts, n, cols, out + r, ld);
}

// q6_k: half n of a 256-value block's 6-bit values (0..63) as two vectors of 64, from its low
// nibbles [L0 | L1] and high 2-bit pairs [H | H].
inline void q6_k_quants(const uint8_t* row, int n, __m512i m4, __m512i m30, __m512i q[2]) {
    const __m512i L = loadu(row + 64 * n);
    const __m512i H = _mm512_broadcast_i64x4(loadu256(row + 128 + 32 * n));
    q[0] = _mm512_or_si512(_mm512_and_si512(L, m4),
                           _mm512_and_si512(_mm512_mask_blend_epi64(0xF0, _mm512_slli_epi16(H, 4), _mm512_slli_epi16(H, 2)), m30));
    q[1] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(L, 4), m4),
                           _mm512_and_si512(_mm512_mask_blend_epi64(0xF0, H, _mm512_srli_epi16(H, 2)), m30));
}

// ---- many columns (prefill; see quant_columns.h): each column repeats its single-column kernel's
// operations in order, so the bits are that kernel's ----


// ---- q6_k, one row or sixteen rows at once (lanes = rows) ----
//
// Per 256-value block, per activation block a (32 values: sub-blocks 2a, 2a + 1 of 16):
//   J_a = sc_2a * I_2a + sc_2a+1 * I_2a+1,  I_g = sum of (q - 32) * x over sub-block g (exact int32),
//   block = tree(cvt(J_a) * (d * dx_a)),  acc = acc + block  (tree: quant_columns.h's q4_k order).
// |J_a| < 2^24, so J_a is the same float whether made in int32 or from float products.

// The block's J_0..J_7 against one column's 256 int8 values x, from the block's values q[c]
// (activation blocks 2c | 2c + 1) and scales s16[c] (q6_k_decode).
inline __m256i q6_k_dots(const __m512i q[4], const __m512i s16[4], const int8_t* x) {
    const __m512i k32 = _mm512_set1_epi8(32);
    __m512i p[4];
    for (int c = 0; c < 4; ++c) {
        const __m512i xc = loadu(x + 64 * c);
        p[c] = _mm512_madd_epi16(_mm512_sub_epi16(_mm512_maddubs_epi16(q[c], xc), _mm512_maddubs_epi16(k32, xc)), s16[c]);
    }
    return totals8(p);
}

// A q6_k block's 256 values (0..63) as four vectors of 64 in order (q6_k_quants: activation blocks
// 2c | 2c + 1), and for each its scales as int16 lanes (lane i of vector c: sub-block 4c + i / 8).
inline void q6_k_decode(const uint8_t* row, __m512i q[4], __m512i s16[4]) {
    const __m512i m4 = _mm512_set1_epi8(0xF), m30 = _mm512_set1_epi8(0x30);
    const __m512i idx0 = _mm512_set_epi16(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    q6_k_quants(row, 0, m4, m30, q);
    q6_k_quants(row, 1, m4, m30, q + 2);
    const __m512i sc16 = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 192))));
    for (int c = 0; c < 4; ++c)
        s16[c] = _mm512_permutexvar_epi16(_mm512_add_epi16(idx0, _mm512_set1_epi16(static_cast<short>(4 * c))), sc16);
}

// One row against N <= 4 columns.
struct Q6KCols {
    template <int N>
    static void run(const uint8_t* row, const Act* const* acts, int cols, float* out, size_t stride) {
        const Columns<N> x(acts);
        float acc[N];
        for (int j = 0; j < N; ++j) acc[j] = 0.f;
        for (int b = 0; b < cols / QK; ++b, row += 210) {
            prefetch_ahead(row, 210);
            __m512i q[4], s16[4];
            q6_k_decode(row, q, s16);
            const __m256 d = _mm256_set1_ps(h2f(row + 208));
            for (int j = 0; j < N; ++j) {
                const __m256i J = q6_k_dots(q, s16, x.q[j] + QK * b);
                acc[j] = acc[j] + tree8(_mm256_mul_ps(_mm256_cvtepi32_ps(J), _mm256_mul_ps(d, _mm256_loadu_ps(x.d[j] + 8 * b))));
            }
        }
        for (int j = 0; j < N; ++j) out[j * stride] = acc[j];
    }
    static float one(const uint8_t* row, const Act& a, int cols) { return one_column<Q6KCols>(row, a, cols); }
};

float dot_q6_k(const uint8_t* row, const Act& a, int cols) { return Q6KCols::one(row, a, cols); }

// q6_k against n columns, sixteen rows at a time with a lane per row (KRows16's layout): values
// [block][activation block a][step s] x 64 bytes, d and the sixteen scales as floats over the rows;
// per sub-block, VNNI sums q * x (one chain each for 2a and 2a + 1), less 32 times the column's sum
// of x over it (xs, integers); J_a from float products, exact (see above). dot_q6_k's bits.
struct Q6KRows16 {
    struct Group {
        std::vector<uint8_t> w;     // [blocks][8 a][8 s] x 64 bytes
        std::vector<float> d, sc;   // [blocks] x 16 rows: d; [blocks][16 g] x 16 rows: sc_g
    };
    static void unpack(const uint8_t* w, size_t row_bytes, int nblocks, Group& g) {
        g.w.resize(static_cast<size_t>(nblocks) * 64 * 64);
        g.d.resize(static_cast<size_t>(nblocks) * 16);
        g.sc.resize(static_cast<size_t>(nblocks) * 256);
        for (int b = 0; b < nblocks; ++b) {
            for (int r = 0; r < 16; ++r) {
                const uint8_t* blk = w + r * row_bytes + static_cast<size_t>(b) * 210;
                g.d[16 * b + r] = h2f(blk + 208);
                for (int k = 0; k < 16; ++k) g.sc[256 * b + 16 * k + r] = static_cast<float>(static_cast<int8_t>(blk[192 + k]));
            }
            for (int half = 0; half < 2; ++half) {
                __m256 v[8][8];                         // [a][row] as float lanes for the transpose (bits only)
                for (int r = 0; r < 8; ++r) {
                    __m512i q[4];
                    const __m512i m4 = _mm512_set1_epi8(0xF), m30 = _mm512_set1_epi8(0x30);
                    const uint8_t* blk = w + (8 * half + r) * row_bytes + static_cast<size_t>(b) * 210;
                    q6_k_quants(blk, 0, m4, m30, q);
                    q6_k_quants(blk, 1, m4, m30, q + 2);
                    for (int c = 0; c < 4; ++c) {
                        v[2 * c][r] = _mm256_castsi256_ps(_mm512_castsi512_si256(q[c]));
                        v[2 * c + 1][r] = _mm256_castsi256_ps(_mm512_extracti64x4_epi64(q[c], 1));
                    }
                }
                for (int a = 0; a < 8; ++a) {
                    transpose8(v[a]);
                    for (int s = 0; s < 8; ++s)
                        _mm256_storeu_ps(reinterpret_cast<float*>(g.w.data() + 64 * (64 * b + 8 * a + s) + 32 * half), v[a][s]);
                }
            }
        }
    }
    template <int N>
    static void run(const Group& g, int nblocks, const Act* const* acts, const int32_t* const* xs, float* out, size_t ld) {
        const Columns<N> x(acts);
        __m512 acc[N];
        for (int j = 0; j < N; ++j) acc[j] = _mm512_setzero_ps();
        for (int b = 0; b < nblocks; ++b) {
            const __m512 db = _mm512_loadu_ps(g.d.data() + 16 * b);
            __m512 left[N], right[N];   // (p0 + p1) + (p2 + p3) and (p4 + p5) + (p6 + p7), built in that order
            for (int a = 0; a < 8; a += 2) {
                __m512 pair[N][2];
                for (int h = 0; h < 2; ++h) {
                    const uint8_t* wa = g.w.data() + 64 * (64 * b + 8 * (a + h));
                    __m512i i0[N], i1[N];
                    for (int j = 0; j < N; ++j) i0[j] = i1[j] = _mm512_setzero_si512();
                    for (int s = 0; s < 4; ++s) {
                        const __m512i w0 = loadu(wa + 64 * s), w1 = loadu(wa + 64 * (s + 4));
                        for (int j = 0; j < N; ++j) {
                            const int8_t* xa = x.q[j] + QK * b + 32 * (a + h) + 4 * s;
                            i0[j] = _mm512_dpbusd_epi32(i0[j], w0, KRows16<false>::bcast4(xa));
                            i1[j] = _mm512_dpbusd_epi32(i1[j], w1, KRows16<false>::bcast4(xa + 16));
                        }
                    }
                    const int ga = 16 * b + 2 * (a + h);
                    const __m512 s0 = _mm512_loadu_ps(g.sc.data() + 16 * ga), s1 = _mm512_loadu_ps(g.sc.data() + 16 * (ga + 1));
                    for (int j = 0; j < N; ++j) {
                        const __m512 J = _mm512_add_ps(
                            _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(i0[j], _mm512_set1_epi32(xs[j][ga]))), s0),
                            _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(i1[j], _mm512_set1_epi32(xs[j][ga + 1]))), s1));
                        pair[j][h] = _mm512_mul_ps(J, _mm512_mul_ps(db, _mm512_set1_ps(x.d[j][8 * b + a + h])));
                    }
                }
                for (int j = 0; j < N; ++j) {
                    const __m512 pr = _mm512_add_ps(pair[j][0], pair[j][1]);
                    if (a == 0) left[j] = pr;
                    else if (a == 2) left[j] = _mm512_add_ps(left[j], pr);
                    else if (a == 4) right[j] = pr;
                    else right[j] = _mm512_add_ps(right[j], pr);
                }
            }
            for (int j = 0; j < N; ++j) acc[j] = _mm512_add_ps(acc[j], _mm512_add_ps(left[j], right[j]));
        }
        for (int j = 0; j < N; ++j) _mm512_storeu_ps(out + j * ld, acc[j]);
    }
};

// dot_columns for q6_k: sixteen-row groups through Q6KRows16 for >= Q6K_ROWS16_MIN_COLS columns
// (each column's offsets once for the call), the rest through Q6KCols.
constexpr int Q6K_ROWS16_MIN_COLS = 4;
void dot_columns_q6_k(const uint8_t* w, size_t row_bytes, int rows, const Act* const* acts, int n, int cols, float* out,
                      size_t ld) {
    const int nblocks = cols / QK;
    int r = 0;
    if (n >= Q6K_ROWS16_MIN_COLS && rows >= 16) {
        thread_local Q6KRows16::Group g;
        thread_local std::vector<int32_t> xs;
        xs.resize(static_cast<size_t>(n) * 16 * nblocks);
        std::vector<const int32_t*> xp(n);
        for (int j = 0; j < n; ++j) {
            q6_k_offsets(acts[j]->q8.q, nblocks, xs.data() + static_cast<size_t>(j) * 16 * nblocks);
            xp[j] = xs.data() + static_cast<size_t>(j) * 16 * nblocks;
        }
        for (; r + 16 <= rows; r += 16) {
            Q6KRows16::unpack(w + r * row_bytes, row_bytes, nblocks, g);
            int j = 0;
            for (; j + 4 <= n; j += 4) Q6KRows16::run<4>(g, nblocks, acts + j, xp.data() + j, out + j * ld + r, ld);
            if (j + 2 <= n) {
                Q6KRows16::run<2>(g, nblocks, acts + j, xp.data() + j, out + j * ld + r, ld);
                j += 2;
            }
            if (j < n) Q6KRows16::run<1>(g, nblocks, acts + j, xp.data() + j, out + j * ld + r, ld);
        }
    }
    if (r < rows) dot_columns<Q6KCols>(w + r * row_bytes, row_bytes, rows - r, acts, n, cols, out + r, ld);
}

// the added block types (256-bit kernels, compiled here for this ISA)
#include "quant_simd_types.h"

// ... of which the symmetric 32-value ones run two blocks per 512-bit step (dot_blocks32)
inline __m256i q5_0_block(const uint8_t* blk) {
    const __m256i hi = _mm256_and_si256(t_bits32(load_u32(blk + 2)), _mm256_set1_epi8(16));
    return _mm256_sub_epi8(_mm256_or_si256(t_nibbles(blk + 6), hi), _mm256_set1_epi8(16));
}
inline __m256i iq4_nl_block(const uint8_t* blk) {
    return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(t_load128(g_iq.iq4nl)), t_nibbles(blk + 2));
}
inline __m256i mxfp4_block(const uint8_t* blk) {
    return _mm256_shuffle_epi8(_mm256_broadcastsi128_si256(t_load128(mxfp4_values())), t_nibbles(blk + 1));
}
inline float e8m0_scale(const uint8_t* blk) { return e8m0_half(blk[0]); }

float dot_q5_0(const uint8_t* row, const Act& a, int cols) { return dot_blocks32<22, q5_0_block>(row, a, cols); }
float dot_iq4_nl(const uint8_t* row, const Act& a, int cols) { return dot_blocks32<18, iq4_nl_block>(row, a, cols); }
float dot_mxfp4(const uint8_t* row, const Act& a, int cols) { return dot_blocks32<17, mxfp4_block, e8m0_scale>(row, a, cols); }

}  // namespace

const KernelTable& avx512_kernels() {
    static const KernelTable t = [] {
        KernelTable k = {"avx512", {dot_f32, dot_f16, dot_bf16, dot_q8_0, dot_q4_0, dot_q4_k, dot_q5_k, dot_q6_k}, {}};
        t_fill(k.dot);
        k.dotn[ENC_F32] = dot_columns<F32N>;
        k.dotn[ENC_F16] = dot_columns<F16N>;
        k.dotn[ENC_BF16] = dot_columns<BF16N>;
        k.dotn[ENC_Q4_K] = dot_columns_k<false>;                 // (other encodings: dot_many loops over dot)
        k.dotn[ENC_Q5_K] = dot_columns_k<true>;
        k.dotn[ENC_Q6_K] = dot_columns_q6_k;
        k.dot[ENC_Q5_0] = dot_q5_0;
        k.dot[ENC_IQ4_NL] = dot_iq4_nl;
        k.dot[ENC_MXFP4] = dot_mxfp4;
        return k;
    }();
    return t;
}

}  // namespace lqf

#pragma GCC pop_options
