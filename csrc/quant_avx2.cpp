// AVX2 + FMA + F16C dot products. Only called after moe.cpp checked the CPU for these features;
// everything here has internal linkage except the table, so no AVX2 code leaks into other paths.
//
// Block formats: int8 products via maddubs (u8 x s8 -> pairs of i16) and madd (-> i32), one float
// FMA per 32 weights with the combined (weight scale * activation scale). No i16 sum can saturate:
// |w| <= 128 for q8_0 (sign trick), q <= 63 elsewhere, activations in [-127, 127].
#include <immintrin.h>

#include "quant.h"

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace lqf {
namespace {

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

float dot_f32(const uint8_t* row, const Act& a, int cols) {
    const float* w = reinterpret_cast<const float*>(row);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= cols; i += 16) {
        prefetch_ahead(row + 4 * i, 64);
        acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i), _mm256_loadu_ps(a.x + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(w + i + 8), _mm256_loadu_ps(a.x + i + 8), acc1);
    }
    float acc = hsum(_mm256_add_ps(acc0, acc1));
    for (; i < cols; ++i) acc += w[i] * a.x[i];
    return acc;
}

inline __m256 bf16x8(const uint8_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}

float dot_bf16(const uint8_t* row, const Act& a, int cols) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= cols; i += 16) {
        prefetch_ahead(row + 2 * i, 32);
        acc0 = _mm256_fmadd_ps(bf16x8(row + 2 * i), _mm256_loadu_ps(a.x + i), acc0);
        acc1 = _mm256_fmadd_ps(bf16x8(row + 2 * i + 16), _mm256_loadu_ps(a.x + i + 8), acc1);
    }
    float acc = hsum(_mm256_add_ps(acc0, acc1));
    for (; i < cols; ++i) acc += bf16_to_fp32(load_u16(row + 2 * i)) * a.x[i];
    return acc;
}

float dot_f16(const uint8_t* row, const Act& a, int cols) {
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    int i = 0;
    for (; i + 16 <= cols; i += 16) {
        prefetch_ahead(row + 2 * i, 32);
        acc0 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * i))),
                               _mm256_loadu_ps(a.x + i), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 2 * i + 16))),
                               _mm256_loadu_ps(a.x + i + 8), acc1);
    }
    float acc = hsum(_mm256_add_ps(acc0, acc1));
    for (; i < cols; ++i) acc += h2f(row + 2 * i) * a.x[i];
    return acc;
}

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

// q4_k and q5_k: value = d*sc_j*q - dmin*m_j. The q part runs in integers per sub-block; the
// mins part is dmin * sum_j m_j * s_j with s_j the activation block sums.
template <bool FIVE>
float dot_k_affine(const uint8_t* row, const Act& a, int cols) {
    constexpr int BB = FIVE ? 176 : 144;
    const __m256i m4 = _mm256_set1_epi8(0xF);
    __m256 acc = _mm256_setzero_ps(), accm = _mm256_setzero_ps();
    for (int b = 0; b < cols / QK; ++b, row += BB) {
        prefetch_ahead(row, BB);
        uint64_t sc8, m8;
        scale_min_k4_all(row + 4, &sc8, &m8);
        const float* da = a.q8.d + 8 * b;
        const __m256 scf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(sc8))));
        const __m256 mf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(m8))));
        const __m256 eff = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(h2f(row)), scf), _mm256_loadu_ps(da));
        accm = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(h2f(row + 2)), mf), _mm256_loadu_ps(a.q8.s + 8 * b), accm);
        const uint8_t* qs = row + (FIVE ? 48 : 16);
        const int8_t* x = a.q8.q + QK * b;
        __m256i qh;
        if (FIVE) qh = loadu(row + 16);
        for (int c = 0; c < 4; ++c) {
            const __m256i qb = loadu(qs + 32 * c);
            __m256i lo = _mm256_and_si256(qb, m4);
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(qb, 4), m4);
            if (FIVE) {
                const __m256i bl = _mm256_set1_epi8(static_cast<char>(1 << (2 * c)));
                const __m256i bh = _mm256_set1_epi8(static_cast<char>(1 << (2 * c + 1)));
                const __m256i sixteen = _mm256_set1_epi8(16);
                lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bl), bl), sixteen));
                hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bh), bh), sixteen));
            }
            const __m256i pl = dot_u8s8(lo, loadu(x + 64 * c));
            const __m256i ph = dot_u8s8(hi, loadu(x + 64 * c + 32));
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(pl), _mm256_permutevar8x32_ps(eff, _mm256_set1_epi32(2 * c)), acc);
            acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ph), _mm256_permutevar8x32_ps(eff, _mm256_set1_epi32(2 * c + 1)), acc);
        }
    }
    return hsum(acc) - hsum(accm);
}

float dot_q4_k(const uint8_t* row, const Act& a, int cols) { return dot_k_affine<false>(row, a, cols); }
float dot_q5_k(const uint8_t* row, const Act& a, int cols) { return dot_k_affine<true>(row, a, cols); }

float dot_q6_k(const uint8_t* row, const Act& a, int cols) {
    const __m256i m4 = _mm256_set1_epi8(0xF), m30 = _mm256_set1_epi8(0x30), k32 = _mm256_set1_epi8(32);
    __m256 acc = _mm256_setzero_ps();
    for (int b = 0; b < cols / QK; ++b, row += 210) {
        prefetch_ahead(row, 210);
        const float d = h2f(row + 208);
        const int8_t* sc = reinterpret_cast<const int8_t*>(row + 192);
        for (int n = 0; n < 2; ++n) {
            const __m256i L0 = loadu(row + 64 * n), L1 = loadu(row + 64 * n + 32), H = loadu(row + 128 + 32 * n);
            __m256i q[4];
            q[0] = _mm256_or_si256(_mm256_and_si256(L0, m4), _mm256_and_si256(_mm256_slli_epi16(H, 4), m30));
            q[1] = _mm256_or_si256(_mm256_and_si256(L1, m4), _mm256_and_si256(_mm256_slli_epi16(H, 2), m30));
            q[2] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(L0, 4), m4), _mm256_and_si256(H, m30));
            q[3] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(L1, 4), m4), _mm256_and_si256(_mm256_srli_epi16(H, 2), m30));
            for (int k = 0; k < 4; ++k) {
                const int ab = 8 * b + 4 * n + k;
                const __m256i x = loadu(a.q8.q + QA * ab);
                const __m256i p = _mm256_sub_epi16(_mm256_maddubs_epi16(q[k], x), _mm256_maddubs_epi16(k32, x));
                const __m256i s16 = _mm256_set_m128i(_mm_set1_epi16(sc[8 * n + 2 * k + 1]), _mm_set1_epi16(sc[8 * n + 2 * k]));
                acc = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p, s16)), _mm256_set1_ps(d * a.q8.d[ab]), acc);
            }
        }
    }
    return hsum(acc);
}

// the added block types (256-bit kernels, compiled here for this ISA)
#include "quant_simd_types.h"

}  // namespace

const KernelTable& avx2_kernels() {
    static const KernelTable t = [] {
        KernelTable k = {"avx2", {dot_f32, dot_f16, dot_bf16, dot_q8_0, dot_q4_0, dot_q4_k, dot_q5_k, dot_q6_k}};
        t_fill(k.dot);
        return k;
    }();
    return t;
}

}  // namespace lqf

#pragma GCC pop_options
