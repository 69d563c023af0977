// The host tier end to end (`fmoe launch`: map service, one cpu worker with the shipped tiny
// model's experts left in its checkpoint, a host cache of a tenth of them in front, a device
// cache of a tenth, router): the worker starts without reading the experts, completions are
// served with experts read from disk (usage.fmoe_experts.disk_reads, /metrics), and a worker
// killed with SIGKILL while it reads is restarted and serves the same tokens (nothing it reads
// is ever written).
#include <signal.h>

#include <string>
#include <thread>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "tests/testing/http_call.h"
#include "tests/testing/process_harness.h"

namespace fmoe {
namespace {

using Json = nlohmann::json;

// The worker's pid and restarts in the launcher's status file; {-1, -1} when absent.
std::pair<int, int> Worker(const testing::LaunchedCluster& cluster) {
  const Json state =
      Json::parse(testing::ReadFile(cluster.dir() + "/run/launcher.json"), nullptr, false);
  if (state.is_discarded() || !state.contains("processes")) return {-1, -1};
  for (const auto& p : state["processes"]) {
    if (p.value("name", "") == "worker-g0-0" && p.value("state", "") == "running") {
      return {p.value("pid", -1), p.value("restarts", 0)};
    }
  }
  return {-1, -1};
}

TEST(DiskTier, ServesFromTheCheckpointAndSurvivesAKillWhileReading) {
  testing::LaunchedCluster cluster("fmoe-disk-tier");
  const int http = testing::FreeTcpPort();
  ASSERT_TRUE(cluster.Start(cluster.TinyManifest(http,
                                                 "    expert_cache_fraction: 0.1\n"
                                                 "    host_cache_fraction: 0.1\n",
                                                 "", 2000),
                            http, 90000))
      << cluster.LauncherLog();
  const std::string log = cluster.LogOf("worker-g0-0");
  EXPECT_NE(log.find("host tier: 6 host slots of 64 experts"), std::string::npos) << log;
  const Json body = {{"model", "tiny-moe"},
                     {"prompt", "The LORD is my shepherd"},
                     {"max_tokens", 24},
                     {"ignore_eos", true},
                     {"temperature", 0}};
  const testing::HttpReply first = testing::HttpCall(http, "POST", "/v1/completions", body.dump());
  ASSERT_EQ(first.status, 200) << first.body << cluster.LogOf("worker-g0-0");
  const Json reply = Json::parse(first.body);
  const Json u = reply["usage"]["fmoe_experts"];
  const uint64_t disk_reads = u["disk_reads"].get<uint64_t>();
  EXPECT_GT(disk_reads, 0u) << first.body;
  EXPECT_LE(disk_reads, u["misses"].get<uint64_t>()) << first.body;
  const std::string text = reply["choices"][0]["text"].get<std::string>();

  std::string metrics;
  EXPECT_TRUE(testing::WaitUntil(
      [&] {
        metrics = testing::HttpCall(http, "GET", "/metrics").body;
        return testing::GroupMetric(metrics, "fmoe_expert_disk_reads_total") >=
               static_cast<double>(disk_reads);
      },
      10000, 100))
      << metrics;
  EXPECT_GT(testing::GroupMetric(metrics, "fmoe_expert_disk_read_bytes_total"), 0.0) << metrics;

  // SIGKILL the worker while it serves (and so reads): the launcher restarts it, and it serves
  // the same tokens from the same files.
  const auto [pid, restarts] = Worker(cluster);
  ASSERT_GT(pid, 0);
  Json longer = body;
  longer["max_tokens"] = 1000;
  testing::HttpReply during;
  std::thread client(
      [&] { during = testing::HttpCall(http, "POST", "/v1/completions", longer.dump()); });
  // Kill it once it has read more than the first request needed.
  testing::WaitUntil(
      [&] {
        const std::string m = testing::HttpCall(http, "GET", "/metrics").body;
        return testing::GroupMetric(m, "fmoe_expert_disk_reads_total") >
               static_cast<double>(disk_reads);
      },
      20000, 20);
  ASSERT_EQ(kill(pid, SIGKILL), 0);
  client.join();  // Its answer is an error, unless it finished before the kill.
  ASSERT_TRUE(testing::WaitUntil(
      [&] {
        const auto [now, r] = Worker(cluster);
        return now > 0 && now != pid && r == restarts + 1;
      },
      120000))
      << cluster.LauncherLog();
  testing::HttpReply again;
  ASSERT_TRUE(testing::WaitUntil(
      [&] {
        again = testing::HttpCall(http, "POST", "/v1/completions", body.dump());
        return again.status == 200;
      },
      120000, 500))
      << again.body << cluster.LogOf("worker-g0-0");
  EXPECT_EQ(Json::parse(again.body)["choices"][0]["text"].get<std::string>(), text);
}

}  // namespace
}  // namespace fmoe
