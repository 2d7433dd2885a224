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

