// Expert parallelism (DESIGN section 7) in one process: each rank is a thread with its own model,
// expert cache and c10d group (Gloo over loopback, the same code the worker processes run).
// World sizes 1, 2 and 3, with every policy at a budget below 100%, generate exactly the tokens
// one all-resident rank generates; each rank loads and caches only the experts it owns; the
// group's expert figures are the sum of the ranks'; a rank that leaves, or stops answering,
// breaks the group within the collective timeout instead of hanging it.
#include <unistd.h>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "common/model/model_config.h"
#include "common/text/tokenizer.h"
#include "gpu_worker/engine/engine.h"
#include "gpu_worker/engine/follower.h"
#include "gpu_worker/experts/cached_experts.h"
#include "gpu_worker/group/expert_group.h"
#include "gpu_worker/model/model.h"
#include "tests/testing/fake_map_service.h"
#include "tests/testing/model_fixture.h"
#include "tests/testing/process_harness.h"

namespace fmoe {
namespace {

using testing::kPrompts;
using testing::Tokens;

const std::string kModelDir = testing::TinyModelDir();

// The model in `dir` (default: the shipped tiny model; the family tests use the fixtures).
testing::LoadedModel& Common(const std::string& dir = kModelDir) {
  static std::once_flag once;
  std::call_once(once, [] { at::set_num_threads(1); });  // The ranks are threads: one core each.
  return testing::SharedModel(dir);
}

// One rank's weights: the dense ones and the experts it owns. Loaded once per (world, rank).
struct RankWeights {
  std::unique_ptr<MoeModel> model;
  ExpertTable table;
};

RankWeights& Weights(uint32_t world, uint32_t rank, const std::string& dir = kModelDir) {
  const ModelInfo& info = Common(dir).info;
  static std::mutex mu;
  static std::map<std::tuple<std::string, uint32_t, uint32_t>, std::unique_ptr<RankWeights>> loaded;
  std::lock_guard<std::mutex> lock(mu);
  auto& slot = loaded[{dir, world, rank}];
  if (!slot) {
    slot = std::make_unique<RankWeights>();
    RuntimeOptions options;
    options.expert_rank = rank;
    options.expert_world_size = world;
    auto model = MoeModel::Load(info, options, {}, &slot->table);
    EXPECT_TRUE(model.ok()) << model.status().ToString();
    slot->model = std::move(*model);
  }
  return *slot;
}

uint16_t FreePort() { return static_cast<uint16_t>(testing::FreeTcpPort()); }

std::vector<Generate> Requests(const std::string& dir = kModelDir) {
  return testing::PromptRequests(*Common(dir).tokenizer);
}

// An expert one rank cannot read (its source hands it out failed), for RunGroup.
struct ExpertFault {
  uint32_t rank = 0;
  uint32_t layer = 0;
  uint32_t expert = 0;
};

// Delegates to the rank's cache, except that the faulty expert comes out of Next failed, as a
// read error behind a host tier would.
class FailingExperts final : public ExpertSource {
 public:
  FailingExperts(ExpertSource& inner, const ExpertFault& fault) : inner_(inner), fault_(fault) {}
  void BeginIteration(std::span<const SequenceInfo> s) override { inner_.BeginIteration(s); }
  uint32_t speculation_distance() const override { return inner_.speculation_distance(); }
  void Speculate(uint32_t layer, uint32_t target, std::span<const float> probs) override {
    inner_.Speculate(layer, target, probs);
  }
  Status BeginLayer(const LayerRouting& routing) override {
    layer_ = routing.layer;
    return inner_.BeginLayer(routing);
  }
  Result<SourcedExpert> Next() override {
    Result<SourcedExpert> next = inner_.Next();
    if (next.ok() && layer_ == fault_.layer && next->expert == fault_.expert) {
      next->weights = {};
      next->failed = IoError("/m/model.safetensors: bytes [0, 64): pread: Input/output error");
    }
    return next;
  }
  void Done(uint32_t expert) override { inner_.Done(expert); }
  bool HostRunsPlanned() const override { return inner_.HostRunsPlanned(); }
  void EndLayer() override { inner_.EndLayer(); }
  void EndIteration() override { inner_.EndIteration(); }
  void OnRequestEnd(uint64_t id) override { inner_.OnRequestEnd(id); }
  RequestUsage Usage(uint64_t id) const override { return inner_.Usage(id); }

