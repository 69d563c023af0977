#include "services/generate_cmd.h"

#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <memory>
#include <string>

#include "common/model_config.h"
#include "common/tokenizer.h"
#include "gpu_worker/device.h"
#include "gpu_worker/engine.h"
#include "gpu_worker/expert_source.h"
#include "gpu_worker/model.h"

namespace fmoe {
namespace {

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

}  // namespace

int RunGenerate(const GenerateCommand& cmd) {
  auto info = LoadModelInfo(cmd.model_dir);
  if (!info.ok()) {
    std::fprintf(stderr, "fmoe generate: %s\n", info.status().message().c_str());
    return 1;
  }
  auto tokenizer = Tokenizer::Load(info->dir);
  if (!tokenizer.ok()) {
    std::fprintf(stderr, "fmoe generate: %s\n", tokenizer.status().message().c_str());
    return 1;
  }
  auto device = ResolveDevice("cpu", -1, cmd.threads);
  if (!device.ok()) {
    std::fprintf(stderr, "fmoe generate: %s\n", device.status().message().c_str());
    return 1;
  }

  RuntimeOptions options;
  options.dtype = cmd.dtype;
  ExpertTable experts;
  ProgressBar bar("loading " + info->dir);
  const auto load_start = std::chrono::steady_clock::now();
  uint64_t loaded = 0;
  auto model = MoeModel::Load(
      *info, options,
      [&](uint64_t done, uint64_t total) {
        loaded = total;
        bar.Update(done, total);
      },
      &experts);
  if (!model.ok()) {
    std::fprintf(stderr, "\nfmoe generate: %s\n", model.status().message().c_str());
    return 1;
  }
  bar.Done(loaded, Seconds(load_start));

  auto ids = (*tokenizer)->Encode(cmd.prompt, /*add_special_tokens=*/!cmd.no_bos);
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
  request.sampling.stop = cmd.stop;

  EngineOptions engine_options;
  engine_options.max_batch = 1;
  engine_options.eos_token_ids = info->eos_token_ids;
  if (auto eos = (*tokenizer)->eos_id(); eos && info->eos_token_ids.empty()) {
    engine_options.eos_token_ids.push_back(*eos);
  }
  ResidentExperts source(std::move(experts));
  TextStream text(**tokenizer, /*skip_special_tokens=*/true);
  StopMatcher stops(cmd.stop);
  bool done = false;
  int exit_code = 0;
  uint32_t generated = 0;
  double first_token_s = 0.0;
  const auto run_start = std::chrono::steady_clock::now();
  std::fputs(cmd.prompt.c_str(), stdout);
  Engine engine(engine_options, **model, source, tokenizer->get(), nullptr,
                [&](const TokenEvent& ev) {
                  if (ev.token_id >= 0) {
                    if (generated++ == 0) first_token_s = Seconds(run_start);
                    std::fputs(stops.Feed(text.Push(ev.token_id)).c_str(), stdout);
                    std::fflush(stdout);
                  }
                  if (ev.finish == FinishReason::kNone) return;
                  done = true;
                  if (!stops.stopped()) std::fputs(stops.Feed(text.Finish()).c_str(), stdout);
                  if (!stops.stopped()) std::fputs(stops.Flush().c_str(), stdout);
                  std::fputs("\n", stdout);
                  std::fflush(stdout);
                  if (ev.finish == FinishReason::kError) {
                    std::fprintf(stderr, "fmoe generate: %s\n", ev.error.c_str());
                    exit_code = 1;
                  }
                });
  engine.Submit(std::move(request));
  while (!done && engine.Step()) {
  }
  const double total_s = Seconds(run_start);
  const double decode_s = total_s - first_token_s;
  std::fprintf(stderr,
               "[%zu prompt tokens, %u generated; prefill %.1f ms (%.0f tok/s); decode %.1f "
               "tok/s; %s]\n",
               ids->size(), generated, first_token_s * 1e3, ids->size() / first_token_s,
               generated > 1 ? (generated - 1) / decode_s : 0.0, device->description.c_str());
  return exit_code;
}

}  // namespace fmoe
