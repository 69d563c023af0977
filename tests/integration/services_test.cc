// The service binaries on their own: the map service records registrations durably (kill -9
// and restart keeps them, and a conflicting shape is refused), refuses a second instance on
// the same data directory, and the router answers /health 503 with a reason when no group is
// alive and 404 with the OpenAI error object for unknown routes.
#include <signal.h>
#include <sys/wait.h>

#include <filesystem>
#include <string>

#include <gtest/gtest.h>

#include "common/http_client.h"
#include "common/json.h"
#include "common/wire/wire.h"
#include "tests/testing/process_harness.h"

namespace fmoe {
namespace {

using testing::BinDir;
using testing::Child;
using testing::FreeTcpPort;
using testing::ReadFile;
using testing::WaitUntil;
using Json = nlohmann::json;

class ServicesTest : public ::testing::Test {
 protected:
  void SetUp() override { dir_ = testing::MakeTempDir("fmoe-services"); }
  void TearDown() override {
    std::error_code ec;
    if (!HasFailure()) std::filesystem::remove_all(dir_, ec);
  }

  std::string WriteManifest(const std::string& name, int map_port, int http_port) {
    std::string path = dir_ + "/" + name + ".yaml";
    testing::WriteFile(path,
                       "model:\n  path: " + std::string(FMOE_SOURCE_DIR) +
                           "/deploy/models/tiny-moe\n"
                           "map_service:\n  endpoint: tcp://127.0.0.1:" +
                           std::to_string(map_port) + "\n  data_dir: " + dir_ +
                           "/maps\n"
                           "worker_groups:\n  - name: g0\n    workers:\n      - device: cpu\n"
                           "router:\n  listen: 127.0.0.1:" +
                           std::to_string(http_port) +
                           "\n  worker_endpoint: tcp://127.0.0.1:" + std::to_string(FreeTcpPort()) +
                           "\nheartbeat:\n  interval_ms: 100\n  timeout_ms: 1000\n");
    // This test's sockets speak with the services: with the cluster key.
    std::string error;
    EXPECT_TRUE(testing::UseClusterKeyOf(path, &error)) << error;
    return path;
  }

