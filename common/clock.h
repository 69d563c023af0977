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
  // Monotonic nanoseconds, same origin as NowMs() * 1e6.
  virtual int64_t NowNs() const = 0;
};

class SteadyClock final : public Clock {
 public:
  int64_t NowMs() const override { return NowNs() / 1000000; }
  int64_t NowNs() const override {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
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
  explicit ManualClock(int64_t start_ms = 0) : now_ns_(start_ms * 1000000) {}
  int64_t NowMs() const override { return now_ns_.load() / 1000000; }
  int64_t NowNs() const override { return now_ns_.load(); }
  void AdvanceMs(int64_t ms) { now_ns_ += ms * 1000000; }
  void AdvanceNs(int64_t ns) { now_ns_ += ns; }

 private:
  std::atomic<int64_t> now_ns_;
};

// Monotonic microseconds (steady clock), for timing code paths that take no Clock.
inline int64_t SteadyNowUs() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Wall-clock milliseconds since the Unix epoch, for records and logs (not for timeouts).
inline uint64_t UnixMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

}  // namespace fmoe
