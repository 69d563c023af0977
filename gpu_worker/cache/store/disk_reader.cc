// DiskReader's two backends over one scheduler (ReaderBase): reads wait in two FIFO queues
// (urgent, normal); the read being cut into chunks ("current") gives out all its chunks before
// the next read is taken, urgent queue first. A chunk is the 4096-aligned file range
// [A0 + k * chunk_bytes, ...) where A0 is the read's offset rounded down, so it never exceeds
// chunk_bytes and fits one bounce buffer. A read: QUEUED (Submit) -> CURRENT (TakeChunk gives its
// first chunk) -> ISSUED (its last chunk is out) -> DONE (FinishChunk of its last chunk, into
// done_) -> returned (Poll/Wait). A failed chunk stops the rest of its read from being issued.
// Backends: ThreadReader (queue_depth threads, each with its buffer, calling pread) and
// UringReader (one thread that submits chunks to the ring and reaps them; Submit wakes it through
// an eventfd polled in the same ring).
// Lock: one mutex (mu_) guards the queues, the done list, the statistics and files_.
#include "gpu_worker/cache/store/disk_reader.h"

#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <iterator>
#include <list>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#if defined(FMOE_HAVE_LIBURING)
#include <liburing.h>
#endif

#include <spdlog/spdlog.h>

#include "common/clock.h"

namespace fmoe {
namespace {

constexpr uint64_t kAlign = 4096;
constexpr uint32_t kMaxQueueDepth = 256;
constexpr size_t kMaxChunkBytes = size_t{64} << 20;

int64_t NowNs() { return SteadyClock::Get().NowNs(); }
uint64_t AlignDown(uint64_t v) { return v & ~(kAlign - 1); }
uint64_t AlignUp(uint64_t v) { return AlignDown(v + kAlign - 1); }

// "PATH: bytes [A, B)".
std::string RangeText(const std::string& path, uint64_t begin, uint64_t end) {
  return path + ": bytes [" + std::to_string(begin) + ", " + std::to_string(end) + ")";
}

struct FreeDeleter {
  void operator()(uint8_t* p) const { std::free(p); }
};
using AlignedBuffer = std::unique_ptr<uint8_t, FreeDeleter>;

// One file added by AddFile. Read with direct_fd while `direct`, else with buffered_fd, which is
// opened (once, under mu) when the file system refuses O_DIRECT; both stay open until the end.
struct DiskFile {
  std::string path;
  int direct_fd = -1;
  int buffered_fd = -1;
  std::atomic<bool> direct{false};
  std::mutex mu;  // Guards the switch to buffered reads.

  ~DiskFile() {
    if (direct_fd >= 0) ::close(direct_fd);
    if (buffered_fd >= 0) ::close(buffered_fd);
  }

  // From a reading thread, after a direct read failed with EINVAL. kIoError when the file
  // cannot be opened again.
  Status SwitchToBuffered() {
    std::lock_guard<std::mutex> lock(mu);
    if (!direct.load(std::memory_order_acquire)) return Status::Ok();
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return IoError(path + ": open: " + std::strerror(errno));
    buffered_fd = fd;
    direct.store(false, std::memory_order_release);
    spdlog::info(
        "disk reader: {}: O_DIRECT reads are refused (EINVAL); reading it through the "
        "page cache",
        path);
    return Status::Ok();
  }
};

struct Read {
  uint64_t id = 0;
  DiskFile* file = nullptr;
  uint64_t offset = 0;  // The caller's range [offset, end) and its destination.
  uint64_t end = 0;
  uint8_t* dst = nullptr;
  uint64_t next = 0;  // Aligned file offset of the next chunk to issue; none at or past `stop`.
  uint64_t stop = 0;
  uint32_t inflight = 0;  // Chunks issued and not finished.
  Status status;          // The first failure.
  int64_t submit_ns = 0;
  int64_t start_ns = 0;
  std::function<void()> then;  // Run on the finishing thread before the read comes back.
  std::list<Read>::iterator self;
};

// One chunk read: file bytes [pos, pos + len) into buf, of which [pos, pos + need) are wanted
// (the rest pads to 4096 past the caller's end).
struct Chunk {
  Read* read = nullptr;
  uint64_t pos = 0;
  size_t len = 0;
  size_t need = 0;
  size_t done = 0;  // Bytes read so far.
  bool direct = false;
  uint8_t* buf = nullptr;

