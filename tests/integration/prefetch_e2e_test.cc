// End to end with the shipped tiny model and the real processes: a map service and a worker
// whose expert cache holds a quarter of the experts. After the store is warmed on some prompts,
// the fmoe policy, guided by the map service's directives, hits the cache more often on other
// prompts of the same kind than lru does at the same budget, with the same tokens.
#include <signal.h>
#include <sys/wait.h>

#include <chrono>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/json.h"
#include "common/text/tokenizer.h"
#include "common/wire/wire.h"
#include "tests/testing/process_harness.h"

namespace fmoe {
namespace {

using testing::BinDir;
using testing::Child;
using testing::FreeTcpPort;
using Json = nlohmann::json;

const std::string kModelDir = std::string(FMOE_SOURCE_DIR) + "/deploy/models/tiny-moe";

// Two sets of prompts of the same kinds (scripture, definitions, questions, instructions).
const std::vector<std::string> kWarm = {
    "In the beginning God created the heaven and the earth. And the earth was without form,",
    "And the LORD spake unto Moses, saying, Speak unto the children of Israel, and say unto them",
    "Blessed are the poor in spirit: for theirs is the kingdom of heaven. Blessed are they that",
    "Water (n.) The fluid which descends from the clouds in rain, and which forms rivers, lakes",
    "Iron (n.) The most common and most useful metal; a metal of a dark gray color, which is",
    "Light (n.) That agent, force, or action in nature by the operation of which upon the organs",
    "What is the difference between a virus and a bacterium, and how does each make us sick?",
    "Explain how a bill becomes a law in the United States, step by step, for a student.",
    "Write a short poem about the sea at night, with the moon and the sound of the waves.",
    "Give me three tips for learning a new language quickly as an adult with a busy job.",
    "And it came to pass, when men began to multiply on the face of the earth, and daughters",
    "Stone (n.) Concreted earthy or mineral matter; also, any particular mass of such matter;",
};
const std::vector<std::string> kTest = {
    "And God said, Let there be light: and there was light. And God saw the light, that it",
    "The LORD is my shepherd; I shall not want. He maketh me to lie down in green pastures:",
    "Fire (n.) The evolution of light and heat in the combustion of bodies; combustion; state",
    "Tree (n.) Any perennial woody plant of considerable size (usually over twenty feet high)",
    "What causes the seasons on Earth, and why is it summer in one hemisphere and winter in",
    "Write a short story about a lighthouse keeper who finds a message in a bottle one morning.",
};

class PrefetchE2eTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::MakeTempDir("fmoe-prefetch");
    map_port_ = FreeTcpPort();
    auto tok = Tokenizer::Load(kModelDir);
    ASSERT_TRUE(tok.ok()) << tok.status().ToString();
    tokenizer_ = std::move(*tok);
    StartMapService("map.log");
  }
  void TearDown() override {
    if (HasFailure()) {
      std::cerr << "map service log:\n" << map_->Log();
      for (const auto& w : worker_logs_) std::cerr << w << ":\n" << testing::ReadFile(w);
      return;  // The directory stays for a look.
    }
    map_.reset();
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }

  std::string Manifest(const std::string& policy) {
    const std::string path = dir_ + "/" + policy + ".yaml";
    worker_endpoint_ = "tcp://127.0.0.1:" + std::to_string(FreeTcpPort());
    testing::WriteFile(
        path, "model:\n  path: " + kModelDir + "\n  dtype: float32\n" +
                  "map_service:\n  endpoint: tcp://127.0.0.1:" + std::to_string(map_port_) +
                  "\n  data_dir: " + dir_ + "/maps\n  prefetch_distance: 3\n" +
                  "worker_groups:\n  - name: g0\n    max_batch: 1\n    policy: " + policy +
                  "\n    expert_cache_fraction: 0.25\n"
                  "    link:\n      gbps: 20\n      latency_us: 5\n"
                  "    workers:\n      - device: cpu\n"
                  "router:\n  listen: 127.0.0.1:" +
                  std::to_string(FreeTcpPort()) + "\n  worker_endpoint: " + worker_endpoint_ +
                  "\nheartbeat:\n  interval_ms: 100\n  timeout_ms: 2000\n");
    // This test's sockets speak with the processes: with the cluster key.
    std::string error;
    EXPECT_TRUE(testing::UseClusterKeyOf(path, &error)) << error;
    return path;
  }

