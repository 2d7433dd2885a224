// io_uring backend. Submission happens on the caller's thread (under sq_mu_) so a demand read
// reaches the kernel without a thread hop; one reaper thread waits for completions, resubmits
// the remainder of short reads, and tops the ring up from the engine's pending queue.
#include "io_engine.h"

#include <atomic>
#include <cerrno>
#include <cstring>
#include <fstream>

#ifdef LQF_HAVE_URING
#include <liburing.h>
#endif

namespace lqf {

static std::atomic<bool> g_force_uring_failure{false};
void force_uring_failure(bool on) { g_force_uring_failure = on; }

#ifndef LQF_HAVE_URING

bool uring_compiled() { return false; }
std::unique_ptr<Backend> make_uring_backend(Engine&, int, unsigned, std::string& why) {
    why = "this build has no liburing (install liburing-dev and rebuild)";
    return nullptr;
}

#else

bool uring_compiled() { return true; }

namespace {

std::string disabled_sysctl() {
    std::ifstream f("/proc/sys/kernel/io_uring_disabled");
    std::string v;
    if (f >> v) return v;
    return "";
}

class UringBackend : public Backend {
   public:
    UringBackend(Engine& e, int fd, unsigned depth) : e_(e), fd_(fd), depth_(depth) {}

    // Returns an empty string on success, otherwise why the ring could not be set up.
    std::string init() {
        unsigned entries = 1;
        while (entries < depth_) entries <<= 1;
        int rc = io_uring_queue_init(entries, &ring_, 0);
        if (rc < 0) {
            std::string why = std::string("io_uring_queue_init: ") + std::strerror(-rc);
            if (rc == -EPERM || rc == -ENOSYS) {
                std::string s = disabled_sysctl();
                why += (s.empty() || s == "0")
                           ? " (blocked by a seccomp profile, e.g. Docker's default, or the kernel lacks io_uring)"
                           : " (kernel.io_uring_disabled=" + s + ")";
            }
            return why;
        }
        ring_ok_ = true;
        // A registered file saves an fget/fput per request; not fatal if the kernel refuses.
        fixed_file_ = io_uring_register_files(&ring_, &fd_, 1) == 0;
        reaper_ = std::thread([this] { reap(); });
        return "";
    }

    ~UringBackend() override {
        shutdown();
        if (ring_ok_) io_uring_queue_exit(&ring_);
    }

    void kick() override {
        std::lock_guard<std::mutex> lk(sq_mu_);
        fill();
    }

    void shutdown() override {
        if (!reaper_.joinable()) return;
        {
            std::lock_guard<std::mutex> lk(sq_mu_);
            stop_ = true;
            io_uring_sqe* sqe = get_sqe();
            io_uring_prep_nop(sqe);
            io_uring_sqe_set_data(sqe, nullptr);  // null user data = wake-up to stop
            io_uring_submit(&ring_);
        }
        reaper_.join();
    }

   private:
    io_uring_sqe* get_sqe() {
        io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
        while (!sqe) {  // ring full of unsubmitted entries: push them to the kernel first
            io_uring_submit(&ring_);
            sqe = io_uring_get_sqe(&ring_);
        }
        return sqe;
    }

    // sq_mu_ held.
    void prep(ReadRequest* r) {
        io_uring_sqe* sqe = get_sqe();
        uint64_t off = r->file_offset + r->done_bytes;
        unsigned len = static_cast<unsigned>(r->length - r->done_bytes);
        if (fixed_file_) {
            io_uring_prep_read(sqe, 0, r->dest + r->done_bytes, len, off);
            sqe->flags |= IOSQE_FIXED_FILE;
        } else {
            io_uring_prep_read(sqe, fd_, r->dest + r->done_bytes, len, off);
        }
        io_uring_sqe_set_data(sqe, r);
        ++inflight_;
    }

    // sq_mu_ held. Moves pending requests into the ring up to the queue depth.
    void fill() {
        bool any = false;
        while (inflight_ < depth_) {
            ReadRequest r;
            {
                std::lock_guard<std::mutex> lk(e_.mu);
                if (!e_.pop_pending(r)) break;
            }
            if (r.length > (1ull << 31)) {
                e_.complete(r, EINVAL, "read of " + std::to_string(r.length) + " bytes exceeds io_uring's 2 GiB per-request limit (tag " + std::to_string(r.tag) + ")");
                continue;
            }
            prep(new ReadRequest(r));
            any = true;
        }
        if (any) io_uring_submit(&ring_);
    }

    void reap() {
        for (;;) {
            io_uring_cqe* cqe = nullptr;
            int rc = io_uring_wait_cqe(&ring_, &cqe);
            if (rc == -EINTR || rc == -EAGAIN) continue;
            if (rc < 0) {
                // Should not happen with a valid ring; fail everything loudly rather than hang.
                fail_all(-rc);
                return;
            }
            auto* r = static_cast<ReadRequest*>(io_uring_cqe_get_data(cqe));
            int res = cqe->res;
            io_uring_cqe_seen(&ring_, cqe);
            std::lock_guard<std::mutex> lk(sq_mu_);
            if (!r) {
                if (stop_) return;
                continue;
            }
            --inflight_;
            handle(r, res);
            fill();
        }
    }

    // sq_mu_ held.
    void handle(ReadRequest* r, int res) {
        if (res == -EAGAIN || res == -EINTR) {
            prep(r);
            io_uring_submit(&ring_);
            return;
        }
        if (res < 0) {
            e_.complete(*r, -res,
                        "read failed (tag " + std::to_string(r->tag) + ", offset " + std::to_string(r->file_offset) +
                            "): " + std::strerror(-res));
            delete r;
            return;
        }
        uint64_t remaining = r->length - r->done_bytes;
        if (res == 0 || (static_cast<uint64_t>(res) < remaining && (r->done_bytes + res) % kAlignment)) {
            e_.complete(*r, ENODATA,
                        "short read at end of file (tag " + std::to_string(r->tag) + "): got " +
                            std::to_string(r->done_bytes + res) + " of " + std::to_string(r->length) +
                            " bytes at offset " + std::to_string(r->file_offset) +
                            "; the file is shorter than expected (truncated?)");
            delete r;
            return;
        }
        r->done_bytes += static_cast<uint64_t>(res);
        if (r->done_bytes < r->length) {  // short read: ask for the rest
            prep(r);
            io_uring_submit(&ring_);
            return;
        }
        e_.complete(*r, 0, "");
        delete r;
    }

    void fail_all(int err) {
        std::lock_guard<std::mutex> lk(sq_mu_);
        ReadRequest r;
        for (;;) {
            {
                std::lock_guard<std::mutex> lk2(e_.mu);
                if (!e_.pop_pending(r)) break;
            }
            e_.complete(r, err, std::string("io_uring completion wait failed: ") + std::strerror(err));
        }
    }

    Engine& e_;
    int fd_;
    unsigned depth_;
    io_uring ring_{};
    bool ring_ok_ = false;
    bool fixed_file_ = false;
    bool stop_ = false;
    unsigned inflight_ = 0;
    std::mutex sq_mu_;
    std::thread reaper_;
};

}  // namespace

std::unique_ptr<Backend> make_uring_backend(Engine& e, int fd, unsigned queue_depth, std::string& why) {
    if (g_force_uring_failure) {
        why = "io_uring setup forced to fail (test switch)";
        return nullptr;
    }
    std::unique_ptr<UringBackend> b(new UringBackend(e, fd, queue_depth));
    why = b->init();
    if (!why.empty()) return nullptr;
    return std::unique_ptr<Backend>(b.release());
}

#endif

}  // namespace lqf
