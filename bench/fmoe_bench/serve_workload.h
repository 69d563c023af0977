// The request list of `fmoe-bench serve`: arrival times and lengths from an Azure LLM inference
// trace (TIMESTAMP,ContextTokens,GeneratedTokens), prompts from a JSONL file (field "prompt")
// matched to the trace's context lengths. Built once, so every run sends the same requests at the
// same offsets. Pure functions (the token counter is injected); no threads.
//
// Scaling rules (the trace's lengths are for large models; the served model is small):
//   prompt target  = clamp(round(ContextTokens   * max_prompt_tokens / P99(ContextTokens)),
//                          1, max_prompt_tokens)
//   output length  = clamp(round(GeneratedTokens * max_tokens / P99(GeneratedTokens)),
//                          min_tokens, max_tokens)
// with both 99th percentiles (nearest rank) taken over every row of the file, so a request's
// lengths do not depend on --offset or --requests. Arrival offsets are the trace's gaps times
// time_scale (or rescaled so the mean rate over the chosen rows is `rate`).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/status.h"

namespace fmoe::bench {

struct ArrivalRow {
  double time_s = 0;  // Seconds since the epoch (or as written, for a numeric TIMESTAMP).
  int64_t context_tokens = 0;
  int64_t generated_tokens = 0;
};

struct ArrivalTrace {
  std::vector<ArrivalRow> rows;  // File order.
  double context_p99 = 0;        // Over every row of the file.
  double generated_p99 = 0;
};

// Reads the CSV: a header naming TIMESTAMP, ContextTokens and GeneratedTokens (any order), then
// one row per request. TIMESTAMP is "YYYY-MM-DD HH:MM:SS[.fraction]" (UTC) or seconds as a
// number. Errors name the file and line.
Result<ArrivalTrace> LoadArrivals(const std::string& path);

// The `field` of each line of a JSONL file, in file order: a string, or the first element of an
// array of strings (MT-bench's "turns"). Lines without a non-empty one are skipped (counted in
// *skipped when given). Error when none is left.
Result<std::vector<std::string>> LoadPrompts(const std::string& path,
                                             const std::string& field = "prompt",
                                             size_t* skipped = nullptr);

// How a prompt is chosen for each arrival.
enum class PromptMatch {
  kLength,  // The unused prompt whose token count is closest to the scaled ContextTokens (ties:
            // an order shuffled by the seed); when every prompt is used, all become unused again.
  kOrder,   // The prompts in file order (those longer than max_prompt_tokens skipped), wrapping.
};

struct WorkloadOptions {
  int requests = 40;            // Measured requests. Default: 40
  int warmup = 2;               // Requests sent first, not counted. Default: 2
  int offset = 0;               // First trace row (0-based, after the header). Default: 0
  double time_scale = 1.0;      // Multiplies the inter-arrival gaps. Default: 1
  double rate = 0;              // > 0: gaps rescaled to this mean rate (requests/s). Default: 0
  int max_tokens = 64;          // Output length cap. Default: 64
  int min_tokens = 4;           // Output length floor. Default: 4
  int max_prompt_tokens = 128;  // Prompt length cap (tokens, BOS included). Default: 128
  PromptMatch match = PromptMatch::kLength;  // Default: length
  uint64_t seed = 1;                         // Default: 1
};

struct BenchRequest {
  int index = 0;         // 0-based position in the list (warm-up requests first).
  bool warmup = false;   // Sent, not counted.
  size_t trace_row = 0;  // Row of the arrivals file (0-based, after the header).
  double arrival_s = 0;  // Offset from the start of the run.
  int64_t trace_context_tokens = 0;
  int64_t trace_generated_tokens = 0;
  int target_prompt_tokens = 0;  // Scaled ContextTokens.
  int prompt_tokens = 0;         // The chosen prompt's token count.
  size_t prompt_line = 0;        // Index of the prompt in LoadPrompts' list.
  std::string prompt;
  int max_tokens = 0;  // Scaled GeneratedTokens: the length asked for.
};

struct Workload {
  std::vector<BenchRequest> requests;
  double time_scale = 1.0;    // The one applied (derived from `rate` when given).
  size_t prompts_usable = 0;  // Prompts within max_prompt_tokens.
};

// Counts a prompt's tokens as the router will (BOS included); an error skips the prompt.
using TokenCounter = std::function<Result<int>(const std::string& text)>;

Result<Workload> BuildWorkload(const ArrivalTrace& trace, const std::vector<std::string>& prompts,
                               const TokenCounter& count_tokens, const WorkloadOptions& options);

// One JSON line per request (prompt included), so a run can be inspected or repeated.
Status WriteWorkload(const std::string& path, const Workload& workload);

// Nearest-rank percentile (p in (0, 100]) of unsorted values; 0 for none.
double Percentile(std::vector<double> values, double p);

}  // namespace fmoe::bench