  int fd() const { return direct ? read->file->direct_fd : read->file->buffered_fd; }
};

enum class Step { kFinished, kAgain };

// Applies one result of read(2) semantics (bytes, or -errno) to `c`: kAgain when the rest must be
// read (from c->done, with c->fd()), else kFinished with `*status` set. `op` names the call in
// messages ("pread", "io_uring read").
Step Advance(Chunk* c, int64_t result, const char* op, Status* status) {
  const Read& r = *c->read;
  if (result < 0) {
    const int err = static_cast<int>(-result);
    if (err == EINTR || err == EAGAIN) return Step::kAgain;
    if (err == EINVAL && c->direct) {
      *status = r.file->SwitchToBuffered();
      if (!status->ok()) return Step::kFinished;
      c->direct = false;
      return Step::kAgain;
    }
    *status =
        IoError(RangeText(r.file->path, r.offset, r.end) + ": " + op + ": " + std::strerror(err));
    return Step::kFinished;
  }
  c->done += static_cast<size_t>(result);
  if (c->done >= c->need) {
    *status = Status::Ok();
    return Step::kFinished;
  }
  // A direct read stops short only at the end of the file (then at an unaligned position, which
  // cannot be read again directly); a buffered one may stop anywhere, and reads 0 at the end.
  const uint64_t at = c->pos + c->done;
  if (result == 0 || (c->direct && at % kAlign != 0)) {
    // The file's size now, where it is below `at` (a read starting past the end stops where it
    // started).
    struct stat st {};
    const uint64_t file_end =
        ::fstat(c->fd(), &st) == 0 ? std::min(static_cast<uint64_t>(st.st_size), at) : at;
    *status = DataLoss(RangeText(r.file->path, r.offset, r.end) + ": the file ends at " +
                       std::to_string(file_end));
    return Step::kFinished;
  }
  return Step::kAgain;
}

// Copies the wanted part of a finished chunk out to the caller's destination.
void CopyOut(const Chunk& c) {
  const Read& r = *c.read;
  const uint64_t lo = std::max<uint64_t>(r.offset, c.pos);
  const uint64_t hi = c.pos + c.need;
  std::memcpy(r.dst + (lo - r.offset), c.buf + (lo - c.pos), hi - lo);
}

class ReaderBase : public DiskReader {
 public:
  explicit ReaderBase(const DiskReaderOptions& options) : options_(options) {}

  // After the backend's destructor stopped its threads: the finishing thread runs what is left
  // and stops.
  ~ReaderBase() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      finish_stopping_ = true;
    }
    finish_cv_.notify_all();
    if (finisher_.joinable()) finisher_.join();
  }

  using DiskReader::Submit;

