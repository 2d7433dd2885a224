// AVX-512 (F + BW + VL + VNNI) dot products: the AVX2 scheme on 64-byte registers, two sub-blocks of 32
// per instruction. AVX-512 has no sign_epi8, so signed x signed products negate the activation
// under the weight's sign mask instead. Internal linkage except the table (see quant_avx2.cpp).
#include <immintrin.h>

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

template <bool FIVE>
float dot_k_affine(const uint8_t* row, const Act& a, int cols) {
    constexpr int BB = FIVE ? 176 : 144;
    const __m512i m4 = _mm512_set1_epi8(0xF);
    __m512 acc = _mm512_setzero_ps();
    __m256 accm = _mm256_setzero_ps();
    for (int b = 0; b < cols / QK; ++b, row += BB) {
        prefetch_ahead(row, BB);
        __m256 scf, mf;
        k_scales(row, scf, mf);
        const __m512 eff = _mm512_castps256_ps512(_mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(h2f(row)), scf),
                                                                _mm256_loadu_ps(a.q8.d + 8 * b)));
        accm = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(h2f(row + 2)), mf), _mm256_loadu_ps(a.q8.s + 8 * b), accm);
        const uint8_t* qs = row + (FIVE ? 48 : 16);
        const int8_t* x = a.q8.q + QK * b;
        __m512i qh2 = _mm512_setzero_si512();
        if (FIVE) qh2 = _mm512_broadcast_i64x4(loadu256(row + 16));
        for (int c = 0; c < 4; ++c) {
            const __m512i q = k_pair<FIVE>(qs, qh2, c, m4);
            const __m512i p = dot_u8s8(q, loadu(x + 64 * c));
            const __m512i idx = _mm512_mask_blend_epi32(0xFF00, _mm512_set1_epi32(2 * c), _mm512_set1_epi32(2 * c + 1));
            acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_permutexvar_ps(idx, eff), acc);
        }
    }
    __m128 t = _mm_add_ps(_mm256_castps256_ps128(accm), _mm256_extractf128_ps(accm, 1));
    t = _mm_add_ps(t, _mm_movehl_ps(t, t));
    return _mm512_reduce_add_ps(acc) - _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

float dot_q4_k(const uint8_t* row, const Act& a, int cols) { return dot_k_affine<false>(row, a, cols); }
float dot_q5_k(const uint8_t* row, const Act& a, int cols) { return dot_k_affine<true>(row, a, cols); }

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

float dot_q6_k(const uint8_t* row, const Act& a, int cols) {
    const __m512i m4 = _mm512_set1_epi8(0xF), m30 = _mm512_set1_epi8(0x30), k32 = _mm512_set1_epi8(32);
    // int16 lane i of a 32-lane vector takes scale (base + i / 8): four 16-weight groups.
    const __m512i idx0 = _mm512_set_epi16(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
    __m512 acc = _mm512_setzero_ps();
    for (int b = 0; b < cols / QK; ++b, row += 210) {
        prefetch_ahead(row, 210);
        const float d = h2f(row + 208);
        const __m512i sc16 = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 192))));
        for (int n = 0; n < 2; ++n) {
            __m512i q[2];
            q6_k_quants(row, n, m4, m30, q);
            for (int h = 0; h < 2; ++h) {
                const int ab = 8 * b + 4 * n + 2 * h;   // two activation blocks: ab, ab + 1
                const __m512i x = loadu(a.q8.q + QA * ab);
                const __m512i p = _mm512_sub_epi16(_mm512_maddubs_epi16(q[h], x), _mm512_maddubs_epi16(k32, x));
                const __m512i s16 = _mm512_permutexvar_epi16(_mm512_add_epi16(idx0, _mm512_set1_epi16(static_cast<short>(8 * n + 4 * h))), sc16);
                acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_madd_epi16(p, s16)), halves(d * a.q8.d[ab], d * a.q8.d[ab + 1]), acc);
            }
        }
    }
    return _mm512_reduce_add_ps(acc);
}

// ---- many columns (prefill; see quant_columns.h): each column repeats its single-column kernel's
// operations in order, so the bits are that kernel's ----


