// Losslessness (DESIGN section 3): with the shipped tiny model, every policy at budgets from 10%
// to 100% of the experts, over the emulated link, generates exactly the tokens the all-resident
// run generates for the same prompts, batch and seeds; the budget holds and the cache's
// invariants hold after every iteration.
#include "gpu_worker/experts/cached_experts.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/model/model_config.h"
#include "common/text/tokenizer.h"
#include "gpu_worker/engine/engine.h"
#include "gpu_worker/model/model.h"
#include "tests/testing/fake_map_service.h"
#include "tests/testing/model_fixture.h"

namespace fmoe {
namespace {

using testing::kPrompts;
using testing::Tokens;
using Loaded = testing::LoadedModel;

const std::string kModelDir = testing::TinyModelDir();

// The model in `dir` (default: the shipped tiny model; the family tests use the fixtures).
Loaded& Fixture(const std::string& dir = kModelDir) { return testing::SharedModel(dir); }

Tokens RunPrompts(ExpertSource& source, ForwardObserver* observer,
                  const std::function<void()>& after_step = {},
                  const std::string& dir = kModelDir) {
  return testing::RunPrompts(Fixture(dir), source, observer, after_step);
}

struct Reference {
  Tokens tokens;
  std::vector<LayerAccess> accesses;
};

const Reference& AllResident(const std::string& dir = kModelDir) {
  static auto* refs = new std::map<std::string, std::unique_ptr<Reference>>();
  auto& r = (*refs)[dir];
  if (!r) {
    r = std::make_unique<Reference>();
    ResidentExperts resident(CloneExpertTable(Fixture(dir).table));
    RecordingExperts recording(resident);
    r->tokens = RunPrompts(recording, nullptr, {}, dir);
    r->accesses = recording.accesses();
  }
  return *r;
}

// Every family (tests/fixtures/<family>-ref), and a checkpoint in each quantized format (its
// experts cached and moved in their stored bytes): every policy at a quarter of the experts gives
// the all-resident tokens (Qwen2-MoE's and DeepSeek's shared experts and dense layers stay outside
// the cache).
class FamilyOffload : public ::testing::TestWithParam<const char*> {};

INSTANTIATE_TEST_SUITE_P(Families, FamilyOffload,
                         ::testing::Values("mixtral-ref", "qwen2-moe-ref", "qwen3-moe-ref",
                                           "olmoe-ref", "deepseek-v2-ref", "deepseek-v3-ref",
                                           "phimoe-ref", "deepseek-v3-fp8-ref",
                                           "qwen3-moe-fp8-channel-ref", "kimi-k2-int4-ref",
                                           "mixtral-gptq-ref", "qwen2-moe-awq-ref", "glm4-moe-ref",
                                           "minimax-m2-ref", "gpt-oss-ref", "gpt-oss-mxfp4-ref"),
                         [](const auto& info) {
                           std::string name = info.param;
                           std::erase(name, '-');
                           return name;
                         });

// `policy` at a quarter of the experts of the fixture in `dir`, prefetching 2 layers ahead; the
// link is the caller's.
CachedExpertsOptions AtAQuarter(const std::string& dir, const char* policy) {
  CachedExpertsOptions o;
  o.policy = policy;
  o.top_k = Fixture(dir).info.top_k;
  o.cache_fraction = 0.25;
  o.policy_options.prefetch_distance = 2;
  o.policy_options.future = AllResident(dir).accesses;
  return o;
}

// Runs the prompts through experts cached as `o` says, with directives from a fake map service
// and the cache's invariants checked after every iteration; the tokens and the cache's figures.
std::pair<Tokens, CacheStats> RunCached(const std::string& dir, const CachedExpertsOptions& o) {
  auto cached = CachedExperts::Create(CloneExpertTable(Fixture(dir).table), o);
  EXPECT_TRUE(cached.ok()) << cached.status().ToString();
  if (!cached.ok()) return {};
  CachedExperts& c = **cached;
  testing::FakeMapService directives(&c, Fixture(dir).info.num_moe_layers);
  Tokens got = RunPrompts(
      c, &directives, [&] { ASSERT_TRUE(c.cache().CheckInvariants().ok()) << o.policy; }, dir);
  return {std::move(got), c.stats()};
}

// Streams every iteration's missing experts (ExpertSource::StreamNextIteration before each
// Forward), as an engine with prefill_stream: on does for its prompts.
class StreamEveryIteration final : public ExpertSource {
 public:
  explicit StreamEveryIteration(CachedExperts& inner) : inner_(inner) {}
  void BeginIteration(std::span<const SequenceInfo> sequences) override {
    EXPECT_TRUE(inner_.StreamNextIteration());
    inner_.BeginIteration(sequences);
  }
  uint32_t speculation_distance() const override { return inner_.speculation_distance(); }
  void Speculate(uint32_t layer, uint32_t target, std::span<const float> probs) override {
    inner_.Speculate(layer, target, probs);
  }
  Status BeginLayer(const LayerRouting& routing) override { return inner_.BeginLayer(routing); }
  Result<SourcedExpert> Next() override { return inner_.Next(); }
  void Done(uint32_t expert) override { inner_.Done(expert); }
  bool HostRunsPlanned() const override { return inner_.HostRunsPlanned(); }
  void EndLayer() override { inner_.EndLayer(); }
  void EndIteration() override { inner_.EndIteration(); }
  void OnRequestEnd(uint64_t request_id) override { inner_.OnRequestEnd(request_id); }
  RequestUsage Usage(uint64_t request_id) const override { return inner_.Usage(request_id); }