  Result<uint32_t> AddFile(const std::string& path) override {
    auto file = std::make_unique<DiskFile>();
    file->path = path;
    if (options_.direct) {
      const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_DIRECT);
      if (fd >= 0) {
        file->direct_fd = fd;
        file->direct = true;
      } else if (errno == EINVAL) {
        spdlog::info(
            "disk reader: {}: the file system refuses O_DIRECT; reading it through the "
            "page cache",
            path);
      } else {
        return OpenError(path, errno);
      }
    }
    if (!file->direct) {
      const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0) return OpenError(path, errno);
      file->buffered_fd = fd;
    }
    std::lock_guard<std::mutex> lock(mu_);
    files_.push_back(std::move(file));
    return static_cast<uint32_t>(files_.size() - 1);
  }

  bool direct(uint32_t file) const override {
    std::lock_guard<std::mutex> lock(mu_);
    return file < files_.size() && files_[file]->direct.load(std::memory_order_acquire);
  }

  void Submit(uint64_t id, uint32_t file, uint64_t offset, size_t bytes, void* dst, bool urgent,
              std::function<void()> then) override {
    ++pending_;
    {
      std::lock_guard<std::mutex> lock(mu_);
      // Under mu_, as TakeChunk's start_ns: a read that starts after this one's submit_ns was
      // chosen with this one queued.
      const int64_t now = NowNs();
      const std::string what = "disk reader: read " + std::to_string(id) + ": ";
      Status invalid;
      if (file >= files_.size()) {
        invalid = InvalidArgument(what + "file index " + std::to_string(file) +
                                  " is out of range (" + std::to_string(files_.size()) + " files)");
      } else if (bytes == 0) {
        invalid = InvalidArgument(what + "zero length");
      } else if (dst == nullptr) {
        invalid = InvalidArgument(what + "null destination");
      } else if (bytes > UINT64_MAX - kAlign || offset > UINT64_MAX - kAlign - bytes) {
        invalid = InvalidArgument(what + "offset " + std::to_string(offset) + " + " +
                                  std::to_string(bytes) + " bytes overflows");
      }
      if (!invalid.ok()) {
        done_.push_back(ReadDone{id, std::move(invalid), now, now, now});
        ++stats_.reads;
        ++stats_.failed;
        return;
      }
      reads_.emplace_back();
      Read& r = reads_.back();
      r.self = std::prev(reads_.end());
      r.id = id;
      r.file = files_[file].get();
      r.offset = offset;
      r.end = offset + bytes;
      r.dst = static_cast<uint8_t*>(dst);
      r.next = AlignDown(offset);
      r.stop = AlignUp(r.end);
      r.submit_ns = now;
      r.then = std::move(then);
      if (r.then && !finisher_.joinable()) finisher_ = std::thread([this] { FinishLoop(); });
      (urgent ? urgent_ : normal_).push_back(&r);
    }
    WakeIo();
  }

  size_t Poll(std::vector<ReadDone>* out) override {
    std::lock_guard<std::mutex> lock(mu_);
    return TakeDone(out);
  }

  size_t Wait(std::vector<ReadDone>* out, std::chrono::milliseconds timeout) override {
    std::unique_lock<std::mutex> lock(mu_);
    if (pending_ == 0) return 0;
    done_cv_.wait_for(lock, timeout, [&] { return !done_.empty(); });
    return TakeDone(out);
  }

  size_t pending() const override { return pending_; }

  DiskReaderStats stats() const override {
    std::lock_guard<std::mutex> lock(mu_);
    DiskReaderStats s = stats_;
    if (inflight_ > 0) s.busy_ns += NowNs() - busy_since_ns_;
    return s;
  }

 protected:
  // Tells the backend that reads were queued. Called without mu_.
  virtual void WakeIo() = 0;

  static Status OpenError(const std::string& path, int err) {
    std::string message = "disk reader: " + path + ": open: " + std::strerror(err);
    return err == ENOENT ? NotFound(std::move(message)) : IoError(std::move(message));
  }

  // REQUIRES: mu_ held. Whether TakeChunk has a chunk to give.
  bool HasWork() const {
    return (current_ != nullptr && current_->next < current_->stop) || !urgent_.empty() ||
           !normal_.empty();
  }

  // REQUIRES: mu_ held, HasWork(). Fills `c` with the next chunk (into `buf`) and counts it in
  // flight.
  void TakeChunk(Chunk* c, uint8_t* buf) {
    const int64_t now = NowNs();
    if (current_ == nullptr || current_->next >= current_->stop) {
      std::deque<Read*>& queue = urgent_.empty() ? normal_ : urgent_;
      current_ = queue.front();
      queue.pop_front();
      current_->start_ns = now;
    }
    Read* r = current_;
    c->read = r;
    c->pos = r->next;
    c->len = std::min<uint64_t>(r->stop - r->next, options_.chunk_bytes);
    c->need = std::min<uint64_t>(r->end, c->pos + c->len) - c->pos;
    c->done = 0;
    c->direct = r->file->direct.load(std::memory_order_acquire);
    c->buf = buf;
    r->next += c->len;
    ++r->inflight;
    if (inflight_++ == 0) busy_since_ns_ = now;
    ++stats_.chunks;
  }

  // REQUIRES: mu_ held. Ends a chunk taken by TakeChunk (its bytes copied out when `status` is
  // ok), and its read when that was the read's last chunk.
  void FinishChunk(const Chunk& c, Status status) {
    const int64_t now = NowNs();
    if (--inflight_ == 0) stats_.busy_ns += now - busy_since_ns_;
    Read* r = c.read;
    --r->inflight;
    if (!status.ok() && r->status.ok()) {
      r->status = std::move(status);
      r->next = r->stop;  // Issue none of its other chunks.
    }
    if (r->next < r->stop || r->inflight > 0) return;
    if (current_ == r) current_ = nullptr;
    ++stats_.reads;
    if (r->status.ok()) {
      stats_.bytes_read += r->end - r->offset;
    } else {
      ++stats_.failed;
    }
    ReadDone done{r->id, std::move(r->status), r->submit_ns, r->start_ns, now};
    if (done.status.ok() && r->then) {
      finishing_.push_back(Finishing{std::move(done), std::move(r->then)});
      reads_.erase(r->self);
      finish_cv_.notify_one();
      return;
    }
    done_.push_back(std::move(done));
    reads_.erase(r->self);
    done_cv_.notify_all();
  }

  // REQUIRES: mu_ held.
  size_t TakeDone(std::vector<ReadDone>* out) {
    const size_t n = done_.size();
    for (ReadDone& d : done_) out->push_back(std::move(d));
    done_.clear();
    pending_ -= n;
    return n;
  }

  const DiskReaderOptions options_;
  mutable std::mutex mu_;
  std::condition_variable done_cv_;  // A read came into done_.

 private:
  // A read whose bytes are in and whose `then` has yet to run.
  struct Finishing {
    ReadDone done;
    std::function<void()> then;
  };

  // The finishing thread: runs each read's `then` outside mu_, then gives the read back.
  void FinishLoop() {
    pthread_setname_np(pthread_self(), "fmoe-disk-fin");
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      finish_cv_.wait(lock, [&] { return finish_stopping_ || !finishing_.empty(); });
      if (finishing_.empty()) return;
      Finishing f = std::move(finishing_.front());
      finishing_.pop_front();
      lock.unlock();
      f.then();
      lock.lock();
      f.done.end_ns = NowNs();
      done_.push_back(std::move(f.done));
      done_cv_.notify_all();
    }
  }

  size_t pending_ = 0;  // The owner's: submitted and not returned.

  std::vector<std::unique_ptr<DiskFile>> files_;  // GUARDED_BY(mu_)
  std::list<Read> reads_;                         // GUARDED_BY(mu_): unfinished reads.
  std::deque<Read*> urgent_;                      // GUARDED_BY(mu_)
  std::deque<Read*> normal_;                      // GUARDED_BY(mu_)
  Read* current_ = nullptr;                       // GUARDED_BY(mu_)
  std::vector<ReadDone> done_;                    // GUARDED_BY(mu_)
  DiskReaderStats stats_;                         // GUARDED_BY(mu_)
  uint32_t inflight_ = 0;                         // GUARDED_BY(mu_): chunks in flight.
  int64_t busy_since_ns_ = 0;                     // GUARDED_BY(mu_)
  std::deque<Finishing> finishing_;               // GUARDED_BY(mu_)
  bool finish_stopping_ = false;                  // GUARDED_BY(mu_)
  std::condition_variable finish_cv_;             // finishing_ grew, or finish_stopping_.
  std::thread finisher_;  // Started (under mu_) by the first Submit with a `then`.
};

