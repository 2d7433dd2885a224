// Quantized-weight CPU kernels: shared declarations.
//
// Weights are rows of GGUF blocks (layouts in lean_qwenflash/quant/*.py); activations for the
// block formats are quantized once per product into ActQ8 (32-value blocks, float scale). Each ISA
// (scalar, AVX2, AVX-512) provides one dot-product per encoding; moe.cpp picks the table at run
// time and owns the threads. No torch, no Python here.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace lqf {

// Must match Encoding.native_id in lean_qwenflash/quant/.
enum Enc : int {
    ENC_F32 = 0, ENC_F16 = 1, ENC_BF16 = 2, ENC_Q8_0 = 3, ENC_Q4_0 = 4, ENC_Q4_K = 5, ENC_Q5_K = 6, ENC_Q6_K = 7,
    // the GGUF block types added for imports (layouts and kernels: quant_types.cpp, quant_simd_types.h)
    ENC_Q4_1 = 8, ENC_Q5_0 = 9, ENC_Q5_1 = 10, ENC_Q2_K = 11, ENC_Q3_K = 12, ENC_IQ4_NL = 13, ENC_IQ4_XS = 14,
    ENC_MXFP4 = 15, ENC_IQ3_XXS = 16, ENC_IQ3_S = 17, ENC_IQ2_XXS = 18, ENC_IQ2_XS = 19, ENC_IQ2_S = 20,
    ENC_IQ1_S = 21, ENC_IQ1_M = 22, ENC_COUNT = 23
};

constexpr int QK = 256;      // K-quant super-block
constexpr int QA = 32;       // activation block

// Bytes of one block and values per block, by encoding.
int enc_block_bytes(int enc);
int enc_block_values(int enc);
inline bool enc_is_float(int enc) { return enc <= ENC_BF16; }
inline size_t enc_row_bytes(int enc, int cols) {
    return static_cast<size_t>(cols / enc_block_values(enc)) * enc_block_bytes(enc);
}

// One activation vector quantized to int8 in blocks of 32: value ~= d[b] * q[32 b + i];
// s[b] = d[b] * sum_i q[32 b + i] (the K-quant mins term needs it).
struct ActQ8 {
    const float* d;
    const int8_t* q;
    const float* s;
};

// Activation input of a dot product: floats for float encodings, ActQ8 otherwise.
struct Act {
    const float* x;
    ActQ8 q8;
};

using DotFn = float (*)(const uint8_t* row, const Act& a, int cols);

// A tile of the many-token products (prefill): `rows` rows of `row_bytes` each from w, times n
// activation vectors: out[j * ld + r] = dot(w + r * row_bytes, *acts[j], cols), bit for bit (each
// column keeps the single-column kernel's summation order). Columns run in groups of four over all
// the rows, so a group's activations stay in L1 while each row's blocks are decoded once for it.
using DotNFn = void (*)(const uint8_t* w, size_t row_bytes, int rows, const Act* const* acts, int n, int cols, float* out,
                        size_t ld);

struct KernelTable {
    const char* name;
    DotFn dot[ENC_COUNT];
    DotNFn dotn[ENC_COUNT];   // nullptr: no multi-column kernel, dot_many loops over dot
};

// The tile above through k.dotn[enc] where there is one, else k.dot for every (row, column).
inline void dot_many(const KernelTable& k, int enc, const uint8_t* w, size_t row_bytes, int rows, const Act* const* acts,
                     int n, int cols, float* out, size_t ld) {
    if (k.dotn[enc]) {
        k.dotn[enc](w, row_bytes, rows, acts, n, cols, out, ld);
        return;
    }
    const DotFn dot = k.dot[enc];
    for (int j = 0; j < n; ++j)
        for (int r = 0; r < rows; ++r) out[j * ld + r] = dot(w + r * row_bytes, *acts[j], cols);
}

const KernelTable& scalar_kernels();
const KernelTable& avx2_kernels();      // only call when the CPU has AVX2 + FMA + F16C
const KernelTable& avx512_kernels();    // only call when the CPU has AVX-512 F + BW + VL + VNNI

// x[n] (n % 32 == 0) -> d[n/32], q[n], s[n/32].
void quantize_act(const float* x, int n, float* d, int8_t* q, float* s);

// One row of `cols` values of encoding `enc` -> fp32 (exactly gguf.quants' arithmetic).
void dequantize_row(int enc, const uint8_t* row, int cols, float* out);

float fp16_to_fp32(uint16_t h);

// ---- the added block types (quant_types.cpp) ----

// Exact fp32 rows of the encodings ENC_Q4_1 .. ENC_IQ1_M (dequantize_row's part for them).
void dequantize_row_types(int enc, const uint8_t* row, int cols, float* out);

// Scalar dot products of the added types, indexed by encoding id (nullptr below ENC_Q4_1).
extern const DotFn scalar_type_dots[ENC_COUNT];

