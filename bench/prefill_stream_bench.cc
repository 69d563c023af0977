// prefill_stream_bench: the time to first token of a long prompt with its missing experts loaded
// into the expert cache (evicting) against streamed through the buffer beside it (DESIGN section
// 14, prefill_stream), and what each way does to a request decoding beside it. One engine
// (max_batch 2, whole prompts) per run, over a fresh cache at --budget of the experts: request
// A (a --decode-prompt-token prompt) decodes --warm tokens, so the cache holds its working set;
// then request B (--prompt-tokens tokens, one output token) arrives. Reported per way: B's TTFT
// (submit to first token), A's mean inter-token time over the --warm tokens before B and the
// --warm tokens after B's first token, the bytes moved and the stream's loads during B's
// prefill; the median of --repeats runs. Every way's tokens are checked against the
// all-resident run's. cpu mode: the emulated link (every figure emulated).
//
//   build/bin/prefill_stream_bench --model /tmp/dsv2-lite-4l --prompt-tokens 2048
//     --budget 0.25 --gbps 16 --dtype bfloat16   (one line)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <spdlog/spdlog.h>
#include <CLI/CLI.hpp>

#include "bench/bench_prompts.h"
#include "common/log.h"
#include "gpu_worker/rank.h"

namespace {

using namespace fmoe;
using BenchClock = std::chrono::steady_clock;

double Seconds(BenchClock::time_point a, BenchClock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : 0.5 * (v[v.size() / 2 - 1] + v[v.size() / 2]);
}

struct Outcome {
  double ttft_s = 0;
  double tpot_before_ms = 0;
  double tpot_after_ms = 0;
  double prefill_mb = 0;      // Bytes moved during B's prefill.
  uint64_t stream_loads = 0;  // During B's prefill.
  uint64_t evictions = 0;     // During B's prefill.
  uint64_t streamed = 0;      // Engine iterations that streamed.
  std::vector<int32_t> a_tokens, b_tokens;
};

struct Setup {
  std::vector<int32_t> a_prompt, b_prompt;
  uint32_t warm = 16;
};

// One run. `cached` null: every expert resident.
Outcome RunOnce(Rank& rank, ExpertSource& source, CachedExperts* cached, StreamMode mode,
                const Setup& s) {
  Outcome out;
  std::vector<BenchClock::time_point> a_times;
  BenchClock::time_point b_submit{}, b_first{};
  EngineOptions options;
  options.max_batch = 2;
  options.prefill_stream = mode;
  if (cached != nullptr) {
    const ModelInfo& info = rank.info();
    options.chunk_costs = [cached, &info] { return CacheChunkCosts(info, cached->cache()); };
    // As the worker does: the cache's stall comes out of a prompt token's measured compute.
    options.local_figures = [cached] {
      ExpertFigures f;
      f.stall_us = static_cast<uint64_t>(cached->stats().total.stall_ns / 1000);
      return f;
    };
  }
  Engine engine(options, rank.model(), source, rank.tokenizer(), nullptr,
                [&](const TokenEvent& ev) {
                  if (ev.token_id < 0) return;
                  if (ev.request_id == 1) {
                    out.a_tokens.push_back(ev.token_id);
                    a_times.push_back(BenchClock::now());
                  } else {
                    if (out.b_tokens.empty()) b_first = BenchClock::now();
                    out.b_tokens.push_back(ev.token_id);
                  }
                });
  Generate a;
  a.request_id = 1;
  a.token_ids = s.a_prompt;
  a.sampling.max_tokens = 2 * s.warm + 2;
  engine.Submit(std::move(a));
  while (out.a_tokens.size() < s.warm + 1 && engine.Step()) {
  }
  const CacheStats before = cached != nullptr ? cached->stats() : CacheStats{};
  Generate b;
  b.request_id = 2;
  b.token_ids = s.b_prompt;
  b.sampling.max_tokens = 1;
  b_submit = BenchClock::now();
  engine.Submit(std::move(b));
  while (out.b_tokens.empty() && engine.Step()) {
  }
  const CacheStats after = cached != nullptr ? cached->stats() : CacheStats{};
  const size_t a_at_b = out.a_tokens.size();
  while (engine.Step()) {
  }
  out.ttft_s = Seconds(b_submit, b_first);
  // A's tokens 1..warm came before B; the warm after B's first token, from the one after it.
  if (s.warm >= 2) out.tpot_before_ms = 1e3 * Seconds(a_times[1], a_times[s.warm]) / (s.warm - 1);
  if (a_times.size() >= a_at_b + s.warm) {
    out.tpot_after_ms = 1e3 * Seconds(a_times[a_at_b - 1], a_times[a_at_b + s.warm - 1]) / s.warm;
  }
  out.prefill_mb = (after.total.bytes_moved - before.total.bytes_moved) / 1e6;
  out.stream_loads = after.total.stream_loads - before.total.stream_loads;
  out.evictions = after.total.evictions - before.total.evictions;
  out.streamed = engine.stats().streamed_iterations;
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  if (fmoe::Status s = fmoe::InitLogging("prefill_stream_bench", "info"); !s.ok()) return 2;
  CLI::App app{
      "prefill_stream_bench: a long prompt's TTFT with its experts loaded into the cache "
      "or streamed beside it, and the decode beside it"};
  std::string model_dir = "deploy/models/tiny-moe";
  std::string device = "cpu";
  std::string dtype = "auto";
  std::string policy = "lru";
  uint32_t prompt_tokens = 2048;
  uint32_t decode_prompt_tokens = 64;
  uint32_t warm = 16;
  double budget = 0.25;
  double gbps = 16;
  double latency_us = 10;
  int threads = 0;
  int repeats = 3;
  uint32_t stream_slots = 0;
  std::vector<std::string> ways = {"cache", "stream", "auto"};
  app.add_option("--model", model_dir, "model directory")->capture_default_str();
  app.add_option("--device", device, "cpu (emulated link) | cuda:N")->capture_default_str();
  app.add_option("--dtype", dtype, "auto | float32 | bfloat16 | float16")->capture_default_str();
  app.add_option("--policy", policy, "cache policy")->capture_default_str();
  app.add_option("--prompt-tokens", prompt_tokens, "the long prompt's tokens")
      ->capture_default_str();
  app.add_option("--decode-prompt-tokens", decode_prompt_tokens, "request A's prompt tokens")
      ->capture_default_str();
  app.add_option("--warm", warm, "A's tokens before B arrives, and the ones measured after")
      ->check(CLI::Range(2u, 1000u))
      ->capture_default_str();
  app.add_option("--budget", budget, "expert cache, fraction of the experts")
      ->check(CLI::Range(1e-6, 1.0))
      ->capture_default_str();
  app.add_option("--gbps", gbps, "link GB/s")->capture_default_str();
  app.add_option("--latency-us", latency_us, "link latency per transfer")->capture_default_str();
  app.add_option("--threads", threads, "intra-op threads (0 = default)");
  app.add_option("--repeats", repeats, "runs per way, interleaved; medians reported")
      ->check(CLI::Range(1, 1000))
      ->capture_default_str();
  app.add_option("--stream-slots", stream_slots, "stream buffer (0 = two layers' experts)");
  app.add_option("--ways", ways, "cache | stream | auto (repeatable)")
      ->check(CLI::IsMember({"cache", "stream", "auto"}));
  CLI11_PARSE(app, argc, argv);
  spdlog::set_level(spdlog::level::warn);

  RankOptions options;
  options.model_dir = model_dir;
  options.threads = threads;
  options.device = device;
  options.dtype = dtype;
  options.experts = RankExperts::kResident;
  options.compute = false;
  options.prefix_caching = false;  // Every run prefills the same prompt in full.
  auto rank = Rank::Assemble(std::move(options));
  if (!rank.ok()) {
    std::fprintf(stderr, "cannot load %s: %s\n", model_dir.c_str(),
                 rank.status().message().c_str());
    return 1;
  }
  Rank& r = **rank;
  const ModelInfo& info = r.info();
  if (prompt_tokens + 2 > info.max_position_embeddings) {
    std::fprintf(stderr, "--prompt-tokens %u does not fit the model's %u positions\n",
                 prompt_tokens, info.max_position_embeddings);
    return 2;
  }
  // Prompts: the fallback texts, tokenized and repeated to length.
  std::vector<int32_t> text;
  while (text.size() < prompt_tokens + decode_prompt_tokens) {
    for (const std::string& p : bench::kFallbackPrompts) {
      auto ids = r.tokenizer()->Encode(p, false);
      if (ids.ok()) text.insert(text.end(), ids->begin(), ids->end());
    }
  }
  Setup setup;
  setup.warm = warm;
  setup.a_prompt.assign(text.begin(), text.begin() + decode_prompt_tokens);
  setup.b_prompt.assign(text.begin() + decode_prompt_tokens,
                        text.begin() + decode_prompt_tokens + prompt_tokens);

  RunOnce(r, *r.resident(), nullptr, StreamMode::kOff, setup);  // Warm-up.
  const Outcome ref = RunOnce(r, *r.resident(), nullptr, StreamMode::kOff, setup);
  std::printf(
      "model %s: L=%u J=%u K=%u; prompt %u tokens beside a decode of %u; budget %.2f; "
      "link %.2f GB/s + %.0f us; policy %s; %d repeats\n\n",
      model_dir.c_str(), info.num_moe_layers, info.num_experts, info.top_k, prompt_tokens,
      decode_prompt_tokens, budget, gbps, latency_us, policy.c_str(), repeats);
  std::printf(
      "| way | TTFT s, median (min-max) | A's TPOT ms before / after | MB moved in the prefill | "
      "stream "
      "loads | evictions | streamed iterations | tokens = all-resident |\n");
  std::printf("|---|---:|---:|---:|---:|---:|---:|---|\n");
  std::printf("| all resident | %.3f | %.1f / %.1f | 0 | 0 | 0 | 0 | - |\n", ref.ttft_s,
              ref.tpot_before_ms, ref.tpot_after_ms);
  // The ways interleaved run by run, so that drift in the machine's speed spreads over all.
  struct Figures {
    std::vector<double> ttft, before, after, mb, loads, evictions, streamed;
    bool same = true;
  };
  std::vector<Figures> figures(ways.size());
  for (int i = 0; i < repeats; ++i) {
    for (size_t w = 0; w < ways.size(); ++w) {
      const StreamMode mode = ways[w] == "cache"    ? StreamMode::kOff
                              : ways[w] == "stream" ? StreamMode::kOn
                                                    : StreamMode::kAuto;
      CachedExpertsOptions c;
      c.policy = policy;
      c.cache_fraction = budget;
      c.link.gbps = gbps;
      c.link.latency_us = latency_us;
      c.stream_slots =
          mode == StreamMode::kOff ? 0 : (stream_slots > 0 ? stream_slots : 2 * info.num_experts);
      auto cached = r.NewCachedExperts(c);
      if (!cached.ok()) {
        std::fprintf(stderr, "cache: %s\n", cached.status().message().c_str());
        return 1;
      }
      const Outcome o = RunOnce(r, **cached, cached->get(), mode, setup);
      Figures& f = figures[w];
      f.same = f.same && o.a_tokens == ref.a_tokens && o.b_tokens == ref.b_tokens;
      f.ttft.push_back(o.ttft_s);
      f.before.push_back(o.tpot_before_ms);
      f.after.push_back(o.tpot_after_ms);
      f.mb.push_back(o.prefill_mb);
      f.loads.push_back(static_cast<double>(o.stream_loads));
      f.evictions.push_back(static_cast<double>(o.evictions));
      f.streamed.push_back(static_cast<double>(o.streamed));
    }
  }
  int status = 0;
  for (size_t w = 0; w < ways.size(); ++w) {
    const Figures& f = figures[w];
    if (!f.same) status = 3;
    std::printf("| %s | %.3f (%.3f-%.3f) | %.1f / %.1f | %.0f | %.0f | %.0f | %.0f | %s |\n",
                ways[w].c_str(), Median(f.ttft), *std::min_element(f.ttft.begin(), f.ttft.end()),
                *std::max_element(f.ttft.begin(), f.ttft.end()), Median(f.before), Median(f.after),
                Median(f.mb), Median(f.loads), Median(f.evictions), Median(f.streamed),
                f.same ? "yes" : "**NO**");
  }
  return status;
}