Result<std::vector<AlignedBuffer>> AllocateBuffers(uint32_t count, size_t bytes) {
  std::vector<AlignedBuffer> buffers;
  for (uint32_t i = 0; i < count; ++i) {
    auto* p = static_cast<uint8_t*>(std::aligned_alloc(kAlign, bytes));
    if (p == nullptr) {
      return ResourceExhausted("disk reader: cannot allocate " + std::to_string(count) + " x " +
                               std::to_string(bytes) + " bytes of read buffers");
    }
    buffers.emplace_back(p);
  }
  return buffers;
}

// queue_depth threads, each reading one chunk at a time with pread into its own buffer.
class ThreadReader final : public ReaderBase {
 public:
  ThreadReader(const DiskReaderOptions& options, std::vector<AlignedBuffer> buffers)
      : ReaderBase(options), buffers_(std::move(buffers)) {
    for (size_t i = 0; i < buffers_.size(); ++i) {
      threads_.emplace_back([this, i] { Loop(buffers_[i].get()); });
    }
  }

  ~ThreadReader() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    work_cv_.notify_all();
    for (std::thread& t : threads_) t.join();
  }

  std::string_view backend() const override { return "threads"; }

 private:
  void WakeIo() override { work_cv_.notify_all(); }

  void Loop(uint8_t* buf) {
    pthread_setname_np(pthread_self(), "fmoe-disk");
    Chunk c;
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      work_cv_.wait(lock, [&] { return stopping_ || HasWork(); });
      if (stopping_) return;
      TakeChunk(&c, buf);
      lock.unlock();
      Status status;
      try {
        status = ReadChunk(&c);
      } catch (const std::exception& e) {
        status = Internal(std::string("disk reader: ") + e.what());
        spdlog::error("{}", status.message());
      }
      lock.lock();
      FinishChunk(c, std::move(status));
    }
  }

  static Status ReadChunk(Chunk* c) {
    Status status;
    for (;;) {
      const ssize_t n = ::pread(c->fd(), c->buf + c->done, c->len - c->done,
                                static_cast<off_t>(c->pos + c->done));
      if (Advance(c, n < 0 ? -errno : n, "pread", &status) == Step::kFinished) break;
    }
    if (status.ok()) CopyOut(*c);
    return status;
  }

  std::vector<AlignedBuffer> buffers_;
  std::vector<std::thread> threads_;
  std::condition_variable work_cv_;  // Reads were queued, or stopping_.
  bool stopping_ = false;            // GUARDED_BY(mu_)
};

