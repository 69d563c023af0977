// Injected time (RocksDB's SystemClock/MockSystemClock idea): components that expire, back off
// or time anything take a Clock&, so tests drive time by hand. Thread-safe.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>

namespace fmoe {

class Clock {
 public:
  virtual ~Clock() = default;
  // Monotonic milliseconds from an arbitrary origin.
  virtual int64_t NowMs() const = 0;
};

class SteadyClock final : public Clock {
 public:
  int64_t NowMs() const override {
    return std::chrono::duration_cast<std::chrono::milliseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  static SteadyClock& Get() {
    static SteadyClock clock;
    return clock;
  }
};

class ManualClock final : public Clock {
 public:
  explicit ManualClock(int64_t start_ms = 0) : now_ms_(start_ms) {}
  int64_t NowMs() const override { return now_ms_.load(); }
  void AdvanceMs(int64_t ms) { now_ms_ += ms; }

 private:
  std::atomic<int64_t> now_ms_;
};

// Wall-clock milliseconds since the Unix epoch, for records and logs (not for timeouts).
inline uint64_t UnixMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace fmoe
