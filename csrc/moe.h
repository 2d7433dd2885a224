// The kernel entry points bound as lean_qwenflash._kernels (see moe.cpp).
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "quant.h"

namespace lqf {

std::vector<std::string> supported_isas();   // "scalar" always; "avx2", "avx512" if the CPU has them
std::string best_isa();
int set_spin(int iterations);
// fn(0) .. fn(num_tasks - 1) on the kernel pool of num_threads threads (the caller works too).
void parallel_run(int num_threads, int num_tasks, const std::function<void(int)>& fn);   // idle workers' spin before sleeping; returns the previous value
const KernelTable& kernels_for(const std::string& isa);   // "auto" = best_isa()

// out[rows] = W[rows, cols] . x[cols]  (x fp32; quantized to ActQ8 first for block encodings)
void gemv(const uint8_t* w, int enc, int rows, int cols, const float* x, float* out, int num_threads, const std::string& isa);

// The same for several matrices of `cols` columns and one x (a layer's q, k and v): x quantized
// once, every matrix's rows in one parallel run. out[m][rows[m]].
void gemv_multi(const std::vector<const uint8_t*>& w, const std::vector<int>& enc, const std::vector<int>& rows, int cols,
                const float* x, const std::vector<float*>& out, int num_threads, const std::string& isa);

// out[n, rows] = x[n, cols] . W[rows, cols]^T: n tokens through one matrix, each row decoded once per
// four tokens (the encoding's multi-column kernel); every value equals gemv's for that token, bit for bit.
void gemm(const uint8_t* w, int enc, int rows, int cols, const float* x, int n, float* out, int num_threads,
          const std::string& isa);

// out[H] = sum_e weights[e] * down_e(silu(gate_e(x)) * up_e(x)); gate_up_e [2I, H], down_e [H, I]
void moe_decode(const float* x, int hidden, int inter, const std::vector<const uint8_t*>& gate_up,
                const std::vector<const uint8_t*>& down, const std::vector<float>& weights, int gate_up_enc, int down_enc,
                float* out, int num_threads, const std::string& isa);

// moe_decode in pieces: parts[e, H] = down_e(silu(gate_e(x)) * up_e(x)) (unweighted), and
// out[H] = sum_e weights[e] * parts[e] in the given order: for the same experts in the same order,
// moe_decode's bits (a streamed decode step computes the experts already cached while the rest load).
void moe_decode_parts(const float* x, int hidden, int inter, const std::vector<const uint8_t*>& gate_up,
                      const std::vector<const uint8_t*>& down, int gate_up_enc, int down_enc, float* parts,
                      int num_threads, const std::string& isa);
void moe_combine(const std::vector<const float*>& parts, const std::vector<float>& weights, int hidden, float* out);

// dst[rows, cols] fp32 = the rows of src decoded exactly
// Many tokens through the experts of one layer: expert e (gate_up[e], down[e]) takes the next
// counts[e] (token, weight) pairs of tokens/weights; out[token, H] += weight * down(silu(gate) * up)
// for every pair, added expert by expert in this order. x [tokens, H] fp32 (quantized per token
// for block encodings), out accumulated in place.
void moe_prefill(const float* x, int hidden, int inter, const std::vector<const uint8_t*>& gate_up,
                 const std::vector<const uint8_t*>& down, const int* counts, const int* tokens, const float* weights,
                 int gate_up_enc, int down_enc, float* out, int num_threads, const std::string& isa);
void dequantize(const uint8_t* src, int enc, int rows, int cols, float* dst, int num_threads);

}  // namespace lqf
