// 256-bit dot products of the added block types (layouts: quant_types.cpp), for the AVX2 and
// AVX-512 tables. Not a normal header: quant_avx2.cpp and quant_avx512.cpp include it inside their
// `#pragma GCC target` region and an anonymous namespace, so each gets its own copy compiled for
// its ISA and nothing here has external linkage (no AVX code can leak into another path).
//
// Scheme (as the q4_k/q8_0 kernels): per 32 weights, the block is unpacked into 32 int8 values w
// (nibbles, bit planes, or a grid lookup with sign masks), multiplied with the int8 activations by
// maddubs (|w| x sign-adjusted x; pairs stay below 2 * 127 * 127, no i16 saturation) and madd
// against per-16 integer sub-scales (1 where the format has none), then one FMA per 32 weights
// with the float (block scale * activation scale). Affine formats (q4_1, q5_1, q2_k) add their
// min term from the activation sums. IQ1 values dl * (grid +- 1/8) are computed as
// (dl / 8) * (8 grid +- 1), exactly the same number in integers.

inline float t_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

inline float t_h2f(const uint8_t* p) { return _cvtsh_ss(load_u16(p)); }
inline __m256i t_load(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
inline __m128i t_load128(const void* p) { return _mm_loadu_si128(static_cast<const __m128i*>(p)); }

// lanes 0-7 (values 0-15) take lo, lanes 8-15 (values 16-31) hi
inline __m256i t_sc16(int lo, int hi) {
    return _mm256_set_m128i(_mm_set1_epi16(static_cast<short>(hi)), _mm_set1_epi16(static_cast<short>(lo)));
}

// sum over i of sc[i / 16] * w[i] * x[i], as 8 x i32; w signed / unsigned
inline __m256i t_sdot(__m256i w, __m256i x, __m256i sc16) {
    return _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_sign_epi8(w, w), _mm256_sign_epi8(x, w)), sc16);
}
inline __m256i t_udot(__m256i w, __m256i x, __m256i sc16) { return _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), sc16); }

// 16 bytes of nibbles -> 32 values (low nibbles first, as every 32-value GGUF format)
inline __m256i t_nibbles(const uint8_t* qs) {
    const __m128i q = t_load128(qs), m4 = _mm_set1_epi8(0xF);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m4), _mm_and_si128(q, m4));
}

// byte i = 0xFF where bit i of v is set
inline __m256i t_bits32(uint32_t v) {
    const __m256i spread = _mm256_set_epi64x(0x0303030303030303LL, 0x0202020202020202LL, 0x0101010101010101LL, 0);
    const __m256i bit = _mm256_set1_epi64x(static_cast<long long>(0x8040201008040201ULL));
    const __m256i b = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(v)), spread);
    return _mm256_cmpeq_epi8(_mm256_and_si256(b, bit), bit);
}

inline __m256i t_u64x4(uint64_t a, uint64_t b, uint64_t c, uint64_t d) {
    return _mm256_set_epi64x(static_cast<long long>(d), static_cast<long long>(c), static_cast<long long>(b), static_cast<long long>(a));
}

// ---- 32-value blocks ----

// q4_1 / q5_1 (AFFINE: + m * sum x) and q5_0 (value - 16): one block -> 8 x i32 partial sums
template <int ENC>
inline __m256i t_legacy_block(const uint8_t* row, const int8_t* xq) {
    constexpr bool FIVE = ENC != ENC_Q4_1, AFFINE = ENC != ENC_Q5_0;
    constexpr int BB = ENC == ENC_Q4_1 ? 20 : (ENC == ENC_Q5_0 ? 22 : 24);
    const __m256i one16 = _mm256_set1_epi16(1), k16 = _mm256_set1_epi8(16);
    __m256i w = t_nibbles(row + BB - 16);
    if (FIVE) w = _mm256_or_si256(w, _mm256_and_si256(t_bits32(load_u32(row + BB - 20)), k16));
    const __m256i x = t_load(xq);
    return AFFINE ? t_udot(w, x, one16) : t_sdot(_mm256_sub_epi8(w, k16), x, one16);
}

