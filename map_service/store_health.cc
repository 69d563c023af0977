#include "map_service/store_health.h"

#include <algorithm>

#include "common/log.h"

namespace fmoe {

StoreHealth::StoreHealth(const Clock& clock, StoreHealthOptions options)
    : clock_(clock), options_(options) {}

const char* StoreHealth::StateName(State state) {
  switch (state) {
    case State::kHealthy:
      return "ok";
    case State::kDegraded:
      return "degraded";
    case State::kRetrying:
      return "retrying";
  }
  return "?";
}

void StoreHealth::StartDegraded(const std::string& reason) {
  Degrade(reason);
  spdlog::error(
      "store: {}; serving read-only (degraded) from what is stored: matching goes on, new maps "
      "and new models are not stored; retrying in {} ms",
      reason, next_retry_ms_ - clock_.NowMs());
}

void StoreHealth::Degrade(const std::string& reason) {
  const int64_t now = clock_.NowMs();
  state_ = State::kDegraded;
  reason_ = reason;
  since_ms_ = now;
  last_log_ms_ = now;
  failed_since_log_ = 0;
  failed_this_episode_ = 0;
  backoff_ms_ = std::max(1, options_.retry_initial_ms);
  next_retry_ms_ = now + backoff_ms_;
}

bool StoreHealth::Failed(const Status& status) {
  if (status.code() != ErrorCode::kIoError) return false;
  ++failed_total_;
  ++failed_this_episode_;
  if (state_ == State::kHealthy) {
    Degrade(status.message());
    failed_this_episode_ = 1;
    spdlog::error(
        "store: a write failed: {}; the store is read-only (degraded): matching goes on, new "
        "maps are not stored nor acknowledged; retrying in {} ms",
        status.message(), backoff_ms_);
    return true;
  }
  reason_ = status.message();
  ++failed_since_log_;
  return true;
}

bool StoreHealth::RetryDue() {
  if (state_ != State::kDegraded || clock_.NowMs() < next_retry_ms_) return false;
  state_ = State::kRetrying;
  ++retries_;
  return true;
}

void StoreHealth::RetryDone(const Status& status) {
  if (state_ != State::kRetrying) return;
  const int64_t now = clock_.NowMs();
  if (status.ok()) {
    state_ = State::kHealthy;
    ++recoveries_;
    spdlog::warn(
        "store: writable again after {:.1f} s degraded ({} writes failed or refused meanwhile, "
        "{} retries)",
        (now - since_ms_) / 1000.0, failed_this_episode_, retries_);
    reason_.clear();
    return;
  }
  state_ = State::kDegraded;
  reason_ = status.message();
  backoff_ms_ = std::min(std::max(1, options_.retry_max_ms),
                         static_cast<int>(std::min<int64_t>(int64_t{backoff_ms_} * 2, 1 << 30)));
  next_retry_ms_ = now + backoff_ms_;
}

void StoreHealth::Tick() {
  if (state_ == State::kHealthy) return;
  const int64_t now = clock_.NowMs();
  if (now - last_log_ms_ < options_.log_interval_ms) return;
  spdlog::error(
      "store: read-only (degraded) for {:.0f} s: {} writes failed or refused in the last {:.0f} s "
      "({} since it began; last: {}); next retry in {} ms",
      (now - since_ms_) / 1000.0, failed_since_log_, (now - last_log_ms_) / 1000.0,
      failed_this_episode_, reason_, next_retry_in_ms());
  last_log_ms_ = now;
  failed_since_log_ = 0;
}

std::string StoreHealth::Why() const {
  return "the store is read-only (degraded for " + std::to_string(degraded_ms() / 1000) +
         " s: " + reason_ + ")";
}

int64_t StoreHealth::degraded_ms() const {
  return state_ == State::kHealthy ? 0 : clock_.NowMs() - since_ms_;
}

int64_t StoreHealth::next_retry_in_ms() const {
  if (state_ != State::kDegraded) return 0;
  return std::max<int64_t>(0, next_retry_ms_ - clock_.NowMs());
}

}  // namespace fmoe
