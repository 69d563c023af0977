// The serving replay: continuous batching, TTFT and TPOT in simulated time, a batch's union of
// experts, prefill and decode figures apart, and the oracle's schedule.
#include "bench/fmoe_bench/replay_serve.h"

#include <random>

#include <gtest/gtest.h>

#include "tests/bench/replay_fixtures.h"

namespace fmoe::bench {
namespace {

constexpr int64_t kMs = 1'000'000;
using Routing = std::vector<std::vector<std::vector<std::vector<uint16_t>>>>;

TEST(ContinuousBatcherTest, AdmitsArrivedRequestsOldestFirstUpToTheBatch) {
  // Request 2 arrives first; 0 and 1 tie (the lower index first); 3 comes later.
  ContinuousBatcher b({5, 5, 0, 100}, {2, 1, 3, 1}, 2);
  EXPECT_EQ(b.NextArrival(), 0);
  auto running = b.Admit(0);
  ASSERT_EQ(running.size(), 1u);
  EXPECT_EQ(running[0].request, 2u);
  std::vector<uint32_t> finished;
  b.Advance(&finished);
  EXPECT_TRUE(finished.empty());
  running = b.Admit(5);  // 0 joins; 1 waits for a slot.
  ASSERT_EQ(running.size(), 2u);
  EXPECT_EQ(running[0].request, 2u);
  EXPECT_EQ(running[0].step, 1u);
  EXPECT_EQ(running[1].request, 0u);
  EXPECT_EQ(running[1].step, 0u);
  EXPECT_EQ(b.NextArrival(), 5);
  b.Advance(&finished);  // 2 is at its last step next; 0 has one more.
  EXPECT_TRUE(finished.empty());
  running = b.Admit(6);
  ASSERT_EQ(running.size(), 2u);
  b.Advance(&finished);
  EXPECT_EQ(finished, (std::vector<uint32_t>{2, 0}));
  running = b.Admit(7);
  ASSERT_EQ(running.size(), 1u);
  EXPECT_EQ(running[0].request, 1u);
  b.Advance(&finished);
  EXPECT_TRUE(b.Admit(50).empty());  // 3 has not arrived.
  EXPECT_EQ(b.NextArrival(), 100);
  EXPECT_EQ(b.Admit(100).size(), 1u);
  b.Advance(&finished);
  EXPECT_TRUE(b.done());
  EXPECT_EQ(b.NextArrival(), -1);
}

TEST(ContinuousBatcherTest, ChunkedPrefillRunsDecodeStepsFirstThenChunksOldestFirst) {
  // Request 0: 10 prompt positions, then 2 decode steps; request 1: 4 positions, 1 decode step.
  // Both arrive at 0; 6 tokens per iteration.
  using Slot = ContinuousBatcher::Slot;
  ContinuousBatcher b({0, 0}, {3, 2}, 2, {10, 4}, 6);
  auto expect = [](const std::vector<Slot>& got, const std::vector<Slot>& want) {
    ASSERT_EQ(got.size(), want.size());
    for (size_t i = 0; i < got.size(); ++i) {
      EXPECT_EQ(got[i].request, want[i].request) << i;
      EXPECT_EQ(got[i].step, want[i].step) << i;
      EXPECT_EQ(got[i].chunk_begin, want[i].chunk_begin) << i;
      EXPECT_EQ(got[i].chunk_end, want[i].chunk_end) << i;
    }
  };
  std::vector<uint32_t> finished;
  // The oldest prefill takes the whole budget; the other waits (no chunk of 0 tokens).
  expect(b.Admit(0), {{0, 0, 0, 6}});
  b.Advance(&finished);
  // Its last chunk (4), then 2 of request 1's prompt.
  expect(b.Admit(0), {{0, 0, 6, 10}, {1, 0, 0, 2}});
  b.Advance(&finished);
  // Request 0 decodes (1 token) while request 1's last chunk runs.
  expect(b.Admit(0), {{0, 1, 0, 0}, {1, 0, 2, 4}});
  b.Advance(&finished);
  expect(b.Admit(0), {{0, 2, 0, 0}, {1, 1, 0, 0}});
  b.Advance(&finished);
  EXPECT_EQ(finished, (std::vector<uint32_t>{0, 1}));
  EXPECT_TRUE(b.done());
}

TEST(ContinuousBatcherTest, AChunkAdvisorGrowsTheFirstChunkAndHoldsBackLaterOnes) {
  using Slot = ContinuousBatcher::Slot;
  // As above, with an advisor that wants chunks of at least 8 tokens (or the rest).
  ContinuousBatcher b({0, 0}, {3, 2}, 2, {10, 4}, 6);
  b.SetChunkAdvisor(
      [](uint32_t chunk, uint32_t rest) { return std::min(std::max(chunk, 8u), rest); });
  std::vector<uint32_t> finished;
  std::vector<Slot> s = b.Admit(0);  // 8 of request 0's 10, past the budget; request 1 waits.
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0].chunk_end, 8u);
  b.Advance(&finished);
  s = b.Admit(0);  // Request 0's last 2; request 1's whole prompt fits the 4 left: no chunk.
  ASSERT_EQ(s.size(), 2u);
  EXPECT_EQ(s[0].chunk_begin, 8u);
  EXPECT_EQ(s[0].chunk_end, 10u);
  EXPECT_EQ(s[1].request, 1u);
  EXPECT_FALSE(s[1].chunk());
}

