// The serving replay's CPU path (hybrid execution): an expert missing from the cache
// may be computed on the CPU from its host copy instead of crossing the link. CpuModel says how
// long the CPU takes for one expert at t tokens; SplitLayer sends each missing expert of a layer
// to the link or to the CPU so that the layer has every expert's result soonest. Pure values and
// functions; no threads. replay_serve.cc applies the split per layer (bench/README.md).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace fmoe::bench {

// One expert on the CPU at `tokens` tokens routed to it.
struct CpuExpertPoint {
  double tokens = 0;
  double us = 0;
};

// How long the CPU takes for one expert. Off by default. The CPU is one queue: it computes one
// expert at a time, each with every core (a decode expert is a matrix-vector product bound by
// host memory bandwidth, which more experts at once would only share).
struct CpuModel {
  // Measured: piecewise linear in the expert's tokens through these points (tokens ascending,
  // >= 1), the first point's time below it, the last segment's slope beyond. Used when set.
  std::vector<CpuExpertPoint> curve;
  // Otherwise c: the CPU time for one token's expert / one expert's load time (the c =
  // 0.5 and 1.0). Flat up to `knee_tokens` (memory-bound), then linear in the tokens
  // (compute-bound): c * load * max(1, tokens / knee_tokens). Default: 0 (off)
  double factor = 0;
  double knee_tokens = 16;  // Default: 16
  std::string source;       // Where `curve` comes from (the report names it); may be empty.

  bool enabled() const { return !curve.empty() || factor > 0; }
  // One expert at `tokens` tokens (>= 1 ns); `load_ns` is the time model's load.
  int64_t ExpertNs(uint64_t tokens, int64_t load_ns) const;
  // "c = 0.50 of a load (5.51 ms at 1 token), flat to 16 tokens" or the curve's points.
  std::string Describe(int64_t load_ns) const;
};

// kInvalidArgument naming the field: points not ascending or below 1 token, a time not positive,
// a factor or knee out of range.
Status ValidateCpuModel(const CpuModel& model);

// "1:5500,4:5600,32:9000" (TOKENS:MICROSECONDS) -> points. kInvalidArgument naming the bad item.
Result<std::vector<CpuExpertPoint>> ParseCpuExpertTimes(std::string_view text);

// One expert a layer needs that is not resident when the layer starts.
struct MissingExpert {
  uint32_t expert = 0;
  int64_t link_ns = 0;  // Link time it still needs: a whole load, or what its prefetch has left.
  int64_t cpu_ns = 0;   // CPU time for its tokens.
};

// Where a layer's missing experts go, and when each side is done (from the layer's start).
struct LayerSplit {
  std::vector<uint32_t> cpu;  // Experts computed on the CPU, ascending; the rest use the link.
  int64_t link_done_ns = 0;   // Last load finished (0 when nothing loads).
  int64_t cpu_done_ns = 0;    // Last CPU expert finished (0 when none runs there).
  int64_t cpu_busy_ns = 0;    // CPU time spent on this layer's experts.
  int64_t ready_ns() const { return link_done_ns > cpu_done_ns ? link_done_ns : cpu_done_ns; }
};

// Splits `missing` between the link and the CPU so that both are done soonest. The link starts
// the layer's loads at `link_free_ns` and copies them one after another (what is queued before
// them: on-demand loads of the layer go ahead of prefetches, so 0 in the replay); the CPU starts
// at `cpu_free_ns` and computes them one after another. Candidates: the experts ordered by CPU
// time over link time (fewest tokens first), the first k to the CPU, k = 0..n; the one that is
// done first wins, the fewest on the CPU on ties (a loaded expert stays in the cache). k = 0
// (everything over the link) is a candidate, so a split is never later than no CPU at all.
LayerSplit SplitLayer(std::span<const MissingExpert> missing, int64_t link_free_ns,
                      int64_t cpu_free_ns);

}  // namespace fmoe::bench
