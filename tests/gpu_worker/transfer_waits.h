// Waits on a TransferEngine's completions, for the emulated and the CUDA link's tests.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "gpu_worker/cache/transfer/transfer_engine.h"

namespace fmoe::testing {

// Collects `n` completions, or what arrived within `limit` (a bound for a broken link, not a
// timing: a healthy one delivers long before).
inline std::vector<TransferDone> WaitFor(TransferEngine* link, size_t n,
                                         std::chrono::milliseconds limit) {
  std::vector<TransferDone> done;
  const auto deadline = std::chrono::steady_clock::now() + limit;
  while (done.size() < n && std::chrono::steady_clock::now() < deadline) {
    link->Wait(&done, std::chrono::milliseconds(50));
  }
  return done;
}

// The completions' task ids, in their order.
inline std::vector<uint64_t> Ids(const std::vector<TransferDone>& done) {
  std::vector<uint64_t> ids;
  for (const TransferDone& d : done) ids.push_back(d.id);
  return ids;
}

}  // namespace fmoe::testing