TEST(ContinuousBatcherTest, DecodeStepsRunPastTheBudgetAndAWholePromptIsNoChunk) {
  using Slot = ContinuousBatcher::Slot;
  // Two requests decode (1-position prompts, 4 steps), a third's prompt waits: 1 token per
  // iteration.
  ContinuousBatcher b({0, 0, 1}, {4, 4, 2}, 3, {1, 1, 3}, 1);
  std::vector<uint32_t> finished;
  std::vector<Slot> s = b.Admit(0);  // The first prompt takes the token; the second waits.
  ASSERT_EQ(s.size(), 1u);
  EXPECT_FALSE(s[0].chunk());  // The whole prompt: the step whole.
  b.Advance(&finished);
  s = b.Admit(1);  // Request 0 decodes, over the budget nothing else runs.
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0].step, 1u);
  b.Advance(&finished);
  for (int i = 0; i < 2; ++i) {
    s = b.Admit(1);
    ASSERT_EQ(s.size(), 1u);
    b.Advance(&finished);
  }
  s = b.Admit(1);  // Request 0 has ended: request 1's prompt runs, then request 2's.
  ASSERT_EQ(s.size(), 1u);
  EXPECT_EQ(s[0].request, 1u);
  EXPECT_EQ(s[0].step, 0u);
  // A budget that holds every prompt never chunks.
  ContinuousBatcher whole({0, 0}, {2, 2}, 2, {3, 4}, 100);
  for (const Slot& slot : whole.Admit(0)) EXPECT_FALSE(slot.chunk());
}

TimeModel Time(double layer_ms, double per_token_ms, double load_ms) {
  TimeModel m;
  m.name = "test";
  m.layer = {{1, layer_ms}, {2, layer_ms + per_token_ms}};
  m.expert_mb = 1;
  m.link_gbps = 1.0 / load_ms;  // 1 MB in load_ms.
  m.link_latency_us = 0;
  return m;
}

ServeConfig Config(const std::string& policy, double budget, uint32_t batch, TimeModel time) {
  ServeConfig c;
  c.policy = policy;
  c.budget = budget;
  c.distance = 1;
  c.online = true;
  c.max_batch = batch;
  c.time = std::move(time);
  return c;
}

// Prompt positions over 2 layers of 4 experts, top-1: every position of request r uses expert
// r % 4 at layer 0 and expert 0 at layer 1.
Trace PromptTrace(const std::vector<int>& lengths) {
  Routing r;
  for (size_t q = 0; q < lengths.size(); ++q) {
    auto& req = r.emplace_back();
    for (int p = 0; p < lengths[q]; ++p) req.push_back({{static_cast<uint16_t>(q % 4)}, {0}});
  }
  return MakeTrace(2, 4, 1, r, {}, 0, "prompt token position");
}

Result<ServeWorkload> Workload(const Trace& trace, const TraceRequests& grouped, double share) {
  ServeWorkloadOptions o;
  o.kind = TraceKind::kPromptPositions;
  o.decode_share = share;
  return BuildServeWorkload(grouped, o);
}

TEST(ServeReplayTest, TtftIsThePrefillAndTpotTheDecodeStepsWithNothingToLoad) {
  Trace trace = PromptTrace({10});
  TraceRequests grouped = GroupByRequest(trace);
  auto w = Workload(trace, grouped, 0.3);  // 7 prompt tokens, 3 decode steps.
  ASSERT_TRUE(w.ok());
  // Layer compute: 1 ms + 0.5 ms per token beyond the first.
  auto r = RunServeReplay(*w, {}, {0}, {2 * kMs}, Config("lru", 1.0, 1, Time(1, 0.5, 5)), nullptr);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_EQ(r->requests.size(), 1u);
  const RequestTiming& t = r->requests[0];
  EXPECT_EQ(t.prompt_tokens, 7u);
  EXPECT_EQ(t.steps, 4u);
  EXPECT_EQ(t.arrival_ns, 2 * kMs);
  EXPECT_EQ(t.start_ns, 2 * kMs);                // Idle until it arrives.
  EXPECT_DOUBLE_EQ(t.ttft_ns(), 2 * 4.0 * kMs);  // 2 layers at 7 tokens.
  EXPECT_DOUBLE_EQ(t.tpot_ns(), 2.0 * kMs);      // 2 layers at 1 token.
  EXPECT_EQ(r->prefill.iterations, 1u);
  EXPECT_EQ(r->prefill.requests, 1u);
  EXPECT_EQ(r->prefill.tokens, 7u);
  EXPECT_EQ(r->decode.iterations, 3u);
  EXPECT_EQ(r->decode.requests, 3u);
  EXPECT_EQ(r->prefill.misses + r->decode.misses, 0u);
  EXPECT_EQ(r->prefill.hits, 2u);
  EXPECT_DOUBLE_EQ(r->total_ns, 14.0 * kMs);
  EXPECT_DOUBLE_EQ(r->mean_batch, 1.0);
}

