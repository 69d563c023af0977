// fmoe-bench serve: the end-to-end comparison of DESIGN section 11. For each policy (and the
// all-resident reference) it launches the real processes from a manifest derived from the base
// one (`fmoe launch`, fresh ports and directories under --out), waits for the router's /health,
// replays one request list built once from an arrival trace and a prompt file (open loop: one
// thread and connection per request, started at its arrival offset; streamed, greedy), stops the
// launcher, and reports per run TTFT/TPOT percentiles, throughput, expert hit rate and errors as
// one table, a CSV and a gnuplot PNG. Runs one after the other on main's thread (which must
// outlive each launcher: see serve_cluster.h); Ctrl-C stops the current run's processes, prints
// what was measured and exits 130 (a second Ctrl-C kills at once).
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <memory>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <CLI/CLI.hpp>

#include "bench/fmoe_bench/commands.h"
#include "bench/fmoe_bench/serve_client.h"
#include "bench/fmoe_bench/serve_cluster.h"
#include "bench/fmoe_bench/serve_report.h"
#include "bench/fmoe_bench/serve_workload.h"
#include "common/http_client.h"
#include "common/json.h"
#include "common/manifest.h"
#include "common/model/model_config.h"
#include "common/policy_names.h"
#include "common/process_util.h"
#include "common/text/tokenizer.h"

