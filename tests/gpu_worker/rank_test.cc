// The rank assembly (gpu_worker/rank.h) on the shipped tiny model: dtype resolution, what each
// mode builds, the tokens of an offloaded rank against an all-resident one, the compute loop, and
// the errors with the stage that failed.
#include "gpu_worker/rank.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <functional>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace fmoe {
namespace {

const std::string kModelDir = std::string(FMOE_SOURCE_DIR) + "/deploy/models/tiny-moe";

ModelInfo WithTorchDtype(const std::string& dtype) {
  ModelInfo info;
  info.torch_dtype = dtype;
  return info;
}

TEST(ResolveDtype, AutoIsTheCheckpointsHalfDtypeOnCudaAndFloat32Otherwise) {
  EXPECT_EQ(*ResolveDtype("auto", WithTorchDtype("bfloat16"), /*cuda=*/true), "bfloat16");
  EXPECT_EQ(*ResolveDtype("auto", WithTorchDtype("float16"), true), "float16");
  EXPECT_EQ(*ResolveDtype("auto", WithTorchDtype("float32"), true), "float32");
  EXPECT_EQ(*ResolveDtype("auto", WithTorchDtype(""), true), "float32");
  // cpu stays float32 whatever the checkpoint.
  EXPECT_EQ(*ResolveDtype("auto", WithTorchDtype("bfloat16"), /*cuda=*/false), "float32");
  EXPECT_EQ(*ResolveDtype("auto", WithTorchDtype("float16"), false), "float32");
  // Experts left on disk are used as stored: the checkpoint's float dtype on any device.
  EXPECT_EQ(*ResolveDtype("auto", WithTorchDtype("bfloat16"), false, /*experts_on_disk=*/true),
            "bfloat16");
  EXPECT_EQ(*ResolveDtype("auto", WithTorchDtype("float32"), false, true), "float32");
}

TEST(ResolveDtype, AnExplicitDtypeIsKeptAndAnUnknownOneRefused) {
  for (const char* dtype : {"float32", "bfloat16", "float16"}) {
    EXPECT_EQ(*ResolveDtype(dtype, WithTorchDtype("bfloat16"), false), dtype);
    EXPECT_EQ(*ResolveDtype(dtype, WithTorchDtype("float32"), true), dtype);
  }
  auto bad = ResolveDtype("fp8", WithTorchDtype("bfloat16"), true);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(bad.status().message(), "dtype \"fp8\" is not auto, float32, bfloat16 or float16");
}

// Greedy tokens of `prompts`, one request after another, through the rank's engine.
std::vector<std::vector<int32_t>> RunPrompts(Rank& rank, std::vector<std::vector<int32_t>>* sink,
                                             const std::vector<std::string>& prompts) {
  Engine& engine = *rank.engine();
  for (size_t i = 0; i < prompts.size(); ++i) {
    Generate g;
    g.request_id = i + 1;
    g.token_ids = *rank.tokenizer()->Encode(prompts[i], true);
    g.sampling.max_tokens = 12;
    engine.Submit(std::move(g));
    while (engine.Step()) {
    }
  }
  return *sink;
}

RankOptions Options(std::vector<std::vector<int32_t>>* tokens) {
  RankOptions o;
  o.model_dir = kModelDir;
  o.threads = 1;
  o.max_batch = 1;
  o.stop_at_eos = false;
  o.on_token = [tokens](const TokenEvent& ev) {
    if (ev.token_id < 0) return;
    if (tokens->size() < ev.request_id) tokens->resize(ev.request_id);
    (*tokens)[ev.request_id - 1].push_back(ev.token_id);
  };
  return o;
}

TEST(Rank, AllResidentBuildsTheModelTokenizerAndEngine) {
  std::vector<std::vector<int32_t>> tokens;
  RankOptions o = Options(&tokens);
  o.experts = RankExperts::kResident;
  RankStage stage = RankStage::kJoin;
  auto rank = Rank::Assemble(o, &stage);
  ASSERT_TRUE(rank.ok()) << rank.status().message();
  Rank& r = **rank;
  EXPECT_EQ(r.info().dir, std::filesystem::canonical(kModelDir).string());
  EXPECT_EQ(r.info().torch_dtype, "bfloat16");
  EXPECT_EQ(r.dtype(), "float32");  // auto on cpu.
  EXPECT_FALSE(r.device().cuda);
  EXPECT_TRUE(r.leader());
  EXPECT_NE(r.tokenizer(), nullptr);
  EXPECT_NE(r.resident(), nullptr);
  EXPECT_EQ(r.cached(), nullptr);
  EXPECT_EQ(&r.experts(), r.resident());
  EXPECT_NE(r.engine(), nullptr);
  EXPECT_EQ(r.follower(), nullptr);
  EXPECT_EQ(r.recorder(), nullptr);
  EXPECT_EQ(r.group().world_size(), 1u);
  EXPECT_EQ(r.options().model_name, "tiny-moe");
  EXPECT_EQ(r.local_figures().hits, 0u);
  auto out = RunPrompts(r, &tokens, {"In the beginning"});
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0].size(), 12u);
}

