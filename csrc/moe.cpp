// Run-time ISA choice, a small thread pool, and the products the runtime calls:
//   gemv            one matrix x one activation row (decode shape; tests and benchmarks)
//   gemm            one matrix x many activation rows (prefill shape: the multi-column kernels)
//   moe_decode      one token through all of its routed experts of a layer in one call:
//                   gate_up -> silu(gate) * up -> down, weighted sum
//   moe_decode_parts / moe_combine  the same in pieces: some experts' outputs now, the rest when
//                   their bytes land, summed in expert order with moe_decode's bits
//   moe_prefill     many tokens through their experts of a layer in one call
//   dequantize      rows -> fp32 (the exact path and prefill tiles), rows split over threads
// Every output value is computed by one thread in a fixed order, so results do not depend on the
// thread count, and a given ISA is deterministic.
#include "moe.h"

#include <pthread.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "affinity.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

namespace lqf {

// ---- ISA ----

static bool cpu_has_avx2() {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
}

static bool cpu_has_avx512() {
    __builtin_cpu_init();
    return cpu_has_avx2() && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vnni");
}

std::vector<std::string> supported_isas() {
    std::vector<std::string> out{"scalar"};
    if (cpu_has_avx2()) out.push_back("avx2");
    if (cpu_has_avx512()) out.push_back("avx512");
    return out;
}

std::string best_isa() { return supported_isas().back(); }

const KernelTable& kernels_for(const std::string& isa) {
    if (isa == "auto") return kernels_for(best_isa());
    if (isa == "scalar") return scalar_kernels();
    if (isa == "avx2") {
        if (!cpu_has_avx2()) throw std::invalid_argument("this CPU lacks AVX2/FMA/F16C: use isa 'scalar' or 'auto'");
        return avx2_kernels();
    }
    if (isa == "avx512") {
        if (!cpu_has_avx512()) throw std::invalid_argument("this CPU lacks AVX-512 F/BW/VL/VNNI: use isa 'avx2', 'scalar' or 'auto'");
        return avx512_kernels();
    }
    throw std::invalid_argument("unknown isa '" + isa + "': expected auto, scalar, avx2 or avx512");
}

// ---- thread pool: the caller runs tasks too; workers spin briefly, then sleep ----

// How long an idle worker spins before sleeping (pause instructions, read on every iteration so a
// change takes effect at once). Short by default: torch's own intra-op threads run between our
// calls on the same cores, and a long spin steals their time (prefill 52 -> 31 tok/s with 20000).
// A decode step on CPU runs torch on one thread, so there it is raised (set_spin): the workers stay
// awake across the many small calls of a step (Q4_K_M decode 43 -> 49 tok/s).
std::atomic<int> g_spin_iterations{2000};

int set_spin(int iterations) { return g_spin_iterations.exchange(iterations < 0 ? 0 : iterations); }

// One call's tasks. Workers claim task indices from `next` and count finished ones in `done`; the
// caller returns as soon as every task is done, so a worker the scheduler has not run yet (a busy
// neighbour holds its core) costs nothing: the caller claims its tasks too. A worker that wakes late
// finds `next` past `total` and leaves the job alone (it keeps the job alive through its shared_ptr).
struct Job {
    const std::function<void(int)>* fn = nullptr;
    int total = 0;
    std::atomic<int> next{0};
    std::atomic<int> done{0};
};

class Pool {
   public:
    explicit Pool(int n) : tids_(static_cast<size_t>(std::max(0, n - 1))) {
        for (int i = 1; i < n; ++i)
            workers_.emplace_back([this, i] {
                pthread_setname_np(pthread_self(), "lqf-kernels");
                tids_[i - 1].store(static_cast<long>(syscall(SYS_gettid)));
                loop();
            });
    }
    // Worker i (1 ..) runs on cpus[i % size] from now on; with no cpus, anywhere in `anywhere`.
    void bind(const std::vector<int>& cpus, const std::vector<int>& anywhere) {
        for (size_t i = 0; i < workers_.size(); ++i)
            pin_thread(workers_[i].native_handle(), cpus.empty() ? anywhere : std::vector<int>{cpus[(i + 1) % cpus.size()]});
    }
    void thread_ids(std::vector<long>& out) const {
        for (const auto& t : tids_)
            if (long id = t.load()) out.push_back(id);
    }
    ~Pool() {
        {
            std::lock_guard<std::mutex> lk(mu_);
            stop_ = true;
            ++gen_;
        }
        cv_.notify_all();
        for (auto& t : workers_) t.join();
    }
    int size() const { return static_cast<int>(workers_.size()) + 1; }

