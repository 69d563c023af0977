#include "router/metrics.h"

#include <cstdio>
#include <sstream>

#include "router/responses.h"

namespace fmoe {
namespace {

const std::vector<double> kLatencyMs = {1,   2.5, 5,    10,   25,   50,    100,
                                        250, 500, 1000, 2500, 5000, 10000, 30000};

std::string Num(double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%.9g", v);
  return buf;
}

std::string Escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    if (c == '\\' || c == '"') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out;
}

const std::vector<double> kPromptTokens = {8,    16,   32,   64,   128,   256,  512,
                                           1024, 2048, 4096, 8192, 16384, 32768};

// `scale` turns the histogram's unit into the metric's (1e-3: milliseconds to seconds). `labels`
// ("" or `name="value",...`) go on every sample.
void RenderHistogram(std::ostringstream& out, const std::string& name, const std::string& help,
                     const Histogram& h, double scale, const std::string& labels = "") {
  out << "# HELP " << name << " " << help << "\n# TYPE " << name << " histogram\n";
  const std::string lead = labels.empty() ? "" : labels + ",";
  const std::string only = labels.empty() ? "" : "{" + labels + "}";
  uint64_t cumulative = 0;
  for (size_t b = 0; b < h.bounds().size(); ++b) {
    cumulative += h.counts()[b];
    out << name << "_bucket{" << lead << "le=\"" << Num(h.bounds()[b] * scale) << "\"} "
        << cumulative << "\n";
  }
  out << name << "_bucket{" << lead << "le=\"+Inf\"} " << h.count() << "\n";
  out << name << "_sum" << only << " " << Num(h.sum() * scale) << "\n";
  out << name << "_count" << only << " " << h.count() << "\n";
}

// One family with a sample per group.
template <typename Value>
void RenderPerGroup(std::ostringstream& out, const std::string& name, const char* type,
                    const std::string& help, const ClusterView& view, Value value) {
  out << "# HELP " << name << " " << help << "\n# TYPE " << name << " " << type << "\n";
  for (const auto& g : view.groups) {
    out << name << "{group=\"" << Escape(g.name) << "\"} " << value(g) << "\n";
  }
}

// One line per rank of each group that reports its ranks' device split.
template <typename Value>
void RenderPerRank(std::ostringstream& out, const std::string& name, const std::string& help,
                   const ClusterView& view, Value value) {
  out << "# HELP " << name << " " << help << "\n# TYPE " << name << " gauge\n";
  for (const auto& g : view.groups) {
    for (size_t r = 0; r < g.kv.ranks.size(); ++r) {
      out << name << "{group=\"" << Escape(g.name) << "\",rank=\"" << r << "\"} "
          << value(g.kv.ranks[r]) << "\n";
    }
  }
}

}  // namespace

RouterMetrics::RouterMetrics()
    : ttft_ms_(kLatencyMs),
      tpot_ms_(kLatencyMs),
      e2e_ms_(kLatencyMs),
      queue_ms_(kLatencyMs),
      prompt_tokens_hist_(kPromptTokens) {}

void RouterMetrics::SetModel(const ModelInfo& info, std::string served_name) {
  std::lock_guard<std::mutex> lock(mu_);
  model_ = info;
  served_name_ = std::move(served_name);
}

void RouterMetrics::CountRequest(const std::string& route, int status) {
  std::lock_guard<std::mutex> lock(mu_);
  ++requests_[{route, status}];
}

void RouterMetrics::CountGeneration(double ttft_ms, double tpot_ms, uint32_t tokens) {
  std::lock_guard<std::mutex> lock(mu_);
  if (tokens > 0) ttft_ms_.Add(ttft_ms);
  if (tokens > 1) tpot_ms_.Add(tpot_ms);
  generated_tokens_ += tokens;
}

void RouterMetrics::CountFinished(const Finished& request) {
  std::lock_guard<std::mutex> lock(mu_);
  e2e_ms_.Add(request.e2e_ms);
  queue_ms_.Add(request.queue_ms);
  prompt_tokens_hist_.Add(request.prompt_tokens);
  prompt_tokens_ += request.prompt_tokens;
}

