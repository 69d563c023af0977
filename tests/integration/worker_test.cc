// The real fmoe-worker process serving the reference checkpoint (tests/fixtures/mixtral-ref):
// this test binds the router's worker socket itself, accepts the leader's Hello, sends Generate
// and Cancel over ZeroMQ and checks the streamed TokenEvents against the greedy continuations
// that Hugging Face transformers produced. Also: cancellation, a bad request failing alone, and
// SIGTERM stopping the worker with exit code 0.
#include <signal.h>
#include <sys/wait.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/json.h"
#include "common/wire/wire.h"
#include "tests/testing/process_harness.h"

namespace fmoe {
namespace {

using testing::BinDir;
using testing::Child;
using testing::FreeTcpPort;
using Json = nlohmann::json;

const std::string kRefDir = std::string(FMOE_SOURCE_DIR) + "/tests/fixtures/mixtral-ref";
constexpr int32_t kEos = 2;  // The fixture's config.json eos_token_id.

struct Stream {
  std::vector<int32_t> tokens;
  FinishReason finish = FinishReason::kNone;
  std::string error;
  uint64_t queue_us = 0;
};

class WorkerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::MakeTempDir("fmoe-worker");
    const int map_port = FreeTcpPort(), worker_port = FreeTcpPort();
    endpoint_ = "tcp://127.0.0.1:" + std::to_string(worker_port);
    manifest_ = dir_ + "/manifest.yaml";
    testing::WriteFile(
        manifest_, "model:\n  path: " + kRefDir + "\nmap_service:\n  endpoint: tcp://127.0.0.1:" +
                       std::to_string(map_port) + "\n  data_dir: " + dir_ +
                       "/maps\nworker_groups:\n  - name: g0\n    max_batch: 3\n"
                       "    workers:\n      - device: cpu\n"
                       "router:\n  listen: 127.0.0.1:" +
                       std::to_string(FreeTcpPort()) + "\n  worker_endpoint: " + endpoint_ +
                       "\nheartbeat:\n  interval_ms: 100\n"
                       "  timeout_ms: 1000\n");
    // This test's socket poses as the router: with the cluster key.
    std::string error;
    ASSERT_TRUE(testing::UseClusterKeyOf(manifest_, &error)) << error;
    context_ = std::make_unique<wire::Context>();
    auto bound = wire::WorkerSocket::Bind(*context_, wire::Role::kRouter, endpoint_);
    ASSERT_TRUE(bound.ok()) << bound.status().ToString();
    socket_ = std::move(*bound);
    map_ = std::make_unique<Child>(
        std::vector<std::string>{BinDir() + "/fmoe-map-service", "--manifest", manifest_},
        dir_ + "/map.log");
    worker_ =
        std::make_unique<Child>(std::vector<std::string>{BinDir() + "/fmoe-worker", "--manifest",
                                                         manifest_, "--group", "g0", "--rank", "0"},
                                dir_ + "/worker.log");
    // The leader says Hello once the model is loaded; accept it.
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
    while (peer_.empty() && std::chrono::steady_clock::now() < deadline) {
      auto in = socket_->Receive(100);
      if (in && std::holds_alternative<WorkerHello>(in->message)) {
        peer_ = in->peer;
        ASSERT_TRUE(socket_->Send(WorkerHelloAck{true, ""}, peer_).ok());
      }
    }
    ASSERT_FALSE(peer_.empty()) << "no Hello from the worker; log:\n" << worker_->Log();
  }

  void TearDown() override {
    if (HasFailure()) {
      if (worker_) std::cerr << "worker log:\n" << worker_->Log();
      return;  // The directory stays for a look.
    }
    worker_.reset();
    map_.reset();
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }

  void Send(const WorkerMessage& message) { ASSERT_TRUE(socket_->Send(message, peer_).ok()); }

