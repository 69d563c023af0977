#pragma once

#include <algorithm>
#include <chrono>
#include <exception>
#include <stdexcept>
#include <string>

namespace fmoe {

// Waits for a collective's work up to `timeout`, in slices of at most `slice`, and breaks off
// (a std::runtime_error with lost()'s text) once lost() names a reason. `work` is pointer-like
// to a c10d Work: wait(ms) returns once the work is done, rethrows the work's error, or throws
// when the slice runs out (the work goes on); isCompleted() says whether it is done.
//
// A work may complete between the end of a slice and the look at isCompleted(): then the work's
// own outcome counts, never the slice's "timed out" (a wait on a completed work returns at once
// or rethrows its error).
template <typename W, typename Lost>
void WaitInSlices(const W& work, std::chrono::milliseconds timeout, std::chrono::milliseconds slice,
                  const Lost& lost) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    try {
      work->wait(std::max(std::chrono::milliseconds{1}, std::min(left, slice)));
      return;
    } catch (const std::exception&) {
      if (work->isCompleted()) {
        work->wait(std::chrono::milliseconds{1});
        return;
      }
      if (std::chrono::steady_clock::now() >= deadline) throw;
      if (std::string why = lost(); !why.empty()) throw std::runtime_error(why);
    }
  }
}

}  // namespace fmoe