template <int ENC>
float t_dot_legacy(const uint8_t* row, const Act& a, int cols) {
    constexpr bool AFFINE = ENC != ENC_Q5_0;
    constexpr int BB = ENC == ENC_Q4_1 ? 20 : (ENC == ENC_Q5_0 ? 22 : 24);
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    float accm = 0.f;
    const int nb = cols / 32;
    int b = 0;
    for (; b + 2 <= nb; b += 2, row += 2 * BB) {       // two blocks per step, two FMA chains
        prefetch_ahead(row, 2 * BB);
        const __m256i p0 = t_legacy_block<ENC>(row, a.q8.q + 32 * b);
        const __m256i p1 = t_legacy_block<ENC>(row + BB, a.q8.q + 32 * b + 32);
        acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(t_h2f(row) * a.q8.d[b]), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_set1_ps(t_h2f(row + BB) * a.q8.d[b + 1]), acc1);
        if (AFFINE) accm += t_h2f(row + 2) * a.q8.s[b] + t_h2f(row + BB + 2) * a.q8.s[b + 1];
    }
    if (b < nb) {
        const __m256i p = t_legacy_block<ENC>(row, a.q8.q + 32 * b);
        acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(t_h2f(row) * a.q8.d[b]), acc0);
        if (AFFINE) accm += t_h2f(row + 2) * a.q8.s[b];
    }
    return t_hsum(_mm256_add_ps(acc0, acc1)) + accm;
}

// iq4_nl (f16 d) and mxfp4 (e8m0 d): a nibble indexes 16 int8 values
template <int ENC>
float t_dot_nl(const uint8_t* row, const Act& a, int cols) {
    constexpr bool MX = ENC == ENC_MXFP4;
    constexpr int BB = MX ? 17 : 18;
    const __m256i tbl = _mm256_broadcastsi128_si256(t_load128(MX ? mxfp4_values() : g_iq.iq4nl));
    const __m256i one16 = _mm256_set1_epi16(1);
    auto scale = [](const uint8_t* blk) { return MX ? e8m0_half(blk[0]) : t_h2f(blk); };
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    const int nb = cols / 32;
    int b = 0;
    for (; b + 2 <= nb; b += 2, row += 2 * BB) {
        prefetch_ahead(row, 2 * BB);
        const __m256i p0 = t_sdot(_mm256_shuffle_epi8(tbl, t_nibbles(row + BB - 16)), t_load(a.q8.q + 32 * b), one16);
        const __m256i p1 = t_sdot(_mm256_shuffle_epi8(tbl, t_nibbles(row + 2 * BB - 16)), t_load(a.q8.q + 32 * b + 32), one16);
        acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0), _mm256_set1_ps(scale(row) * a.q8.d[b]), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1), _mm256_set1_ps(scale(row + BB) * a.q8.d[b + 1]), acc1);
    }
    if (b < nb) {
        const __m256i p = t_sdot(_mm256_shuffle_epi8(tbl, t_nibbles(row + BB - 16)), t_load(a.q8.q + 32 * b), one16);
        acc0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(scale(row) * a.q8.d[b]), acc0);
    }
    return t_hsum(_mm256_add_ps(acc0, acc1));
}

// ---- 256-value blocks: t_<type>(blk, j, group) unpacks 32-value group j (w, sub-scales, f) ----

// w: signed values; or, for the IQ2/IQ3 grids (all values positive), the grid values unsigned
// and neg = 0xFF where the sign is minus: the sign goes onto the activations instead (one
// sign_epi8), and maddubs takes the grid as its unsigned operand.
struct TGroup {
    __m256i w;
    __m256i neg;
    __m256i sc16;
    float f;
};

inline void t_iq4_xs(const uint8_t* k, int j, TGroup& g, __m256i tbl) {
    g.w = _mm256_shuffle_epi8(tbl, t_nibbles(k + 8 + 16 * j));
    const int ls = (((k[4 + j / 2] >> (4 * (j % 2))) & 0xF) | (((load_u16(k + 2) >> (2 * j)) & 3) << 4)) - 32;
    g.sc16 = _mm256_set1_epi16(static_cast<short>(ls));
    g.f = t_h2f(k);
}