// MXFP4's 16 element values (e2m1, doubled so they are integers).
const int8_t* mxfp4_values();

// Lookup tables of the IQ formats. The grids and the 7-bit sign table are ggml's, but not in our
// source: lean_qwenflash.models.native reads them from the `gguf` package at import and hands
// them over once through set_iq_table (a copy is kept). The rest is derived from them here.
struct IqTables {
    const uint64_t* iq2xxs = nullptr;     // 256 grids of 8 int8 values
    const uint64_t* iq2xs = nullptr;      // 512
    const uint64_t* iq2s = nullptr;       // 1024
    const uint32_t* iq3xxs = nullptr;     // 256 grids of 4 int8 values
    const uint32_t* iq3s = nullptr;       // 512
    const uint64_t* iq1s = nullptr;       // 2048 grids of 8 int8 values in {-1, 0, 1}
    const uint64_t* iq1s_x8 = nullptr;    // the same grids times 8 (derived)
    const uint8_t* ksigns = nullptr;      // 128 sign bytes (7 sign bits + parity)
    const uint64_t* ksign_masks = nullptr;// 128: byte k = 0xFF where ksigns' bit k is set (derived)
    const int8_t* iq4nl = nullptr;        // 16 values of the IQ4_NL / IQ4_XS non-linear grid
};
extern IqTables g_iq;
// 256 masks: byte k = 0xFF where bit k of the index is set (plain sign bytes; no table needed)
extern const uint64_t g_bit_masks[256];

// Store one table by name: iq2xxs, iq2xs, iq2s (int8 [N, 8]), iq3xxs, iq3s (int8 [N, 4]), iq1s
// (int8 [2048, 8]), ksigns (uint8 [128]), iq4nl (int8 [16]). Throws on an unknown name or size.
void set_iq_table(const char* name, const void* data, size_t nbytes);
// Throws std::runtime_error naming what is missing if `enc` needs tables that are not set.
void require_tables(int enc);

// Software prefetch of the bytes a loop iteration will read PREFETCH_BYTES from now: decode reads
// weights once, from DRAM, and the dot products' dependency chains keep the out-of-order window
// from running far enough ahead on its own (q4_k from DRAM, one thread: 5.2 -> 10.7 GB/s).
constexpr int PREFETCH_BYTES = 2048;
inline void prefetch_ahead(const uint8_t* p, int bytes) {
    for (int l = 0; l < bytes; l += 64) __builtin_prefetch(p + PREFETCH_BYTES + l, 0, 3);
}

// Block-field readers shared by the kernels (little-endian, unaligned).
inline uint16_t load_u16(const uint8_t* p) { return static_cast<uint16_t>(p[0] | (p[1] << 8)); }

inline uint32_t load_u32(const uint8_t* p) {
    uint32_t v;
    std::memcpy(&v, p, 4);
    return v;
}

// MXFP4's shared scale: the e8m0 byte e as 2^(e - 128), half of 2^(e - 127) since the element
// values are stored doubled; e < 2 gives the float32 subnormals.
inline float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? (0x00200000u << e) : (static_cast<uint32_t>(e - 1) << 23);
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

inline float bf16_to_fp32(uint16_t h) {
    const uint32_t bits = static_cast<uint32_t>(h) << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

// q4_k / q5_k: the 6-bit scale and min of sub-block j from the 12 packed bytes.
inline void scale_min_k4(int j, const uint8_t* s, uint8_t* sc, uint8_t* m) {
    if (j < 4) {
        *sc = s[j] & 63;
        *m = s[j + 4] & 63;
    } else {
        *sc = static_cast<uint8_t>((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4));
        *m = static_cast<uint8_t>((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
}

// All eight q4_k/q5_k scales and mins at once, as 8 bytes each (byte j = sub-block j), with
// 32-bit word operations instead of eight scale_min_k4 calls: scales 0-3 and mins 0-3 are the low
// 6 bits of bytes 0-3 and 4-7; scales/mins 4-7 take their low 4 bits from the nibbles of bytes
// 8-11 and their top 2 bits from the top 2 bits of bytes 0-3 / 4-7.
inline void scale_min_k4_all(const uint8_t* s, uint64_t* sc, uint64_t* m) {
    uint32_t w0, w1, w2;
    std::memcpy(&w0, s, 4);
    std::memcpy(&w1, s + 4, 4);
    std::memcpy(&w2, s + 8, 4);
    const uint32_t low6 = 0x3F3F3F3Fu, low4 = 0x0F0F0F0Fu, bits45 = 0x30303030u;
    const uint32_t sc_hi = (w2 & low4) | ((w0 >> 2) & bits45);
    const uint32_t m_hi = ((w2 >> 4) & low4) | ((w1 >> 2) & bits45);
    *sc = (w0 & low6) | (static_cast<uint64_t>(sc_hi) << 32);
    *m = (w1 & low6) | (static_cast<uint64_t>(m_hi) << 32);
}

}  // namespace lqf