#if defined(FMOE_HAVE_LIBURING)

// One thread owns the ring: it fills free slots with chunks, submits, and reaps. Submit wakes it
// through an eventfd that the ring polls (user_data kWakeTag).
class UringReader final : public ReaderBase {
 public:
  UringReader(const DiskReaderOptions& options, std::vector<AlignedBuffer> buffers)
      : ReaderBase(options), buffers_(std::move(buffers)), slots_(buffers_.size()) {
    for (size_t i = 0; i < slots_.size(); ++i) {
      slots_[i].buf = buffers_[i].get();
      free_slots_.push_back(static_cast<uint32_t>(slots_.size() - 1 - i));
    }
  }

  ~UringReader() override {
    if (thread_.joinable()) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        stopping_ = true;
      }
      WakeIo();
      thread_.join();
    }
    if (ring_ready_) io_uring_queue_exit(&ring_);
    if (event_fd_ >= 0) ::close(event_fd_);
  }

  // Sets up the ring and starts the thread. kFailedPrecondition when the kernel refuses.
  Status Start() {
    event_fd_ = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (event_fd_ < 0) {
      return FailedPrecondition(std::string("disk reader: eventfd: ") + std::strerror(errno));
    }
    const int err = io_uring_queue_init(static_cast<unsigned>(slots_.size() + 1), &ring_, 0);
    if (err < 0) {
      return FailedPrecondition(std::string("disk reader: io_uring_queue_init: ") +
                                std::strerror(-err));
    }
    ring_ready_ = true;
    thread_ = std::thread([this] { Loop(); });
    return Status::Ok();
  }

  std::string_view backend() const override { return "io_uring"; }

 private:
  static constexpr uint64_t kWakeTag = UINT64_MAX;

  void WakeIo() override {
    const uint64_t one = 1;
    (void)!::write(event_fd_, &one, sizeof(one));
  }

  io_uring_sqe* GetSqe() {
    io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
    while (sqe == nullptr) {  // Not expected (see Prepare): make room by submitting.
      (void)io_uring_submit(&ring_);
      sqe = io_uring_get_sqe(&ring_);
    }
    return sqe;
  }

  // Queues a read of the rest of slot `i`'s chunk. The ring has room: at most one entry per slot
  // plus the eventfd poll are outstanding, and the ring has that many.
  void Prepare(uint32_t i) {
    Chunk& c = slots_[i];
    io_uring_sqe* sqe = GetSqe();
    io_uring_prep_read(sqe, c.fd(), c.buf + c.done, static_cast<unsigned>(c.len - c.done),
                       c.pos + c.done);
    io_uring_sqe_set_data64(sqe, i);
  }

  void Loop() {
    pthread_setname_np(pthread_self(), "fmoe-disk-uring");
    bool poll_armed = false;
    size_t inflight = 0;  // Slots in the ring.
    for (;;) {
      bool stop = false;
      {
        std::lock_guard<std::mutex> lock(mu_);
        stop = stopping_;
        while (!stop && !free_slots_.empty() && HasWork()) {
          const uint32_t i = free_slots_.back();
          free_slots_.pop_back();
          TakeChunk(&slots_[i], slots_[i].buf);
          Prepare(i);
          ++inflight;
        }
      }
      if (stop && inflight == 0) return;
      if (!poll_armed) {
        io_uring_sqe* sqe = GetSqe();
        io_uring_prep_poll_add(sqe, event_fd_, POLLIN);
        io_uring_sqe_set_data64(sqe, kWakeTag);
        poll_armed = true;
      }
      const int submitted = io_uring_submit_and_wait(&ring_, 1);
      if (submitted < 0 && submitted != -EINTR && submitted != -EAGAIN && submitted != -EBUSY) {
        spdlog::error("disk reader: io_uring_submit_and_wait: {}", std::strerror(-submitted));
      }
      unsigned head = 0;
      unsigned seen = 0;
      io_uring_cqe* cqe = nullptr;
      io_uring_for_each_cqe(&ring_, head, cqe) {
        ++seen;
        const uint64_t tag = io_uring_cqe_get_data64(cqe);
        if (tag == kWakeTag) {
          uint64_t count = 0;
          (void)!::read(event_fd_, &count, sizeof(count));
          poll_armed = false;
          continue;
        }
        const auto i = static_cast<uint32_t>(tag);
        Chunk& c = slots_[i];
        Status status;
        if (Advance(&c, cqe->res, "io_uring read", &status) == Step::kAgain) {
          Prepare(i);
          continue;
        }
        if (status.ok()) CopyOut(c);
        --inflight;
        std::lock_guard<std::mutex> lock(mu_);
        FinishChunk(c, std::move(status));
        free_slots_.push_back(i);
      }
      io_uring_cq_advance(&ring_, seen);
    }
  }

  std::vector<AlignedBuffer> buffers_;
  std::vector<Chunk> slots_;  // The ring thread's; slot i reads into buffers_[i].
  std::vector<uint32_t> free_slots_;
  io_uring ring_{};
  bool ring_ready_ = false;
  int event_fd_ = -1;
  std::thread thread_;
  bool stopping_ = false;  // GUARDED_BY(mu_)
};