TEST(Rank, AnOffloadedRankGivesTheAllResidentTokens) {
  const std::vector<std::string> prompts = {"In the beginning", "The word \"light\" means"};
  std::vector<std::vector<int32_t>> resident_tokens, cached_tokens;
  RankOptions resident = Options(&resident_tokens);
  resident.experts = RankExperts::kResident;
  auto a = Rank::Assemble(resident);
  ASSERT_TRUE(a.ok()) << a.status().message();
  RankOptions cached = Options(&cached_tokens);
  cached.experts = RankExperts::kCached;
  cached.cache.policy = "lru";
  cached.cache.cache_fraction = 0.25;
  cached.cache.link.gbps = 1000;
  auto b = Rank::Assemble(cached);
  ASSERT_TRUE(b.ok()) << b.status().message();
  ASSERT_NE((*b)->cached(), nullptr);
  EXPECT_EQ((*b)->cached()->cache().slots(),
            (*a)->info().num_moe_layers * (*a)->info().num_experts / 4);
  EXPECT_EQ(RunPrompts(**a, &resident_tokens, prompts), RunPrompts(**b, &cached_tokens, prompts));
  EXPECT_GT((*b)->local_figures().misses, 0u);
  EXPECT_EQ((*b)->group_figures().misses, (*b)->local_figures().misses);
}

