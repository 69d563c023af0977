// The compute fences of a link, by id (transfer_engine.h: RecordComputeFence). A fence is alive
// while a submitted copy that has not started names it, and while it is the newest: the expert
// cache names the newest fence in every copy it submits until the next fence is recorded, so the
// newest must outlive the copies that have already used it. Older fences go as soon as no
// pending copy names them. Generic over the event type so the bookkeeping is tested without a
// GPU (the CUDA link uses cudaEvent_t). Thread-safe.
#pragma once

#include <cstdint>
#include <functional>
#include <mutex>
#include <unordered_map>

namespace fmoe {

template <typename Event>
class FenceRegistry {
 public:
  using Destroy = std::function<void(Event)>;

  explicit FenceRegistry(Destroy destroy) : destroy_(std::move(destroy)) {}
  ~FenceRegistry() {
    for (auto& [id, fence] : fences_) destroy_(fence.event);
  }
  FenceRegistry(const FenceRegistry&) = delete;
  FenceRegistry& operator=(const FenceRegistry&) = delete;

  // A new fence, now the newest; fences no pending copy names go.
  void Add(uint64_t id, Event event) {
    std::lock_guard<std::mutex> lock(mu_);
    newest_ = id;
    for (auto it = fences_.begin(); it != fences_.end();) {
      if (it->second.users == 0) {
        destroy_(it->second.event);
        it = fences_.erase(it);
      } else {
        ++it;
      }
    }
    fences_[id] = Fence{event, 0};
  }

  // A copy naming `id` was submitted. False when the fence is gone (a caller's bookkeeping error;
  // the copy then waits for the compute stream as it is when it starts).
  bool Acquire(uint64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = fences_.find(id);
    if (it == fences_.end()) return false;
    ++it->second.users;
    return true;
  }

  // A copy naming `id` was cancelled before it started.
  void Release(uint64_t id) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = fences_.find(id);
    if (it != fences_.end()) Drop(it);
  }

  // A copy naming `id` starts: `wait(event)` is called under the lock (the event stays valid for
  // the call). False, without calling `wait`, when the fence is gone.
  bool Use(uint64_t id, const std::function<void(Event)>& wait) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = fences_.find(id);
    if (it == fences_.end()) return false;
    wait(it->second.event);
    Drop(it);
    return true;
  }

  size_t size() const {
    std::lock_guard<std::mutex> lock(mu_);
    return fences_.size();
  }

 private:
  struct Fence {
    Event event{};
    int users = 0;  // Submitted copies naming it that have not started.
  };
  using Map = std::unordered_map<uint64_t, Fence>;

  // One user fewer; an unused fence that is not the newest goes.
  void Drop(typename Map::iterator it) {
    if (it->second.users > 0) --it->second.users;
    if (it->second.users == 0 && it->first != newest_) {
      destroy_(it->second.event);
      fences_.erase(it);
    }
  }

  Destroy destroy_;
  mutable std::mutex mu_;
  Map fences_;           // GUARDED_BY(mu_)
  uint64_t newest_ = 0;  // GUARDED_BY(mu_)
};

}  // namespace fmoe
