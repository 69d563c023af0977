// cache_bench: decode TPOT of the model with its experts offloaded, for each policy and budget,
// against the all-resident reference, through the same engine and expert cache a worker runs (the
// rank assembled by gpu_worker/rank.h, every expert resident; each configuration's cache over a
// copy of its experts, Rank::NewCachedExperts).
// cpu mode: the emulated link. The link is set from a measured all-resident run so that loading
// one expert takes --load-ratio times the compute of one layer (decode iteration time / L),
// unless --gbps is given. Each configuration generates --tokens tokens greedily for each of
// --prompts prompts, one request at a time (batch 1); TPOT = decode time / decode tokens, the
// median of --repeats runs (each run a fresh cache, so every run starts from the same state).
// Each run is interleaved request by request with an all-resident run of the same prompts, and
// "vs all-resident" divides the two medians of the same configuration, so that drift in the
// machine's speed does not show up as a policy's cost.
// --hybrid off|on|both: hybrid execution (a missing expert run on the host when that finishes the
// layer sooner); `both` runs each configuration without and with it. In cpu mode the host runs
// are slowed to --host-ratio x one expert's load time for one token (the emulated host compute
// rate, from one expert's measured compute time): every such figure is emulated. --admit
// on|off|both: with hybrid, whether a host-run expert is loaded with the link's spare time.
// Prints a Markdown table.
//
//   build/bin/cache_bench --model deploy/models/tiny-moe --prompts-file prompts.jsonl
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <CLI/CLI.hpp>

#include "bench/bench_prompts.h"
#include "common/log.h"
#include "common/policy_names.h"
#include "gpu_worker/experts/cpu_expert.h"
#include "gpu_worker/model/blocks.h"
#include "gpu_worker/model/model.h"
#include "gpu_worker/rank.h"

namespace {

using namespace fmoe;
using BenchClock = std::chrono::steady_clock;

const std::vector<std::string>& kFallback = bench::kFallbackPrompts;

struct Run {
  double decode_s = 0;
  uint64_t decode_tokens = 0;
  std::vector<std::vector<int32_t>> tokens;
  double tpot_ms() const { return decode_tokens ? 1e3 * decode_s / decode_tokens : 0; }
};

void RunOne(MoeModel& model, ExpertSource& source, const Tokenizer& tok,
            const std::vector<int32_t>& prompt, uint32_t max_tokens, uint64_t id, Run* run) {
  std::vector<int32_t> out;
  BenchClock::time_point first{};
  BenchClock::time_point last{};
  EngineOptions options;
  options.max_batch = 1;
  Engine engine(options, model, source, &tok, nullptr, [&](const TokenEvent& ev) {
    if (ev.token_id < 0) return;
    out.push_back(ev.token_id);
    (out.size() == 1 ? first : last) = BenchClock::now();
  });
  Generate g;
  g.request_id = id;
  g.token_ids = prompt;
  g.sampling.max_tokens = max_tokens;
  engine.Submit(std::move(g));
  while (engine.Step()) {
  }
  if (out.size() > 1) {
    run->decode_s += std::chrono::duration<double>(last - first).count();
    run->decode_tokens += out.size() - 1;
  }
  run->tokens.push_back(std::move(out));
}

Run RunPrompts(MoeModel& model, ExpertSource& source, const Tokenizer& tok,
               const std::vector<std::vector<int32_t>>& prompts, uint32_t max_tokens) {
  Run run;
  for (size_t i = 0; i < prompts.size(); ++i)
    RunOne(model, source, tok, prompts[i], max_tokens, i + 1, &run);
  return run;
}

// The same prompts through two sources, request by request, alternating which goes first, so
// that both see the same machine.
std::pair<Run, Run> RunInterleaved(MoeModel& model, ExpertSource& a, ExpertSource& b,
                                   const Tokenizer& tok,
                                   const std::vector<std::vector<int32_t>>& prompts,
                                   uint32_t max_tokens) {
  Run ra, rb;
  for (size_t i = 0; i < prompts.size(); ++i) {
    if (i % 2 == 0) {
      RunOne(model, a, tok, prompts[i], max_tokens, i + 1, &ra);
      RunOne(model, b, tok, prompts[i], max_tokens, i + 1, &rb);
    } else {
      RunOne(model, b, tok, prompts[i], max_tokens, i + 1, &rb);
      RunOne(model, a, tok, prompts[i], max_tokens, i + 1, &ra);
    }
  }
  return {std::move(ra), std::move(rb)};
}

}  // namespace