 private:
  ExpertSource& inner_;
  ExpertFault fault_;
  uint32_t layer_ = 0;
};

struct GroupRun {
  Tokens tokens;
  std::map<uint64_t, TokenEvent> last_events;
  std::vector<CacheStats> rank_stats;
  ExpertFigures group_figures;
  std::vector<GroupStats> group_stats;
  std::vector<std::string> errors;
  uint64_t preemptions = 0;                  // The leader's.
  std::vector<KvPoolFigures> kv;             // Per rank, at the end.
  std::vector<KvFigures::RankSplit> splits;  // The leader's view of every rank's split, at the end.
};

// Runs the prompts through a group of `world` rank threads; rank 0 serves them.
// `max_batched_tokens`: the leader's token budget per step (prompts prefilled in chunks).
// `budget_pages`: per rank, one device budget for its experts and KV pool (memory), in pages of
// an expert's bytes (instead of `fraction`), the pool's arena agreed across the group after it
// forms, as the rank does.
GroupRun RunGroup(uint32_t world, const std::string& policy, double fraction,
                  const std::vector<LayerAccess>& future = {}, const std::string& dir = kModelDir,
                  uint32_t max_batched_tokens = 0, uint64_t kv_tokens = 0,
                  std::optional<ExpertFault> fault = std::nullopt,
                  StreamMode stream = StreamMode::kOff,
                  const std::vector<double>& budget_pages = {}) {
  const ModelInfo& info = Common(dir).info;
  // Every rank's KV pool: fixed at kv_tokens positions (0: growing), as the rank sets it.
  for (uint32_t r = 0; r < world; ++r)
    Weights(world, r, dir).model->ConfigureKv({kv_tokens, false});
  GroupRun run;
  std::mutex mu;
  const uint16_t port = FreePort();
  std::vector<std::unique_ptr<CachedExperts>> caches(world);
  for (uint32_t r = 0; r < world; ++r) {
    CachedExpertsOptions o;
    o.policy = policy;
    o.top_k = info.top_k;
    o.cache_fraction = fraction;
    if (!budget_pages.empty()) {
      // Pages of an expert's bytes rounded up to whole KV blocks (as CachedExperts cuts them).
      const RankWeights& w = Weights(world, r, dir);
      uint64_t expert_bytes = 0;
      for (const ExpertWeights& e : w.table[r % info.num_moe_layers]) {
        if (!e.w1.defined()) continue;
        expert_bytes = e.w1.nbytes() + e.w2.nbytes() + e.w3.nbytes();
        break;
      }
      CachedExpertsOptions::SharedBudget b;
      b.page_quantum = w.model->kv_block_bytes();
      const uint64_t unit = std::lcm<uint64_t>(b.page_quantum, 256);
      const uint64_t page = (expert_bytes + unit - 1) / unit * unit;
      b.device_gb = budget_pages[r] * static_cast<double>(page) / 1e9;
      o.shared = b;
    }
    o.rank = r;
    o.world_size = world;
    o.policy_options.prefetch_distance = 2;
    o.policy_options.future = future;
    o.link.gbps = 8;
    o.link.latency_us = 10;
    if (stream != StreamMode::kOff) o.stream_slots = 2 * info.num_experts / world;
    auto cached = CachedExperts::Create(CloneExpertTable(Weights(world, r, dir).table), o);
    EXPECT_TRUE(cached.ok()) << cached.status().ToString();
    if (!cached.ok()) return run;
    caches[r] = std::move(*cached);
  }
  std::vector<CachedExperts*> targets;
  for (auto& c : caches) targets.push_back(c.get());
  testing::FakeMapService directives(targets, info.num_moe_layers, /*experts=*/4);
  run.rank_stats.resize(world);
  run.group_stats.resize(world);
  run.kv.resize(world);

  auto rank_main = [&](uint32_t r) {
    auto fail = [&](const std::string& what) {
      std::lock_guard<std::mutex> lock(mu);
      run.errors.push_back("rank " + std::to_string(r) + ": " + what);
    };
    ExpertGroupOptions g;
    g.group = "test";
    g.rank = r;
    g.world_size = world;
    g.rendezvous_host = "127.0.0.1";
    g.rendezvous_port = port;
    g.rendezvous_timeout = std::chrono::seconds(30);
    g.collective_timeout = std::chrono::seconds(30);
    auto joined = ExpertGroup::Join(g);
    if (!joined.ok()) return fail(joined.status().ToString());
    ExpertGroup& group = **joined;
    MoeModel& model = *Weights(world, r, dir).model;
    model.set_group(&group);
    CachedExperts& cache = *caches[r];
    if (!budget_pages.empty()) {
      std::optional<KvArena> arena = cache.kv_arena();
      if (!arena) return fail("no KV arena");
      if (Status s = AgreeKvArena(group, model.kv_block_bytes(), &*arena); !s.ok()) {
        return fail(s.ToString());
      }
      KvPoolOptions kv;
      kv.arena = arena;
      model.ConfigureKv(kv);
      if (Status s = model.MaterializeKv(); !s.ok()) return fail(s.ToString());
    }
    std::unique_ptr<FailingExperts> failing;
    if (fault && fault->rank == r) failing = std::make_unique<FailingExperts>(cache, *fault);
    ExpertSource& source = failing ? static_cast<ExpertSource&>(*failing) : cache;
    auto local = [&cache] {
      const CacheCounters t = cache.stats().total;
      return ExpertFigures{t.hits,
                           t.misses,
                           t.prefetches_issued,
                           t.prefetches_used,
                           t.bytes_moved,
                           static_cast<uint64_t>(t.stall_ns / 1000)};
    };
    Status invariants;
    if (r == 0) {
      EngineOptions options;
      options.max_batch = 4;  // Six prompts: requests join and leave mid-run.
      options.max_batched_tokens = max_batched_tokens;
      options.prefill_stream = stream;
      options.group = &group;
      options.keepalive_ms = 100;
      options.local_figures = local;
      options.on_group_failure = [&](const Status& s) { fail(s.ToString()); };
      std::atomic<size_t> finished{0};
      Engine engine(options, model, source, Common(dir).tokenizer.get(), &directives,
                    [&](const TokenEvent& ev) {
                      std::lock_guard<std::mutex> lock(mu);
                      if (ev.token_id >= 0) run.tokens[ev.request_id].push_back(ev.token_id);
                      if (ev.finish == FinishReason::kError) run.errors.push_back(ev.error);
                      run.last_events[ev.request_id] = ev;
                      if (ev.finish != FinishReason::kNone) ++finished;
                    });
      for (Generate& req : Requests(dir)) engine.Submit(std::move(req));
      const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(120);
      engine.Run([&] {
        if (Status s = cache.cache().CheckInvariants(); !s.ok() && invariants.ok()) invariants = s;
        return finished == kPrompts.size() || std::chrono::steady_clock::now() > deadline;
      });
      run.group_figures = engine.group_figures();
      run.splits = engine.kv_figures().ranks;
      run.preemptions = engine.stats().preemptions;
    } else {
      Follower follower(model, source, group, 4, local);
      Status s = follower.Run([] { return false; }, std::chrono::seconds(0));
      if (!s.ok()) fail(s.ToString());
      if (Status c = cache.cache().CheckInvariants(); !c.ok()) invariants = c;
    }
    if (!invariants.ok()) fail(invariants.ToString());
    model.set_group(nullptr);
    std::lock_guard<std::mutex> lock(mu);
    run.rank_stats[r] = cache.stats();
    run.group_stats[r] = group.stats();
    run.kv[r] = model.kv_figures();
  };
  std::vector<std::thread> threads;
  for (uint32_t r = 0; r < world; ++r) threads.emplace_back(rank_main, r);
  for (auto& t : threads) t.join();
  return run;
}

struct Reference {
  Tokens tokens;
  std::vector<LayerAccess> accesses;
  // Per request: the (MoE layer, expert) pairs its tokens picked.
  std::map<uint64_t, std::set<std::pair<uint32_t, uint32_t>>> used;
};

// Records the experts each request's tokens pick.
class RoutingRecorder final : public ForwardObserver {
 public:
  explicit RoutingRecorder(Reference* ref) : ref_(ref) {}
  void OnLayerRouting(uint64_t request_id, uint32_t, uint32_t layer,
                      std::span<const uint32_t> experts, std::span<const uint32_t>) override {
    for (uint32_t e : experts) ref_->used[request_id].insert({layer, e});
  }

