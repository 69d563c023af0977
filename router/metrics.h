// The router's metrics, served as Prometheus text on GET /metrics: requests by route and
// status, time to first token and time per output token histograms, generated tokens (total
// and per second over the last 10 s), and, from the cluster view, queue depth and running
// requests per group, the workers' expert hits, misses and bytes moved, and the map service's
// match latency. Thread-safe.
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "common/histogram.h"
#include "router/worker_link.h"

namespace fmoe {

class RouterMetrics {
 public:
  RouterMetrics();

  void CountRequest(const std::string& route, int status);
  // A finished generation: time to its first token, mean time per later token, tokens out.
  void CountGeneration(double ttft_ms, double tpot_ms, uint32_t tokens);

  // Prometheus text exposition (version 0.0.4).
  std::string Render(const ClusterView& view) const;

 private:
  mutable std::mutex mu_;
  std::map<std::pair<std::string, int>, uint64_t> requests_;  // GUARDED_BY(mu_)
  Histogram ttft_ms_;                                         // GUARDED_BY(mu_)
  Histogram tpot_ms_;                                         // GUARDED_BY(mu_)
  uint64_t tokens_ = 0;                                       // GUARDED_BY(mu_)
  // Tokens per second over the last full 10 s window.
  mutable int64_t window_start_ms_ = 0;       // GUARDED_BY(mu_)
  mutable uint64_t window_start_tokens_ = 0;  // GUARDED_BY(mu_)
  mutable double tokens_per_s_ = 0.0;         // GUARDED_BY(mu_)
};

}  // namespace fmoe
