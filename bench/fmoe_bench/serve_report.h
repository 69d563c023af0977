// What `fmoe-bench serve` reports: one summary per run (latency percentiles, throughput, expert
// hit rate, errors) from its requests' outcomes, printed as one aligned table, written as CSV,
// and plotted through a gnuplot script (run when gnuplot is on PATH). Pure functions except the
// file writers and RunGnuplot; no threads.
//
// Definitions (warm-up requests excluded; latencies of successful requests only):
//   TTFT  = arrival of the first event with text - the moment the request was sent;
//   TPOT  = (last event with text - first event with text) / (completion_tokens - 1), for
//           requests of 2 tokens or more;
//   throughput = output tokens (or requests) / (last answer's end - first measured send);
//   hit rate   = sum of usage.fmoe_experts.hits / sum of (hits + misses).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "bench/fmoe_bench/serve_client.h"
#include "bench/fmoe_bench/serve_workload.h"
#include "common/status.h"

namespace fmoe::bench {

struct RunSummary {
  std::string name;    // "fmoe", ..., "resident".
  std::string policy;  // The manifest policy it ran.
  double budget = 0;   // expert_cache_fraction.
  bool failed = false;
  std::string failure;  // Why the run failed (or a warning, e.g. a process had to be killed).
  int requests = 0;     // Measured requests sent.
  int ok = 0;
  int errors = 0;
  std::string first_error;  // The first failed request's error, for the report.
  int64_t prompt_tokens = 0;
  int64_t cached_tokens = 0;     // Of prompt_tokens, found in the prefix cache.
  int64_t output_tokens = 0;     // Sum of usage.completion_tokens.
  int64_t requested_tokens = 0;  // Sum of max_tokens of the successful requests.
  int short_requests = 0;        // Successful requests that ended before max_tokens (eos).
  // Successful requests with tokens but no expert figures (hits + misses = 0) in their usage.
  int requests_without_figures = 0;
  double duration_s = 0;
  double ttft_ms[3] = {0, 0, 0};  // p50, p90, p99.
  double tpot_ms[3] = {0, 0, 0};
  double ttft_mean_ms = 0;
  double tpot_mean_ms = 0;
  int ttft_samples = 0;  // Requests with a first token.
  int tpot_samples = 0;  // Requests with 2 tokens or more.
  double tokens_per_s = 0;
  double requests_per_s = 0;
  uint64_t expert_hits = 0;
  uint64_t expert_misses = 0;
  double hit_rate = -1;  // -1: no expert figures.
  uint64_t bytes_moved = 0;
  int64_t preemptions = -1;  // The groups' fmoe_preemptions_total after the run; -1: unknown.
};

// Summarises one run. `results[i]` belongs to `requests[i]`.
RunSummary Summarize(const std::vector<BenchRequest>& requests,
                     const std::vector<StreamResult>& results);

// One line per request (warm-up included, marked), for the run directory.
Status WriteRequestsCsv(const std::string& path, const std::vector<BenchRequest>& requests,
                        const std::vector<StreamResult>& results, BenchClock::time_point start);

// The aligned table of every run (failed runs included, with their reasons below it).
std::string FormatTable(const std::vector<RunSummary>& runs);

// Header and one row per run.
Status WriteSummaryCsv(const std::string& path, const std::vector<RunSummary>& runs);

// Writes the gnuplot script for `csv_path` (written from `runs`) next to it (same name, .gp) and
// runs gnuplot when it is on PATH and some run has figures. Never fails the benchmark: returns a
// line to print (where the PNG is, or why there is none).
std::string PlotSummary(const std::string& csv_path, const std::string& png_path,
                        const std::vector<RunSummary>& runs);

}  // namespace fmoe::bench
