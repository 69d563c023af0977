// The engine's scheduler: decodes first, then prompt chunks within the step's token budget,
// admission in arrival order up to max_batch, prompts that must run whole, removal from either
// queue, and that every request's prompt is covered exactly once, in order.
#include "gpu_worker/core/scheduler.h"

#include <algorithm>

#include <map>
#include <random>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "gpu_worker/core/chunk_planner.h"

namespace fmoe {
namespace {

SchedulerOptions Options(uint32_t max_batch, uint32_t budget, uint32_t max_waiting = 16) {
  SchedulerOptions o;
  o.max_batch = max_batch;
  o.max_batched_tokens = budget;
  o.max_waiting = max_waiting;
  return o;
}

uint32_t Tokens(const std::vector<ScheduledWork>& work) {
  uint32_t n = 0;
  for (const ScheduledWork& w : work) n += w.tokens;
  return n;
}

TEST(Scheduler, ChecksItsOptions) {
  EXPECT_TRUE(Options(8, 0).Check().ok());
  EXPECT_TRUE(Options(8, 8).Check().ok());
  EXPECT_EQ(Options(0, 0).Check().code(), ErrorCode::kInvalidArgument);
  const Status s = Options(8, 4).Check();
  EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument);
  EXPECT_NE(s.message().find("max_batched_tokens 4 is below max_batch 8"), std::string::npos)
      << s.message();
}

TEST(Scheduler, WithoutBudgetAPromptRunsWhole) {
  Scheduler s(Options(2, 0));
  ASSERT_TRUE(s.Add(1, 100));
  ASSERT_TRUE(s.Add(2, 7));
  ASSERT_TRUE(s.Add(3, 5));
  auto work = s.Schedule();
  ASSERT_EQ(work.size(), 2u);  // max_batch 2: request 3 waits.
  EXPECT_EQ(work[0].id, 1u);
  EXPECT_TRUE(work[0].prefill && work[0].admitted && work[0].samples);
  EXPECT_EQ(work[0].tokens, 100u);
  EXPECT_EQ(work[1].tokens, 7u);
  EXPECT_EQ(s.running(), 2u);
  EXPECT_EQ(s.waiting(), 1u);
  s.Completed(work);
  work = s.Schedule();
  ASSERT_EQ(work.size(), 2u);
  EXPECT_FALSE(work[0].prefill);
  EXPECT_EQ(work[0].tokens, 1u);
  EXPECT_TRUE(work[0].samples);
}

TEST(Scheduler, DecodesComeFirstAndPromptsAreCutToTheBudget) {
  Scheduler s(Options(4, 16));
  ASSERT_TRUE(s.Add(1, 4));
  auto work = s.Schedule();
  s.Completed(work);  // Request 1 decodes from now on.
  ASSERT_TRUE(s.Add(2, 40));
  work = s.Schedule();
  ASSERT_EQ(work.size(), 2u);
  EXPECT_EQ(work[0].id, 1u);
  EXPECT_FALSE(work[0].prefill);
  EXPECT_EQ(work[1].id, 2u);
  EXPECT_TRUE(work[1].prefill && work[1].admitted);
  EXPECT_FALSE(work[1].samples);  // 15 of 40 prompt tokens.
  EXPECT_EQ(work[1].first, 0u);
  EXPECT_EQ(work[1].tokens, 15u);
  EXPECT_EQ(Tokens(work), 16u);
  s.Completed(work);
  work = s.Schedule();
  ASSERT_EQ(work.size(), 2u);
  EXPECT_EQ(work[1].first, 15u);
  EXPECT_EQ(work[1].tokens, 15u);
  EXPECT_FALSE(work[1].admitted);
  s.Completed(work);
  work = s.Schedule();
  ASSERT_EQ(work.size(), 2u);
  EXPECT_EQ(work[1].first, 30u);
  EXPECT_EQ(work[1].tokens, 10u);
  EXPECT_TRUE(work[1].samples);
  s.Completed(work);
  work = s.Schedule();
  ASSERT_EQ(work.size(), 2u);
  EXPECT_FALSE(work[0].prefill);
  EXPECT_FALSE(work[1].prefill);
}

TEST(Scheduler, AWaitingRequestJoinsOnlyWithBudgetLeft) {
  Scheduler s(Options(4, 4));
  ASSERT_TRUE(s.Add(1, 10));
  ASSERT_TRUE(s.Add(2, 3));
  auto work = s.Schedule();  // Request 1 takes the whole budget: 2 waits.
  ASSERT_EQ(work.size(), 1u);
  EXPECT_EQ(s.waiting(), 1u);
  s.Completed(work);
  work = s.Schedule();
  ASSERT_EQ(work.size(), 1u);
  EXPECT_EQ(work[0].first, 4u);
  s.Completed(work);
  work = s.Schedule();  // 2 of 10 left: request 2 gets the other 2 tokens of budget.
  ASSERT_EQ(work.size(), 2u);
  EXPECT_EQ(work[0].tokens, 2u);
  EXPECT_TRUE(work[0].samples);
  EXPECT_EQ(work[1].id, 2u);
  EXPECT_EQ(work[1].tokens, 2u);
  EXPECT_FALSE(work[1].samples);
}

TEST(Scheduler, APromptThatMustNotBeCutRunsWholeWhenFirst) {
  Scheduler s(Options(4, 8));
  ASSERT_TRUE(s.Add(1, 6));
  ASSERT_TRUE(s.Add(2, 20, /*chunkable=*/false));
  auto work = s.Schedule();  // 1 takes 6; 2 is not the first prompt chunk: it waits.
  ASSERT_EQ(work.size(), 1u);
  s.Completed(work);
  work = s.Schedule();  // 1 decodes; 2 is the first prompt: all 20 tokens, beyond the budget.
  ASSERT_EQ(work.size(), 2u);
  EXPECT_EQ(work[1].id, 2u);
  EXPECT_EQ(work[1].tokens, 20u);
  EXPECT_TRUE(work[1].samples);
}

// An advisor that wants chunks of at least 12 tokens (or the rest of the prompt).
uint32_t AtLeast12(uint32_t chunk, uint32_t rest) { return std::min(std::max(chunk, 12u), rest); }

TEST(Scheduler, AChunkAdvisorGrowsTheFirstChunkAndHoldsBackSmallLaterOnes) {
  Scheduler s(Options(4, 8));
  s.SetChunkAdvisor(AtLeast12);
  ASSERT_TRUE(s.Add(1, 30));
  ASSERT_TRUE(s.Add(2, 20));
  auto work = s.Schedule();    // 1 is the first prompt chunk: 12 tokens, beyond the budget of 8.
  ASSERT_EQ(work.size(), 1u);  // 2 would get no budget: it waits.
  EXPECT_EQ(work[0].id, 1u);
  EXPECT_EQ(work[0].tokens, 12u);
  EXPECT_TRUE(work[0].grown);
  s.Completed(work);
  work = s.Schedule();
  ASSERT_EQ(work.size(), 1u);
  EXPECT_EQ(work[0].first, 12u);
  EXPECT_EQ(work[0].tokens, 12u);
  EXPECT_TRUE(work[0].grown);
  s.Completed(work);
  work = s.Schedule();  // 6 left of 30: the rest runs as the budget allows; 2 gets the other 2
                        // tokens of budget, which the advisor turns down: 2 waits.
  ASSERT_EQ(work.size(), 1u);
  EXPECT_EQ(work[0].tokens, 6u);
  EXPECT_TRUE(work[0].samples);
  EXPECT_FALSE(work[0].grown) << "the rest of a prompt within the budget";
  s.Completed(work);
  work = s.Schedule();  // 1 decodes (1 token); 2 is the first prompt chunk: 12 of its 20.
  ASSERT_EQ(work.size(), 2u);
  EXPECT_FALSE(work[0].prefill);
  EXPECT_EQ(work[1].id, 2u);
  EXPECT_TRUE(work[1].admitted);
  EXPECT_EQ(work[1].tokens, 12u);
  EXPECT_TRUE(work[1].grown) << "admitted with a grown chunk";
  EXPECT_FALSE(work[0].grown) << "a decode";
  s.Completed(work);
  work = s.Schedule();  // 8 left, 7 of budget: the advisor asks for the 8.
  ASSERT_EQ(work.size(), 2u);
  EXPECT_EQ(work[1].tokens, 8u);
  EXPECT_TRUE(work[1].samples);
  EXPECT_TRUE(work[1].grown);
}

TEST(ChunkPlanner, ExpectedExpertsNearsEveryExpert) {
  EXPECT_DOUBLE_EQ(ExpectedExperts(8, 2, 1), 2.0);
  EXPECT_NEAR(ExpectedExperts(8, 2, 2), 8 * (1 - 0.75 * 0.75), 1e-12);
  EXPECT_NEAR(ExpectedExperts(64, 6, 64), 63.9, 0.1);
  EXPECT_EQ(ExpectedExperts(8, 2, 0), 0.0);
  EXPECT_EQ(ExpectedExperts(0, 2, 5), 0.0);
  EXPECT_DOUBLE_EQ(ExpectedExperts(4, 8, 3), 4.0);  // K above J: every expert.
}

// Streaming: a long prompt that needs nearly every expert of each layer finishes sooner with each
// layer's missing experts loaded while the layer before computes; a short one (few experts) or
// every expert resident does not; decode steps in the iteration count the working set a cached
// prefill would evict.
TEST(ChunkPlanner, StreamingIsSoonerForLongPromptsThatNeedNearlyEveryExpert) {
  ChunkCosts c{64, 6, 26, 0.75, 1.32e6, 26 * 0.04e6};
  // 2,048 tokens: every expert of each layer; 48 loads a layer either way, but streamed they
  // overlap the layer before's compute.
  EXPECT_NEAR(CachedIterationNs(c, 2048, 0), 26 * 48 * 1.32e6 + 2048 * 26 * 0.04e6, 1e6);
  EXPECT_NEAR(StreamedIterationNs(c, 2048, 0),
              26 * std::max(48 * 1.32e6, 2048 * 0.04e6) + std::min(48 * 1.32e6, 2048 * 0.04e6),
              1e6);
  EXPECT_TRUE(StreamSooner(c, 2048, 0));
  // 4 tokens route to about 23 experts a layer: streaming all 48 missing ones costs more.
  EXPECT_FALSE(StreamSooner(c, 4, 0));
  // Decode steps beside the prompt: the evicted experts they use come back, a cost of the
  // cached way only.
  EXPECT_GT(CachedIterationNs(c, 64, 7) - CachedIterationNs(c, 64, 0),
            StreamedIterationNs(c, 64, 7) - StreamedIterationNs(c, 64, 0));
  // Every expert resident: nothing to stream.
  ChunkCosts resident = c;
  resident.miss = 0;
  EXPECT_FALSE(StreamSooner(resident, 2048, 0));
  // No prompt tokens, or costs not measured yet: never.
  EXPECT_FALSE(StreamSooner(c, 0, 8));
  EXPECT_FALSE(StreamSooner(ChunkCosts{64, 6, 26, 0.75, 0, 0}, 2048, 0));
  EXPECT_EQ(StreamModeFromName("auto"), StreamMode::kAuto);
  EXPECT_EQ(StreamModeFromName("on"), StreamMode::kOn);
  EXPECT_EQ(StreamModeFromName("off"), StreamMode::kOff);
  EXPECT_EQ(StreamModeFromName("always"), std::nullopt);
  EXPECT_STREQ(StreamModeName(StreamMode::kAuto), "auto");
}

TEST(ChunkPlanner, LoadBoundPrefillsRunWholeAndComputeBoundOnesKeepTheBudgetsChunk) {
  // DeepSeek-V2-Lite-shaped, a quarter of the experts resident, a slow link: each 64-token
  // chunk loads nearly all 64 experts of each layer, as the whole prompt does.
  ChunkCosts slow{64, 6, 26, 0.75, 1.32e6, 26 * 0.04e6};
  EXPECT_GT(PrefillNs(slow, 64, 512), 5 * PrefillNs(slow, 512, 512));
  EXPECT_EQ(ExpertAwareChunk(slow, 64, 512, 0.25), 512u);
  // Every expert resident: nothing to load, chunks cost nothing more.
  ChunkCosts resident = slow;
  resident.miss = 0.0;
  EXPECT_DOUBLE_EQ(PrefillNs(resident, 64, 512), PrefillNs(resident, 512, 512));
  EXPECT_EQ(ExpertAwareChunk(resident, 64, 512, 0.25), 64u);
  // A fast link: loads are small against compute; 64-token chunks stay.
  ChunkCosts fast = slow;
  fast.load_ns = 0.01e6;
  EXPECT_EQ(ExpertAwareChunk(fast, 64, 512, 0.25), 64u);
  // In between, the smallest doubling within the overhead: 8 chunks of 64 cost too much, two of
  // 256 do not.
  ChunkCosts mid = slow;
  mid.load_ns = 0.12e6;
  const double whole = PrefillNs(mid, 512, 512);
  EXPECT_GT(PrefillNs(mid, 128, 512), 1.25 * whole);
  EXPECT_LE(PrefillNs(mid, 256, 512), 1.25 * whole);
  EXPECT_EQ(ExpertAwareChunk(mid, 64, 512, 0.25), 256u);
  // Off, unknown costs, or a chunk that is the rest: the budget's chunk.
  EXPECT_EQ(ExpertAwareChunk(slow, 64, 512, 0.0), 64u);
  EXPECT_EQ(ExpertAwareChunk(ChunkCosts{}, 64, 512, 0.25), 64u);
  EXPECT_EQ(ExpertAwareChunk(slow, 512, 512, 0.25), 512u);
}

TEST(Scheduler, RemoveAndQueueLimits) {
  Scheduler s(Options(1, 0, /*max_waiting=*/2));
  EXPECT_FALSE(s.Add(1, 0));  // An empty prompt.
  ASSERT_TRUE(s.Add(1, 3));
  ASSERT_TRUE(s.Add(2, 3));
  EXPECT_FALSE(s.Add(3, 3));  // Two wait already.
  EXPECT_FALSE(s.Add(1, 3));  // Queued already.
  auto work = s.Schedule();
  ASSERT_EQ(work.size(), 1u);
  EXPECT_FALSE(s.Add(1, 3));  // Running.
  EXPECT_TRUE(s.IsWaiting(2));
  EXPECT_TRUE(s.Remove(2));
  EXPECT_FALSE(s.Remove(2));
  EXPECT_TRUE(s.Remove(1));  // Removed before Completed: Completed skips it.
  s.Completed(work);
  EXPECT_EQ(s.running(), 0u);
  EXPECT_TRUE(s.Schedule().empty());
}

// Random arrivals and lengths: every step stays within max_batch and the budget (a decode step
// always runs), each prompt is covered once, in order, and samples only after its last chunk.
TEST(Scheduler, RandomWorkloadsCoverEveryPromptOnceWithinTheLimits) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 50; ++trial) {
    const uint32_t max_batch = 1 + rng() % 6;
    const uint32_t budget = rng() % 3 == 0 ? 0 : max_batch + rng() % 40;
    Scheduler s(Options(max_batch, budget, 1000));
    // Half the budgeted trials with an advisor that wants chunks of at least `least` tokens:
    // the first prompt chunk of a step may then pass the budget by up to `least`.
    const uint32_t least = budget != 0 && rng() % 2 == 0 ? 2 + rng() % 30 : 0;
    if (least != 0) {
      s.SetChunkAdvisor([least](uint32_t chunk, uint32_t rest) {
        return std::min(std::max(chunk, least), rest);
      });
    }
    std::map<uint64_t, uint32_t> prompt, covered, decodes, to_decode;
    uint64_t next = 1;
    for (int step = 0; step < 400; ++step) {
      if (rng() % 3 == 0) {
        prompt[next] = 1 + rng() % 60;
        to_decode[next] = rng() % 5;
        ASSERT_TRUE(s.Add(next, prompt[next]));
        ++next;
      }
      auto work = s.Schedule();
      uint32_t decode_tokens = 0, prompt_tokens = 0;
      for (const ScheduledWork& w : work) {
        if (w.prefill) {
          ASSERT_EQ(w.first, covered[w.id]) << "req " << w.id;
          covered[w.id] += w.tokens;
          ASSERT_LE(covered[w.id], prompt[w.id]);
          ASSERT_EQ(w.samples, covered[w.id] == prompt[w.id]);
          prompt_tokens += w.tokens;
        } else {
          ASSERT_EQ(covered[w.id], prompt[w.id]) << "a decode before the prompt ended";
          ++decode_tokens;
        }
      }
      ASSERT_LE(s.running(), max_batch);
      if (budget != 0) {
        ASSERT_LE(decode_tokens + prompt_tokens, std::max(budget, decode_tokens) + least);
      }
      if (s.running() > 0) {
        ASSERT_FALSE(work.empty()) << "a step ran nothing with work to do";
      }
      s.Completed(work);
      for (const ScheduledWork& w : work) {
        if (!w.samples) continue;
        if (decodes[w.id]++ >= to_decode[w.id]) s.Remove(w.id);
      }
    }
  }
}

