// Decode attention over a KV cache stored as rows of a float or GGUF block encoding (attention.cpp).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace lqf {

// Rows of one cached tensor: row j of kv head h starts at base + h * head_stride + j * row_stride
// (bytes). `dim` values are used; block encodings store ceil(dim / 32) blocks (a row is padded
// with zeros to a whole block).
struct KVRows {
    const uint8_t* base;
    int enc;
    int dim;
    int64_t head_stride;
    int64_t row_stride;
};

// One query row per head over the first num_keys cached rows (all visible):
//   out[h] = sum_j softmax_j(scale * sum_p q_p[h] . keys_p[kv(h), j]) values[kv(h), j]
// q [num_heads, sum_p keys[p].dim] fp32 (the parts' query columns side by side); kv(h) = h / group.
// sinks (or null): per-head logits of one more key whose value is zero. values may be keys[0]
// (same base and layout: MLA's latent), then each row is dequantized once. out [num_heads, values.dim].
// Keys are split into fixed spans (independent of the thread count), merged in order.
void attention_decode(const float* q, int num_heads, int num_kv_heads, const std::vector<KVRows>& keys,
                      const KVRows& values, int num_keys, float scale, const float* sinks, float* out,
                      int num_threads, const std::string& isa);

}  // namespace lqf
