#include "gpu_worker/core/scheduler.h"

#include <algorithm>
#include <limits>

namespace fmoe {

Status SchedulerOptions::Check() const {
  if (max_batch == 0) return InvalidArgument("max_batch must be at least 1");
  if (max_batched_tokens != 0 && max_batched_tokens < max_batch) {
    return InvalidArgument("max_batched_tokens " + std::to_string(max_batched_tokens) +
                           " is below max_batch " + std::to_string(max_batch) +
                           ": every running request needs a token of each step (0 = no budget)");
  }
  return Status::Ok();
}

bool Scheduler::Add(uint64_t id, uint32_t prompt_tokens, bool chunkable, uint32_t boundary) {
  if (prompt_tokens == 0 || waiting_.size() >= options_.max_waiting || Contains(id)) return false;
  waiting_.push_back({id, prompt_tokens, 0, chunkable, chunkable ? boundary : 0});
  return true;
}

Scheduler::Entry* Scheduler::Find(uint64_t id) {
  for (Entry& e : running_) {
    if (e.id == id) return &e;
  }
  for (Entry& e : waiting_) {
    if (e.id == id) return &e;
  }
  return nullptr;
}

const Scheduler::Entry* Scheduler::Find(uint64_t id) const {
  return const_cast<Scheduler*>(this)->Find(id);
}

bool Scheduler::Contains(uint64_t id) const { return Find(id) != nullptr; }

bool Scheduler::IsWaiting(uint64_t id) const {
  return std::any_of(waiting_.begin(), waiting_.end(), [id](const Entry& e) { return e.id == id; });
}

bool Scheduler::Remove(uint64_t id) {
  auto match = [id](const Entry& e) { return e.id == id; };
  if (auto it = std::find_if(running_.begin(), running_.end(), match); it != running_.end()) {
    running_.erase(it);
    return true;
  }
  if (auto it = std::find_if(waiting_.begin(), waiting_.end(), match); it != waiting_.end()) {
    waiting_.erase(it);
    return true;
  }
  return false;
}

uint32_t Scheduler::ChunkOf(const Entry& e, bool first_prefill, uint64_t* budget,
                            bool* grown) const {
  uint32_t left = e.prompt - e.prefilled;
  // A chunk that starts before the boundary ends there at most.
  if (e.boundary > e.prefilled) left = std::min(left, e.boundary - e.prefilled);
  if (options_.max_batched_tokens == 0) return left;
  if (!e.chunkable) {
    if (!first_prefill) return 0;
    *budget -= std::min<uint64_t>(*budget, left);
    return left;
  }
  const auto fits = static_cast<uint32_t>(std::min<uint64_t>(left, *budget));
  const uint32_t chunk = AdvisedChunk(chunk_advisor_, fits, left, first_prefill);
  if (grown != nullptr) *grown = chunk > fits;
  *budget -= std::min<uint64_t>(*budget, chunk);
  return chunk;
}

std::vector<ScheduledWork> Scheduler::Schedule() {
  std::vector<ScheduledWork> work;
  uint64_t budget = options_.max_batched_tokens == 0 ? std::numeric_limits<uint64_t>::max()
                                                     : options_.max_batched_tokens;
  for (const Entry& e : running_) {
    if (!e.decoding()) continue;
    work.push_back({e.id, false, 0, 1, false, true});
    budget -= std::min<uint64_t>(budget, 1);
  }
  bool first_prefill = true;
  for (const Entry& e : running_) {
    if (e.decoding()) continue;
    bool grown = false;
    const uint32_t chunk = ChunkOf(e, first_prefill, &budget, &grown);
    if (chunk == 0) continue;
    first_prefill = false;
    work.push_back({e.id, true, e.prefilled, chunk, false, e.prefilled + chunk == e.prompt, grown});
  }
  while (running_.size() < options_.max_batch && !waiting_.empty()) {
    Entry e = waiting_.front();
    e.prefilled = 0;
    uint64_t probe = budget;
    if (ChunkOf(e, first_prefill, &probe) == 0) break;  // Before the hook takes any blocks.
    if (admit_hook_) e.prefilled = std::min(admit_hook_(e.id, e.prompt), e.prompt - 1);
    bool grown = false;
    const uint32_t chunk = ChunkOf(e, first_prefill, &budget, &grown);
    if (chunk == 0) break;
    first_prefill = false;
    work.push_back({e.id, true, e.prefilled, chunk, true, e.prefilled + chunk == e.prompt, grown});
    running_.push_back(e);
    waiting_.pop_front();
  }
  return work;
}

bool Scheduler::Preempt(uint64_t id, uint32_t prompt_tokens) {
  auto it =
      std::find_if(running_.begin(), running_.end(), [id](const Entry& e) { return e.id == id; });
  if (it == running_.end() || prompt_tokens == 0) return false;
  Entry e = *it;
  running_.erase(it);
  e.prompt = prompt_tokens;
  e.prefilled = 0;
  waiting_.push_front(e);
  return true;
}

void Scheduler::Completed(std::span<const ScheduledWork> work) {
  for (const ScheduledWork& w : work) {
    if (!w.prefill) continue;
    for (Entry& e : running_) {
      if (e.id != w.id) continue;
      e.prefilled = std::min(e.prompt, w.first + w.tokens);
      break;
    }
  }
}

std::vector<uint64_t> Scheduler::RunningIds() const {
  std::vector<uint64_t> ids;
  ids.reserve(running_.size());
  for (const Entry& e : running_) ids.push_back(e.id);
  return ids;
}

std::vector<uint64_t> Scheduler::WaitingIds() const {
  std::vector<uint64_t> ids;
  ids.reserve(waiting_.size());
  for (const Entry& e : waiting_) ids.push_back(e.id);
  return ids;
}

}  // namespace fmoe
