// The emulated host-to-device link of cpu mode (DESIGN section 2; NewEmulatedLink in
// transfer_engine.h): one thread paces the queued tasks (transfer_queue.h) at the configured
// bandwidth and latency.
// Pacing: a segment (a task's turn on the link) has absolute deadlines base + bytes / gbps, base
// = its start (+ latency_us in the task's first segment). Mid-task the thread sleeps only when
// over kRunAheadNs ahead (shorter sleeps overshoot); a segment's end waits out its last deadline
// exactly (sleep, then spin < kSpinNs), so no error accumulates and nothing spins for long.
#include <algorithm>
#include <chrono>
#include <cstring>
#include <memory>
#include <new>
#include <string>
#include <thread>
#include <utility>

#if defined(__linux__)
#include <sys/prctl.h>
#endif

#include "common/process_util.h"
#include "gpu_worker/cache/transfer/transfer_engine.h"
#include "gpu_worker/cache/transfer/transfer_queue.h"

namespace fmoe {
namespace {

using transfer_internal::ChunkVerdict;
using transfer_internal::LinkTask;
using transfer_internal::SteadyNowNs;
using transfer_internal::TransferQueue;

constexpr int64_t kSpinNs = 50'000;       // Final approach to a deadline is spun, not slept.
constexpr int64_t kRunAheadNs = 100'000;  // Mid-task, sleep only when this far ahead.
constexpr std::align_val_t kDeviceAlign{64};

// Sleeps until about kSpinNs before `deadline_ns`, then spins to it.
void WaitUntil(int64_t deadline_ns) {
  for (;;) {
    const int64_t left = deadline_ns - SteadyNowNs();
    if (left <= 0) return;
    if (left > kSpinNs) std::this_thread::sleep_for(std::chrono::nanoseconds(left - kSpinNs));
  }
}

class EmulatedLink final : public TransferEngine {
 public:
  explicit EmulatedLink(const LinkOptions& options)
      : latency_ns_(static_cast<int64_t>(options.latency_us * 1e3)),
        ns_per_byte_(1.0 / options.gbps),
        chunk_bytes_(options.chunk_bytes),
        thread_([this] { Run(); }) {}

  ~EmulatedLink() override {
    queue_.Stop();
    thread_.join();
  }

  std::string_view name() const override { return "emulated"; }
  void Submit(const TransferTask& task) override { queue_.Submit(task); }
  void Cancel(uint64_t id) override { (void)queue_.Cancel(id); }
  void Promote(uint64_t id) override { queue_.Promote(id); }
  size_t Poll(std::vector<TransferDone>* out) override { return queue_.Poll(out); }
  size_t Wait(std::vector<TransferDone>* out, std::chrono::milliseconds timeout) override {
    return queue_.Wait(out, timeout);
  }
  TransferStats stats() const override { return queue_.stats(); }

  Result<uint64_t> FreeDeviceBytes() const override { return HostAvailableBytes(); }

  Result<void*> AllocateDevice(size_t bytes) override {
    void* p = ::operator new(bytes, kDeviceAlign, std::nothrow);
    if (p == nullptr) {
      return ResourceExhausted("link: cannot allocate " + std::to_string(bytes) +
                               " bytes of emulated device memory");
    }
    return p;
  }
  void FreeDevice(void* ptr) override { ::operator delete(ptr, kDeviceAlign); }

 private:
  // The copy thread: one segment per loop.
  void Run() {
#if defined(__linux__)
    prctl(PR_SET_TIMERSLACK, 1000UL);  // Sleeps end within ~1 us, not the default 50 us.
#endif
    LinkTask t;
    while (queue_.TakeNext(&t)) {
      const int64_t segment_start = SteadyNowNs();
      int64_t base = segment_start;
      if (!t.started) {
        t.started = true;
        t.start_ns = segment_start;
        base += latency_ns_;
      }
      const auto* src = static_cast<const char*>(t.task.src);
      auto* dst = static_cast<char*>(t.task.dst);
      size_t segment_bytes = 0;
      int64_t deadline = base;
      while (t.offset < t.task.bytes) {
        const size_t n = std::min(chunk_bytes_, t.task.bytes - t.offset);
        std::memcpy(dst + t.offset, src + t.offset, n);
        t.offset += n;
        segment_bytes += n;
        deadline = base + static_cast<int64_t>(static_cast<double>(segment_bytes) * ns_per_byte_);
        if (queue_.AfterChunk(n) != ChunkVerdict::kContinue) break;
        const int64_t ahead = deadline - SteadyNowNs();
        if (ahead > kRunAheadNs)
          std::this_thread::sleep_for(std::chrono::nanoseconds(ahead - kSpinNs));
      }
      WaitUntil(deadline);  // The link is busy until the paced end of what was copied.
      const int64_t end = SteadyNowNs();
      (void)queue_.EndSegment(std::move(t), end, end - segment_start);
      t = LinkTask();
    }
  }

  const int64_t latency_ns_;
  const double ns_per_byte_;  // gbps is 1e9 bytes/s, so one byte takes 1/gbps ns.
  const size_t chunk_bytes_;
  TransferQueue queue_;
  std::thread thread_;  // Last: starts after everything it uses is constructed.
};

}  // namespace

Result<std::unique_ptr<TransferEngine>> NewEmulatedLink(const LinkOptions& options) {
  FMOE_RETURN_IF_ERROR(transfer_internal::ValidateLinkOptions(options));
  return std::unique_ptr<TransferEngine>(std::make_unique<EmulatedLink>(options));
}

}  // namespace fmoe
