// The router binary with its peers played by the test: a group leader over ZeroMQ (with the
// cluster key), and the real map service started and killed around it.
//  - A Hello that does not match what the manifest says the group serves (another model
//    fingerprint, another world size) is refused, logged and counted; the group's leader stays
//    and its request in flight completes.
//  - Without the map service the router serves on, and /health says "degraded" (200) with the
//    map service "down"; once the service answers, "ok"; when it is killed, "degraded" again.
#include <signal.h>
#include <sys/wait.h>

#include <atomic>
#include <filesystem>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "common/json.h"
#include "common/model/model_config.h"
#include "common/wire/wire.h"
#include "tests/testing/http_call.h"
#include "tests/testing/process_harness.h"

namespace fmoe {
namespace {

using testing::BinDir;
using testing::Child;
using testing::FreeTcpPort;
using testing::ReadFile;
using testing::WaitUntil;
using Json = nlohmann::json;

constexpr uint32_t kHeldTokens = 77;  // The leader holds requests for this many tokens.

// A group leader: says Hello with the served model's fingerprint, heartbeats, answers every
// Generate at once except those for kHeldTokens, which it holds until Release.
class Leader {
 public:
  Leader(const std::string& endpoint, uint64_t fingerprint) {
    wire::SocketOptions o;
    o.routing_id = "w/g0/0";
    auto socket = wire::WorkerSocket::Connect(context_, wire::Role::kDealer, endpoint, o);
    EXPECT_TRUE(socket.ok()) << socket.status().ToString();
    if (socket.ok()) socket_ = std::move(socket).value();
    hello_.group = "g0";
    hello_.model_name = "tiny-moe";
    hello_.model_fingerprint = fingerprint;
    hello_.instance_id = 0x1111;
    hello_.max_batch = 4;
    hello_.free_slots = 4;
    thread_ = std::thread([this] { Loop(); });
  }
  ~Leader() {
    stop_ = true;
    thread_.join();
  }
  bool accepted() const { return accepted_; }
  size_t held() const {
    std::lock_guard<std::mutex> lock(mu_);
    return held_.size();
  }
  void Release() { release_ = true; }

 private:
  void Loop() {
    auto last = std::chrono::steady_clock::now() - std::chrono::seconds(1);
    uint64_t seq = 0;
    while (!stop_ && socket_) {
      if (std::chrono::steady_clock::now() - last > std::chrono::milliseconds(100)) {
        last = std::chrono::steady_clock::now();
        if (accepted_) {
          WorkerHeartbeat hb;
          hb.group = "g0";
          hb.instance_id = hello_.instance_id;
          hb.seq = ++seq;
          hb.free_slots = 4;
          (void)socket_->Send(hb);
        } else {
          (void)socket_->Send(hello_);
        }
      }
      if (release_) {
        std::vector<uint64_t> ids;
        {
          std::lock_guard<std::mutex> lock(mu_);
          ids.swap(held_);
        }
        for (uint64_t id : ids) Answer(id);
      }
      auto in = socket_->Receive(5);
      if (!in) continue;
      if (const auto* ack = std::get_if<WorkerHelloAck>(&in->message)) {
        accepted_ = ack->accepted;
      } else if (const auto* g = std::get_if<Generate>(&in->message)) {
        if (g->sampling.max_tokens == kHeldTokens && !release_) {
          std::lock_guard<std::mutex> lock(mu_);
          held_.push_back(g->request_id);
        } else {
          Answer(g->request_id);
        }
      } else if (const auto* c = std::get_if<Cancel>(&in->message)) {
        TokenEvent ev;
        ev.request_id = c->request_id;
        ev.finish = FinishReason::kCancelled;
        (void)socket_->Send(ev);
      }
    }
  }
  void Answer(uint64_t id) {
    TokenEvent ev;
    ev.request_id = id;
    ev.token_id = 300;
    (void)socket_->Send(ev);
    ev.token_id = -1;
    ev.finish = FinishReason::kLength;
    (void)socket_->Send(ev);
  }

