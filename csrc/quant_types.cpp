// The GGUF block types added for imports: Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, IQ4_NL, IQ4_XS, MXFP4 and
// the IQ3/IQ2/IQ1 grid types. Here: the IQ lookup tables (handed over from Python), exact
// dequantization (the float32 operations of gguf.quants, in its order; built with
// -ffp-contract=off) and the scalar dot products. The SIMD ones are in quant_simd_types.h.
//
// Block layouts (byte offsets; h = f16, values in order):
//   q4_1    20 B / 32:  h d, h m, 16 nibble bytes (low nibbles = values 0-15, high = 16-31); d*q + m
//   q5_0    22 B / 32:  h d, u32 qh (bit i = bit 4 of value i), 16 nibble bytes; d*(q - 16)
//   q5_1    24 B / 32:  h d, h m, u32 qh, 16 nibble bytes; d*q + m
//   q2_k    84 B / 256: 16 scale bytes (low nibble scale, high nibble min, per 16 values), 64 bytes of
//                       2-bit values (value 128h + 32s + l in bits 2s of byte 32h + l), h d, h dmin
//   q3_k   110 B / 256: 32 hmask bytes (bit j of byte l: value 32j + l has no -4), 64 bytes of 2-bit
//                       values (as q2_k), 12 bytes of 16 6-bit scales (offset 32), h d
//   iq4_nl  18 B / 32:  h d, 16 nibble bytes indexing the 16-value grid
//   iq4_xs 136 B / 256: h d, u16 scales_h (2 bits per 32), 4 bytes scales_l (nibbles), 128 nibble
//                       bytes (16 per 32 values); scale ls - 32
//   mxfp4   17 B / 32:  e8m0 byte, 16 nibble bytes of e2m1 values (stored doubled)
//   iq2_xxs 66 B / 256: h d, per 32 values two u32: 4 grid indices (bytes), then 4 x 7 sign bits and
//                       a 4-bit scale; d * (0.5 + ls) / 4
//   iq2_xs  74 B / 256: h d, 32 u16 (9-bit grid index, 7 sign bits), 8 scale bytes (nibble per 16)
//   iq2_s   82 B / 256: h d, 32 grid-index low bytes, 32 sign bytes, 8 qh bytes (2 index bits per
//                       8 values), 8 scale bytes (nibble per 16)
//   iq3_xxs 98 B / 256: h d, 64 grid indices (4 values each), per 32 values a u32 of 4 x 7 sign bits
//                       and a 4-bit scale; d * (0.5 + ls) / 2
//   iq3_s  110 B / 256: h d, 64 grid-index low bytes, 8 qh bytes (index bit 8), 32 sign bytes,
//                       4 scale bytes (nibble per 32); d * (1 + 2 ls)
//   iq1_s   50 B / 256: h d, 32 grid-index low bytes, 8 u16 (3 index bits per 8 values, 3-bit scale,
//                       delta sign); d * (2 ls + 1) * (grid +- 1/8)
//   iq1_m   56 B / 256: 32 grid-index low bytes, 16 qh bytes (a nibble per 8 values: 3 index bits and
//                       the delta sign), 4 u16 of 3-bit scales per 16 values whose top nibbles
//                       together are the f16 d
#include <stdexcept>
#include <string>
#include <vector>

#include "quant.h"