// expert_cache_gb: auto on cpu sizes the cache from the host's available memory less the KV
// reserve: the tiny model's experts all fit; a reserve larger than any machine's memory is an
// error naming the figures.
TEST(Rank, AnAutoCacheSizesItselfFromFreeMemory) {
  std::vector<std::vector<int32_t>> tokens;
  RankOptions o = Options(&tokens);
  o.experts = RankExperts::kCached;
  o.cache.policy = "lru";
  o.cache.cache_auto = true;
  auto rank = Rank::Assemble(o);
  ASSERT_TRUE(rank.ok()) << rank.status().message();
  const ModelInfo& info = (*rank)->info();
  EXPECT_EQ((*rank)->cached()->cache().slots(), info.num_moe_layers * info.num_experts);
  // The tiny model (8 layers, 4 kv heads of 32, 1024 positions) at max_batch 1 in float32.
  EXPECT_EQ(KvPoolTokens(info, 1, 0), 1024u);
  EXPECT_EQ(KvPoolTokens(info, 8, 0), 8 * 1024u);
  EXPECT_EQ(KvPoolTokens(info, 8, 1000), 1008u);  // Whole 16-position blocks.
  EXPECT_EQ(KvReserveBytes(info, KvPoolTokens(info, 1, 0), 0, "float32"),
            2ull * 8 * 4 * 32 * 4 * 1024);
  EXPECT_EQ(KvReserveBytes(info, KvPoolTokens(info, 8, 0), 0, "bfloat16"),
            8 * 2ull * 8 * 4 * 32 * 2 * 1024);
  // MLA keeps latents, not per-head keys and values: the reserve is what the runtime holds.
  ModelInfo mla = info;
  mla.mla = MlaSpec{};
  mla.mla->kv_lora_rank = 512;
  mla.mla->qk_rope_head_dim = 64;
  EXPECT_EQ(KvReserveBytes(mla, 2048, 2048, "bfloat16"), 2ull * 1024 * (512 + 64) * 8 * 2);
  EXPECT_EQ(KvReserveBytes(mla, 2048, 2048, "bfloat16"), 2ull * 1024 * KvBytesPerToken(mla, 2));
  // A model of 128K positions: the pool holds one whole context or 32K per batch slot.
  ModelInfo long_context = info;
  long_context.max_position_embeddings = 131072;
  EXPECT_EQ(KvPoolTokens(long_context, 1, 0), 131072u);
  EXPECT_EQ(KvPoolTokens(long_context, 8, 0), 8 * 32768u);
  // gpt-oss-style sliding layers keep a window per sequence: with a step budget their blocks
  // are max_batch x (window + 2 blocks) + the budget; without one, the whole pool's.
  ModelInfo sliding = info;
  sliding.sliding_window = 128;
  sliding.sliding_layers = {true, false, true, false, true, false, true, false};
  EXPECT_EQ(KvSlidingPoolTokens(sliding, 8, 512, 8192), 8 * (128 + 32) + 512u);
  EXPECT_EQ(KvSlidingPoolTokens(sliding, 8, 0, 8192), 8192u);
  EXPECT_EQ(KvSlidingPoolTokens(info, 8, 512, 8192), 8192u);  // No sliding layers.
  EXPECT_EQ(KvReserveBytes(sliding, 1024, 160, "float32"),
            (4 * 1024ull + 4 * 160ull) * 2 * 4 * 32 * 4);

  // A utilization that leaves less than one expert:
  std::vector<std::vector<int32_t>> more;
  RankOptions huge = Options(&more);
  huge.experts = RankExperts::kCached;
  huge.cache.policy = "lru";
  huge.cache.cache_auto = true;
  huge.cache.memory_utilization = 1e-9;
  auto refused = Rank::Assemble(huge);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), ErrorCode::kResourceExhausted);
  EXPECT_NE(refused.status().message().find("holds no expert of 393216 bytes"), std::string::npos)
      << refused.status().message();
}

TEST(Rank, NewCachedExpertsCopiesAResidentRanksExperts) {
  RankOptions o;
  o.model_dir = kModelDir;
  o.experts = RankExperts::kResident;
  o.compute = false;
  auto rank = Rank::Assemble(o);
  ASSERT_TRUE(rank.ok()) << rank.status().message();
  EXPECT_EQ((*rank)->engine(), nullptr);
  CachedExpertsOptions c;
  c.policy = "lfu";
  c.cache_fraction = 0.5;
  auto cache = (*rank)->NewCachedExperts(c);
  ASSERT_TRUE(cache.ok()) << cache.status().message();
  EXPECT_EQ((*cache)->cache().slots(),
            (*rank)->info().num_moe_layers * (*rank)->info().num_experts / 2);

  o.experts = RankExperts::kCached;
  auto offloaded = Rank::Assemble(o);
  ASSERT_TRUE(offloaded.ok()) << offloaded.status().message();
  auto refused = (*offloaded)->NewCachedExperts(c);
  EXPECT_EQ(refused.status().code(), ErrorCode::kFailedPrecondition);
}

