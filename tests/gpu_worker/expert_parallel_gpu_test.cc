// Expert parallelism on cuda:0 (DESIGN section 7), world 1: a rank on cuda:0 joined to a group of
// one, as Rank::Assemble joins it (cuda_index 0, which selects NCCL for a larger world), decodes
// exactly the greedy tokens it decodes without a group, all-resident and with its expert cache
// at half the experts on the CUDA link. A group of one opens no rendezvous and no process group
// (backend "none"), so NCCL itself is exercised only by worlds of two or more, which need as many
// GPUs. Label gpu: without a usable GPU every test says "skipped: no GPU" (ctest: Skipped).
#include <map>
#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/model/model_config.h"
#include "common/text/tokenizer.h"
#include "gpu_worker/engine/engine.h"
#include "gpu_worker/experts/cached_experts.h"
#include "gpu_worker/group/expert_group.h"
#include "gpu_worker/model/model.h"
#include "tests/gpu_worker/gpu_skip.h"
#include "tests/testing/model_fixture.h"

namespace fmoe {
namespace {

using testing::kPrompts;
using testing::Tokens;

const std::string kModelDir = testing::TinyModelDir();

// Greedy decode of every prompt, four at a time; `group` may be null.
Tokens RunPrompts(MoeModel& model, ExpertSource& source, const Tokenizer& tokenizer,
                  ExpertGroup* group) {
  Tokens out;
  EngineOptions options;
  options.max_batch = 4;
  options.group = group;
  Engine engine(options, model, source, &tokenizer, nullptr, [&](const TokenEvent& ev) {
    if (ev.token_id >= 0) out[ev.request_id].push_back(ev.token_id);
    EXPECT_NE(ev.finish, FinishReason::kError) << ev.error;
  });
  for (Generate& g : testing::PromptRequests(tokenizer, /*sampled=*/false)) {
    engine.Submit(std::move(g));
  }
  for (int step = 0; step < 200 && engine.Step(); ++step) {
  }
  EXPECT_FALSE(engine.group_failed());
  return out;
}

TEST(ExpertParallelOnCuda, AGroupOfOneGivesTheUngroupedTokens) {
  FMOE_SKIP_WITHOUT_GPU();
  auto info = LoadModelInfo(kModelDir);
  ASSERT_TRUE(info.ok()) << info.status().ToString();
  auto tokenizer = Tokenizer::Load(kModelDir);
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status().ToString();
  RuntimeOptions r;
  r.cuda_index = 0;
  ExpertTable table;
  auto model = MoeModel::Load(*info, r, {}, &table);
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  MoeModel& m = **model;

  ExpertGroupOptions g;
  g.group = "gpu-test";
  g.rank = 0;
  g.world_size = 1;
  g.cuda_index = 0;
  auto joined = ExpertGroup::Join(g);
  ASSERT_TRUE(joined.ok()) << joined.status().ToString();
  ExpertGroup& group = **joined;
  EXPECT_EQ(group.world_size(), 1u);
  EXPECT_EQ(group.backend(), "none");

  // All resident, on the device.
  auto alone_source = ResidentExperts::Create(CloneExpertTable(table), 0);
  ASSERT_TRUE(alone_source.ok()) << alone_source.status().ToString();
  ASSERT_TRUE((*alone_source)->experts()[0][0].w1.is_cuda());
  const Tokens alone = RunPrompts(m, **alone_source, **tokenizer, nullptr);
  ASSERT_EQ(alone.size(), kPrompts.size());
  auto grouped_source = ResidentExperts::Create(CloneExpertTable(table), 0);
  ASSERT_TRUE(grouped_source.ok()) << grouped_source.status().ToString();
  m.set_group(&group);
  const Tokens grouped = RunPrompts(m, **grouped_source, **tokenizer, &group);
  m.set_group(nullptr);
  EXPECT_EQ(grouped, alone);

  // The expert cache at half the experts, on the CUDA link.
  CachedExpertsOptions o;
  o.policy = "lru";
  o.top_k = info->top_k;
  o.cache_fraction = 0.5;
  o.cuda_index = 0;
  auto cached = CachedExperts::Create(CloneExpertTable(table), o);
  ASSERT_TRUE(cached.ok()) << cached.status().ToString();
  m.set_group(&group);
  const Tokens grouped_cached = RunPrompts(m, **cached, **tokenizer, &group);
  m.set_group(nullptr);
  EXPECT_EQ(grouped_cached, alone);
  EXPECT_GT((*cached)->stats().total.misses, 0u);
}

}  // namespace
}  // namespace fmoe
