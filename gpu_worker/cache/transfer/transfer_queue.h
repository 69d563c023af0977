// Private to the transfer engine backends (emulated_link.cc, transfer_engine_cuda.cu): the
// task queue, its order on the link, parking, Cancel/Promote, the finished-task list and the
// stats, shared so that both links schedule alike. Header-only and C++17 (nvcc includes it).
//
// Threads: Submit/Cancel/Promote/Poll/Wait/Stop from the engine thread (and stats() from any);
// TakeNext/AfterChunk/EndSegment from the link's one copy thread. One mutex guards everything.
// The copy thread holds the task it copies (the "current" task) outside the queue; Cancel and
// Promote reach it through flags read at its next chunk boundary (AfterChunk, EndSegment).
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"
#include "gpu_worker/cache/transfer/transfer_engine.h"

namespace fmoe::transfer_internal {

inline int64_t SteadyNowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Checked once by each backend's factory.
inline Status ValidateLinkOptions(const LinkOptions& options) {
  if (!(options.gbps > 0.0) || !std::isfinite(options.gbps)) {
    return InvalidArgument("link: gbps " + std::to_string(options.gbps) +
                           " is not a finite number > 0");
  }
  if (!(options.latency_us >= 0.0) || !std::isfinite(options.latency_us)) {
    return InvalidArgument("link: latency_us " + std::to_string(options.latency_us) +
                           " is not a finite number >= 0");
  }
  if (options.chunk_bytes < 4096) {
    return InvalidArgument("link: chunk_bytes " + std::to_string(options.chunk_bytes) +
                           " is below 4096");
  }
  if (options.cuda_chunk_bytes < 4096) {
    return InvalidArgument("link: cuda_chunk_bytes " + std::to_string(options.cuda_chunk_bytes) +
                           " is below 4096");
  }
  return Status::Ok();
}

// A submitted task and its progress.
struct LinkTask {
  TransferTask task;
  uint64_t seq = 0;       // Order of entry into its class (Submit, or Promote), for FIFO ties.
  size_t offset = 0;      // Bytes copied so far (a parked task resumes here).
  bool started = false;   // The first segment ran: latency charged, fence waited for.
  int64_t submit_ns = 0;  // Steady clock.
  int64_t start_ns = 0;   // First byte (start of the latency); valid when started.
};

enum class ChunkVerdict {
  kContinue,  // Copy the next chunk.
  kPark,      // A prefetch that an on-demand task now waits for: end the segment.
  kStop,      // Cancelled, or the link is shutting down: end the segment.
};

class TransferQueue {
 public:
  // ---- engine thread ----
  void Submit(const TransferTask& task) {
    LinkTask t;
    t.task = task;
    if (std::isnan(t.task.priority)) t.task.priority = -std::numeric_limits<double>::infinity();
    t.submit_ns = SteadyNowNs();
    std::lock_guard<std::mutex> lock(mu_);
    t.seq = next_seq_++;
    if (t.task.on_demand) ++queued_on_demand_;
    queue_.push_back(std::move(t));
    ++unfinished_;
    work_cv_.notify_one();
  }

  // A queued or parked task finishes at once (cancelled) and is returned so that the backend can
  // release what it holds for it; the current task is flagged and ends at its next chunk
  // boundary (nullopt); an unknown id is ignored (nullopt).
  std::optional<LinkTask> Cancel(uint64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    if (has_current_ && current_id_ == id) {
      current_cancel_ = true;
      return std::nullopt;
    }
    auto it = Find(id);
    if (it == queue_.end()) return std::nullopt;
    LinkTask t = std::move(*it);
    queue_.erase(it);
    if (t.task.on_demand) --queued_on_demand_;
    const int64_t now = SteadyNowNs();
    if (!t.started) t.start_ns = now;
    FinishLocked(t, /*cancelled=*/true, now);
    return t;
  }

  void Promote(uint64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    if (has_current_ && current_id_ == id) {
      current_on_demand_ = true;  // It goes on copying; nothing parks it any more.
      return;
    }
    auto it = Find(id);
    if (it == queue_.end() || it->task.on_demand) return;
    it->task.on_demand = true;
    it->seq = next_seq_++;  // FIFO among on-demand tasks by the time they became on-demand.
    ++queued_on_demand_;
  }

  size_t Poll(std::vector<TransferDone>* out) {
    std::lock_guard<std::mutex> lock(mu_);
    return DrainLocked(out);
  }

  size_t Wait(std::vector<TransferDone>* out, std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lock(mu_);
    done_cv_.wait_for(lock, timeout, [this] { return !done_.empty() || unfinished_ == 0; });
    return DrainLocked(out);
  }