TEST(Rank, RunComputeServesUntilStopped) {
  std::vector<std::vector<int32_t>> tokens;
  std::atomic<int> finished{0};
  RankOptions o = Options(&tokens);
  o.experts = RankExperts::kResident;
  o.on_token = [&finished](const TokenEvent& ev) {
    if (ev.finish != FinishReason::kNone) ++finished;
  };
  auto rank = Rank::Assemble(o);
  ASSERT_TRUE(rank.ok()) << rank.status().message();
  std::atomic<bool> stop{false};
  std::thread compute(
      [&] { (*rank)->RunCompute([&] { return stop.load(); }, std::chrono::milliseconds(0)); });
  Generate g;
  g.request_id = 7;
  g.token_ids = {1, 2, 3};
  g.sampling.max_tokens = 4;
  (*rank)->engine()->Submit(std::move(g));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (finished == 0 && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  stop = true;
  (*rank)->Wake();
  compute.join();
  EXPECT_EQ(finished, 1);
  EXPECT_FALSE((*rank)->group_failed());
  EXPECT_EQ((*rank)->group_failure(), "");
  EXPECT_EQ((*rank)->engine()->stats().requests_finished, 1u);
  (*rank)->Finish();
}

struct BadCase {
  std::string name;
  std::function<void(RankOptions&)> change;
  RankStage stage;
  std::string message;  // A part of the error.
};

TEST(Rank, ErrorsNameTheCauseAndTheStage) {
  const std::string dir = ::testing::TempDir() + "fmoe-rank-" + std::to_string(::getpid());
  const std::vector<BadCase> cases = {
      {"device", [](RankOptions& o) { o.device = "gpu"; }, RankStage::kOptions,
       "rank: device \"gpu\" is not cpu or cuda:N"},
      {"cuda index", [](RankOptions& o) { o.device = "cuda:x"; }, RankStage::kOptions,
       "rank: device \"cuda:x\" is not cpu or cuda:N"},
      {"dtype", [](RankOptions& o) { o.dtype = "fp8"; }, RankStage::kOptions,
       "dtype \"fp8\" is not auto, float32, bfloat16 or float16"},
      {"rank",
       [](RankOptions& o) {
         o.rank = 2;
         o.world_size = 2;
       },
       RankStage::kOptions, "rank: rank 2 of a group of 2 does not exist"},
      {"resident group",
       [](RankOptions& o) {
         o.experts = RankExperts::kResident;
         o.world_size = 2;
       },
       RankStage::kOptions, "every expert resident needs a group of one rank"},
      {"rendezvous", [](RankOptions& o) { o.world_size = 2; }, RankStage::kOptions,
       "rank: group local of 2 ranks has no rendezvous address"},
      {"model dir", [](RankOptions& o) { o.model_dir = "/nonexistent/model"; }, RankStage::kLoad,
       "model: /nonexistent/model: no such directory"},
      {"policy", [](RankOptions& o) { o.cache.policy = "belady"; }, RankStage::kLoad,
       "unknown policy \"belady\""},
      {"trace", [&dir](RankOptions& o) { o.record_trace = dir + "/no/such/dir/t.trc"; },
       RankStage::kTrace, "cannot write the trace: " + dir + "/no/such/dir/t.trc"},
  };
  for (const BadCase& c : cases) {
    RankOptions o;
    o.model_dir = kModelDir;
    c.change(o);
    RankStage stage = RankStage::kJoin;
    auto rank = Rank::Assemble(o, &stage);
    ASSERT_FALSE(rank.ok()) << c.name;
    EXPECT_EQ(stage, c.stage) << c.name;
    EXPECT_NE(rank.status().message().find(c.message), std::string::npos)
        << c.name << ": " << rank.status().message();
  }
}

TEST(Rank, ARankWhosePeersNeverComeFailsToJoin) {
  RankOptions o;
  o.model_dir = kModelDir;
  o.rank = 1;
  o.world_size = 2;
  o.rendezvous_host = "127.0.0.1";
  o.rendezvous_port = 1;  // Nobody serves the store there.
  o.rendezvous_timeout = std::chrono::milliseconds(500);
  RankStage stage = RankStage::kOptions;
  auto rank = Rank::Assemble(o, &stage);
  ASSERT_FALSE(rank.ok());
  EXPECT_EQ(stage, RankStage::kJoin);
  EXPECT_EQ(rank.status().code(), ErrorCode::kUnavailable) << rank.status().message();
}

}  // namespace
}  // namespace fmoe