#endif  // FMOE_HAVE_LIBURING

Status Validate(const DiskReaderOptions& o) {
  if (o.queue_depth < 1 || o.queue_depth > kMaxQueueDepth) {
    return InvalidArgument("disk reader: queue_depth " + std::to_string(o.queue_depth) +
                           " is not in 1..256");
  }
  if (o.chunk_bytes < kAlign || o.chunk_bytes > kMaxChunkBytes || o.chunk_bytes % kAlign != 0) {
    return InvalidArgument("disk reader: chunk_bytes " + std::to_string(o.chunk_bytes) +
                           " is not a multiple of 4096 in 4096..64 MiB");
  }
  if (o.backend != "auto" && o.backend != "io_uring" && o.backend != "threads") {
    return InvalidArgument("disk reader: backend \"" + o.backend +
                           "\" is not auto, io_uring or threads");
  }
  return Status::Ok();
}

}  // namespace

Result<std::unique_ptr<DiskReader>> DiskReader::Create(const DiskReaderOptions& options) {
  FMOE_RETURN_IF_ERROR(Validate(options));
  FMOE_ASSIGN_OR_RETURN(std::vector<AlignedBuffer> buffers,
                        AllocateBuffers(options.queue_depth, options.chunk_bytes));
  std::unique_ptr<DiskReader> reader;
  if (options.backend != "threads") {
#if defined(FMOE_HAVE_LIBURING)
    auto uring = std::make_unique<UringReader>(options, std::move(buffers));
    const Status started = uring->Start();
    if (started.ok()) {
      reader = std::move(uring);
    } else if (options.backend == "io_uring") {
      return started;
    } else {
      spdlog::info("{}; the disk reader uses pread threads", started.message());
      FMOE_ASSIGN_OR_RETURN(buffers, AllocateBuffers(options.queue_depth, options.chunk_bytes));
    }
#else
    if (options.backend == "io_uring") {
      return FailedPrecondition(
          "disk reader: backend \"io_uring\": this build has no liburing (use auto or threads)");
    }
#endif
  }
  if (reader == nullptr) reader = std::make_unique<ThreadReader>(options, std::move(buffers));
  spdlog::info("disk reader: backend={} queue_depth={} chunk_bytes={} direct={}", reader->backend(),
               options.queue_depth, options.chunk_bytes, options.direct);
  return reader;
}

}  // namespace fmoe