TEST(ServeReplayTest, RequestsBatchTogetherAndWaitForASlot) {
  Trace trace = PromptTrace({3, 3, 3});
  TraceRequests grouped = GroupByRequest(trace);
  auto w = Workload(trace, grouped, 0.34);  // 2 prompt tokens and 1 decode step each.
  ASSERT_TRUE(w.ok());
  ServeConfig c = Config("lru", 1.0, 2, Time(1, 1, 5));
  auto r = RunServeReplay(*w, {}, {0, 1, 2}, {0, 0, 0}, c, nullptr);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  // Iteration 1: prefills of 0 and 1 (4 tokens: 4 ms a layer); iteration 2: their decode steps
  // (2 tokens: 2 ms); iteration 3: prefill of 2 (2 tokens); iteration 4: its decode step.
  EXPECT_EQ(r->iterations, 4u);
  EXPECT_DOUBLE_EQ(r->requests[0].ttft_ns(), 8.0 * kMs);
  EXPECT_DOUBLE_EQ(r->requests[1].ttft_ns(), 8.0 * kMs);
  EXPECT_DOUBLE_EQ(r->requests[0].tpot_ns(), 4.0 * kMs);
  EXPECT_EQ(r->requests[2].start_ns, 12 * kMs);
  EXPECT_DOUBLE_EQ(r->requests[2].ttft_ns(), 16.0 * kMs);
  EXPECT_DOUBLE_EQ(r->requests[2].tpot_ns(), 2.0 * kMs);
  EXPECT_DOUBLE_EQ(r->mean_batch, 1.5);
  EXPECT_EQ(r->prefill.iterations, 2u);
  EXPECT_EQ(r->prefill.requests, 3u);
  EXPECT_EQ(r->decode.iterations, 2u);
  EXPECT_EQ(r->decode.requests, 3u);
}

TEST(ServeReplayTest, ABatchLoadsItsUnionOnce) {
  // One layer of 4 experts and 1 slot (expert 0 preloaded); two requests decode with expert 1.
  Routing r(2);
  for (auto& req : r) {
    for (int i = 0; i < 4; ++i) req.push_back({{1}});
  }
  Trace trace = MakeTrace(1, 4, 1, r);
  TraceRequests grouped = GroupByRequest(trace);
  ServeWorkloadOptions o;
  o.kind = TraceKind::kDecodePositions;
  auto w = BuildServeWorkload(grouped, o);
  ASSERT_TRUE(w.ok());
  auto together =
      RunServeReplay(*w, {}, {0, 1}, {0, 0}, Config("lru", 0.25, 2, Time(1, 0, 5)), nullptr);
  ASSERT_TRUE(together.ok()) << together.status().ToString();
  EXPECT_EQ(together->decode.on_demand_loads, 1u);
  EXPECT_EQ(together->decode.misses, 1u);
  EXPECT_EQ(together->decode.hits, 3u);
  EXPECT_EQ(together->prefill.iterations, 0u);  // No prefill in the trace.
  EXPECT_DOUBLE_EQ(together->decode.stall_ns, 5.0 * kMs);
  EXPECT_DOUBLE_EQ(together->decode.experts_moved, 1.0);
  // TTFT of a decode-only request: its first step, the load included.
  EXPECT_DOUBLE_EQ(together->requests[0].ttft_ns(), 6.0 * kMs);
}

TEST(ServeReplayTest, TheSameRequestsAloneMissEachOnItsOwn) {
  // Request 0 uses expert 1, request 1 expert 2, at each of 3 steps, one slot.
  Routing r = {{{{1}}, {{1}}, {{1}}}, {{{2}}, {{2}}, {{2}}}};
  Trace trace = MakeTrace(1, 4, 1, r);
  TraceRequests grouped = GroupByRequest(trace);
  ServeWorkloadOptions o;
  o.kind = TraceKind::kDecodePositions;
  auto w = BuildServeWorkload(grouped, o);
  ASSERT_TRUE(w.ok());
  auto alone =
      RunServeReplay(*w, {}, {0, 1}, {0, 0}, Config("lru", 0.25, 1, Time(1, 0, 5)), nullptr);
  auto together =
      RunServeReplay(*w, {}, {0, 1}, {0, 0}, Config("lru", 0.5, 2, Time(1, 0, 5)), nullptr);
  ASSERT_TRUE(alone.ok() && together.ok());
  EXPECT_EQ(alone->decode.misses, 2u);  // One switch of expert per request.
  EXPECT_EQ(alone->decode.iterations, 6u);
  EXPECT_EQ(together->decode.iterations, 3u);
  // Two slots (0 and 1 preloaded): expert 2 is loaded once, then both stay.
  EXPECT_EQ(together->decode.misses, 1u);
  EXPECT_EQ(together->decode.hits, 5u);
}

// Random prompts over 4 layers of 8 experts, top-2.
Trace RandomPrompts(uint32_t seed, int requests) {
  std::mt19937 rng(seed);
  Routing r(requests);
  for (auto& req : r) {
    const int positions = 2 + static_cast<int>(rng() % 8);
    for (int p = 0; p < positions; ++p) {
      std::vector<std::vector<uint16_t>> layers;
      for (int l = 0; l < 4; ++l) {
        uint16_t a = static_cast<uint16_t>(rng() % 8), b = static_cast<uint16_t>(rng() % 7);
        if (b >= a) ++b;
        layers.push_back({std::min(a, b), std::max(a, b)});
      }
      req.push_back(layers);
    }
  }
  return MakeTrace(4, 8, 2, r, {}, 0, "prompt token position");
}

