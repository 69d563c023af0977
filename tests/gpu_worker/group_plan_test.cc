// The leader's iteration plan: round trips, and every malformed or over-limit plan a rank could
// receive is refused with a message naming what is wrong (never a crash, never a partial plan).
#include "gpu_worker/core/group_plan.h"

#include <cstring>

#include <gtest/gtest.h>

namespace fmoe {
namespace {

IterationPlan Sample() {
  IterationPlan plan;
  plan.kind = PlanKind::kIteration;
  plan.step = 41;
  plan.ended = {7, 9};
  plan.sequences.push_back({11, 0, {1, 2, 3, 4}, /*prefill=*/true});
  plan.sequences.push_back({12, 5, {99}, /*prefill=*/false});
  return plan;
}

PlanLimits Limits() {
  PlanLimits l;
  l.max_sequences = 4;
  l.max_ended = 8;
  l.max_tokens = 16;
  l.vocab_size = 100;
  return l;
}

std::string ErrorOf(const std::vector<uint8_t>& bytes, const PlanLimits& limits = Limits()) {
  auto plan = DecodePlan(bytes, limits);
  EXPECT_FALSE(plan.ok());
  if (plan.ok()) return "";
  EXPECT_EQ(plan.status().code(), ErrorCode::kInvalidArgument);
  return plan.status().message();
}

TEST(GroupPlan, RoundTrips) {
  for (const IterationPlan& plan : {Sample(), IterationPlan{PlanKind::kIdle, 3, {1, 2, 3}, {}, {5}},
                                    IterationPlan{PlanKind::kStop, 0, {}, {}, {}}}) {
    auto back = DecodePlan(EncodePlan(plan), Limits());
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    EXPECT_EQ(*back, plan);
  }
}

TEST(GroupPlan, EveryTruncationIsRefused) {
  const std::vector<uint8_t> bytes = EncodePlan(Sample());
  for (size_t n = 0; n < bytes.size(); ++n) {
    std::vector<uint8_t> cut(bytes.begin(), bytes.begin() + static_cast<long>(n));
    EXPECT_NE(ErrorOf(cut).find("iteration plan: "), std::string::npos) << n;
  }
  std::vector<uint8_t> longer = bytes;
  longer.push_back(0);
  EXPECT_NE(ErrorOf(longer).find("1 trailing bytes"), std::string::npos);
}

TEST(GroupPlan, BadHeadersAreNamed) {
  std::vector<uint8_t> bytes = EncodePlan(Sample());
  bytes[0] = 'X';
  EXPECT_NE(ErrorOf(bytes).find("bad magic"), std::string::npos);
  bytes = EncodePlan(Sample());
  bytes[4] = 9;  // Version.
  EXPECT_NE(ErrorOf(bytes).find("version 9"), std::string::npos);
  bytes = EncodePlan(Sample());
  bytes[6] = 7;  // Kind.
  EXPECT_NE(ErrorOf(bytes).find("unknown kind 7"), std::string::npos);
  IterationPlan idle = Sample();
  idle.kind = PlanKind::kIdle;
  EXPECT_NE(ErrorOf(EncodePlan(idle)).find("runs nothing lists 2 sequences"), std::string::npos);
}

TEST(GroupPlan, LimitsAndContentsAreChecked) {
  IterationPlan plan = Sample();
  PlanLimits tight = Limits();
  tight.max_sequences = 1;
  EXPECT_NE(ErrorOf(EncodePlan(plan), tight).find("2 sequences, more than max_batch 1"),
            std::string::npos);
  tight = Limits();
  tight.max_ended = 1;
  EXPECT_NE(ErrorOf(EncodePlan(plan), tight).find("2 ended requests"), std::string::npos);
  tight = Limits();
  tight.max_tokens = 3;
  EXPECT_NE(ErrorOf(EncodePlan(plan), tight).find("4 tokens, more than 3"), std::string::npos);

  plan = Sample();
  plan.sequences[0].tokens[2] = 100;
  EXPECT_NE(ErrorOf(EncodePlan(plan)).find("token 100 is not in the vocabulary of 100"),
            std::string::npos);
  plan = Sample();
  plan.sequences[0].tokens[0] = -1;
  EXPECT_NE(ErrorOf(EncodePlan(plan)).find("token -1"), std::string::npos);
  plan = Sample();
  plan.sequences[1].tokens = {1, 2};
  EXPECT_NE(ErrorOf(EncodePlan(plan)).find("decodes 2 tokens at once"), std::string::npos);
  plan = Sample();
  plan.sequences[1].tokens.clear();
  EXPECT_NE(ErrorOf(EncodePlan(plan)).find("has no tokens"), std::string::npos);
  plan = Sample();
  plan.sequences[1].request_id = 11;
  EXPECT_NE(ErrorOf(EncodePlan(plan)).find("request 11 appears twice"), std::string::npos);
}

// A prompt prefilled in chunks: a later iteration may carry several prompt tokens; a decode
// carries one, and a request's first iteration is its prompt.
TEST(GroupPlan, PrefillChunksAndDecodesAreTold) {
  IterationPlan plan = Sample();
  plan.sequences[1] = {12, 3, {5, 6, 7}, /*prefill=*/true};
  auto back = DecodePlan(EncodePlan(plan), Limits());
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, plan);
  plan = Sample();
  plan.sequences[0].prefill = false;
  plan.sequences[0].tokens = {1};
  EXPECT_NE(ErrorOf(EncodePlan(plan)).find("starts with a decode step"), std::string::npos);
  std::vector<uint8_t> bytes = EncodePlan(Sample());
  const size_t flags_at = 4 + 2 + 2 + 8 + 4 + 4 + 2 * 8 + 4 + 1 + 8 + 4;  // Sequence 0's flags.
  ASSERT_EQ(bytes[flags_at], 1);
  bytes[flags_at] = 6;
  EXPECT_NE(ErrorOf(bytes).find("unknown flags 6"), std::string::npos);
  // A preempted request restarts with a prefill from position 0, never with a decode.
  plan = Sample();
  plan.sequences[1] = {12, 9, {5, 6, 7, 8}, /*prefill=*/true, /*restart=*/true};
  back = DecodePlan(EncodePlan(plan), Limits());
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(*back, plan);
  bytes = EncodePlan(Sample());
  bytes[flags_at] = 2;
  EXPECT_NE(ErrorOf(bytes).find("restarts with a decode step"), std::string::npos);
}

// An iteration that streams its missing experts says so to every rank; unknown iteration flags,
// and a plan that runs nothing yet streams, are refused.
TEST(GroupPlan, AStreamedIterationIsTold) {
  IterationPlan plan = Sample();
  plan.stream = true;
  auto back = DecodePlan(EncodePlan(plan), Limits());
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_TRUE(back->stream);
  EXPECT_EQ(*back, plan);
  EXPECT_FALSE(DecodePlan(EncodePlan(Sample()), Limits())->stream);
  const size_t iteration_flags_at = 4 + 2 + 2 + 8 + 4 + 4 + 2 * 8 + 4;
  std::vector<uint8_t> bytes = EncodePlan(plan);
  ASSERT_EQ(bytes[iteration_flags_at], 1);
  bytes[iteration_flags_at] = 2;
  EXPECT_NE(ErrorOf(bytes).find("unknown iteration flags 2"), std::string::npos);
  IterationPlan idle{PlanKind::kIdle, 3, {}, {}, {}};
  idle.stream = true;
  EXPECT_NE(ErrorOf(EncodePlan(idle)).find("a plan that runs nothing streams"), std::string::npos);
}

TEST(GroupPlan, HugeCountsDoNotAllocateBeforeTheBytesAreThere) {
  std::vector<uint8_t> bytes = EncodePlan(IterationPlan{PlanKind::kIteration, 0, {}, {}, {}});
  const uint32_t many = 0xffffffffu;
  std::memcpy(bytes.data() + 16, &many, sizeof(many));  // Ended count.
  PlanLimits open = Limits();
  open.max_ended = many;
  EXPECT_NE(ErrorOf(bytes, open).find("truncated ended ids"), std::string::npos);
}

TEST(GroupPlan, FiguresPackAndUnpack) {
  std::vector<RequestUsage> usage = {{1, 2, 3, 7, 8, 9, 40}, {4, 5, 6, 17, 18, 19, 41}};
  ExpertFigures totals{10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23};
  std::vector<int64_t> packed = PackFigures(usage, totals);
  ASSERT_EQ(packed.size(), 28u);
  for (int64_t& v : packed) v *= 2;  // What a group of two identical ranks would sum to.
  std::vector<RequestUsage> back(2);
  ExpertFigures sum;
  UnpackFigures(packed, back, &sum);
  EXPECT_EQ(back[1].misses, 10u);
  EXPECT_EQ(back[0].bytes_moved, 6u);
  EXPECT_EQ(sum.hits, 20u);
  EXPECT_EQ(sum.stall_us, 30u);
  EXPECT_EQ(back[0].host_runs, 14u);
  EXPECT_EQ(back[1].host_ns, 36);
  EXPECT_EQ(back[1].bytes_not_moved, 38u);
  EXPECT_EQ(sum.host_runs, 32u);
  EXPECT_EQ(sum.host_us, 34u);
  EXPECT_EQ(sum.bytes_not_moved, 36u);
  EXPECT_EQ(back[0].disk_reads, 80u);
  EXPECT_EQ(back[1].disk_reads, 82u);
  EXPECT_EQ(sum.disk_reads, 38u);
  EXPECT_EQ(sum.disk_bytes, 40u);
  EXPECT_EQ(sum.disk_stall_us, 42u);
  EXPECT_EQ(sum.failed_loads, 44u);
  EXPECT_EQ(sum.failed_experts, 46u);
}

// Each rank writes its failures into its own block after the figures; the sum of the ranks'
// counters gives every rank the same per-sequence failures, the lowest rank's first.
TEST(GroupPlan, FailuresRideOnTheFiguresSum) {
  constexpr uint32_t kWorld = 3, kExperts = 8;
  const std::vector<RequestUsage> usage(4);
  std::vector<std::vector<int64_t>> ranks(kWorld);
  size_t first = 0;
  for (uint32_t r = 0; r < kWorld; ++r) {
    ranks[r] = PackFigures(usage, ExpertFigures{});
    first = ranks[r].size();
    std::vector<std::optional<RankFailure>> mine(usage.size());
    if (r == 1) mine[2] = RankFailure{1, 5, 7};  // Layer 5, expert 7 (key 47).
    if (r == 2) mine[2] = RankFailure{2, 0, 0};  // Key 0: still a failure.
    if (r == 2) mine[3] = RankFailure{2, 3, 1};
    PackFailures(mine, r, kWorld, kExperts, &ranks[r]);
    ASSERT_EQ(ranks[r].size(), first + usage.size() * kWorld);
  }
  std::vector<int64_t> sum(ranks[0].size(), 0);
  for (const auto& c : ranks) {
    for (size_t i = 0; i < sum.size(); ++i) sum[i] += c[i];
  }
  const auto all = UnpackFailures(sum, first, usage.size(), kWorld, kExperts);
  ASSERT_EQ(all.size(), usage.size());
  EXPECT_FALSE(all[0].has_value());
  EXPECT_FALSE(all[1].has_value());
  ASSERT_TRUE(all[2].has_value());
  EXPECT_EQ(all[2]->rank, 1u);
  EXPECT_EQ(all[2]->layer, 5u);
  EXPECT_EQ(all[2]->expert, 7u);
  ASSERT_TRUE(all[3].has_value());
  EXPECT_EQ(all[3]->rank, 2u);
  EXPECT_EQ(all[3]->layer, 3u);
  EXPECT_EQ(all[3]->expert, 1u);
  // The figures before them are untouched.
  RequestUsage out[4];
  ExpertFigures totals;
  UnpackFigures(sum, out, &totals);
  EXPECT_EQ(totals.hits, 0u);
  // Counters cut short read as no failure.
  EXPECT_FALSE(
      UnpackFailures(std::span<const int64_t>(sum).first(first), first, 4, kWorld, kExperts)[2]
          .has_value());
}

}  // namespace
}  // namespace fmoe