int main(int argc, char** argv) {
  // Logs go to stderr: stdout carries the tables.
  if (fmoe::Status s = fmoe::InitLogging("cache_bench", "info"); !s.ok()) return 2;
  CLI::App app{
      "cache_bench: decode TPOT per policy and expert budget (emulated link on cpu, the "
      "CUDA link on cuda)"};
  std::string model_dir = "deploy/models/tiny-moe";
  std::string prompts_file;
  size_t num_prompts = 8;
  uint32_t max_tokens = 32;
  int threads = 1;
  std::string device = "cpu";
  std::string dtype = "float32";
  double load_ratio = 3.0;
  double gbps = 0;
  double latency_us = 10;
  uint32_t distance = 3;
  int repeats = 3;
  std::vector<std::string> policies = {"fmoe",      "fmoe-nextuse", "moe-infinity", "speculative",
                                       "on-demand", "lru",          "lfu",          "oracle"};
  std::vector<double> budgets = {0.25, 0.5, 1.0};
  double budget_expert_bytes = 0;
  std::string hybrid = "off";
  std::string admit = "on";
  double host_ratio = 0.5;
  std::vector<double> host_budgets;
  app.add_option("--model", model_dir, "model directory");
  app.add_option("--prompts-file", prompts_file, "JSONL with a \"prompt\" field per line");
  app.add_option("--prompts", num_prompts, "prompts, one request each");
  app.add_option("--tokens", max_tokens, "tokens generated per prompt");
  app.add_option("--threads", threads, "intra-op threads");
  app.add_option("--device", device, "cpu (emulated link) | cuda:N (the CUDA link)")
      ->capture_default_str();
  app.add_option("--dtype", dtype, "auto | float32 | bfloat16 | float16")->capture_default_str();
  app.add_option("--load-ratio", load_ratio, "one expert's load time / one layer's compute");
  app.add_option("--gbps", gbps, "link GB/s (overrides --load-ratio)");
  app.add_option("--latency-us", latency_us, "link latency per transfer");
  app.add_option("--distance", distance, "prefetch distance d (speculative, oracle)");
  app.add_option("--repeats", repeats, "runs per configuration; the median TPOT is reported");
  app.add_option("--policy", policies, "policies to run (repeatable)");
  app.add_option("--budget", budgets, "expert budgets as fractions of the experts");
  app.add_option("--budget-expert-bytes", budget_expert_bytes,
                 "take each --budget as a fraction of L x J experts of this many bytes instead "
                 "(e.g. the bfloat16 expert's bytes: a quantized model's cache then holds more "
                 "experts in the same memory)")
      ->check(CLI::NonNegativeNumber);
  app.add_option("--hybrid", hybrid, "hybrid execution: off | on | both (without, then with)")
      ->check(CLI::IsMember({"off", "on", "both"}))
      ->capture_default_str();
  app.add_option("--admit", admit,
                 "hybrid: admit host-run experts with spare link time: on | off | both")
      ->check(CLI::IsMember({"off", "on", "both"}))
      ->capture_default_str();
  app.add_option("--host-ratio", host_ratio,
                 "cpu mode: a host run of one expert on one token takes this many expert loads "
                 "(the emulated host compute rate, c)")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  app.add_option("--host-budget", host_budgets,
                 "host tier: leave the experts in the checkpoint and keep this fraction of them "
                 "in host memory, read from disk as needed (repeatable; unset: every expert in "
                 "host memory); the compute dtype must be the experts' stored one")
      ->check(CLI::Range(1e-9, 1.0));
  app.footer("Policies:\n" + PolicyHelp(/*servable_only=*/false));
  CLI11_PARSE(app, argc, argv);
  spdlog::set_level(spdlog::level::warn);

  RankOptions options;
  options.model_dir = model_dir;
  options.threads = threads;
  options.device = device;
  options.dtype = dtype;
  options.experts = RankExperts::kResident;
  options.compute = false;  // An engine per request and source, below.
  auto rank = Rank::Assemble(std::move(options));
  if (!rank.ok()) {
    std::fprintf(stderr, "cannot load %s: %s\n", model_dir.c_str(),
                 rank.status().message().c_str());
    return 1;
  }
  const ModelInfo& info = (*rank)->info();
  MoeModel& model = (*rank)->model();
  const Tokenizer& tok = *(*rank)->tokenizer();
  ResidentExperts& resident = *(*rank)->resident();
  // The host tier's runs read the experts from the checkpoint: a second load leaves them there.
  ExpertTable on_disk;
  if (!host_budgets.empty()) {
    RuntimeOptions r;
    r.dtype = (*rank)->dtype();
    r.cuda_index = (*rank)->device().cuda_index;
    r.experts_on_disk = true;
    auto second = MoeModel::Load(info, r, {}, &on_disk);
    if (!second.ok()) {
      std::fprintf(stderr, "cannot leave the experts on disk: %s\n",
                   second.status().message().c_str());
      return 1;
    }
  }
  std::vector<std::vector<int32_t>> prompts;
  for (const std::string& p : bench::ReadPrompts(prompts_file, num_prompts, kFallback, 600)) {
    prompts.push_back(*tok.Encode(p, true));
  }

  // The reference, twice (the first warms caches), recording the routing for the oracle.
  RunPrompts(model, resident, tok, prompts, max_tokens);
  RecordingExperts recording(resident);
  Run reference = RunPrompts(model, recording, tok, prompts, max_tokens);
  std::vector<double> reference_tpots = {reference.tpot_ms()};
  for (int r = 1; r < repeats; ++r) {
    reference_tpots.push_back(RunPrompts(model, resident, tok, prompts, max_tokens).tpot_ms());
  }
  std::sort(reference_tpots.begin(), reference_tpots.end());
  const double reference_tpot = reference_tpots[reference_tpots.size() / 2];
  const double layer_ms = reference_tpot / info.num_moe_layers;
  const size_t expert_bytes = resident.experts()[0][0].bytes();
  if (gbps <= 0) {
    const double load_s = load_ratio * layer_ms / 1e3 - latency_us / 1e6;
    gbps = expert_bytes / std::max(load_s, 1e-6) / 1e9;
  }
  const double load_ms = latency_us / 1e3 + expert_bytes / (gbps * 1e9) * 1e3;
  const bool cuda = (*rank)->device().cuda_index >= 0;
  std::printf(
      "model %s: L=%u J=%u K=%u, expert %zu bytes (%s, experts %s); all-resident TPOT %.2f ms, "
      "%.3f ms per layer on %s\n",
      model_dir.c_str(), info.num_moe_layers, info.num_experts, info.top_k, expert_bytes,
      (*rank)->dtype().c_str(), info.quant.Describe().c_str(), reference_tpot, layer_ms,
      (*rank)->device().description.c_str());
  if (cuda) {
    std::printf("link: the CUDA link (pinned host memory to device slots)");
  } else {
    std::printf("emulated link: %.3f GB/s + %.0f us = %.3f ms per expert (%.1f x a layer)", gbps,
                latency_us, load_ms, load_ms / layer_ms);
  }
  // The emulated host compute rate: one expert's measured compute on one token, slowed so that
  // it takes host_ratio loads.
  double host_slowdown = 1.0;
  if (hybrid != "off" && !cuda) {
    const ExpertWeights& w = resident.experts()[0][0];
    const at::Tensor x =
        at::randn({1, info.hidden_size}).to(w.quantized() ? at::kFloat : w.w1.scalar_type());
    std::vector<double> ms;
    for (int i = 0; i < 201; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      // A quantized expert is computed from its stored bytes by the CPU kernel (cpu mode).
      if (w.quantized()) {
        if (Result<at::Tensor> y = CpuSwiGlu(x, w); !y.ok()) {
          std::fprintf(stderr, "cpu expert: %s\n", y.status().message().c_str());
          return 1;
        }
      } else {
        at::Tensor y = SwiGlu(x, w.w1, w.w3, w.w2, RuntimeOptions{}.row_block);
      }
      ms.push_back(
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(ms.begin(), ms.end());
    host_slowdown = std::max(1.0, host_ratio * load_ms / ms[ms.size() / 2]);
    std::printf("; emulated host: one expert %.3f ms x %.1f = %.3f ms (%.2f x a load)",
                ms[ms.size() / 2], host_slowdown, ms[ms.size() / 2] * host_slowdown,
                ms[ms.size() / 2] * host_slowdown / load_ms);
  }
  std::printf("; %zu prompts x %u tokens, batch 1, %d thread(s), d=%u\n\n", prompts.size(),
              max_tokens, threads, distance);
  std::printf(
      "| policy | hybrid | budget | host | TPOT ms | vs all-resident (paired) | hit rate | stall "
      "ms/token | MB moved/token | host runs/token | disk reads/token | disk stall ms/token | MB "
      "read/token | prefetches used / issued | identical tokens "
      "|\n|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n");
  std::printf(
      "| all-resident | - | 100%% | all | %.2f | 1.00 | 100%% | 0 | 0 | 0 | 0 | 0 | 0 | - | - |\n",
      reference_tpot);
  // (hybrid, admission) per row.
  std::vector<std::pair<bool, bool>> hybrid_modes;
  if (hybrid != "on") hybrid_modes.push_back({false, false});
  if (hybrid != "off") {
    if (admit != "on") hybrid_modes.push_back({true, false});
    if (admit != "off") hybrid_modes.push_back({true, true});
  }
  std::fflush(stdout);
  std::vector<double> hosts = host_budgets;
  if (hosts.empty()) hosts.push_back(0);  // 0: every expert in host memory.
  for (const std::string& policy : policies) {
    for (double budget : budgets) {
      for (double host : hosts) {
        for (const auto& [on_host, admits] : hybrid_modes) {
          CachedExpertsOptions o;
          o.hybrid = on_host;
          o.admit_host_runs = admits;
          o.host_slowdown = host_slowdown;
          o.policy = policy;
          if (budget_expert_bytes > 0) {
            o.cache_gb =
                budget * info.num_moe_layers * info.num_experts * budget_expert_bytes / 1e9;
          } else {
            o.cache_fraction = budget;
          }
          o.link.gbps = gbps;
          o.link.latency_us = latency_us;
          o.policy_options.prefetch_distance = distance;
          o.policy_options.future = recording.accesses();
          if (host > 0) o.host_cache_fraction = host;
          std::vector<double> tpots;
          std::vector<double> paired;
          Run run;
          CacheStats st;
          std::optional<HostTierStats> host_tier;
          for (int r = 0; r < std::max(1, repeats); ++r) {
            Result<std::unique_ptr<CachedExperts>> cached =
              host > 0 ? [&] {
                CachedExpertsOptions t = o;
                t.top_k = info.top_k;
                t.cuda_index = (*rank)->device().cuda_index;
                return CachedExperts::Create(CloneExpertTable(on_disk), t);
              }()
                       : (*rank)->NewCachedExperts(o);
            if (!cached.ok()) {
              std::fprintf(stderr, "%s\n", cached.status().message().c_str());
              return 1;
            }
            auto [base_run, cached_run] =
                RunInterleaved(model, resident, **cached, tok, prompts, max_tokens);
            run = std::move(cached_run);
            tpots.push_back(run.tpot_ms());
            paired.push_back(base_run.tpot_ms());
            st = (*cached)->stats();
            host_tier = (*cached)->host_tier_stats();
          }
          std::sort(tpots.begin(), tpots.end());
          std::sort(paired.begin(), paired.end());
          const double tpot = tpots[tpots.size() / 2];
          const double base = paired[paired.size() / 2];
          const CacheCounters& t = st.total;
          const uint64_t tokens = std::max<uint64_t>(1, run.decode_tokens + prompts.size());
          const double lookups = static_cast<double>(t.hits + t.misses);
          const HostTierStats tier = host_tier.value_or(HostTierStats{});
          const std::string host_column =
              host > 0 ? fmt::format("{:.0f}% ({} slots)", host * 100, tier.slots) : "all";
          std::printf(
              "| %s | %s | %.0f%% (%u slots) | %s | %.2f | %.2f | %.1f%% | %.2f | %.2f | %.2f | "
              "%.2f | %.2f | %.1f | %llu / %llu | %s |\n",
              policy.c_str(),
              !on_host ? "off"
              : admits ? (cuda ? "on" : "on (emulated)")
                       : (cuda ? "on, no admission" : "on, no admission (emulated)"),
              budget * 100, st.slots, host_column.c_str(), tpot, tpot / base,
              lookups > 0 ? 100.0 * t.hits / lookups : 0.0, t.stall_ns / 1e6 / tokens,
              t.bytes_moved / 1e6 / tokens, static_cast<double>(t.host_runs) / tokens,
              static_cast<double>(t.disk_reads) / tokens, t.disk_stall_ns / 1e6 / tokens,
              tier.bytes_read / 1e6 / tokens, static_cast<unsigned long long>(t.prefetches_used),
              static_cast<unsigned long long>(t.prefetches_issued),
              run.tokens == reference.tokens ? "yes" : "NO");
          std::fflush(stdout);
        }
      }
    }
  }
  return 0;
}