TEST(ServeReplayTest, TheOracleFollowsItsOwnScheduleAndBeatsLru) {
  Trace trace = RandomPrompts(5, 12);
  TraceRequests grouped = GroupByRequest(trace);
  auto w = Workload(trace, grouped, 0.5);
  ASSERT_TRUE(w.ok());
  std::vector<uint32_t> test;
  std::vector<int64_t> arrivals;
  for (uint32_t i = 0; i < 12; ++i) {
    test.push_back(i);
    arrivals.push_back(i * 7 * kMs);
  }
  for (uint32_t batch : {1u, 4u}) {
    auto lru = RunServeReplay(*w, {}, test, arrivals, Config("lru", 0.25, batch, Time(1, 0.1, 3)),
                              nullptr);
    auto oracle = RunServeReplay(*w, {}, test, arrivals,
                                 Config("oracle", 0.25, batch, Time(1, 0.1, 3)), nullptr);
    ASSERT_TRUE(lru.ok() && oracle.ok()) << oracle.status().ToString();
    EXPECT_GE(oracle->oracle_passes, 1u);
    if (batch == 1) {
      EXPECT_FALSE(oracle->oracle_forced);  // FIFO: timing changes nothing.
    }
    EXPECT_GT(oracle->decode.hit_rate() + oracle->prefill.hit_rate(),
              lru->decode.hit_rate() + lru->prefill.hit_rate())
        << batch;
    EXPECT_LT(oracle->prefill.stall_ns + oracle->decode.stall_ns,
              lru->prefill.stall_ns + lru->decode.stall_ns)
        << batch;
  }
}

TEST(ServeReplayTest, AnOracleKeptToAScheduleWaitsForItsRequestsAndServesEveryOne) {
  Trace trace = RandomPrompts(6, 10);
  TraceRequests grouped = GroupByRequest(trace);
  auto w = Workload(trace, grouped, 0.5);
  ASSERT_TRUE(w.ok());
  std::vector<uint32_t> test;
  std::vector<int64_t> arrivals;
  for (uint32_t i = 0; i < 10; ++i) {
    test.push_back(i);
    arrivals.push_back(i * 20 * kMs);
  }
  ServeConfig c = Config("oracle", 0.25, 4, Time(1, 0.1, 3));
  c.oracle_passes = 0;  // Kept to the schedule of a run without stalls.
  auto forced = RunServeReplay(*w, {}, test, arrivals, c, nullptr);
  ASSERT_TRUE(forced.ok()) << forced.status().ToString();
  EXPECT_TRUE(forced->oracle_forced);
  EXPECT_EQ(forced->oracle_passes, 1u);
  for (size_t k = 0; k < test.size(); ++k) {
    const RequestTiming& t = forced->requests[k];
    EXPECT_GE(t.start_ns, t.arrival_ns) << k;
    EXPECT_GT(t.first_token_ns, t.start_ns) << k;
    EXPECT_GE(t.last_token_ns, t.first_token_ns) << k;
  }
  auto lru =
      RunServeReplay(*w, {}, test, arrivals, Config("lru", 0.25, 4, Time(1, 0.1, 3)), nullptr);
  ASSERT_TRUE(lru.ok());
  EXPECT_LT(forced->prefill.stall_ns + forced->decode.stall_ns,
            lru->prefill.stall_ns + lru->decode.stall_ns);
}

TEST(ServeReplayTest, EveryPolicyRunsAndAFullBudgetNeverMisses) {
  Trace trace = RandomPrompts(9, 10);
  TraceRequests grouped = GroupByRequest(trace);
  auto w = Workload(trace, grouped, 0.5);
  ASSERT_TRUE(w.ok());
  const std::vector<uint32_t> train = {0, 1, 2, 3}, test = {4, 5, 6, 7, 8, 9};
  const std::vector<int64_t> arrivals = {0, 1, 2, 30, 31, 32};
  auto store = WarmServeStore(*w, train, 100, 1);
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  EXPECT_GT(store->size(), 4u);
  for (const char* policy : {"lru", "lfu", "on-demand", "moe-infinity", "fmoe", "fmoe-pfreq",
                             "fmoe-nextuse", "oracle"}) {
    for (double budget : {0.25, 1.0}) {
      for (bool online : {false, true}) {
        for (uint32_t chunk : {0u, 3u}) {
          ServeConfig c = Config(policy, budget, 4, Time(1, 0.1, 3));
          c.online = online;
          c.max_batched_tokens = chunk;
          auto r = RunServeReplay(*w, train, test, arrivals, c, &*store);
          ASSERT_TRUE(r.ok()) << policy << ": " << r.status().ToString();
          EXPECT_EQ(r->requests.size(), 6u);
          for (const RequestTiming& t : r->requests) {
            EXPECT_GT(t.first_token_ns, t.start_ns) << policy;
            EXPECT_GE(t.last_token_ns, t.first_token_ns) << policy;
            if (chunk > 0 && t.prompt_tokens > chunk) {
              EXPECT_GT(t.prefill_iterations, 1u) << policy;
            }
          }
          if (budget == 1.0) {
            EXPECT_EQ(r->prefill.misses + r->decode.misses, 0u) << policy;
            EXPECT_EQ(r->prefill.stall_ns + r->decode.stall_ns, 0.0) << policy;
          }
        }
      }
    }
  }
}