  // Receives until every id in `ids` has finished (or the deadline); answers heartbeats.
  void Collect(const std::vector<uint64_t>& ids, int timeout_ms = 180000,
               uint64_t cancel_after_first = 0) {
    auto done = [&] {
      return std::all_of(ids.begin(), ids.end(), [&](uint64_t id) {
        return streams_.count(id) && streams_[id].finish != FinishReason::kNone;
      });
    };
    auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
    while (!done() && std::chrono::steady_clock::now() < deadline) {
      auto in = socket_->Receive(100);
      if (!in) continue;
      if (const auto* hb = std::get_if<WorkerHeartbeat>(&in->message)) {
        Send(WorkerHeartbeatAck{hb->seq, true});
      } else if (const auto* ev = std::get_if<TokenEvent>(&in->message)) {
        Stream& s = streams_[ev->request_id];
        if (ev->token_id >= 0) {
          EXPECT_EQ(ev->index, s.tokens.size());
          s.tokens.push_back(ev->token_id);
          if (s.tokens.size() == 1) s.queue_us = ev->queue_us;
          if (ev->request_id == cancel_after_first && s.tokens.size() == 1) {
            Send(Cancel{ev->request_id});
          }
        }
        if (ev->finish != FinishReason::kNone) {
          s.finish = ev->finish;
          s.error = ev->error;
        }
      }
    }
  }

  std::string dir_, endpoint_, manifest_, peer_;
  std::unique_ptr<wire::Context> context_;
  std::unique_ptr<wire::WorkerSocket> socket_;
  std::unique_ptr<Child> map_, worker_;
  std::map<uint64_t, Stream> streams_;
};

Json Reference() {
  std::ifstream in(kRefDir + "/reference.json");
  std::stringstream ss;
  ss << in.rdbuf();
  return Json::parse(ss.str());
}

TEST_F(WorkerTest, StreamsTheReferenceContinuationsAndStopsCleanly) {
  const Json ref = Reference();
  std::vector<uint64_t> ids;
  std::map<uint64_t, std::vector<int32_t>> expected;
  uint64_t id = 100;
  for (const Json& p : ref["prompts"]) {
    Generate g;
    g.request_id = ++id;
    g.token_ids = p["ids"].get<std::vector<int32_t>>();
    g.sampling.max_tokens = 16;
    Send(g);
    ids.push_back(id);
    // The worker stops at the model's eos (transformers was told not to): the expected stream
    // is the reference continuation up to it.
    std::vector<int32_t> want = p["generated_ids"].get<std::vector<int32_t>>();
    want.erase(std::find(want.begin(), want.end(), kEos), want.end());
    expected[id] = want;
  }
  Collect(ids);
  for (uint64_t r : ids) {
    const Stream& s = streams_[r];
    EXPECT_EQ(s.tokens, expected[r]) << "req " << r;
    EXPECT_EQ(s.finish, expected[r].size() == 16 ? FinishReason::kLength : FinishReason::kStop)
        << "req " << r << " " << s.error;
  }
  // A long request cancelled after its first token ends cancelled (its greedy continuation has
  // no eos in 250 tokens, checked with transformers); a bad one fails alone.
  Generate long_one;
  long_one.request_id = 7;
  long_one.token_ids = {1, 40, 41, 42};
  long_one.sampling.max_tokens = 250;
  Send(long_one);
  Generate bad;
  bad.request_id = 8;
  bad.token_ids = {1, 100000};
  Send(bad);
  Collect({7, 8}, 60000, /*cancel_after_first=*/7);
  EXPECT_EQ(streams_[7].finish, FinishReason::kCancelled);
  EXPECT_LT(streams_[7].tokens.size(), 250u);
  EXPECT_EQ(streams_[8].finish, FinishReason::kError);
  EXPECT_EQ(streams_[8].error, "req=8: prompt token 1 (100000) is not in the vocabulary of 512");

  worker_->Signal(SIGTERM);
  auto status = worker_->Wait(20000);
  ASSERT_TRUE(status.has_value());
  EXPECT_TRUE(WIFEXITED(*status) && WEXITSTATUS(*status) == 0) << *status;
}

}  // namespace
}  // namespace fmoe