inline void t_iq2_xxs(const uint8_t* k, int j, TGroup& g) {
    const uint8_t* q = k + 2 + 8 * j;
    const uint32_t aux = load_u32(q + 4);
    const uint64_t* gr = g_iq.iq2xxs;
    const uint64_t* sm = g_iq.ksign_masks;
    g.w = t_u64x4(gr[q[0]], gr[q[1]], gr[q[2]], gr[q[3]]);
    g.neg = t_u64x4(sm[aux & 127], sm[(aux >> 7) & 127], sm[(aux >> 14) & 127], sm[(aux >> 21) & 127]);
    g.sc16 = _mm256_set1_epi16(static_cast<short>(2 * (aux >> 28) + 1));
    g.f = t_h2f(k) * 0.125f;
}

inline void t_iq2_xs(const uint8_t* k, int j, TGroup& g) {
    const uint8_t* q = k + 2 + 8 * j;
    const uint16_t q0 = load_u16(q), q1 = load_u16(q + 2), q2 = load_u16(q + 4), q3 = load_u16(q + 6);
    const uint64_t* gr = g_iq.iq2xs;
    const uint64_t* sm = g_iq.ksign_masks;
    g.w = t_u64x4(gr[q0 & 511], gr[q1 & 511], gr[q2 & 511], gr[q3 & 511]);
    g.neg = t_u64x4(sm[q0 >> 9], sm[q1 >> 9], sm[q2 >> 9], sm[q3 >> 9]);
    const uint8_t sb = k[66 + j];
    g.sc16 = t_sc16(2 * (sb & 0xF) + 1, 2 * (sb >> 4) + 1);
    g.f = t_h2f(k) * 0.125f;
}

inline void t_iq2_s(const uint8_t* k, int j, TGroup& g) {
    const uint8_t* q = k + 2 + 4 * j;
    const int qh = k[66 + j];
    const uint64_t* gr = g_iq.iq2s;
    g.w = t_u64x4(gr[q[0] | ((qh << 8) & 0x300)], gr[q[1] | ((qh << 6) & 0x300)], gr[q[2] | ((qh << 4) & 0x300)],
                           gr[q[3] | ((qh << 2) & 0x300)]);
    g.neg = t_bits32(load_u32(k + 34 + 4 * j));
    const uint8_t sb = k[74 + j];
    g.sc16 = t_sc16(2 * (sb & 0xF) + 1, 2 * (sb >> 4) + 1);
    g.f = t_h2f(k) * 0.125f;
}

inline void t_iq3_xxs(const uint8_t* k, int j, TGroup& g) {
    const uint8_t* q = k + 2 + 8 * j;
    const uint32_t aux = load_u32(k + 66 + 4 * j);
    const uint32_t* gr = g_iq.iq3xxs;
    const uint64_t* sm = g_iq.ksign_masks;
    const __m256i w = _mm256_set_epi32(static_cast<int>(gr[q[7]]), static_cast<int>(gr[q[6]]), static_cast<int>(gr[q[5]]),
                                       static_cast<int>(gr[q[4]]), static_cast<int>(gr[q[3]]), static_cast<int>(gr[q[2]]),
                                       static_cast<int>(gr[q[1]]), static_cast<int>(gr[q[0]]));
    g.w = w;
    g.neg = t_u64x4(sm[aux & 127], sm[(aux >> 7) & 127], sm[(aux >> 14) & 127], sm[(aux >> 21) & 127]);
    g.sc16 = _mm256_set1_epi16(static_cast<short>(2 * (aux >> 28) + 1));
    g.f = t_h2f(k) * 0.25f;
}

