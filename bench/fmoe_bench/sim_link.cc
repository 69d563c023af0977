#include "bench/fmoe_bench/sim_link.h"

#include <algorithm>
#include <cstdlib>

namespace fmoe::bench {

SimLink::~SimLink() = default;

void SimLink::AdvanceTo(int64_t now) {
  while (current_ && current_since_ + current_->remaining_ns <= now) {
    const int64_t end = current_since_ + current_->remaining_ns;
    stats_.busy_ns += current_->remaining_ns;
    current_->remaining_ns = 0;
    Finish(*current_, end, /*cancelled=*/false);
    current_.reset();
    StartNext(end);
  }
}

void SimLink::StartNext(int64_t at) {
  if (current_ || queue_.empty()) return;
  // On-demand first (lowest seq), then the highest priority (lowest seq on ties).
  auto better = [](const Task& a, const Task& b) {
    if (a.task.on_demand != b.task.on_demand) return a.task.on_demand;
    if (!a.task.on_demand && a.task.priority != b.task.priority) {
      return a.task.priority > b.task.priority;
    }
    return a.seq < b.seq;
  };
  auto best = std::min_element(queue_.begin(), queue_.end(), better);
  current_ = std::move(*best);
  queue_.erase(best);
  current_since_ = at;
  if (current_->start_ns < 0) current_->start_ns = at;
}

void SimLink::Park(int64_t now) {
  const int64_t copied = now - current_since_;
  stats_.busy_ns += copied;
  current_->remaining_ns -= copied;
  ++stats_.preemptions;
  queue_.push_back(std::move(*current_));
  current_.reset();
}

void SimLink::Finish(Task& t, int64_t at, bool cancelled) {
  TransferDone d;
  d.id = t.task.id;
  d.cancelled = cancelled;
  const int64_t progress = task_ns_ - t.remaining_ns;
  d.bytes_copied =
      cancelled ? static_cast<size_t>(static_cast<double>(t.task.bytes) *
                                      static_cast<double>(progress) / static_cast<double>(task_ns_))
                : t.task.bytes;
  d.submit_ns = t.submit_ns;
  d.start_ns = t.start_ns < 0 ? at : t.start_ns;
  d.end_ns = at;
  stats_.bytes_copied += d.bytes_copied;
  ++(cancelled ? stats_.tasks_cancelled : stats_.tasks_done);
  done_.push_back(d);
}

void SimLink::Submit(const TransferTask& task) {
  const int64_t now = clock_.NowNs();
  AdvanceTo(now);
  queue_.push_back(Task{task, task_ns_, now, -1, next_seq_++});
  if (current_ && task.on_demand && !current_->task.on_demand) Park(now);
  StartNext(now);
}

void SimLink::Promote(uint64_t id) {
  const int64_t now = clock_.NowNs();
  AdvanceTo(now);
  if (current_ && current_->task.id == id) {
    current_->task.on_demand = true;
    return;
  }
  auto it =
      std::find_if(queue_.begin(), queue_.end(), [id](const Task& t) { return t.task.id == id; });
  if (it == queue_.end() || it->task.on_demand) return;
  it->task.on_demand = true;
  it->seq = next_seq_++;
  if (current_ && !current_->task.on_demand) Park(now);
  StartNext(now);
}

void SimLink::Cancel(uint64_t id) {
  const int64_t now = clock_.NowNs();
  AdvanceTo(now);
  if (current_ && current_->task.id == id) {
    const int64_t copied = now - current_since_;
    stats_.busy_ns += copied;
    current_->remaining_ns -= copied;
    Finish(*current_, now, /*cancelled=*/true);
    current_.reset();
    StartNext(now);
    return;
  }
  auto it =
      std::find_if(queue_.begin(), queue_.end(), [id](const Task& t) { return t.task.id == id; });
  if (it == queue_.end()) return;
  Finish(*it, now, /*cancelled=*/true);
  queue_.erase(it);
}

int64_t SimLink::RemainingNs(const void* src) {
  const int64_t now = clock_.NowNs();
  AdvanceTo(now);
  if (current_ && current_->task.src == src) {
    return current_->remaining_ns - (now - current_since_);
  }
  for (const Task& t : queue_) {
    if (t.task.src == src) return t.remaining_ns;
  }
  return -1;
}

size_t SimLink::Poll(std::vector<TransferDone>* out) {
  AdvanceTo(clock_.NowNs());
  const size_t n = done_.size();
  out->insert(out->end(), done_.begin(), done_.end());
  done_.clear();
  return n;
}

size_t SimLink::Wait(std::vector<TransferDone>* out, std::chrono::milliseconds) {
  AdvanceTo(clock_.NowNs());
  if (done_.empty() && current_) {
    const int64_t end = current_since_ + current_->remaining_ns;
    clock_.AdvanceNs(end - clock_.NowNs());
  }
  return Poll(out);
}

Result<void*> SimLink::AllocateDevice(size_t bytes) {
  void* p = std::aligned_alloc(64, (bytes + 63) / 64 * 64);
  if (p == nullptr) return ResourceExhausted("simulated link: no memory for the slots");
  return p;
}

void SimLink::FreeDevice(void* ptr) { std::free(ptr); }

}  // namespace fmoe::bench