namespace fmoe::bench {
namespace {

// The groups' preemptions since start, from the router's /metrics; -1 when it does not answer.
int64_t ScrapePreemptions(int port) {
  Result<http::Response> metrics = http::Get("127.0.0.1", port, "/metrics", 2000);
  if (!metrics.ok() || metrics->status != 200) return -1;
  int64_t total = 0;
  std::istringstream lines(metrics->body);
  for (std::string line; std::getline(lines, line);) {
    if (!line.starts_with("fmoe_preemptions_total{")) continue;
    const size_t space = line.rfind(' ');
    if (space != std::string::npos) total += std::atoll(line.c_str() + space + 1);
  }
  return total;
}

namespace fs = std::filesystem;

struct ServeOptions {
  std::string manifest;               // Required.
  std::vector<std::string> policies;  // Default: every manifest policy.
  double budget = 0.25;               // expert_cache_fraction of the policy runs.
  bool no_reference = false;          // Skip the fraction-1.0 run "resident".
  int max_batch = 0;                  // > 0: every group's max_batch. Default: the manifest's
  int max_batched_tokens = -1;  // >= 0: every group's max_batched_tokens. Default: the manifest's
  double chunk_overhead = -1;   // >= 0: every group's chunk_overhead. Default: the manifest's
  std::string prefix_caching;   // "on" | "off": every group's. Default: the manifest's
  // > 0: every group's memory {device_gb} (one device budget for experts and KV; --budget and
  // kv_cache_tokens then do not apply to the policy runs). Default: the manifest's
  double memory_gb = 0;
  // >= 0: with --memory-gb, memory.return_hold_s. Default: the manifest's (0)
  double return_hold_s = -1;
  std::string arrivals;  // Required.
  std::string prompts;   // Required.
  WorkloadOptions workload;
  std::string prompt_field = "prompt";   // JSONL field holding the prompt.
  std::string prompt_match = "length";   // length | order
  std::string out = "fmoe-bench-serve";  // Run directories and logs.
  std::string fmoe;                      // Default: fmoe next to this executable.
  std::string csv;                       // Default: <out>/summary.csv (or next to --png).
  std::string png;                       // Default: none.
  double ready_timeout_s = 180;
  double request_timeout_s = 300;
  double stop_timeout_s = 60;
};

struct RunPlan {
  std::string name;
  std::string policy;
  double fraction = 1.0;
};

// What every run shares.
struct Bench {
  const ServeOptions& options;
  const Manifest& base;
  const Workload& workload;
  std::vector<std::string> bodies;  // One JSON request body per request.
  std::string authorization;
  StopSignals& signals;
  // Set by the signal thread, which outlives this struct: shared.
  std::shared_ptr<std::atomic<bool>> abort = std::make_shared<std::atomic<bool>>(false);
};

std::string Seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%.1f s", s);
  return buf;
}

double Since(BenchClock::time_point t) {
  return std::chrono::duration<double>(BenchClock::now() - t).count();
}

// Sends every request at its offset from now, one thread each; returns when all have ended. Stops
// sending on Ctrl-C or once `alive()` turns false (the launcher exited: nothing would answer).
std::vector<StreamResult> DriveLoad(Bench& bench, int port, const std::function<bool()>& alive,
                                    BenchClock::time_point* start) {
  const std::vector<BenchRequest>& requests = bench.workload.requests;
  std::vector<StreamResult> results(requests.size());
  std::vector<std::thread> threads;
  threads.reserve(requests.size());
  *start = BenchClock::now();
  for (size_t i = 0; i < requests.size(); ++i) {
    const auto at = *start + std::chrono::duration_cast<BenchClock::duration>(
                                 std::chrono::duration<double>(requests[i].arrival_s));
    bool up = true;
    while (!bench.abort->load() && (up = alive()) && BenchClock::now() < at) {
      std::this_thread::sleep_for(
          std::min<BenchClock::duration>(at - BenchClock::now(), std::chrono::milliseconds(50)));
    }
    if (bench.abort->load() || !up) {
      for (size_t j = i; j < requests.size(); ++j) {
        results[j].sent = results[j].done = BenchClock::now();
        results[j].error = up ? "not sent (interrupted)" : "not sent (the launcher exited)";
      }
      break;
    }
    threads.emplace_back([&bench, &results, port, i] {
      results[i] = StreamCompletion(port, bench.bodies[i], bench.authorization,
                                    bench.options.request_timeout_s, *bench.abort);
    });
  }
  for (std::thread& t : threads) t.join();
  return results;
}

// One run: derive and write its manifest, launch, wait for /health, drive, stop.
RunSummary RunOne(Bench& bench, const RunPlan& plan, size_t number, size_t count) {
  const ServeOptions& o = bench.options;
  RunSummary summary;
  summary.name = plan.name;
  summary.policy = plan.policy;
  summary.budget = plan.fraction;
  auto fail = [&](std::string why) {
    summary.failed = true;
    summary.failure = std::move(why);
    summary.requests = o.workload.requests;
    std::fprintf(stderr, "[%zu/%zu] %s: FAILED: %s\n", number, count, plan.name.c_str(),
                 summary.failure.c_str());
    return summary;
  };
  const fs::path dir = fs::path(o.out) / plan.name;
  std::error_code ec;
  fs::remove_all(dir / "run", ec);  // Fresh processes state and map store for every run.
  fs::remove_all(dir / "maps", ec);
  fs::create_directories(dir, ec);
  if (ec) return fail(dir.string() + ": cannot create (" + ec.message() + ")");

  const auto t_launch = BenchClock::now();
  std::unique_ptr<LaunchedCluster> cluster;
  for (int attempt = 0; attempt < 3 && !cluster; ++attempt) {
    fs::remove(dir / "launcher.log", ec);
    Result<Manifest> manifest =
        WriteManifest(DeriveManifest(bench.base, plan.policy, plan.fraction, dir.string()),
                      (dir / "manifest.yaml").string());
    if (!manifest.ok()) return fail(manifest.status().message());
    std::fprintf(stderr, "[%zu/%zu] %s: launching (policy %s, expert_cache_fraction %g, %s)\n",
                 number, count, plan.name.c_str(), plan.policy.c_str(), plan.fraction,
                 manifest->source_path.c_str());
    auto started = LaunchedCluster::Start(o.fmoe, *manifest, (dir / "launcher.log").string());
    if (!started.ok()) return fail(started.status().message());
    Status ready = (*started)->WaitReady(o.ready_timeout_s,
                                         [&bench] { return bench.signals.stop_requested(); });
    if (ready.ok()) {
      cluster = std::move(*started);
      break;
    }
    const std::string tails = (*started)->LogTails(15);
    Status stopped =
        (*started)->Stop(o.stop_timeout_s, [&bench] { return bench.signals.count() > 1; });
    if (bench.signals.stop_requested()) return fail("interrupted");
    // Ports are picked free but not reserved: another process may take one before the launcher
    // binds it. The launcher's pre-flight says so; try again with fresh ports.
    const bool port_taken = tails.find("already in use") != std::string::npos;
    if (port_taken && attempt < 2) {
      std::fprintf(stderr, "[%zu/%zu] %s: a port was taken meanwhile; again with fresh ports\n",
                   number, count, plan.name.c_str());
      continue;
    }
    std::fprintf(stderr, "%s", tails.c_str());
    return fail(ready.message() + (stopped.ok() ? "" : "; " + stopped.message()) + " (logs in " +
                dir.string() + ")");
  }
  std::fprintf(stderr, "[%zu/%zu] %s: ready in %s on 127.0.0.1:%d; %zu requests over %s\n", number,
               count, plan.name.c_str(), Seconds(Since(t_launch)).c_str(), cluster->router_port(),
               bench.workload.requests.size(),
               Seconds(bench.workload.requests.back().arrival_s).c_str());

  BenchClock::time_point start;
  std::vector<StreamResult> results = DriveLoad(
      bench, cluster->router_port(), [&cluster] { return cluster->Running(); }, &start);
  const bool launcher_alive = cluster->Running();
  const std::string launcher_exit = cluster->exit_description();
  const int64_t preemptions = ScrapePreemptions(cluster->router_port());
  const auto t_stop = BenchClock::now();
  Status stopped = cluster->Stop(o.stop_timeout_s, [&bench] { return bench.signals.count() > 1; });
  const std::string tails = launcher_alive ? "" : cluster->LogTails(15);
  cluster.reset();

  summary = Summarize(bench.workload.requests, results);
  summary.preemptions = preemptions;
  summary.name = plan.name;
  summary.policy = plan.policy;
  summary.budget = plan.fraction;
  Status written =
      WriteRequestsCsv((dir / "requests.csv").string(), bench.workload.requests, results, start);
  if (!written.ok()) std::fprintf(stderr, "%s\n", written.message().c_str());
  std::fprintf(stderr, "[%zu/%zu] %s: %d ok, %d errors in %s; stopped in %s\n", number, count,
               plan.name.c_str(), summary.ok, summary.errors, Seconds(summary.duration_s).c_str(),
               Seconds(Since(t_stop)).c_str());
  if (bench.signals.stop_requested()) {
    summary.failed = true;
    summary.failure = "interrupted";
  } else if (!launcher_alive) {
    std::fprintf(stderr, "%s", tails.c_str());
    summary.failed = true;
    summary.failure =
        "the launcher exited during the run (" + launcher_exit + "; logs in " + dir.string() + ")";
  } else if (summary.ok == 0) {
    summary.failed = true;
    summary.failure = "no request succeeded; first error: " + summary.first_error;
  }
  if (!stopped.ok()) {
    const std::string note = "stopping: " + stopped.message();
    summary.failure += (summary.failure.empty() ? "" : "; ") + note;
  }
  return summary;
}

// One paragraph on stdout: where the requests come from and what they ask for.
void PrintWorkload(const ServeOptions& o, const ArrivalTrace& trace, const Workload& workload,
                   size_t prompts, size_t skipped) {
  const std::vector<BenchRequest>& requests = workload.requests;
  double prompt_sum = 0, target_sum = 0, length_sum = 0;
  for (const BenchRequest& r : requests) {
    prompt_sum += r.prompt_tokens;
    target_sum += r.target_prompt_tokens;
    length_sum += r.max_tokens;
  }
  const double n = static_cast<double>(requests.size());
  const double span = requests.back().arrival_s;
  std::printf(
      "workload: %zu requests (%d warm-up) from rows %d..%zu of %s over %.1f s (time scale %.4g, "
      "%.2f req/s)\n"
      "  prompts: %s, %zu usable of %zu (<= %d tokens, %zu lines skipped), matched by %s: mean "
      "%.1f tokens (target mean %.1f)\n"
      "  lengths: max_tokens mean %.1f in [%d, %d] (trace P99: context %.0f, generated %.0f)\n",
      requests.size(), o.workload.warmup, o.workload.offset,
      static_cast<size_t>(o.workload.offset) + requests.size() - 1, o.arrivals.c_str(), span,
      workload.time_scale, span > 0 ? (n - 1) / span : 0.0, o.prompts.c_str(),
      workload.prompts_usable, prompts, o.workload.max_prompt_tokens, skipped,
      o.prompt_match.c_str(), prompt_sum / n, target_sum / n, length_sum / n, o.workload.min_tokens,
      o.workload.max_tokens, trace.context_p99, trace.generated_p99);
  std::fflush(stdout);
}

int RunServe(ServeOptions o) {
  // Validation of what CLI11 does not check.
  auto bad = [](const std::string& what) {
    std::fprintf(stderr, "fmoe-bench serve: %s\n", what.c_str());
    return 2;
  };
  if (o.policies.empty()) {
    for (const PolicyName& p : kPolicyNames) {
      if (p.servable) o.policies.emplace_back(p.name);
    }
  }
  for (size_t i = 0; i < o.policies.size(); ++i) {
    const std::string& p = o.policies[i];
    const PolicyName* known = FindPolicyName(p);
    if (known == nullptr || !known->servable) {
      return bad("--policies: \"" + p + "\" is not a manifest policy (" +
                 PolicyNameList(/*servable_only=*/true) + ")");
    }
    if (std::find(o.policies.begin(), o.policies.begin() + static_cast<long>(i), p) !=
        o.policies.begin() + static_cast<long>(i)) {
      return bad("--policies: \"" + p + "\" is listed twice");
    }
  }
  if (o.workload.min_tokens > o.workload.max_tokens) {
    return bad("--min-tokens " + std::to_string(o.workload.min_tokens) + " is above --max-tokens " +
               std::to_string(o.workload.max_tokens));
  }
  o.workload.match = o.prompt_match == "order" ? PromptMatch::kOrder : PromptMatch::kLength;
  if (o.fmoe.empty()) o.fmoe = (fs::path(ExecutableDir()) / "fmoe").string();
  if (access(o.fmoe.c_str(), X_OK) != 0) {
    return bad("--fmoe " + o.fmoe + ": the launcher binary is not there or not executable");
  }
  if (o.csv.empty()) {
    o.csv = o.png.empty() ? (fs::path(o.out) / "summary.csv").string()
                          : fs::path(o.png).replace_extension(".csv").string();
  }

  Result<Manifest> base = LoadManifest(o.manifest);
  if (!base.ok()) return bad(base.status().message());
  for (WorkerGroupSpec& g : base->worker_groups) {
    if (o.max_batch > 0) g.max_batch = o.max_batch;
    if (o.max_batched_tokens >= 0) g.max_batched_tokens = o.max_batched_tokens;
    if (o.chunk_overhead >= 0) g.chunk_overhead = o.chunk_overhead;
    if (!o.prefix_caching.empty()) g.prefix_caching = o.prefix_caching == "on";
    if (o.memory_gb > 0) {
      MemorySpec m = g.memory.value_or(MemorySpec{});
      m.device_gb = o.memory_gb;
      if (o.return_hold_s >= 0) m.return_hold_s = o.return_hold_s;
      g.memory = m;
      g.kv_cache_tokens = 0;
      g.expert_cache_auto = false;
    }
    if (g.memory && g.workers.size() > 1) {
      return bad("group " + g.name + ": one device budget (memory) needs a group of one rank");
    }
    if (g.max_batched_tokens != 0 && g.max_batched_tokens < g.max_batch) {
      return bad("group " + g.name + ": max_batched_tokens " +
                 std::to_string(g.max_batched_tokens) + " is below max_batch " +
                 std::to_string(g.max_batch));
    }
  }
  Result<ModelInfo> model = LoadModelInfo(base->model.path);
  if (!model.ok()) return bad(model.status().message());
  if (model->max_position_embeddings > 0 &&
      static_cast<uint32_t>(o.workload.max_prompt_tokens + o.workload.max_tokens) >
          model->max_position_embeddings) {
    return bad("--max-prompt-tokens + --max-tokens = " +
               std::to_string(o.workload.max_prompt_tokens + o.workload.max_tokens) +
               " exceeds the model's context of " + std::to_string(model->max_position_embeddings) +
               " tokens");
  }
  auto tokenizer = Tokenizer::Load(base->model.path);
  if (!tokenizer.ok()) return bad(tokenizer.status().message());
  Result<ArrivalTrace> trace = LoadArrivals(o.arrivals);
  if (!trace.ok()) return bad(trace.status().message());
  size_t skipped = 0;
  Result<std::vector<std::string>> prompts = LoadPrompts(o.prompts, o.prompt_field, &skipped);
  if (!prompts.ok()) return bad(prompts.status().message());
  const Tokenizer& tok = **tokenizer;
  Result<Workload> workload = BuildWorkload(
      *trace, *prompts,
      [&tok](const std::string& text) -> Result<int> {
        auto ids = tok.Encode(text, /*add_special_tokens=*/true);
        if (!ids.ok()) return ids.status();
        return static_cast<int>(ids->size());
      },
      o.workload);
  if (!workload.ok()) return bad(workload.status().message());

  PrintWorkload(o, *trace, *workload, prompts->size(), skipped);
  std::error_code ec;
  fs::create_directories(o.out, ec);
  if (ec) return bad("--out " + o.out + ": cannot create (" + ec.message() + ")");
  Status written = WriteWorkload((fs::path(o.out) / "workload.jsonl").string(), *workload);
  if (!written.ok()) return bad(written.message());

  StopSignals& signals = StopSignals::Install();
  Bench bench{o, *base, *workload, {}, {}, signals};
  signals.OnStop([abort = bench.abort] { *abort = true; });
  for (const BenchRequest& r : workload->requests) {
    bench.bodies.push_back(nlohmann::json{{"model", base->model.name},
                                          {"prompt", r.prompt},
                                          {"max_tokens", r.max_tokens},
                                          {"temperature", 0},
                                          {"seed", o.workload.seed},
                                          {"stream", true},
                                          {"stream_options", {{"include_usage", true}}}}
                               .dump());
  }
  if (!base->router.api_keys.empty()) bench.authorization = "Bearer " + base->router.api_keys[0];

  std::vector<RunPlan> plans;
  for (const std::string& p : o.policies) plans.push_back({p, p, o.budget});
  // The reference keeps every expert resident; on-demand is the policy that does nothing else.
  if (!o.no_reference) plans.push_back({"resident", "on-demand", 1.0});

  std::vector<RunSummary> runs;
  for (size_t i = 0; i < plans.size() && !signals.stop_requested(); ++i) {
    runs.push_back(RunOne(bench, plans[i], i + 1, plans.size()));
  }

  std::printf("\n%s", FormatTable(runs).c_str());
  Status csv = WriteSummaryCsv(o.csv, runs);
  std::printf("%s\n", csv.ok() ? ("csv: " + o.csv).c_str() : csv.message().c_str());
  if (!o.png.empty() && csv.ok()) std::printf("%s\n", PlotSummary(o.csv, o.png, runs).c_str());
  std::fflush(stdout);
  if (signals.stop_requested()) return 130;
  const bool any_failed =
      std::any_of(runs.begin(), runs.end(), [](const RunSummary& r) { return r.failed; });
  return any_failed || !csv.ok() ? 1 : 0;
}

}  // namespace

