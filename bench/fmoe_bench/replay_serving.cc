// fmoe-bench replay --model serving: every policy and the oracle over a trace's requests served
// as the engine serves them (replay_serve.h), at each max batch, cache budget and prefetch
// distance, offline and online, in one run. One table per (mode, batch, budget, d) on stdout,
// every row as CSV, the targets of the design at the main point, and TTFT and TPOT against the
// budget as a PNG through gnuplot.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "bench/fmoe_bench/plot.h"
#include "bench/fmoe_bench/replay_command.h"
#include "bench/fmoe_bench/replay_core.h"
#include "bench/fmoe_bench/replay_report.h"
#include "bench/fmoe_bench/replay_serve.h"
#include "bench/fmoe_bench/replay_workload.h"
#include "common/model/expert_trace.h"

namespace fmoe::bench {
namespace {

struct ServeJob {
  ServeConfig config;
  const MapStore* warm = nullptr;
  Result<ServeResult> result = Internal("not run");
  ServeSummary summary;
};

std::string ModeName(const ServeConfig& c) { return c.online ? "online" : "offline"; }

// ", max batched tokens N" (", prefills whole" for 0) when the run asked for chunked prefill.
std::string ChunkName(uint32_t max_batched_tokens, bool chunking, double overhead = 0) {
  if (!chunking) return "";
  if (max_batched_tokens == 0) return ", prefills whole";
  std::string name = ", max batched tokens " + std::to_string(max_batched_tokens);
  if (overhead > 0) {
    char text[32];
    std::snprintf(text, sizeof(text), "%g", overhead);
    name += std::string(", expert-aware (overhead ") + text + ")";
  }
  return name;
}

}  // namespace

int RunServingReplay(const ReplayOptions& o) {
  auto trace = ReadTrace(o.trace);
  if (!trace.ok()) {
    std::fprintf(stderr, "fmoe-bench replay: %s\n", trace.status().message().c_str());
    return 2;
  }
  const TraceHeader& h = trace->header;
  auto kind = o.trace_kind == "auto" ? DetectTraceKind(h) : ParseTraceKind(o.trace_kind);
  if (!kind.ok()) {
    std::fprintf(stderr, "fmoe-bench replay: %s\n", kind.status().message().c_str());
    return 2;
  }
  const bool chunking = std::any_of(o.max_batched_tokens.begin(), o.max_batched_tokens.end(),
                                    [](uint32_t n) { return n > 0; });
  if (chunking && *kind != TraceKind::kPromptPositions) {
    std::fprintf(stderr,
                 "fmoe-bench replay: --max-batched-tokens > 0 (chunked prefill) needs each prompt "
                 "position's routing; the trace kind %s has none (%s): use 0\n",
                 std::string(TraceKindName(*kind)).c_str(),
                 *kind == TraceKind::kIterations ? "a prefill's routing is recorded whole"
                                                 : "no prefill is recorded");
    return 2;
  }
  TraceRequests grouped = GroupByRequest(*trace);
  ServeWorkloadOptions wo;
  wo.kind = *kind;
  wo.decode_share = o.decode_share;
  auto workload = BuildServeWorkload(grouped, wo);
  if (!workload.ok()) {
    std::fprintf(stderr, "fmoe-bench replay: %s\n", workload.status().message().c_str());
    return 2;
  }
  uint32_t n = static_cast<uint32_t>(workload->requests.size());
  if (o.requests != 0) n = std::min(n, o.requests);
  const uint32_t n_train = static_cast<uint32_t>(std::floor(n * o.train_fraction));
  std::vector<uint32_t> train, test;
  for (uint32_t r = 0; r < n; ++r) (r < n_train ? train : test).push_back(r);
  if (o.test_requests != 0 && test.size() > o.test_requests) test.resize(o.test_requests);
  if (test.empty()) {
    std::fprintf(stderr, "fmoe-bench replay: no test requests (%u requests, train fraction %g)\n",
                 n, o.train_fraction);
    return 2;
  }
  std::optional<ArrivalTrace> arrival_trace;
  if (!o.arrivals.empty()) {
    auto a = LoadArrivals(o.arrivals);
    if (!a.ok()) {
      std::fprintf(stderr, "fmoe-bench replay: %s\n", a.status().message().c_str());
      return 2;
    }
    arrival_trace = std::move(*a);
  }
  ArrivalOptions ao;
  ao.offset = o.arrival_offset;
  ao.rate = o.rate;
  ao.time_scale = o.time_scale;
  auto arrivals = ArrivalOffsets(arrival_trace ? &*arrival_trace : nullptr, test.size(), ao);
  if (!arrivals.ok()) {
    std::fprintf(stderr, "fmoe-bench replay: %s\n", arrivals.status().message().c_str());
    return 2;
  }

  std::vector<std::string> notes;
  const std::vector<std::string> policies = RunnablePolicies(*trace, o.policies, &notes);
  if (*kind == TraceKind::kPromptPositions) {
    notes.push_back("the trace has prompt routing only: each prompt's last " +
                    Fixed(100 * o.decode_share, 0) +
                    "% of positions stand in for its decode steps (one token each); the rest is "
                    "its prefill");
  }
  if (*kind == TraceKind::kDecodePositions) {
    notes.push_back(
        "the trace has decode steps only (no prefill recorded): TTFT is the first decode "
        "step's, queueing included; every iteration counts as decode");
  }

  // The workload, as run.
  uint64_t prompt_tokens = 0, decode_steps = 0, union_sum = 0, prefills = 0;
  for (uint32_t r : test) {
    const ServeRequest& req = workload->requests[r];
    prompt_tokens += req.prompt_tokens;
    decode_steps += req.decode_steps();
    if (req.has_prefill) {
      ++prefills;
      for (uint32_t l = 0; l < h.num_layers; ++l) union_sum += req.steps[0]->used(l).size();
    }
  }
  const uint32_t threads =
      o.threads ? o.threads : std::max(1u, std::thread::hardware_concurrency());
  std::printf("trace %s: %s, %s; L=%u J=%u K=%u h=%u; replayed as %s\n", o.trace.c_str(),
              h.model.c_str(), h.iteration_unit.c_str(), h.num_layers, h.num_experts, h.top_k,
              h.hidden, std::string(TraceKindName(*kind)).c_str());
  std::printf(
      "requests: %u train, %zu test (%u in all); test: %llu prefills of %llu prompt tokens "
      "(%.1f of %u experts per layer each), %llu decode steps\n",
      n_train, test.size(), n, static_cast<unsigned long long>(prefills),
      static_cast<unsigned long long>(prompt_tokens),
      prefills ? static_cast<double>(union_sum) / (prefills * h.num_layers) : 0.0, h.num_experts,
      static_cast<unsigned long long>(decode_steps));
  if (arrival_trace) {
    const double span = arrivals->empty() ? 0 : static_cast<double>(arrivals->back()) / 1e9;
    std::printf("arrivals: %s rows %u.., %.1f s for %zu requests (%.2f requests/s)\n",
                o.arrivals.c_str(), o.arrival_offset, span, test.size(),
                span > 0 ? static_cast<double>(test.size() - 1) / span : 0.0);
  } else {
    std::printf("arrivals: every request at once\n");
  }
  std::printf("time model %s\n  (%s)\nstore capacity %u; %u threads\n", o.time.Describe().c_str(),
              o.time.source.c_str(), o.store_capacity, threads);
  std::vector<bool> hybrids;
  if (o.hybrid != "on") hybrids.push_back(false);
  if (o.hybrid != "off") hybrids.push_back(true);
  if (o.hybrid != "off") {
    std::printf("CPU path (runs labelled +cpu): %s\n", o.cpu.Describe(o.time.LoadNs()).c_str());
  }
  if (o.disk.enabled()) {
    std::printf("disk tier (simulated): %s\n",
                o.disk.Describe(h.num_layers * h.num_experts, o.time.expert_mb * 1e6).c_str());
  }
  std::fflush(stdout);

  // Configurations: budgets at the main distance, distances at the main budget.
  std::vector<uint32_t> distances = o.distances;
  if (distances.empty()) distances = {o.main_distance};
  std::set<std::pair<double, uint32_t>> points;
  for (double b : o.budgets) {
    if (o.full_grid) {
      for (uint32_t d : distances) points.insert({b, d});
    } else {
      points.insert({b, o.main_distance});
    }
  }
  for (uint32_t d : distances) points.insert({o.main_budget, d});

  std::map<uint32_t, std::unique_ptr<MapStore>> warm;
  std::vector<std::unique_ptr<ServeJob>> jobs;
  for (const auto& mode : o.modes) {
    for (uint32_t batch : o.batches) {
      for (uint32_t chunk : o.max_batched_tokens) {
        for (const auto& [b, d] : points) {
          for (const auto& p : policies) {
            for (bool hybrid : hybrids) {
              auto job = std::make_unique<ServeJob>();
              ServeConfig& c = job->config;
              c.policy = p;
              c.max_batched_tokens = chunk;
              c.chunk_overhead = o.chunk_overhead;
              c.hybrid = hybrid;
              c.cpu = o.cpu;
              c.budget = b;
              c.distance = d;
              c.online = mode == "online";
              c.max_batch = batch;
              c.time = o.time;
              c.store_capacity = o.store_capacity;
              c.max_inflight_prefetches = o.inflight;
              c.disk = o.disk;
              if (UsesMapService(p) && !c.online) warm[d] = nullptr;
              jobs.push_back(std::move(job));
            }
          }
        }
      }
    }
  }
  const Status built = BuildWarmStores(
      threads, [&](uint32_t d) { return WarmServeStore(*workload, train, o.store_capacity, d); },
      &warm);
  if (!built.ok()) {
    std::fprintf(stderr, "fmoe-bench replay: %s\n", built.message().c_str());
    return 1;
  }
  RunJobs(
      threads, jobs, warm,
      [&](ServeJob& job) {
        job.result = RunServeReplay(*workload, train, test, *arrivals, job.config, job.warm);
        if (job.result.ok()) job.summary = Summarise(*job.result, o.time.expert_mb);
      },
      [&](const ServeJob& job) {
        return ModeName(job.config) + " batch " + std::to_string(job.config.max_batch) + " " +
               RunLabel(job.config) + " budget " + Fixed(job.config.budget, 2) + " d " +
               std::to_string(job.config.distance) +
               ChunkName(job.config.max_batched_tokens, chunking, job.config.chunk_overhead);
      });

  // Tables, one per (mode, batch, budget, d), and the CSV.
  std::ostringstream csv;
  csv << ServeCsvHeader(o.disk.enabled()) << '\n';
  bool failed = false;
  using Key = std::tuple<std::string, uint32_t, double, uint32_t, uint32_t>;
  std::map<Key, std::vector<std::pair<std::string, ServeSummary>>> groups;
  std::vector<Key> order;
  for (const auto& job : jobs) {
    const ServeConfig& c = job->config;
    const Key key{ModeName(c), c.max_batch, c.budget, c.distance, c.max_batched_tokens};
    if (!groups.contains(key)) order.push_back(key);
    auto& rows = groups[key];
    if (!job->result.ok()) {
      failed = true;
      std::printf("%s batch %u budget %.2f d %u%s %s failed: %s\n", ModeName(c).c_str(),
                  c.max_batch, c.budget, c.distance,
                  ChunkName(c.max_batched_tokens, chunking, c.chunk_overhead).c_str(),
                  RunLabel(c).c_str(), job->result.status().message().c_str());
      continue;
    }
    if (c.policy == "oracle" && job->result->oracle_forced) {
      notes.push_back(RunLabel(c) + " at " + ModeName(c) + " batch " + std::to_string(c.max_batch) +
                      " budget " + Fixed(c.budget, 2) +
                      ChunkName(c.max_batched_tokens, chunking, c.chunk_overhead) +
                      ": its batches still changed after " +
                      std::to_string(job->result->oracle_passes - 1) +
                      " runs; the last kept to the previous run's batches");
    }
    rows.emplace_back(RunLabel(c), job->summary);
    csv << ServeCsvRow(c, job->summary) << '\n';
  }
  for (const Key& key : order) {
    const auto& [mode, batch, budget, d, chunk] = key;
    std::printf("\n%s, max batch %u, budget %.2f, d=%u%s\n%s", mode.c_str(), batch, budget, d,
                ChunkName(chunk, chunking).c_str(), ServeTable(groups[key]).c_str());
  }
  for (const auto& note : notes) std::printf("note: %s\n", note.c_str());

  // The design's targets at the main point.
  std::printf("\ntargets at budget %.2f, d=%u (means over requests):\n", o.main_budget,
              o.main_distance);
  for (const Key& key : order) {
    const auto& [mode, batch, budget, d, chunk] = key;
    if (budget != o.main_budget || d != o.main_distance) continue;
    const std::string at = mode + " batch " + std::to_string(batch) + ChunkName(chunk, chunking);
    // The design's targets compare runs without the CPU path (or only with it, labelled bare).
    std::vector<std::pair<std::string, ServeSummary>> off, on;
    for (const auto& [label, s] : groups[key]) {
      if (s.hybrid) {
        on.emplace_back(label.substr(0, label.size() - 4), s);
      } else {
        off.emplace_back(label, s);
      }
    }
    if (!off.empty() && !on.empty()) {
      const HybridCheck hc = CheckHybridTargets(off, on);
      std::printf(
          "  %s, CPU path: fmoe+cpu decode stall / lru %.3f (target <= 0.4), / lru+cpu "
          "%.3f (target <= 0.95); with / without: lru %.3f, fmoe %.3f\n",
          at.c_str(), hc.fmoe_vs_lru, hc.fmoe_vs_lru_hybrid, hc.lru_gain, hc.fmoe_gain);
    }
    const TargetCheck t = CheckTargets(off.empty() ? on : off);
    if (t.fmoe_tpot_ms == 0 && t.fmoe_ttft_ms == 0) continue;
    std::printf(
        "  %s: fmoe TPOT %.3f ms, TTFT %.1f ms; lowest of all realizable: TPOT %s "
        "(%.3f), TTFT %s (%.1f); of the baselines: TPOT %s (%.3f), TTFT %s (%.1f); fmoe decode "
        "stall / lru %.3f; fmoe / oracle: TPOT %.2f, TTFT %.2f, decode stall %.2f\n",
        at.c_str(), t.fmoe_tpot_ms, t.fmoe_ttft_ms, t.best_tpot.c_str(), t.best_tpot_ms,
        t.best_ttft.c_str(), t.best_ttft_ms, t.baseline_tpot.c_str(), t.baseline_tpot_ms,
        t.baseline_ttft.c_str(), t.baseline_ttft_ms, t.decode_stall_vs_lru, t.tpot_vs_oracle,
        t.ttft_vs_oracle, t.decode_stall_vs_oracle);
  }

  // Chunked prefill: each policy's latencies against the token budget at the main point, and how
  // much the largest max batch's mean TPOT is above max batch 1's.
  const bool sweep = chunking || o.max_batched_tokens.size() > 1;
  const auto find = [&](const std::string& mode, uint32_t batch, uint32_t chunk,
                        const std::string& label) -> const ServeSummary* {
    auto g = groups.find(Key{mode, batch, o.main_budget, o.main_distance, chunk});
    if (g == groups.end()) return nullptr;
    for (const auto& [l, summary] : g->second) {
      if (l == label) return &summary;
    }
    return nullptr;
  };
  const uint32_t top_batch = *std::max_element(o.batches.begin(), o.batches.end());
  const bool ratio =
      top_batch > 1 && std::find(o.batches.begin(), o.batches.end(), 1u) != o.batches.end();
  if (sweep) {
    std::printf(
        "\nchunked prefill at budget %.2f, d=%u: ms, mean / p99 (max batched tokens 0: prefills "
        "whole)%s\n",
        o.main_budget, o.main_distance,
        ratio
            ? ("; ratio: mean TPOT at max batch " + std::to_string(top_batch) + " / at max batch 1")
                  .c_str()
            : "");
    for (const auto& mode : o.modes) {
      for (const auto& p : policies) {
        for (bool hybrid : hybrids) {
          ServeConfig lc;
          lc.policy = p;
          lc.hybrid = hybrid;
          const std::string label = RunLabel(lc);
          for (uint32_t chunk : o.max_batched_tokens) {
            std::string line = "  " + mode + " " + label + " tokens " + std::to_string(chunk) + ":";
            for (uint32_t batch : o.batches) {
              const ServeSummary* x = find(mode, batch, chunk, label);
              if (x == nullptr) continue;
              line += " batch " + std::to_string(batch) + " TPOT " + Fixed(x->tpot.mean_ms, 1) +
                      " / " + Fixed(x->tpot.p99_ms, 1) + ", TTFT " + Fixed(x->ttft.mean_ms, 0) +
                      " / " + Fixed(x->ttft.p99_ms, 0) + ";";
            }
            const ServeSummary* one = find(mode, 1, chunk, label);
            const ServeSummary* top = find(mode, top_batch, chunk, label);
            if (ratio && one != nullptr && top != nullptr && one->tpot.mean_ms > 0) {
              line += " ratio " + Fixed(top->tpot.mean_ms / one->tpot.mean_ms, 2);
            }
            std::printf("%s\n", line.c_str());
          }
        }
      }
    }
  }

  if (!o.csv.empty()) {
    std::ofstream out(o.csv);
    out << csv.str();
    if (!out) {
      std::fprintf(stderr, "fmoe-bench replay: cannot write %s\n", o.csv.c_str());
      return 1;
    }
    std::printf("\nwrote %s\n", o.csv.c_str());
  }
  if (!o.png.empty()) {
    // Per (mode, batch): mean TTFT and mean TPOT against the budget at the main distance; with
    // several token budgets (chunked prefill), against those at the main budget instead.
    const bool by_chunk = o.max_batched_tokens.size() > 1;
    const std::string xlabel =
        by_chunk ? "max batched tokens (0: prefills whole)" : "cache budget (fraction of experts)";
    std::vector<PlotPanel> panels;
    for (const auto& mode : o.modes) {
      for (uint32_t batch : o.batches) {
        const std::string at = mode + ", batch " + std::to_string(batch);
        PlotPanel ttft{at + ": mean TTFT", xlabel, "TTFT ms", true, {}};
        PlotPanel tpot{at + ": mean TPOT", xlabel, "TPOT ms", false, {}};
        for (const auto& p : policies) {
          PlotSeries s1{p, {}}, s2{p, {}};
          for (const auto& job : jobs) {
            const ServeConfig& c = job->config;
            // The plot shows the runs without the CPU path (with it, when only those ran).
            if (ModeName(c) != mode || c.max_batch != batch || c.policy != p ||
                c.hybrid != (o.hybrid == "on") || c.distance != o.main_distance ||
                !job->result.ok() || (by_chunk && c.budget != o.main_budget) ||
                (!by_chunk && c.max_batched_tokens != o.max_batched_tokens.front())) {
              continue;
            }
            const double x = by_chunk ? c.max_batched_tokens : c.budget;
            s1.points.push_back({x, job->summary.ttft.mean_ms});
            s2.points.push_back({x, job->summary.tpot.mean_ms});
          }
          ttft.series.push_back(s1);
          tpot.series.push_back(s2);
        }
        panels.push_back(ttft);
        panels.push_back(tpot);
      }
    }
    const std::string title =
        "Serving replay: " + h.model + ", " + std::to_string(test.size()) + " test requests (" +
        std::string(TraceKindName(*kind)) + "); time model " + o.time.name + " (expert load = " +
        Fixed(static_cast<double>(o.time.LoadNs()) / static_cast<double>(o.time.LayerNs(1)), 1) +
        " layers of 1-token compute)";
    const uint32_t rows = static_cast<uint32_t>(o.modes.size() * o.batches.size());
    Status s = WritePlot(o.png, title, panels, rows, 2);
    if (s.ok()) {
      std::printf("wrote %s\n", o.png.c_str());
    } else {
      std::printf("no plot: %s\n", s.message().c_str());
    }
  }
  return failed ? 1 : 0;
}

}  // namespace fmoe::bench