void ExpectSameRun(const ServeResult& a, const ServeResult& b, const std::string& what) {
  ASSERT_EQ(a.requests.size(), b.requests.size()) << what;
  for (size_t k = 0; k < a.requests.size(); ++k) {
    EXPECT_EQ(a.requests[k].start_ns, b.requests[k].start_ns) << what << " " << k;
    EXPECT_EQ(a.requests[k].first_token_ns, b.requests[k].first_token_ns) << what << " " << k;
    EXPECT_EQ(a.requests[k].last_token_ns, b.requests[k].last_token_ns) << what << " " << k;
    EXPECT_EQ(a.requests[k].prefill_iterations, 1u) << what << " " << k;
    EXPECT_EQ(b.requests[k].prefill_iterations, 1u) << what << " " << k;
  }
  for (auto phase : {&ServeResult::prefill, &ServeResult::decode}) {
    const PhaseFigures &x = a.*phase, &y = b.*phase;
    EXPECT_EQ(x.iterations, y.iterations) << what;
    EXPECT_EQ(x.tokens, y.tokens) << what;
    EXPECT_EQ(x.requests, y.requests) << what;
    EXPECT_EQ(x.hits, y.hits) << what;
    EXPECT_EQ(x.misses, y.misses) << what;
    EXPECT_EQ(x.prefetches_issued, y.prefetches_issued) << what;
    EXPECT_EQ(x.prefetches_used, y.prefetches_used) << what;
    EXPECT_EQ(x.experts_moved, y.experts_moved) << what;
    EXPECT_EQ(x.stall_ns, y.stall_ns) << what;
    EXPECT_EQ(x.time_ns, y.time_ns) << what;
  }
  EXPECT_EQ(a.iterations, b.iterations) << what;
  EXPECT_EQ(a.directives, b.directives) << what;
  EXPECT_EQ(a.oracle_passes, b.oracle_passes) << what;
}

TEST(ServeReplayTest, ATokenBudgetThatHoldsEveryPromptChangesNothing) {
  Trace trace = RandomPrompts(9, 10);
  TraceRequests grouped = GroupByRequest(trace);
  auto w = Workload(trace, grouped, 0.5);
  ASSERT_TRUE(w.ok());
  const std::vector<uint32_t> train = {0, 1, 2, 3}, test = {4, 5, 6, 7, 8, 9};
  const std::vector<int64_t> arrivals = {0, 1, 2, 30, 31, 32};
  // Every prompt of the trace together, and a decode step of every slot.
  uint32_t all = 0;
  for (const ServeRequest& r : w->requests) all += r.prompt_tokens;
  auto store = WarmServeStore(*w, train, 100, 1);
  ASSERT_TRUE(store.ok());
  for (const char* policy : {"lru", "moe-infinity", "fmoe", "oracle"}) {
    for (uint32_t batch : {1u, 4u}) {
      ServeConfig c = Config(policy, 0.25, batch, Time(1, 0.1, 3));
      c.online = false;
      auto whole = RunServeReplay(*w, train, test, arrivals, c, &*store);
      c.max_batched_tokens = all + batch;
      auto budget = RunServeReplay(*w, train, test, arrivals, c, &*store);
      ASSERT_TRUE(whole.ok() && budget.ok()) << policy << ": " << budget.status().ToString();
      ExpectSameRun(*whole, *budget, std::string(policy) + " batch " + std::to_string(batch));
    }
  }
}

TEST(ServeReplayTest, ChunkedPrefillLetsAnotherRequestDecodeBetweenItsChunks) {
  // Request 0: 20 positions (10 prompt, 10 decode); request 1: 80 (40 prompt, 40 decode),
  // arriving while request 0 decodes. Nothing to load: only the batching differs.
  Trace trace = PromptTrace({20, 80});
  TraceRequests grouped = GroupByRequest(trace);
  auto w = Workload(trace, grouped, 0.5);
  ASSERT_TRUE(w.ok());
  ServeConfig c = Config("lru", 1.0, 2, Time(1, 0.5, 5));
  const std::vector<int64_t> arrivals = {0, 20 * kMs};  // Request 0's prefill takes 11 ms.
  auto whole = RunServeReplay(*w, {}, {0, 1}, arrivals, c, nullptr);
  c.max_batched_tokens = 8;
  auto chunked = RunServeReplay(*w, {}, {0, 1}, arrivals, c, nullptr);
  ASSERT_TRUE(whole.ok() && chunked.ok()) << chunked.status().ToString();
  // Request 0's prefill (8 of its 10 positions, then 2) and request 1's 40 positions in chunks
  // of 7, each beside a decode step of request 0.
  EXPECT_EQ(whole->requests[0].prefill_iterations, 1u);
  EXPECT_EQ(whole->requests[1].prefill_iterations, 1u);
  EXPECT_EQ(chunked->requests[0].prefill_iterations, 2u);
  EXPECT_EQ(chunked->requests[1].prefill_iterations, 6u);
  EXPECT_EQ(whole->prefill.iterations, 2u);
  EXPECT_EQ(chunked->prefill.iterations, 8u);
  EXPECT_EQ(whole->prefill.requests, 2u);  // Prefills, each counted once.
  EXPECT_EQ(chunked->prefill.requests, 2u);
  // Request 0's decode tokens ran in request 1's chunk iterations: one in the whole prefill's,
  // six beside the chunks.
  EXPECT_EQ(whole->prefill.tokens, 10u + 40u + 1u);
  EXPECT_EQ(chunked->prefill.tokens, 10u + 40u + 6u);
  // The same tokens in all; every step still runs once.
  EXPECT_EQ(whole->prefill.tokens + whole->decode.tokens,
            chunked->prefill.tokens + chunked->decode.tokens);
  for (const auto* r : {&*whole, &*chunked}) {
    EXPECT_EQ(r->requests[0].steps, 11u);
    EXPECT_EQ(r->requests[1].steps, 41u);
  }
  // Request 1's first token comes later, request 0's tokens come faster.
  EXPECT_GT(chunked->requests[1].ttft_ns(), whole->requests[1].ttft_ns());
  EXPECT_LT(chunked->requests[0].tpot_ns(), whole->requests[0].tpot_ns());
}