    void run(int num_tasks, const std::function<void(int)>& fn) {
        if (num_tasks <= 0) return;
        if (workers_.empty() || num_tasks == 1) {
            for (int t = 0; t < num_tasks; ++t) fn(t);
            return;
        }
        std::lock_guard<std::mutex> one_job(run_mu_);   // callers on several threads take turns
        auto job = std::make_shared<Job>();
        job->fn = &fn;
        job->total = num_tasks;
        {
            std::lock_guard<std::mutex> lk(mu_);
            job_ = job;
            ++gen_;
            gen_atomic_.store(gen_, std::memory_order_release);
        }
        cv_.notify_all();
        work(*job);
        // Tasks a worker claimed and is still running: spin briefly, then yield the core (that
        // worker may be waiting for it), never an unbounded spin.
        for (int i = 0; job->done.load(std::memory_order_acquire) != num_tasks; ++i) {
            if (i < 4096)
                __builtin_ia32_pause();
            else
                std::this_thread::yield();
        }
        std::lock_guard<std::mutex> lk(mu_);
        if (job_ == job) job_.reset();
    }

   private:
    static void work(Job& job) {
        for (int t; (t = job.next.fetch_add(1, std::memory_order_relaxed)) < job.total;) {
            (*job.fn)(t);
            job.done.fetch_add(1, std::memory_order_acq_rel);
        }
    }
    void loop() {
        uint64_t seen = 0;
        for (;;) {
            // Spin a little (bounded: g_spin_iterations pauses): consecutive calls come fast.
            for (int i = 0; i < g_spin_iterations.load(std::memory_order_relaxed) &&
                            gen_atomic_.load(std::memory_order_acquire) == seen;
                 ++i)
                __builtin_ia32_pause();
            std::shared_ptr<Job> job;
            {
                std::unique_lock<std::mutex> lk(mu_);
                cv_.wait(lk, [&] { return gen_ != seen; });
                seen = gen_;
                if (stop_) return;
                job = job_;
            }
            if (job) work(*job);
        }
    }