// q4_k and q5_k (dot_k_affine's order per column): scales, mins and the 64-weight vectors of each
// sub-block pair decoded once per block for every column.
template <bool FIVE>
struct KAffineN {
    static float one(const uint8_t* row, const Act& a, int cols) { return dot_k_affine<FIVE>(row, a, cols); }
    template <int N>
    static void run(const uint8_t* row, const Act* const* acts, int cols, float* out, size_t stride) {
        constexpr int BB = FIVE ? 176 : 144;
        const __m512i m4 = _mm512_set1_epi8(0xF);
        const Columns<N> x(acts);
        __m512 acc[N], eff[N];
        __m256 accm[N];
        for (int j = 0; j < N; ++j) {
            acc[j] = _mm512_setzero_ps();
            accm[j] = _mm256_setzero_ps();
        }
        for (int b = 0; b < cols / QK; ++b, row += BB) {
            prefetch_ahead(row, BB);
            __m256 scf, mf;
            k_scales(row, scf, mf);
            const __m256 dsc = _mm256_mul_ps(_mm256_set1_ps(h2f(row)), scf);
            const __m256 dmf = _mm256_mul_ps(_mm256_set1_ps(h2f(row + 2)), mf);
            for (int j = 0; j < N; ++j) {
                eff[j] = _mm512_castps256_ps512(_mm256_mul_ps(dsc, _mm256_loadu_ps(x.d[j] + 8 * b)));
                accm[j] = _mm256_fmadd_ps(dmf, _mm256_loadu_ps(x.s[j] + 8 * b), accm[j]);
            }
            const uint8_t* qs = row + (FIVE ? 48 : 16);
            __m512i qh2 = _mm512_setzero_si512();
            if (FIVE) qh2 = _mm512_broadcast_i64x4(loadu256(row + 16));
            for (int c = 0; c < 4; ++c) {
                const __m512i q = k_pair<FIVE>(qs, qh2, c, m4);
                const __m512i idx = _mm512_mask_blend_epi32(0xFF00, _mm512_set1_epi32(2 * c), _mm512_set1_epi32(2 * c + 1));
                for (int j = 0; j < N; ++j) {
                    const __m512i p = dot_u8s8(q, loadu(x.q[j] + QK * b + 64 * c));
                    acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), _mm512_permutexvar_ps(idx, eff[j]), acc[j]);
                }
            }
        }
        for (int j = 0; j < N; ++j) {
            __m128 t = _mm_add_ps(_mm256_castps256_ps128(accm[j]), _mm256_extractf128_ps(accm[j], 1));
            t = _mm_add_ps(t, _mm_movehl_ps(t, t));
            out[j * stride] = _mm512_reduce_add_ps(acc[j]) - _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
        }
    }
};

// q6_k (dot_q6_k's order per column): the 6-bit values and each group's scales decoded once per
// block for every column.
struct Q6KN {
    static float one(const uint8_t* row, const Act& a, int cols) { return dot_q6_k(row, a, cols); }
    template <int N>
    static void run(const uint8_t* row, const Act* const* acts, int cols, float* out, size_t stride) {
        const __m512i m4 = _mm512_set1_epi8(0xF), m30 = _mm512_set1_epi8(0x30), k32 = _mm512_set1_epi8(32);
        const __m512i idx0 = _mm512_set_epi16(3, 3, 3, 3, 3, 3, 3, 3, 2, 2, 2, 2, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
        const Columns<N> x(acts);
        __m512 acc[N];
        for (int j = 0; j < N; ++j) acc[j] = _mm512_setzero_ps();
        for (int b = 0; b < cols / QK; ++b, row += 210) {
            prefetch_ahead(row, 210);
            const float d = h2f(row + 208);
            const __m512i sc16 = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 192))));
            for (int n = 0; n < 2; ++n) {
                __m512i q[2];
                q6_k_quants(row, n, m4, m30, q);
                for (int h = 0; h < 2; ++h) {
                    const int ab = 8 * b + 4 * n + 2 * h;
                    const __m512i s16 = _mm512_permutexvar_epi16(_mm512_add_epi16(idx0, _mm512_set1_epi16(static_cast<short>(8 * n + 4 * h))), sc16);
                    for (int j = 0; j < N; ++j) {
                        const __m512i xj = loadu(x.q[j] + QA * ab);
                        const __m512i p = _mm512_sub_epi16(_mm512_maddubs_epi16(q[h], xj), _mm512_maddubs_epi16(k32, xj));
                        acc[j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_madd_epi16(p, s16)),
                                                 halves(d * x.d[j][ab], d * x.d[j][ab + 1]), acc[j]);
                    }
                }
            }
        }
        for (int j = 0; j < N; ++j) out[j * stride] = _mm512_reduce_add_ps(acc[j]);
    }
};

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
        k.dotn[ENC_Q4_K] = dot_columns<KAffineN<false>>;      // (other encodings: dot_many loops over dot)
        k.dotn[ENC_Q5_K] = dot_columns<KAffineN<true>>;
        k.dotn[ENC_Q6_K] = dot_columns<Q6KN>;
        k.dot[ENC_Q5_0] = dot_q5_0;
        k.dot[ENC_IQ4_NL] = dot_iq4_nl;
        k.dot[ENC_MXFP4] = dot_mxfp4;
        return k;
    }();
    return t;
}

}  // namespace lqf

#pragma GCC pop_options
