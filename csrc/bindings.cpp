// Python bindings for the I/O engine: lean_qwenflash._io.
//
// Destinations are Python buffer objects (our AlignedBuffer, numpy arrays, bytearrays): the
// binding checks the byte range against the buffer's size, keeps the object alive while its read
// is in flight, and hands the engine a raw address. Blocking calls release the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <unordered_map>

#include "io_engine.h"
#include "slot_table.h"

namespace py = pybind11;

namespace lqf {
namespace {

PyObject* g_io_error = nullptr;

[[noreturn]] void raise_io_error(const IoError& e) {
    // OSError(errno, message) fills .errno and .strerror; .tag names the request.
    py::object cls = py::reinterpret_borrow<py::object>(g_io_error);
    py::object exc = cls(e.err, e.what());
    exc.attr("tag") = e.tag;
    PyErr_SetObject(g_io_error, exc.ptr());
    throw py::error_already_set();
}

struct BufferRange {
    char* ptr;
    uint64_t size;
};

BufferRange writable_range(const py::buffer& buf) {
    py::buffer_info info = buf.request(/*writable=*/true);
    return {static_cast<char*>(info.ptr), static_cast<uint64_t>(info.size * info.itemsize)};
}

class PyEngine {
   public:
    PyEngine(const std::string& path, const std::string& kind, unsigned queue_depth, unsigned num_threads, bool direct) {
        EngineOptions o;
        o.kind = kind;
        o.queue_depth = queue_depth;
        o.num_threads = num_threads;
        o.direct = direct;
        try {
            py::gil_scoped_release nogil;
            engine_.reset(new Engine(path, o));
        } catch (const IoError& e) {
            raise_io_error(e);
        }
    }

    ~PyEngine() { close(); }

    void close() {
        if (!engine_) return;
        {
            py::gil_scoped_release nogil;
            engine_.reset();  // drains in-flight reads before the buffers below may be released
        }
        keep_alive_.clear();
    }

    Engine& eng() {
        if (!engine_) throw std::runtime_error("I/O engine is closed");
        return *engine_;
    }

    uint64_t submit(py::buffer dest, uint64_t dest_offset, uint64_t file_offset, uint64_t length, int64_t tag, bool urgent) {
        BufferRange r = writable_range(dest);
        if (dest_offset > r.size || length > r.size - dest_offset)
            raise_io_error(IoError(EINVAL, tag,
                                   "destination range [" + std::to_string(dest_offset) + ", " +
                                       std::to_string(dest_offset + length) + ") is outside the " +
                                       std::to_string(r.size) + "-byte buffer (tag " + std::to_string(tag) + ")"));
        uint64_t id;
        try {
            id = eng().submit(file_offset, length, r.ptr + dest_offset, tag, urgent);
        } catch (const IoError& e) {
            raise_io_error(e);
        }
        keep_alive_[id] = dest;
        return id;
    }

    double wait(uint64_t id) {
        Engine& e = eng();
        double service_s = 0;
        try {
            py::gil_scoped_release nogil;
            service_s = e.wait(id);
        } catch (const IoError& err) {
            keep_alive_.erase(id);
            raise_io_error(err);
        }
        keep_alive_.erase(id);
        return service_s;
    }

    // Waits for every id even after a failure, so no read is still landing in a buffer the
    // caller is about to reuse; then raises the first failure.
    void wait_all(const std::vector<uint64_t>& ids) {
        Engine& e = eng();
        bool failed = false;
        IoError first(0, 0, "");
        {
            py::gil_scoped_release nogil;
            for (uint64_t id : ids) {
                try {
                    e.wait(id);
                } catch (const IoError& err) {
                    if (!failed) first = err;
                    failed = true;
                }
            }
        }
        for (uint64_t id : ids) keep_alive_.erase(id);
        if (failed) raise_io_error(first);
    }

    // One batch: list of (dest, dest_offset, file_offset, length, tag). All validated first.
    void read(const std::vector<std::tuple<py::buffer, uint64_t, uint64_t, uint64_t, int64_t>>& batch, bool urgent) {
        for (const auto& t : batch) {
            BufferRange r = writable_range(std::get<0>(t));
            uint64_t dest_offset = std::get<1>(t), file_offset = std::get<2>(t), length = std::get<3>(t);
            int64_t tag = std::get<4>(t);
            if (dest_offset > r.size || length > r.size - dest_offset)
                raise_io_error(IoError(EINVAL, tag, "destination range outside the buffer (tag " + std::to_string(tag) + ")"));
            if (file_offset % kAlignment || length % kAlignment || length == 0 ||
                reinterpret_cast<uintptr_t>(r.ptr + dest_offset) % kAlignment)
                raise_io_error(IoError(EINVAL, tag, "misaligned or empty read in batch (tag " + std::to_string(tag) +
                                                        "): offsets, length and address must be multiples of 4096"));
        }
        std::vector<uint64_t> ids;
        ids.reserve(batch.size());
        for (const auto& t : batch) {
            try {
                ids.push_back(submit(std::get<0>(t), std::get<1>(t), std::get<2>(t), std::get<3>(t), std::get<4>(t), urgent));
            } catch (...) {
                wait_all(ids);
                throw;
            }
        }
        wait_all(ids);
    }

