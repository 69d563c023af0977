// A TransferEngine in simulated time, for the policy replay (DESIGN section 11): every task
// occupies the one link for a set time (one expert's load), in the order the real engines use
// (on-demand first, FIFO among them; then prefetches by priority, FIFO on ties; an on-demand
// task parks a prefetch being copied, which keeps its progress). Nothing is copied. Time is a
// ManualClock the replay advances for compute; Wait advances it to the next completion, which
// is how the expert cache's stalls come out in simulated time. One thread.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "common/clock.h"
#include "gpu_worker/cache/transfer/transfer_engine.h"

namespace fmoe::bench {

class SimLink final : public TransferEngine {
 public:
  // `task_ns`: link time of one task (> 0).
  SimLink(ManualClock& clock, int64_t task_ns) : clock_(clock), task_ns_(task_ns) {}
  ~SimLink() override;

  std::string_view name() const override { return "simulated"; }
  void Submit(const TransferTask& task) override;
  void Cancel(uint64_t id) override;
  void Promote(uint64_t id) override;
  size_t Poll(std::vector<TransferDone>* out) override;
  size_t Wait(std::vector<TransferDone>* out, std::chrono::milliseconds timeout) override;
  TransferStats stats() const override { return stats_; }
  Result<void*> AllocateDevice(size_t bytes) override;
  void FreeDevice(void* ptr) override;

  // Tasks submitted and not finished.
  size_t pending() const { return queue_.size() + (current_ ? 1 : 0); }
  // Link time the task copying from `src` still needs at the clock's time; -1 when no such task
  // is on the link (one that finished by now included: poll first). The replay's CPU path asks
  // it of a missing expert's host copy.
  int64_t RemainingNs(const void* src);
  // When the task now on the link finishes if nothing overtakes it; -1 when the link is idle.
  // Meaningful once the link has been run up to the clock (Poll); the disk tier (sim_tier.h)
  // orders its own events with the link's by it.
  int64_t NextEndNs() const { return current_ ? current_since_ + current_->remaining_ns : -1; }

 private:
  struct Task {
    TransferTask task;
    int64_t remaining_ns = 0;
    int64_t submit_ns = 0;
    int64_t start_ns = -1;
    uint64_t seq = 0;  // Order of arrival (or of promotion, for on-demand tasks).
  };
  // Runs the link up to `now`: finishes the tasks that end by then, in order.
  void AdvanceTo(int64_t now);
  void StartNext(int64_t at);
  void Park(int64_t now);
  void Finish(Task& t, int64_t at, bool cancelled);

  ManualClock& clock_;
  int64_t task_ns_;
  std::vector<Task> queue_;
  std::optional<Task> current_;
  int64_t current_since_ = 0;  // When the current task (re)started copying.
  uint64_t next_seq_ = 0;
  std::vector<TransferDone> done_;
  TransferStats stats_;
};

}  // namespace fmoe::bench
