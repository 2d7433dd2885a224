// Thread placement for the compute budget (see affinity.h and models/affinity.py).
//
// Why: with two cores and two busy threads of ours, one neighbour at nice 19 beside us made the
// scheduler's wake-up placement put two of our threads on one core now and then (they wake and
// sleep hundreds of times per prompt), and a 512-token prompt lost 15-25% of its speed. One core
// per compute thread keeps them apart; llama.cpp's threads, which never sleep, lose ~0-5%.
#include "affinity.h"

#include <dlfcn.h>
#include <sched.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <atomic>
#include <mutex>
#include <stdexcept>

namespace lqf {

bool pin_thread(pthread_t thread, const std::vector<int>& cpus) {
    cpu_set_t set;
    CPU_ZERO(&set);
    for (int cpu : cpus) {
        if (cpu < 0 || cpu >= CPU_SETSIZE) return false;
        CPU_SET(cpu, &set);
    }
    return !cpus.empty() && pthread_setaffinity_np(thread, sizeof(set), &set) == 0;
}

namespace {

struct OmpCall {
    int (*thread_num)() = nullptr;
    const std::vector<int>* cpus = nullptr;
    const std::vector<int>* anywhere = nullptr;
    std::mutex mu;
    std::vector<long> tids;
};

void omp_member(void* data) {
    auto* call = static_cast<OmpCall*>(data);
    const int i = call->thread_num();
    if (i == 0) return;   // the caller: its own mask is the runtime's business (models/affinity.py)
    const auto& cpus = *call->cpus;
    if (pin_thread(pthread_self(), cpus.empty() ? *call->anywhere : std::vector<int>{cpus[static_cast<size_t>(i) % cpus.size()]})) {
        std::lock_guard<std::mutex> lk(call->mu);
        call->tids.push_back(static_cast<long>(syscall(SYS_gettid)));
    }
}

}  // namespace

std::vector<long> bind_openmp_team(const std::string& runtime, int num_threads, const std::vector<int>& cpus,
                                   const std::vector<int>& anywhere) {
    if ((cpus.empty() && anywhere.empty()) || num_threads < 2) return {};
    // RTLD_NOLOAD: only the runtime torch already loaded (its thread pool is the one to bind).
    void* lib = dlopen(runtime.c_str(), RTLD_LAZY | RTLD_NOLOAD);
    if (!lib) throw std::runtime_error("OpenMP runtime not loaded in this process: " + runtime);
    using Parallel = void (*)(void (*)(void*), void*, unsigned, unsigned);
    auto parallel = reinterpret_cast<Parallel>(dlsym(lib, "GOMP_parallel"));
    auto thread_num = reinterpret_cast<int (*)()>(dlsym(lib, "omp_get_thread_num"));
    if (!parallel || !thread_num) {
        dlclose(lib);
        throw std::runtime_error(runtime + " has no GOMP_parallel / omp_get_thread_num");
    }
    OmpCall call;
    call.thread_num = thread_num;
    call.cpus = &cpus;
    call.anywhere = &anywhere;
    parallel(omp_member, &call, static_cast<unsigned>(num_threads), 0);
    dlclose(lib);   // (drops only our reference)
    return call.tids;
}

}  // namespace lqf