void AddServeCommand(CLI::App& app, int& exit_code) {
  auto o = std::make_shared<ServeOptions>();
  auto* cmd = app.add_subcommand(
      "serve",
      "launch the real processes once per policy and the all-resident reference, drive "
      "the router with a trace, report TTFT/TPOT/throughput/hit rate");
  cmd->footer("Manifest policies (--policies):\n" + PolicyHelp(/*servable_only=*/true));
  cmd->add_option("--manifest", o->manifest, "base manifest (e.g. deploy/manifests/local.yaml)")
      ->required()
      ->check(CLI::ExistingFile);
  cmd->add_option("--policies", o->policies,
                  "comma-separated policies (default: every manifest policy)")
      ->delimiter(',');
  cmd->add_option("--budget", o->budget, "expert_cache_fraction of the policy runs")
      ->capture_default_str()
      ->check(CLI::Range(1e-9, 1.0));
  cmd->add_flag("--no-reference", o->no_reference, "skip the all-resident reference run");
  cmd->add_option("--max-batch", o->max_batch, "every group's max_batch (default: the manifest's)")
      ->check(CLI::Range(1, 1024));
  cmd->add_option("--prefix-caching", o->prefix_caching,
                  "every group's prefix caching (default: the manifest's)")
      ->check(CLI::IsMember({"on", "off"}));
  cmd->add_option("--memory-gb", o->memory_gb,
                  "every group's one device budget for experts and KV (memory: {device_gb}); "
                  "the policy runs use it instead of --budget")
      ->check(CLI::PositiveNumber);
  cmd->add_option("--return-hold-s", o->return_hold_s,
                  "with --memory-gb: how long the KV pool keeps a borrowed page it no longer "
                  "needs (memory: {return_hold_s}; default: the manifest's)")
      ->check(CLI::Range(0.0, 3600.0));
  cmd->add_option("--chunk-overhead", o->chunk_overhead,
                  "every group's expert-aware chunks (chunk_overhead; 0 = the budget's chunks; "
                  "default: the manifest's)")
      ->check(CLI::Range(0.0, 1000.0));
  cmd->add_option("--max-batched-tokens", o->max_batched_tokens,
                  "every group's tokens per engine step; 0 = whole prompts (default: the "
                  "manifest's)")
      ->check(CLI::Range(0, 1 << 20));
  cmd->add_option("--arrivals", o->arrivals,
                  "arrival trace CSV (TIMESTAMP,ContextTokens,"
                  "GeneratedTokens; Azure LLM inference format)")
      ->required()
      ->check(CLI::ExistingFile);
  cmd->add_option("--prompts", o->prompts, "prompts JSONL (field \"prompt\")")
      ->required()
      ->check(CLI::ExistingFile);
  cmd->add_option("--requests", o->workload.requests, "measured requests")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000000));
  cmd->add_option("--warmup", o->workload.warmup,
                  "requests sent before the measured ones in every run, not counted")
      ->capture_default_str()
      ->check(CLI::Range(0, 1000000));
  cmd->add_option("--offset", o->workload.offset, "first trace row (0-based, after the header)")
      ->capture_default_str()
      ->check(CLI::NonNegativeNumber);
  auto* scale = cmd->add_option("--time-scale", o->workload.time_scale,
                                "multiply the trace's inter-arrival gaps by this")
                    ->capture_default_str()
                    ->check(CLI::PositiveNumber);
  cmd->add_option("--rate", o->workload.rate,
                  "rescale the gaps to this mean rate (requests/s) instead")
      ->check(CLI::PositiveNumber)
      ->excludes(scale);
  cmd->add_option("--max-tokens", o->workload.max_tokens,
                  "cap on generated lengths (the trace's P99 maps here)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000000));
  cmd->add_option("--min-tokens", o->workload.min_tokens, "floor on generated lengths")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000000));
  cmd->add_option("--max-prompt-tokens", o->workload.max_prompt_tokens,
                  "cap on prompt lengths in tokens (the trace's context P99 maps here)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000000));
  cmd->add_option("--prompt-field", o->prompt_field,
                  "JSONL field with the prompt (a string, or an array whose first string is used)")
      ->capture_default_str();
  cmd->add_option("--prompt-match", o->prompt_match,
                  "length: the unused prompt closest to the scaled context length; order: file "
                  "order")
      ->capture_default_str()
      ->check(CLI::IsMember({"length", "order"}));
  cmd->add_option("--seed", o->workload.seed, "prompt tie order and the requests' seed")
      ->capture_default_str();
  cmd->add_option("--out", o->out, "directory for run directories and logs")->capture_default_str();
  cmd->add_option("--fmoe", o->fmoe, "the launcher binary (default: fmoe next to fmoe-bench)");
  cmd->add_option("--csv", o->csv, "summary CSV (default: OUT/summary.csv, or next to --png)");
  cmd->add_option("--png", o->png, "plot (gnuplot script written next to the CSV)");
  cmd->add_option("--ready-timeout", o->ready_timeout_s, "seconds to wait for /health per run")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--request-timeout", o->request_timeout_s, "seconds per request")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->add_option("--stop-timeout", o->stop_timeout_s,
                  "seconds for the launcher to stop before it is killed")
      ->capture_default_str()
      ->check(CLI::PositiveNumber);
  cmd->callback([o, &exit_code] { exit_code = RunServe(*o); });
}

}  // namespace fmoe::bench
