// Hybrid execution end to end (`fmoe launch`: map service, one cpu worker with the shipped tiny
// model at a quarter of its experts over a slow emulated link, `hybrid` on, router): a
// completion's usage.fmoe_experts carries the experts run on the host, their time and the bytes
// not moved, and /metrics the group's totals from the leader's heartbeats.
#include <string>

#include <gtest/gtest.h>

#include "common/json.h"
#include "tests/testing/http_call.h"
#include "tests/testing/process_harness.h"

namespace fmoe {
namespace {

using Json = nlohmann::json;

TEST(Hybrid, UsageAndMetricsCarryTheHostRuns) {
  testing::LaunchedCluster cluster("fmoe-hybrid");
  const int http = testing::FreeTcpPort();
  ASSERT_TRUE(cluster.Start(cluster.TinyManifest(http,
                                                 "    expert_cache_fraction: 0.25\n"
                                                 "    link: {gbps: 0.2, latency_us: 10}\n"
                                                 "    hybrid: {host_slowdown: 1}\n",
                                                 "", 2000),
                            http, 90000))
      << cluster.LauncherLog();
  const Json body = {{"model", "tiny-moe"},
                     {"prompt", "The LORD is my shepherd"},
                     {"max_tokens", 16},
                     {"ignore_eos", true},
                     {"temperature", 0}};
  const testing::HttpReply r = testing::HttpCall(http, "POST", "/v1/completions", body.dump());
  ASSERT_EQ(r.status, 200) << r.body << cluster.LogOf("worker-g0-0");
  const Json u = Json::parse(r.body)["usage"]["fmoe_experts"];
  const uint64_t host_runs = u["host_runs"].get<uint64_t>();
  EXPECT_GT(host_runs, 0u) << r.body;
  EXPECT_GT(u["misses"].get<uint64_t>(), 0u) << r.body;
  EXPECT_LE(host_runs, u["misses"].get<uint64_t>()) << r.body;
  EXPECT_GT(u["host_ms"].get<double>(), 0.0) << r.body;
  // Every host run left one whole expert on the host.
  const uint64_t not_moved = u["bytes_not_moved"].get<uint64_t>();
  ASSERT_GT(not_moved, 0u) << r.body;
  EXPECT_EQ(not_moved % host_runs, 0u) << r.body;

  std::string metrics;
  EXPECT_TRUE(testing::WaitUntil(
      [&] {
        metrics = testing::HttpCall(http, "GET", "/metrics").body;
        return testing::GroupMetric(metrics, "fmoe_expert_host_runs_total") >=
               static_cast<double>(host_runs);
      },
      10000, 100))
      << metrics;
  EXPECT_GT(testing::GroupMetric(metrics, "fmoe_expert_host_seconds_total"), 0.0) << metrics;
  EXPECT_GE(testing::GroupMetric(metrics, "fmoe_expert_not_moved_bytes_total"),
            static_cast<double>(not_moved))
      << metrics;
}

}  // namespace
}  // namespace fmoe