// The admit hook's cached prefix: the prefill starts after it. A preempted request goes to the
// front of the queue with its new prompt length and is prefilled again from its first token.
TEST(Scheduler, CachedPrefixAndPreemption) {
  Scheduler s(Options(2, 8));
  s.SetAdmitHook([](uint64_t id, uint32_t prompt) { return id == 1 ? prompt : 0u; });
  ASSERT_TRUE(s.Add(1, 20));
  ASSERT_TRUE(s.Add(2, 5));
  ASSERT_TRUE(s.Add(3, 5));
  auto work = s.Schedule();
  // Request 1's whole prompt is cached: its last token is still computed (the first sample).
  ASSERT_EQ(work.size(), 2u);
  EXPECT_EQ(work[0].id, 1u);
  EXPECT_EQ(work[0].first, 19u);
  EXPECT_EQ(work[0].tokens, 1u);
  EXPECT_TRUE(work[0].samples);
  EXPECT_EQ(work[1].id, 2u);
  EXPECT_EQ(work[1].first, 0u);
  EXPECT_EQ(work[1].tokens, 5u);
  s.Completed(work);
  EXPECT_FALSE(s.Preempt(3, 6));  // Waiting, not running.
  EXPECT_TRUE(s.Preempt(2, 6));   // Its prompt and first token, again.
  EXPECT_EQ(s.WaitingIds(), (std::vector<uint64_t>{2, 3}));
  EXPECT_EQ(s.RunningIds(), (std::vector<uint64_t>{1}));
  work = s.Schedule();
  ASSERT_EQ(work.size(), 2u);
  EXPECT_FALSE(work[0].prefill);  // Request 1 decodes.
  EXPECT_EQ(work[1].id, 2u);
  EXPECT_TRUE(work[1].admitted);
  EXPECT_EQ(work[1].first, 0u);
  EXPECT_EQ(work[1].tokens, 6u);
  EXPECT_TRUE(work[1].samples);
}