  TransferStats stats() const {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_;
  }

  // Makes TakeNext return false and the current segment end (ChunkVerdict::kStop); tasks left
  // are dropped unreported.
  void Stop() {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    work_cv_.notify_all();
  }

  // ---- copy thread ----
  // Blocks until a task can run (it becomes the current task) or Stop() (returns false).
  bool TakeNext(LinkTask* out) {
    std::unique_lock<std::mutex> lock(mu_);
    work_cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
    if (stop_) return false;
    auto best = std::min_element(queue_.begin(), queue_.end(), RunsBefore);
    *out = std::move(*best);
    queue_.erase(best);
    if (out->task.on_demand) --queued_on_demand_;
    has_current_ = true;
    current_id_ = out->task.id;
    current_on_demand_ = out->task.on_demand;
    current_cancel_ = false;
    return true;
  }

  // Counts `bytes` of the current task as copied and says what to do at this chunk boundary.
  ChunkVerdict AfterChunk(size_t bytes) {
    std::lock_guard<std::mutex> lock(mu_);
    stats_.bytes_copied += bytes;
    if (stop_ || current_cancel_) return ChunkVerdict::kStop;
    if (!current_on_demand_ && queued_on_demand_ > 0) return ChunkVerdict::kPark;
    return ChunkVerdict::kContinue;
  }

  // Ends the current task's segment (`busy_ns` of link time): finished when all its bytes are
  // copied, cancelled when Cancel reached it, otherwise parked back in the queue with its
  // offset. Returns the task when it finished (for the backend's cleanup), nullopt when parked
  // or dropped by Stop.
  std::optional<LinkTask> EndSegment(LinkTask t, int64_t end_ns, int64_t busy_ns) {
    std::lock_guard<std::mutex> lock(mu_);
    has_current_ = false;
    stats_.busy_ns += busy_ns;
    if (stop_) return std::nullopt;
    if (current_cancel_ || t.offset >= t.task.bytes) {
      FinishLocked(t, current_cancel_, end_ns);
      return t;
    }
    t.task.on_demand = current_on_demand_;
    if (queued_on_demand_ > 0) ++stats_.preemptions;
    if (t.task.on_demand) {
      ++queued_on_demand_;
      t.seq = next_seq_++;
    }
    queue_.push_back(std::move(t));
    return std::nullopt;
  }

 private:
  // On-demand first (FIFO), then prefetches by descending priority (FIFO on ties).
  static bool RunsBefore(const LinkTask& a, const LinkTask& b) {
    if (a.task.on_demand != b.task.on_demand) return a.task.on_demand;
    if (!a.task.on_demand && a.task.priority != b.task.priority) {
      return a.task.priority > b.task.priority;
    }
    return a.seq < b.seq;
  }

  // REQUIRES: mu_ held.
  std::vector<LinkTask>::iterator Find(uint64_t id) {
    return std::find_if(queue_.begin(), queue_.end(),
                        [id](const LinkTask& t) { return t.task.id == id; });
  }

  // REQUIRES: mu_ held.
  void FinishLocked(const LinkTask& t, bool cancelled, int64_t end_ns) {
    TransferDone d;
    d.id = t.task.id;
    d.cancelled = cancelled;
    d.bytes_copied = t.offset;
    d.submit_ns = t.submit_ns;
    d.start_ns = t.start_ns;
    d.end_ns = end_ns;
    done_.push_back(d);
    --unfinished_;
    if (cancelled) {
      ++stats_.tasks_cancelled;
    } else {
      ++stats_.tasks_done;
    }
    done_cv_.notify_all();
  }

  // REQUIRES: mu_ held.
  size_t DrainLocked(std::vector<TransferDone>* out) {
    const size_t n = done_.size();
    out->insert(out->end(), done_.begin(), done_.end());
    done_.clear();
    return n;
  }

  mutable std::mutex mu_;
  std::condition_variable work_cv_;  // The copy thread waits here for a task.
  std::condition_variable done_cv_;  // Wait() waits here for a finished task.
  // Everything below: GUARDED_BY(mu_).
  std::vector<LinkTask> queue_;  // Queued and parked tasks, unordered (a few hundred at most).
  size_t queued_on_demand_ = 0;  // How many in queue_ are on-demand.
  size_t unfinished_ = 0;        // Submitted, not yet in done_ (queue_ + current).
  uint64_t next_seq_ = 0;
  bool has_current_ = false;
  uint64_t current_id_ = 0;
  bool current_on_demand_ = false;
  bool current_cancel_ = false;
  bool stop_ = false;
  std::vector<TransferDone> done_;
  TransferStats stats_;
};

}  // namespace fmoe::transfer_internal
