// Where compute threads run (csrc/affinity.cpp): one core per thread of the budget, so that the
// scheduler never stacks two of our busy threads on one core while a neighbour holds the other.
#pragma once

#include <pthread.h>

#include <string>
#include <vector>

namespace lqf {

// Let one thread run on these CPUs only. Returns false when the kernel refused (a CPU left this
// process's cpuset, say) or the list is empty.
bool pin_thread(pthread_t thread, const std::vector<int>& cpus);

// Bind the kernel pools' workers: worker i (1 .. n-1; the caller is thread 0) of every pool, now and
// later, runs on cpus[i % cpus.size()]. An empty `cpus` lets them run on `anywhere` (the process's
// CPUs) again; both empty leaves them alone.
void bind_kernel_threads(const std::vector<int>& cpus, const std::vector<int>& anywhere);
std::vector<int> kernel_thread_cpus();

// Bind the OpenMP team that `num_threads`-thread parallel regions of the calling thread use (torch's
// intra-op pool) the same way: member i runs on cpus[i % cpus.size()] (with `cpus` empty, anywhere
// in `anywhere`), except the caller (member 0), whose mask is left alone. `runtime` is the path of
// the OpenMP library already loaded in this process (libgomp, or a runtime exporting its GOMP_ entry
// points); it is not loaded if absent. Returns the thread ids of the members bound; throws naming
// what was missing.
std::vector<long> bind_openmp_team(const std::string& runtime, int num_threads, const std::vector<int>& cpus,
                                   const std::vector<int>& anywhere);

// The kernel thread ids of the kernel pools' workers (for tests and `ps`).
std::vector<long> kernel_thread_ids();

}  // namespace lqf
