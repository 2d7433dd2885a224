#pragma once

// Shared by the SIMD files (included at the top of each one's target region and anonymous
// namespace, like quant_simd_types.h): the K-quant scale decode and the multi-column loop.

// q4_k / q5_k: a block's eight 6-bit sub-block scales and mins (from row + 4) as floats.
inline void k_scales(const uint8_t* row, __m256& scf, __m256& mf) {
    uint64_t sc8, m8;
    scale_min_k4_all(row + 4, &sc8, &m8);
    scf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(sc8))));
    mf = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_cvtsi64_si128(static_cast<long long>(m8))));
}

// q4_k / q5_k: sub-block pair c's 64 weights from 32 bytes of nibbles (low nibbles: the first 32,
// high: the next) plus, for q5_k, the fifth bit of each from qh (bits 2c and 2c+1 of each byte).
template <bool FIVE>
inline void k_quants(__m256i qb, __m256i qh, int c, __m256i m4, __m256i& lo, __m256i& hi) {
    lo = _mm256_and_si256(qb, m4);
    hi = _mm256_and_si256(_mm256_srli_epi16(qb, 4), m4);
    if (FIVE) {
        const __m256i bl = _mm256_set1_epi8(static_cast<char>(1 << (2 * c)));
        const __m256i bh = _mm256_set1_epi8(static_cast<char>(1 << (2 * c + 1)));
        const __m256i sixteen = _mm256_set1_epi8(16);
        lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bl), bl), sixteen));
        hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(qh, bh), bh), sixteen));
    }
}

// A column kernel's single-column case: K::run<1> (its one-column code is the GEMV, so a column of
// a wider call has the GEMV's bits).
template <class K>
inline float one_column(const uint8_t* row, const Act& a, int cols) {
    const Act* p = &a;
    float out;
    K::template run<1>(row, &p, cols, &out, 0);
    return out;
}

// ---- q4_k's and q5_k's one order (the AVX2 and AVX-512 kernels, one row or a lane per row) ----
//
// Per 256-value block: I_k = the sum of q * x over sub-block k (exact int32), then
//   block = tree(cvt(I_k) * ((d * sc_k) * dx_k)) - tree((dmin * m_k) * s_k)
// with tree(v) = ((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7)), and a row's blocks added in
// order: acc = acc + block. A kernel that holds one row per lane does the same operations lane by
// lane, so every row has the same bits however many rows or columns a call takes.

// tree(v) over the 8 lanes of v
inline float tree8(__m256 v) {
    const __m256 s1 = _mm256_add_ps(v, _mm256_permute_ps(v, 0xB1));      // v0+v1, v2+v3, ...
    const __m256 s2 = _mm256_add_ps(s1, _mm256_permute_ps(s1, 0x4E));    // (v0+v1)+(v2+v3), ...
    return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(s2), _mm256_extractf128_ps(s2, 1)));
}

// 8 x 8 transpose of 32-bit lanes: v[i] lane j -> v[j] lane i
inline void transpose8(__m256 v[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(v[i], v[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(v[i], v[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
    }
    for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x20);
        v[i + 4] = _mm256_permute2f128_ps(u[i], u[i + 4], 0x31);
    }
}

// Eight totals in lanes 0..7, from eight vectors of partial int32 sums (I[k]'s lanes add up to
// total k; integer sums, exact in any order).
inline __m256i lane_totals8(const __m256i I[8]) {
    const __m256i g0 = _mm256_hadd_epi32(_mm256_hadd_epi32(I[0], I[1]), _mm256_hadd_epi32(I[2], I[3]));
    const __m256i g1 = _mm256_hadd_epi32(_mm256_hadd_epi32(I[4], I[5]), _mm256_hadd_epi32(I[6], I[7]));
    return _mm256_add_epi32(_mm256_permute2x128_si256(g0, g1, 0x20), _mm256_permute2x128_si256(g0, g1, 0x31));
}

// A q4_k block's d * sc_k and dmin * m_k over k = 0..7.
inline void q4_k_scales(const uint8_t* blk, __m256& dsc, __m256& dmf) {
    __m256 scf, mf;
    k_scales(blk, scf, mf);
    dsc = _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(load_u16(blk))), scf);
    dmf = _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(load_u16(blk + 2))), mf);
}

// One block's value against one column: its totals, scales and the column's block scales d_k and sums s_k.
inline float q4_k_block(__m256i tot, __m256 dsc, __m256 dmf, const float* d, const float* s) {
    return tree8(_mm256_mul_ps(_mm256_cvtepi32_ps(tot), _mm256_mul_ps(dsc, _mm256_loadu_ps(d)))) -
           tree8(_mm256_mul_ps(dmf, _mm256_loadu_ps(s)));
}

