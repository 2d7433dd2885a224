// Request queue, completion table, pread backend, aligned buffers and crc32c.
#include "io_engine.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

namespace lqf {

static std::string errno_text(int err) { return std::string(std::strerror(err)); }

uint64_t now_ns() {
    return static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                     std::chrono::steady_clock::now().time_since_epoch())
                                     .count());
}

Engine::Engine(const std::string& path, const EngineOptions& opts) : path_(path), opts_(opts) {
    if (opts_.queue_depth == 0 || opts_.queue_depth > 4096)
        throw IoError(EINVAL, -1, "queue_depth must be in 1..4096, got " + std::to_string(opts_.queue_depth));
    if (opts_.kind != "auto" && opts_.kind != "uring" && opts_.kind != "pread")
        throw IoError(EINVAL, -1, "engine must be 'auto', 'uring' or 'pread', got '" + opts_.kind + "'");

    // Read-only on purpose: the engine must never be able to modify a store.
    direct_ = opts_.direct;
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | (direct_ ? O_DIRECT : 0));
    if (fd_ < 0 && direct_ && errno == EINVAL) {
        // tmpfs and some overlay filesystems refuse O_DIRECT; reading still works, through the
        // page cache, and we say so rather than fail.
        direct_ = false;
        fallback_reason_ = "O_DIRECT refused by the filesystem (EINVAL); reading through the page cache. ";
        fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    }
    if (fd_ < 0) {
        int err = errno;
        throw IoError(err, -1, "cannot open " + path + " for reading: " + errno_text(err));
    }
    struct stat st;
    if (fstat(fd_, &st) != 0) {
        int err = errno;
        ::close(fd_);
        throw IoError(err, -1, "cannot stat " + path + ": " + errno_text(err));
    }
    file_size_ = static_cast<uint64_t>(st.st_size);

    unsigned threads = opts_.num_threads ? opts_.num_threads : std::min(opts_.queue_depth, 8u);
    if (opts_.kind != "pread") {
        std::string why;
        backend_ = make_uring_backend(*this, fd_, opts_.queue_depth, why);
        if (backend_) {
            kind_ = "uring";
        } else if (opts_.kind == "uring") {
            ::close(fd_);
            throw IoError(ENOSYS, -1, "io_uring engine unavailable: " + why + " (use engine 'pread' or 'auto')");
        } else {
            fallback_reason_ += "io_uring unavailable (" + why + "); using the pread thread pool.";
        }
    }
    if (!backend_) {
        backend_ = make_pread_backend(*this, fd_, threads);
        kind_ = "pread";
    }
}

Engine::~Engine() {
    drain();
    {
        std::lock_guard<std::mutex> lk(mu);
        stopping = true;
    }
    work_cv.notify_all();
    backend_->shutdown();
    backend_.reset();
    ::close(fd_);
}

uint64_t Engine::submit(uint64_t file_offset, uint64_t length, char* dest, int64_t tag, bool urgent) {
    // Every check happens before the request exists, so a refused request has done no I/O.
    auto addr = reinterpret_cast<uintptr_t>(dest);
    if (length == 0) throw IoError(EINVAL, tag, "read of 0 bytes (tag " + std::to_string(tag) + ")");
    if (file_offset % kAlignment || length % kAlignment || addr % kAlignment)
        throw IoError(EINVAL, tag,
                      "misaligned read (tag " + std::to_string(tag) + "): file offset " + std::to_string(file_offset) +
                          ", length " + std::to_string(length) + " and destination address must all be multiples of " +
                          std::to_string(kAlignment));
    if (file_offset + length > file_size_)
        throw IoError(EINVAL, tag,
                      "read past end of " + path_ + " (tag " + std::to_string(tag) + "): bytes [" +
                          std::to_string(file_offset) + ", " + std::to_string(file_offset + length) + ") of a " +
                          std::to_string(file_size_) + "-byte file");
    uint64_t id;
    {
        std::lock_guard<std::mutex> lk(mu);
        id = next_id_++;
        ReadRequest r;
        r.id = id;
        r.file_offset = file_offset;
        r.length = length;
        r.dest = dest;
        r.tag = tag;
        r.submit_ns = now_ns();
        Completion c;
        c.tag = tag;
        table_.emplace(id, c);
        (urgent ? urgent_ : pending_).push_back(r);
        ++outstanding_;
    }
    backend_->kick();
    return id;
}

bool Engine::pop_pending(ReadRequest& out) {
    if (!urgent_.empty()) {
        out = urgent_.front();
        urgent_.pop_front();
        return true;
    }
    if (!pending_.empty()) {
        out = pending_.front();
        pending_.pop_front();
        return true;
    }
    return false;
}

void Engine::complete(const ReadRequest& r, int err, const std::string& msg) {
    {
        std::lock_guard<std::mutex> lk(mu);
        auto it = table_.find(r.id);
        if (it != table_.end()) {
            it->second.done = true;
            it->second.err = err;
            it->second.message = msg;
            it->second.service_ns = now_ns() - r.submit_ns;
        }
        --outstanding_;
        if (!err) {
            bytes_read_ += r.length;
            ++num_reads_;
        }
    }
    done_cv_.notify_all();
}

double Engine::wait(uint64_t id) {
    Completion c;
    {
        std::unique_lock<std::mutex> lk(mu);
        auto it = table_.find(id);
        if (it == table_.end()) throw IoError(EINVAL, -1, "unknown or already-waited request id " + std::to_string(id));
        done_cv_.wait(lk, [&] { return table_[id].done; });
        c = table_[id];
        table_.erase(id);
    }
    if (c.err) throw IoError(c.err, c.tag, c.message);
    return static_cast<double>(c.service_ns) * 1e-9;
}