inline void t_iq3_s(const uint8_t* k, int j, TGroup& g) {
    const uint8_t* q = k + 2 + 8 * j;
    const int qh = k[66 + j];
    const uint32_t* gr = g_iq.iq3s;
    int v[8];
    for (int t = 0; t < 8; ++t) v[t] = static_cast<int>(gr[q[t] | (((qh >> t) & 1) << 8)]);
    g.w = _mm256_set_epi32(v[7], v[6], v[5], v[4], v[3], v[2], v[1], v[0]);
    g.neg = t_bits32(load_u32(k + 74 + 4 * j));
    g.sc16 = _mm256_set1_epi16(static_cast<short>(1 + 2 * ((k[106 + j / 2] >> (4 * (j % 2))) & 0xF)));
    g.f = t_h2f(k);
}

inline void t_iq1_s(const uint8_t* k, int j, TGroup& g) {
    const uint8_t* q = k + 2 + 4 * j;
    const uint16_t qh = load_u16(k + 34 + 2 * j);
    const uint64_t* gr = g_iq.iq1s_x8;
    const __m256i w = t_u64x4(gr[q[0] | ((qh << 8) & 0x700)], gr[q[1] | ((qh << 5) & 0x700)], gr[q[2] | ((qh << 2) & 0x700)],
                              gr[q[3] | ((qh >> 1) & 0x700)]);
    g.w = _mm256_add_epi8(w, _mm256_set1_epi8((qh & 0x8000) ? -1 : 1));
    g.sc16 = _mm256_set1_epi16(static_cast<short>(2 * ((qh >> 12) & 7) + 1));
    g.f = t_h2f(k) * 0.125f;
}

inline void t_iq1_m(const uint8_t* k, int j, TGroup& g, float d) {
    const uint8_t* q = k + 4 * j;
    const int h0 = k[32 + 2 * j], h1 = k[33 + 2 * j];
    const uint64_t* gr = g_iq.iq1s_x8;
    const __m256i w = t_u64x4(gr[q[0] | ((h0 << 8) & 0x700)], gr[q[1] | ((h0 << 4) & 0x700)], gr[q[2] | ((h1 << 8) & 0x700)],
                              gr[q[3] | ((h1 << 4) & 0x700)]);
    const uint64_t plus = 0x0101010101010101ULL, minus = ~0ULL;
    g.w = _mm256_add_epi8(w, t_u64x4(h0 & 0x08 ? minus : plus, h0 & 0x80 ? minus : plus, h1 & 0x08 ? minus : plus,
                                     h1 & 0x80 ? minus : plus));
    const int sw = load_u16(k + 48 + 2 * (j / 2)) >> (6 * (j % 2));
    g.sc16 = t_sc16(2 * (sw & 7) + 1, 2 * ((sw >> 3) & 7) + 1);
    g.f = d * 0.125f;
}

inline float t_iq1_m_d(const uint8_t* k) {
    const uint8_t* s = k + 48;
    return _cvtsh_ss(static_cast<uint16_t>((load_u16(s) >> 12) | ((load_u16(s + 2) >> 8) & 0xF0) | ((load_u16(s + 4) >> 4) & 0xF00) |
                                           (load_u16(s + 6) & 0xF000)));
}

