// fmoe-bench replay: every cache policy and the oracle over one trace, at several cache budgets
// and prefetch distances, offline (map store and caches warmed on a train split, measured on the
// test split) and online (empty store, learning as it goes, on the same test split). The flags
// (one place for both models), the serving model's dispatch (replay_serving.cc), and the
// per-position model of replay_core.h: each record one iteration, one request at a time. One
// table on stdout, the same rows as CSV, a PNG through gnuplot.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>

#include "bench/fmoe_bench/commands.h"
#include "bench/fmoe_bench/plot.h"
#include "bench/fmoe_bench/replay_command.h"
#include "bench/fmoe_bench/replay_core.h"
#include "common/model/expert_trace.h"
#include "common/policy_names.h"

namespace fmoe::bench {
namespace {

struct Job {
  ReplayConfig config;
  const MapStore* warm = nullptr;
  Result<ReplayResult> result = Internal("not run");
};

double PerToken(double v, uint64_t tokens) { return tokens ? v / static_cast<double>(tokens) : 0; }

}  // namespace

std::vector<std::string> RunnablePolicies(const Trace& trace, const std::vector<std::string>& asked,
                                          std::vector<std::string>* notes) {
  bool has_speculation = false;
  for (const auto& it : trace.iterations) has_speculation |= !it.speculation.empty();
  std::vector<std::string> policies;
  for (const auto& p : asked) {
    if (p == "speculative" && !has_speculation) {
      notes->push_back(
          "speculative: not run (the trace has no speculative predictions: they need the "
          "model's hidden states, which only a trace the worker recorded has)");
      continue;
    }
    policies.push_back(p);
  }
  if (trace.header.hidden == 0) {
    notes->push_back("the trace has no semantic embeddings: fmoe's semantic search is off");
  }
  return policies;
}

int RunPositionReplay(const ReplayOptions& o) {
  auto trace = ReadTrace(o.trace);
  if (!trace.ok()) {
    std::fprintf(stderr, "fmoe-bench replay: %s\n", trace.status().message().c_str());
    return 2;
  }
  const TraceHeader& h = trace->header;
  TraceRequests requests = GroupByRequest(*trace);
  uint32_t n = static_cast<uint32_t>(requests.requests.size());
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
  std::vector<std::string> notes;
  const std::vector<std::string> policies = RunnablePolicies(*trace, o.policies, &notes);

  // Configurations: budgets at the main distance, distances at the main budget.
  std::vector<uint32_t> distances = o.distances;
  if (distances.empty()) distances = {1, 2, 3, 4, 5, 6};
  std::set<std::pair<double, uint32_t>> points;
  for (double b : o.budgets) {
    if (o.full_grid) {
      for (uint32_t d : distances) points.insert({b, d});
    } else {
      points.insert({b, o.main_distance});
    }
  }
  for (uint32_t d : distances) points.insert({o.main_budget, d});

  // One warm store per distance (offline fmoe policies).
  std::map<uint32_t, std::unique_ptr<MapStore>> warm;
  const bool any_fmoe = std::any_of(policies.begin(), policies.end(), UsesMapService);
  const bool offline = std::find(o.modes.begin(), o.modes.end(), "offline") != o.modes.end();
  std::vector<std::unique_ptr<Job>> jobs;
  for (const auto& mode : o.modes) {
    for (const auto& [b, d] : points) {
      for (const auto& p : policies) {
        auto job = std::make_unique<Job>();
        job->config.policy = p;
        job->config.budget = b;
        job->config.distance = d;
        job->config.online = mode == "online";
        job->config.layer_ns = o.time.LayerNs(1);
        job->config.load_ns = o.time.LoadNs();
        job->config.store_capacity = o.store_capacity;
        job->config.max_inflight_prefetches = o.inflight;
        if (UsesMapService(p) && !job->config.online) warm[d] = nullptr;
        jobs.push_back(std::move(job));
      }
    }
  }
  const uint32_t threads =
      o.threads ? o.threads : std::max(1u, std::thread::hardware_concurrency());
  std::printf("trace %s: %s, %s; L=%u J=%u K=%u h=%u\n", o.trace.c_str(), h.model.c_str(),
              h.iteration_unit.c_str(), h.num_layers, h.num_experts, h.top_k, h.hidden);
  const double layer_ms = static_cast<double>(o.time.LayerNs(1)) / 1e6;
  const double load_ms = static_cast<double>(o.time.LoadNs()) / 1e6;
  std::printf(
      "requests: %u train, %zu test (%u in all); per-position model; link (time model %s): layer "
      "%.3f ms, expert load %.3f ms (ratio %.2f); store capacity %u; %u threads\n",
      n_train, test.size(), n, o.time.name.c_str(), layer_ms, load_ms, load_ms / layer_ms,
      o.store_capacity, threads);
  std::fflush(stdout);

  if (any_fmoe && offline) {
    const Status built = BuildWarmStores(
        threads, [&](uint32_t d) { return WarmStore(requests, train, o.store_capacity, d); },
        &warm);
    if (!built.ok()) {
      std::fprintf(stderr, "fmoe-bench replay: %s\n", built.message().c_str());
      return 1;
    }
  }
  RunJobs(
      threads, jobs, warm,
      [&](Job& job) { job.result = RunReplay(requests, train, test, job.config, job.warm); },
      [](const Job& job) {
        return std::string(job.config.online ? "online " : "offline ") + job.config.policy +
               " budget " + Fixed(job.config.budget, 2) + " d " +
               std::to_string(job.config.distance);
      });

  // The table and the CSV.
  std::ostringstream csv;
  csv << "mode,budget,distance,policy,tokens,hit_rate,stall_ms_per_token,ms_per_token,"
         "precision,recall,loads_per_token,mb_per_token,late_prefetches,prefetches_issued,"
         "prefetches_used,on_demand_loads,match_score,wall_s\n";
  std::printf("\n%-7s %6s %2s %-13s %7s %11s %9s %9s %7s %9s %9s\n", "mode", "budget", "d",
              "policy", "hit%", "stall ms/t", "ms/token", "precision", "recall", "loads/tok",
              "MB/tok");
  bool failed = false;
  std::string last_group;
  for (const auto& job : jobs) {
    const ReplayConfig& c = job->config;
    const std::string mode = c.online ? "online" : "offline";
    const std::string group = mode + Fixed(c.budget, 2) + std::to_string(c.distance);
    if (group != last_group && !last_group.empty()) std::printf("\n");
    last_group = group;
    if (!job->result.ok()) {
      failed = true;
      std::printf("%-7s %6.2f %2u %-13s failed: %s\n", mode.c_str(), c.budget, c.distance,
                  c.policy.c_str(), job->result.status().message().c_str());
      continue;
    }
    const ReplayResult& r = *job->result;
    const double stall = PerToken(r.stall_ns, r.tokens) / 1e6;
    const double per_token = PerToken(r.total_ns, r.tokens) / 1e6;
    const double loads = PerToken(static_cast<double>(r.loads), r.tokens);
    std::printf("%-7s %6.2f %2u %-13s %7.2f %11.3f %9.3f %9.3f %7.3f %9.3f %9.1f\n", mode.c_str(),
                c.budget, c.distance, c.policy.c_str(), 100 * r.hit_rate(), stall, per_token,
                r.precision(), r.recall(), loads, loads * o.time.expert_mb);
    csv << mode << ',' << Fixed(c.budget, 2) << ',' << c.distance << ',' << c.policy << ','
        << r.tokens << ',' << Fixed(r.hit_rate(), 5) << ',' << Fixed(stall, 4) << ','
        << Fixed(per_token, 4) << ',' << Fixed(r.precision(), 4) << ',' << Fixed(r.recall(), 4)
        << ',' << Fixed(loads, 4) << ',' << Fixed(loads * o.time.expert_mb, 2) << ','
        << r.late_prefetches << ',' << r.prefetches_issued << ',' << r.prefetches_used << ','
        << r.on_demand_loads << ',' << Fixed(r.match_score, 4) << ',' << Fixed(r.wall_s, 2) << '\n';
  }
  for (const auto& note : notes) std::printf("note: %s\n", note.c_str());

  // The comparison the design targets: fmoe against the others at the main point.
  auto find = [&](const std::string& mode, const std::string& policy) -> const ReplayResult* {
    for (const auto& job : jobs) {
      const ReplayConfig& c = job->config;
      if ((c.online ? "online" : "offline") == mode && c.policy == policy &&
          c.budget == o.main_budget && c.distance == o.main_distance && job->result.ok()) {
        return &*job->result;
      }
    }
    return nullptr;
  };
  for (const auto& mode : o.modes) {
    const ReplayResult* f = find(mode, "fmoe");
    if (f == nullptr) continue;
    std::printf("\n%s, budget %.2f, d=%u:", mode.c_str(), o.main_budget, o.main_distance);
    if (const ReplayResult* m = find(mode, "moe-infinity")) {
      std::printf(" fmoe/moe-infinity stall %.3f, hit rate x%.2f;",
                  m->stall_ns > 0 ? f->stall_ns / m->stall_ns : 0.0,
                  m->hit_rate() > 0 ? f->hit_rate() / m->hit_rate() : 0.0);
    }
    if (const ReplayResult* orc = find(mode, "oracle")) {
      std::printf(" oracle stall %.3f ms/token (fmoe %.3f, x%.2f);",
                  PerToken(orc->stall_ns, orc->tokens) / 1e6,
                  PerToken(f->stall_ns, f->tokens) / 1e6,
                  orc->stall_ns > 0 ? f->stall_ns / orc->stall_ns : 0.0);
    }
    std::string best;
    double best_stall = 0;
    for (const auto& p : policies) {
      if (p == "oracle") continue;
      const ReplayResult* r = find(mode, p);
      if (r != nullptr && (best.empty() || r->stall_ns < best_stall)) {
        best = p;
        best_stall = r->stall_ns;
      }
    }
    std::printf(" lowest stall except the oracle: %s\n", best.c_str());
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
    // Panels: hit rate and stall against the budget at the main distance, stall against d at
    // the main budget; one line per policy, offline and online.
    std::vector<PlotPanel> panels;
    for (const auto& mode : o.modes) {
      PlotPanel hit{mode + ": hit rate (d=" + std::to_string(o.main_distance) + ")",
                    "cache budget (fraction of experts)",
                    "hit rate",
                    false,
                    {}};
      PlotPanel stall{mode + ": stall per token (d=" + std::to_string(o.main_distance) + ")",
                      "cache budget (fraction of experts)",
                      "stall ms/token",
                      false,
                      {}};
      PlotPanel dist{mode + ": stall per token (budget " + Fixed(o.main_budget, 2) + ")",
                     "prefetch distance d",
                     "stall ms/token",
                     false,
                     {}};
      for (const auto& p : policies) {
        PlotSeries sh{p, {}}, ss{p, {}}, sd{p, {}};
        for (const auto& job : jobs) {
          const ReplayConfig& c = job->config;
          if ((c.online ? "online" : "offline") != mode || c.policy != p || !job->result.ok()) {
            continue;
          }
          const ReplayResult& r = *job->result;
          const double s = PerToken(r.stall_ns, r.tokens) / 1e6;
          if (c.distance == o.main_distance) {
            sh.points.push_back({c.budget, r.hit_rate()});
            ss.points.push_back({c.budget, s});
          }
          if (c.budget == o.main_budget) sd.points.push_back({double(c.distance), s});
        }
        hit.series.push_back(sh);
        stall.series.push_back(ss);
        dist.series.push_back(sd);
      }
      panels.push_back(hit);
      panels.push_back(stall);
      panels.push_back(dist);
    }
    std::string title = "Policy replay: " + h.model + ", " + std::to_string(test.size()) +
                        " test requests (" + h.iteration_unit +
                        "); link: expert load = " + Fixed(load_ms / layer_ms, 1) +
                        " layers of compute";
    Status s = WritePlot(o.png, title, panels, static_cast<uint32_t>(o.modes.size()), 3);
    if (s.ok()) {
      std::printf("wrote %s\n", o.png.c_str());
    } else {
      std::printf("no plot: %s\n", s.message().c_str());
    }
  }
  return failed ? 1 : 0;
}

namespace {

// The time model's flags; zero (or negative latency) leaves the preset's figure.
struct TimeFlags {
  std::string preset = "dev-vm";
  std::string layer_times;
  double layer_ms = 0;
  double load_ms = 0;
  double expert_mb = 0;
  double link_gbps = 0;
  double link_latency_us = -1;
};

Result<TimeModel> ResolveTime(const TimeFlags& f) {
  FMOE_ASSIGN_OR_RETURN(TimeModel m, TimeModelPreset(f.preset));
  bool changed = false;
  if (!f.layer_times.empty()) {
    FMOE_ASSIGN_OR_RETURN(m.layer, ParseLayerTimes(f.layer_times));
    changed = true;
  }
  if (f.layer_ms > 0) {
    m.layer = {{1, f.layer_ms}};
    changed = true;
  }
  if (f.expert_mb > 0) {
    m.expert_mb = f.expert_mb;
    changed = true;
  }
  if (f.link_gbps > 0) {
    m.link_gbps = f.link_gbps;
    changed = true;
  }
  if (f.link_latency_us >= 0) {
    m.link_latency_us = f.link_latency_us;
    changed = true;
  }
  if (f.load_ms > 0) {
    m.link_latency_us = 0;
    m.link_gbps = m.expert_mb / f.load_ms;
    changed = true;
  }
  if (changed) {
    m.name = "custom (from " + f.preset + ")";
    m.source += "; changed by flags";
  }
  FMOE_RETURN_IF_ERROR(ValidateTimeModel(m));
  return m;
}

}  // namespace

void AddReplayCommand(CLI::App& app, int& exit_code) {
  auto o = std::make_shared<ReplayOptions>();
  auto* cmd = app.add_subcommand(
      "replay", "replay a routing trace through every cache policy and the oracle");
  cmd->footer("Policies (--policies):\n" + PolicyHelp(/*servable_only=*/false));
  cmd->add_option("--trace", o->trace, "fmoe trace (worker --record-trace, or import-trace)")
      ->required();
  cmd->add_option("--policies", o->policies, "policies to run")
      ->delimiter(',')
      ->capture_default_str();
  cmd->add_option("--budgets", o->budgets, "cache budgets, fractions of all experts")
      ->delimiter(',')
      ->check(CLI::Range(1e-6, 1.0))
      ->capture_default_str();
  cmd->add_option("--distances", o->distances,
                  "prefetch distances d (default: --distance for serving, 1-6 for positions)")
      ->delimiter(',')
      ->check(CLI::Range(1, 64));
  cmd->add_option("--budget", o->main_budget, "the budget the distance sweep runs at")
      ->check(CLI::Range(1e-6, 1.0))
      ->capture_default_str();
  cmd->add_option("--distance", o->main_distance, "the distance the budget sweep runs at")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  cmd->add_flag("--full-grid", o->full_grid, "every budget at every distance");
  cmd->add_option("--modes", o->modes, "offline, online or both")
      ->delimiter(',')
      ->check(CLI::IsMember({"offline", "online"}))
      ->capture_default_str();
  cmd->add_option("--requests", o->requests, "use the trace's first N requests (0: all)");
  cmd->add_option("--train-fraction", o->train_fraction,
                  "the first part of the requests that warms the store (offline)")
      ->check(CLI::Range(0.0, 0.99))
      ->capture_default_str();
  cmd->add_option("--test-requests", o->test_requests, "measure at most N requests (0: all)");
  auto t = std::make_shared<TimeFlags>();
  std::string presets;
  for (const std::string& p : TimeModelPresetNames()) presets += (presets.empty() ? "" : ", ") + p;
  cmd->add_option("--time-model", t->preset,
                  "the time model's preset (" + presets +
                      "): dev-vm is measured on the 2-vCPU dev VM (bench/RESULTS.md: "
                      "runtime_bench, cache_bench's link); fmoe-paper is Mixtral-8x7B on an RTX "
                      "3090 over PCIe 4.0, the fMoE paper's testbed")
      ->check(CLI::IsMember(TimeModelPresetNames()))
      ->capture_default_str();
  cmd->add_option("--layer-ms-at", t->layer_times,
                  "one layer's compute against the iteration's tokens, TOKENS:MS,... (piecewise "
                  "linear; default: the preset's)");
  cmd->add_option("--layer-ms", t->layer_ms,
                  "one layer's compute at any number of tokens (flat; overrides --layer-ms-at)")
      ->check(CLI::Range(1e-6, 1e6));
  cmd->add_option("--expert-mb", t->expert_mb, "MB (10^6 bytes) of one expert (default: preset's)")
      ->check(CLI::Range(1e-9, 1e6));
  cmd->add_option("--link-gbps", t->link_gbps, "link bandwidth, GB/s (default: the preset's)")
      ->check(CLI::Range(1e-9, 1e6));
  cmd->add_option("--link-latency-us", t->link_latency_us,
                  "link latency per transfer, us (default: the preset's)")
      ->check(CLI::Range(0.0, 1e9));
  cmd->add_option("--load-ms", t->load_ms,
                  "one expert over the link, ms (sets the bandwidth for --expert-mb, latency 0)")
      ->check(CLI::Range(1e-6, 1e6));
  cmd->add_option("--model", o->model,
                  "serving: a prefill per request, decode steps, continuous batching, TTFT and "
                  "TPOT; positions: each trace record one iteration, one request at a time (the "
                  "first replay's model)")
      ->check(CLI::IsMember({"serving", "positions"}))
      ->capture_default_str();
  cmd->add_option("--batches", o->batches, "serving: max batch sizes to run")
      ->delimiter(',')
      ->check(CLI::Range(1, 256))
      ->capture_default_str();
  cmd->add_option("--max-batched-tokens", o->max_batched_tokens,
                  "serving: chunked prefill, at most N tokens per iteration (decode steps first, "
                  "then prompt chunks, oldest first); a comma list runs each; 0: prefills whole "
                  "(needs a prompt-positions trace otherwise)")
      ->delimiter(',')
      ->check(CLI::Range(0, 1 << 20))
      ->capture_default_str();
  cmd->add_option("--chunk-overhead", o->chunk_overhead,
                  "serving, with --max-batched-tokens: expert-aware chunks, as the engine's "
                  "chunk_overhead: a prompt chunk grows (doubling, up to the rest of the prompt) "
                  "while its expected expert loads would make the prefill more than (1 + X) x "
                  "its time whole; 0: the budget's chunks")
      ->check(CLI::Range(0.0, 1000.0))
      ->capture_default_str();
  cmd->add_option("--trace-kind", o->trace_kind,
                  "serving: what the records are (auto: from the trace header; iterations, "
                  "prompt-positions, decode-positions)")
      ->check(CLI::IsMember({"auto", "iterations", "prompt-positions", "decode-positions"}))
      ->capture_default_str();
  cmd->add_option("--decode-share", o->decode_share,
                  "serving, prompt-positions: the share of each prompt's positions replayed as "
                  "its decode steps (Azure conversations: 0.155 of tokens are generated)")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  cmd->add_option("--arrivals", o->arrivals,
                  "serving: arrival trace (Azure CSV: TIMESTAMP,ContextTokens,GeneratedTokens); "
                  "without it every request arrives at once");
  cmd->add_option("--arrival-offset", o->arrival_offset, "serving: first row of --arrivals")
      ->capture_default_str();
  cmd->add_option("--rate", o->rate, "serving: rescale the arrival gaps to this many requests/s")
      ->check(CLI::Range(0.0, 1e9));
  cmd->add_option("--time-scale", o->time_scale, "serving: multiply the arrival gaps")
      ->check(CLI::Range(1e-9, 1e9))
      ->capture_default_str();
  cmd->add_option("--store-capacity", o->store_capacity, "maps the store keeps (C)")
      ->check(CLI::Range(1, 1000000))
      ->capture_default_str();
  cmd->add_option("--inflight", o->inflight, "prefetches handed to the link at once")
      ->check(CLI::Range(1, 64))
      ->capture_default_str();
  cmd->add_option("--hybrid", o->hybrid,
                  "serving: compute missing experts on the CPU when that has the layer's experts "
                  "sooner (off, on, or both: every run with and without it); the CPU model is "
                  "--cpu-expert-us or --cpu-factor, else the time model preset's measured host "
                  "kernel curve")
      ->check(CLI::IsMember({"off", "on", "both"}))
      ->capture_default_str();
  cmd->add_option("--cpu-factor", o->cpu.factor,
                  "serving, hybrid: c, the CPU's time for one token's expert / one expert's load "
                  "time (flat to --cpu-knee-tokens, then linear in the tokens)")
      ->check(CLI::Range(0.0, 1e6));
  cmd->add_option("--cpu-knee-tokens", o->cpu.knee_tokens,
                  "serving, hybrid: the tokens up to which a CPU expert takes its 1-token time "
                  "(memory-bound), with --cpu-factor")
      ->check(CLI::Range(1.0, 1e6))
      ->capture_default_str();
  auto cpu_times = std::make_shared<std::string>();
  auto host_start = std::make_shared<std::string>("warm");
  cmd->add_option("--cpu-expert-us", *cpu_times,
                  "serving, hybrid: one expert's measured CPU time against its tokens, "
                  "TOKENS:MICROSECONDS,... (piecewise linear; overrides --cpu-factor)");
  cmd->add_option("--host-budget", o->disk.host_budget,
                  "serving: a disk tier: experts live on disk behind a host cache of this "
                  "fraction of them, (0, 1] (unset: every expert in host memory, no disk)")
      ->check(CLI::Range(1e-9, 1.0));
  cmd->add_option("--disk-gbps", o->disk.gbps,
                  "serving, disk tier: disk bandwidth, GB/s, shared by the reads in flight "
                  "(default: 1.1, the dev VM's virtio disk vda with O_DIRECT 8-64 MiB reads, "
                  "fio and disk_bench; an NVMe drive is about 3-7)")
      ->check(CLI::Range(1e-9, 1e6))
      ->capture_default_str();
  cmd->add_option("--disk-latency-us", o->disk.latency_us,
                  "serving, disk tier: latency per expert read, us (default: 57, the mean of "
                  "fio's 4 KiB O_DIRECT random reads at queue depth 1 (io_uring) on the dev VM's "
                  "virtio disk vda; an NVMe drive is about 50-100)")
      ->check(CLI::Range(0.0, 1e9))
      ->capture_default_str();
  cmd->add_option("--disk-queue-depth", o->disk.queue_depth,
                  "serving, disk tier: expert reads in flight at once")
      ->check(CLI::Range(1, 256))
      ->capture_default_str();
  cmd->add_option("--host-start", *host_start,
                  "serving, disk tier: the host cache at start: warm (the first experts in "
                  "(layer, expert) order, as many as it holds) or empty")
      ->check(CLI::IsMember({"warm", "empty"}))
      ->capture_default_str();
  auto host_score = std::make_shared<std::string>("policy");
  cmd->add_option("--host-score", *host_score,
                  "serving, disk tier: the host cache's eviction score: policy (the device "
                  "cache's, as the worker's host tier) or loads (its own: the loads it served "
                  "per expert, halved every 32 x host slots loads)")
      ->check(CLI::IsMember({"policy", "loads"}))
      ->capture_default_str();
  cmd->add_option("--threads", o->threads, "replays run in parallel (0: one per core)");
  cmd->add_option("--csv", o->csv, "write the table as CSV");
  cmd->add_option("--png", o->png, "plot with gnuplot");
  cmd->callback([o, t, cpu_times, host_start, host_score, &exit_code] {
    o->disk.score = *host_score == "loads" ? DiskModel::Score::kLoads : DiskModel::Score::kPolicy;
    auto time = ResolveTime(*t);
    if (!time.ok()) {
      std::fprintf(stderr, "fmoe-bench replay: %s\n", time.status().message().c_str());
      exit_code = 2;
      return;
    }
    o->time = std::move(*time);
    if (!cpu_times->empty()) {
      auto curve = ParseCpuExpertTimes(*cpu_times);
      if (!curve.ok()) {
        std::fprintf(stderr, "fmoe-bench replay: %s\n", curve.status().message().c_str());
        exit_code = 2;
        return;
      }
      o->cpu.curve = std::move(*curve);
      o->cpu.source = "--cpu-expert-us";
    }
    if (o->hybrid != "off" && !o->cpu.enabled() && !o->time.cpu_expert.empty()) {
      // The preset's host-kernel curve, for an expert of the preset's size scaled to this one.
      const double scale = o->time.expert_mb / o->time.cpu_expert_mb;
      for (const LayerTimePoint& p : o->time.cpu_expert) {
        o->cpu.curve.push_back({p.tokens, p.ms * 1e3 * scale});
      }
      o->cpu.source = o->time.cpu_source;
      if (scale != 1.0) o->cpu.source += ", scaled x" + std::to_string(scale) + " to --expert-mb";
    }
    if (o->hybrid != "off" && (!o->cpu.enabled() || o->model != "serving")) {
      std::fprintf(stderr,
                   "fmoe-bench replay: --hybrid %s needs --model serving and a CPU model "
                   "(--cpu-factor, --cpu-expert-us, or a time model preset with a measured "
                   "host kernel curve)\n",
                   o->hybrid.c_str());
      exit_code = 2;
      return;
    }
    o->disk.warm = *host_start == "warm";
    if (o->disk.enabled() && (o->model != "serving" || o->hybrid != "off")) {
      std::fprintf(stderr,
                   "fmoe-bench replay: --host-budget (the disk tier) needs --model serving and "
                   "--hybrid off\n");
      exit_code = 2;
      return;
    }
    if (o->model != "serving" && (o->max_batched_tokens.size() != 1 || o->max_batched_tokens[0])) {
      std::fprintf(stderr, "fmoe-bench replay: --max-batched-tokens needs --model serving\n");
      exit_code = 2;
      return;
    }
    exit_code = o->model == "serving" ? RunServingReplay(*o) : RunPositionReplay(*o);
  });
}

Status BuildWarmStores(uint32_t threads, const std::function<Result<MapStore>(uint32_t)>& build,
                       WarmStores* warm) {
  std::vector<uint32_t> ds;
  for (auto& [d, s] : *warm) ds.push_back(d);
  std::vector<Result<MapStore>> stores(ds.size(), Internal("not built"));
  Parallel(threads, ds.size(), [&](size_t i) { stores[i] = build(ds[i]); });
  for (size_t i = 0; i < ds.size(); ++i) {
    if (!stores[i].ok()) return stores[i].status().WithContext("warming the store");
    (*warm)[ds[i]] = std::make_unique<MapStore>(std::move(*stores[i]));
  }
  return Status::Ok();
}

}  // namespace fmoe::bench
