// Losslessness on the GPU (DESIGN section 3): with the model and the expert cache on cuda:0 (the
// CUDA link, device slots), every policy a manifest may serve, at 25% and 50% of the experts,
// generates exactly the greedy tokens the all-resident run on cuda:0 generates, for the shipped
// tiny model and the mixtral fixture, in float32 and bfloat16; the cache's invariants hold after
// every step. Label gpu: without a usable GPU every test says "skipped: no GPU" (ctest: Skipped).
#include "gpu_worker/cached_experts.h"

#include <algorithm>
#include <functional>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "common/model/model_config.h"
#include "common/policy_names.h"
#include "common/text/tokenizer.h"
#include "gpu_worker/engine.h"
#include "gpu_worker/model.h"
#include "tests/gpu_worker/gpu_skip.h"

namespace fmoe {
namespace {

struct Loaded {
  ModelInfo info;
  std::unique_ptr<Tokenizer> tokenizer;
  std::unique_ptr<MoeModel> model;
  ExpertTable table;
};

// The model in `dir` on cuda:0 in `dtype`, loaded as Rank::LoadWeights loads it; null on failure.
Loaded* Fixture(const std::string& dir, const std::string& dtype) {
  static auto* loaded = new std::map<std::string, std::unique_ptr<Loaded>>();
  auto& l = (*loaded)[dir + " " + dtype];
  if (!l) {
    auto fresh = std::make_unique<Loaded>();
    auto info = LoadModelInfo(dir);
    EXPECT_TRUE(info.ok()) << info.status().ToString();
    if (!info.ok()) return nullptr;
    fresh->info = *info;
    auto tok = Tokenizer::Load(dir);
    EXPECT_TRUE(tok.ok()) << tok.status().ToString();
    if (!tok.ok()) return nullptr;
    fresh->tokenizer = std::move(*tok);
    RuntimeOptions r;
    r.dtype = dtype;
    r.cuda_index = 0;
    auto model = MoeModel::Load(fresh->info, r, {}, &fresh->table);
    EXPECT_TRUE(model.ok()) << model.status().ToString();
    if (!model.ok()) return nullptr;
    fresh->model = std::move(*model);
    l = std::move(fresh);
  }
  return l.get();
}

// A stand-in for the map service: after each layer's gates, directs a prefetch of that layer's
// three most likely experts for the layer two ahead, so that prefetches are in flight.
class EchoDirectives final : public ForwardObserver {
 public:
  EchoDirectives(CachedExperts* target, uint32_t layers) : target_(target), layers_(layers) {}
  void OnLayerGates(uint64_t id, uint32_t iteration, uint32_t layer,
                    std::span<const float> probs) override {
    if (layer + 2 >= layers_) return;
    std::vector<uint32_t> order(probs.size());
    for (uint32_t j = 0; j < order.size(); ++j) order[j] = j;
    std::sort(order.begin(), order.end(),
              [&](uint32_t a, uint32_t b) { return probs[a] > probs[b]; });
    PrefetchDirective d;
    d.request_id = id;
    d.iteration = iteration;
    d.target_layer = layer + 2;
    d.score = 0.5f;
    for (size_t i = 0; i < 3 && i < order.size(); ++i) {
      d.entries.push_back({order[i], probs[order[i]], probs[order[i]] / 2});
    }
    target_->PostDirective(std::move(d));
  }

