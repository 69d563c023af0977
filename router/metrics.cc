#include "router/metrics.h"

#include <chrono>
#include <cstdio>
#include <sstream>

namespace fmoe {
namespace {

const std::vector<double> kLatencyMs = {1,   2.5, 5,    10,   25,   50,    100,
                                        250, 500, 1000, 2500, 5000, 10000, 30000};

int64_t NowMs() {
  return std::chrono::duration_cast<std::chrono::milliseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

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

void RenderHistogram(std::ostringstream& out, const std::string& name, const std::string& help,
                     const Histogram& h) {
  out << "# HELP " << name << " " << help << "\n# TYPE " << name << " histogram\n";
  uint64_t cumulative = 0;
  for (size_t b = 0; b < h.bounds().size(); ++b) {
    cumulative += h.counts()[b];
    out << name << "_bucket{le=\"" << Num(h.bounds()[b] / 1000.0) << "\"} " << cumulative << "\n";
  }
  out << name << "_bucket{le=\"+Inf\"} " << h.count() << "\n";
  out << name << "_sum " << Num(h.sum() / 1000.0) << "\n";
  out << name << "_count " << h.count() << "\n";
}

}  // namespace

RouterMetrics::RouterMetrics() : ttft_ms_(kLatencyMs), tpot_ms_(kLatencyMs) {
  window_start_ms_ = NowMs();
}

void RouterMetrics::CountRequest(const std::string& route, int status) {
  std::lock_guard<std::mutex> lock(mu_);
  ++requests_[{route, status}];
}

void RouterMetrics::CountGeneration(double ttft_ms, double tpot_ms, uint32_t tokens) {
  std::lock_guard<std::mutex> lock(mu_);
  if (tokens > 0) ttft_ms_.Add(ttft_ms);
  if (tokens > 1) tpot_ms_.Add(tpot_ms);
  tokens_ += tokens;
}

std::string RouterMetrics::Render(const ClusterView& view) const {
  std::ostringstream out;
  std::lock_guard<std::mutex> lock(mu_);
  const int64_t now = NowMs();
  if (now - window_start_ms_ >= 10000) {
    tokens_per_s_ = static_cast<double>(tokens_ - window_start_tokens_) * 1000.0 /
                    static_cast<double>(now - window_start_ms_);
    window_start_ms_ = now;
    window_start_tokens_ = tokens_;
  }
  out << "# HELP fmoe_requests_total HTTP requests answered, by route and status.\n"
         "# TYPE fmoe_requests_total counter\n";
  for (const auto& [key, n] : requests_) {
    out << "fmoe_requests_total{route=\"" << Escape(key.first) << "\",status=\"" << key.second
        << "\"} " << n << "\n";
  }
  RenderHistogram(out, "fmoe_time_to_first_token_seconds",
                  "Time from a completion request's arrival to its first token.", ttft_ms_);
  RenderHistogram(out, "fmoe_time_per_output_token_seconds",
                  "Mean time between a completion's tokens after the first.", tpot_ms_);
  out << "# HELP fmoe_generated_tokens_total Completion tokens generated.\n"
         "# TYPE fmoe_generated_tokens_total counter\nfmoe_generated_tokens_total "
      << tokens_ << "\n";
  out << "# HELP fmoe_tokens_per_second Completion tokens per second over the last 10 s.\n"
         "# TYPE fmoe_tokens_per_second gauge\nfmoe_tokens_per_second "
      << Num(tokens_per_s_) << "\n";
  out << "# HELP fmoe_group_alive Whether a worker group is alive (1) or not (0).\n"
         "# TYPE fmoe_group_alive gauge\n";
  for (const auto& g : view.groups) {
    out << "fmoe_group_alive{group=\"" << Escape(g.name) << "\"} " << (g.alive ? 1 : 0) << "\n";
  }
  out << "# HELP fmoe_queue_depth Requests waiting in the router for a group.\n"
         "# TYPE fmoe_queue_depth gauge\n";
  for (const auto& g : view.groups) {
    out << "fmoe_queue_depth{group=\"" << Escape(g.name) << "\"} " << g.queued << "\n";
  }
  out << "# HELP fmoe_running_requests Requests handed to a group's leader, not finished.\n"
         "# TYPE fmoe_running_requests gauge\n";
  for (const auto& g : view.groups) {
    out << "fmoe_running_requests{group=\"" << Escape(g.name) << "\"} " << g.running << "\n";
  }
  out << "# HELP fmoe_expert_hits_total Routed-expert uses served from the device cache (as "
         "last reported by the group's leader).\n# TYPE fmoe_expert_hits_total counter\n";
  for (const auto& g : view.groups) {
    out << "fmoe_expert_hits_total{group=\"" << Escape(g.name) << "\"} " << g.experts.hits << "\n";
  }
  out << "# HELP fmoe_expert_misses_total Routed-expert uses that waited for a load.\n"
         "# TYPE fmoe_expert_misses_total counter\n";
  for (const auto& g : view.groups) {
    out << "fmoe_expert_misses_total{group=\"" << Escape(g.name) << "\"} " << g.experts.misses
        << "\n";
  }
  out << "# HELP fmoe_expert_hit_rate Hits over hits plus misses since the leader started.\n"
         "# TYPE fmoe_expert_hit_rate gauge\n";
  for (const auto& g : view.groups) {
    const uint64_t total = g.experts.hits + g.experts.misses;
    out << "fmoe_expert_hit_rate{group=\"" << Escape(g.name) << "\"} "
        << Num(total ? static_cast<double>(g.experts.hits) / static_cast<double>(total) : 0.0)
        << "\n";
  }
  out << "# HELP fmoe_expert_bytes_moved_total Bytes copied to the device expert cache.\n"
         "# TYPE fmoe_expert_bytes_moved_total counter\n";
  for (const auto& g : view.groups) {
    out << "fmoe_expert_bytes_moved_total{group=\"" << Escape(g.name) << "\"} "
        << g.experts.bytes_moved << "\n";
  }
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
  return out.str();
}

}  // namespace fmoe
