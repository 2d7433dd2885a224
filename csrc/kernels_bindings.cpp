// Python bindings for the CPU kernels: lean_qwenflash._kernels. Python passes raw addresses
// (tensor.data_ptr()) and sizes; lean_qwenflash/models/native.py checks shapes, dtypes and
// contiguity before calling, and keeps the tensors alive. Every call releases the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "moe.h"

namespace py = pybind11;
using namespace lqf;

template <typename T>
static T* ptr(uintptr_t a) {
    return reinterpret_cast<T*>(a);
}

PYBIND11_MODULE(_kernels, m) {
    m.doc() = "lean-qwenflash CPU kernels: quantized dot products, fused MoE decode, dequantization";
    m.def("supported_isas", &supported_isas, "ISAs this CPU can run, slowest first ('scalar' always).");
    m.def("best_isa", &best_isa);
    m.def("set_spin", &set_spin, py::arg("iterations"),
          "How many pause instructions an idle worker spins before sleeping; returns the previous value.");
    m.def("block_bytes", &enc_block_bytes, py::arg("enc"));
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
        "moe_decode",
        [](uintptr_t x, int hidden, int inter, const std::vector<uintptr_t>& gate_up, const std::vector<uintptr_t>& down,
           const std::vector<float>& weights, int gu_enc, int dn_enc, uintptr_t out, int threads, const std::string& isa) {
            std::vector<const uint8_t*> gu(gate_up.size()), dn(down.size());
            for (size_t i = 0; i < gu.size(); ++i) gu[i] = ptr<const uint8_t>(gate_up[i]);
            for (size_t i = 0; i < dn.size(); ++i) dn[i] = ptr<const uint8_t>(down[i]);
            py::gil_scoped_release nogil;
            moe_decode(ptr<const float>(x), hidden, inter, gu, dn, weights, gu_enc, dn_enc, ptr<float>(out), threads, isa);
        },
        py::arg("x"), py::arg("hidden"), py::arg("inter"), py::arg("gate_up"), py::arg("down"), py::arg("weights"),
        py::arg("gate_up_enc"), py::arg("down_enc"), py::arg("out"), py::arg("threads"), py::arg("isa") = "auto");
    m.def(
        "moe_prefill",
        [](uintptr_t x, int hidden, int inter, const std::vector<uintptr_t>& gate_up, const std::vector<uintptr_t>& down,
           uintptr_t counts, uintptr_t tokens, uintptr_t weights, int gu_enc, int dn_enc, uintptr_t out, int threads,
           const std::string& isa) {
            std::vector<const uint8_t*> gu(gate_up.size()), dn(down.size());
            for (size_t i = 0; i < gu.size(); ++i) gu[i] = ptr<const uint8_t>(gate_up[i]);
            for (size_t i = 0; i < dn.size(); ++i) dn[i] = ptr<const uint8_t>(down[i]);
            py::gil_scoped_release nogil;
            moe_prefill(ptr<const float>(x), hidden, inter, gu, dn, ptr<const int>(counts), ptr<const int>(tokens),
                        ptr<const float>(weights), gu_enc, dn_enc, ptr<float>(out), threads, isa);
        },
        py::arg("x"), py::arg("hidden"), py::arg("inter"), py::arg("gate_up"), py::arg("down"), py::arg("counts"),
        py::arg("tokens"), py::arg("weights"), py::arg("gate_up_enc"), py::arg("down_enc"), py::arg("out"),
        py::arg("threads"), py::arg("isa") = "auto");
    m.def(
        "dequantize",
        [](uintptr_t src, int enc, int rows, int cols, uintptr_t dst, int threads) {
            py::gil_scoped_release nogil;
            dequantize(ptr<const uint8_t>(src), enc, rows, cols, ptr<float>(dst), threads);
        },
        py::arg("src"), py::arg("enc"), py::arg("rows"), py::arg("cols"), py::arg("dst"), py::arg("threads"));
}
