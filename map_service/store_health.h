// Whether the map service's store takes writes, as its service thread sees it (map_service/
// README.md, "Disk trouble"). A store write that fails with kIoError (a full, failing or
// read-only disk) makes the store DEGRADED: read-only, matching and stats go on, new writes are
// refused at once without touching the disk, and a recovery is tried after a backoff that
// doubles up to retry_max_ms. Failures are logged once when they start, then at most once per
// log_interval_ms with their count, and once more at recovery.
// HEALTHY -> DEGRADED (Failed, or StartDegraded when the store opened read-only)
// DEGRADED -> RETRYING (RetryDue, when the backoff passed: the owner submits a recovery job)
// RETRYING -> HEALTHY (RetryDone ok) | DEGRADED (RetryDone failed, backoff doubled)
// The service thread only; time from the injected Clock.
#pragma once

#include <cstdint>
#include <string>

#include "common/clock.h"
#include "common/status.h"

namespace fmoe {

struct StoreHealthOptions {
  int retry_initial_ms = 1000;  // First retry after a failure. Default: 1000
  int retry_max_ms = 30000;     // Backoff cap. Default: 30000
  int log_interval_ms = 10000;  // At most one line per interval while degraded. Default: 10000
};

class StoreHealth {
 public:
  enum class State { kHealthy, kDegraded, kRetrying };

  StoreHealth(const Clock& clock, StoreHealthOptions options);

  // The store opened read-only (Open's read_only_reason).
  void StartDegraded(const std::string& reason);
  // A store write failed. Only kIoError degrades the store; returns true when it did (the
  // caller then logs nothing itself).
  bool Failed(const Status& status);
  // A write not attempted because the store is degraded (counted and logged with the others).
  void Refused() {
    ++failed_total_;
    ++failed_since_log_;
    ++failed_this_episode_;
  }
  // DEGRADED and the backoff passed: moves to RETRYING and returns true (once per attempt).
  bool RetryDue();
  // The recovery job's result.
  void RetryDone(const Status& status);
  // The periodic log line while degraded; call often (every turn of the service loop).
  void Tick();

  State state() const { return state_; }
  bool healthy() const { return state_ == State::kHealthy; }
  // "the store is read-only (degraded since N s: REASON); retrying": for refusals.
  std::string Why() const;
  const std::string& reason() const { return reason_; }
  uint64_t failed_total() const { return failed_total_; }  // Writes failed or refused, ever.
  uint64_t retries() const { return retries_; }
  uint64_t recoveries() const { return recoveries_; }
  int64_t degraded_ms() const;       // How long degraded; 0 when healthy.
  int64_t next_retry_in_ms() const;  // 0 when healthy or retrying.
  static const char* StateName(State state);

 private:
  void Degrade(const std::string& reason);

  const Clock& clock_;
  const StoreHealthOptions options_;
  State state_ = State::kHealthy;
  std::string reason_;         // The last failure's message.
  int64_t since_ms_ = 0;       // Degraded since.
  int64_t next_retry_ms_ = 0;  // When DEGRADED: the next retry's time.
  int backoff_ms_ = 0;         // The current backoff.
  int64_t last_log_ms_ = 0;    // The last periodic line.
  uint64_t failed_total_ = 0;
  uint64_t failed_since_log_ = 0;     // Failed or refused since the last line.
  uint64_t failed_this_episode_ = 0;  // Since the store became degraded.
  uint64_t retries_ = 0;
  uint64_t recoveries_ = 0;
};

}  // namespace fmoe
