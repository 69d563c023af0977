// fmoe-generate: `fmoe generate --model DIR --prompt TEXT`, a quick local check of a checkpoint.
// The launcher (`fmoe`, Torch-free) execs this binary from its own directory with the arguments
// after `generate`. Assembles a rank (gpu_worker/rank.h: cpu, every expert resident, one request
// at a time) with a progress bar while the weights load, runs one request through the same engine
// a worker uses, streams the text to stdout and prints timings to stderr. Like the router, it is
// the engine's client: it matches the stop strings in the text it prints and cancels the request
// at the first one (the engine never looks for stop strings).
// Exit codes: 0 done, 1 load or run failure, 2 bad arguments.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "common/log.h"
#include "common/model/model_config.h"
#include "common/text/tokenizer.h"
#include "common/wire/sampling_limits.h"
#include "gpu_worker/rank.h"

namespace {

using namespace fmoe;

struct GenerateCommand {
  std::string model_dir;
  std::string prompt;
  uint32_t max_tokens = 64;       // Default: 64
  float temperature = 0.0f;       // Default: 0 (greedy)
  float top_p = 1.0f;             // Default: 1
  int32_t top_k = 0;              // Default: 0 (off)
  uint64_t seed = 0;              // Default: 0
  std::vector<std::string> stop;  // Stop strings. Default: none
  std::string dtype = "auto";     // auto (float32 on cpu) | float32 | bfloat16 | float16
  int threads = 0;                // Intra-op threads; 0 = LibTorch's choice. Default: 0
  std::string device = "cpu";     // cpu | cuda:N. Default: cpu
  bool no_bos = false;            // Do not add the tokenizer's BOS. Default: false
  // Prompt tokens per step (chunked prefill); 0 = the whole prompt at once. Default: 0
  uint32_t max_batched_tokens = 0;
};

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
}

// A one-line progress bar on stderr, redrawn in place on a terminal, printed once otherwise.
class ProgressBar {
 public:
  explicit ProgressBar(std::string label) : label_(std::move(label)), tty_(isatty(2) != 0) {}
  void Update(uint64_t done, uint64_t total) {
    if (!tty_ || total == 0) return;
    const int width = 30;
    const int filled = static_cast<int>(width * done / total);
    std::fprintf(stderr, "\r%s [%s%s] %3d%% %.1f/%.1f MB", label_.c_str(),
                 std::string(static_cast<size_t>(filled), '#').c_str(),
                 std::string(static_cast<size_t>(width - filled), '.').c_str(),
                 static_cast<int>(100 * done / total), done / 1e6, total / 1e6);
    std::fflush(stderr);
  }
  void Done(uint64_t total, double seconds) {
    std::fprintf(stderr, "%s%s: %.1f MB in %.2f s\n", tty_ ? "\r\033[K" : "", label_.c_str(),
                 total / 1e6, seconds);
  }

 private:
  std::string label_;
  bool tty_;
};

// What the engine reports, printed as it comes; the stop strings are matched here.
struct Output {
  TextStream* text = nullptr;
  StopMatcher* stops = nullptr;
  std::function<void()> cancel;  // Ends the request at the engine.
  std::chrono::steady_clock::time_point start;
  uint32_t generated = 0;
  double first_token_s = 0.0;
  bool done = false;
  int exit_code = 0;

  void OnToken(const TokenEvent& ev) {
    if (done) return;  // Ended by a stop string: the cancel's event.
    if (ev.token_id >= 0) {
      if (generated++ == 0) first_token_s = Seconds(start);
      if (!ev.stop_token) std::fputs(stops->Feed(text->Push(ev.token_id)).c_str(), stdout);
      std::fflush(stdout);
    }
    if (ev.finish == FinishReason::kNone) {
      if (!stops->stopped()) return;
      cancel();  // The text holds a stop string: done, with this token.
    }
    done = true;
    if (!stops->stopped()) std::fputs(stops->Feed(text->Finish()).c_str(), stdout);
    if (!stops->stopped()) std::fputs(stops->Flush().c_str(), stdout);
    std::fputs("\n", stdout);
    std::fflush(stdout);
    if (ev.finish == FinishReason::kError) {
      std::fprintf(stderr, "fmoe generate: %s\n", ev.error.c_str());
      exit_code = 1;
    }
  }
};