// The symmetric 256-value formats: sum over groups of f * d_act * (sc16-weighted integer dot).
template <int ENC>
float t_dot_super(const uint8_t* row, const Act& a, int cols) {
    constexpr int BB = ENC == ENC_IQ4_XS ? 136 : ENC == ENC_IQ3_XXS ? 98 : ENC == ENC_IQ3_S ? 110
                     : ENC == ENC_IQ2_XXS ? 66 : ENC == ENC_IQ2_XS ? 74 : ENC == ENC_IQ2_S ? 82 : ENC == ENC_IQ1_S ? 50 : 56;
    constexpr bool GRID = ENC == ENC_IQ2_XXS || ENC == ENC_IQ2_XS || ENC == ENC_IQ2_S || ENC == ENC_IQ3_XXS || ENC == ENC_IQ3_S;
    const __m256i tbl = ENC == ENC_IQ4_XS ? _mm256_broadcastsi128_si256(t_load128(g_iq.iq4nl)) : _mm256_setzero_si256();
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    TGroup g;
    for (int b = 0; b < cols / QK; ++b, row += BB) {
        prefetch_ahead(row, BB);
        const float d1m = ENC == ENC_IQ1_M ? t_iq1_m_d(row) : 0.f;
        for (int j = 0; j < 8; ++j) {
            switch (ENC) {
                case ENC_IQ4_XS: t_iq4_xs(row, j, g, tbl); break;
                case ENC_IQ2_XXS: t_iq2_xxs(row, j, g); break;
                case ENC_IQ2_XS: t_iq2_xs(row, j, g); break;
                case ENC_IQ2_S: t_iq2_s(row, j, g); break;
                case ENC_IQ3_XXS: t_iq3_xxs(row, j, g); break;
                case ENC_IQ3_S: t_iq3_s(row, j, g); break;
                case ENC_IQ1_S: t_iq1_s(row, j, g); break;
                default: t_iq1_m(row, j, g, d1m); break;
            }
            const int ab = 8 * b + j;
            const __m256i x = t_load(a.q8.q + QA * ab);
            const __m256i p = GRID ? t_udot(g.w, _mm256_sign_epi8(x, _mm256_or_si256(g.neg, _mm256_set1_epi8(1))), g.sc16)
                                   : t_sdot(g.w, x, g.sc16);
            acc[j & 1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(g.f * a.q8.d[ab]), acc[j & 1]);
        }
    }
    return t_hsum(_mm256_add_ps(acc[0], acc[1]));
}

// q2_k and q3_k: 16 sub-scales per block, applied in float after the integer sums: i32 lanes
// 0-3 of a 32-value group's madd hold its first 16 values, lanes 4-7 the second 16, so lane l
// takes scale 2j + l / 4, picked from the block's 16 scales (as floats) by a permute.
inline __m256 t_pick_scales(__m256 lo8, __m256 hi8, int j) {
    const int k = 2 * (j % 4);
    const __m256i idx = _mm256_set_epi32(k + 1, k + 1, k + 1, k + 1, k, k, k, k);
    return _mm256_permutevar8x32_ps(j < 4 ? lo8 : hi8, idx);
}

inline void t_scales16(__m128i s8, __m256* lo8, __m256* hi8) {
    *lo8 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(s8));
    *hi8 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(s8, 8)));
}

// q2_k: value = d * sc * q - dmin * m per 16 values; q unsigned 0..3.
inline float t_dot_q2_k(const uint8_t* row, const Act& a, int cols) {
    const __m256i m3 = _mm256_set1_epi8(3), ones8 = _mm256_set1_epi8(1), one16 = _mm256_set1_epi16(1);
    const __m128i m4 = _mm_set1_epi8(0xF);
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int b = 0; b < cols / QK; ++b, row += 84) {
        prefetch_ahead(row, 84);
        const float d = t_h2f(row + 80), dmin = t_h2f(row + 82);
        const __m128i sb = t_load128(row);
        __m256 sc_lo, sc_hi, mn_lo, mn_hi;
        t_scales16(_mm_and_si128(sb, m4), &sc_lo, &sc_hi);
        t_scales16(_mm_and_si128(_mm_srli_epi16(sb, 4), m4), &mn_lo, &mn_hi);
        for (int h = 0; h < 2; ++h) {
            const __m256i qb = t_load(row + 16 + 32 * h);
            for (int s = 0; s < 4; ++s) {
                const int j = 4 * h + s, ab = 8 * b + j;
                const __m256i w = _mm256_and_si256(_mm256_srli_epi16(qb, 2 * s), m3);
                const __m256i x = t_load(a.q8.q + QA * ab);
                const __m256 p = _mm256_cvtepi32_ps(t_udot(w, x, one16));
                const __m256 pm = _mm256_cvtepi32_ps(t_udot(ones8, x, one16));
                const float da = a.q8.d[ab];
                acc[s & 1] = _mm256_fmadd_ps(p, _mm256_mul_ps(t_pick_scales(sc_lo, sc_hi, j), _mm256_set1_ps(d * da)), acc[s & 1]);
                acc[s & 1] = _mm256_fnmadd_ps(pm, _mm256_mul_ps(t_pick_scales(mn_lo, mn_hi, j), _mm256_set1_ps(dmin * da)), acc[s & 1]);
            }
        }
    }
    return t_hsum(_mm256_add_ps(acc[0], acc[1]));
}