  struct Figures {
    uint64_t hits = 0, misses = 0;
    std::map<uint64_t, std::vector<int32_t>> tokens;
    double hit_rate() const { return hits + misses ? double(hits) / double(hits + misses) : 0; }
  };

  // Starts a worker with `policy`, runs `prompts` one at a time (calling `before(i)` ahead of
  // prompt i), stops it.
  Figures Run(const std::string& policy, const std::vector<std::string>& prompts, int tokens,
              const std::function<void(size_t)>& before = {}) {
    Figures f;
    const std::string manifest = Manifest(policy);
    wire::Context context;
    auto bound = wire::WorkerSocket::Bind(context, wire::Role::kRouter, worker_endpoint_);
    EXPECT_TRUE(bound.ok());
    if (!bound.ok()) return f;
    auto& socket = *bound;
    const std::string log =
        dir_ + "/worker-" + policy + std::to_string(worker_logs_.size()) + ".log";
    worker_logs_.push_back(log);
    Child worker(
        {BinDir() + "/fmoe-worker", "--manifest", manifest, "--group", "g0", "--rank", "0"}, log);
    std::string peer;
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (peer.empty() && std::chrono::steady_clock::now() < deadline) {
      auto in = socket->Receive(100);
      if (in && std::holds_alternative<WorkerHello>(in->message)) {
        peer = in->peer;
        EXPECT_TRUE(socket->Send(WorkerHelloAck{true, ""}, peer).ok());
      }
    }
    EXPECT_FALSE(peer.empty()) << "no Hello from the worker";
    if (peer.empty()) return f;
    // Let the worker register with the map service before the first request.
    EXPECT_TRUE(testing::WaitUntil(
        [&] {
          return testing::ReadFile(log).find("registered with map service") != std::string::npos;
        },
        20000));
    uint64_t id = 0;
    for (const std::string& text : prompts) {
      if (before) before(id);
      Generate g;
      g.request_id = ++id;
      auto ids = tokenizer_->Encode(text, /*add_special_tokens=*/true);
      EXPECT_TRUE(ids.ok());
      g.token_ids = *ids;
      g.sampling.max_tokens = static_cast<uint32_t>(tokens);
      EXPECT_TRUE(socket->Send(g, peer).ok());
      bool done = false;
      const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(60);
      while (!done && std::chrono::steady_clock::now() < end) {
        auto in = socket->Receive(100);
        if (!in) continue;
        if (const auto* hb = std::get_if<WorkerHeartbeat>(&in->message)) {
          EXPECT_TRUE(socket->Send(WorkerHeartbeatAck{hb->seq, true}, peer).ok());
        } else if (const auto* ev = std::get_if<TokenEvent>(&in->message)) {
          if (ev->token_id >= 0) f.tokens[id].push_back(ev->token_id);
          if (ev->finish != FinishReason::kNone) {
            EXPECT_NE(ev->finish, FinishReason::kError) << ev->error;
            f.hits += ev->expert_hits;
            f.misses += ev->expert_misses;
            done = true;
          }
        }
      }
      EXPECT_TRUE(done) << "request " << id << " did not finish";
    }
    worker.Signal(SIGTERM);
    auto status = worker.Wait(20000);
    EXPECT_TRUE(status && WIFEXITED(*status) && WEXITSTATUS(*status) == 0);
    return f;
  }

