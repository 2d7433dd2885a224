// Python bindings for the CPU kernels: lean_qwenflash._kernels. Python passes raw addresses
// (tensor.data_ptr()) and sizes; lean_qwenflash/models/native.py checks shapes, dtypes and
// contiguity before calling, and keeps the tensors alive. Every call releases the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "affinity.h"
#include "attention.h"
#include "decode_step.h"
#include "deltanet.h"
#include "moe.h"
#include "ops.h"

namespace py = pybind11;
using namespace lqf;

template <typename T>
static T* ptr(uintptr_t a) {
    return reinterpret_cast<T*>(a);
}

// Addresses from Python as typed pointers (one per expert or matrix).
template <typename T>
static std::vector<T*> ptrs(const std::vector<uintptr_t>& a) {
    std::vector<T*> out(a.size());
    for (size_t i = 0; i < a.size(); ++i) out[i] = ptr<T>(a[i]);
    return out;
}

PYBIND11_MODULE(_kernels, m) {
    m.doc() = "lean-qwenflash CPU kernels: quantized dot products, fused MoE decode, dequantization";
    m.def("supported_isas", &supported_isas, "ISAs this CPU can run, slowest first ('scalar' always).");
    m.def("best_isa", &best_isa);
    m.def("set_spin", &set_spin, py::arg("iterations"),
          "How many pause instructions an idle worker spins before sleeping; returns the previous value.");
    m.def("bind_kernel_threads", &bind_kernel_threads, py::arg("cpus"), py::arg("anywhere"),
          "Pin worker i of the kernel pools to cpus[i % len] (the caller is thread 0), pools made later too; "
          "with cpus [], let them run on the CPUs `anywhere` again.");
    m.def("kernel_thread_cpus", &kernel_thread_cpus, "The kernel pools' binding ([] when unbound).");
    m.def("kernel_thread_ids", &kernel_thread_ids, "Thread ids of the kernel pools' workers.");
    m.def(
        "bind_openmp_team",
        [](const std::string& runtime, int num_threads, const std::vector<int>& cpus, const std::vector<int>& anywhere) {
            py::gil_scoped_release nogil;
            return bind_openmp_team(runtime, num_threads, cpus, anywhere);
        },
        py::arg("runtime"), py::arg("num_threads"), py::arg("cpus"), py::arg("anywhere"),
        "Pin member i (>= 1) of the calling thread's num_threads-thread OpenMP team to cpus[i % len] (cpus []: "
        "let it run on `anywhere`), through the already loaded runtime at path `runtime`; returns the members' "
        "thread ids.");
    m.def(
        "encoding_ids", [] {
            std::vector<int> ids;
            for (int e = 0; e < ENC_COUNT; ++e) ids.push_back(e);
            return ids;
        },
        "The encoding ids (csrc/quant.h Enc) this build has kernels and exact dequantization for.");
    m.def("block_bytes", &enc_block_bytes, py::arg("enc"));
    m.def(
        "set_iq_table",
        [](const std::string& name, const py::bytes& data) {
            const std::string b = data;
            set_iq_table(name.c_str(), b.data(), b.size());
        },
        py::arg("name"), py::arg("data"),
        "Hand over one IQ lookup table (a copy is kept): iq2xxs, iq2xs, iq2s, iq3xxs, iq3s, iq1s, ksigns, iq4nl.");
    m.def("require_tables", &require_tables, py::arg("enc"),
          "Raise naming the missing table if encoding `enc` needs IQ tables that are not set.");
    m.def("block_values", &enc_block_values, py::arg("enc"));
    m.def(
        "gemv",
        [](uintptr_t w, int enc, int rows, int cols, uintptr_t x, uintptr_t out, int threads, const std::string& isa) {
            py::gil_scoped_release nogil;
            gemv(ptr<const uint8_t>(w), enc, rows, cols, ptr<const float>(x), ptr<float>(out), threads, isa);
        },
        py::arg("w"), py::arg("enc"), py::arg("rows"), py::arg("cols"), py::arg("x"), py::arg("out"),
        py::arg("threads"), py::arg("isa") = "auto");
    m.def(
        "gemv_multi",
        [](const std::vector<uintptr_t>& w, const std::vector<int>& enc, const std::vector<int>& rows, int cols, uintptr_t x,
           const std::vector<uintptr_t>& out, int threads, const std::string& isa) {
            const auto wp = ptrs<const uint8_t>(w);
            const auto op = ptrs<float>(out);
            py::gil_scoped_release nogil;
            gemv_multi(wp, enc, rows, cols, ptr<const float>(x), op, threads, isa);
        },
        py::arg("w"), py::arg("enc"), py::arg("rows"), py::arg("cols"), py::arg("x"), py::arg("out"), py::arg("threads"),
        py::arg("isa") = "auto", "Several matrices times one x in one call (x quantized once).");
    m.def(
        "gemm",
        [](uintptr_t w, int enc, int rows, int cols, uintptr_t x, int n, uintptr_t out, int threads, const std::string& isa) {
            py::gil_scoped_release nogil;
            gemm(ptr<const uint8_t>(w), enc, rows, cols, ptr<const float>(x), n, ptr<float>(out), threads, isa);
        },
        py::arg("w"), py::arg("enc"), py::arg("rows"), py::arg("cols"), py::arg("x"), py::arg("n"), py::arg("out"),
        py::arg("threads"), py::arg("isa") = "auto",
        "n tokens x [n, cols] through one matrix: out [n, rows] (each value gemv's for that token).");
    m.def(
        "moe_decode",
        [](uintptr_t x, int hidden, int inter, const std::vector<uintptr_t>& gate_up, const std::vector<uintptr_t>& down,
           const std::vector<float>& weights, int gu_enc, int dn_enc, uintptr_t out, int threads, const std::string& isa) {
            const auto gu = ptrs<const uint8_t>(gate_up), dn = ptrs<const uint8_t>(down);
            py::gil_scoped_release nogil;
            moe_decode(ptr<const float>(x), hidden, inter, gu, dn, weights, gu_enc, dn_enc, ptr<float>(out), threads, isa);
        },
        py::arg("x"), py::arg("hidden"), py::arg("inter"), py::arg("gate_up"), py::arg("down"), py::arg("weights"),
        py::arg("gate_up_enc"), py::arg("down_enc"), py::arg("out"), py::arg("threads"), py::arg("isa") = "auto");
    m.def(
        "moe_decode_parts",
        [](uintptr_t x, int hidden, int inter, const std::vector<uintptr_t>& gate_up, const std::vector<uintptr_t>& down,
           int gu_enc, int dn_enc, uintptr_t parts, int threads, const std::string& isa) {
            const auto gu = ptrs<const uint8_t>(gate_up), dn = ptrs<const uint8_t>(down);
            py::gil_scoped_release nogil;
            moe_decode_parts(ptr<const float>(x), hidden, inter, gu, dn, gu_enc, dn_enc, ptr<float>(parts), threads, isa);
        },
        py::arg("x"), py::arg("hidden"), py::arg("inter"), py::arg("gate_up"), py::arg("down"), py::arg("gate_up_enc"),
        py::arg("down_enc"), py::arg("parts"), py::arg("threads"), py::arg("isa") = "auto",
        "moe_decode without the sum: parts [E, hidden] fp32, expert e's unweighted output in row e.");
    m.def(
        "moe_combine",
        [](const std::vector<uintptr_t>& parts, const std::vector<float>& weights, int hidden, uintptr_t out) {
            const auto pp = ptrs<const float>(parts);
            py::gil_scoped_release nogil;
            moe_combine(pp, weights, hidden, ptr<float>(out));
        },
        py::arg("parts"), py::arg("weights"), py::arg("hidden"), py::arg("out"),
        "out [hidden] = sum_e weights[e] * parts[e] in order (each parts[e] a row of hidden fp32 values).");
    m.def(
        "moe_prefill",
        [](uintptr_t x, int hidden, int inter, const std::vector<uintptr_t>& gate_up, const std::vector<uintptr_t>& down,
           uintptr_t counts, uintptr_t tokens, uintptr_t weights, int gu_enc, int dn_enc, uintptr_t out, int threads,
           const std::string& isa) {
            const auto gu = ptrs<const uint8_t>(gate_up), dn = ptrs<const uint8_t>(down);
            py::gil_scoped_release nogil;
            moe_prefill(ptr<const float>(x), hidden, inter, gu, dn, ptr<const int>(counts), ptr<const int>(tokens),
                        ptr<const float>(weights), gu_enc, dn_enc, ptr<float>(out), threads, isa);
        },
        py::arg("x"), py::arg("hidden"), py::arg("inter"), py::arg("gate_up"), py::arg("down"), py::arg("counts"),
        py::arg("tokens"), py::arg("weights"), py::arg("gate_up_enc"), py::arg("down_enc"), py::arg("out"),
        py::arg("threads"), py::arg("isa") = "auto");
    m.def(
        "attention_decode",
        [](uintptr_t q, int heads, int kv_heads, const std::vector<std::tuple<uintptr_t, int, int, int64_t, int64_t>>& keys,
           const std::tuple<uintptr_t, int, int, int64_t, int64_t>& values, int num_keys, float scale, uintptr_t sinks,
           uintptr_t out, int threads, const std::string& isa) {
            auto rows = [](const std::tuple<uintptr_t, int, int, int64_t, int64_t>& t) {
                return KVRows{ptr<const uint8_t>(std::get<0>(t)), std::get<1>(t), std::get<2>(t), std::get<3>(t), std::get<4>(t)};
            };
            std::vector<KVRows> k;
            for (const auto& t : keys) k.push_back(rows(t));
            py::gil_scoped_release nogil;
            attention_decode(ptr<const float>(q), heads, kv_heads, k, rows(values), num_keys, scale,
                             sinks ? ptr<const float>(sinks) : nullptr, ptr<float>(out), threads, isa);
        },
        py::arg("q"), py::arg("heads"), py::arg("kv_heads"), py::arg("keys"), py::arg("values"), py::arg("num_keys"),
        py::arg("scale"), py::arg("sinks"), py::arg("out"), py::arg("threads"), py::arg("isa") = "auto",
        "Decode attention: keys/values are (address, encoding, dim, head stride, row stride) rows (csrc/attention.h).");
    m.def(
        "rms_norm",
        [](uintptr_t x, int rows, int n, uintptr_t w, int weight_mode, float eps, uintptr_t out) {
            py::gil_scoped_release nogil;
            rms_norm(ptr<const float>(x), rows, n, w ? ptr<const float>(w) : nullptr, weight_mode, eps, ptr<float>(out));
        },
        py::arg("x"), py::arg("rows"), py::arg("n"), py::arg("w"), py::arg("weight_mode"), py::arg("eps"), py::arg("out"),
        "RMS norm of fp32 rows (weight_mode 0: none, 1: times w, 2: times 1 + w); csrc/ops.h.");
    m.def(
        "rope",
        [](uintptr_t x, int outer, int tokens, int head_dim, int rotary_dim, uintptr_t cos, uintptr_t sin, uintptr_t out) {
            py::gil_scoped_release nogil;
            rope_rotate_half(ptr<const float>(x), outer, tokens, head_dim, rotary_dim, ptr<const float>(cos),
                             ptr<const float>(sin), ptr<float>(out));
        },
        py::arg("x"), py::arg("outer"), py::arg("tokens"), py::arg("head_dim"), py::arg("rotary_dim"), py::arg("cos"),
        py::arg("sin"), py::arg("out"), "Rotate-half rotary embedding of fp32 [outer, tokens, head_dim]; csrc/ops.h.");
    m.def(
        "route_softmax",
        [](uintptr_t w, int enc, int experts, int hidden, uintptr_t x, uintptr_t bias, int top_k, bool renorm,
           bool by_rank, int threads, const std::string& isa) {
            py::gil_scoped_release nogil;
            return route_softmax(ptr<const uint8_t>(w), enc, experts, hidden, ptr<const float>(x),
                                 bias ? ptr<const float>(bias) : nullptr, top_k, renorm, by_rank, threads, isa);
        },
        py::arg("w"), py::arg("enc"), py::arg("experts"), py::arg("hidden"), py::arg("x"), py::arg("bias"),
        py::arg("top_k"), py::arg("renorm"), py::arg("by_rank"), py::arg("threads"), py::arg("isa") = "auto",
        "One token's softmax routing: (expert ids ascending, weights); csrc/ops.h.");
    m.def(
        "dequantize",
        [](uintptr_t src, int enc, int rows, int cols, uintptr_t dst, int threads) {
            py::gil_scoped_release nogil;
            dequantize(ptr<const uint8_t>(src), enc, rows, cols, ptr<float>(dst), threads);
        },
        py::arg("src"), py::arg("enc"), py::arg("rows"), py::arg("cols"), py::arg("dst"), py::arg("threads"));
    py::class_<AttentionStep>(m, "AttentionStep",
                              "A layer's attention sub-block for one-token steps (csrc/decode_step.h); Python keeps "
                              "the tensors its addresses point at alive.")
        .def(py::init([](int hidden, int heads, int kv_heads, int head_dim, bool gated, uintptr_t in_norm, int in_norm_mode,
                         float in_eps, const std::vector<uintptr_t>& w, const std::vector<int>& enc,
                         const std::vector<int>& rows, const std::vector<uintptr_t>& bias, uintptr_t q_norm,
                         uintptr_t k_norm, int qk_mode, float qk_eps, float scale, uintptr_t sinks) {
                 if (w.size() != 4 || enc.size() != 4 || rows.size() != 4 || bias.size() != 4)
                     throw std::invalid_argument("AttentionStep: w, enc, rows and bias need 4 entries (q, k, v, o)");
                 if (!in_norm) throw std::invalid_argument("AttentionStep: the input norm needs a weight");
                 if (!q_norm != !k_norm) throw std::invalid_argument("AttentionStep: q and k norms come together");
                 AttentionStep s;
                 s.hidden = hidden, s.heads = heads, s.kv_heads = kv_heads, s.head_dim = head_dim, s.gated = gated;
                 s.in_norm = ptr<const float>(in_norm), s.in_norm_mode = in_norm_mode, s.in_eps = in_eps;
                 for (int i = 0; i < 4; ++i) {
                     if (!w[i]) throw std::invalid_argument("AttentionStep: a null weight");
                     s.w[i] = ptr<const uint8_t>(w[i]), s.enc[i] = enc[i], s.rows[i] = rows[i];
                     s.bias[i] = bias[i] ? ptr<const float>(bias[i]) : nullptr;
                 }
                 s.q_norm = q_norm ? ptr<const float>(q_norm) : nullptr;
                 s.k_norm = k_norm ? ptr<const float>(k_norm) : nullptr;
                 s.qk_mode = qk_mode, s.qk_eps = qk_eps, s.scale = scale;
                 s.sinks = sinks ? ptr<const float>(sinks) : nullptr;
                 return s;
             }),
             py::arg("hidden"), py::arg("heads"), py::arg("kv_heads"), py::arg("head_dim"), py::arg("gated"),
             py::arg("in_norm"), py::arg("in_norm_mode"), py::arg("in_eps"), py::arg("w"), py::arg("enc"), py::arg("rows"),
             py::arg("bias"), py::arg("q_norm"), py::arg("k_norm"), py::arg("qk_mode"), py::arg("qk_eps"),
             py::arg("scale"), py::arg("sinks"))
        .def(
            "run",
            [](const AttentionStep& s, uintptr_t x, int rotary_dim, uintptr_t cos, uintptr_t sin, uintptr_t k_cache, uintptr_t v_cache,
               int64_t head_stride, int64_t row_stride, int num_past, uintptr_t out, int threads, const std::string& isa) {
                py::gil_scoped_release nogil;
                attention_step(s, ptr<const float>(x), rotary_dim, cos ? ptr<const float>(cos) : nullptr,
                               sin ? ptr<const float>(sin) : nullptr, ptr<float>(k_cache), ptr<float>(v_cache),
                               head_stride, row_stride, num_past, ptr<float>(out), threads, isa);
            },
            py::arg("x"), py::arg("rotary_dim"), py::arg("cos"), py::arg("sin"), py::arg("k_cache"), py::arg("v_cache"), py::arg("head_stride"),
            py::arg("row_stride"), py::arg("num_past"), py::arg("out"), py::arg("threads"), py::arg("isa") = "auto",
            "out = x + the attention sub-block of x; writes the new key/value rows at num_past (strides in floats).");

    py::class_<DeltaNetStep>(m, "DeltaNetStep",
                             "A layer's Gated-DeltaNet sub-block for one-token steps (csrc/deltanet.h); Python keeps "
                             "the tensors its addresses point at alive.")
        .def(py::init([](int hidden, int k_heads, int v_heads, int k_dim, int v_dim, int conv_kernel, bool split,
                         uintptr_t in_norm, int in_norm_mode, float in_eps, const std::vector<uintptr_t>& w,
                         const std::vector<int>& enc, const std::vector<int>& rows, uintptr_t conv, uintptr_t a_log,
                         uintptr_t dt_bias, uintptr_t out_norm, float out_eps, uintptr_t out_order) {
                 if (w.size() != 5 || enc.size() != 5 || rows.size() != 5)
                     throw std::invalid_argument("DeltaNetStep: w, enc and rows need 5 entries");
                 if (!in_norm || !conv || !a_log || !dt_bias || !out_norm)
                     throw std::invalid_argument("DeltaNetStep: a null norm, conv, A_log or dt_bias");
                 DeltaNetStep s;
                 s.hidden = hidden, s.k_heads = k_heads, s.v_heads = v_heads, s.k_dim = k_dim, s.v_dim = v_dim;
                 s.conv_kernel = conv_kernel, s.split = split;
                 s.in_norm = ptr<const float>(in_norm), s.in_norm_mode = in_norm_mode, s.in_eps = in_eps;
                 for (int i = 0; i < 5; ++i) {
                     const bool used = split || i == 0 || i == 1 || i == 4;
                     if (used && !w[i]) throw std::invalid_argument("DeltaNetStep: a null weight");
                     s.w[i] = used ? ptr<const uint8_t>(w[i]) : nullptr, s.enc[i] = enc[i], s.rows[i] = rows[i];
                 }
                 s.conv = ptr<const float>(conv), s.a_log = ptr<const float>(a_log), s.dt_bias = ptr<const float>(dt_bias);
                 s.out_norm = ptr<const float>(out_norm), s.out_eps = out_eps;
                 s.out_order = out_order ? ptr<const int64_t>(out_order) : nullptr;
                 return s;
             }),
             py::arg("hidden"), py::arg("k_heads"), py::arg("v_heads"), py::arg("k_dim"), py::arg("v_dim"),
             py::arg("conv_kernel"), py::arg("split"), py::arg("in_norm"), py::arg("in_norm_mode"), py::arg("in_eps"),
             py::arg("w"), py::arg("enc"), py::arg("rows"), py::arg("conv"), py::arg("a_log"), py::arg("dt_bias"),
             py::arg("out_norm"), py::arg("out_eps"), py::arg("out_order") = 0)
        .def(
            "run",
            [](const DeltaNetStep& s, uintptr_t x, uintptr_t conv_state, uintptr_t recurrent, uintptr_t out, int threads,
               const std::string& isa) {
                py::gil_scoped_release nogil;
                deltanet_step(s, ptr<const float>(x), ptr<float>(conv_state), ptr<float>(recurrent), ptr<float>(out),
                              threads, isa);
            },
            py::arg("x"), py::arg("conv_state"), py::arg("recurrent"), py::arg("out"), py::arg("threads"),
            py::arg("isa") = "auto",
            "out = x + the DeltaNet sub-block of x; conv_state [C, K-1] and recurrent [Hv, Dk, Dv] updated in place.");
}