// A boundary (LongRoPE's original context): no chunk runs across it, with or without a budget;
// a preempted request prefilled again over more than the boundary is cut there too.
TEST(Scheduler, NoChunkRunsAcrossTheBoundary) {
  {
    Scheduler s(Options(2, 0));  // No budget: the prompt in two parts.
    ASSERT_TRUE(s.Add(1, 12, /*chunkable=*/true, /*boundary=*/8));
    auto work = s.Schedule();
    ASSERT_EQ(work.size(), 1u);
    EXPECT_EQ(work[0].first, 0u);
    EXPECT_EQ(work[0].tokens, 8u);
    EXPECT_FALSE(work[0].samples);
    s.Completed(work);
    work = s.Schedule();
    ASSERT_EQ(work.size(), 1u);
    EXPECT_EQ(work[0].first, 8u);
    EXPECT_EQ(work[0].tokens, 4u);
    EXPECT_TRUE(work[0].samples);
    s.Completed(work);
    // Prompt 6 and 6 tokens decoded: prefilled again as 8, then 4.
    ASSERT_TRUE(s.Preempt(1, 12));
    work = s.Schedule();
    ASSERT_EQ(work.size(), 1u);
    EXPECT_EQ(work[0].tokens, 8u);
    s.Completed(work);
    work = s.Schedule();
    ASSERT_EQ(work.size(), 1u);
    EXPECT_EQ(work[0].first, 8u);
    EXPECT_EQ(work[0].tokens, 4u);
  }
  {
    Scheduler s(Options(2, 6));  // Budget 6: 6, then 2 (to the boundary), then 6.
    ASSERT_TRUE(s.Add(1, 14, /*chunkable=*/true, /*boundary=*/8));
    std::vector<std::pair<uint32_t, uint32_t>> chunks;
    for (int step = 0; step < 3; ++step) {
      auto work = s.Schedule();
      ASSERT_EQ(work.size(), 1u);
      chunks.emplace_back(work[0].first, work[0].tokens);
      s.Completed(work);
    }
    EXPECT_EQ(chunks, (std::vector<std::pair<uint32_t, uint32_t>>{{0, 6}, {6, 2}, {8, 6}}));
  }
  {
    // A prompt that must not be cut ignores the boundary: it runs whole.
    Scheduler s(Options(2, 0));
    ASSERT_TRUE(s.Add(1, 12, /*chunkable=*/false, /*boundary=*/8));
    auto work = s.Schedule();
    ASSERT_EQ(work.size(), 1u);
    EXPECT_EQ(work[0].tokens, 12u);
  }
}

}  // namespace
}  // namespace fmoe