std::string RouterMetrics::Render(const ClusterView& view) const {
  std::ostringstream out;
  std::lock_guard<std::mutex> lock(mu_);
  out << "# HELP fmoe_requests_total HTTP requests answered, by route and status.\n"
         "# TYPE fmoe_requests_total counter\n";
  for (const auto& [key, n] : requests_) {
    out << "fmoe_requests_total{route=\"" << Escape(key.first) << "\",status=\"" << key.second
        << "\"} " << n << "\n";
  }
  if (responses_ != nullptr) {
    out << "# HELP fmoe_responses_stored Responses kept for previous_response_id.\n"
           "# TYPE fmoe_responses_stored gauge\n"
           "fmoe_responses_stored "
        << responses_->size()
        << "\n# HELP fmoe_responses_persistent Whether they are also kept on disk "
           "(router.responses_dir) (1) or in memory only (0).\n"
           "# TYPE fmoe_responses_persistent gauge\n"
           "fmoe_responses_persistent "
        << (responses_->persistent() ? 1 : 0)
        << "\n# HELP fmoe_responses_store_errors_total Writes of stored responses the disk "
           "refused (the responses stay in memory).\n"
           "# TYPE fmoe_responses_store_errors_total counter\n"
           "fmoe_responses_store_errors_total "
        << responses_->refused_writes() << "\n";
  }
  RenderHistogram(out, "fmoe_time_to_first_token_seconds",
                  "Time from a completion request's arrival to a choice's first token.", ttft_ms_,
                  1e-3);
  RenderHistogram(out, "fmoe_time_per_output_token_seconds",
                  "Mean time between a choice's tokens after the first.", tpot_ms_, 1e-3);
  RenderHistogram(out, "fmoe_e2e_request_latency_seconds",
                  "Time from a completion request's arrival to its last token.", e2e_ms_, 1e-3);
  RenderHistogram(out, "fmoe_request_queue_time_seconds",
                  "Time from a completion request's arrival to the start of its prefill.",
                  queue_ms_, 1e-3);
  RenderHistogram(out, "fmoe_request_prompt_tokens", "Prompt tokens of a completion request.",
                  prompt_tokens_hist_, 1.0);
  out << "# HELP fmoe_prompt_tokens_total Prompt tokens of finished completion requests.\n"
         "# TYPE fmoe_prompt_tokens_total counter\nfmoe_prompt_tokens_total "
      << prompt_tokens_ << "\n";
  out << "# HELP fmoe_generation_tokens_total Completion tokens generated.\n"
         "# TYPE fmoe_generation_tokens_total counter\nfmoe_generation_tokens_total "
      << generated_tokens_ << "\n";
  if (model_) {
    const ModelInfo& m = *model_;
    auto gauge = [&](const char* name, const char* help, uint64_t value) {
      out << "# HELP " << name << " " << help << "\n# TYPE " << name << " gauge\n"
          << name << " " << value << "\n";
    };
    out << "# HELP fmoe_model_info The served model (always 1).\n# TYPE fmoe_model_info gauge\n"
        << "fmoe_model_info{architecture=\"" << Escape(m.architecture) << "\",fingerprint=\""
        << FingerprintHex(m.fingerprint) << "\"} 1\n";
    gauge("fmoe_model_moe_layers", "MoE layers (L): transformer layers with routed experts.",
          m.num_moe_layers);
    gauge("fmoe_model_layers", "Transformer layers, dense ones included.", m.num_hidden_layers);
    gauge("fmoe_model_routed_experts", "Routed experts per MoE layer (J).", m.num_experts);
    gauge("fmoe_model_experts_per_token", "Routed experts each token uses per layer (K).", m.top_k);
    const uint32_t width = CheckpointBytesPerParam(m);
    gauge("fmoe_model_routed_expert_bytes",
          "Bytes of one routed expert as the checkpoint stores it, quantized or not (what the "
          "expert cache holds).",
          RoutedExpertBytes(m));
    gauge("fmoe_model_shared_expert_bytes",
          "Bytes of one MoE layer's shared expert in the checkpoint's dtype (resident, outside "
          "the expert cache; 0 = none).",
          SharedExpertParams(m) * width);
  }
  RenderPerGroup(out, "fmoe_group_alive", "gauge", "Whether a worker group serves (1) or not (0).",
                 view, [](const GroupView& g) { return g.alive ? 1 : 0; });
  RenderPerGroup(out, "fmoe_group_loading", "gauge",
                 "Whether a worker group is loading its model (1) or not (0).", view,
                 [](const GroupView& g) { return g.loading ? 1 : 0; });
  RenderPerGroup(out, "fmoe_queue_depth", "gauge", "Requests waiting in the router for a group.",
                 view, [](const GroupView& g) { return g.queued; });
  RenderPerGroup(out, "fmoe_running_requests", "gauge",
                 "Requests handed to a group's leader, not finished.", view,
                 [](const GroupView& g) { return g.running; });
  RenderPerGroup(out, "fmoe_expert_hits_total", "counter",
                 "Routed-expert uses served from the device cache (as last reported by the "
                 "group's leader).",
                 view, [](const GroupView& g) { return g.experts.hits; });
  RenderPerGroup(out, "fmoe_expert_misses_total", "counter",
                 "Routed-expert uses not resident: loaded, or with hybrid execution run on the "
                 "host.",
                 view, [](const GroupView& g) { return g.experts.misses; });
  RenderPerGroup(out, "fmoe_expert_moved_bytes_total", "counter",
                 "Bytes copied to the device expert cache.", view,
                 [](const GroupView& g) { return g.experts.bytes_moved; });
  RenderPerGroup(out, "fmoe_expert_host_runs_total", "counter",
                 "Missing experts run on the host instead of loaded (hybrid execution).", view,
                 [](const GroupView& g) { return g.experts.host_runs; });
  RenderPerGroup(out, "fmoe_expert_host_seconds_total", "counter",
                 "Time of the experts run on the host (hybrid execution).", view,
                 [](const GroupView& g) { return Num(g.experts.host_us / 1e6); });
  RenderPerGroup(out, "fmoe_expert_not_moved_bytes_total", "counter",
                 "Bytes of the experts run on the host, which were not copied to the device.", view,
                 [](const GroupView& g) { return g.experts.bytes_not_moved; });
  RenderPerGroup(out, "fmoe_expert_disk_reads_total", "counter",
                 "Expert misses read from the checkpoint on disk before their copy (host tier).",
                 view, [](const GroupView& g) { return g.experts.disk_reads; });
  RenderPerGroup(out, "fmoe_expert_disk_read_bytes_total", "counter",
                 "Bytes of experts read from the checkpoint on disk (host tier).", view,
                 [](const GroupView& g) { return g.experts.disk_bytes; });
  RenderPerGroup(out, "fmoe_expert_disk_stall_seconds_total", "counter",
                 "Compute time spent waiting for experts still being read from disk.", view,
                 [](const GroupView& g) { return g.experts.disk_stall_us / 1e6; });
  RenderPerGroup(out, "fmoe_expert_failed_loads_total", "counter",
                 "Expert reads that failed (from disk or the host copy), each try counted.", view,
                 [](const GroupView& g) { return g.experts.failed_loads; });
  RenderPerGroup(out, "fmoe_expert_failed_total", "counter",
                 "Experts given up on after a failed read and its retry: the requests that "
                 "needed one ended with an error.",
                 view, [](const GroupView& g) { return g.experts.failed_experts; });
  RenderPerGroup(out, "fmoe_kv_blocks", "gauge",
                 "Blocks of 16 positions in the leader's paged KV pool.", view,
                 [](const GroupView& g) { return g.kv.total_blocks; });
  RenderPerGroup(out, "fmoe_kv_blocks_max", "gauge",
                 "Blocks the leader's KV pool may hold: with one device budget (memory), what "
                 "it may borrow from the expert cache; else fmoe_kv_blocks.",
                 view, [](const GroupView& g) {
                   return g.kv.max_blocks != 0 ? g.kv.max_blocks : g.kv.total_blocks;
                 });
  RenderPerGroup(out, "fmoe_device_kv_bytes", "gauge",
                 "One device budget (memory): the leader's device bytes the KV pool holds now "
                 "(0 without one).",
                 view, [](const GroupView& g) { return g.kv.kv_bytes; });
  RenderPerGroup(out, "fmoe_device_expert_bytes", "gauge",
                 "One device budget (memory): the leader's device bytes the expert cache holds "
                 "now (0 without one).",
                 view, [](const GroupView& g) { return g.kv.expert_bytes; });
  RenderPerRank(out, "fmoe_rank_device_kv_bytes",
                "One device budget in a group of several ranks: each rank's device bytes its KV "
                "pool holds (as of the group's last iteration).",
                view, [](const KvFigures::RankSplit& r) { return r.kv_bytes; });
  RenderPerRank(out, "fmoe_rank_device_expert_bytes",
                "One device budget in a group of several ranks: each rank's device bytes its "
                "expert cache holds (as of the group's last iteration).",
                view, [](const KvFigures::RankSplit& r) { return r.expert_bytes; });
  RenderPerGroup(out, "fmoe_kv_blocks_used", "gauge",
                 "KV blocks referenced by running requests (cached prefixes nobody uses are "
                 "free).",
                 view, [](const GroupView& g) { return g.kv.used_blocks; });
  RenderPerGroup(out, "fmoe_prefix_cache_queries_total", "counter",
                 "Prompt tokens looked up in the prefix cache (whole blocks).", view,
                 [](const GroupView& g) { return g.kv.prefix_queries; });
  RenderPerGroup(out, "fmoe_prefix_cache_hits_total", "counter",
                 "Prompt tokens found in the prefix cache, not computed again.", view,
                 [](const GroupView& g) { return g.kv.prefix_hits; });
  RenderPerGroup(out, "fmoe_preemptions_total", "counter",
                 "Running requests preempted because the KV pool was full (recomputed later).",
                 view, [](const GroupView& g) { return g.kv.preemptions; });
  RenderPerGroup(out, "fmoe_prompt_chunks_total", "counter",
                 "Prompt chunks the leader's engine ran (a prompt the token budget does not cut "
                 "is one).",
                 view, [](const GroupView& g) { return g.engine.prompt_chunks; });
  RenderPerGroup(out, "fmoe_prompt_chunks_grown_total", "counter",
                 "Prompt chunks the expert-aware advisor grew past the token budget's chunk (a "
                 "small chunk would have loaded nearly the experts of the whole prompt).",
                 view, [](const GroupView& g) { return g.engine.chunks_grown; });
  RenderPerGroup(out, "fmoe_streamed_iterations_total", "counter",
                 "Engine iterations whose missing experts were streamed layer by layer through the "
                 "buffer beside the expert cache instead of loaded into it (prefill_stream).",
                 view, [](const GroupView& g) { return g.engine.streamed_iterations; });
  RenderPerGroup(out, "fmoe_prompt_token_seconds", "gauge",
                 "A prompt token's measured compute on the leader (moving average over steps of "
                 "many prompt tokens, the expert cache's stall taken out; 0 until measured).",
                 view, [](const GroupView& g) {
                   return Num(static_cast<double>(g.engine.prompt_token_ns) / 1e9);
                 });
  out << "# HELP fmoe_map_service_up Whether the map service answers (1) or not (0).\n"
         "# TYPE fmoe_map_service_up gauge\nfmoe_map_service_up "
      << (view.map_service_alive ? 1 : 0) << "\n";
  out << "# HELP fmoe_map_service_match_latency_seconds Map service: context received to its "
         "directives sent.\n# TYPE fmoe_map_service_match_latency_seconds summary\n"
         "fmoe_map_service_match_latency_seconds{quantile=\"0.5\"} "
      << Num(view.map_match_p50_us / 1e6)
      << "\nfmoe_map_service_match_latency_seconds{quantile=\"0.99\"} "
      << Num(view.map_match_p99_us / 1e6) << "\nfmoe_map_service_match_latency_seconds_count "
      << view.map_match_count << "\n";
  // vLLM's names, for the dashboards and autoscalers built for it (metrics.h).
  const std::string model = "model_name=\"" + Escape(served_name_) + "\"";
  uint64_t running = 0, waiting = 0, kv_total = 0, kv_used = 0, prefix_queries = 0, prefix_hits = 0,
           preemptions = 0;
  for (const auto& g : view.groups) {
    running += g.running;
    waiting += g.queued;
    kv_total += g.kv.total_blocks;
    kv_used += g.kv.used_blocks;
    prefix_queries += g.kv.prefix_queries;
    prefix_hits += g.kv.prefix_hits;
    preemptions += g.kv.preemptions;
  }
  auto alias = [&](const char* name, const char* type, const char* help, uint64_t value) {
    out << "# HELP " << name << " " << help << "\n# TYPE " << name << " " << type << "\n"
        << name << "{" << model << "} " << value << "\n";
  };
  alias("vllm:num_requests_running", "gauge",
        "Requests running on the workers (fmoe_running_requests, summed).", running);
  alias("vllm:num_requests_waiting", "gauge",
        "Requests waiting in the router (fmoe_queue_depth, summed).", waiting);
  out << "# HELP vllm:kv_cache_usage_perc KV blocks in use, a fraction of every group's pool "
         "(fmoe_kv_blocks_used / fmoe_kv_blocks, summed).\n# TYPE vllm:kv_cache_usage_perc "
         "gauge\nvllm:kv_cache_usage_perc{"
      << model << "} "
      << Num(kv_total ? static_cast<double>(kv_used) / static_cast<double>(kv_total) : 0.0) << "\n";
  alias("vllm:prefix_cache_queries_total", "counter",
        "Prompt tokens looked up in the prefix cache (fmoe_prefix_cache_queries_total, summed).",
        prefix_queries);
  alias("vllm:prefix_cache_hits_total", "counter",
        "Prompt tokens found in the prefix cache (fmoe_prefix_cache_hits_total, summed).",
        prefix_hits);
  alias("vllm:num_preemptions_total", "counter",
        "Requests preempted (fmoe_preemptions_total, summed).", preemptions);
  alias("vllm:prompt_tokens_total", "counter", "Prompt tokens (fmoe_prompt_tokens_total).",
        prompt_tokens_);
  alias("vllm:generation_tokens_total", "counter",
        "Generated tokens (fmoe_generation_tokens_total).", generated_tokens_);
  RenderHistogram(out, "vllm:time_to_first_token_seconds",
                  "Time to first token (fmoe_time_to_first_token_seconds).", ttft_ms_, 1e-3, model);
  RenderHistogram(out, "vllm:time_per_output_token_seconds",
                  "Time per output token (fmoe_time_per_output_token_seconds).", tpot_ms_, 1e-3,
                  model);
  RenderHistogram(out, "vllm:e2e_request_latency_seconds",
                  "End-to-end request latency (fmoe_e2e_request_latency_seconds).", e2e_ms_, 1e-3,
                  model);
  RenderHistogram(out, "vllm:request_queue_time_seconds",
                  "Queue time (fmoe_request_queue_time_seconds).", queue_ms_, 1e-3, model);
  RenderHistogram(out, "vllm:request_prompt_tokens",
                  "Prompt tokens of a request (fmoe_request_prompt_tokens).", prompt_tokens_hist_,
                  1.0, model);
  out << "# HELP fmoe_worker_hellos_refused_total Worker Hellos refused: a group not in the "
         "manifest, another model name or fingerprint, another world size.\n"
         "# TYPE fmoe_worker_hellos_refused_total counter\n";
  for (const char* reason : {"group", "model", "fingerprint", "world_size"}) {
    auto it = view.hellos_refused.find(reason);
    out << "fmoe_worker_hellos_refused_total{reason=\"" << reason << "\"} "
        << (it == view.hellos_refused.end() ? 0 : it->second) << "\n";
  }
  return out.str();
}

}  // namespace fmoe