 private:
  CachedExperts* target_;
  uint32_t layers_;
};

using Tokens = std::map<uint64_t, std::vector<int32_t>>;

const std::vector<std::string> kPrompts = {
    "The history of the city begins",          "In the beginning God created", "def fibonacci(n):",
    "The theorem states that for every prime", "She opened the door and saw",  "Water boils at"};

// Greedy decode of every prompt, four at a time (requests join and leave mid-run); `after_step`
// runs after every engine step.
Tokens RunPrompts(Loaded& f, ExpertSource& source, ForwardObserver* observer,
                  const std::function<void()>& after_step) {
  Tokens out;
  EngineOptions options;
  options.max_batch = 4;
  Engine engine(options, *f.model, source, f.tokenizer.get(), observer, [&](const TokenEvent& ev) {
    if (ev.token_id >= 0) out[ev.request_id].push_back(ev.token_id);
    EXPECT_NE(ev.finish, FinishReason::kError) << ev.error;
  });
  for (size_t i = 0; i < kPrompts.size(); ++i) {
    Generate g;
    g.request_id = i + 1;
    g.token_ids = *f.tokenizer->Encode(kPrompts[i], true);
    g.sampling.max_tokens = 10 + static_cast<uint32_t>(i);
    engine.Submit(std::move(g));
  }
  for (int step = 0; step < 200 && engine.Step(); ++step) {
    if (after_step) after_step();
  }
  return out;
}

std::vector<std::string> ServablePolicies() {
  std::vector<std::string> out;
  for (const PolicyName& p : kPolicyNames) {
    if (p.servable) out.emplace_back(p.name);
  }
  return out;
}

// (model directory under the source tree, dtype).
class CudaOffload : public ::testing::TestWithParam<std::tuple<const char*, const char*>> {};

INSTANTIATE_TEST_SUITE_P(ModelsAndDtypes, CudaOffload,
                         ::testing::Combine(::testing::Values("deploy/models/tiny-moe",
                                                              "tests/fixtures/mixtral-ref"),
                                            ::testing::Values("float32", "bfloat16")),
                         [](const auto& info) {
                           std::string name = std::get<0>(info.param);
                           name = name.substr(name.rfind('/') + 1) + "_" + std::get<1>(info.param);
                           std::erase(name, '-');
                           return name;
                         });

TEST_P(CudaOffload, EveryServablePolicyAndBudgetGivesTheAllResidentTokens) {
  FMOE_SKIP_WITHOUT_GPU();
  const std::string dir = std::string(FMOE_SOURCE_DIR) + "/" + std::get<0>(GetParam());
  const std::string dtype = std::get<1>(GetParam());
  Loaded* f = Fixture(dir, dtype);
  ASSERT_NE(f, nullptr);
  const ModelInfo& info = f->info;

  ResidentExperts resident(CloneExpertTable(f->table));
  const Tokens ref = RunPrompts(*f, resident, nullptr, {});
  ASSERT_EQ(ref.size(), kPrompts.size());
  for (size_t i = 0; i < kPrompts.size(); ++i) {
    EXPECT_FALSE(ref.at(i + 1).empty()) << "prompt " << i;
  }

  const std::vector<std::string> policies = ServablePolicies();
  ASSERT_FALSE(policies.empty());
  for (const std::string& policy : policies) {
    for (double fraction : {0.25, 0.5}) {
      CachedExpertsOptions o;
      o.policy = policy;
      o.top_k = info.top_k;
      o.cache_fraction = fraction;
      o.cuda_index = 0;
      o.policy_options.prefetch_distance = 2;
      auto cached = CachedExperts::Create(CloneExpertTable(f->table), o);
      ASSERT_TRUE(cached.ok()) << policy << " " << fraction << ": " << cached.status().ToString();
      CachedExperts& c = **cached;
      EchoDirectives directives(&c, info.num_moe_layers);
      bool invariants = true;
      const Tokens got = RunPrompts(*f, c, &directives, [&] {
        Status s = c.cache().CheckInvariants();
        if (!s.ok() && invariants) {
          ADD_FAILURE() << policy << " " << fraction << ": " << s.ToString();
          invariants = false;
        }
      });
      EXPECT_EQ(got, ref) << "policy " << policy << " budget " << fraction << " dtype " << dtype;
      const CacheStats st = c.stats();
      EXPECT_LE(st.resident, st.slots) << policy;
      EXPECT_LT(st.slots, info.num_moe_layers * info.num_experts) << policy << " " << fraction;
      EXPECT_GT(st.total.misses, 0u) << policy << " " << fraction;
      EXPECT_GT(st.total.bytes_moved, 0u) << policy << " " << fraction;
    }
  }
}

}  // namespace
}  // namespace fmoe
