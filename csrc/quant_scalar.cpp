// Portable kernels: block sizes, fp16, activation quantization, exact dequantization, and the
// scalar dot products (the fallback on CPUs without AVX2, and the reference the SIMD paths are
// tested against). Built with -ffp-contract=off so dequantization rounds exactly like numpy.
#include <cmath>
#include <cstring>

#include "quant.h"

namespace lqf {

int enc_block_bytes(int enc) {
    static const int bytes[ENC_COUNT] = {4, 2, 2, 34, 18, 144, 176, 210, 20, 22, 24, 84, 110, 18, 136, 17, 98, 110, 66, 74, 82, 50, 56};
    return bytes[enc];
}

int enc_block_values(int enc) {
    static const int values[ENC_COUNT] = {1, 1, 1, 32, 32, 256, 256, 256, 32, 32, 32, 256, 256, 32, 256, 32, 256, 256, 256, 256, 256, 256, 256};
    return values[enc];
}

float fp16_to_fp32(uint16_t h) {
    uint32_t sign = static_cast<uint32_t>(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1F, mant = h & 0x3FF, bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else {  // subnormal: normalise
            int e = 0;
            while (!(mant & 0x400)) {
                mant <<= 1;
                ++e;
            }
            bits = sign | (static_cast<uint32_t>(113 - e) << 23) | ((mant & 0x3FF) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7F800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 112) << 23) | (mant << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

void quantize_act(const float* x, int n, float* d, int8_t* q, float* s) {
    for (int b = 0; b < n / QA; ++b) {
        const float* xb = x + b * QA;
        float amax = 0.f;
        for (int i = 0; i < QA; ++i) amax = std::fmax(amax, std::fabs(xb[i]));
        const float db = amax / 127.f;
        const float inv = db > 0.f ? 1.f / db : 0.f;
        int sum = 0;
        for (int i = 0; i < QA; ++i) {
            int v = static_cast<int>(std::nearbyint(xb[i] * inv));
            v = v > 127 ? 127 : (v < -127 ? -127 : v);
            q[b * QA + i] = static_cast<int8_t>(v);
            sum += v;
        }
        d[b] = db;
        s[b] = db * static_cast<float>(sum);
    }
}

// ---- unpacking one block into plain integer values (shared by dequantize and scalar dots) ----

// q4_k / q5_k: 256 unsigned q values; sub-block j's scale/min into sc[j], m[j].
static void unpack_k_affine(int enc, const uint8_t* blk, uint8_t* q, uint8_t* sc, uint8_t* m) {
    const uint8_t* scales = blk + 4;
    for (int j = 0; j < 8; ++j) scale_min_k4(j, scales, sc + j, m + j);
    const uint8_t* qs = blk + (enc == ENC_Q4_K ? 16 : 48);
    for (int c = 0; c < 4; ++c)
        for (int l = 0; l < 32; ++l) {
            q[64 * c + l] = qs[32 * c + l] & 0xF;
            q[64 * c + 32 + l] = qs[32 * c + l] >> 4;
        }
    if (enc == ENC_Q5_K) {
        const uint8_t* qh = blk + 16;
        for (int j = 0; j < 8; ++j)
            for (int l = 0; l < 32; ++l) q[32 * j + l] |= static_cast<uint8_t>(((qh[l] >> j) & 1) << 4);
    }
}

// q6_k: 256 signed values q - 32.
static void unpack_q6_k(const uint8_t* blk, int8_t* q) {
    const uint8_t* ql = blk;
    const uint8_t* qh = blk + 128;
    for (int n = 0; n < 2; ++n)
        for (int l = 0; l < 32; ++l) {
            const uint8_t* L = ql + 64 * n;
            const uint8_t h = qh[32 * n + l];
            int8_t* y = q + 128 * n;
            y[l] = static_cast<int8_t>(((L[l] & 0xF) | ((h & 3) << 4)) - 32);
            y[l + 32] = static_cast<int8_t>(((L[l + 32] & 0xF) | (((h >> 2) & 3) << 4)) - 32);
            y[l + 64] = static_cast<int8_t>(((L[l] >> 4) | (((h >> 4) & 3) << 4)) - 32);
            y[l + 96] = static_cast<int8_t>(((L[l + 32] >> 4) | (((h >> 6) & 3) << 4)) - 32);
        }
}

void dequantize_row(int enc, const uint8_t* row, int cols, float* out) {
    switch (enc) {
        case ENC_F32:
            std::memcpy(out, row, static_cast<size_t>(cols) * 4);
            return;
        case ENC_F16:
            for (int i = 0; i < cols; ++i) out[i] = fp16_to_fp32(load_u16(row + 2 * i));
            return;
        case ENC_BF16:
            for (int i = 0; i < cols; ++i) out[i] = bf16_to_fp32(load_u16(row + 2 * i));
            return;
        case ENC_Q8_0:
            for (int b = 0; b < cols / 32; ++b, row += 34) {
                const float d = fp16_to_fp32(load_u16(row));
                const int8_t* q = reinterpret_cast<const int8_t*>(row + 2);
                for (int i = 0; i < 32; ++i) out[32 * b + i] = d * static_cast<float>(q[i]);
            }
            return;
        case ENC_Q4_0:
            for (int b = 0; b < cols / 32; ++b, row += 18) {
                const float d = fp16_to_fp32(load_u16(row));
                for (int i = 0; i < 16; ++i) {
                    out[32 * b + i] = d * static_cast<float>((row[2 + i] & 0xF) - 8);
                    out[32 * b + 16 + i] = d * static_cast<float>((row[2 + i] >> 4) - 8);
                }
            }
            return;
        case ENC_Q4_K:
        case ENC_Q5_K: {
            const int bb = enc_block_bytes(enc);
            uint8_t q[QK], sc[8], m[8];
            for (int b = 0; b < cols / QK; ++b, row += bb) {
                const float d = fp16_to_fp32(load_u16(row)), dmin = fp16_to_fp32(load_u16(row + 2));
                unpack_k_affine(enc, row, q, sc, m);
                for (int j = 0; j < 8; ++j) {
                    const float dj = d * static_cast<float>(sc[j]), mj = dmin * static_cast<float>(m[j]);
                    for (int l = 0; l < 32; ++l) out[QK * b + 32 * j + l] = dj * static_cast<float>(q[32 * j + l]) - mj;
                }
            }
            return;
        }
        case ENC_Q6_K: {
            int8_t q[QK];
            for (int b = 0; b < cols / QK; ++b, row += 210) {
                const float d = fp16_to_fp32(load_u16(row + 208));
                const int8_t* sc = reinterpret_cast<const int8_t*>(row + 192);
                unpack_q6_k(row, q);
                for (int j = 0; j < 16; ++j) {
                    const float dj = d * static_cast<float>(sc[j]);
                    for (int l = 0; l < 16; ++l) out[QK * b + 16 * j + l] = dj * static_cast<float>(q[16 * j + l]);
                }
            }
            return;
        }
        default:
            dequantize_row_types(enc, row, cols, out);
            return;
    }
}

// ---- scalar dot products ----

static float dot_f32(const uint8_t* row, const Act& a, int cols) {
    const float* w = reinterpret_cast<const float*>(row);
    float acc = 0.f;
    for (int i = 0; i < cols; ++i) acc += w[i] * a.x[i];
    return acc;
}

static float dot_f16(const uint8_t* row, const Act& a, int cols) {
    float acc = 0.f;
    for (int i = 0; i < cols; ++i) acc += fp16_to_fp32(load_u16(row + 2 * i)) * a.x[i];
    return acc;
}

static float dot_bf16(const uint8_t* row, const Act& a, int cols) {
    float acc = 0.f;
    for (int i = 0; i < cols; ++i) acc += bf16_to_fp32(load_u16(row + 2 * i)) * a.x[i];
    return acc;
}

static float dot_q8_0(const uint8_t* row, const Act& a, int cols) {
    float acc = 0.f;
    for (int b = 0; b < cols / 32; ++b, row += 34) {
        const int8_t* w = reinterpret_cast<const int8_t*>(row + 2);
        const int8_t* x = a.q8.q + 32 * b;
        int isum = 0;
        for (int i = 0; i < 32; ++i) isum += w[i] * x[i];
        acc += fp16_to_fp32(load_u16(row)) * a.q8.d[b] * static_cast<float>(isum);
    }
    return acc;
}

static float dot_q4_0(const uint8_t* row, const Act& a, int cols) {
    float acc = 0.f;
    for (int b = 0; b < cols / 32; ++b, row += 18) {
        const int8_t* x = a.q8.q + 32 * b;
        int isum = 0;
        for (int i = 0; i < 16; ++i) isum += ((row[2 + i] & 0xF) - 8) * x[i] + ((row[2 + i] >> 4) - 8) * x[i + 16];
        acc += fp16_to_fp32(load_u16(row)) * a.q8.d[b] * static_cast<float>(isum);
    }
    return acc;
}

static float dot_k_affine(int enc, const uint8_t* row, const Act& a, int cols) {
    const int bb = enc_block_bytes(enc);
    uint8_t q[QK], sc[8], m[8];
    float acc = 0.f;
    for (int b = 0; b < cols / QK; ++b, row += bb) {
        const float d = fp16_to_fp32(load_u16(row)), dmin = fp16_to_fp32(load_u16(row + 2));
        unpack_k_affine(enc, row, q, sc, m);
        for (int j = 0; j < 8; ++j) {
            const int ab = 8 * b + j;
            const int8_t* x = a.q8.q + QA * ab;
            int isum = 0;
            for (int l = 0; l < 32; ++l) isum += q[32 * j + l] * x[l];
            acc += d * static_cast<float>(sc[j]) * a.q8.d[ab] * static_cast<float>(isum) - dmin * static_cast<float>(m[j]) * a.q8.s[ab];
        }
    }
    return acc;
}

static float dot_q4_k(const uint8_t* row, const Act& a, int cols) { return dot_k_affine(ENC_Q4_K, row, a, cols); }
static float dot_q5_k(const uint8_t* row, const Act& a, int cols) { return dot_k_affine(ENC_Q5_K, row, a, cols); }

static float dot_q6_k(const uint8_t* row, const Act& a, int cols) {
    int8_t q[QK];
    float acc = 0.f;
    for (int b = 0; b < cols / QK; ++b, row += 210) {
        const float d = fp16_to_fp32(load_u16(row + 208));
        const int8_t* sc = reinterpret_cast<const int8_t*>(row + 192);
        unpack_q6_k(row, q);
        for (int k = 0; k < 8; ++k) {
            const int ab = 8 * b + k;
            const int8_t* x = a.q8.q + QA * ab;
            int lo = 0, hi = 0;
            for (int l = 0; l < 16; ++l) {
                lo += q[32 * k + l] * x[l];
                hi += q[32 * k + 16 + l] * x[16 + l];
            }
            acc += d * a.q8.d[ab] * static_cast<float>(sc[2 * k] * lo + sc[2 * k + 1] * hi);
        }
    }
    return acc;
}

const KernelTable& scalar_kernels() {
    static const KernelTable t = [] {
        KernelTable k = {"scalar", {dot_f32, dot_f16, dot_bf16, dot_q8_0, dot_q4_0, dot_q4_k, dot_q5_k, dot_q6_k}, {}};
        for (int e = ENC_Q4_1; e < ENC_COUNT; ++e) k.dot[e] = scalar_type_dots[e];
        return k;
    }();
    return t;
}

}  // namespace lqf
