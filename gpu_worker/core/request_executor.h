// The seam between the rank's control plane (worker.h, which receives requests from the router)
// and what runs them (the engine, engine.h): neither includes the other.
#pragma once

#include <cstdint>

#include "common/wire/messages.h"

namespace fmoe {

// What runs requests: the engine (gpu_worker/engine/engine.h). Thread-safe.
class RequestExecutor {
 public:
  virtual ~RequestExecutor() = default;
  virtual void Submit(Generate request) = 0;
  virtual void Cancel(uint64_t request_id) = 0;
  virtual uint32_t active() const = 0;  // Waiting plus running requests.
};

}  // namespace fmoe