 private:
  CachedExperts& inner_;
};

// Streamed through a buffer smaller than a layer's experts and one of two layers, every
// iteration of every family (and quantized format) gives the all-resident tokens: the stream
// slots hold an expert's stored bytes as the cache's slots do, and nothing is evicted.
TEST_P(FamilyOffload, StreamedIterationsGiveTheAllResidentTokens) {
  const std::string dir = std::string(FMOE_SOURCE_DIR) + "/tests/fixtures/" + GetParam();
  const Reference& ref = AllResident(dir);
  const ModelInfo& info = Fixture(dir).info;
  for (const char* policy : {"fmoe", "lru"}) {
    for (uint32_t stream_slots : {3u, 2 * info.num_experts}) {
      CachedExpertsOptions o = AtAQuarter(dir, policy);
      o.link.gbps = 8;
      o.link.latency_us = 10;
      o.stream_slots = stream_slots;
      o.hybrid = true;  // Off in a streamed iteration.
      auto cached = CachedExperts::Create(CloneExpertTable(Fixture(dir).table), o);
      ASSERT_TRUE(cached.ok()) << cached.status().ToString();
      CachedExperts& c = **cached;
      StreamEveryIteration streamed(c);
      testing::FakeMapService directives(&c, info.num_moe_layers);
      const Tokens got = RunPrompts(
          streamed, &directives,
          [&] { ASSERT_TRUE(c.cache().CheckInvariants().ok()) << policy << " " << stream_slots; },
          dir);
      EXPECT_EQ(got, ref.tokens) << policy << " stream_slots " << stream_slots;
      const CacheStats st = c.stats();
      EXPECT_GT(st.stream_iterations, 0u);
      EXPECT_EQ(st.total.evictions, 0u);
      EXPECT_EQ(st.total.host_runs, 0u);
      EXPECT_GE(st.total.stream_loads, st.total.misses);
      EXPECT_EQ(st.stream_slots, stream_slots);
    }
  }
}

TEST_P(FamilyOffload, EveryPolicyAtAQuarterGivesTheAllResidentTokens) {
  const std::string dir = std::string(FMOE_SOURCE_DIR) + "/tests/fixtures/" + GetParam();
  const Reference& ref = AllResident(dir);
  ASSERT_EQ(ref.tokens.size(), kPrompts.size());
  const ModelInfo& info = Fixture(dir).info;
  for (const char* policy : {"fmoe", "fmoe-nextuse", "moe-infinity", "speculative", "on-demand",
                             "lru", "lfu", "oracle"}) {
    CachedExpertsOptions o = AtAQuarter(dir, policy);
    o.link.gbps = 8;
    o.link.latency_us = 10;
    const auto [got, st] = RunCached(dir, o);
    EXPECT_EQ(got, ref.tokens) << "policy " << policy;
    EXPECT_EQ(st.slots, info.num_moe_layers * info.num_experts / 4) << policy;
    EXPECT_GT(st.total.misses, 0u) << policy;
    if (info.quant.quantized()) {
      // The native bytes, padded to 64 per stored tensor: fewer than the float experts'.
      EXPECT_GE(st.expert_bytes, RoutedExpertBytes(info)) << policy;
      EXPECT_LT(st.expert_bytes, RoutedExpertParams(info) * 2) << policy;
    }
  }
}

// Hybrid execution on every family: with a link slow enough that the host wins some
// experts, every policy at a quarter still gives the all-resident tokens, greedy and seeded:
// in cpu mode a host run computes the same function from the host copy.
TEST_P(FamilyOffload, HybridEveryPolicyAtAQuarterGivesTheAllResidentTokens) {
  const std::string dir = std::string(FMOE_SOURCE_DIR) + "/tests/fixtures/" + GetParam();
  const Reference& ref = AllResident(dir);
  ASSERT_EQ(ref.tokens.size(), kPrompts.size());
  for (const char* policy : {"fmoe", "fmoe-nextuse", "moe-infinity", "speculative", "on-demand",
                             "lru", "lfu", "oracle"}) {
    CachedExpertsOptions o = AtAQuarter(dir, policy);
    o.link.gbps = 0.5;
    o.link.latency_us = 200;
    o.hybrid = true;
    o.host_slowdown = 2;
    const auto [got, st] = RunCached(dir, o);
    EXPECT_EQ(got, ref.tokens) << "policy " << policy;
    EXPECT_GT(st.total.host_runs, 0u) << policy;
    EXPECT_GT(st.total.host_ns, 0) << policy;
    EXPECT_EQ(st.total.bytes_not_moved, st.total.host_runs * st.expert_bytes) << policy;
    EXPECT_LE(st.total.host_runs, st.total.misses) << policy;
  }
}

TEST(CachedExperts, EveryPolicyAndBudgetGivesTheAllResidentTokens) {
  const Reference& ref = AllResident();
  ASSERT_EQ(ref.tokens.size(), kPrompts.size());
  const uint32_t layers = Fixture().info.num_moe_layers;
  for (const char* policy : {"fmoe", "fmoe-nextuse", "moe-infinity", "speculative", "on-demand",
                             "lru", "lfu", "oracle"}) {
    for (double fraction : {0.1, 0.25, 0.5, 1.0}) {
      CachedExpertsOptions o;
      o.policy = policy;
      o.top_k = Fixture().info.top_k;
      o.cache_fraction = fraction;
      o.policy_options.prefetch_distance = 2;
      o.policy_options.future = ref.accesses;
      o.link.gbps = 8;  // An expert (393 KB in fp32) takes ~60 us: prefetches overlap compute.
      o.link.latency_us = 10;
      auto cached = CachedExperts::Create(CloneExpertTable(Fixture().table), o);
      ASSERT_TRUE(cached.ok()) << cached.status().ToString();
      CachedExperts& c = **cached;
      testing::FakeMapService directives(&c, layers);
      bool invariants = true;
      const Tokens got = RunPrompts(c, &directives, [&] {
        Status s = c.cache().CheckInvariants();
        if (!s.ok() && invariants) {
          ADD_FAILURE() << policy << " " << fraction << ": " << s.ToString();
          invariants = false;
        }
      });
      EXPECT_EQ(got, ref.tokens) << "policy " << policy << " budget " << fraction;
      const CacheStats st = c.stats();
      EXPECT_LE(st.resident, st.slots);
      EXPECT_EQ(st.slots, static_cast<uint32_t>(fraction * 64 + 1e-9)) << policy;
      if (fraction < 1.0) {
        EXPECT_GT(st.total.misses, 0u) << policy << " " << fraction;
        EXPECT_GT(st.total.bytes_moved, 0u) << policy << " " << fraction;
      } else {
        EXPECT_EQ(st.total.misses, 0u) << policy;  // Preloaded: every expert resident.
      }
      if (std::string(policy) == "fmoe" && fraction < 1.0) {
        EXPECT_GT(st.directives, 0u);
        EXPECT_GT(st.total.prefetches_issued, 0u);
      }
      if (std::string(policy) == "speculative" && fraction < 1.0) {
        EXPECT_GT(st.total.prefetches_issued, 0u);
      }
    }
  }
}

// A stream buffer beside a budget that holds every expert would never be used: none is made.
TEST(CachedExperts, AFullBudgetGetsNoStreamBuffer) {
  for (double fraction : {1.0, 0.5}) {
    CachedExpertsOptions o;
    o.policy = "lru";
    o.top_k = Fixture().info.top_k;
    o.cache_fraction = fraction;
    o.stream_slots = 16;
    auto cached = CachedExperts::Create(CloneExpertTable(Fixture().table), o);
    ASSERT_TRUE(cached.ok()) << cached.status().ToString();
    EXPECT_EQ((*cached)->stats().stream_slots, fraction < 1.0 ? 16u : 0u) << fraction;
    EXPECT_EQ((*cached)->StreamNextIteration(), fraction < 1.0) << fraction;
  }
}

TEST(CachedExperts, RequestFiguresReachTheTokenEvents) {
  CachedExpertsOptions o;
  o.policy = "lru";
  o.top_k = Fixture().info.top_k;
  o.cache_fraction = 0.25;
  auto cached = CachedExperts::Create(CloneExpertTable(Fixture().table), o);
  ASSERT_TRUE(cached.ok()) << cached.status().ToString();
  Loaded& f = Fixture();
  std::map<uint64_t, TokenEvent> last;
  Engine engine(EngineOptions{}, *f.model, **cached, f.tokenizer.get(), nullptr,
                [&](const TokenEvent& ev) { last[ev.request_id] = ev; });
  Generate g;
  g.request_id = 9;
  g.token_ids = *f.tokenizer->Encode(kPrompts[0], true);
  g.sampling.max_tokens = 8;
  engine.Submit(std::move(g));
  for (int step = 0; step < 50 && engine.Step(); ++step) {
  }
  const TokenEvent& ev = last[9];
  EXPECT_GT(ev.expert_hits + ev.expert_misses, 0u);
  EXPECT_GT(ev.expert_misses, 0u);
  EXPECT_EQ(ev.bytes_moved % (*cached)->stats().expert_bytes, 0u);
  EXPECT_GT(ev.bytes_moved, 0u);
}

// The split follows the measured rates: a slow link and a host as fast as the compute send
// many missing experts to the host; a fast link and a host 1000x slower send almost none: the
// probes that measure the host, one per power-of-two bucket of token counts (a batch here has
// under 128 rows, so at most 7) and one per kReprobeAfter loads in a bucket. Both runs give the
// all-resident tokens.
TEST(CachedExperts, HybridSplitFollowsTheMeasuredRates) {
  const Reference& ref = AllResident();
  auto run = [&](double gbps, double slowdown) {
    CachedExpertsOptions o;
    o.policy = "lru";
    o.top_k = Fixture().info.top_k;
    o.cache_fraction = 0.25;
    o.link.gbps = gbps;
    o.link.latency_us = 10;
    o.hybrid = true;
    o.host_slowdown = slowdown;
    auto cached = CachedExperts::Create(CloneExpertTable(Fixture().table), o);
    EXPECT_TRUE(cached.ok()) << cached.status().ToString();
    EXPECT_EQ(RunPrompts(**cached, nullptr), ref.tokens) << gbps << " " << slowdown;
    return (*cached)->stats().total;
  };
  const CacheCounters slow_link = run(0.2, 1.0);
  const CacheCounters slow_host = run(32, 1000);
  EXPECT_GT(slow_link.host_runs, slow_link.misses / 4);
  EXPECT_LE(slow_host.host_runs, 7 + slow_host.misses / HostTimeModel::kReprobeAfter);
  EXPECT_GT(slow_link.host_runs, 3 * slow_host.host_runs)
      << slow_link.host_runs << " " << slow_host.host_runs;
  EXPECT_LT(slow_link.bytes_moved, slow_host.bytes_moved);
}

TEST(CachedExperts, HybridFiguresReachTheRequest) {
  CachedExpertsOptions o;
  o.policy = "lru";
  o.top_k = Fixture().info.top_k;
  o.cache_fraction = 0.25;
  o.link.gbps = 0.2;
  o.hybrid = true;
  auto cached = CachedExperts::Create(CloneExpertTable(Fixture().table), o);
  ASSERT_TRUE(cached.ok()) << cached.status().ToString();
  Loaded& f = Fixture();
  Engine engine(EngineOptions{}, *f.model, **cached, f.tokenizer.get(), nullptr,
                [&](const TokenEvent&) {});
  Generate g;
  g.request_id = 9;
  g.token_ids = *f.tokenizer->Encode(kPrompts[0], true);
  g.sampling.max_tokens = 30;
  engine.Submit(std::move(g));
  for (int step = 0; step < 6; ++step) ASSERT_TRUE(engine.Step());
  // One request, still running: it has every host run and all their time.
  const RequestUsage usage = (*cached)->Usage(9);
  const CacheCounters t = (*cached)->stats().total;
  EXPECT_GT(usage.host_runs, 0u);
  EXPECT_EQ(usage.host_runs, t.host_runs);
  EXPECT_EQ(usage.bytes_not_moved, t.bytes_not_moved);
  EXPECT_GT(usage.host_ns, t.host_ns / 2);
  EXPECT_LE(usage.host_ns, t.host_ns);
}

TEST(CachedExperts, RejectsABadHostSlowdown) {
  CachedExpertsOptions o;
  o.policy = "lru";
  o.top_k = Fixture().info.top_k;
  o.hybrid = true;
  for (double bad : {0.5, -1.0, std::numeric_limits<double>::infinity()}) {
    o.host_slowdown = bad;
    auto cached = CachedExperts::Create(CloneExpertTable(Fixture().table), o);
    ASSERT_FALSE(cached.ok());
    EXPECT_NE(cached.status().message().find("host_slowdown"), std::string::npos);
  }
}

TEST(CachedExperts, RejectsABudgetThatHoldsNoExpert) {
  CachedExpertsOptions o;
  o.policy = "lru";
  o.top_k = 2;
  o.cache_gb = 1e-6;  // 1 KB.
  auto cached = CachedExperts::Create(CloneExpertTable(Fixture().table), o);
  ASSERT_FALSE(cached.ok());
  EXPECT_NE(cached.status().message().find("holds no expert"), std::string::npos);
  o.cache_gb.reset();
  o.policy = "clairvoyant";
  cached = CachedExperts::Create(CloneExpertTable(Fixture().table), o);
  ASSERT_FALSE(cached.ok());
  EXPECT_NE(cached.status().message().find("unknown policy"), std::string::npos);
}

// ---- The host tier (DESIGN section 13): experts left in the checkpoint's files ----

// The tiny model in bfloat16 (its experts' stored dtype: the host tier reads them as stored),
// loaded into memory or left on disk; from `dir` (default: the shipped one).
std::unique_ptr<Loaded> LoadBf16(bool on_disk, const std::string& dir = kModelDir) {
  RuntimeOptions r;
  r.dtype = "bfloat16";
  r.experts_on_disk = on_disk;
  return testing::LoadModel(dir, r);
}

Loaded& SharedBf16(bool on_disk) {
  static auto* models = new std::unique_ptr<Loaded>[2];
  auto& m = models[on_disk ? 1 : 0];
  if (!m) m = LoadBf16(on_disk);
  if (!m) std::abort();
  return *m;
}

const Tokens& Bf16Reference() {
  static const Tokens* ref = [] {
    ResidentExperts resident(CloneExpertTable(SharedBf16(false).table));
    return new Tokens(testing::RunPrompts(SharedBf16(false), resident, nullptr, {}));
  }();
  return *ref;
}

TEST(HostTierExperts, TheLoaderReadsNoExpertAndRecordsWhereEachOneIs) {
  const Loaded& m = SharedBf16(true);
  size_t experts = 0;
  for (const auto& layer : m.table) {
    for (const ExpertWeights& w : layer) {
      ASSERT_NE(w.disk, nullptr);
      ASSERT_TRUE(w.w1.is_meta());
      ASSERT_EQ(w.disk->size(), 3u);
      EXPECT_EQ((*w.disk)[0].bytes, static_cast<uint64_t>(w.w1.numel()) * 2);
      EXPECT_NE((*w.disk)[0].tensor.find("experts"), std::string::npos);
      ++experts;
    }
  }
  EXPECT_EQ(experts, 64u);
  // Every expert resident needs them in memory: refused by name.
  auto resident = ResidentExperts::Create(CloneExpertTable(m.table), -1);
  EXPECT_FALSE(resident.ok());
  // A float32 run would convert the stored bfloat16: refused, naming the tensor and the way out.
  RuntimeOptions r;
  r.experts_on_disk = true;
  auto info = LoadModelInfo(kModelDir);
  ASSERT_TRUE(info.ok());
  ExpertTable table;
  auto f32 = MoeModel::Load(*info, r, {}, &table);
  ASSERT_FALSE(f32.ok());
  EXPECT_NE(f32.status().message().find("host_cache_gb"), std::string::npos)
      << f32.status().ToString();
}

// Losslessness with three tiers: every policy, host budgets from one expert to all of them, two
// device budgets: the all-resident tokens, the invariants of both caches after every step.
TEST(HostTierExperts, EveryPolicyAndBothBudgetsGiveTheAllResidentTokens) {
  const Tokens& ref = Bf16Reference();
  ASSERT_EQ(ref.size(), kPrompts.size());
  Loaded& m = SharedBf16(true);
  for (const char* policy : {"fmoe", "moe-infinity", "lru", "lfu", "on-demand", "speculative"}) {
    for (double host : {0.02, 0.25, 1.0}) {  // 0.02 of 64: one expert.
      for (double device : {0.1, 0.5}) {
        CachedExpertsOptions o;
        o.policy = policy;
        o.top_k = m.info.top_k;
        o.cache_fraction = device;
        o.host_cache_fraction = host;
        o.policy_options.prefetch_distance = 2;
        o.link.gbps = 8;
        o.link.latency_us = 10;
        o.disk.backend = "threads";
        auto cached = CachedExperts::Create(CloneExpertTable(m.table), o);
        ASSERT_TRUE(cached.ok()) << cached.status().ToString();
        CachedExperts& c = **cached;
        testing::FakeMapService directives(&c, m.info.num_moe_layers);
        const std::string what = std::string(policy) + " host " + std::to_string(host) +
                                 " device " + std::to_string(device);
        const Tokens got = testing::RunPrompts(m, c, &directives, [&] {
          Status s = c.cache().CheckInvariants();
          ASSERT_TRUE(s.ok()) << what << ": " << s.ToString();
        });
        EXPECT_EQ(got, ref) << what;
        const std::optional<HostTierStats> t = c.host_tier_stats();
        ASSERT_TRUE(t.has_value());
        EXPECT_EQ(t->slots, std::max<uint32_t>(1, static_cast<uint32_t>(host * 64 + 1e-9)));
        EXPECT_GT(t->reads, 0u) << what;
        EXPECT_EQ(t->read_errors, 0u) << what;
        const CacheStats st = c.stats();
        EXPECT_LE(st.total.disk_reads, st.total.misses) << what;
        if (host < 0.5) {
          EXPECT_GT(st.total.disk_reads, 0u) << what;
        }
        if (host < 1.0) {
          EXPECT_GT(t->evictions, 0u) << what;
        }
        EXPECT_LE(t->resident, t->slots);
      }
    }
  }
}

// Hybrid execution reads a missing expert into host memory and runs it there.
// Streamed iterations read their experts through the host tier as the cache's loads do, down to
// a host cache of one expert, and give the all-resident tokens.
TEST(HostTierExperts, StreamedIterationsGiveTheAllResidentTokens) {
  const Tokens& ref = Bf16Reference();
  Loaded& m = SharedBf16(true);
  for (double host : {0.02, 0.25}) {
    CachedExpertsOptions o;
    o.policy = "fmoe";
    o.top_k = m.info.top_k;
    o.cache_fraction = 0.25;
    o.host_cache_fraction = host;
    o.policy_options.prefetch_distance = 2;
    o.link.gbps = 8;
    o.link.latency_us = 10;
    o.disk.backend = "threads";
    o.stream_slots = 2 * m.info.num_experts;
    auto cached = CachedExperts::Create(CloneExpertTable(m.table), o);
    ASSERT_TRUE(cached.ok()) << cached.status().ToString();
    CachedExperts& c = **cached;
    StreamEveryIteration streamed(c);
    testing::FakeMapService directives(&c, m.info.num_moe_layers);
    const Tokens got = testing::RunPrompts(m, streamed, &directives, [&] {
      Status s = c.cache().CheckInvariants();
      ASSERT_TRUE(s.ok()) << host << ": " << s.ToString();
    });
    EXPECT_EQ(got, ref) << "host " << host;
    EXPECT_GT(c.stats().stream_iterations, 0u);
    EXPECT_GT(c.host_tier_stats()->reads, 0u);
    EXPECT_EQ(c.host_tier_stats()->read_errors, 0u);
  }
}

TEST(HostTierExperts, HybridRunsExpertsFromTheHostTier) {
  Loaded& m = SharedBf16(true);
  CachedExpertsOptions o;
  o.policy = "lru";
  o.top_k = m.info.top_k;
  o.cache_fraction = 0.1;
  o.host_cache_fraction = 0.25;
  o.link.gbps = 0.5;
  o.link.latency_us = 200;
  o.hybrid = true;
  o.host_slowdown = 2;
  auto cached = CachedExperts::Create(CloneExpertTable(m.table), o);
  ASSERT_TRUE(cached.ok()) << cached.status().ToString();
  CachedExperts& c = **cached;
  const Tokens got = testing::RunPrompts(m, c, nullptr, {});
  EXPECT_EQ(got, Bf16Reference());
  EXPECT_GT(c.stats().total.host_runs, 0u);
}

// A quantized checkpoint's experts are read in their stored bytes, and gpt-oss's fused experts
// (float and MXFP4) as their parts of each layer's tensors.
TEST(HostTierExperts, QuantizedAndFusedExpertsReadAsStoredGiveTheAllResidentTokens) {
  for (const char* family :
       {"deepseek-v3-fp8-ref", "kimi-k2-int4-ref", "gpt-oss-ref", "gpt-oss-mxfp4-ref"}) {
    const std::string dir = std::string(FMOE_SOURCE_DIR) + "/tests/fixtures/" + family;
    const Reference& ref = AllResident(dir);
    RuntimeOptions r;
    r.experts_on_disk = true;
    std::unique_ptr<Loaded> m = testing::LoadModel(dir, r);
    ASSERT_NE(m, nullptr) << family;
    // Hybrid execution computes some experts from their host slots.
    for (bool hybrid : {false, true}) {
      CachedExpertsOptions o = AtAQuarter(dir, "fmoe");
      o.host_cache_fraction = 0.25;
      o.link.gbps = hybrid ? 0.5 : 8;
      o.hybrid = hybrid;
      o.host_slowdown = 2;
      auto cached = CachedExperts::Create(CloneExpertTable(m->table), o);
      ASSERT_TRUE(cached.ok()) << cached.status().ToString();
      CachedExperts& c = **cached;
      testing::FakeMapService directives(&c, m->info.num_moe_layers);
      EXPECT_EQ(testing::RunPrompts(*m, c, &directives, {}), ref.tokens)
          << family << (hybrid ? " hybrid" : "");
      EXPECT_GT(c.host_tier_stats()->reads, 0u);
      EXPECT_EQ(c.host_tier_stats()->read_errors, 0u);
      if (hybrid) {
        EXPECT_GT(c.stats().total.host_runs, 0u) << family;
      }
    }
  }
}

// gpt-oss's fused experts left on disk: each expert's tensors are meta tensors of the shapes the
// in-memory load slices out, gate and up name the same region of the fused tensor (its e-th
// of J), and a float checkpoint computed in another dtype is refused naming the tensor.
TEST(HostTierExperts, FusedExpertsAreTheirPartsOfEachLayersTensor) {
  const std::string dir = std::string(FMOE_SOURCE_DIR) + "/tests/fixtures/gpt-oss-mxfp4-ref";
  RuntimeOptions r;
  r.experts_on_disk = true;
  std::unique_ptr<Loaded> m = testing::LoadModel(dir, r);
  ASSERT_NE(m, nullptr);
  const Loaded& resident = Fixture(dir);
  for (size_t l = 0; l < m->table.size(); ++l) {
    for (size_t e = 0; e < m->table[l].size(); ++e) {
      const ExpertWeights& w = m->table[l][e];
      const ExpertWeights& in_memory = resident.table[l][e];
      ASSERT_NE(w.disk, nullptr);
      const auto tensors = w.Tensors();
      const auto want = in_memory.Tensors();
      ASSERT_EQ(tensors.size(), want.size());
      ASSERT_EQ(w.disk->size(), tensors.size());
      for (size_t i = 0; i < tensors.size(); ++i) {
        EXPECT_TRUE(tensors[i]->is_meta());
        EXPECT_EQ(tensors[i]->sizes(), want[i]->sizes()) << i;
        EXPECT_EQ(tensors[i]->scalar_type(), want[i]->scalar_type()) << i;
      }
      // w1 (gate) and w3 (up): parts 0 and 1 of the expert's rows of gate_up_proj_blocks.
      const DiskExtent& gate = (*w.disk)[0];
      const DiskExtent& up = (*w.disk)[3];
      EXPECT_NE(gate.tensor.find("gate_up_proj_blocks"), std::string::npos) << gate.tensor;
      EXPECT_EQ(gate.offset, up.offset);
      EXPECT_EQ(gate.bytes, up.bytes);
      EXPECT_EQ(gate.bytes, 2 * static_cast<uint64_t>(w.w1.numel()));
      EXPECT_EQ(gate.ways, 2u);
      EXPECT_EQ(gate.part, 0u);
      EXPECT_EQ(up.part, 1u);
      EXPECT_EQ((*w.disk)[6].ways, 0u);  // w2: down_proj_blocks as stored.
      if (e > 0) {
        EXPECT_EQ(gate.offset, (*m->table[l][e - 1].disk)[0].offset + gate.bytes);
      }
    }
  }
  // Stored in float32, computed in bfloat16: a conversion the host tier does not make.
  RuntimeOptions bf16;
  bf16.experts_on_disk = true;
  bf16.dtype = "bfloat16";
  const std::string float_dir = std::string(FMOE_SOURCE_DIR) + "/tests/fixtures/gpt-oss-ref";
  auto info = LoadModelInfo(float_dir);
  ASSERT_TRUE(info.ok());
  ExpertTable table;
  auto refused = MoeModel::Load(*info, bf16, {}, &table);
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("gate_up_proj"), std::string::npos)
      << refused.status().ToString();
  EXPECT_NE(refused.status().message().find("host_cache_gb"), std::string::npos);
}

// A checkpoint cut short while serving: the requests that needed an unreadable expert end with
// an error naming the file and the tensor, the process goes on, and once the file is whole again
// the same prompts give the all-resident tokens.
TEST(HostTierExperts, AFileCutShortFailsTheRequestsThatNeedItAndServingGoesOn) {
  namespace fs = std::filesystem;
  const fs::path dir =
      fs::path(::testing::TempDir()) / ("tiny-moe-cut-" + std::to_string(getpid()));
  fs::remove_all(dir);
  fs::copy(kModelDir, dir, fs::copy_options::recursive);
  const fs::path weights = dir / "model.safetensors";
  const std::string whole =
      (fs::path(::testing::TempDir()) / "tiny-moe-whole.safetensors").string();
  fs::copy_file(weights, whole, fs::copy_options::overwrite_existing);
  std::unique_ptr<Loaded> m = LoadBf16(true, dir.string());
  ASSERT_NE(m, nullptr);
  CachedExpertsOptions o;
  o.policy = "lru";
  o.top_k = m->info.top_k;
  o.cache_fraction = 0.1;
  o.host_cache_fraction = 0.02;  // One expert: nearly every use reads.
  o.disk.backend = "threads";
  auto cached = CachedExperts::Create(CloneExpertTable(m->table), o);
  ASSERT_TRUE(cached.ok()) << cached.status().ToString();
  CachedExperts& c = **cached;
  // Cut the file just past the dense weights' end: most experts are beyond it.
  uint64_t first_expert = fs::file_size(weights);
  for (const auto& layer : m->table) {
    for (const ExpertWeights& w : layer) first_expert = std::min(first_expert, (*w.disk)[0].offset);
  }
  fs::resize_file(weights, first_expert + 100);
  std::vector<TokenEvent> errors;
  size_t finished = 0;
  {
    EngineOptions e;
    e.max_batch = 2;
    Engine engine(e, *m->model, c, m->tokenizer.get(), nullptr, [&](const TokenEvent& ev) {
      if (ev.finish == FinishReason::kError) errors.push_back(ev);
      if (ev.finish != FinishReason::kNone) ++finished;
    });
    for (Generate& g : testing::PromptRequests(*m->tokenizer, false)) engine.Submit(std::move(g));
    for (int step = 0; step < 200 && engine.Step(); ++step) {
    }
  }
  EXPECT_EQ(finished, kPrompts.size());
  ASSERT_FALSE(errors.empty());
  EXPECT_NE(errors[0].error.find(weights.string()), std::string::npos) << errors[0].error;
  EXPECT_NE(errors[0].error.find("experts"), std::string::npos) << errors[0].error;
  EXPECT_GT(c.host_tier_stats()->read_errors, 0u);
  // Whole again: served as before, by the same cache.
  fs::copy_file(whole, weights, fs::copy_options::overwrite_existing);
  const Tokens got = testing::RunPrompts(*m, c, nullptr, {});
  EXPECT_EQ(got, Bf16Reference());
  fs::remove_all(dir);
  fs::remove(whole);
}

// Fault injection for the host tier (CachedExpertsOptions::wrap_disk_reader): while armed,
// every read overlapping one expert's stored tensors fails with an I/O error; the other reads go
// to the real reader.
struct ReadFaults {
  std::atomic<bool> armed{true};
  std::vector<DiskExtent> extents;  // The unreadable expert's.
  std::atomic<int> failed{0};       // Reads failed so far.
};

class FailingReader final : public DiskReader {
 public:
  FailingReader(std::unique_ptr<DiskReader> inner, std::shared_ptr<ReadFaults> faults)
      : inner_(std::move(inner)), faults_(std::move(faults)) {}
  std::string_view backend() const override { return inner_->backend(); }
  Result<uint32_t> AddFile(const std::string& path) override {
    Result<uint32_t> file = inner_->AddFile(path);
    if (file.ok()) paths_[*file] = path;
    return file;
  }
  bool direct(uint32_t file) const override { return inner_->direct(file); }
  void Submit(uint64_t id, uint32_t file, uint64_t offset, size_t bytes, void* dst, bool urgent,
              std::function<void()> then) override {
    if (faults_->armed && Unreadable(file, offset, bytes)) {
      ReadDone d;
      d.id = id;
      d.status = IoError(paths_[file] + ": bytes [" + std::to_string(offset) + ", " +
                         std::to_string(offset + bytes) + "): pread: Input/output error");
      failed_.push_back(std::move(d));
      ++faults_->failed;
      return;
    }
    inner_->Submit(id, file, offset, bytes, dst, urgent, std::move(then));
  }
  size_t Poll(std::vector<ReadDone>* out) override { return TakeFailed(out) + inner_->Poll(out); }
  size_t Wait(std::vector<ReadDone>* out, std::chrono::milliseconds timeout) override {
    const size_t n = TakeFailed(out);
    return n > 0 ? n + inner_->Poll(out) : inner_->Wait(out, timeout);
  }
  size_t pending() const override { return inner_->pending() + failed_.size(); }
  DiskReaderStats stats() const override { return inner_->stats(); }