  std::string dir_;
};

// Sends one message from a fresh DEALER and waits for the answer.
std::optional<MapMessage> Ask(const std::string& endpoint, const MapMessage& message,
                              const std::string& id) {
  wire::Context context;
  wire::SocketOptions options;
  options.routing_id = id;
  auto socket = wire::MapSocket::Connect(context, wire::Role::kDealer, endpoint, options);
  if (!socket.ok()) return std::nullopt;
  if (!(*socket)->Send(message).ok()) return std::nullopt;
  auto reply = (*socket)->Receive(5000);
  if (!reply) return std::nullopt;
  return reply->message;
}

Register TinyRegistration(uint32_t hidden) {
  Register reg;
  reg.group = "g0";
  reg.rank = 0;
  reg.world_size = 1;
  reg.instance_id = 42;
  reg.model_fingerprint = 0xfeedface;
  reg.num_layers = 8;
  reg.num_experts = 8;
  reg.top_k = 2;
  reg.hidden_size = hidden;
  return reg;
}

TEST_F(ServicesTest, MapServiceKeepsRegistrationsAcrossKillAndRefusesConflicts) {
  const int port = FreeTcpPort();
  const std::string endpoint = "tcp://127.0.0.1:" + std::to_string(port);
  std::string manifest = WriteManifest("m", port, FreeTcpPort());
  {
    Child service({BinDir() + "/fmoe-map-service", "--manifest", manifest}, dir_ + "/ms1.log");
    auto reply = Ask(endpoint, TinyRegistration(256), "t1");
    ASSERT_TRUE(reply.has_value()) << ReadFile(dir_ + "/ms1.log");
    auto* ack = std::get_if<RegisterAck>(&*reply);
    ASSERT_NE(ack, nullptr);
    EXPECT_TRUE(ack->accepted) << ack->reason;
    service.Signal(SIGKILL);
    service.Wait(5000);
  }
  Child service({BinDir() + "/fmoe-map-service", "--manifest", manifest}, dir_ + "/ms2.log");
  // The model's shape survived the kill: a different shape under its fingerprint is refused.
  auto reply = Ask(endpoint, TinyRegistration(512), "t2");
  ASSERT_TRUE(reply.has_value()) << ReadFile(dir_ + "/ms2.log");
  auto* ack = std::get_if<RegisterAck>(&*reply);
  ASSERT_NE(ack, nullptr);
  EXPECT_FALSE(ack->accepted);
  EXPECT_NE(ack->reason.find("different shape"), std::string::npos) << ack->reason;

  AdminRequest stats;
  stats.id = 7;
  stats.op = AdminOp::kStats;
  reply = Ask(endpoint, stats, "t3");
  ASSERT_TRUE(reply.has_value());
  auto* admin = std::get_if<AdminReply>(&*reply);
  ASSERT_NE(admin, nullptr);
  EXPECT_EQ(admin->id, 7u);
  Json body = Json::parse(admin->json);
  ASSERT_EQ(body["models"].size(), 1u);
  EXPECT_EQ(body["models"][0]["hidden_size"], 256);
  EXPECT_EQ(body["counters"]["registrations_refused"], 1);

  // Garbage on the socket is counted and dropped; the service keeps answering.
  {
    wire::Context context;
    auto raw = wire::MapSocket::Connect(context, wire::Role::kDealer, endpoint);
    ASSERT_TRUE(raw.ok());
    const uint8_t junk[] = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12};
    ASSERT_TRUE((*raw)->SendRaw(junk).ok());
    ASSERT_TRUE((*raw)->Send(stats).ok());
    auto again = (*raw)->Receive(5000);
    ASSERT_TRUE(again.has_value());
    Json j = Json::parse(std::get<AdminReply>(again->message).json);
    EXPECT_GE(j["wire"]["dropped"]["bad_identifier"].get<int>() +
                  j["wire"]["dropped"]["malformed"].get<int>(),
              1)
        << j.dump();
  }
}

TEST_F(ServicesTest, SecondMapServiceOnSameDataDirFailsFast) {
  std::string first = WriteManifest("a", FreeTcpPort(), FreeTcpPort());
  std::string second = WriteManifest("b", FreeTcpPort(), FreeTcpPort());
  Child one({BinDir() + "/fmoe-map-service", "--manifest", first}, dir_ + "/one.log");
  ASSERT_TRUE(WaitUntil(
      [&] { return ReadFile(dir_ + "/one.log").find("listening on") != std::string::npos; },
      20000));
  Child two({BinDir() + "/fmoe-map-service", "--manifest", second}, dir_ + "/two.log");
  auto status = two.Wait(20000);
  ASSERT_TRUE(status.has_value()) << "the second service did not exit";
  ASSERT_TRUE(WIFEXITED(*status));
  EXPECT_EQ(WEXITSTATUS(*status), 1);
  EXPECT_NE(ReadFile(dir_ + "/two.log").find("is in use by another map service"), std::string::npos)
      << ReadFile(dir_ + "/two.log");
}

TEST_F(ServicesTest, RouterHealthWithoutWorkersAndUnknownRoutes) {
  const int http = FreeTcpPort();
  std::string manifest = WriteManifest("r", FreeTcpPort(), http);
  Child router({BinDir() + "/fmoe-router", "--manifest", manifest}, dir_ + "/router.log");
  ASSERT_TRUE(WaitUntil([&] { return http::Get("127.0.0.1", http, "/health", 500).ok(); }, 20000))
      << ReadFile(dir_ + "/router.log");
  auto health = http::Get("127.0.0.1", http, "/health", 1000);
  ASSERT_TRUE(health.ok());
  EXPECT_EQ(health->status, 503);
  Json body = Json::parse(health->body);
  EXPECT_EQ(body["status"], "unavailable");
  EXPECT_EQ(body["reason"], "no worker group is alive: g0: never connected");
  EXPECT_EQ(body["map_service"]["alive"], false);

  auto missing = http::Get("127.0.0.1", http, "/v1/nothing", 1000);
  ASSERT_TRUE(missing.ok());
  EXPECT_EQ(missing->status, 404);
  Json err = Json::parse(missing->body);
  EXPECT_EQ(err["error"]["type"], "invalid_request_error");
  EXPECT_EQ(err["error"]["message"], "no route GET /v1/nothing");

  router.Signal(SIGTERM);
  auto status = router.Wait(10000);
  ASSERT_TRUE(status.has_value());
  ASSERT_TRUE(WIFEXITED(*status));
  EXPECT_EQ(WEXITSTATUS(*status), 0);
}

}  // namespace
}  // namespace fmoe
