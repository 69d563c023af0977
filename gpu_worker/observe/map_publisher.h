// MapPublisher: the ForwardObserver that turns the model's per-request iteration context (its
// semantic embedding and every layer's gate distribution, DESIGN section 4) into the map
// service's context messages, handed to a sink that must not block (Outbox::PublishContext).
// Engine thread only.
#pragma once

#include <cstdint>
#include <functional>
#include <unordered_map>
#include <utility>

#include "common/wire/messages.h"
#include "gpu_worker/observe/forward_observer.h"

namespace fmoe {

class MapPublisher final : public ForwardObserver {
 public:
  using Sink = std::function<void(MapMessage)>;
  explicit MapPublisher(Sink sink) : sink_(std::move(sink)) {}

  void OnIterationStart(uint64_t request_id, uint32_t iteration,
                        std::span<const float> sem) override {
    last_iteration_[request_id] = iteration;
    sink_(IterationStart{request_id, iteration, {sem.begin(), sem.end()}});
  }
  void OnLayerGates(uint64_t request_id, uint32_t iteration, uint32_t layer,
                    std::span<const float> probs) override {
    sink_(LayerObserved{request_id, iteration, layer, {probs.begin(), probs.end()}});
  }
  void OnIterationEnd(uint64_t request_id, uint32_t iteration) override {
    sink_(IterationEnd{request_id, iteration, /*finished=*/false});
  }
  // The request left the batch: the service frees its state.
  void OnRequestEnd(uint64_t request_id) override {
    auto it = last_iteration_.find(request_id);
    if (it == last_iteration_.end()) return;  // Never ran an iteration.
    sink_(IterationEnd{request_id, it->second, /*finished=*/true});
    last_iteration_.erase(it);
  }

 private:
  Sink sink_;
  std::unordered_map<uint64_t, uint32_t> last_iteration_;
};

}  // namespace fmoe
