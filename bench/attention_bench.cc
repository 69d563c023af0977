// One layer's attention (gpu_worker/model/blocks.h Attention) on the CPU. Random weights and
// activations, grouped-query shapes (default Mixtral's: 32 heads, 8 KV heads, head_dim 128,
// hidden 4096), float32 or bfloat16 (--dtype).
// Prefill (the default): a long prompt's wall time and the peak resident memory it adds, with the
// queries in blocks under a score budget (RuntimeOptions::attention_score_budget) or in one block.
// One prefill per process, so the peak (VmHWM) is the call's:
//   build/bin/attention_bench --tokens 4096 --budget 67108864
//   build/bin/attention_bench --tokens 4096 --budget 0      # 0: one block, whatever its size
// Decode (--decode B): B sequences of --tokens cached positions each (in 16-row blocks scattered
// over the pool, as the paged pool hands them out) take one decode step together; the median time
// of --reps calls, and the attention part's KV read rate. FMOE_CPU_DECODE_ATTENTION=0 runs
// LibTorch's expression instead of the host decode kernel (cpu_attention.h):
//   build/bin/attention_bench --decode 8 --tokens 2048 --dtype bfloat16
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>
#include <CLI/CLI.hpp>

#include "common/model/model_config.h"
#include "gpu_worker/model/blocks.h"

