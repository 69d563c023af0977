// Models for the tests that run LibTorch code in-process: the shipped tiny model and the family
// fixtures (tests/fixtures/<family>-ref), loaded once per process and shared, the prompts the
// losslessness tests decode, and one engine run of them.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/model/model_config.h"
#include "common/text/tokenizer.h"
#include "common/wire/messages.h"
#include "gpu_worker/experts/expert_source.h"
#include "gpu_worker/model/model.h"
#include "gpu_worker/observe/forward_observer.h"

namespace fmoe::testing {

// deploy/models/tiny-moe in the source tree.
std::string TinyModelDir();
// tests/fixtures/<name> in the source tree (e.g. "mixtral-ref").
std::string FixtureDir(const std::string& name);

// A model's description, tokenizer and weights; `table` holds the experts MoeModel::Load loaded.
struct LoadedModel {
  ModelInfo info;
  std::unique_ptr<Tokenizer> tokenizer;
  std::unique_ptr<MoeModel> model;
  ExpertTable table;
};

// Loads the model in `dir` with `options`; a failure is a test failure (EXPECT) and gives null.
std::unique_ptr<LoadedModel> LoadModel(const std::string& dir, const RuntimeOptions& options = {});
// The model in `dir` with default RuntimeOptions, loaded on first use and kept for the process
// (thread-safe). Tests copy `table` (CloneExpertTable) rather than take it.
LoadedModel& SharedModel(const std::string& dir);

// Generated tokens per request id.
using Tokens = std::map<uint64_t, std::vector<int32_t>>;

// The prompts the losslessness tests decode.
inline const std::vector<std::string> kPrompts = {
    "The history of the city begins",          "In the beginning God created", "def fibonacci(n):",
    "The theorem states that for every prime", "She opened the door and saw",  "Water boils at"};

// kPrompts as requests: ids 1..6, prompt i asking for 10 + i tokens. With `sampled`, every
// second one samples (temperature 0.8, top_p 0.9, seed 1000 + i); the others are greedy.
std::vector<Generate> PromptRequests(const Tokenizer& tokenizer, bool sampled = true);

// Decodes PromptRequests(sampled) with `model`'s weights over `source`, four at a time (requests
// join and leave mid-run), for at most 200 steps; `after_step` runs after every step. An error
// event is a test failure.
Tokens RunPrompts(LoadedModel& model, ExpertSource& source, ForwardObserver* observer,
                  const std::function<void()>& after_step = {}, bool sampled = true);

}  // namespace fmoe::testing