int RunGenerate(const GenerateCommand& cmd) {
  // Logs would interleave with the text on stdout: only warnings and errors.
  spdlog::set_level(spdlog::level::warn);
  auto info = LoadModelInfo(cmd.model_dir);
  if (!info.ok()) {
    std::fprintf(stderr, "fmoe generate: %s\n", info.status().message().c_str());
    return 1;
  }
  Output out;
  RankOptions options;
  options.model_dir = info->dir;
  options.model = *info;
  options.device = cmd.device;
  options.threads = cmd.threads;
  options.dtype = cmd.dtype;
  options.experts = RankExperts::kResident;
  options.max_batch = 1;
  options.max_batched_tokens = cmd.max_batched_tokens;
  options.on_token = [&out](const TokenEvent& ev) { out.OnToken(ev); };
  ProgressBar bar("loading " + info->dir);
  uint64_t loaded = 0;
  options.progress = [&](uint64_t done, uint64_t total) {
    loaded = total;
    bar.Update(done, total);
  };
  const auto load_start = std::chrono::steady_clock::now();
  auto assembled = Rank::Assemble(std::move(options));
  if (!assembled.ok()) {
    std::fprintf(stderr, "%sfmoe generate: %s\n", loaded > 0 ? "\n" : "",
                 assembled.status().message().c_str());
    return 1;
  }
  Rank& rank = **assembled;
  bar.Done(loaded, Seconds(load_start));

  auto ids = rank.tokenizer()->Encode(cmd.prompt, /*add_special_tokens=*/!cmd.no_bos);
  if (!ids.ok()) {
    std::fprintf(stderr, "fmoe generate: prompt: %s\n", ids.status().message().c_str());
    return 2;
  }
  Generate request;
  request.request_id = 1;
  request.token_ids = *ids;
  request.sampling.max_tokens = cmd.max_tokens;
  request.sampling.temperature = cmd.temperature;
  request.sampling.top_p = cmd.top_p;
  request.sampling.top_k = cmd.top_k;
  request.sampling.seed = cmd.seed;

  TextStream text(*rank.tokenizer(), /*skip_special_tokens=*/true);
  StopMatcher stops(cmd.stop);
  out.text = &text;
  out.stops = &stops;
  Engine& engine = *rank.engine();
  out.cancel = [&engine] { engine.Cancel(1); };
  out.start = std::chrono::steady_clock::now();
  std::fputs(cmd.prompt.c_str(), stdout);
  engine.Submit(std::move(request));
  while (!out.done && engine.Step()) {
  }
  const double total_s = Seconds(out.start);
  const double decode_s = total_s - out.first_token_s;
  std::fprintf(stderr,
               "[%zu prompt tokens, %u generated; prefill %.1f ms (%.0f tok/s); decode %.1f "
               "tok/s; %s]\n",
               ids->size(), out.generated, out.first_token_s * 1e3, ids->size() / out.first_token_s,
               out.generated > 1 ? (out.generated - 1) / decode_s : 0.0,
               rank.device().description.c_str());
  return out.exit_code;
}

}  // namespace

int main(int argc, char** argv) {
  GenerateCommand gen;
  CLI::App app{"run a model locally on one prompt"};  // Named by argv[0]: "fmoe generate".
  app.add_option("--model", gen.model_dir, "Hugging Face model directory")->required();
  app.add_option("--prompt", gen.prompt, "prompt text")->required();
  app.add_option("--max-tokens", gen.max_tokens, "tokens to generate")
      ->capture_default_str()
      ->check(CLI::Range(1u, 1u << 20));
  app.add_option("--temperature", gen.temperature, "0 = greedy")
      ->capture_default_str()
      ->check(CLI::Range(0.0f, kMaxTemperature));
  app.add_option("--top-p", gen.top_p, "nucleus sampling mass")
      ->capture_default_str()
      ->check(CLI::Range(0.0f, 1.0f));
  app.add_option("--top-k", gen.top_k, "0 = off")
      ->capture_default_str()
      ->check(CLI::Range(0, kMaxTopK));
  app.add_option("--seed", gen.seed, "sampling seed")->capture_default_str();
  app.add_option("--stop", gen.stop, "stop string (repeatable)");
  app.add_option("--dtype", gen.dtype,
                 "compute dtype; auto = the checkpoint's torch_dtype on cuda, float32 on cpu")
      ->capture_default_str()
      ->check(CLI::IsMember({"auto", "float32", "bfloat16", "float16"}));
  app.add_option("--device", gen.device, "cpu | cuda:N")->capture_default_str();
  app.add_option("--threads", gen.threads, "intra-op threads (0 = default)")
      ->check(CLI::NonNegativeNumber);
  app.add_flag("--no-bos", gen.no_bos, "do not add the tokenizer's BOS token");
  app.add_option("--max-batched-tokens", gen.max_batched_tokens,
                 "prefill the prompt in chunks of this many tokens (0 = whole)")
      ->capture_default_str()
      ->check(CLI::Range(0u, 1u << 20));
  CLI11_PARSE(app, argc, argv);
  return RunGenerate(gen);
}