   private:
    std::unique_ptr<Engine> engine_;
    std::unordered_map<uint64_t, py::object> keep_alive_;
};

}  // namespace
}  // namespace lqf

PYBIND11_MODULE(_io, m) {
    using namespace lqf;
    m.doc() = "lean-qwenflash native I/O: O_DIRECT reads through io_uring or a pread thread pool";

    g_io_error = PyErr_NewExceptionWithDoc(
        "lean_qwenflash._io.IoError",
        "An I/O failure: .errno, .strerror (what went wrong) and .tag (the request's tag).",
        PyExc_OSError, nullptr);
    m.attr("IoError") = py::reinterpret_borrow<py::object>(g_io_error);
    m.attr("ALIGNMENT") = kAlignment;

    py::class_<AlignedBuffer>(m, "AlignedBuffer", py::buffer_protocol(),
                              "Zeroed host memory aligned to 4096 bytes; view it with torch.frombuffer or numpy.")
        .def(py::init<uint64_t, uint64_t>(), py::arg("nbytes"), py::arg("alignment") = kAlignment)
        .def_buffer([](AlignedBuffer& b) {
            return py::buffer_info(b.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                                   {static_cast<py::ssize_t>(b.size())}, {static_cast<py::ssize_t>(1)}, false);
        })
        .def_property_readonly("address", [](const AlignedBuffer& b) { return reinterpret_cast<uintptr_t>(b.data()); })
        .def_property_readonly("nbytes", &AlignedBuffer::size)
        .def("__len__", &AlignedBuffer::size);

    py::class_<PyEngine>(m, "Engine", "Read-only reader of one file; see lean_qwenflash.io_engine for the Python API.")
        .def(py::init<const std::string&, const std::string&, unsigned, unsigned, bool>(), py::arg("path"),
             py::arg("engine") = "auto", py::arg("queue_depth") = 32, py::arg("num_threads") = 0,
             py::arg("direct") = true)
        .def("submit", &PyEngine::submit, py::arg("dest"), py::arg("dest_offset"), py::arg("file_offset"),
             py::arg("length"), py::arg("tag") = 0, py::arg("urgent") = false,
             "Queue one read; returns a request id to wait on.")
        .def("wait", &PyEngine::wait, py::arg("request_id"),
             "Block until the request completes (IoError if it failed); returns its service time in seconds.")
        .def("wait_all", &PyEngine::wait_all, py::arg("request_ids"))
        .def("is_done", [](PyEngine& p, uint64_t id) { return p.eng().is_done(id); }, py::arg("request_id"))
        .def("read", &PyEngine::read, py::arg("batch"), py::arg("urgent") = true,
             "Read a batch of (dest, dest_offset, file_offset, length, tag) and wait for all of it.")
        .def("drain", [](PyEngine& p) {
            Engine& e = p.eng();
            py::gil_scoped_release nogil;
            e.drain();
        })
        .def("close", &PyEngine::close)
        .def_property_readonly("kind", [](PyEngine& p) { return p.eng().kind(); })
        .def_property_readonly("fallback_reason", [](PyEngine& p) { return p.eng().fallback_reason(); })
        .def_property_readonly("direct", [](PyEngine& p) { return p.eng().direct(); })
        .def_property_readonly("file_size", [](PyEngine& p) { return p.eng().file_size(); })
        .def_property_readonly("queue_depth", [](PyEngine& p) { return p.eng().queue_depth(); })
        .def_property_readonly("path", [](PyEngine& p) { return p.eng().path(); })
        .def_property_readonly("bytes_read", [](PyEngine& p) { return p.eng().bytes_read(); })
        .def_property_readonly("num_reads", [](PyEngine& p) { return p.eng().num_reads(); });

    // Keys cross as (group, item) pairs; SlotTable::key is their one encoding. The hot calls
    // (pin_present, unpin_all) read their lists through the C API: a decode step makes them once
    // per layer on cold CPU caches, where pybind11's generic casters cost more.
    static const int kSlotEmpty = SlotTable::EMPTY, kSlotReading = SlotTable::READING, kSlotReady = SlotTable::READY;
    auto key_or_none = [](int64_t key) -> py::object {
        if (key < 0) return py::none();
        return py::make_tuple(SlotTable::group_of(key), SlotTable::item_of(key));
    };
    static const int64_t kDecaySlots = SlotTable::kDecaySlots;
    py::class_<SlotTable>(m, "SlotTable", "Slot states, pins and eviction order (LRU or LFU) of one expert cache tier (experts/cache.py).")
        .def(py::init([](int num_slots, const std::string& policy, int64_t decay_every) {
            return new SlotTable(num_slots, SlotTable::policy_named(policy), decay_every);
        }), py::arg("num_slots"), py::arg("policy") = "lru", py::arg("decay_every") = 0)
        .def_property_readonly("policy", [](const SlotTable& t) { return t.policy() == SlotTable::LFU ? "lfu" : "lru"; })
        .def_property_readonly("decay_every", &SlotTable::decay_every)
        .def("uses", [](const SlotTable& t, int64_t group, int64_t item) { return t.uses(SlotTable::key(group, item)); },
             py::arg("group"), py::arg("item"), "LFU: the (decayed) use count of (group, item); 0 under LRU.")
        .def_property_readonly("num_slots", &SlotTable::num_slots)
        .def("lookup", [](const SlotTable& t, int64_t group, int64_t item) {
            return t.lookup(SlotTable::key(group, item));
        }, py::arg("group"), py::arg("item"), "The slot holding (group, item), or -1.")
        .def("pin", &SlotTable::pin, py::arg("slot"))
        .def("unpin", &SlotTable::unpin, py::arg("slot"))
        .def("mark_ready", &SlotTable::mark_ready, py::arg("slot"))
        .def("make_cold", &SlotTable::make_cold, py::arg("slot"))
        .def("allocate", [key_or_none](SlotTable& t, int64_t group, int64_t item) {
            int64_t evicted;
            int slot = t.allocate(SlotTable::key(group, item), &evicted);
            return py::make_tuple(slot, key_or_none(evicted));
        }, py::arg("group"), py::arg("item"), "(slot or -1, the evicted key or None).")
        .def("drop", &SlotTable::drop, py::arg("slot"))
        .def("pin_present", [](SlotTable& t, int64_t group, py::list items) -> py::object {
            const Py_ssize_t n = PyList_GET_SIZE(items.ptr());
            std::vector<int64_t> keys(n);
            std::vector<int> slots(n);
            for (Py_ssize_t i = 0; i < n; ++i) {
                long long item = PyLong_AsLongLong(PyList_GET_ITEM(items.ptr(), i));
                if (item == -1 && PyErr_Occurred()) throw py::error_already_set();
                keys[i] = SlotTable::key(group, item);
            }
            if (!t.pin_present(keys.data(), static_cast<int>(n), slots.data())) return py::none();
            PyObject* out = PyList_New(n);
            if (!out) throw py::error_already_set();
            for (Py_ssize_t i = 0; i < n; ++i) PyList_SET_ITEM(out, i, PyLong_FromLong(slots[i]));
            return py::reinterpret_steal<py::object>(out);
        }, py::arg("group"), py::arg("items"),
             "Pin every item's slot, in order, and return the slots; None (nothing pinned) if one has none.")
        .def("unpin_all", [](SlotTable& t, py::list slots) {
            const Py_ssize_t n = PyList_GET_SIZE(slots.ptr());
            std::vector<int> ids(n);
            for (Py_ssize_t i = 0; i < n; ++i) {
                long slot = PyLong_AsLong(PyList_GET_ITEM(slots.ptr(), i));
                if (slot == -1 && PyErr_Occurred()) throw py::error_already_set();
                ids[i] = static_cast<int>(slot);
            }
            t.unpin_all(ids.data(), static_cast<int>(n));
        }, py::arg("slots"))
        .def("key_of", [key_or_none](const SlotTable& t, int slot) { return key_or_none(t.key_of(slot)); },
             py::arg("slot"), "(group, item) held by the slot, or None.")
        .def("state", &SlotTable::state, py::arg("slot"))
        .def("pins", &SlotTable::pins, py::arg("slot"))
        .def("held", &SlotTable::held, py::arg("group"))
        .def("held_by_group", &SlotTable::held_by_group)
        .def("__len__", &SlotTable::size)
        .def("num_pinned", &SlotTable::num_pinned)
        .def("items", [key_or_none](const SlotTable& t) {
            py::dict out;
            for (const auto& kv : t.items()) out[key_or_none(kv.first)] = kv.second;
            return out;
        }, "{(group, item): slot} of every key with a slot.")
        .def("eviction_order", &SlotTable::eviction_order, "The evictable slots, the next victim first.")
        .def_readonly_static("DECAY_SLOTS", &kDecaySlots)
        .def_readonly_static("EMPTY", &kSlotEmpty)
        .def_readonly_static("READING", &kSlotReading)
        .def_readonly_static("READY", &kSlotReady);

    m.def("crc32c", [](py::buffer data, uint32_t seed) {
        py::buffer_info info = data.request();
        const void* ptr = info.ptr;
        uint64_t n = static_cast<uint64_t>(info.size * info.itemsize);
        py::gil_scoped_release nogil;
        return crc32c(ptr, n, seed);
    }, py::arg("data"), py::arg("seed") = 0, "CRC-32C (Castagnoli) of a buffer; hardware-accelerated on x86-64.");
    m.def("uring_compiled", &uring_compiled, "True if this build links liburing.");
    m.def("_force_uring_failure", &force_uring_failure, py::arg("on"),
          "Test switch: make io_uring setup fail as it does in a locked-down container.");
}