TEST(ServeReplayTest, ExpertAwareChunksRunLoadBoundPromptsWholeAndKeepTheBudgetOtherwise) {
  // The requests of the test above. A quarter of the experts cached over a 5 ms link: a chunk of
  // 7 or 8 positions is expected to need nearly every expert of a layer, as the whole prompt
  // does, so cutting a prompt would cost far more than 25%: each prefill runs whole. Every
  // expert cached: nothing to load, the budget's chunks stay.
  Trace trace = PromptTrace({20, 80});
  TraceRequests grouped = GroupByRequest(trace);
  auto w = Workload(trace, grouped, 0.5);
  ASSERT_TRUE(w.ok());
  const std::vector<int64_t> arrivals = {0, 20 * kMs};
  ServeConfig c = Config("lru", 0.25, 2, Time(1, 0.5, 5));
  c.max_batched_tokens = 8;
  c.chunk_overhead = 0.25;
  auto load_bound = RunServeReplay(*w, {}, {0, 1}, arrivals, c, nullptr);
  c.budget = 1.0;
  auto resident = RunServeReplay(*w, {}, {0, 1}, arrivals, c, nullptr);
  c.chunk_overhead = 0;
  auto plain = RunServeReplay(*w, {}, {0, 1}, arrivals, c, nullptr);
  ASSERT_TRUE(load_bound.ok() && resident.ok() && plain.ok());
  EXPECT_EQ(load_bound->requests[0].prefill_iterations, 1u);
  EXPECT_EQ(load_bound->requests[1].prefill_iterations, 1u);
  EXPECT_EQ(resident->requests[0].prefill_iterations, 2u);
  EXPECT_EQ(resident->requests[1].prefill_iterations, 6u);
  EXPECT_EQ(resident->prefill.iterations, plain->prefill.iterations);
  EXPECT_EQ(resident->requests[1].ttft_ns(), plain->requests[1].ttft_ns());
}

TEST(ServeReplayTest, ChunksOfAPromptNeedOnlyTheirOwnPositionsExperts) {
  // One layer of 4 experts, top-1, one slot (expert 0 preloaded): a prompt of positions using
  // experts 1, 1, 2, 2, then a decode step. Whole, the prefill needs 1 and 2 at once (the slot
  // cannot hold both: both load); in chunks of 2, [0, 2) needs only 1 and [2, 4) only 2.
  Routing r = {{{{1}}, {{1}}, {{2}}, {{2}}, {{2}}}};
  Trace trace = MakeTrace(1, 4, 1, r, {}, 0, "prompt token position");
  TraceRequests grouped = GroupByRequest(trace);
  auto w = Workload(trace, grouped, 0.2);  // 4 prompt positions, 1 decode step.
  ASSERT_TRUE(w.ok());
  ServeConfig c = Config("lru", 0.25, 1, Time(1, 0, 10));
  c.max_batched_tokens = 2;
  auto chunked = RunServeReplay(*w, {}, {0}, {0}, c, nullptr);
  ASSERT_TRUE(chunked.ok()) << chunked.status().ToString();
  EXPECT_EQ(chunked->prefill.iterations, 2u);
  EXPECT_EQ(chunked->prefill.tokens, 4u);
  EXPECT_EQ(chunked->prefill.misses, 2u);  // 1 in the first chunk, 2 in the second.
  EXPECT_EQ(chunked->prefill.hits, 0u);
  EXPECT_EQ(chunked->decode.hits, 1u);  // Expert 2 stayed.
}

TEST(ServeReplayTest, ChunkedPrefillNeedsEachPromptPositionsRouting) {
  Routing r = {{{{1}}, {{1}}, {{2}}}};
  Trace trace = MakeTrace(1, 4, 1, r);
  TraceRequests grouped = GroupByRequest(trace);
  for (TraceKind kind : {TraceKind::kIterations, TraceKind::kDecodePositions}) {
    ServeWorkloadOptions o;
    o.kind = kind;
    auto w = BuildServeWorkload(grouped, o);
    ASSERT_TRUE(w.ok());
    ServeConfig c = Config("lru", 0.5, 1, Time(1, 0, 3));
    EXPECT_TRUE(RunServeReplay(*w, {}, {0}, {0}, c, nullptr).ok());
    c.max_batched_tokens = 16;
    auto refused = RunServeReplay(*w, {}, {0}, {0}, c, nullptr);
    EXPECT_EQ(refused.status().code(), ErrorCode::kInvalidArgument);
    EXPECT_NE(refused.status().message().find(std::string(TraceKindName(kind))), std::string::npos)
        << refused.status().message();
  }
}

