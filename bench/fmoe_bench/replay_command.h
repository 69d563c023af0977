// fmoe-bench replay's options, shared by its two models of a trace: `serving` (replay_serve.h:
// a prefill per request, decode steps, continuous batching by an arrival trace, TTFT and TPOT)
// and `positions` (replay_core.h: each record one iteration, one request at a time, as the
// first replay did; kept to compare with the fMoE paper's figures). replay.cc maps the flags.
#pragma once

#include <atomic>
#include <cstdint>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "bench/fmoe_bench/format.h"
#include "bench/fmoe_bench/replay_core.h"
#include "bench/fmoe_bench/replay_hybrid.h"
#include "bench/fmoe_bench/replay_time.h"
#include "bench/fmoe_bench/sim_tier.h"
#include "common/model/expert_trace.h"
#include "common/policy_names.h"
#include "common/status.h"
#include "map_service/map_store.h"

namespace fmoe::bench {

struct ReplayOptions {
  std::string trace;
  std::string model = "serving";                         // serving or positions. Default: serving
  std::vector<std::string> policies = AllPolicyNames();  // Every name of common/policy_names.h.
  std::vector<double> budgets = {0.1, 0.25, 0.5, 1.0};
  std::vector<uint32_t> distances;  // Default: the main distance (serving), 1..6 (positions).
  double main_budget = 0.25;
  uint32_t main_distance = 3;
  bool full_grid = false;
  std::vector<std::string> modes = {"offline", "online"};
  uint32_t requests = 0;
  double train_fraction = 0.7;
  uint32_t test_requests = 0;
  uint32_t store_capacity = 1000;
  uint32_t inflight = 2;
  uint32_t threads = 0;
  std::string csv;
  std::string png;
  TimeModel time;  // Resolved from --time-model and the flags that change it.

  // serving only.
  std::vector<uint32_t> batches = {1, 8};
  // Chunked prefill: tokens per iteration, each value a run (0: prefills whole). Default: 0
  std::vector<uint32_t> max_batched_tokens = {0};
  // Expert-aware chunks (gpu_worker/core/chunk_planner.h): a chunk grows while cutting the
  // prompt at its size costs more than (1 + this) x the prompt whole; 0: the budget's chunks.
  // Default: 0
  double chunk_overhead = 0;
  std::string trace_kind = "auto";
  double decode_share = 0.15;
  std::string arrivals;  // Empty: every request arrives at once.
  uint32_t arrival_offset = 0;
  double rate = 0;
  double time_scale = 1.0;
  // Hybrid execution (replay_hybrid.h): off, on, or both (every run with and without it).
  std::string hybrid = "off";  // Default: off
  CpuModel cpu;                // From --cpu-factor, --cpu-knee-tokens, --cpu-expert-us.
  // The disk tier: --host-budget (unset: none), --disk-gbps, --disk-latency-us,
  // --disk-queue-depth, --host-start.
  DiskModel disk;
};

// The policies of `asked` that `trace` can run (speculative needs the speculative predictions
// only a worker's trace has), with a note in *notes for each left out and for a trace without
// semantic embeddings (fmoe's semantic search is then off). replay.cc.
std::vector<std::string> RunnablePolicies(const Trace& trace, const std::vector<std::string>& asked,
                                          std::vector<std::string>* notes);

int RunServingReplay(const ReplayOptions& options);   // replay_serving.cc
int RunPositionReplay(const ReplayOptions& options);  // replay.cc

// What both replays share to run their jobs.

// Runs fn(0) .. fn(count - 1) on `threads` threads.
template <class Fn>
void Parallel(uint32_t threads, size_t count, Fn&& fn) {
  std::atomic<size_t> next{0};
  std::vector<std::thread> pool;
  for (uint32_t t = 0; t < threads; ++t) {
    pool.emplace_back([&] {
      for (size_t i; (i = next.fetch_add(1)) < count;) fn(i);
    });
  }
  for (auto& t : pool) t.join();
}

// Fills every entry of `warm` (a warm store per prefetch distance, for the offline runs of the
// map-service policies) with build(distance), the distances in parallel; the first failure,
// with "warming the store: " before it. replay.cc.
using WarmStores = std::map<uint32_t, std::unique_ptr<MapStore>>;
Status BuildWarmStores(uint32_t threads, const std::function<Result<MapStore>(uint32_t)>& build,
                       WarmStores* warm);

// Points each offline job of a map-service policy at its distance's warm store, then runs
// run(job) for every job on `threads` threads, printing "[i/n] <label(job)>" (and ": <error>"
// when job.result failed) to stderr as each ends. A job has `config` (online, policy,
// distance), `warm` and `result`.
template <class Job, class Run, class Label>
void RunJobs(uint32_t threads, std::vector<std::unique_ptr<Job>>& jobs, const WarmStores& warm,
             Run&& run, Label&& label) {
  for (auto& job : jobs) {
    if (UsesMapService(job->config.policy) && !job->config.online) {
      job->warm = warm.at(job->config.distance).get();
    }
  }
  std::mutex print_mu;
  std::atomic<size_t> finished{0};
  Parallel(threads, jobs.size(), [&](size_t i) {
    auto& job = *jobs[i];
    run(job);
    std::lock_guard<std::mutex> lock(print_mu);
    std::fprintf(stderr, "[%zu/%zu] %s%s\n", ++finished, jobs.size(), label(job).c_str(),
                 job.result.ok() ? "" : (": " + job.result.status().message()).c_str());
  });
}

}  // namespace fmoe::bench