  wire::Context context_;
  std::unique_ptr<wire::WorkerSocket> socket_;
  WorkerHello hello_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> accepted_{false};
  std::atomic<bool> release_{false};
  mutable std::mutex mu_;
  std::vector<uint64_t> held_;  // GUARDED_BY(mu_)
  std::thread thread_;
};

// One Hello from a fresh DEALER under `routing_id`; the router's answer.
std::optional<WorkerHelloAck> Hello(const std::string& endpoint, const std::string& routing_id,
                                    const WorkerHello& hello) {
  wire::Context context;
  wire::SocketOptions o;
  o.routing_id = routing_id;
  auto socket = wire::WorkerSocket::Connect(context, wire::Role::kDealer, endpoint, o);
  if (!socket.ok() || !(*socket)->Send(hello).ok()) return std::nullopt;
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (std::chrono::steady_clock::now() < end) {
    auto in = (*socket)->Receive(50);
    if (in && std::holds_alternative<WorkerHelloAck>(in->message)) {
      return std::get<WorkerHelloAck>(in->message);
    }
  }
  return std::nullopt;
}

class RouterPeersTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::MakeTempDir("fmoe-router-peers");
    http_ = FreeTcpPort();
    map_port_ = FreeTcpPort();
    worker_endpoint_ = "tcp://127.0.0.1:" + std::to_string(FreeTcpPort());
    manifest_ = dir_ + "/manifest.yaml";
    testing::WriteFile(manifest_,
                       "model:\n  name: tiny-moe\n  path: " + std::string(FMOE_SOURCE_DIR) +
                           "/deploy/models/tiny-moe\n"
                           "map_service:\n  endpoint: tcp://127.0.0.1:" +
                           std::to_string(map_port_) + "\n  data_dir: " + dir_ +
                           "/maps\n"
                           "worker_groups:\n  - name: g0\n    workers:\n"
                           "      - device: cpu\n"
                           "router:\n  listen: 127.0.0.1:" +
                           std::to_string(http_) + "\n  worker_endpoint: " + worker_endpoint_ +
                           "\nheartbeat:\n  interval_ms: 100\n  timeout_ms: 1500\n"
                           "launcher:\n  run_dir: " +
                           dir_ + "/run\n");
    std::string error;
    ASSERT_TRUE(testing::UseClusterKeyOf(manifest_, &error)) << error;
    auto model = LoadModelInfo(FMOE_SOURCE_DIR "/deploy/models/tiny-moe");
    ASSERT_TRUE(model.ok()) << model.status().ToString();
    fingerprint_ = model->fingerprint;
    router_ = std::make_unique<Child>(
        std::vector<std::string>{BinDir() + "/fmoe-router", "--manifest", manifest_},
        dir_ + "/router.log");
    ASSERT_TRUE(WaitUntil([&] { return Health().is_object(); }, 30000)) << RouterLog();
  }
  void TearDown() override {
    if (HasFailure()) std::cerr << RouterLog();
    router_.reset();
    std::error_code ec;
    if (!HasFailure()) std::filesystem::remove_all(dir_, ec);
  }

  Json Health() const {
    auto r = testing::HttpCall(http_, "GET", "/health");
    return r.status == 0 ? Json() : Json::parse(r.body, nullptr, false);
  }
  std::string RouterLog() const { return ReadFile(dir_ + "/router.log"); }
  std::string Metrics() const { return testing::HttpCall(http_, "GET", "/metrics").body; }
  int Complete() const {
    return testing::HttpCall(http_, "POST", "/v1/completions",
                             Json{{"model", "tiny-moe"}, {"prompt", "x"}, {"max_tokens", 2}}.dump())
        .status;
  }

  std::string dir_, manifest_, worker_endpoint_;
  int http_ = 0, map_port_ = 0;
  uint64_t fingerprint_ = 0;
  std::unique_ptr<Child> router_;
};