 private:
  bool Unreadable(uint32_t file, uint64_t offset, size_t bytes) {
    for (const DiskExtent& x : faults_->extents) {
      if (x.path == paths_[file] && offset < x.offset + x.bytes && x.offset < offset + bytes) {
        return true;
      }
    }
    return false;
  }
  size_t TakeFailed(std::vector<ReadDone>* out) {
    const size_t n = failed_.size();
    out->insert(out->end(), failed_.begin(), failed_.end());
    failed_.clear();
    return n;
  }
  std::unique_ptr<DiskReader> inner_;
  std::shared_ptr<ReadFaults> faults_;
  std::map<uint32_t, std::string> paths_;
  std::vector<ReadDone> failed_;
};

// Records the experts each request's tokens picked, per MoE layer.
class RoutingRecorder final : public ForwardObserver {
 public:
  void OnLayerRouting(uint64_t request_id, uint32_t, uint32_t layer,
                      std::span<const uint32_t> experts, std::span<const uint32_t>) override {
    for (uint32_t e : experts) used[request_id].insert({layer, e});
  }
  std::map<uint64_t, std::set<std::pair<uint32_t, uint32_t>>> used;
};

struct Served {
  std::vector<int32_t> tokens;
  FinishReason finish = FinishReason::kNone;
  std::string error;
};

// Runs `requests` through an engine over `source`, all in one batch, to the end.
std::map<uint64_t, Served> Serve(Loaded& m, ExpertSource& source, std::vector<Generate> requests,
                                 ForwardObserver* observer = nullptr) {
  std::map<uint64_t, Served> out;
  EngineOptions e;
  e.max_batch = static_cast<uint32_t>(requests.size());
  Engine engine(e, *m.model, source, m.tokenizer.get(), observer, [&](const TokenEvent& ev) {
    Served& s = out[ev.request_id];
    if (ev.token_id >= 0) s.tokens.push_back(ev.token_id);
    if (ev.finish != FinishReason::kNone) {
      s.finish = ev.finish;
      s.error = ev.error;
    }
  });
  for (Generate& g : requests) engine.Submit(std::move(g));
  for (int step = 0; step < 200 && engine.Step(); ++step) {
  }
  return out;
}

// One unreadable expert behind the host tier: of two requests in one batch, the one whose tokens
// pick it ends with an error naming the layer, the expert and the read's error (after one retry
// of the read); the other gets the all-resident tokens exactly. A later request that does not
// pick it is served, and once the expert reads again it loads again and its request is served.
// The prompts, their all-resident outcomes, and an expert (layer, expert) that request `a` picks
// and request `b` never does.
struct BadExpertCase {
  std::vector<Generate> prompts;
  std::map<uint64_t, Served> ref;
  uint64_t a = 0, b = 0;
  std::pair<uint32_t, uint32_t> bad;
};

BadExpertCase PickBadExpert() {
  BadExpertCase k;
  k.prompts = testing::PromptRequests(*SharedBf16(false).tokenizer, false);
  ResidentExperts resident(CloneExpertTable(SharedBf16(false).table));
  RoutingRecorder routing;
  k.ref = Serve(SharedBf16(false), resident, k.prompts, &routing);
  EXPECT_EQ(k.ref.size(), k.prompts.size());
  for (const auto& [i, used_i] : routing.used) {
    for (const auto& [j, used_j] : routing.used) {
      if (k.a != 0 || i == j) continue;
      for (const auto& x : used_i) {
        if (used_j.count(x) == 0) {
          k.a = i, k.b = j, k.bad = x;
          break;
        }
      }
    }
  }
  return k;
}

TEST(HostTierExperts, AnUnreadableExpertFailsOnlyTheRequestsThatPickIt) {
  BadExpertCase k = PickBadExpert();
  ASSERT_NE(k.a, 0u) << "every request picks every expert";
  std::vector<Generate>& prompts = k.prompts;
  std::map<uint64_t, Served>& ref = k.ref;
  const uint64_t a = k.a, b = k.b;
  const std::pair<uint32_t, uint32_t> bad = k.bad;
  Loaded& m = SharedBf16(true);
  auto faults = std::make_shared<ReadFaults>();
  faults->extents = *m.table[bad.first][bad.second].disk;
  CachedExpertsOptions o;
  o.policy = "lru";
  o.top_k = m.info.top_k;
  o.cache_fraction = 0.1;
  o.host_cache_fraction = 0.1;
  o.preload = false;  // The unreadable expert is read when first picked.
  o.disk.backend = "threads";
  o.wrap_disk_reader = [faults](std::unique_ptr<DiskReader> inner) -> std::unique_ptr<DiskReader> {
    return std::make_unique<FailingReader>(std::move(inner), faults);
  };
  auto cached = CachedExperts::Create(CloneExpertTable(m.table), o);
  ASSERT_TRUE(cached.ok()) << cached.status().ToString();
  CachedExperts& c = **cached;
  const std::string what = "layer " + std::to_string(bad.first) + " expert " +
                           std::to_string(bad.second) + ", req " + std::to_string(a) +
                           " picks it, req " + std::to_string(b) + " does not";
  std::map<uint64_t, Served> got = Serve(m, c, {prompts[a - 1], prompts[b - 1]});
  EXPECT_EQ(got[a].finish, FinishReason::kError) << what;
  EXPECT_NE(got[a].error.find("expert " + std::to_string(bad.second) + " of MoE layer " +
                              std::to_string(bad.first) + " could not be read"),
            std::string::npos)
      << got[a].error;
  EXPECT_NE(got[a].error.find(faults->extents[0].path), std::string::npos) << got[a].error;
  EXPECT_NE(got[a].error.find("Input/output error"), std::string::npos) << got[a].error;
  // What it generated before the failing step is what it generates all-resident.
  ASSERT_LE(got[a].tokens.size(), ref[a].tokens.size());
  EXPECT_TRUE(std::equal(got[a].tokens.begin(), got[a].tokens.end(), ref[a].tokens.begin()));
  EXPECT_NE(got[b].finish, FinishReason::kError) << got[b].error;
  EXPECT_EQ(got[b].tokens, ref[b].tokens) << what;
  EXPECT_GT(faults->failed, 0);
  EXPECT_GE(c.host_tier_stats()->read_errors, 2u);  // The read and its retry.
  const CacheStats failed_stats = c.stats();
  EXPECT_GE(failed_stats.total.failed_loads, 2u);
  EXPECT_EQ(failed_stats.total.failed_experts, 1u);
  EXPECT_TRUE(c.cache().CheckInvariants().ok()) << c.cache().CheckInvariants().ToString();
  // A later request that does not pick it is served.
  Generate again = prompts[b - 1];
  again.request_id = 100;
  got = Serve(m, c, {again});
  EXPECT_EQ(got[100].tokens, ref[b].tokens);
  // Readable again: the expert loads, and its request gets the all-resident tokens.
  faults->armed = false;
  Generate retried = prompts[a - 1];
  retried.request_id = 101;
  got = Serve(m, c, {retried});
  EXPECT_NE(got[101].finish, FinishReason::kError) << got[101].error;
  EXPECT_EQ(got[101].tokens, ref[a].tokens);
  EXPECT_EQ(c.stats().total.failed_experts, 1u);
  EXPECT_TRUE(c.cache().CheckInvariants().ok()) << c.cache().CheckInvariants().ToString();
}

// The disk reads a request's misses needed reach its token events (usage.fmoe_experts).
TEST(HostTierExperts, DiskReadsReachTheTokenEvents) {
  Loaded& m = SharedBf16(true);
  CachedExpertsOptions o;
  o.policy = "lru";
  o.top_k = m.info.top_k;
  o.cache_fraction = 0.1;
  o.host_cache_fraction = 0.1;
  auto cached = CachedExperts::Create(CloneExpertTable(m.table), o);
  ASSERT_TRUE(cached.ok()) << cached.status().ToString();
  std::map<uint64_t, TokenEvent> last;
  Engine engine(EngineOptions{}, *m.model, **cached, m.tokenizer.get(), nullptr,
                [&](const TokenEvent& ev) { last[ev.request_id] = ev; });
  Generate g;
  g.request_id = 9;
  g.token_ids = *m.tokenizer->Encode(kPrompts[0], true);
  g.sampling.max_tokens = 8;
  engine.Submit(std::move(g));
  for (int step = 0; step < 50 && engine.Step(); ++step) {
  }
  const TokenEvent& ev = last[9];
  EXPECT_GT(ev.expert_disk_reads, 0u);
  EXPECT_LE(ev.expert_disk_reads, ev.expert_misses);
  const CacheStats st = (*cached)->stats();
  EXPECT_GE(st.total.disk_reads, ev.expert_disk_reads);
  EXPECT_GT(st.total.disk_stall_ns, 0);
  EXPECT_LE(st.total.disk_stall_ns, st.total.stall_ns);
}

// host_cache_gb: auto: every expert when they fit in the available memory less the reserve
// (the tiny model's 64 do here), else what fits, at least one.
TEST(HostTierExperts, AnAutoHostCacheTakesWhatTheAvailableMemoryHolds) {
  Loaded& m = SharedBf16(true);
  CachedExpertsOptions o;
  o.policy = "lru";
  o.top_k = m.info.top_k;
  o.cache_fraction = 0.25;
  o.host_cache_auto = true;
  auto all = CachedExperts::Create(CloneExpertTable(m.table), o);
  ASSERT_TRUE(all.ok()) << all.status().ToString();
  EXPECT_EQ((*all)->host_tier_stats()->slots, 64u);
  o.host_reserve_bytes = uint64_t{1} << 62;  // More than any host has: one slot still.
  auto one = CachedExperts::Create(CloneExpertTable(m.table), o);
  ASSERT_TRUE(one.ok()) << one.status().ToString();
  EXPECT_EQ((*one)->host_tier_stats()->slots, 1u);
  EXPECT_EQ(testing::RunPrompts(m, **one, nullptr, {}), Bf16Reference());
}

TEST(HostTierExperts, AHostBudgetWithExpertsInMemoryIsRefused) {
  CachedExpertsOptions o;
  o.policy = "lru";
  o.top_k = Fixture().info.top_k;
  o.host_cache_fraction = 0.5;
  auto cached = CachedExperts::Create(CloneExpertTable(Fixture().table), o);
  ASSERT_FALSE(cached.ok());
  EXPECT_NE(cached.status().message().find("left on disk"), std::string::npos);
}

}  // namespace
}  // namespace fmoe