    std::vector<std::thread> workers_;
    std::vector<std::atomic<long>> tids_;
    std::mutex run_mu_;
    std::mutex mu_;
    std::condition_variable cv_;
    uint64_t gen_ = 0;
    std::atomic<uint64_t> gen_atomic_{0};
    bool stop_ = false;
    std::shared_ptr<Job> job_;
};

// One pool per thread count, made on first use and kept: models with different thread budgets in
// one process each get theirs, and no pool is torn down under a caller still using it.
// Every pool's workers follow one binding (bind_kernel_threads), pools made later too.
static std::map<int, std::unique_ptr<Pool>> g_pools;
static std::mutex g_pools_mu;
static std::vector<int> g_bind_cpus, g_anywhere;

static Pool& pool(int num_threads) {
    std::lock_guard<std::mutex> lk(g_pools_mu);
    num_threads = std::max(1, num_threads);
    auto& p = g_pools[num_threads];
    if (!p) {
        p.reset(new Pool(num_threads));
        // (its workers inherit the creating thread's mask, which a bound step narrowed to one CPU)
        if (!g_bind_cpus.empty() || !g_anywhere.empty()) p->bind(g_bind_cpus, g_anywhere);
    }
    return *p;
}

void bind_kernel_threads(const std::vector<int>& cpus, const std::vector<int>& anywhere) {
    std::lock_guard<std::mutex> lk(g_pools_mu);
    g_bind_cpus = cpus;
    g_anywhere = anywhere;
    if (cpus.empty() && anywhere.empty()) return;
    for (auto& kv : g_pools) kv.second->bind(cpus, anywhere);
}

std::vector<int> kernel_thread_cpus() {
    std::lock_guard<std::mutex> lk(g_pools_mu);
    return g_bind_cpus;
}

std::vector<long> kernel_thread_ids() {
    std::lock_guard<std::mutex> lk(g_pools_mu);
    std::vector<long> out;
    for (auto& kv : g_pools) kv.second->thread_ids(out);
    return out;
}

void parallel_run(int num_threads, int num_tasks, const std::function<void(int)>& fn) { pool(num_threads).run(num_tasks, fn); }

// ---- activations ----

struct ActBuf {
    std::vector<float> d, s;
    std::vector<int8_t> q;
    const float* x = nullptr;
    Act act() const { return Act{x, ActQ8{d.data(), q.data(), s.data()}}; }
    void prepare(int enc, const float* values, int n) {
        x = values;
        if (enc_is_float(enc)) return;
        d.resize(n / QA);
        s.resize(n / QA);
        q.resize(n);
        quantize_act(values, n, d.data(), q.data(), s.data());
    }
};

// Buffers a many-token call reuses on its calling thread, grown to the largest call so far and
// never shrunk: a 512-token moe_prefill of the issue-21 model wrote 40 MB of fresh memory per
// layer, ~570 MiB of page faults per prompt.
template <class T>
static T* room(std::vector<T>& v, size_t n) {
    if (v.size() < n) v.resize(n);
    return v.data();
}

// Activation rows for a product in `enc`, quantized per block into buffers kept across calls
// (floats are read in place): reserve for n rows of `cols` values, then prepare(i, x) fills row i
// (from any thread) and acts[i] is its activation.
struct RowActs {
    std::vector<int8_t> q;
    std::vector<float> d, s;
    std::vector<Act> acts;
    bool block = false;
    int cols = 0;
    size_t nb = 0;
    void reserve(int enc, int n, int row_cols) {
        block = !enc_is_float(enc);
        cols = row_cols;
        nb = static_cast<size_t>(cols / QA);
        room(acts, n);
        if (!block) return;
        room(q, static_cast<size_t>(n) * cols);
        room(d, n * nb);
        room(s, n * nb);
    }
    void prepare(int i, const float* x) {
        acts[i].x = x;
        if (!block) return;
        int8_t* qi = q.data() + static_cast<size_t>(i) * cols;
        float *di = d.data() + i * nb, *si = s.data() + i * nb;
        acts[i].q8 = ActQ8{di, qi, si};
        quantize_act(x, cols, di, qi, si);
    }
};

// silu(gate) * up of one row of h [2I] (gate then up) into out [I]
static void swiglu_row(const float* h, int inter, float* out) {
    for (int j = 0; j < inter; ++j) {
        const float g = h[j];
        out[j] = g / (1.f + std::exp(-g)) * h[inter + j];
    }
}

// silu(gate) * up of each of n rows of h [n, 2I] (gate then up), prepared for a product in `enc`
// (quantized for block encodings): acts[i] is row i's activation.
struct SwiGLU {
    std::vector<float> values;
    std::vector<ActBuf> bufs;
    std::vector<Act> acts;
    SwiGLU(Pool& pl, const float* h, int n, int inter, int enc)
        : values(static_cast<size_t>(n) * inter), bufs(n), acts(n) {
        pl.run(n, [&](int i) {
            float* ai = values.data() + static_cast<size_t>(i) * inter;
            swiglu_row(h + static_cast<size_t>(i) * 2 * inter, inter, ai);
            bufs[i].prepare(enc, ai, inter);
            acts[i] = bufs[i].act();
        });
    }
};

// What moe_prefill reuses on its calling thread: the tokens' and the pairs' activations, the
// gate_up and down outputs.
struct PrefillScratch {
    RowActs x, a;
    std::vector<const Act*> pair_acts;
    std::vector<float> h, sw, y;
};

static void check_cols(int enc, int cols, const char* what) {
    if (enc < 0 || enc >= ENC_COUNT) throw std::invalid_argument(std::string(what) + ": unknown encoding id");
    if (cols <= 0 || cols % enc_block_values(enc))
        throw std::invalid_argument(std::string(what) + ": row length " + std::to_string(cols) +
                                    " is not a multiple of the encoding's block of " + std::to_string(enc_block_values(enc)));
    require_tables(enc);     // the IQ types: their grids must have been handed over (quant_types.cpp)
}

// Rows per task: contiguous runs long enough for the prefetchers (16 rows -> 64: 15.9 -> 17.3 GB/s
// for q4_k at 2 threads), about four tasks per thread so a busy core does not hold the rest up.
static int task_rows(int total_rows, int threads) {
    return std::max(16, std::min(512, total_rows / (4 * std::max(1, threads))));
}

void gemv(const uint8_t* w, int enc, int rows, int cols, const float* x, float* out, int num_threads, const std::string& isa) {
    gemv_multi({w}, {enc}, {rows}, cols, x, {out}, num_threads, isa);
}

void gemv_multi(const std::vector<const uint8_t*>& w, const std::vector<int>& enc, const std::vector<int>& rows, int cols,
                const float* x, const std::vector<float*>& out, int num_threads, const std::string& isa) {
    const size_t n = w.size();
    if (enc.size() != n || rows.size() != n || out.size() != n || n == 0)
        throw std::invalid_argument("gemv: one encoding, row count and output per matrix");
    const KernelTable& k = kernels_for(isa);
    // One quantized activation serves every block encoding (all read 32-value int8 blocks).
    ActBuf a;
    bool quantized = false;
    for (size_t m = 0; m < n; ++m) {
        check_cols(enc[m], cols, "gemv");
        if (!enc_is_float(enc[m]) && !quantized) {
            a.prepare(enc[m], x, cols);
            quantized = true;
        }
    }
    Act act = a.act();
    act.x = x;
    Pool& p = pool(num_threads);
    int total = 0;
    for (int r : rows) total += r;
    const int step = task_rows(total, p.size());
    // Tasks: runs of `step` rows inside one matrix.
    std::vector<std::pair<int, int>> tasks;     // (matrix, first row)
    for (size_t m = 0; m < n; ++m)
        for (int r = 0; r < rows[m]; r += step) tasks.emplace_back(static_cast<int>(m), r);
    p.run(static_cast<int>(tasks.size()), [&](int t) {
        const int m = tasks[t].first, r0 = tasks[t].second, r1 = std::min(rows[m], r0 + step);
        const size_t stride = enc_row_bytes(enc[m], cols);
        const DotFn dot = k.dot[enc[m]];
        for (int r = r0; r < r1; ++r) out[m][r] = dot(w[m] + r * stride, act, cols);
    });
}

// moe_decode and moe_decode_parts: gate_up, SwiGLU, then down; with ``parts`` each expert's down
// output lands in its own row (parts[e * hidden + r], unweighted), else out[r] sums the experts in
// order. A row of parts is the very float the sum takes, so moe_combine of parts gives moe_decode's
// bits (no fused multiply-adds in this file).
static void moe_decode_impl(const float* x, int hidden, int inter, const std::vector<const uint8_t*>& gate_up,
                            const std::vector<const uint8_t*>& down, const float* weights, int gate_up_enc,
                            int down_enc, float* out, float* parts, int num_threads, const std::string& isa) {
    check_cols(gate_up_enc, hidden, "moe_decode gate_up");
    check_cols(down_enc, inter, "moe_decode down");
    const KernelTable& k = kernels_for(isa);
    const int num_experts = static_cast<int>(gate_up.size());
    if (down.size() != gate_up.size())
        throw std::invalid_argument("moe_decode: gate_up, down and weights must have one entry per expert");
    if (num_experts == 0) {
        if (out) std::fill(out, out + hidden, 0.f);
        return;
    }
    Pool& p = pool(num_threads);

    // 1. gate_up for every expert: [E, 2I]
    ActBuf ax;
    ax.prepare(gate_up_enc, x, hidden);
    const Act act_x = ax.act();
    const size_t gu_stride = enc_row_bytes(gate_up_enc, hidden);
    const DotFn dot_gu = k.dot[gate_up_enc];
    std::vector<float> h(static_cast<size_t>(num_experts) * 2 * inter);
    const int gu_step = std::min(2 * inter, task_rows(num_experts * 2 * inter, p.size()));
    const int gu_tasks_per_expert = (2 * inter + gu_step - 1) / gu_step;
    p.run(num_experts * gu_tasks_per_expert, [&](int t) {
        const int e = t / gu_tasks_per_expert, r0 = (t % gu_tasks_per_expert) * gu_step;
        const int r1 = std::min(2 * inter, r0 + gu_step);
        float* he = h.data() + static_cast<size_t>(e) * 2 * inter;
        for (int r = r0; r < r1; ++r) he[r] = dot_gu(gate_up[e] + r * gu_stride, act_x, hidden);
    });

    // 2. silu(gate) * up, quantized per expert for the down product
    SwiGLU sw(p, h.data(), num_experts, inter, down_enc);
    const std::vector<Act>& acts = sw.acts;

    // 3. down: every output row sums its experts in order (deterministic), or each expert's row apart
    const size_t dn_stride = enc_row_bytes(down_enc, inter);
    const DotFn dot_dn = k.dot[down_enc];
    const int dn_step = task_rows(hidden, p.size());
    p.run((hidden + dn_step - 1) / dn_step, [&](int t) {
        const int r1 = std::min(hidden, (t + 1) * dn_step);
        for (int r = t * dn_step; r < r1; ++r) {
            if (parts) {
                for (int e = 0; e < num_experts; ++e)
                    parts[static_cast<size_t>(e) * hidden + r] = dot_dn(down[e] + r * dn_stride, acts[e], inter);
                continue;
            }
            float acc = 0.f;
            for (int e = 0; e < num_experts; ++e) acc += weights[e] * dot_dn(down[e] + r * dn_stride, acts[e], inter);
            out[r] = acc;
        }
    });
}

void moe_decode(const float* x, int hidden, int inter, const std::vector<const uint8_t*>& gate_up,
                const std::vector<const uint8_t*>& down, const std::vector<float>& weights, int gate_up_enc, int down_enc,
                float* out, int num_threads, const std::string& isa) {
    if (weights.size() != gate_up.size())
        throw std::invalid_argument("moe_decode: gate_up, down and weights must have one entry per expert");
    moe_decode_impl(x, hidden, inter, gate_up, down, weights.data(), gate_up_enc, down_enc, out, nullptr, num_threads, isa);
}

void moe_decode_parts(const float* x, int hidden, int inter, const std::vector<const uint8_t*>& gate_up,
                      const std::vector<const uint8_t*>& down, int gate_up_enc, int down_enc, float* parts,
                      int num_threads, const std::string& isa) {
    moe_decode_impl(x, hidden, inter, gate_up, down, nullptr, gate_up_enc, down_enc, nullptr, parts, num_threads, isa);
}

void moe_combine(const std::vector<const float*>& parts, const std::vector<float>& weights, int hidden, float* out) {
    if (parts.size() != weights.size())
        throw std::invalid_argument("moe_combine: parts and weights must have one entry per expert");
    for (int r = 0; r < hidden; ++r) {
        float acc = 0.f;
        for (size_t e = 0; e < parts.size(); ++e) acc += weights[e] * parts[e][r];
        out[r] = acc;
    }
}

// dst[p * rows + r] = row r of expert e times pair p's activations acts[p], for every pair p of every
// expert e (pairs first[e] .. first[e+1]); tasks are tiles of about TILE_BYTES of one expert's rows
// (at least 16 rows, and small enough for ~4 tasks a thread), run against all of that expert's pairs
// while the rows sit in cache (dot_many: each row's blocks decoded once per four pairs). A tile is one
// contiguous read for the prefetchers: with the 16-row tiles of before, a short prompt's experts (2-3
// tokens each, read from DRAM once) stalled at every tile's start (Q4_K_M file, 32-token prompt, one
// process: median 117-148 -> 161-176 tok/s; 512 tokens unchanged within noise, bf16 unchanged).
constexpr size_t TILE_BYTES = 64 << 10;
static void rows_times_pairs(Pool& pl, const KernelTable& k, int enc, const std::vector<const uint8_t*>& w,
                             const std::vector<int>& first, int rows, int cols, const Act* const* acts, float* dst) {
    const size_t stride = enc_row_bytes(enc, cols);
    const int num_experts = static_cast<int>(w.size());
    const int by_bytes = std::max(16, static_cast<int>(TILE_BYTES / stride));
    const int for_balance = std::max(16, rows * num_experts / (4 * pl.size()));   // >= ~4 tasks a thread
    // (a multiple of sixteen rows: the kernels that take rows eight or sixteen at a time get full
    // groups; every row's bits are the single-row kernel's however the call is tiled)
    const int step = std::min(rows, std::max(16, std::min(by_bytes, for_balance) / 16 * 16));
    const int blocks = (rows + step - 1) / step;
    pl.run(num_experts * blocks, [&](int task) {
        const int e = task / blocks, r0 = (task % blocks) * step, r1 = std::min(rows, r0 + step);
        dot_many(k, enc, w[e] + r0 * stride, stride, r1 - r0, acts + first[e], first[e + 1] - first[e], cols,
                 dst + static_cast<size_t>(first[e]) * rows + r0, rows);
    });
}

void gemm(const uint8_t* w, int enc, int rows, int cols, const float* x, int n, float* out, int num_threads,
          const std::string& isa) {
    check_cols(enc, cols, "gemm");
    if (rows <= 0 || n <= 0) throw std::invalid_argument("gemm: needs at least one row and one token");
    const KernelTable& k = kernels_for(isa);
    Pool& pl = pool(num_threads);
    std::vector<ActBuf> ax(n);
    std::vector<Act> acts(n);
    pl.run(n, [&](int t) {
        ax[t].prepare(enc, x + static_cast<size_t>(t) * cols, cols);
        acts[t] = ax[t].act();
    });
    std::vector<const Act*> act_ptrs(n);
    for (int t = 0; t < n; ++t) act_ptrs[t] = &acts[t];
    rows_times_pairs(pl, k, enc, {w}, {0, n}, rows, cols, act_ptrs.data(), out);
}

void moe_prefill(const float* x, int hidden, int inter, const std::vector<const uint8_t*>& gate_up,
                 const std::vector<const uint8_t*>& down, const int* counts, const int* tokens, const float* weights,
                 int gate_up_enc, int down_enc, float* out, int num_threads, const std::string& isa) {
    check_cols(gate_up_enc, hidden, "moe_prefill gate_up");
    check_cols(down_enc, inter, "moe_prefill down");
    const KernelTable& k = kernels_for(isa);
    const int num_experts = static_cast<int>(gate_up.size());
    if (down.size() != gate_up.size()) throw std::invalid_argument("moe_prefill: gate_up and down must have one entry per expert");
    std::vector<int> first(num_experts + 1, 0);                 // expert e's pairs: first[e] .. first[e+1]
    for (int e = 0; e < num_experts; ++e) {
        if (counts[e] <= 0) throw std::invalid_argument("moe_prefill: every expert of a call needs at least one token");
        first[e + 1] = first[e] + counts[e];
    }
    const int pairs = first[num_experts];
    int num_tokens = 0;                                          // tokens are rows of x and out
    for (int p = 0; p < pairs; ++p) num_tokens = std::max(num_tokens, tokens[p] + 1);
    Pool& pl = pool(num_threads);
    // (a reference: the pool's workers must use the calling thread's scratch, not their own)
    thread_local PrefillScratch scratch;
    PrefillScratch& sc = scratch;

    // 1. each token's activations, quantized once for the gate_up encoding
    sc.x.reserve(gate_up_enc, num_tokens, hidden);
    pl.run(num_tokens, [&](int t) { sc.x.prepare(t, x + static_cast<size_t>(t) * hidden); });
    const Act** pair_acts = room(sc.pair_acts, pairs);
    for (int p = 0; p < pairs; ++p) pair_acts[p] = &sc.x.acts[tokens[p]];

    // 2. gate_up for every pair: h [pairs, 2I]
    float* h = room(sc.h, static_cast<size_t>(pairs) * 2 * inter);
    rows_times_pairs(pl, k, gate_up_enc, gate_up, first, 2 * inter, hidden, pair_acts, h);

    // 3. silu(gate) * up per pair, quantized for the down product
    float* sw = room(sc.sw, static_cast<size_t>(pairs) * inter);
    sc.a.reserve(down_enc, pairs, inter);
    pl.run(pairs, [&](int p) {
        float* ap = sw + static_cast<size_t>(p) * inter;
        swiglu_row(h + static_cast<size_t>(p) * 2 * inter, inter, ap);
        sc.a.prepare(p, ap);
    });
    for (int p = 0; p < pairs; ++p) pair_acts[p] = &sc.a.acts[p];

    // 4. down for every pair: y [pairs, H]
    float* y = room(sc.y, static_cast<size_t>(pairs) * hidden);
    rows_times_pairs(pl, k, down_enc, down, first, hidden, inter, pair_acts, y);

    // 5. out[token] += weight * y, expert by expert in the call's order (as torch's per-expert
    //    index_add: a prefill split into several calls adds in the same order); threads own columns
    const int col_step = std::max(64, hidden / (4 * pl.size()));
    pl.run((hidden + col_step - 1) / col_step, [&](int task) {
        const int c0 = task * col_step, c1 = std::min(hidden, c0 + col_step);
        for (int p = 0; p < pairs; ++p) {
            const float w = weights[p];
            const float* yp = y + static_cast<size_t>(p) * hidden;
            float* op = out + static_cast<size_t>(tokens[p]) * hidden;
            for (int c = c0; c < c1; ++c) op[c] += w * yp[c];
        }
    });
}

void dequantize(const uint8_t* src, int enc, int rows, int cols, float* dst, int num_threads) {
    check_cols(enc, cols, "dequantize");
    const size_t stride = enc_row_bytes(enc, cols);
    constexpr int ROWS = 64;
    pool(num_threads).run((rows + ROWS - 1) / ROWS, [&](int t) {
        const int r1 = std::min(rows, (t + 1) * ROWS);
        for (int r = t * ROWS; r < r1; ++r) dequantize_row(enc, src + r * stride, cols, dst + static_cast<size_t>(r) * cols);
    });
}

}  // namespace lqf
