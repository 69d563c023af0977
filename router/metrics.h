// The router's metrics, served as Prometheus text on GET /metrics, by Prometheus's conventions
// (base units, counters end in _total, nothing derived that a query can divide): requests by
// route and status; time to first token, time per output token, end-to-end latency, queue time
// and prompt length histograms; prompt and generated token counters; from the cluster view,
// queue depth, running requests and loading state per group, the workers' expert hits, misses
// and bytes moved, and the map service's match latency; the model's expert shape (L, J, K, bytes
// of a routed and of a shared expert). Thread-safe.
//
// Beside ours, the names dashboards and autoscalers built for vLLM read, with its `model_name`
// label: vllm:num_requests_running and vllm:num_requests_waiting (gauges, summed over the
// groups), vllm:time_to_first_token_seconds, vllm:time_per_output_token_seconds,
// vllm:e2e_request_latency_seconds, vllm:request_queue_time_seconds and
// vllm:request_prompt_tokens (histograms), vllm:prompt_tokens_total and
// vllm:generation_tokens_total (counters). Each is the same figure as its fmoe_ twin.
// vllm:kv_cache_usage_perc comes from the leaders' heartbeats (their KV pools).
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <utility>

#include "common/histogram.h"
#include "common/model/model_config.h"
#include "router/worker_link.h"

namespace fmoe {
class ResponseStore;
}

namespace fmoe {

class RouterMetrics {
 public:
  RouterMetrics();

  // A completion request that every choice finished.
  struct Finished {
    std::string route;
    uint32_t prompt_tokens = 0;
    uint32_t completion_tokens = 0;  // All choices.
    double e2e_ms = 0.0;             // Arrival to the last token.
    double queue_ms = 0.0;           // Arrival to the start of its prefill (the longest choice).
  };

  // The served model's shape, rendered as fmoe_model_* gauges, and the name it is served by
  // (the vllm: aliases' model_name label); set once, before serving.
  void SetModel(const ModelInfo& info, std::string served_name = "");

  void CountRequest(const std::string& route, int status);
  // A finished generation (one choice): time to its first token, mean time per later token,
  // tokens out.
  void CountGeneration(double ttft_ms, double tpot_ms, uint32_t tokens);
  void CountFinished(const Finished& request);

  // The Responses API's store, rendered as fmoe_responses_* (it must outlive every Render); set
  // once, before serving.
  void SetResponseStore(const ResponseStore* store) { responses_ = store; }

  // Prometheus text exposition (version 0.0.4).
  std::string Render(const ClusterView& view) const;

 private:
  mutable std::mutex mu_;
  std::map<std::pair<std::string, int>, uint64_t> requests_;  // GUARDED_BY(mu_)
  Histogram ttft_ms_;                                         // GUARDED_BY(mu_)
  Histogram tpot_ms_;                                         // GUARDED_BY(mu_)
  Histogram e2e_ms_;                                          // GUARDED_BY(mu_)
  Histogram queue_ms_;                                        // GUARDED_BY(mu_)
  Histogram prompt_tokens_hist_;                              // GUARDED_BY(mu_)
  uint64_t generated_tokens_ = 0;                             // GUARDED_BY(mu_)
  uint64_t prompt_tokens_ = 0;                                // GUARDED_BY(mu_)
  std::optional<ModelInfo> model_;                            // GUARDED_BY(mu_)
  std::string served_name_;                                   // GUARDED_BY(mu_)
  const ResponseStore* responses_ = nullptr;
};

}  // namespace fmoe
