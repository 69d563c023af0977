// The serving workload: what a trace's records become (a prefill of the prompt's union, decode
// steps), and the arrival offsets.
#include "bench/fmoe_bench/replay_workload.h"

#include <gtest/gtest.h>

#include "tests/bench/replay_fixtures.h"

namespace fmoe::bench {
namespace {

using Routing = std::vector<std::vector<std::vector<std::vector<uint16_t>>>>;

// One request of `positions` positions over 2 layers of 6 experts, top-2: position p picks
// {p % 6, (p + 1) % 6} at layer 0 and {0, 5} at layer 1.
Routing Positions(int positions) {
  Routing r(1);
  for (int p = 0; p < positions; ++p) {
    std::vector<uint16_t> a = {static_cast<uint16_t>(p % 6), static_cast<uint16_t>((p + 1) % 6)};
    std::sort(a.begin(), a.end());
    r[0].push_back({a, {0, 5}});
  }
  return r;
}

TEST(ServeWorkloadTest, DetectsWhatTheRecordsAre) {
  TraceHeader h;
  h.iteration_unit =
      "engine iteration (0 = prefill of the whole prompt, then one decode step each)";
  EXPECT_EQ(*DetectTraceKind(h), TraceKind::kIterations);
  h.iteration_unit = "prompt token position (prefill routing, one iteration per position)";
  EXPECT_EQ(*DetectTraceKind(h), TraceKind::kPromptPositions);
  h.iteration_unit = "prefill token position (prompt routing, ...)";
  EXPECT_EQ(*DetectTraceKind(h), TraceKind::kPromptPositions);
  h.iteration_unit = "decode token position (decode steps only, ...)";
  EXPECT_EQ(*DetectTraceKind(h), TraceKind::kDecodePositions);
  h.iteration_unit = "token position (prefill and decode, one iteration per position)";
  EXPECT_EQ(DetectTraceKind(h).status().code(), ErrorCode::kInvalidArgument);
  for (TraceKind k :
       {TraceKind::kIterations, TraceKind::kPromptPositions, TraceKind::kDecodePositions}) {
    EXPECT_EQ(*ParseTraceKind(TraceKindName(k)), k);
  }
  EXPECT_FALSE(ParseTraceKind("positions").ok());
}

TEST(ServeWorkloadTest, APrefillIsTheUnionOfItsPositionsWithTokenCounts) {
  Trace trace = MakeTrace(2, 6, 2, Positions(4));
  std::vector<const TraceIteration*> ps;
  for (const auto& it : trace.iterations) ps.push_back(&it);
  TraceIteration m = MergePositions(trace.header, ps);
  EXPECT_EQ(m.tokens, 4u);
  EXPECT_TRUE(m.map_derived);
  ASSERT_TRUE(ValidateTraceIteration(trace.header, m).ok());
  // Layer 0: {0,1}, {1,2}, {2,3}, {3,4}.
  auto e0 = m.used(0);
  auto c0 = m.used_counts(0);
  EXPECT_EQ(std::vector<uint16_t>(e0.begin(), e0.end()), (std::vector<uint16_t>{0, 1, 2, 3, 4}));
  EXPECT_EQ(std::vector<uint32_t>(c0.begin(), c0.end()), (std::vector<uint32_t>{1, 2, 2, 2, 1}));
  auto e1 = m.used(1);
  auto c1 = m.used_counts(1);
  EXPECT_EQ(std::vector<uint16_t>(e1.begin(), e1.end()), (std::vector<uint16_t>{0, 5}));
  EXPECT_EQ(std::vector<uint32_t>(c1.begin(), c1.end()), (std::vector<uint32_t>{4, 4}));
  // The derived map is the mean of the positions' maps.
  std::vector<float> map;
  m.FillMap(trace.header, &map);
  EXPECT_FLOAT_EQ(map[1], 2.0f / 8);
  EXPECT_FLOAT_EQ(map[6 + 5], 0.5f);
}

TEST(ServeWorkloadTest, StoredMapsAreAveragedOverThePositions) {
  Trace trace = MakeTrace(1, 4, 1, {{{{0}}, {{1}}}});
  for (auto& it : trace.iterations) {
    it.map_derived = false;
    it.map_offsets = {0, 2};
    it.map_experts = {0, 1};
    it.map_probs =
        it.iteration == 0 ? std::vector<float>{0.75f, 0.25f} : std::vector<float>{0.25f, 0.5f};
  }
  TraceIteration m = MergePositions(trace.header, {&trace.iterations[0], &trace.iterations[1]});
  ASSERT_TRUE(ValidateTraceIteration(trace.header, m).ok());
  std::vector<float> map;
  m.FillMap(trace.header, &map);
  EXPECT_FLOAT_EQ(map[0], 0.5f);
  EXPECT_FLOAT_EQ(map[1], 0.375f);
  EXPECT_FLOAT_EQ(map[2], 0.0f);
}

TEST(ServeWorkloadTest, PromptPositionsSplitIntoAPrefillAndDecodeSteps) {
  Routing r = Positions(10);
  Routing one = Positions(1);
  Routing two = Positions(2);
  r.push_back(one[0]);
  r.push_back(two[0]);
  Trace trace = MakeTrace(2, 6, 2, r, {}, 0, "prompt token position");
  TraceRequests grouped = GroupByRequest(trace);
  ServeWorkloadOptions o;
  o.kind = TraceKind::kPromptPositions;
  o.decode_share = 0.2;
  auto w = BuildServeWorkload(grouped, o);
  ASSERT_TRUE(w.ok()) << w.status().ToString();
  ASSERT_EQ(w->requests.size(), 3u);
  const ServeRequest& a = w->requests[0];
  EXPECT_TRUE(a.has_prefill);
  EXPECT_EQ(a.prompt_tokens, 8u);
  EXPECT_EQ(a.decode_steps(), 2u);
  EXPECT_EQ(a.steps[1], &trace.iterations[8]);
  EXPECT_EQ(a.steps[2], &trace.iterations[9]);
  EXPECT_EQ(a.steps[0]->tokens, 8u);
  // The prefill's positions, kept for chunked prefill: their merge is the prefill.
  ASSERT_EQ(a.prompt_positions.size(), 8u);
  EXPECT_EQ(a.prompt_positions[0], &trace.iterations[0]);
  EXPECT_EQ(a.prompt_positions[7], &trace.iterations[7]);
  const TraceIteration whole = MergePositions(trace.header, a.prompt_positions);
  EXPECT_EQ(whole.used_experts, a.steps[0]->used_experts);
  EXPECT_EQ(whole.used_tokens, a.steps[0]->used_tokens);
  // One position: a prefill only. Two: at least one decode step, whatever the share.
  EXPECT_EQ(w->requests[1].decode_steps(), 0u);
  EXPECT_EQ(w->requests[1].prompt_tokens, 1u);
  EXPECT_EQ(w->requests[2].decode_steps(), 1u);
  // Every position but one at share 1.
  o.decode_share = 1.0;
  w = BuildServeWorkload(grouped, o);
  EXPECT_EQ(w->requests[0].decode_steps(), 9u);
  o.decode_share = 1.5;
  EXPECT_EQ(BuildServeWorkload(grouped, o).status().code(), ErrorCode::kInvalidArgument);
}

TEST(ServeWorkloadTest, IterationsAreUsedAsRecordedAndDecodePositionsHaveNoPrefill) {
  Trace trace = MakeTrace(2, 6, 2, Positions(3));
  TraceRequests grouped = GroupByRequest(trace);
  ServeWorkloadOptions o;
  o.kind = TraceKind::kIterations;
  auto w = BuildServeWorkload(grouped, o);
  ASSERT_TRUE(w.ok());
  EXPECT_TRUE(w->requests[0].has_prefill);
  EXPECT_EQ(w->requests[0].steps.size(), 3u);
  EXPECT_EQ(w->requests[0].decode_steps(), 2u);
  EXPECT_EQ(w->requests[0].steps[0], &trace.iterations[0]);
  EXPECT_TRUE(w->requests[0].prompt_positions.empty());  // A prefill recorded whole.

  // A prefill the engine ran in chunks: records 0 and 1 flagged prefill are one prefill.
  Trace chunked = MakeTrace(2, 6, 2, Positions(4));
  chunked.iterations[0].prefill = true;
  chunked.iterations[1].prefill = true;
  auto cw = BuildServeWorkload(GroupByRequest(chunked), o);
  ASSERT_TRUE(cw.ok());
  ASSERT_EQ(cw->requests[0].steps.size(), 3u);
  EXPECT_EQ(cw->requests[0].prompt_tokens, 2u);
  EXPECT_EQ(cw->requests[0].decode_steps(), 2u);
  const TraceIteration& prefill = *cw->requests[0].steps[0];
  EXPECT_TRUE(prefill.prefill);
  // Layer 0: position 0 picks {0, 1}, position 1 {1, 2}: expert 1 twice.
  EXPECT_EQ(std::vector<uint16_t>(prefill.used(0).begin(), prefill.used(0).end()),
            (std::vector<uint16_t>{0, 1, 2}));
  EXPECT_EQ(std::vector<uint32_t>(prefill.used_counts(0).begin(), prefill.used_counts(0).end()),
            (std::vector<uint32_t>{1, 2, 1}));
  EXPECT_EQ(cw->requests[0].steps[1], &chunked.iterations[2]);

  o.kind = TraceKind::kDecodePositions;
  w = BuildServeWorkload(grouped, o);
  ASSERT_TRUE(w.ok());
  EXPECT_FALSE(w->requests[0].has_prefill);
  EXPECT_EQ(w->requests[0].prompt_tokens, 0u);
  EXPECT_EQ(w->requests[0].decode_steps(), 3u);
}

TEST(ServeWorkloadTest, ArrivalsFollowTheTraceGapsScaled) {
  ArrivalTrace t;
  for (double s : {100.0, 101.0, 103.0, 103.0, 110.0}) t.rows.push_back({s, 10, 5});
  ArrivalOptions o;
  auto a = ArrivalOffsets(&t, 4, o);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ(*a, (std::vector<int64_t>{0, 1'000'000'000, 3'000'000'000, 3'000'000'000}));
  o.offset = 1;
  o.time_scale = 0.5;
  a = ArrivalOffsets(&t, 4, o);
  EXPECT_EQ(*a, (std::vector<int64_t>{0, 1'000'000'000, 1'000'000'000, 4'500'000'000}));
  // Rescaled to 1 request/s: 3 gaps over 9 s become 3 s.
  o.rate = 1.0;
  a = ArrivalOffsets(&t, 4, o);
  EXPECT_EQ(a->back(), 3'000'000'000);
  EXPECT_EQ(*ArrivalOffsets(nullptr, 3, ArrivalOptions{}), (std::vector<int64_t>{0, 0, 0}));
  o = ArrivalOptions{};
  o.offset = 3;
  EXPECT_EQ(ArrivalOffsets(&t, 3, o).status().code(), ErrorCode::kInvalidArgument);
  o.offset = 0;
  o.time_scale = 0;
  EXPECT_FALSE(ArrivalOffsets(&t, 3, o).ok());
}

}  // namespace
}  // namespace fmoe::bench