 private:
  Reference* ref_;
};

// One rank, every expert resident: what every group must produce.
const Reference& AllResident(const std::string& dir = kModelDir) {
  static auto* refs = new std::map<std::string, std::unique_ptr<Reference>>();
  auto& r = (*refs)[dir];
  if (!r) {
    r = std::make_unique<Reference>();
    RankWeights& w = Weights(1, 0, dir);
    ResidentExperts resident(CloneExpertTable(w.table));
    RecordingExperts recording(resident);
    RoutingRecorder routing(r.get());
    EngineOptions options;
    options.max_batch = 4;
    Engine engine(options, *w.model, recording, Common(dir).tokenizer.get(), &routing,
                  [&](const TokenEvent& ev) {
                    if (ev.token_id >= 0) r->tokens[ev.request_id].push_back(ev.token_id);
                  });
    for (Generate& req : Requests(dir)) engine.Submit(std::move(req));
    for (int step = 0; step < 200 && engine.Step(); ++step) {
    }
    r->accesses = recording.accesses();
  }
  return *r;
}

TEST(ExpertParallel, EachRankLoadsOnlyItsOwnExperts) {
  const ModelInfo& info = Common().info;
  for (uint32_t world : {2u, 3u}) {
    size_t total = 0;
    for (uint32_t r = 0; r < world; ++r) {
      const ExpertTable& table = Weights(world, r).table;
      ASSERT_EQ(table.size(), info.num_moe_layers);
      for (uint32_t l = 0; l < info.num_moe_layers; ++l) {
        for (uint32_t j = 0; j < info.num_experts; ++j) {
          const bool owned = (l * info.num_experts + j) % world == r;
          EXPECT_EQ(table[l][j].w1.defined(), owned) << "world " << world << " rank " << r;
          total += owned ? 1 : 0;
        }
      }
    }
    EXPECT_EQ(total, size_t{info.num_moe_layers} * info.num_experts);  // Each exactly once.
  }
}

TEST(ExpertParallel, EveryWorldSizeAndPolicyGivesTheAllResidentTokens) {
  const Reference& ref = AllResident();
  ASSERT_EQ(ref.tokens.size(), kPrompts.size());
  const uint32_t experts = Common().info.num_moe_layers * Common().info.num_experts;
  std::map<uint64_t, uint64_t> request_uses;  // Of the first run.
  for (uint32_t world : {1u, 2u, 3u}) {
    for (const char* policy : {"fmoe", "fmoe-nextuse", "moe-infinity", "speculative", "on-demand",
                               "lru", "lfu", "oracle"}) {
      SCOPED_TRACE("world " + std::to_string(world) + " policy " + policy);
      const double fraction = 0.5;
      GroupRun run = RunGroup(world, policy, fraction, ref.accesses);
      EXPECT_TRUE(run.errors.empty()) << run.errors.front();
      EXPECT_EQ(run.tokens, ref.tokens);
      uint64_t hits = 0, misses = 0, bytes = 0;
      for (uint32_t r = 0; r < world; ++r) {
        const CacheStats& st = run.rank_stats[r];
        const uint32_t owned = experts / world + (r < experts % world ? 1 : 0);
        EXPECT_EQ(st.slots, static_cast<uint32_t>(fraction * owned + 1e-9)) << "rank " << r;
        EXPECT_LE(st.resident, st.slots) << "rank " << r;
        EXPECT_GT(st.total.hits + st.total.misses, 0u) << "rank " << r << " computed nothing";
        if (std::string(policy) == "fmoe") {
          EXPECT_GT(st.directives, 0u) << "rank " << r;
          if (world > 1) {
            EXPECT_GT(st.directives_foreign, 0u) << "rank " << r;
          }
        }
        hits += st.total.hits;
        misses += st.total.misses;
        bytes += st.total.bytes_moved;
        if (world > 1) {
          EXPECT_GT(run.group_stats[r].combines, 0u) << "rank " << r;
          EXPECT_EQ(run.group_stats[r].combines, run.group_stats[0].combines) << "rank " << r;
        }
      }
      // The leader's figures are the group's: every rank's expert uses added up.
      EXPECT_EQ(run.group_figures.hits, hits);
      EXPECT_EQ(run.group_figures.misses, misses);
      EXPECT_EQ(run.group_figures.bytes_moved, bytes);
      // A request's expert uses (hits plus misses) depend on its routing only: the group's sum of
      // the ranks' figures must give what one rank counts alone.
      std::map<uint64_t, uint64_t> uses;
      for (const auto& [id, ev] : run.last_events) uses[id] = ev.expert_hits + ev.expert_misses;
      if (request_uses.empty()) request_uses = uses;
      EXPECT_EQ(uses, request_uses);
    }
  }
}

// An expert one rank cannot read fails, on every rank alike, only the requests whose tokens pick
// it: each ends with an error naming the layer and the expert (and the rank, when it is not the
// leader); the others get the all-resident tokens; the group does not break.
TEST(ExpertParallel, AnUnreadableExpertOnOneRankFailsOnlyTheRequestsThatPickIt) {
  const Reference& ref = AllResident();
  const ModelInfo& info = Common().info;
  for (uint32_t rank : {1u, 0u}) {
    // An expert of this rank that some requests pick and others do not.
    std::optional<ExpertFault> fault;
    std::set<uint64_t> picking;
    for (uint32_t l = 0; l < info.num_moe_layers && !fault; ++l) {
      for (uint32_t j = 0; j < info.num_experts && !fault; ++j) {
        if ((l * info.num_experts + j) % 2 != rank) continue;
        picking.clear();
        for (const auto& [id, used] : ref.used) {
          if (used.count({l, j}) != 0) picking.insert(id);
        }
        if (!picking.empty() && picking.size() < ref.used.size()) fault = ExpertFault{rank, l, j};
      }
    }
    ASSERT_TRUE(fault.has_value()) << "rank " << rank;
    const std::string what = "fault on rank " + std::to_string(rank) + ": expert " +
                             std::to_string(fault->expert) + " of MoE layer " +
                             std::to_string(fault->layer);
    GroupRun run = RunGroup(2, "lru", 0.5, ref.accesses, kModelDir, 0, 0, fault);
    const std::string named = "expert " + std::to_string(fault->expert) + " of MoE layer " +
                              std::to_string(fault->layer) + " could not be read";
    for (const std::string& e : run.errors) {
      EXPECT_NE(e.find(named), std::string::npos) << what << ": " << e;  // No group failure.
    }
    ASSERT_EQ(run.last_events.size(), kPrompts.size()) << what;
    for (const auto& [id, ev] : run.last_events) {
      const std::vector<int32_t>& want = ref.tokens.at(id);
      const std::vector<int32_t>& got = run.tokens[id];
      if (picking.count(id) != 0) {
        EXPECT_EQ(ev.finish, FinishReason::kError) << what << " req " << id;
        EXPECT_NE(ev.error.find(named), std::string::npos) << ev.error;
        if (rank != 0) {
          EXPECT_NE(ev.error.find("on rank 1"), std::string::npos) << ev.error;
        } else {
          EXPECT_NE(ev.error.find("Input/output error"), std::string::npos) << ev.error;
        }
        ASSERT_LE(got.size(), want.size());
        EXPECT_TRUE(std::equal(got.begin(), got.end(), want.begin())) << what << " req " << id;
      } else {
        EXPECT_NE(ev.finish, FinishReason::kError) << what << " req " << id << ": " << ev.error;
        EXPECT_EQ(got, want) << what << " req " << id;
      }
    }
  }
}

// Chunked prefill across a group: the plans carry the prompt chunks (iterations after the first
// with several prompt tokens), the followers run them, and the tokens are the all-resident ones.
// A KV pool too small for every running request: the leader preempts, the other rank is told
// by the plan to restart the request, and the tokens are those of one rank with room to spare.
TEST(ExpertParallel, PreemptionAcrossAGroupGivesTheAllResidentTokens) {
  const Reference& ref = AllResident();
  for (auto [budget, pool] : {std::pair{0u, 96u}, std::pair{5u, 48u}}) {
    GroupRun run = RunGroup(2, "lru", 0.5, ref.accesses, kModelDir, budget, pool);
    EXPECT_TRUE(run.errors.empty()) << run.errors.front();
    EXPECT_EQ(run.tokens, ref.tokens) << "budget " << budget;
    EXPECT_GT(run.preemptions, 0u) << "budget " << budget;
  }
  for (uint32_t r = 0; r < 2; ++r) Weights(2, r).model->ConfigureKv({});
}

TEST(ExpertParallel, PromptChunksAcrossAGroupGiveTheAllResidentTokens) {
  const Reference& ref = AllResident();
  GroupRun run = RunGroup(2, "lru", 0.5, ref.accesses, kModelDir, /*max_batched_tokens=*/5);
  EXPECT_TRUE(run.errors.empty()) << run.errors.front();
  EXPECT_EQ(run.tokens, ref.tokens);
}

// The leader's plan tells every rank which iterations stream their missing experts; each rank
// streams its own through its buffer, in step with the leader, and the tokens are the
// all-resident ones.
TEST(ExpertParallel, StreamedIterationsAcrossAGroupGiveTheAllResidentTokens) {
  const Reference& ref = AllResident();
  GroupRun run = RunGroup(2, "lru", 0.25, ref.accesses, kModelDir, /*max_batched_tokens=*/5,
                          /*kv_tokens=*/0, std::nullopt, StreamMode::kOn);
  EXPECT_TRUE(run.errors.empty()) << run.errors.front();
  EXPECT_EQ(run.tokens, ref.tokens);
  ASSERT_EQ(run.rank_stats.size(), 2u);
  EXPECT_GT(run.rank_stats[0].stream_iterations, 0u);
  EXPECT_EQ(run.rank_stats[1].stream_iterations, run.rank_stats[0].stream_iterations);
}

// One device budget for KV and experts on every rank of a group (the manifest's memory): each
// rank's pool borrows its own cache's pages as the leader's does and gives them back when idle.
// Rank 1's budget is far smaller (3 pages: the pool's own, one to borrow, one expert slot), so
// the group's pool is capped at its 2 pages: the leader, whose own budget (25 pages) would let
// its pool take 22 and keeps 3 for it alone, uses 2 of those and preempts at the cap instead of
// running rank 1 out of blocks, and the tokens are the all-resident ones.
TEST(ExpertParallel, OneDeviceBudgetAcrossAGroupGivesTheAllResidentTokens) {
  const Reference& ref = AllResident();
  const uint32_t experts = Common().info.num_moe_layers * Common().info.num_experts;
  // Rank 0: half of its experts and nine pages (25 pages: a KV floor of 3).
  const double pages = experts / 2 / 2 + 9.5;
  GroupRun run = RunGroup(2, "lru", 0, ref.accesses, kModelDir, 0, 0, std::nullopt,
                          StreamMode::kOff, {pages, 3.5});
  EXPECT_TRUE(run.errors.empty()) << run.errors.front();
  EXPECT_EQ(run.tokens, ref.tokens);
  EXPECT_GT(run.preemptions, 0u);
  ASSERT_EQ(run.kv.size(), 2u);
  EXPECT_EQ(run.kv[0].max_blocks, 2 * 3u);  // Rank 1's 2 pages of 3 blocks.
  EXPECT_EQ(run.kv[1].max_blocks, 2 * 3u);
  EXPECT_EQ(run.kv[0].pages_borrowed, 0u);  // Its own floor holds the cap.
  EXPECT_GT(run.kv[1].pages_borrowed, 0u);
  // The leader reports every rank's split as of the last iteration: each rank's pages (25 and
  // 3) between its pool and its cache, rank 1's pool holding borrowed pages then.
  ASSERT_EQ(run.splits.size(), 2u);
  for (uint32_t r = 0; r < 2; ++r) {
    EXPECT_EQ(run.splits[r].kv_bytes + run.splits[r].expert_bytes,
              run.kv[r].bytes + run.kv[r].expert_bytes)
        << "rank " << r;
  }
  EXPECT_EQ(run.kv[0].bytes + run.kv[0].expert_bytes,
            (run.kv[1].bytes + run.kv[1].expert_bytes) / 3 * 25);
  EXPECT_GT(run.splits[1].kv_bytes, 0u);
  for (uint32_t r = 0; r < 2; ++r) {
    EXPECT_EQ(run.kv[r].pages_returned, run.kv[r].pages_borrowed) << "rank " << r;  // Idle.
    EXPECT_EQ(run.kv[r].used_blocks, 0u) << "rank " << r;
    EXPECT_GT(run.rank_stats[r].total.evictions, 0u) << "rank " << r;
  }
  for (uint32_t r = 0; r < 2; ++r) Weights(2, r).model->ConfigureKv({});
}

// Every family (tests/fixtures/<family>-ref): a group of two ranks at a quarter of the experts
// gives the tokens one rank with every expert resident gives. Qwen2-MoE's and DeepSeek's shared
// experts and dense layers are computed by every rank outside the cache.
class FamilyGroup : public ::testing::TestWithParam<const char*> {};

INSTANTIATE_TEST_SUITE_P(Families, FamilyGroup,
                         ::testing::Values("qwen2-moe-ref", "qwen3-moe-ref", "olmoe-ref",
                                           "deepseek-v2-ref", "deepseek-v3-ref", "phimoe-ref",
                                           "deepseek-v3-fp8-ref", "qwen3-moe-fp8-channel-ref",
                                           "kimi-k2-int4-ref", "mixtral-gptq-ref",
                                           "qwen2-moe-awq-ref", "glm4-moe-ref", "minimax-m2-ref",
                                           "gpt-oss-ref", "gpt-oss-mxfp4-ref"),
                         [](const auto& info) {
                           std::string name = info.param;
                           std::erase(name, '-');
                           return name;
                         });

TEST_P(FamilyGroup, WorldTwoGivesTheAllResidentTokens) {
  const std::string dir = std::string(FMOE_SOURCE_DIR) + "/tests/fixtures/" + GetParam();
  const Reference& ref = AllResident(dir);
  ASSERT_EQ(ref.tokens.size(), kPrompts.size());
  for (const char* policy : {"fmoe", "lru"}) {
    SCOPED_TRACE(std::string("policy ") + policy);
    GroupRun run = RunGroup(2, policy, 0.25, ref.accesses, dir);
    EXPECT_TRUE(run.errors.empty()) << run.errors.front();
    EXPECT_EQ(run.tokens, ref.tokens);
    for (uint32_t r = 0; r < 2; ++r) {
      EXPECT_GT(run.rank_stats[r].total.misses, 0u) << "rank " << r << " never missed";
      EXPECT_GT(run.group_stats[r].combines, 0u) << "rank " << r;
    }
  }
}

// A rank that leaves (its group is destroyed mid-run, as when its process dies) or that stops
// answering (alive but stuck) breaks the group: the leader's engine reports it within the
// collective timeout and stops serving; nothing waits forever.
TEST(ExpertParallel, ARankThatLeavesOrHangsBreaksTheGroupWithinTheTimeout) {
  for (bool hang : {false, true}) {
    SCOPED_TRACE(hang ? "rank 1 hangs" : "rank 1 leaves");
    const ModelInfo& info = Common().info;
    const uint16_t port = FreePort();
    std::mutex mu;
    Status failure;
    std::chrono::steady_clock::time_point failed_at;
    std::atomic<bool> release{false};
    std::thread rank1([&] {
      ExpertGroupOptions g;
      g.group = "test";
      g.rank = 1;
      g.world_size = 2;
      g.rendezvous_host = "127.0.0.1";
      g.rendezvous_port = port;
      g.collective_timeout = std::chrono::milliseconds(1500);
      auto joined = ExpertGroup::Join(g);
      ASSERT_TRUE(joined.ok()) << joined.status().ToString();
      // Follows one plan by hand, then leaves or stops answering.
      std::vector<uint8_t> bytes;
      ASSERT_TRUE((*joined)->Broadcast(&bytes).ok());
      if (hang) {
        while (!release) std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      joined->reset();  // Closes its connections.
    });
    ExpertGroupOptions g;
    g.group = "test";
    g.rank = 0;
    g.world_size = 2;
    g.rendezvous_host = "127.0.0.1";
    g.rendezvous_port = port;
    g.collective_timeout = std::chrono::milliseconds(1500);
    auto joined = ExpertGroup::Join(g);
    ASSERT_TRUE(joined.ok()) << joined.status().ToString();
    RankWeights& w = Weights(2, 0);
    CachedExpertsOptions o;
    o.policy = "lru";
    o.top_k = info.top_k;
    o.rank = 0;
    o.world_size = 2;
    auto cached = CachedExperts::Create(CloneExpertTable(w.table), o);
    ASSERT_TRUE(cached.ok());
    w.model->set_group(joined->get());
    EngineOptions options;
    options.group = joined->get();
    options.keepalive_ms = 50;
    options.on_group_failure = [&](const Status& s) {
      std::lock_guard<std::mutex> lock(mu);
      failure = s;
      failed_at = std::chrono::steady_clock::now();
    };
    std::vector<TokenEvent> events;
    Engine engine(options, *w.model, **cached, Common().tokenizer.get(), nullptr,
                  [&](const TokenEvent& ev) { events.push_back(ev); });
    const auto start = std::chrono::steady_clock::now();
    // Rank 1 follows the first plan, then leaves or stops answering.
    engine.Submit(Requests()[0]);
    engine.Run([&] { return std::chrono::steady_clock::now() - start > std::chrono::seconds(20); });
    const double seconds = std::chrono::duration<double>(failed_at - start).count();
    release = true;
    rank1.join();
    w.model->set_group(nullptr);
    ASSERT_FALSE(failure.ok()) << "the engine never noticed";
    EXPECT_TRUE(engine.group_failed());
    EXPECT_LT(seconds, hang ? 6.0 : 3.0);
    EXPECT_NE(failure.message().find("expert group test: rank 0/2"), std::string::npos)
        << failure.message();
    EXPECT_TRUE((*joined)->failed());
    // Once broken, every collective answers at once with the same error: well inside the
    // 1.5 s collective timeout it would otherwise wait (slack for a loaded machine).
    std::vector<uint8_t> bytes{1, 2, 3};
    const auto t0 = std::chrono::steady_clock::now();
    EXPECT_FALSE((*joined)->Broadcast(&bytes).ok());
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(500));
  }
}

// Liveness: a rank whose counter in rank 0's store stops (here: a rank without the liveness
// thread, joined and then idle, as a rank behind a cut link looks to rank 0) breaks the group
// within the liveness timeout, far inside the collective timeout; ranks that beat run as usual.
TEST(ExpertParallel, ASilentRankBreaksTheGroupWithinTheLivenessTimeout) {
  for (bool silent : {false, true}) {
    SCOPED_TRACE(silent ? "rank 1 silent" : "rank 1 beats");
    const uint16_t port = FreePort();
    auto options = [&](uint32_t rank) {
      ExpertGroupOptions g;
      g.group = "test";
      g.rank = rank;
      g.world_size = 2;
      g.rendezvous_host = "127.0.0.1";
      g.rendezvous_port = port;
      g.collective_timeout = std::chrono::seconds(20);
      g.liveness_interval = std::chrono::milliseconds(50);
      g.liveness_timeout = std::chrono::milliseconds(rank == 1 && silent ? 0 : 500);
      return g;
    };
    std::atomic<bool> release{false};
    Status rank1_status;
    std::thread rank1([&] {
      auto joined = ExpertGroup::Join(options(1));
      ASSERT_TRUE(joined.ok()) << joined.status().ToString();
      at::Tensor t = at::zeros({4, 256});
      for (int i = 0; i < 20 && !silent; ++i) rank1_status = (*joined)->CombineDisjoint(t);
      while (silent && !release) std::this_thread::sleep_for(std::chrono::milliseconds(10));
    });
    auto joined = ExpertGroup::Join(options(0));
    ASSERT_TRUE(joined.ok()) << joined.status().ToString();
    at::Tensor t = at::zeros({4, 256});
    const auto start = std::chrono::steady_clock::now();
    Status s;
    for (int i = 0; i < 20 && s.ok(); ++i) s = (*joined)->CombineDisjoint(t);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    release = true;
    rank1.join();
    if (!silent) {
      EXPECT_TRUE(s.ok()) << s.ToString();
      EXPECT_TRUE(rank1_status.ok()) << rank1_status.ToString();
      continue;
    }
    ASSERT_FALSE(s.ok());
    EXPECT_GE(seconds, 0.45);
    EXPECT_LT(seconds, 5.0) << "the liveness timeout (0.5 s), not the collective timeout (20 s)";
    EXPECT_NE(s.message().find("liveness: rank 1 has not beaten for"), std::string::npos)
        << s.message();
  }
}

TEST(ExpertParallel, JoinNamesTheRendezvousThatNobodyServes) {
  ExpertGroupOptions g;
  g.group = "lonely";
  g.rank = 1;
  g.world_size = 2;
  g.rendezvous_host = "127.0.0.1";
  g.rendezvous_port = FreePort();
  g.rendezvous_timeout = std::chrono::milliseconds(500);
  auto joined = ExpertGroup::Join(g);
  ASSERT_FALSE(joined.ok());
  EXPECT_EQ(joined.status().code(), ErrorCode::kUnavailable);
  EXPECT_NE(joined.status().message().find("rendezvous at 127.0.0.1:"), std::string::npos)
      << joined.status().message();
  EXPECT_NE(joined.status().message().find("is rank 0 running?"), std::string::npos);
}

}  // namespace
}  // namespace fmoe
