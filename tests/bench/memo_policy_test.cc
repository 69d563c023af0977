// The replay's score memo (bench/fmoe_bench/memo_policy.h): a score is computed once until a
// callback or a new running layer may have changed it, and is then the policy's own again.
#include "bench/fmoe_bench/memo_policy.h"

#include <memory>
#include <vector>

#include <gtest/gtest.h>

namespace fmoe::bench {
namespace {

constexpr uint32_t kLayers = 2;
constexpr uint32_t kExperts = 3;

class Control final : public CacheControl {
 public:
  uint32_t num_layers() const override { return kLayers; }
  uint32_t num_experts() const override { return kExperts; }
  uint32_t top_k() const override { return 1; }
  uint32_t slots() const override { return 2; }
  bool Owns(uint32_t, uint32_t) const override { return true; }
  uint32_t current_layer() const override { return layer; }
  void Prefetch(uint32_t, uint32_t, double) override {}
  void ClearPrefetches() override {}
  uint32_t layer = 0;
};

// Scores from a table the test changes behind the memo's back, as a policy's state would.
class Table final : public CachePolicy {
 public:
  std::string_view name() const override { return "table"; }
  double EvictionScore(uint32_t layer, uint32_t expert) const override {
    return score[layer * kExperts + expert] + 100.0 * control_->current_layer();
  }
  std::vector<double> score = std::vector<double>(kLayers * kExperts, 1.0);
};

struct Memo {
  Memo() {
    auto t = std::make_unique<Table>();
    table = t.get();
    memo = std::make_unique<MemoPolicy>(std::move(t));
    memo->Attach(&control);
  }
  Control control;
  Table* table = nullptr;
  std::unique_ptr<MemoPolicy> memo;
};

TEST(MemoPolicy, ComputesAScoreOnceUntilSomethingMayChangeIt) {
  Memo m;
  EXPECT_EQ(m.memo->name(), "table");
  EXPECT_EQ(m.memo->EvictionScore(1, 2), 1.0);
  m.table->score[5] = 7.0;  // Unseen: no callback said so.
  EXPECT_EQ(m.memo->EvictionScore(1, 2), 1.0);
  EXPECT_EQ(m.memo->computed(), 1u);
  // A per-expert callback forgets that expert's score only.
  m.table->score[0] = 3.0;
  m.memo->OnUse(1, 2, /*hit=*/true);
  EXPECT_EQ(m.memo->EvictionScore(1, 2), 7.0);
  EXPECT_EQ(m.memo->EvictionScore(0, 0), 3.0);  // First time asked.
  m.table->score[0] = 4.0;
  m.memo->OnResident(1, 2);
  EXPECT_EQ(m.memo->EvictionScore(0, 0), 3.0);
  m.memo->OnEvicted(0, 0);
  EXPECT_EQ(m.memo->EvictionScore(0, 0), 4.0);
  EXPECT_EQ(m.memo->computed(), 4u);
}

TEST(MemoPolicy, EveryOtherCallbackAndANewRunningLayerForgetEveryScore) {
  Memo m;
  int round = 0;
  const auto changed = [&] {
    ++round;
    for (double& s : m.table->score) s = round;
    return m.memo->EvictionScore(0, 1) == round + 100.0 * m.control.layer &&
           m.memo->EvictionScore(1, 0) == round + 100.0 * m.control.layer;
  };
  m.memo->EvictionScore(0, 1);
  m.memo->EvictionScore(1, 0);
  m.memo->OnIterationStart({});
  EXPECT_TRUE(changed());
  m.memo->OnLayerStart(LayerRouting{});
  EXPECT_TRUE(changed());
  m.memo->OnLayerEnd(0);
  EXPECT_TRUE(changed());
  m.memo->OnIterationEnd();
  EXPECT_TRUE(changed());
  m.memo->OnRequestEnd(9);
  EXPECT_TRUE(changed());
  m.memo->OnDirective(PrefetchDirective{});
  EXPECT_TRUE(changed());
  const std::vector<float> probs(kExperts, 0.5f);
  m.memo->OnSpeculation(0, 1, probs);
  EXPECT_TRUE(changed());
  m.control.layer = 1;  // The cache moved on without a callback yet.
  EXPECT_TRUE(changed());
}

}  // namespace
}  // namespace fmoe::bench
