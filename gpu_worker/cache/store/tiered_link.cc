#include "gpu_worker/cache/store/tiered_link.h"

#include <utility>

#include "common/clock.h"

namespace fmoe {

TieredLink::TieredLink(std::unique_ptr<TransferEngine> device_link, HostTier* tier)
    : device_(std::move(device_link)), tier_(tier) {
  name_ = std::string(device_->name()) + " behind a host tier";
}

TieredLink::~TieredLink() {
  // Copies still on the device link read pinned host slots: the owner (the expert cache) has
  // cancelled and drained them before destroying the link; nothing else to do.
}

void TieredLink::ToDevice(Task& t) {
  t.task.src = tier_->Pin(t.task.key);
  t.copying = true;
  device_->Submit(t.task);
}

void TieredLink::Submit(const TransferTask& task) {
  Task& t = tasks_[task.id];
  t.task = task;
  if (tier_->Resident(task.key)) {
    ToDevice(t);
    return;
  }
  t.read_start_ns = SteadyClock::Get().NowNs();
  tier_->Request(task.key, task.on_demand);
}

void TieredLink::Cancel(uint64_t id) {
  auto it = tasks_.find(id);
  if (it == tasks_.end()) return;
  if (it->second.copying) {
    device_->Cancel(id);
    return;
  }
  TransferDone d;
  d.id = id;
  d.cancelled = true;
  d.submit_ns = it->second.read_start_ns;
  d.start_ns = d.end_ns = SteadyClock::Get().NowNs();
  ready_.push_back(d);
  tier_->Release(it->second.task.key);
  tasks_.erase(it);
}

void TieredLink::Promote(uint64_t id) {
  auto it = tasks_.find(id);
  if (it == tasks_.end()) return;
  it->second.task.on_demand = true;
  if (it->second.copying) {
    device_->Promote(id);
  } else {
    tier_->Request(it->second.task.key, /*urgent=*/true);
  }
}

void TieredLink::Drain(std::vector<TransferDone>* out) {
  // Reads first: a task whose read finished goes to the device link (or fails).
  for (const TierDone& r : reads_) {
    for (auto it = tasks_.begin(); it != tasks_.end();) {
      Task& t = it->second;
      if (t.copying || t.task.key != r.key) {
        ++it;
        continue;
      }
      if (r.status.ok() && tier_->Resident(r.key)) {
        ToDevice(t);
        ++it;
        continue;
      }
      TransferDone d;
      d.id = it->first;
      d.status = r.status.ok() ? Internal("tiered link: expert read but not resident") : r.status;
      d.submit_ns = t.read_start_ns;
      d.start_ns = r.start_ns;
      d.end_ns = r.end_ns;
      out->push_back(std::move(d));
      it = tasks_.erase(it);
    }
  }
  reads_.clear();
  for (TransferDone& c : copies_) {
    auto it = tasks_.find(c.id);
    if (it == tasks_.end()) continue;
    tier_->Unpin(it->second.task.key);
    if (it->second.read_start_ns != 0) {
      c.submit_ns = it->second.read_start_ns;
      c.start_ns = it->second.read_start_ns;
    }
    tasks_.erase(it);
    out->push_back(std::move(c));
  }
  copies_.clear();
  for (TransferDone& d : ready_) out->push_back(std::move(d));
  ready_.clear();
}

size_t TieredLink::Poll(std::vector<TransferDone>* out) {
  const size_t before = out->size();
  tier_->Poll(&reads_);
  device_->Poll(&copies_);
  Drain(out);
  return out->size() - before;
}

size_t TieredLink::Wait(std::vector<TransferDone>* out, std::chrono::milliseconds timeout) {
  const size_t before = out->size();
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  while (true) {
    Poll(out);
    if (out->size() > before || tasks_.empty()) break;
    bool reading = false, copying = false;
    for (const auto& [id, t] : tasks_) (t.copying ? copying : reading) = true;
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) break;
    // One side blocks; with both busy, each gets short turns.
    const std::chrono::milliseconds turn =
        reading && copying ? std::min(left, std::chrono::milliseconds(1)) : left;
    if (reading) tier_->Wait(&reads_, turn);
    if (copying) device_->Wait(&copies_, turn);
    Drain(out);
    if (out->size() > before) break;
  }
  return out->size() - before;
}

}  // namespace fmoe