// q6_k's group kernels sum q * x (q = 0..63) and subtract 32 times the column's sum of x over each
// 16-value sub-block: xs[16 * b + g] = 32 * that sum for sub-block g of block b.
inline void q6_k_offsets(const int8_t* q, int nblocks, int32_t* xs) {
    for (int g = 0; g < 16 * nblocks; ++g) {
        int32_t t = 0;
        for (int i = 0; i < 16; ++i) t += q[16 * g + i];
        xs[g] = 32 * t;
    }
}

// Many columns: K::run<N> computes one row against N <= 4 columns with each weight block decoded
// once; every column repeats the single-column kernel's operations in its order on its own
// accumulators, so the results are the same bits, and the N independent accumulator chains hide
// the FMA latency one column waits on. Groups of four columns run over all the rows of the tile
// (their activations stay in L1), then the one to three left (a single one through the
// single-column kernel K::one: nothing to share).
template <class K>
void dot_columns(const uint8_t* w, size_t row_bytes, int rows, const Act* const* acts, int n, int cols, float* out,
                 size_t ld) {
    int j = 0;
    for (; j + 4 <= n; j += 4)
        for (int r = 0; r < rows; ++r) K::template run<4>(w + r * row_bytes, acts + j, cols, out + j * ld + r, ld);
    for (int r = 0; r < rows && j < n; ++r) {
        const uint8_t* row = w + r * row_bytes;
        float* o = out + j * ld + r;
        switch (n - j) {
            case 3: K::template run<3>(row, acts + j, cols, o, ld); break;
            case 2: K::template run<2>(row, acts + j, cols, o, ld); break;
            default: *o = K::one(row, *acts[j], cols); break;     // one column: the single-column kernel
        }
    }
}

// The columns' int8 activations, block scales and block sums.
template <int N>
struct Columns {
    const int8_t* q[N];
    const float* d[N];
    const float* s[N];
    explicit Columns(const Act* const* acts) {
        for (int j = 0; j < N; ++j) {
            q[j] = acts[j]->q8.q;
            d[j] = acts[j]->q8.d;
            s[j] = acts[j]->q8.s;
        }
    }
};


// Float rows (ENC: f32, f16 or bf16) against N <= 4 columns of fp32 activations. V is the ISA's
// vector: W lanes, zero / loadx / fma / add / sum, and f32 / f16 / bf16 widening W stored values.
// Two accumulators per column over 2W values a step, then the tail one value at a time; N = 1 is
// the single-column kernel (`one`), so every column of a wider call has its bits, and the weights
// are widened once for all N columns.
template <class V, int ENC>
struct FloatN {
    static_assert(ENC == ENC_F32 || ENC == ENC_F16 || ENC == ENC_BF16, "FloatN reads the float encodings");
    static constexpr int VB = ENC == ENC_F32 ? 4 : 2;     // bytes a value
    static typename V::vec load(const uint8_t* p) {
        if constexpr (ENC == ENC_F32) return V::f32(p);
        else if constexpr (ENC == ENC_F16) return V::f16(p);
        else return V::bf16(p);
    }
    static float at(const uint8_t* p) {
        if constexpr (ENC == ENC_F32) {
            float v;
            std::memcpy(&v, p, 4);
            return v;
        } else if constexpr (ENC == ENC_F16) {
            return fp16_to_fp32(load_u16(p));
        } else {
            return bf16_to_fp32(load_u16(p));
        }
    }
    template <int N>
    static void run(const uint8_t* row, const Act* const* acts, int cols, float* out, size_t stride) {
        typename V::vec acc0[N], acc1[N];
        for (int j = 0; j < N; ++j) acc0[j] = acc1[j] = V::zero();
        int i = 0;
        for (; i + 2 * V::W <= cols; i += 2 * V::W) {
            prefetch_ahead(row + VB * i, 2 * V::W * VB);
            const typename V::vec w0 = load(row + VB * i), w1 = load(row + VB * (i + V::W));
            for (int j = 0; j < N; ++j) {
                acc0[j] = V::fma(w0, V::loadx(acts[j]->x + i), acc0[j]);
                acc1[j] = V::fma(w1, V::loadx(acts[j]->x + i + V::W), acc1[j]);
            }
        }
        for (int j = 0; j < N; ++j) {
            float acc = V::sum(V::add(acc0[j], acc1[j]));
            for (int k = i; k < cols; ++k) acc += at(row + VB * k) * acts[j]->x[k];
            out[j * stride] = acc;
        }
    }
    static float one(const uint8_t* row, const Act& a, int cols) { return one_column<FloatN>(row, a, cols); }
};