TEST(ServeReplayTest, BadConfigsAreRefused) {
  Trace trace = RandomPrompts(3, 2);
  TraceRequests grouped = GroupByRequest(trace);
  auto w = Workload(trace, grouped, 0.5);
  ASSERT_TRUE(w.ok());
  const TimeModel t = Time(1, 0, 3);
  auto code = [&](const ServeConfig& c, std::vector<int64_t> arrivals = {0}) {
    return RunServeReplay(*w, {}, {0}, arrivals, c, nullptr).status().code();
  };
  EXPECT_EQ(code(Config("lru", 0.0, 1, t)), ErrorCode::kInvalidArgument);
  ServeConfig c = Config("lru", 0.5, 1, t);
  c.distance = 5;
  EXPECT_EQ(code(c), ErrorCode::kInvalidArgument);
  EXPECT_EQ(code(Config("lru", 0.5, 0, t)), ErrorCode::kInvalidArgument);
  EXPECT_EQ(code(Config("lru", 0.5, 1, t), {0, 0}), ErrorCode::kInvalidArgument);
  c = Config("fmoe", 0.5, 1, t);
  c.online = false;
  EXPECT_EQ(code(c), ErrorCode::kInvalidArgument);  // Offline fmoe needs a warmed store.
  c = Config("lru", 0.5, 1, t);
  c.time.link_gbps = 0;
  EXPECT_EQ(code(c), ErrorCode::kInvalidArgument);
  EXPECT_EQ(code(Config("belady", 0.5, 1, t)), ErrorCode::kInvalidArgument);
  c = Config("lru", 0.5, 1, t);
  c.hybrid = true;  // No CPU model.
  EXPECT_EQ(code(c), ErrorCode::kInvalidArgument);
  c.cpu.factor = -1;
  EXPECT_EQ(code(c), ErrorCode::kInvalidArgument);
}

ServeConfig Hybrid(ServeConfig c, double factor, double knee = 16) {
  c.hybrid = true;
  c.cpu.factor = factor;
  c.cpu.knee_tokens = knee;
  return c;
}

// Decode steps only, one layer of 4 experts, top-1 (one slot at 25%: expert 0 preloaded).
Result<ServeWorkload> DecodeWorkload(const Trace& trace, const TraceRequests& grouped) {
  ServeWorkloadOptions o;
  o.kind = TraceKind::kDecodePositions;
  return BuildServeWorkload(grouped, o);
}

TEST(ServeReplayTest, HybridComputesAMissOnTheCpuWhenThatIsSooner) {
  // Every step misses: expert 1, 2, 1, 2, ... against a cache holding one expert. A load takes
  // 10 ms, a layer 1 ms.
  Routing r(1);
  for (int i = 0; i < 4; ++i) r[0].push_back({{static_cast<uint16_t>(1 + i % 2)}});
  Trace trace = MakeTrace(1, 4, 1, r);
  TraceRequests grouped = GroupByRequest(trace);
  auto w = DecodeWorkload(trace, grouped);
  ASSERT_TRUE(w.ok());
  const ServeConfig off = Config("lru", 0.25, 1, Time(1, 0, 10));
  auto link = RunServeReplay(*w, {}, {0}, {0}, off, nullptr);
  // c = 0.5: 5 ms on the CPU against 10 over the link, every step; the cache keeps expert 0.
  auto half = RunServeReplay(*w, {}, {0}, {0}, Hybrid(off, 0.5), nullptr);
  // c = 1.5: 15 ms on the CPU: every miss loads, as without the CPU path.
  auto slow = RunServeReplay(*w, {}, {0}, {0}, Hybrid(off, 1.5), nullptr);
  ASSERT_TRUE(link.ok() && half.ok() && slow.ok()) << half.status().ToString();
  EXPECT_DOUBLE_EQ(link->requests[0].tpot_ns(), 11.0 * kMs);
  EXPECT_DOUBLE_EQ(link->decode.stall_ns, 40.0 * kMs);
  EXPECT_DOUBLE_EQ(link->decode.experts_moved, 4.0);
  EXPECT_EQ(link->decode.cpu_experts, 0u);

  EXPECT_DOUBLE_EQ(half->requests[0].ttft_ns(), 6.0 * kMs);
  EXPECT_DOUBLE_EQ(half->requests[0].tpot_ns(), 6.0 * kMs);
  EXPECT_EQ(half->decode.cpu_experts, 4u);
  EXPECT_EQ(half->decode.misses, 4u);  // CPU-run experts are misses too.
  EXPECT_EQ(half->decode.hits, 0u);
  EXPECT_EQ(half->decode.on_demand_loads, 0u);
  EXPECT_DOUBLE_EQ(half->decode.experts_moved, 0.0);
  EXPECT_DOUBLE_EQ(half->decode.stall_ns, 20.0 * kMs);
  EXPECT_DOUBLE_EQ(half->decode.cpu_stall_ns, 20.0 * kMs);
  EXPECT_DOUBLE_EQ(half->decode.cpu_ns, 20.0 * kMs);

  EXPECT_EQ(slow->decode.cpu_experts, 0u);
  EXPECT_DOUBLE_EQ(slow->decode.stall_ns, link->decode.stall_ns);
  EXPECT_DOUBLE_EQ(slow->requests[0].tpot_ns(), link->requests[0].tpot_ns());
}