// q3_k: value = d * (sc - 32) * (q - 4 * !hbit); the 16 6-bit scales unpacked with word operations.
inline float t_dot_q3_k(const uint8_t* row, const Act& a, int cols) {
    const __m256i m3 = _mm256_set1_epi8(3), k4 = _mm256_set1_epi8(4), one16 = _mm256_set1_epi16(1);
    __m256 acc[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int b = 0; b < cols / QK; ++b, row += 110) {
        prefetch_ahead(row, 110);
        const float d = t_h2f(row + 108);
        const uint32_t w0 = load_u32(row + 96), w1 = load_u32(row + 100), w2 = load_u32(row + 104);
        const uint32_t lo4 = 0x0F0F0F0Fu, hi2 = 0x03030303u;
        const __m128i s8 = _mm_sub_epi8(
            _mm_set_epi32(static_cast<int>(((w1 >> 4) & lo4) | (((w2 >> 6) & hi2) << 4)),
                          static_cast<int>(((w0 >> 4) & lo4) | (((w2 >> 4) & hi2) << 4)),
                          static_cast<int>((w1 & lo4) | (((w2 >> 2) & hi2) << 4)),
                          static_cast<int>((w0 & lo4) | ((w2 & hi2) << 4))),
            _mm_set1_epi8(32));
        __m256 sc_lo, sc_hi;
        t_scales16(s8, &sc_lo, &sc_hi);
        const __m256i hm = t_load(row);
        for (int h = 0; h < 2; ++h) {
            const __m256i qb = t_load(row + 32 + 32 * h);
            for (int s = 0; s < 4; ++s) {
                const int j = 4 * h + s, ab = 8 * b + j;
                const __m256i q = _mm256_and_si256(_mm256_srli_epi16(qb, 2 * s), m3);
                const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << j));
                const __m256i clear = _mm256_cmpeq_epi8(_mm256_and_si256(hm, bit), _mm256_setzero_si256());
                const __m256i w = _mm256_sub_epi8(q, _mm256_and_si256(clear, k4));
                const __m256 p = _mm256_cvtepi32_ps(t_sdot(w, t_load(a.q8.q + QA * ab), one16));
                acc[s & 1] = _mm256_fmadd_ps(p, _mm256_mul_ps(t_pick_scales(sc_lo, sc_hi, j), _mm256_set1_ps(d * a.q8.d[ab])), acc[s & 1]);
            }
        }
    }
    return t_hsum(_mm256_add_ps(acc[0], acc[1]));
}

// The table entries ENC_Q4_1 .. ENC_IQ1_M, in id order.
inline void t_fill(DotFn* dot) {
    dot[ENC_Q4_1] = t_dot_legacy<ENC_Q4_1>;
    dot[ENC_Q5_0] = t_dot_legacy<ENC_Q5_0>;
    dot[ENC_Q5_1] = t_dot_legacy<ENC_Q5_1>;
    dot[ENC_Q2_K] = t_dot_q2_k;
    dot[ENC_Q3_K] = t_dot_q3_k;
    dot[ENC_IQ4_NL] = t_dot_nl<ENC_IQ4_NL>;
    dot[ENC_IQ4_XS] = t_dot_super<ENC_IQ4_XS>;
    dot[ENC_MXFP4] = t_dot_nl<ENC_MXFP4>;
    dot[ENC_IQ3_XXS] = t_dot_super<ENC_IQ3_XXS>;
    dot[ENC_IQ3_S] = t_dot_super<ENC_IQ3_S>;
    dot[ENC_IQ2_XXS] = t_dot_super<ENC_IQ2_XXS>;
    dot[ENC_IQ2_XS] = t_dot_super<ENC_IQ2_XS>;
    dot[ENC_IQ2_S] = t_dot_super<ENC_IQ2_S>;
    dot[ENC_IQ1_S] = t_dot_super<ENC_IQ1_S>;
    dot[ENC_IQ1_M] = t_dot_super<ENC_IQ1_M>;
}
