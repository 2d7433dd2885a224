// lean-qwenflash native I/O: read-only O_DIRECT reads into caller-owned aligned memory.
//
// One request queue and completion table, two backends that drain it:
//   uring: liburing ring with a registered file; the submitting thread fills the ring up to the
//          queue depth, a reaper thread collects completions (short reads are resubmitted for the
//          remainder) and tops the ring up from the pending queue.
//   pread: a small pool of threads doing pread() (for kernels or containers without io_uring).
// Requests marked urgent jump ahead of pending (not yet submitted) speculative requests, so a
// demand read never waits behind a queue of prefetches. Nothing here touches Python; the
// bindings release the GIL around every blocking call.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

namespace lqf {

constexpr uint64_t kAlignment = 4096;

// An I/O failure with the errno it came from and the caller's tag for the request.
struct IoError : std::runtime_error {
    int err;
    int64_t tag;
    IoError(int err_, int64_t tag_, const std::string& msg)
        : std::runtime_error(msg), err(err_), tag(tag_) {}
};

struct ReadRequest {
    uint64_t id = 0;
    uint64_t file_offset = 0;
    uint64_t length = 0;
    char* dest = nullptr;
    int64_t tag = 0;
    uint64_t done_bytes = 0;  // progress, for resubmitting short reads
    uint64_t submit_ns = 0;   // steady clock, for service-time statistics
};

struct Completion {
    bool done = false;
    int err = 0;              // 0 on success
    std::string message;
    int64_t tag = 0;
    uint64_t service_ns = 0;  // submit -> completion
};

class Backend;
uint64_t now_ns();

struct EngineOptions {
    std::string kind = "auto";   // "auto", "uring", "pread"
    unsigned queue_depth = 32;
    unsigned num_threads = 0;    // pread threads; 0 = min(queue_depth, 8)
    bool direct = true;          // O_DIRECT; falls back to buffered (and says so) if the fs refuses
};

class Engine {
   public:
    Engine(const std::string& path, const EngineOptions& opts);
    ~Engine();
    Engine(const Engine&) = delete;
    Engine& operator=(const Engine&) = delete;

    // Queue a read of [file_offset, file_offset + length) into dest. Validates alignment and
    // bounds before anything is submitted (throws IoError(EINVAL) naming the tag).
    uint64_t submit(uint64_t file_offset, uint64_t length, char* dest, int64_t tag, bool urgent);
    // Block until request id completes; throws IoError if it failed. Forgets the id. Returns the
    // request's service time (submit -> completion) in seconds.
    double wait(uint64_t id);
    bool is_done(uint64_t id);
    // Block until every outstanding request completes (used before buffers are freed).
    void drain();

    const std::string& kind() const { return kind_; }
    const std::string& fallback_reason() const { return fallback_reason_; }
    bool direct() const { return direct_; }
    uint64_t file_size() const { return file_size_; }
    unsigned queue_depth() const { return opts_.queue_depth; }
    const std::string& path() const { return path_; }
    uint64_t bytes_read() const { return bytes_read_; }
    uint64_t num_reads() const { return num_reads_; }

    // Called by backends.
    bool pop_pending(ReadRequest& out);         // urgent first; false if none
    void complete(const ReadRequest& r, int err, const std::string& msg);
    std::mutex mu;
    std::condition_variable work_cv;            // pread workers sleep here
    bool stopping = false;

   private:
    std::string path_;
    EngineOptions opts_;
    int fd_ = -1;
    bool direct_ = true;
    uint64_t file_size_ = 0;
    std::string kind_;
    std::string fallback_reason_;
    std::unique_ptr<Backend> backend_;

    uint64_t next_id_ = 1;
    std::deque<ReadRequest> urgent_, pending_;
    std::unordered_map<uint64_t, Completion> table_;
    std::condition_variable done_cv_;
    uint64_t outstanding_ = 0;
    uint64_t bytes_read_ = 0;
    uint64_t num_reads_ = 0;
};

class Backend {
   public:
    virtual ~Backend() = default;
    // New work was queued on the engine; start it if there is capacity.
    virtual void kick() = 0;
    virtual void shutdown() = 0;
};

std::unique_ptr<Backend> make_pread_backend(Engine& e, int fd, unsigned num_threads);
// Returns nullptr and sets why on failure (never throws for an unavailable kernel feature).
std::unique_ptr<Backend> make_uring_backend(Engine& e, int fd, unsigned queue_depth, std::string& why);
bool uring_compiled();
void force_uring_failure(bool on);  // test switch: make uring setup fail as in a locked-down container

constexpr uint64_t kHugePage = 2ull << 20;   // x86-64 transparent huge page

// Aligned, zeroed host memory exposed to Python through the buffer protocol (huge-page backed
// where the kernel allows, from kHugePage up).
class AlignedBuffer {
   public:
    explicit AlignedBuffer(uint64_t nbytes, uint64_t alignment = kAlignment);
    ~AlignedBuffer();
    AlignedBuffer(const AlignedBuffer&) = delete;
    AlignedBuffer& operator=(const AlignedBuffer&) = delete;
    char* data() const { return data_; }
    uint64_t size() const { return size_; }
    uint64_t alignment() const { return alignment_; }

   private:
    char* data_ = nullptr;
    uint64_t size_ = 0;
    uint64_t alignment_ = kAlignment;
};

uint32_t crc32c(const void* data, uint64_t n, uint32_t seed);

}  // namespace lqf
