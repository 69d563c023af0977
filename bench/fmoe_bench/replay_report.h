// The serving replay's report (DESIGN section 11): per run, the requests' TTFT and TPOT (p50,
// p90, p99, mean; nearest-rank percentiles), and the cache figures of prefill and decode apart
// (hit rate, stall, MB moved, prefetch precision and recall); the table and CSV rows
// `fmoe-bench replay` prints, and the checks of the design's targets. Pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "bench/fmoe_bench/replay_serve.h"

namespace fmoe::bench {

struct LatencySummary {
  uint64_t count = 0;  // Requests with the figure.
  double p50_ms = 0, p90_ms = 0, p99_ms = 0, mean_ms = 0;
};

// Nearest-rank percentiles and the mean of `ns` (nanoseconds), in milliseconds.
LatencySummary Summarise(std::vector<double> ns);

struct PhaseSummary {
  uint64_t iterations = 0;
  uint64_t units = 0;  // Prefills (prefill) or decode tokens (decode).
  double hit_rate = 0;
  double stall_ms = 0;     // Per unit.
  double loads = 0;        // Experts' worth of bytes moved per unit (cancelled copies in part).
  double mb = 0;           // MB moved per unit.
  double precision = 0;    // Prefetched experts used / prefetches handed to the link.
  double recall = 0;       // Loads a prefetch covered / loads a layer needed.
  double cpu_experts = 0;  // Hybrid: missing experts computed on the CPU per unit.
  double cpu_ms = 0;       // Hybrid: the CPU's time on them per unit.
  // Disk tier (PhaseFigures): loads found in the host cache / loads handed to it; expert reads
  // from disk and their MB per unit; the part of stall_ms with a needed expert still being read
  // from disk per unit (the rest of stall_ms waited for the device link).
  double host_hit_rate = 0;
  double disk_reads = 0;
  double disk_mb = 0;
  double disk_stall_ms = 0;
  // Host-tier prefetch per unit: reads started by a hint (part of disk_reads), and hints not
  // read (an urgent read was waiting, or the use came before the read could end).
  double hinted_reads = 0;
  double hints_not_read = 0;
};

PhaseSummary Summarise(const PhaseFigures& phase, double expert_mb);

struct ServeSummary {
  LatencySummary ttft, tpot;
  PhaseSummary prefill, decode;
  double mean_batch = 0;
  double total_s = 0;   // First arrival to last token.
  bool hybrid = false;  // Run with the CPU path.
  bool disk = false;    // Run with the disk tier.
};

// A run's row label: the policy, with "+cpu" when it ran with the CPU path.
std::string RunLabel(const ServeConfig& config);

ServeSummary Summarise(const ServeResult& result, double expert_mb);

// A text table, one row per (label, summary): TTFT and TPOT p50 / p90 / p99 / mean in ms, then
// prefill and decode hit rate, stall, MB, precision and recall, and the mean batch; when a row
// ran with the CPU path, the experts computed on the CPU per prefill and per decode token; when
// one ran with the disk tier, per prefill and per decode token its host-cache hit rate, expert
// reads from disk (of which hinted) and disk stall (ms; part of the stall column).
std::string ServeTable(const std::vector<std::pair<std::string, ServeSummary>>& rows);

// CSV: the header (no newline), and one row for a run (no newline). Columns are only ever added
// at the end (max_batched_tokens last: 0 for whole prefills), so readers by position still work.
// Runs with the disk tier (`disk`; a row: its config's) add its columns after those: host_budget,
// then per prefill and per decode token the host hit rate, disk reads, disk MB and disk stall ms.
// Then chunk_overhead (expert-aware chunks; 0: the budget's chunks) for every run, and after it,
// for runs with the tier, per prefill and per decode token the hinted reads and the hints not
// read.
std::string ServeCsvHeader(bool disk = false);
std::string ServeCsvRow(const ServeConfig& config, const ServeSummary& s);

// The design's targets at one (mode, batch): `fmoe` against the other policies that can be built
// (everything but the oracle), against the baselines among them (also leaving out fmoe-traj and
// fmoe-traj-sem, which are fmoe's cache with other matching), LRU and the oracle. Missing
// policies are skipped.
struct TargetCheck {
  std::string best_tpot, best_ttft;  // Lowest mean TPOT / TTFT of the realizable policies.
  double fmoe_tpot_ms = 0, best_tpot_ms = 0;
  double fmoe_ttft_ms = 0, best_ttft_ms = 0;
  std::string baseline_tpot, baseline_ttft;  // The same among the baselines.
  double baseline_tpot_ms = 0, baseline_ttft_ms = 0;
  double decode_stall_vs_lru = 0;  // fmoe's decode stall per token / LRU's.
  double tpot_vs_oracle = 0;       // fmoe's mean TPOT / the oracle's.
  double ttft_vs_oracle = 0;
  double decode_stall_vs_oracle = 0;
};
TargetCheck CheckTargets(const std::vector<std::pair<std::string, ServeSummary>>& policies);

// Issue 18's targets at one (mode, batch): fmoe with the CPU path against LRU without it and
// with it (decode stall per token), from the rows without (`off`) and with it (`on`, labelled by
// the bare policy names). 0 where a policy is missing.
struct HybridCheck {
  double fmoe_vs_lru = 0;         // fmoe with / LRU without (target <= 0.4).
  double fmoe_vs_lru_hybrid = 0;  // fmoe with / LRU with (target <= 0.95).
  double lru_gain = 0;            // LRU with / without.
  double fmoe_gain = 0;           // fmoe with / without.
};
HybridCheck CheckHybridTargets(const std::vector<std::pair<std::string, ServeSummary>>& off,
                               const std::vector<std::pair<std::string, ServeSummary>>& on);

}  // namespace fmoe::bench
