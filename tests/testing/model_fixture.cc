#include "tests/testing/model_fixture.h"

#include <cstdlib>
#include <mutex>
#include <utility>

#include <gtest/gtest.h>

#include "gpu_worker/engine/engine.h"

namespace fmoe::testing {

std::string TinyModelDir() { return std::string(FMOE_SOURCE_DIR) + "/deploy/models/tiny-moe"; }

std::string FixtureDir(const std::string& name) {
  return std::string(FMOE_SOURCE_DIR) + "/tests/fixtures/" + name;
}

std::unique_ptr<LoadedModel> LoadModel(const std::string& dir, const RuntimeOptions& options) {
  auto loaded = std::make_unique<LoadedModel>();
  auto info = LoadModelInfo(dir);
  EXPECT_TRUE(info.ok()) << info.status().ToString();
  if (!info.ok()) return nullptr;
  loaded->info = *info;
  auto tok = Tokenizer::Load(dir);
  EXPECT_TRUE(tok.ok()) << tok.status().ToString();
  if (!tok.ok()) return nullptr;
  loaded->tokenizer = std::move(*tok);
  auto model = MoeModel::Load(loaded->info, options, {}, &loaded->table);
  EXPECT_TRUE(model.ok()) << model.status().ToString();
  if (!model.ok()) return nullptr;
  loaded->model = std::move(*model);
  return loaded;
}

LoadedModel& SharedModel(const std::string& dir) {
  static std::mutex mu;
  static auto* loaded = new std::map<std::string, std::unique_ptr<LoadedModel>>();
  std::lock_guard<std::mutex> lock(mu);
  auto& slot = (*loaded)[dir];
  if (!slot) slot = LoadModel(dir);
  if (!slot) {
    ADD_FAILURE() << "cannot load the model in " << dir;
    std::abort();  // Every caller dereferences the model.
  }
  return *slot;
}

std::vector<Generate> PromptRequests(const Tokenizer& tokenizer, bool sampled) {
  std::vector<Generate> out;
  for (size_t i = 0; i < kPrompts.size(); ++i) {
    Generate g;
    g.request_id = i + 1;
    g.token_ids = *tokenizer.Encode(kPrompts[i], true);
    g.sampling.max_tokens = 10 + static_cast<uint32_t>(i);
    if (sampled && i % 2 == 1) {  // Half sampled with a seed, half greedy.
      g.sampling.temperature = 0.8f;
      g.sampling.top_p = 0.9f;
      g.sampling.seed = 1000 + i;
    }
    out.push_back(std::move(g));
  }
  return out;
}

Tokens RunPrompts(LoadedModel& model, ExpertSource& source, ForwardObserver* observer,
                  const std::function<void()>& after_step, bool sampled) {
  Tokens out;
  EngineOptions options;
  options.max_batch = 4;  // Six prompts: requests join and leave mid-run.
  Engine engine(options, *model.model, source, model.tokenizer.get(), observer,
                [&](const TokenEvent& ev) {
                  if (ev.token_id >= 0) out[ev.request_id].push_back(ev.token_id);
                  EXPECT_NE(ev.finish, FinishReason::kError) << ev.error;
                });
  for (Generate& g : PromptRequests(*model.tokenizer, sampled)) engine.Submit(std::move(g));
  for (int step = 0; step < 200 && engine.Step(); ++step) {
    if (after_step) after_step();
  }
  return out;
}

}  // namespace fmoe::testing
