// The engine's scheduler: decodes first, then prompt chunks within the step's token budget,
// admission in arrival order up to max_batch, prompts that must run whole, removal from either
// queue, and that every request's prompt is covered exactly once, in order.
#include "gpu_worker/core/scheduler.h"

#include <map>
#include <random>

#include <gtest/gtest.h>

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
        ASSERT_LE(decode_tokens + prompt_tokens, std::max(budget, decode_tokens));
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

}  // namespace
}  // namespace fmoe