  void StartMapService(const std::string& log) {
    map_ = std::make_unique<Child>(
        std::vector<std::string>{BinDir() + "/fmoe-map-service", "--manifest", Manifest("lru")},
        dir_ + "/" + log);
  }

  std::string dir_, worker_endpoint_;
  int map_port_ = 0;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<Child> map_;
  std::vector<std::string> worker_logs_;
};

TEST_F(PrefetchE2eTest, FmoeHitsMoreThanLruAfterWarmingTheStore) {
  constexpr int kTokens = 24;
  // Warm: the worker streams every iteration's context; the service stores the maps.
  Run("lru", kWarm, kTokens);
  ASSERT_FALSE(HasFailure());
  // fmoe first: the test prompts' own maps must not be in the store before it runs them (the
  // lru run stores them too).
  Figures fmoe = Run("fmoe", kTest, kTokens);
  Figures lru = Run("lru", kTest, kTokens);
  ASSERT_FALSE(HasFailure());
  // Losslessness across policies: the same tokens.
  EXPECT_EQ(fmoe.tokens, lru.tokens);
  std::printf("hit rate at 25%% of experts: fmoe %.1f%% (%llu/%llu), lru %.1f%% (%llu/%llu)\n",
              100 * fmoe.hit_rate(), static_cast<unsigned long long>(fmoe.hits),
              static_cast<unsigned long long>(fmoe.hits + fmoe.misses), 100 * lru.hit_rate(),
              static_cast<unsigned long long>(lru.hits),
              static_cast<unsigned long long>(lru.hits + lru.misses));
  EXPECT_GT(lru.hits + lru.misses, 0u);
  EXPECT_GT(fmoe.hit_rate(), lru.hit_rate());
  // The fmoe worker was guided: it received directives.
  const std::string fmoe_log = testing::ReadFile(worker_logs_.back());
  EXPECT_EQ(fmoe_log.find(" 0 directives"), std::string::npos) << fmoe_log;
}

// The map service dies mid-run: the worker keeps serving without guidance (its contexts are
// dropped and counted, never queued behind the dead service), re-registers when the service
// returns with its store intact from disk, and is guided again.
TEST_F(PrefetchE2eTest, WorkerServesThroughAMapServiceRestart) {
  Run("lru", kWarm, 16);
  ASSERT_FALSE(HasFailure());
  Figures f = Run("fmoe", kTest, 16, [&](size_t i) {
    if (i == 2) {
      map_->Signal(SIGKILL);
      map_->Wait(5000);
    } else if (i == 4) {
      const std::string log = worker_logs_.back();
      // The worker notices (no heartbeat answer within the timeout) while serving.
      ASSERT_TRUE(testing::WaitUntil(
          [&] { return testing::ReadFile(log).find("map service lost") != std::string::npos; },
          30000));
      StartMapService("map2.log");
      // Re-registered: the second "registered with map service" line.
      ASSERT_TRUE(testing::WaitUntil(
          [&] {
            const std::string text = testing::ReadFile(log);
            const size_t first = text.find("registered with map service");
            return first != std::string::npos &&
                   text.find("registered with map service", first + 1) != std::string::npos;
          },
          30000));
    }
  });
  ASSERT_FALSE(HasFailure());
  EXPECT_EQ(f.tokens.size(), kTest.size());
  const std::string log = testing::ReadFile(worker_logs_.back());
  // Contexts of the dead period were dropped (refused by the socket, or dropped while the service
  // was marked away), not queued.
  EXPECT_EQ(log.find("0 dropped (map service away), 0 refused by the socket"), std::string::npos)
      << log;
  // The restarted service rebuilt its store from disk and guided the last prompts.
  const std::string map2 = map_->Log();
  EXPECT_EQ(map2.find(": 0 maps loaded"), std::string::npos) << map2;
  EXPECT_NE(map2.find("registered group=g0"), std::string::npos) << map2;
  EXPECT_EQ(log.find(" 0 directives"), std::string::npos) << log;
}

}  // namespace
}  // namespace fmoe