namespace lqf {

// ---- tables ----

IqTables g_iq;

namespace {

struct TableStore {
    std::vector<uint64_t> iq2xxs, iq2xs, iq2s, iq1s, iq1s_x8, ksign_masks;
    std::vector<uint32_t> iq3xxs, iq3s;
    std::vector<uint8_t> ksigns;
    std::vector<int8_t> iq4nl;
};
TableStore g_store;

constexpr uint64_t byte_mask(unsigned bits) {
    uint64_t m = 0;
    for (int k = 0; k < 8; ++k)
        if (bits & (1u << k)) m |= uint64_t{0xFF} << (8 * k);
    return m;
}

// POSITIVE: every byte must be 1..127 (the IQ2/IQ3 grids: the SIMD kernels take them as unsigned
// maddubs operands and put the signs on the activations).
template <class T>
void copy_into(std::vector<T>& v, const void* data, size_t nbytes, size_t want, const char* name, bool positive = false) {
    if (nbytes != want * sizeof(T))
        throw std::invalid_argument(std::string("set_iq_table ") + name + ": expected " + std::to_string(want * sizeof(T)) +
                                    " bytes, got " + std::to_string(nbytes));
    const uint8_t* p = static_cast<const uint8_t*>(data);
    for (size_t i = 0; positive && i < nbytes; ++i)
        if (p[i] < 1 || p[i] > 127)
            throw std::invalid_argument(std::string("set_iq_table ") + name + ": grid values must be 1..127");
    v.resize(want);
    std::memcpy(v.data(), data, nbytes);
}

}  // namespace

const uint64_t g_bit_masks[256] = {
#define M4(b) byte_mask(b), byte_mask(b + 1), byte_mask(b + 2), byte_mask(b + 3)
#define M16(b) M4(b), M4(b + 4), M4(b + 8), M4(b + 12)
#define M64(b) M16(b), M16(b + 16), M16(b + 32), M16(b + 48)
    M64(0), M64(64), M64(128), M64(192)
#undef M64
#undef M16
#undef M4
};

void set_iq_table(const char* name, const void* data, size_t nbytes) {
    const std::string n(name);
    TableStore& s = g_store;
    if (n == "iq2xxs") {
        copy_into(s.iq2xxs, data, nbytes, 256, name, true);
        g_iq.iq2xxs = s.iq2xxs.data();
    } else if (n == "iq2xs") {
        copy_into(s.iq2xs, data, nbytes, 512, name, true);
        g_iq.iq2xs = s.iq2xs.data();
    } else if (n == "iq2s") {
        copy_into(s.iq2s, data, nbytes, 1024, name, true);
        g_iq.iq2s = s.iq2s.data();
    } else if (n == "iq3xxs") {
        copy_into(s.iq3xxs, data, nbytes, 256, name, true);
        g_iq.iq3xxs = s.iq3xxs.data();
    } else if (n == "iq3s") {
        copy_into(s.iq3s, data, nbytes, 512, name, true);
        g_iq.iq3s = s.iq3s.data();
    } else if (n == "iq1s") {
        copy_into(s.iq1s, data, nbytes, 2048, name);
        s.iq1s_x8.resize(2048);
        for (int i = 0; i < 2048; ++i) {
            int8_t v[8];
            std::memcpy(v, &s.iq1s[i], 8);
            for (int k = 0; k < 8; ++k) {
                if (v[k] < -1 || v[k] > 1) throw std::invalid_argument("set_iq_table iq1s: grid values must be -1, 0 or 1");
                v[k] = static_cast<int8_t>(8 * v[k]);
            }
            std::memcpy(&s.iq1s_x8[i], v, 8);
        }
        g_iq.iq1s = s.iq1s.data();
        g_iq.iq1s_x8 = s.iq1s_x8.data();
    } else if (n == "ksigns") {
        copy_into(s.ksigns, data, nbytes, 128, name);
        s.ksign_masks.resize(128);
        for (int i = 0; i < 128; ++i) s.ksign_masks[i] = g_bit_masks[s.ksigns[i]];
        g_iq.ksigns = s.ksigns.data();
        g_iq.ksign_masks = s.ksign_masks.data();
    } else if (n == "iq4nl") {
        copy_into(s.iq4nl, data, nbytes, 16, name);
        g_iq.iq4nl = s.iq4nl.data();
    } else {
        throw std::invalid_argument("set_iq_table: unknown table '" + n +
                                    "' (expected iq2xxs, iq2xs, iq2s, iq3xxs, iq3s, iq1s, ksigns or iq4nl)");
    }
}

void require_tables(int enc) {
    auto need = [&](const void* p, const char* table, const char* type) {
        if (!p)
            throw std::runtime_error(std::string(type) + " kernels need the '" + table +
                                     "' table, which is not set: import lean_qwenflash.models.native (it loads the "
                                     "tables from the gguf package; pip install gguf) before using " + type + " weights");
    };
    switch (enc) {
        case ENC_IQ4_NL: need(g_iq.iq4nl, "iq4nl", "iq4_nl"); break;
        case ENC_IQ4_XS: need(g_iq.iq4nl, "iq4nl", "iq4_xs"); break;
        case ENC_IQ2_XXS: need(g_iq.iq2xxs, "iq2xxs", "iq2_xxs"); need(g_iq.ksigns, "ksigns", "iq2_xxs"); break;
        case ENC_IQ2_XS: need(g_iq.iq2xs, "iq2xs", "iq2_xs"); need(g_iq.ksigns, "ksigns", "iq2_xs"); break;
        case ENC_IQ2_S: need(g_iq.iq2s, "iq2s", "iq2_s"); break;
        case ENC_IQ3_XXS: need(g_iq.iq3xxs, "iq3xxs", "iq3_xxs"); need(g_iq.ksigns, "ksigns", "iq3_xxs"); break;
        case ENC_IQ3_S: need(g_iq.iq3s, "iq3s", "iq3_s"); break;
        case ENC_IQ1_S: need(g_iq.iq1s, "iq1s", "iq1_s"); break;
        case ENC_IQ1_M: need(g_iq.iq1s, "iq1s", "iq1_m"); break;
        default: break;
    }
}

// MXFP4's e2m1 element values, doubled (so they are integers): +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}.
static const int8_t kMxfp4Values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
const int8_t* mxfp4_values() { return kMxfp4Values; }

// ---- shared field readers ----

// q3_k: scale i (0..15) of the 12 packed bytes, offset removed.
static inline int q3_k_scale(const uint8_t* s, int i) {
    const int lo = i < 8 ? (s[i] & 0xF) : (s[i - 8] >> 4);
    const int hi = (s[8 + (i & 3)] >> (2 * (i >> 2))) & 3;
    return (lo | (hi << 4)) - 32;
}

// iq4_xs: 6-bit scale of sub-block j, offset removed.
static inline int iq4_xs_scale(const uint8_t* blk, int j) {
    const int lo = (blk[4 + j / 2] >> (4 * (j % 2))) & 0xF;
    const int hi = (load_u16(blk + 2) >> (2 * j)) & 3;
    return (lo | (hi << 4)) - 32;
}

// iq1_m: the f16 scale from the top nibbles of the four scale words.
static inline float iq1_m_d(const uint8_t* blk) {
    const uint8_t* s = blk + 48;
    const uint16_t h = static_cast<uint16_t>((load_u16(s) >> 12) | ((load_u16(s + 2) >> 8) & 0xF0) |
                                             ((load_u16(s + 4) >> 4) & 0xF00) | (load_u16(s + 6) & 0xF000));
    return fp16_to_fp32(h);
}

static inline int8_t grid_at(uint64_t g, int k) { return static_cast<int8_t>(g >> (8 * k)); }

// ---- exact dequantization ----
//
// One function per type (the switch is outside the block loop) with plain loops the compiler can
// vectorize; -ffp-contract=off keeps each product and sum rounded on its own, as numpy does.
// gguf's `(db * grid) * sign` with sign = +-1.0f is the same multiplication here.

// y[i] = (db * grid[i]) * (+-1) for the 8 values of one grid row, signs from 0xFF/0x00 mask bytes;
// the multiplication by -1 as a flip of the sign bit (the same result, and no branch on random signs)
static inline void grid_row(float* y, float db, uint64_t grid, uint64_t neg_masks) {
    int8_t g[8];
    uint8_t n[8];
    std::memcpy(g, &grid, 8);
    std::memcpy(n, &neg_masks, 8);
    for (int i = 0; i < 8; ++i) {
        const float v = db * static_cast<float>(g[i]);
        uint32_t bits;
        std::memcpy(&bits, &v, 4);
        bits ^= static_cast<uint32_t>(n[i] & 0x80) << 24;
        std::memcpy(y + i, &bits, 4);
    }
}

template <int ENC>
static void deq_block(const uint8_t* k, float* __restrict y) {
    if constexpr (ENC == ENC_Q4_1) {
        const float d = fp16_to_fp32(load_u16(k)), m = fp16_to_fp32(load_u16(k + 2));
        for (int i = 0; i < 16; ++i) {
            y[i] = d * static_cast<float>(k[4 + i] & 0xF) + m;
            y[16 + i] = d * static_cast<float>(k[4 + i] >> 4) + m;
        }
    } else if constexpr (ENC == ENC_Q5_0 || ENC == ENC_Q5_1) {
        constexpr bool one = ENC == ENC_Q5_1;
        const float d = fp16_to_fp32(load_u16(k)), m = one ? fp16_to_fp32(load_u16(k + 2)) : 0.f;
        const uint32_t qh = load_u32(k + (one ? 4 : 2));
        const uint8_t* qs = k + (one ? 8 : 6);
        int q[32];
        for (int i = 0; i < 16; ++i) {
            q[i] = (qs[i] & 0xF) | static_cast<int>(((qh >> i) & 1) << 4);
            q[16 + i] = (qs[i] >> 4) | static_cast<int>(((qh >> (16 + i)) & 1) << 4);
        }
        for (int i = 0; i < 32; ++i) y[i] = one ? d * static_cast<float>(q[i]) + m : d * static_cast<float>(q[i] - 16);
    } else if constexpr (ENC == ENC_Q2_K || ENC == ENC_Q3_K) {
        // value 128h + 32s + l: bits 2s of byte 32h + l; 16-value scale group 8h + 2s + l / 16
        constexpr bool three = ENC == ENC_Q3_K;
        const float d = fp16_to_fp32(load_u16(k + (three ? 108 : 80)));
        const float dmin = three ? 0.f : fp16_to_fp32(load_u16(k + 82));
        const uint8_t* qs = k + (three ? 32 : 16);
        for (int h = 0; h < 2; ++h)
            for (int s = 0; s < 4; ++s)
                for (int half = 0; half < 2; ++half) {
                    const int g = 8 * h + 2 * s + half, j = 4 * h + s;
                    float* yy = y + 16 * g;
                    const uint8_t* q = qs + 32 * h + 16 * half;
                    if (three) {
                        const float dl = d * static_cast<float>(q3_k_scale(k + 96, g));
                        const uint8_t* hm = k + 16 * half;
                        for (int l = 0; l < 16; ++l)
                            yy[l] = dl * static_cast<float>(((q[l] >> (2 * s)) & 3) - (((hm[l] >> j) & 1) ? 0 : 4));
                    } else {
                        const float dl = d * static_cast<float>(k[g] & 0xF), ml = dmin * static_cast<float>(k[g] >> 4);
                        for (int l = 0; l < 16; ++l) yy[l] = dl * static_cast<float>((q[l] >> (2 * s)) & 3) - ml;
                    }
                }
    } else if constexpr (ENC == ENC_IQ4_NL || ENC == ENC_MXFP4) {
        constexpr bool mx = ENC == ENC_MXFP4;
        const float d = mx ? e8m0_half(k[0]) : fp16_to_fp32(load_u16(k));
        const int8_t* tv = mx ? kMxfp4Values : g_iq.iq4nl;
        const uint8_t* qs = k + (mx ? 1 : 2);
        for (int i = 0; i < 16; ++i) {
            y[i] = d * static_cast<float>(tv[qs[i] & 0xF]);
            y[16 + i] = d * static_cast<float>(tv[qs[i] >> 4]);
        }
    } else if constexpr (ENC == ENC_IQ4_XS) {
        const float d = fp16_to_fp32(load_u16(k));
        for (int j = 0; j < 8; ++j) {
            const float dl = d * static_cast<float>(iq4_xs_scale(k, j));
            const uint8_t* qs = k + 8 + 16 * j;
            for (int i = 0; i < 16; ++i) {
                y[32 * j + i] = dl * static_cast<float>(g_iq.iq4nl[qs[i] & 0xF]);
                y[32 * j + 16 + i] = dl * static_cast<float>(g_iq.iq4nl[qs[i] >> 4]);
            }
        }
    } else if constexpr (ENC == ENC_IQ2_XXS || ENC == ENC_IQ2_XS || ENC == ENC_IQ2_S) {
        // per 8 values t: a grid row, its sign masks, and the scale of its 16 (xs, s) or 32 (xxs)
        const float d = fp16_to_fp32(load_u16(k));
        for (int t = 0; t < 32; ++t) {
            uint64_t g, neg;
            int ls;
            if constexpr (ENC == ENC_IQ2_XXS) {
                const uint8_t* q = k + 2 + 8 * (t / 4);
                const uint32_t aux = load_u32(q + 4);
                g = g_iq.iq2xxs[q[t % 4]];
                neg = g_iq.ksign_masks[(aux >> (7 * (t % 4))) & 127];
                ls = static_cast<int>(aux >> 28);
            } else if constexpr (ENC == ENC_IQ2_XS) {
                const uint16_t q = load_u16(k + 2 + 2 * t);
                g = g_iq.iq2xs[q & 511];
                neg = g_iq.ksign_masks[q >> 9];
                ls = (k[66 + t / 4] >> (4 * ((t / 2) % 2))) & 0xF;
            } else {
                g = g_iq.iq2s[k[2 + t] | (((k[66 + t / 4] >> (2 * (t % 4))) & 3) << 8)];
                neg = g_bit_masks[k[34 + t]];
                ls = (k[74 + t / 4] >> (4 * ((t / 2) % 2))) & 0xF;
            }
            const float db = d * (0.5f + static_cast<float>(ls)) * 0.25f;
            grid_row(y + 8 * t, db, g, neg);
        }
    } else if constexpr (ENC == ENC_IQ3_XXS || ENC == ENC_IQ3_S) {
        const float d = fp16_to_fp32(load_u16(k));
        for (int j = 0; j < 8; ++j) {
            float db;
            if constexpr (ENC == ENC_IQ3_XXS) {
                db = d * (0.5f + static_cast<float>(load_u32(k + 66 + 4 * j) >> 28)) * 0.5f;
            } else {
                db = d * static_cast<float>(1 + 2 * ((k[106 + j / 2] >> (4 * (j % 2))) & 0xF));
            }
            for (int l = 0; l < 4; ++l) {          // 8 values: two grid rows of 4
                uint64_t g, neg;
                if constexpr (ENC == ENC_IQ3_XXS) {
                    const uint8_t* q = k + 2 + 8 * j + 2 * l;
                    g = g_iq.iq3xxs[q[0]] | (uint64_t{g_iq.iq3xxs[q[1]]} << 32);
                    neg = g_iq.ksign_masks[(load_u32(k + 66 + 4 * j) >> (7 * l)) & 127];
                } else {
                    const int qh = k[66 + j], t0 = 2 * l, t1 = 2 * l + 1;
                    g = g_iq.iq3s[k[2 + 8 * j + t0] | (((qh >> t0) & 1) << 8)] |
                        (uint64_t{g_iq.iq3s[k[2 + 8 * j + t1] | (((qh >> t1) & 1) << 8)]} << 32);
                    neg = g_bit_masks[k[74 + 4 * j + l]];
                }
                grid_row(y + 32 * j + 8 * l, db, g, neg);
            }
        }
    } else if constexpr (ENC == ENC_IQ1_S) {
        const float d = fp16_to_fp32(load_u16(k));
        for (int j = 0; j < 8; ++j) {
            const uint16_t qh = load_u16(k + 34 + 2 * j);
            const float dl = d * static_cast<float>(2 * ((qh >> 12) & 7) + 1);
            const float delta = (qh & 0x8000) ? -0.125f : 0.125f;
            for (int l = 0; l < 4; ++l) {
                const uint64_t g = g_iq.iq1s[k[2 + 4 * j + l] | (((qh >> (3 * l)) & 7) << 8)];
                for (int i = 0; i < 8; ++i) y[32 * j + 8 * l + i] = dl * (static_cast<float>(grid_at(g, i)) + delta);
            }
        }
    } else {
        static_assert(ENC == ENC_IQ1_M, "an added block type");
        const float d = iq1_m_d(k);
        for (int t = 0; t < 32; ++t) {          // t: 8 values
            const int nib = (k[32 + t / 2] >> (4 * (t % 2))) & 0xF;
            const int sc = (load_u16(k + 48 + 2 * (t / 8)) >> (3 * ((t / 2) % 4))) & 7;
            const float dl = d * static_cast<float>(2 * sc + 1);
            const float delta = (nib & 8) ? -0.125f : 0.125f;
            const uint64_t g = g_iq.iq1s[k[t] | ((nib & 7) << 8)];
            for (int i = 0; i < 8; ++i) y[8 * t + i] = dl * (static_cast<float>(grid_at(g, i)) + delta);
        }
    }
}

template <int ENC>
static void deq_row(const uint8_t* row, int cols, float* y) {
    const int bb = enc_block_bytes(ENC), nv = enc_block_values(ENC);
    for (int b = 0; b < cols / nv; ++b) deq_block<ENC>(row + static_cast<size_t>(b) * bb, y + static_cast<size_t>(b) * nv);
}

void dequantize_row_types(int enc, const uint8_t* row, int cols, float* y) {
    switch (enc) {
        case ENC_Q4_1: return deq_row<ENC_Q4_1>(row, cols, y);
        case ENC_Q5_0: return deq_row<ENC_Q5_0>(row, cols, y);
        case ENC_Q5_1: return deq_row<ENC_Q5_1>(row, cols, y);
        case ENC_Q2_K: return deq_row<ENC_Q2_K>(row, cols, y);
        case ENC_Q3_K: return deq_row<ENC_Q3_K>(row, cols, y);
        case ENC_IQ4_NL: return deq_row<ENC_IQ4_NL>(row, cols, y);
        case ENC_IQ4_XS: return deq_row<ENC_IQ4_XS>(row, cols, y);
        case ENC_MXFP4: return deq_row<ENC_MXFP4>(row, cols, y);
        case ENC_IQ3_XXS: return deq_row<ENC_IQ3_XXS>(row, cols, y);
        case ENC_IQ3_S: return deq_row<ENC_IQ3_S>(row, cols, y);
        case ENC_IQ2_XXS: return deq_row<ENC_IQ2_XXS>(row, cols, y);
        case ENC_IQ2_XS: return deq_row<ENC_IQ2_XS>(row, cols, y);
        case ENC_IQ2_S: return deq_row<ENC_IQ2_S>(row, cols, y);
        case ENC_IQ1_S: return deq_row<ENC_IQ1_S>(row, cols, y);
        case ENC_IQ1_M: return deq_row<ENC_IQ1_M>(row, cols, y);
        default: throw std::invalid_argument("dequantize_row_types: not an added block type");
    }
}

// ---- scalar dot products ----

// One 32-value group of a block in integers: value i ~= f * sc[i / 16] * w[i] - fm * mn[i / 16].
struct Group {
    int8_t w[32];
    int sc[2] = {1, 1};
    int mn[2] = {0, 0};
    float f = 0.f, fm = 0.f;
};

static void nibbles(const uint8_t* qs, const int8_t* tv, int8_t* w) {
    for (int i = 0; i < 16; ++i) {
        w[i] = tv ? tv[qs[i] & 0xF] : static_cast<int8_t>(qs[i] & 0xF);
        w[16 + i] = tv ? tv[qs[i] >> 4] : static_cast<int8_t>(qs[i] >> 4);
    }
}

static void grid8(uint64_t g, uint64_t neg, int8_t* w) {
    for (int i = 0; i < 8; ++i) w[i] = static_cast<int8_t>((neg >> (8 * i)) & 1 ? -grid_at(g, i) : grid_at(g, i));
}

static void group_of(int enc, const uint8_t* k, int j, Group& g) {
    switch (enc) {
        case ENC_Q4_1:
            g.f = fp16_to_fp32(load_u16(k));
            g.fm = -fp16_to_fp32(load_u16(k + 2));
            g.mn[0] = g.mn[1] = 1;
            nibbles(k + 4, nullptr, g.w);
            return;
        case ENC_Q5_0:
        case ENC_Q5_1: {
            const bool one = enc == ENC_Q5_1;
            g.f = fp16_to_fp32(load_u16(k));
            if (one) {
                g.fm = -fp16_to_fp32(load_u16(k + 2));
                g.mn[0] = g.mn[1] = 1;
            }
            const uint32_t qh = load_u32(k + (one ? 4 : 2));
            nibbles(k + (one ? 8 : 6), nullptr, g.w);
            for (int i = 0; i < 32; ++i) g.w[i] = static_cast<int8_t>((g.w[i] | ((qh >> i) & 1) << 4) - (one ? 0 : 16));
            return;
        }
        case ENC_Q2_K: {
            g.f = fp16_to_fp32(load_u16(k + 80));
            g.fm = fp16_to_fp32(load_u16(k + 82));
            for (int h = 0; h < 2; ++h) {
                g.sc[h] = k[2 * j + h] & 0xF;
                g.mn[h] = k[2 * j + h] >> 4;
            }
            for (int l = 0; l < 32; ++l) g.w[l] = static_cast<int8_t>((k[16 + 32 * (j / 4) + l] >> (2 * (j % 4))) & 3);
            return;
        }
        case ENC_Q3_K: {
            g.f = fp16_to_fp32(load_u16(k + 108));
            for (int h = 0; h < 2; ++h) g.sc[h] = q3_k_scale(k + 96, 2 * j + h);
            for (int l = 0; l < 32; ++l) {
                int q = (k[32 + 32 * (j / 4) + l] >> (2 * (j % 4))) & 3;
                if (!((k[l] >> j) & 1)) q -= 4;
                g.w[l] = static_cast<int8_t>(q);
            }
            return;
        }
        case ENC_IQ4_NL:
            g.f = fp16_to_fp32(load_u16(k));
            nibbles(k + 2, g_iq.iq4nl, g.w);
            return;
        case ENC_MXFP4:
            g.f = e8m0_half(k[0]);
            nibbles(k + 1, kMxfp4Values, g.w);
            return;
        case ENC_IQ4_XS:
            g.f = fp16_to_fp32(load_u16(k));
            g.sc[0] = g.sc[1] = iq4_xs_scale(k, j);
            nibbles(k + 8 + 16 * j, g_iq.iq4nl, g.w);
            return;
        case ENC_IQ2_XXS: {
            const uint8_t* q = k + 2 + 8 * j;
            const uint32_t aux = load_u32(q + 4);
            g.f = fp16_to_fp32(load_u16(k)) * 0.125f;
            g.sc[0] = g.sc[1] = 2 * static_cast<int>(aux >> 28) + 1;
            for (int l = 0; l < 4; ++l) grid8(g_iq.iq2xxs[q[l]], g_iq.ksign_masks[(aux >> (7 * l)) & 127], g.w + 8 * l);
            return;
        }
        case ENC_IQ2_XS:
        case ENC_IQ2_S: {
            const bool xs = enc == ENC_IQ2_XS;
            g.f = fp16_to_fp32(load_u16(k)) * 0.125f;
            const uint8_t sb = k[(xs ? 66 : 74) + j];
            g.sc[0] = 2 * (sb & 0xF) + 1;
            g.sc[1] = 2 * (sb >> 4) + 1;
            for (int l = 0; l < 4; ++l) {
                const int t = 4 * j + l;
                if (xs) {
                    const uint16_t q = load_u16(k + 2 + 2 * t);
                    grid8(g_iq.iq2xs[q & 511], g_iq.ksign_masks[q >> 9], g.w + 8 * l);
                } else {
                    const int idx = k[2 + t] | (((k[66 + j] >> (2 * l)) & 3) << 8);
                    grid8(g_iq.iq2s[idx], g_bit_masks[k[34 + t]], g.w + 8 * l);
                }
            }
            return;
        }
        case ENC_IQ3_XXS: {
            const uint32_t aux = load_u32(k + 66 + 4 * j);
            g.f = fp16_to_fp32(load_u16(k)) * 0.25f;
            g.sc[0] = g.sc[1] = 2 * static_cast<int>(aux >> 28) + 1;
            for (int l = 0; l < 4; ++l) {
                const uint64_t g8 = g_iq.iq3xxs[k[2 + 8 * j + 2 * l]] | (uint64_t{g_iq.iq3xxs[k[3 + 8 * j + 2 * l]]} << 32);
                grid8(g8, g_iq.ksign_masks[(aux >> (7 * l)) & 127], g.w + 8 * l);
            }
            return;
        }
        case ENC_IQ3_S: {
            g.f = fp16_to_fp32(load_u16(k));
            g.sc[0] = g.sc[1] = 1 + 2 * ((k[106 + j / 2] >> (4 * (j % 2))) & 0xF);
            for (int l = 0; l < 4; ++l) {
                const int t0 = 2 * l, t1 = 2 * l + 1;
                const uint32_t a = g_iq.iq3s[k[2 + 8 * j + t0] | (((k[66 + j] >> t0) & 1) << 8)];
                const uint32_t b = g_iq.iq3s[k[2 + 8 * j + t1] | (((k[66 + j] >> t1) & 1) << 8)];
                grid8(a | (uint64_t{b} << 32), g_bit_masks[k[74 + 4 * j + l]], g.w + 8 * l);
            }
            return;
        }
        case ENC_IQ1_S: {
            // value = dl * (grid + delta) = (dl / 8) * (8 grid +- 1)
            const uint16_t qh = load_u16(k + 34 + 2 * j);
            g.f = fp16_to_fp32(load_u16(k)) * 0.125f;
            g.sc[0] = g.sc[1] = 2 * ((qh >> 12) & 7) + 1;
            const int dsign = (qh & 0x8000) ? -1 : 1;
            for (int l = 0; l < 4; ++l) {
                const uint64_t gr = g_iq.iq1s[k[2 + 4 * j + l] | (((qh >> (3 * l)) & 7) << 8)];
                for (int i = 0; i < 8; ++i) g.w[8 * l + i] = static_cast<int8_t>(8 * grid_at(gr, i) + dsign);
            }
            return;
        }
        case ENC_IQ1_M: {
            g.f = iq1_m_d(k) * 0.125f;
            const uint16_t sw = load_u16(k + 48 + 2 * (j / 2));
            for (int h = 0; h < 2; ++h) g.sc[h] = 2 * ((sw >> (6 * (j % 2) + 3 * h)) & 7) + 1;
            for (int l = 0; l < 4; ++l) {
                const int t = 4 * j + l;
                const int nib = (k[32 + t / 2] >> (4 * (t % 2))) & 0xF;
                const uint64_t gr = g_iq.iq1s[k[t] | ((nib & 7) << 8)];
                const int dsign = (nib & 8) ? -1 : 1;
                for (int i = 0; i < 8; ++i) g.w[8 * l + i] = static_cast<int8_t>(8 * grid_at(gr, i) + dsign);
            }
            return;
        }
        default:
            throw std::invalid_argument("group_of: not an added block type");
    }
}

template <int ENC>
static float dot_groups(const uint8_t* row, const Act& a, int cols) {
    const int bb = enc_block_bytes(ENC), groups = enc_block_values(ENC) / 32;
    float acc = 0.f;
    Group g;
    for (int b = 0; b < cols / (32 * groups); ++b, row += bb) {
        for (int j = 0; j < groups; ++j) {
            group_of(ENC, row, j, g);
            const int ab = groups * b + j;
            const int8_t* x = a.q8.q + QA * ab;
            int isum = 0, msum = 0;
            for (int h = 0; h < 2; ++h) {
                int p = 0, s = 0;
                for (int i = 16 * h; i < 16 * h + 16; ++i) {
                    p += g.w[i] * x[i];
                    s += x[i];
                }
                isum += g.sc[h] * p;
                msum += g.mn[h] * s;
            }
            acc += g.f * a.q8.d[ab] * static_cast<float>(isum) - g.fm * a.q8.d[ab] * static_cast<float>(msum);
        }
    }
    return acc;
}

const DotFn scalar_type_dots[ENC_COUNT] = {
    nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr, nullptr,
    dot_groups<ENC_Q4_1>, dot_groups<ENC_Q5_0>, dot_groups<ENC_Q5_1>, dot_groups<ENC_Q2_K>, dot_groups<ENC_Q3_K>,
    dot_groups<ENC_IQ4_NL>, dot_groups<ENC_IQ4_XS>, dot_groups<ENC_MXFP4>, dot_groups<ENC_IQ3_XXS>,
    dot_groups<ENC_IQ3_S>, dot_groups<ENC_IQ2_XXS>, dot_groups<ENC_IQ2_XS>, dot_groups<ENC_IQ2_S>,
    dot_groups<ENC_IQ1_S>, dot_groups<ENC_IQ1_M>,
};

}  // namespace lqf