namespace {

// A "Vm...:" line of /proc/self/status, in bytes (0 when absent).
uint64_t ProcStatusBytes(const std::string& key) {
  std::ifstream in("/proc/self/status");
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(key + ":", 0) == 0) return std::stoull(line.substr(key.size() + 1)) * 1024;
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"attention_bench: one layer's prefill attention, time and peak memory"};
  int64_t tokens = 4096, heads = 32, kv_heads = 8, head_dim = 128, hidden = 4096;
  int64_t budget = int64_t{1} << 26;
  int64_t decode = 0, reps = 20;
  std::string dtype = "float32";
  app.add_option("--tokens", tokens, "prompt tokens")->check(CLI::Range(1, 1 << 20));
  app.add_option("--heads", heads, "query heads")->check(CLI::Range(1, 1024));
  app.add_option("--kv-heads", kv_heads, "key/value heads (divides --heads)")
      ->check(CLI::Range(1, 1024));
  app.add_option("--head-dim", head_dim, "head dimension")->check(CLI::Range(2, 1024));
  app.add_option("--hidden", hidden, "hidden size")->check(CLI::Range(1, 1 << 16));
  app.add_option("--budget", budget, "score elements per query block; 0 = one block")
      ->check(CLI::Range(int64_t{0}, std::numeric_limits<int64_t>::max()));
  app.add_option("--decode", decode, "decode: this many sequences take one step (0: prefill)")
      ->check(CLI::Range(0, 4096));
  app.add_option("--reps", reps, "decode: calls timed (the median is reported)")
      ->check(CLI::Range(1, 100000));
  app.add_option("--dtype", dtype, "float32 | bfloat16")
      ->check(CLI::IsMember({"float32", "bfloat16"}))
      ->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  if (heads % kv_heads != 0) {
    std::fprintf(stderr, "attention_bench: --kv-heads %lld does not divide --heads %lld\n",
                 static_cast<long long>(kv_heads), static_cast<long long>(heads));
    return 2;
  }
  if (budget == 0) budget = std::numeric_limits<int64_t>::max();

  c10::InferenceMode guard;
  at::manual_seed(1);
  fmoe::ModelInfo info;
  info.num_attention_heads = static_cast<uint32_t>(heads);
  info.num_key_value_heads = static_cast<uint32_t>(kv_heads);
  info.head_dim = static_cast<uint32_t>(head_dim);
  info.hidden_size = static_cast<uint32_t>(hidden);
  const double scale = 1.0 / std::sqrt(static_cast<double>(hidden));
  fmoe::AttentionWeights w;
  w.wq = at::randn({heads * head_dim, hidden}) * scale;
  w.wk = at::randn({kv_heads * head_dim, hidden}) * scale;
  w.wv = at::randn({kv_heads * head_dim, hidden}) * scale;
  w.wo = at::randn({hidden, heads * head_dim}) * scale;
  at::Tensor hn = at::randn({tokens, hidden});
  // The paged pool's layout ([rows, KV, hd]), the sequence's positions in rows 0..tokens-1.
  at::Tensor k_pool = at::zeros({tokens, kv_heads, head_dim});
  at::Tensor v_pool = at::zeros({tokens, kv_heads, head_dim});
  at::Tensor slots = at::arange(tokens, at::kLong);
  fmoe::RotaryTables rope;
  at::Tensor freqs =
      at::outer(at::arange(tokens, at::kLong).to(at::kFloat), fmoe::RotaryInverseFrequencies(info));
  at::Tensor emb = at::cat({freqs, freqs}, -1);
  rope.cos = emb.cos();
  rope.sin = emb.sin();
  if (decode > 0) {
    const at::ScalarType dt = dtype == "bfloat16" ? at::kBFloat16 : at::kFloat;
    for (at::Tensor* t : {&w.wq, &w.wk, &w.wv, &w.wo, &rope.cos, &rope.sin}) *t = t->to(dt);
    // Sequence b's positions at pool rows perm[b * tokens + j]: the paged pool's 16-row blocks,
    // handed out in a shuffled order.
    const int64_t blocks = (decode * tokens + 15) / 16;
    const at::Tensor perm =
        (at::randperm(blocks, at::kLong).unsqueeze(1) * 16 + at::arange(16, at::kLong).unsqueeze(0))
            .flatten()
            .narrow(0, 0, decode * tokens);
    at::Tensor dk = at::randn({blocks * 16, kv_heads, head_dim}).to(dt);
    at::Tensor dv = at::randn({blocks * 16, kv_heads, head_dim}).to(dt);
    std::vector<fmoe::AttentionSpan> steps;
    for (int64_t b = 0; b < decode; ++b) {
      steps.push_back({b, 1, tokens - 1, &dk, &dv, perm.narrow(0, b * tokens, tokens), 0});
    }
    const at::Tensor x = at::randn({decode, hidden}).to(dt);
    std::vector<double> ms;
    at::Tensor out;
    for (int64_t r = 0; r < reps + 2; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      out = fmoe::Attention(info, w, x, steps, rope, /*row_block=*/1, budget);
      const double t =
          std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
      if (r >= 2) ms.push_back(t);  // Two warm-up calls.
    }
    std::sort(ms.begin(), ms.end());
    const double median = ms[ms.size() / 2];
    const double kv_bytes = 2.0 * static_cast<double>(decode * tokens * kv_heads * head_dim) *
                            static_cast<double>(dk.element_size());
    const char* env = std::getenv("FMOE_CPU_DECODE_ATTENTION");
    std::printf(
        "decode: %lld sequences x %lld positions, heads %lld/%lld, head_dim %lld, %s, %s: "
        "median %.3f ms per step (min %.3f, max %.3f; %lld calls); KV read %.2f GB/s over the "
        "whole call (checksum %.4f)\n",
        static_cast<long long>(decode), static_cast<long long>(tokens),
        static_cast<long long>(heads), static_cast<long long>(kv_heads),
        static_cast<long long>(head_dim), dtype.c_str(),
        env != nullptr && std::string(env) == "0" ? "LibTorch expression" : "host decode kernel",
        median, ms.front(), ms.back(), static_cast<long long>(reps), kv_bytes / median / 1e6,
        out.to(at::kFloat).abs().mean().item<double>());
    return 0;
  }
  const std::vector<fmoe::AttentionSpan> spans = {{0, tokens, 0, &k_pool, &v_pool, slots, 0}};

  const uint64_t rss_before = ProcStatusBytes("VmRSS");
  const auto start = std::chrono::steady_clock::now();
  at::Tensor out = fmoe::Attention(info, w, hn, spans, rope, /*row_block=*/0, budget);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const uint64_t peak = ProcStatusBytes("VmHWM");
  const int64_t block = fmoe::QueryBlockRows(heads, tokens, budget);
  std::printf(
      "tokens %lld, heads %lld/%lld, head_dim %lld: query blocks of %lld rows (%lld blocks)\n",
      static_cast<long long>(tokens), static_cast<long long>(heads),
      static_cast<long long>(kv_heads), static_cast<long long>(head_dim),
      static_cast<long long>(std::min(block, tokens)),
      static_cast<long long>((tokens + block - 1) / block));
  std::printf("time %.3f s; peak rss %.2f GB, %.2f GB above the inputs' %.2f GB (checksum %.4f)\n",
              seconds, peak / 1e9, (peak - std::min(peak, rss_before)) / 1e9, rss_before / 1e9,
              out.abs().mean().item<double>());
  return 0;
}