TEST_F(RouterPeersTest, AHelloForAnotherModelOrWorldSizeIsRefusedAndTheLeaderStays) {
  Leader leader(worker_endpoint_, fingerprint_);
  ASSERT_TRUE(WaitUntil([&] { return leader.accepted(); }, 30000));
  ASSERT_TRUE(WaitUntil([&] { return Health()["groups"][0]["alive"] == true; }, 30000));
  const Json before = Health()["groups"][0];
  EXPECT_EQ(before["model_fingerprint"], FingerprintHex(fingerprint_));
  // A request in flight on the leader.
  testing::AsyncCall held(
      http_, "POST", "/v1/completions",
      Json{{"model", "tiny-moe"}, {"prompt", "x"}, {"max_tokens", kHeldTokens}, {"stream", true}}
          .dump());
  ASSERT_TRUE(WaitUntil([&] { return leader.held() == 1; }, 30000));

  // Another process's Hello: same group and model name, another fingerprint.
  WorkerHello forged;
  forged.group = "g0";
  forged.model_name = "tiny-moe";
  forged.model_fingerprint = fingerprint_ ^ 0x5a5a;
  forged.instance_id = 0x2222;
  forged.max_batch = 4;
  auto ack = Hello(worker_endpoint_, "w/g0/0-intruder", forged);
  ASSERT_TRUE(ack.has_value());
  EXPECT_FALSE(ack->accepted);
  EXPECT_NE(ack->reason.find("fingerprint"), std::string::npos) << ack->reason;
  // The right fingerprint with another world size than the manifest's one rank.
  forged.model_fingerprint = fingerprint_;
  forged.world_size = 2;
  ack = Hello(worker_endpoint_, "w/g0/0-intruder2", forged);
  ASSERT_TRUE(ack.has_value());
  EXPECT_FALSE(ack->accepted);
  EXPECT_NE(ack->reason.find("world size"), std::string::npos) << ack->reason;

  // The leader stays: same instance, alive, and its request completes.
  const Json after = Health()["groups"][0];
  EXPECT_EQ(after["instance"], before["instance"]);
  EXPECT_EQ(after["alive"], true);
  leader.Release();
  const testing::HttpReply r = held.Finish();
  EXPECT_EQ(r.status, 200) << r.body;
  EXPECT_NE(r.body.find("data: [DONE]"), std::string::npos) << r.body;
  EXPECT_EQ(r.body.find("worker group lost"), std::string::npos) << r.body;
  const std::string metrics = Metrics();
  EXPECT_NE(metrics.find("fmoe_worker_hellos_refused_total{reason=\"fingerprint\"} 1"),
            std::string::npos)
      << metrics;
  EXPECT_NE(metrics.find("fmoe_worker_hellos_refused_total{reason=\"world_size\"} 1"),
            std::string::npos)
      << metrics;
  EXPECT_NE(RouterLog().find("refused worker peer=w/g0/0-intruder"), std::string::npos);
}

TEST_F(RouterPeersTest, WithoutTheMapServiceTheRouterServesAndHealthSaysDegraded) {
  Leader leader(worker_endpoint_, fingerprint_);
  ASSERT_TRUE(WaitUntil([&] { return leader.accepted(); }, 30000));
  // No map service: serving, degraded.
  ASSERT_TRUE(WaitUntil(
      [&] {
        Json h = Health();
        return h["status"] == "degraded" && h["map_service"]["status"] == "down";
      },
      30000))
      << Health().dump();
  auto r = testing::HttpCall(http_, "GET", "/health");
  EXPECT_EQ(r.status, 200) << r.body;
  EXPECT_TRUE(Json::parse(r.body)["map_service"]["reason"].is_string()) << r.body;
  EXPECT_EQ(Complete(), 200);

  // The map service comes: ok.
  auto service = std::make_unique<Child>(
      std::vector<std::string>{BinDir() + "/fmoe-map-service", "--manifest", manifest_},
      dir_ + "/map-service.log");
  ASSERT_TRUE(WaitUntil(
      [&] {
        Json h = Health();
        return h["status"] == "ok" && h["map_service"]["status"] == "up";
      },
      60000))
      << Health().dump() << ReadFile(dir_ + "/map-service.log");
  EXPECT_EQ(Complete(), 200);

  // It dies: degraded again, and serving.
  service->Signal(SIGKILL);
  service->Wait(10000);
  ASSERT_TRUE(WaitUntil([&] { return Health()["status"] == "degraded"; }, 30000))
      << Health().dump();
  EXPECT_EQ(Complete(), 200);
  EXPECT_EQ(Health()["groups"][0]["alive"], true);
}

}  // namespace
}  // namespace fmoe