bool Engine::is_done(uint64_t id) {
    std::lock_guard<std::mutex> lk(mu);
    auto it = table_.find(id);
    return it == table_.end() || it->second.done;
}

void Engine::drain() {
    std::unique_lock<std::mutex> lk(mu);
    done_cv_.wait(lk, [&] { return outstanding_ == 0; });
}

// ---- pread backend --------------------------------------------------------------------------

namespace {

// Reads the whole request or reports why not; short reads are continued from where they stopped.
void pread_request(int fd, const ReadRequest& r, int& err, std::string& msg) {
    uint64_t done = 0;
    err = 0;
    while (done < r.length) {
        ssize_t n = ::pread(fd, r.dest + done, r.length - done, static_cast<off_t>(r.file_offset + done));
        if (n < 0) {
            if (errno == EINTR || errno == EAGAIN) continue;
            err = errno;
            msg = "read failed (tag " + std::to_string(r.tag) + ", offset " + std::to_string(r.file_offset) +
                  "): " + errno_text(err);
            return;
        }
        if (n == 0 || (static_cast<uint64_t>(n) < r.length - done && (done + n) % kAlignment)) {
            err = ENODATA;
            msg = "short read at end of file (tag " + std::to_string(r.tag) + "): got " +
                  std::to_string(done + (n > 0 ? n : 0)) + " of " + std::to_string(r.length) + " bytes at offset " +
                  std::to_string(r.file_offset) + "; the file is shorter than expected (truncated?)";
            return;
        }
        done += static_cast<uint64_t>(n);
    }
}

class PreadBackend : public Backend {
   public:
    PreadBackend(Engine& e, int fd, unsigned n) : e_(e), fd_(fd) {
        for (unsigned i = 0; i < n; ++i) threads_.emplace_back([this] { run(); });
    }
    ~PreadBackend() override { shutdown(); }
    void kick() override { e_.work_cv.notify_one(); }
    void shutdown() override {
        for (auto& t : threads_)
            if (t.joinable()) t.join();
        threads_.clear();
    }

   private:
    void run() {
        for (;;) {
            ReadRequest r;
            {
                std::unique_lock<std::mutex> lk(e_.mu);
                e_.work_cv.wait(lk, [&] { return e_.stopping || e_.pop_pending(r); });
                if (r.id == 0) return;  // stopping, nothing popped
            }
            int err;
            std::string msg;
            pread_request(fd_, r, err, msg);
            e_.complete(r, err, msg);
        }
    }
    Engine& e_;
    int fd_;
    std::vector<std::thread> threads_;
};

}  // namespace

std::unique_ptr<Backend> make_pread_backend(Engine& e, int fd, unsigned num_threads) {
    return std::unique_ptr<Backend>(new PreadBackend(e, fd, num_threads ? num_threads : 1));
}

// ---- aligned buffers ------------------------------------------------------------------------

AlignedBuffer::AlignedBuffer(uint64_t nbytes, uint64_t alignment) : size_(nbytes), alignment_(alignment) {
    if (alignment == 0 || (alignment & (alignment - 1)))
        throw IoError(EINVAL, -1, "alignment must be a power of two, got " + std::to_string(alignment));
    // Round the allocation up so a whole number of aligned blocks can always be read into it.
    // A buffer of at least one huge page (expert caches, a resident layer's records) is huge-page
    // aligned and asks for transparent huge pages before it is first touched: where THP is
    // "madvise" (common), expert products then miss the TLB far less (cached decode +4-5%).
    const uint64_t block = nbytes >= kHugePage ? std::max<uint64_t>(alignment, kHugePage) : alignment;
    uint64_t alloc = ((nbytes + block - 1) / block) * block;
    if (alloc == 0) alloc = block;
    void* p = nullptr;
    int rc = posix_memalign(&p, block, alloc);
    if (rc != 0) throw IoError(rc, -1, "cannot allocate " + std::to_string(alloc) + " aligned bytes: " + errno_text(rc));
#ifdef MADV_HUGEPAGE
    if (block >= kHugePage) madvise(p, alloc, MADV_HUGEPAGE);   // (advice only: a kernel without THP ignores it)
#endif
    std::memset(p, 0, alloc);
    data_ = static_cast<char*>(p);
}

AlignedBuffer::~AlignedBuffer() { std::free(data_); }

// ---- crc32c (Castagnoli) --------------------------------------------------------------------

namespace {
struct Crc32cTable {
    uint32_t t[256];
    Crc32cTable() {
        for (uint32_t i = 0; i < 256; ++i) {
            uint32_t c = i;
            for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
            t[i] = c;
        }
    }
};

uint32_t crc32c_soft(const unsigned char* p, uint64_t n, uint32_t crc) {
    static const Crc32cTable tab;
    for (uint64_t i = 0; i < n; ++i) crc = tab.t[(crc ^ p[i]) & 0xff] ^ (crc >> 8);
    return crc;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t crc32c_hw(const unsigned char* p, uint64_t n, uint32_t crc) {
    uint64_t c = crc;
    while (n >= 8) {
        uint64_t v;
        std::memcpy(&v, p, 8);
        c = __builtin_ia32_crc32di(c, v);
        p += 8;
        n -= 8;
    }
    uint32_t c32 = static_cast<uint32_t>(c);
    while (n--) c32 = __builtin_ia32_crc32qi(c32, *p++);
    return c32;
}
#endif
}  // namespace

uint32_t crc32c(const void* data, uint64_t n, uint32_t seed) {
    auto p = static_cast<const unsigned char*>(data);
    uint32_t crc = ~seed;
#if defined(__x86_64__)
    static const bool hw = __builtin_cpu_supports("sse4.2");
    if (hw) return ~crc32c_hw(p, n, crc);
#endif
    return ~crc32c_soft(p, n, crc);
}

}  // namespace lqf
