// The host tier end to end (`fmoe launch`: map service, one cpu worker with the shipped tiny
// model's experts left in its checkpoint, a host cache of a tenth of them in front, a device
// cache of a tenth, router): the worker starts without reading the experts, completions are
// served with experts read from disk (usage.fmoe_experts.disk_reads, /metrics), and a worker
// killed with SIGKILL while it reads is restarted and serves the same tokens (nothing it reads
// is ever written).
#include <signal.h>
#include <unistd.h>

#include <filesystem>
#include <string>
#include <thread>

#include <gtest/gtest.h>

#include "common/json.h"
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

// The checkpoint shard cut short while the worker serves from it (a disk failing, a file
// replaced under it): the requests whose experts can no longer be read end with an error
// naming the read, the worker stays up (same pid, no restart), /metrics counts the failed
// reads, and once the file is whole again the same prompt gives the same tokens.
TEST(DiskTier, AShardCutShortWhileServingFailsOnlyTheRequestsThatNeedIt) {
  testing::LaunchedCluster cluster("fmoe-disk-cut");
  namespace fs = std::filesystem;
  const int http = testing::FreeTcpPort();
  std::string manifest = cluster.TinyManifest(http,
                                              "    expert_cache_fraction: 0.1\n"
                                              "    host_cache_fraction: 0.1\n",
                                              "", 2000);
  // The model's own copy, in the test's directory.
  const std::string key = "  path: ";
  const size_t at = manifest.find(key);
  ASSERT_NE(at, std::string::npos) << manifest;
  const size_t from = at + key.size();
  const std::string tiny = manifest.substr(from, manifest.find('\n', from) - from);
  const std::string model = cluster.dir() + "/model";
  fs::copy(tiny, model, fs::copy_options::recursive);
  manifest.replace(from, tiny.size(), model);
  const std::string shard = model + "/model.safetensors";
  const std::string whole = cluster.dir() + "/whole.safetensors";
  fs::copy_file(shard, whole);
  ASSERT_TRUE(cluster.Start(manifest, http, 90000)) << cluster.LauncherLog();
  // The launcher's status file names the running worker (it may lag the router's /health).
  std::pair<int, int> worker{-1, -1};
  ASSERT_TRUE(testing::WaitUntil(
      [&] {
        worker = Worker(cluster);
        return worker.first > 0;
      },
      30000))
      << cluster.LauncherLog();
  const auto [pid, restarts] = worker;

  auto body = [](const std::string& prompt) {
    return Json{{"model", "tiny-moe"},
                {"prompt", prompt},
                {"max_tokens", 48},
                {"ignore_eos", true},
                {"temperature", 0}}
        .dump();
  };
  const testing::HttpReply first =
      testing::HttpCall(http, "POST", "/v1/completions", body("The LORD is my shepherd"));
  ASSERT_EQ(first.status, 200) << first.body << cluster.LogOf("worker-g0-0");
  const std::string text = Json::parse(first.body)["choices"][0]["text"].get<std::string>();

  // Cut the shard to its first fifth: most experts' bytes are gone. A host tier of 6 of the 64
  // experts cannot hold what 48 tokens of other prompts route to, so reads must fail.
  const auto size = fs::file_size(shard);
  ASSERT_EQ(::truncate(shard.c_str(), static_cast<off_t>(size / 5)), 0);
  int failed = 0;
  const char* prompts[] = {"In the beginning God created", "And the earth was without form",
                           "Blessed is the man that walketh", "Now the serpent was more subtil",
                           "By the rivers of Babylon"};
  for (const char* prompt : prompts) {
    const testing::HttpReply r = testing::HttpCall(http, "POST", "/v1/completions", body(prompt));
    if (r.status == 200) continue;
    ++failed;
    EXPECT_GE(r.status, 500) << r.body;
    EXPECT_NE(r.body.find("could not be read"), std::string::npos) << r.body;
  }
  EXPECT_GT(failed, 0) << cluster.LogOf("worker-g0-0");
  // The same worker serves on: nothing was restarted.
  EXPECT_EQ(Worker(cluster), std::make_pair(pid, restarts)) << cluster.LauncherLog();
  std::string metrics;
  EXPECT_TRUE(testing::WaitUntil(
      [&] {
        metrics = testing::HttpCall(http, "GET", "/metrics").body;
        return testing::GroupMetric(metrics, "fmoe_expert_failed_total") > 0.0;
      },
      20000, 100))
      << metrics;
  EXPECT_GE(testing::GroupMetric(metrics, "fmoe_expert_failed_loads_total"),
            testing::GroupMetric(metrics, "fmoe_expert_failed_total"))
      << metrics;

  // The file whole again (written in place, as a repaired disk would give it back): the first
  // prompt's tokens again.
  fs::copy_file(whole, shard, fs::copy_options::overwrite_existing);
  const testing::HttpReply again =
      testing::HttpCall(http, "POST", "/v1/completions", body("The LORD is my shepherd"));
  ASSERT_EQ(again.status, 200) << again.body << cluster.LogOf("worker-g0-0");
  EXPECT_EQ(Json::parse(again.body)["choices"][0]["text"].get<std::string>(), text);
  EXPECT_EQ(Worker(cluster), std::make_pair(pid, restarts)) << cluster.LauncherLog();
}

}  // namespace
}  // namespace fmoe
