// runtime_bench: prefill and decode throughput of the model runtime on this machine, every expert
// resident (a rank assembled by gpu_worker/rank.h), through the same engine a worker runs. For
// each batch size: B requests of --prompt-tokens tokens (real text from --prompts, one prompt per
// request, cut or repeated to length) submitted together; prefill tokens/s = B * prompt tokens /
// time of the first iteration, decode tokens/s = tokens generated after it / the time they took.
// Peak resident memory (VmHWM) at the end. Prints a Markdown table.
//
//   build/bin/runtime_bench --model deploy/models/tiny-moe --batch 1 --batch 8
#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "bench/bench_prompts.h"
#include "common/log.h"
#include "gpu_worker/rank.h"

namespace {

using BenchClock = std::chrono::steady_clock;

double Since(BenchClock::time_point t) {
  return std::chrono::duration<double>(BenchClock::now() - t).count();
}

// The text used when no prompts file is given.
const std::vector<std::string> kFallback = {
    "The history of the city begins with a small settlement on the river, where traders met to "
    "exchange grain, salt and cloth. Over the centuries it grew into a market town"};

}  // namespace

int main(int argc, char** argv) {
  // Logs go to stderr: stdout carries the tables.
  if (fmoe::Status s = fmoe::InitLogging("runtime_bench", "info"); !s.ok()) return 2;
  using namespace fmoe;
  CLI::App app{"runtime_bench: prefill and decode tokens/s of the model runtime"};
  std::string model_dir = "deploy/models/tiny-moe";
  std::string prompts_path = "../shared/data/prompts/puffin-dev.jsonl";
  std::vector<uint32_t> batches;
  uint32_t prompt_tokens = 128, decode_tokens = 64;
  int threads = 0;
  int row_block = 4;
  std::string dtype = "float32";
  std::string device = "cpu";
  app.add_option("--model", model_dir)->capture_default_str();
  app.add_option("--prompts", prompts_path, "JSONL prompts (the text is cut to length)")
      ->capture_default_str();
  app.add_option("--batch", batches, "batch sizes (repeatable); default 1 and 8");
  app.add_option("--prompt-tokens", prompt_tokens)->capture_default_str();
  app.add_option("--decode-tokens", decode_tokens)->capture_default_str();
  app.add_option("--threads", threads, "intra-op threads, 0 = LibTorch default");
  app.add_option("--row-block", row_block, "rows per matrix block (0 = whole batch)")
      ->capture_default_str();
  app.add_option("--dtype", dtype, "auto | float32 | bfloat16 | float16")->capture_default_str();
  app.add_option("--device", device, "cpu | cuda:N")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  if (batches.empty()) batches = {1, 8};

  spdlog::set_level(spdlog::level::warn);  // The table alone on stdout.
  RankOptions options;
  options.model_dir = model_dir;
  options.threads = threads;
  options.device = device;
  options.dtype = dtype;
  options.row_block = row_block;
  options.experts = RankExperts::kResident;
  options.compute = false;  // An engine per batch size, below.
  auto rank = Rank::Assemble(std::move(options));
  if (!rank.ok()) {
    std::fprintf(stderr, "runtime_bench: %s\n", rank.status().message().c_str());
    return 1;
  }
  MoeModel& model = (*rank)->model();
  ExpertSource& experts = (*rank)->experts();
  const Tokenizer* tokenizer = (*rank)->tokenizer();

  uint32_t max_batch = 1;
  for (uint32_t b : batches) max_batch = std::max(max_batch, b);
  std::vector<std::vector<int32_t>> prompts;
  for (const std::string& text : bench::ReadPrompts(prompts_path, max_batch, kFallback)) {
    auto ids = tokenizer->Encode(text, true);
    if (!ids.ok() || ids->empty()) return 1;
    std::vector<int32_t> p;
    while (p.size() < prompt_tokens) p.insert(p.end(), ids->begin(), ids->end());
    p.resize(prompt_tokens);
    prompts.push_back(std::move(p));
  }

  std::printf("| batch | prompt tokens | prefill tok/s | decode tok/s | decode ms/iteration |\n");
  std::printf("|---:|---:|---:|---:|---:|\n");
  for (uint32_t batch : batches) {
    EngineOptions eo;
    eo.max_batch = batch;
    uint32_t done = 0;
    Engine engine(eo, model, experts, nullptr, nullptr, [&](const TokenEvent& ev) {
      if (ev.finish != FinishReason::kNone) ++done;
    });
    for (uint32_t r = 0; r < batch; ++r) {
      Generate g;
      g.request_id = r + 1;
      g.token_ids = prompts[r];
      g.sampling.max_tokens = decode_tokens + 1;  // The first token comes from prefill.
      engine.Submit(std::move(g));
    }
    auto t0 = BenchClock::now();
    engine.Step();  // Prefill of every request, first token each.
    const double prefill_s = Since(t0);
    auto t1 = BenchClock::now();
    uint64_t iterations = 0;
    while (done < batch && engine.Step()) ++iterations;
    const double decode_s = Since(t1);
    const double decoded = static_cast<double>(engine.stats().decode_tokens);
    std::printf("| %u | %u | %.0f | %.1f | %.2f |\n", batch, prompt_tokens,
                batch * prompt_tokens / prefill_s, decoded / decode_s,
                1e3 * decode_s / static_cast<double>(iterations));
    std::fflush(stdout);
  }
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  std::printf("\npeak resident memory: %.1f MB; %s; model %s, dtype %s, row block %d\n",
              usage.ru_maxrss / 1024.0, (*rank)->device().description.c_str(),
              (*rank)->info().dir.c_str(), (*rank)->dtype().c_str(), row_block);
  return 0;
}