TEST(ServeReplayTest, HybridSplitsABatchsMissesBetweenTheLinkAndTheCpu) {
  // Two requests decode together, one with expert 1, the other with expert 2, for 3 steps; one
  // slot. Step 1: both miss; link only 20 ms, one on the CPU max(10, 5) = 10, both 10: expert 1
  // (the lower) runs on the CPU, expert 2 loads. Steps 2 and 3: expert 2 hits, expert 1 runs on
  // the CPU (5 ms).
  Routing r = {{{{1}}, {{1}}, {{1}}}, {{{2}}, {{2}}, {{2}}}};
  Trace trace = MakeTrace(1, 4, 1, r);
  TraceRequests grouped = GroupByRequest(trace);
  auto w = DecodeWorkload(trace, grouped);
  ASSERT_TRUE(w.ok());
  const ServeConfig off = Config("lru", 0.25, 2, Time(1, 0, 10));
  auto on = RunServeReplay(*w, {}, {0, 1}, {0, 0}, Hybrid(off, 0.5), nullptr);
  auto link = RunServeReplay(*w, {}, {0, 1}, {0, 0}, off, nullptr);
  ASSERT_TRUE(on.ok() && link.ok()) << on.status().ToString();
  EXPECT_EQ(on->decode.iterations, 3u);
  EXPECT_DOUBLE_EQ(on->requests[0].ttft_ns(), 11.0 * kMs);
  EXPECT_DOUBLE_EQ(on->requests[1].tpot_ns(), 6.0 * kMs);
  EXPECT_EQ(on->decode.cpu_experts, 3u);
  EXPECT_EQ(on->decode.hits, 2u);
  EXPECT_EQ(on->decode.misses, 4u);
  EXPECT_EQ(on->decode.on_demand_loads, 1u);
  EXPECT_DOUBLE_EQ(on->decode.experts_moved, 1.0);
  EXPECT_DOUBLE_EQ(on->decode.stall_ns, 20.0 * kMs);      // 10 + 5 + 5.
  EXPECT_DOUBLE_EQ(on->decode.cpu_stall_ns, 10.0 * kMs);  // Steps 2 and 3.
  EXPECT_DOUBLE_EQ(on->decode.cpu_ns, 15.0 * kMs);
  // Without it the two experts take turns in the slot: both load at step 1, then the one that
  // was not kept at each step (the resident one is computed first, then makes room).
  EXPECT_DOUBLE_EQ(link->decode.stall_ns, 40.0 * kMs);
  EXPECT_DOUBLE_EQ(link->decode.experts_moved, 4.0);
}

TEST(ServeReplayTest, HybridLoadsAPrefillsExpertsWhenTheirTokensMakeTheCpuSlower) {
  // Request 2's prompt: 10 positions over 2 layers, expert 2 at layer 0 and 0 at layer 1; 20%
  // decode: a prefill of 8 tokens, then 2 decode steps. 2 slots (layer 0's experts 0 and 1
  // preloaded). At c = 0.5 flat to 2 tokens, an expert of 8 tokens takes 20 ms on the CPU
  // against a 10 ms load: the prefill loads both, as without the CPU path, then decode hits.
  Trace trace = PromptTrace({1, 1, 10});
  TraceRequests grouped = GroupByRequest(trace);
  auto w = Workload(trace, grouped, 0.2);
  ASSERT_TRUE(w.ok());
  const ServeConfig off = Config("lru", 0.25, 1, Time(1, 0, 10));
  auto link = RunServeReplay(*w, {}, {2}, {0}, off, nullptr);
  auto on = RunServeReplay(*w, {}, {2}, {0}, Hybrid(off, 0.5, 2), nullptr);
  ASSERT_TRUE(link.ok() && on.ok()) << on.status().ToString();
  EXPECT_EQ(on->prefill.tokens, 8u);
  EXPECT_EQ(on->prefill.cpu_experts, 0u);
  EXPECT_EQ(on->prefill.on_demand_loads, 2u);
  EXPECT_DOUBLE_EQ(on->prefill.stall_ns, 20.0 * kMs);
  EXPECT_DOUBLE_EQ(on->requests[0].ttft_ns(), link->requests[0].ttft_ns());
  EXPECT_EQ(on->decode.misses, 0u);
  // Flat to 16 tokens, the same prefill's experts take 5 ms each on the CPU: both go there.
  auto flat = RunServeReplay(*w, {}, {2}, {0}, Hybrid(off, 0.5, 16), nullptr);
  ASSERT_TRUE(flat.ok());
  EXPECT_EQ(flat->prefill.cpu_experts, 2u);
  EXPECT_DOUBLE_EQ(flat->prefill.stall_ns, 10.0 * kMs);
}

TEST(ServeReplayTest, HybridNeverSlowsTheFirstIterationOfAnyPolicy) {
  // The first iteration starts from the same (preloaded) cache with and without the CPU path.
  Trace trace = RandomPrompts(11, 8);
  TraceRequests grouped = GroupByRequest(trace);
  auto w = Workload(trace, grouped, 0.5);
  ASSERT_TRUE(w.ok());
  const std::vector<uint32_t> test = {0, 1, 2, 3, 4, 5, 6, 7};
  const std::vector<int64_t> arrivals(test.size(), 0);
  for (const char* policy : {"lru", "lfu", "on-demand", "moe-infinity", "fmoe", "oracle"}) {
    for (double factor : {0.25, 0.5, 1.0, 3.0}) {
      for (uint32_t batch : {1u, 4u}) {
        const ServeConfig off = Config(policy, 0.25, batch, Time(1, 0.1, 3));
        auto a = RunServeReplay(*w, {}, test, arrivals, off, nullptr);
        auto b = RunServeReplay(*w, {}, test, arrivals, Hybrid(off, factor), nullptr);
        ASSERT_TRUE(a.ok() && b.ok()) << policy << ": " << b.status().ToString();
        EXPECT_LE(b->requests[0].ttft_ns(), a->requests[0].ttft_ns())
            << policy << " c=" << factor << " batch " << batch;
        if (factor < 1) {
          EXPECT_GT(b->prefill.cpu_experts + b->decode.cpu_experts, 0u) << policy;
        }
      }
    }
  }
}

}  // namespace
}  // namespace fmoe::bench
