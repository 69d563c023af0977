// Expert-parallel worker groups as real processes (`fmoe launch`: map service, the ranks of one
// group joined through c10d Gloo, router), over HTTP:
//   - world sizes 1, 2 and 3, each with half of its experts' budget, answer the same prompts
//     (greedy, seeded sampling, streamed) with the same text and the same token counts, and each
//     rank holds only its own share of the experts;
//   - SIGKILL of one rank: the request it was serving ends with "worker group lost" (the leader's
//     goodbye, not the heartbeat timeout), the launcher restarts the whole group, the group
//     serves again with the same answers, and after SIGTERM no process of the group is left.
#include <signal.h>
#include <sys/wait.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "common/http_client.h"
#include "common/json.h"
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
using namespace std::chrono_literals;

template <class... T>
std::string Cat(const T&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  return out.str();
}

// A launched system with one group of `world` cpu ranks; `budget`: the group's expert cache
// (or one device budget) keys.
class Launched {
 public:
  Launched(int world, const std::string& tag,
           const std::string& budget = "    expert_cache_fraction: 0.5\n")
      : dir_(testing::MakeTempDir("fmoe-ep-" + tag)) {
    http_ = FreeTcpPort();
    manifest_ = dir_ + "/manifest.yaml";
    std::string ranks;
    for (int r = 0; r < world; ++r) ranks += "      - device: cpu\n";
    testing::WriteFile(manifest_,
                       "model:\n  name: tiny-moe\n  path: " + std::string(FMOE_SOURCE_DIR) +
                           "/deploy/models/tiny-moe\n"
                           "map_service:\n  endpoint: tcp://127.0.0.1:" +
                           std::to_string(FreeTcpPort()) + "\n  data_dir: " + dir_ +
                           "/maps\n"
                           "worker_groups:\n  - name: g0\n    max_batch: 4\n" +
                           budget +
                           "    collective_timeout_s: 10\n    rendezvous_timeout_s: 60\n"
                           "    rendezvous: 127.0.0.1:" +
                           std::to_string(FreeTcpPort()) + "\n    workers:\n" + ranks +
                           "router:\n  listen: 127.0.0.1:" + std::to_string(http_) +
                           "\n  worker_endpoint: tcp://127.0.0.1:" + std::to_string(FreeTcpPort()) +
                           "\nheartbeat:\n  interval_ms: 100\n  timeout_ms: 5000\n"
                           "launcher:\n  run_dir: " +
                           dir_ +
                           "/run\n  ready_timeout_s: 90\n  restart:\n"
                           "    initial_backoff_ms: 200\n    max_backoff_ms: 1000\n");
    launcher_ = std::make_unique<Child>(
        std::vector<std::string>{BinDir() + "/fmoe", "launch", manifest_}, dir_ + "/launcher.log");
  }
  ~Launched() {
    Stop();
    std::error_code ec;
    if (!::testing::Test::HasFailure()) std::filesystem::remove_all(dir_, ec);
  }

  bool WaitHealthy(int timeout_ms) {
    return WaitUntil(
        [&] {
          Json h = Health();
          return h.is_object() && h.contains("groups") && h["groups"].size() == 1 &&
                 h["groups"][0].value("alive", false);
        },
        timeout_ms);
  }
  Json Health() const {
    auto res = http::Get("127.0.0.1", http_, "/health", 1000);
    if (!res.ok()) return Json();
    return Json::parse(res->body, nullptr, false);
  }
  int http() const { return http_; }
  testing::HttpReply Complete(const Json& body) const {
    return testing::HttpCall(http_, "POST", "/v1/completions", body.dump());
  }
  Json State() const {
    Json j = Json::parse(ReadFile(dir_ + "/run/launcher.json"), nullptr, false);
    return j.is_discarded() ? Json::object() : j;
  }
  // pid and restarts of a running process of the status file; {-1, -1} otherwise.
  std::pair<int, int> Running(const std::string& name) const {
    Json s = State();
    if (!s.contains("processes")) return {-1, -1};
    for (const auto& p : s["processes"]) {
      if (p.value("name", "") == name && p.value("state", "") == "running") {
        return {p.value("pid", -1), p.value("restarts", 0)};
      }
    }
    return {-1, -1};
  }
  std::string RankLog(int rank) const {
    return ReadFile(dir_ + "/run/logs/worker-g0-" + std::to_string(rank) + ".log");
  }
  int Stop() {
    if (!launcher_) return -1;
    launcher_->Signal(SIGTERM);
    auto status = launcher_->Wait(60000);
    launcher_.reset();
    return status && WIFEXITED(*status) ? WEXITSTATUS(*status) : -1;
  }
  const std::string& dir() const { return dir_; }
  const std::string& manifest() const { return manifest_; }
  std::string LauncherLog() const { return ReadFile(dir_ + "/launcher.log"); }

 private:
  std::string dir_;
  std::string manifest_;
  int http_ = 0;
  std::unique_ptr<Child> launcher_;
};

// Greedy, seeded sampling, a longer greedy one and a streamed one.
std::vector<Json> Bodies() {
  return {
      {{"model", "tiny-moe"},
       {"prompt", "In the beginning God created"},
       {"max_tokens", 12},
       {"temperature", 0}},
      {{"model", "tiny-moe"},
       {"prompt", "The history of the city"},
       {"max_tokens", 12},
       {"temperature", 0.8},
       {"top_p", 0.9},
       {"seed", 7}},
      {{"model", "tiny-moe"}, {"prompt", "Water boils at"}, {"max_tokens", 20}, {"temperature", 0}},
      {{"model", "tiny-moe"},
       {"prompt", "She opened the door"},
       {"max_tokens", 10},
       {"temperature", 0.7},
       {"seed", 3},
       {"stream", true}},
  };
}

// What a completion said: its text (the streamed pieces joined) and its token count.
std::string Answer(const testing::HttpReply& r) {
  if (r.status != 200) return Cat("status ", r.status, ": ", r.body);
  if (r.head.find("text/event-stream") != std::string::npos) {
    std::string text;
    for (const std::string& e : testing::SseEvents(r.body)) {
      if (e == "[DONE]") break;
      Json j = Json::parse(e, nullptr, false);
      if (j.is_object() && j.contains("choices") && !j["choices"].empty()) {
        text += j["choices"][0].value("text", "");
      }
    }
    return text;
  }
  Json j = Json::parse(r.body, nullptr, false);
  if (!j.is_object()) return "unparsable: " + r.body;
  return j["choices"][0].value("text", "") + " |" +
         std::to_string(j["usage"].value("completion_tokens", -1));
}

// Sends every body at once (the group batches them) and returns the answers in order.
std::vector<std::string> AskAll(const Launched& system) {
  const std::vector<Json> bodies = Bodies();
  std::vector<std::string> answers(bodies.size());
  std::vector<std::thread> clients;
  for (size_t i = 0; i < bodies.size(); ++i) {
    clients.emplace_back([&, i] { answers[i] = Answer(system.Complete(bodies[i])); });
  }
  for (auto& t : clients) t.join();
  return answers;
}

TEST(ExpertParallelE2E, WorldSizesOneToThreeAnswerAlike) {
  std::vector<std::string> reference;
  // Last, world 2 with one device budget for KV and experts on each rank (20 pages of an
  // expert's bytes each, of which the four requests' KV borrows).
  for (auto [world, memory] : {std::pair{1, false}, {2, false}, {3, false}, {2, true}}) {
    SCOPED_TRACE(Cat("world ", world, memory ? " with memory" : ""));
    Launched system(
        world, Cat("w", world, memory ? "m" : ""),
        memory ? "    memory: {device_gb: 0.008}\n" : "    expert_cache_fraction: 0.5\n");
    ASSERT_TRUE(system.WaitHealthy(120000)) << system.LauncherLog();
    EXPECT_EQ(system.Health()["groups"][0].value("world_size", 0), world);
    std::vector<std::string> answers = AskAll(system);
    for (const std::string& a : answers) {
      EXPECT_EQ(a.rfind("status ", 0), std::string::npos) << a;
    }
    if (reference.empty()) {
      reference = answers;
    } else {
      EXPECT_EQ(answers, reference);
    }
    if (memory) {
      // /health shows each rank's split once a heartbeat after the group's iterations carried
      // it: the same 20 pages on each rank, between its pool and its cache.
      Json split;
      ASSERT_TRUE(WaitUntil(
          [&] {
            split = system.Health()["groups"][0].value("device_memory", Json::object());
            return split.contains("ranks");
          },
          60000))
          << system.Health().dump();
      ASSERT_EQ(split["ranks"].size(), 2u) << split.dump();
      const uint64_t total =
          split.value("kv_bytes", uint64_t{0}) + split.value("expert_bytes", uint64_t{0});
      EXPECT_GT(total, 0u) << split.dump();
      for (const Json& rank : split["ranks"]) {
        EXPECT_EQ(rank.value("kv_bytes", uint64_t{0}) + rank.value("expert_bytes", uint64_t{0}),
                  total)
            << split.dump();
        EXPECT_GT(rank.value("kv_bytes", uint64_t{0}), 0u) << split.dump();
      }
      auto metrics_reply = http::Get("127.0.0.1", system.http(), "/metrics", 1000);
      ASSERT_TRUE(metrics_reply.ok()) << metrics_reply.status().ToString();
      const std::string& metrics = metrics_reply->body;
      EXPECT_NE(metrics.find("fmoe_rank_device_kv_bytes{group=\"g0\",rank=\"1\"}"),
                std::string::npos)
          << metrics;
    }
    ASSERT_EQ(system.Stop(), 0) << system.LauncherLog();
    // Each rank cached only its share: 64 experts, (l * 8 + j) % world == rank, half of them
    // in the budget; and the ranks exchanged expert outputs.
    for (int r = 0; r < world; ++r) {
      const std::string log = system.RankLog(r);
      if (memory) {
        // Both ranks: 20 pages, 2 the pool's own and up to 16 more borrowed (864 positions).
        EXPECT_NE(log.find("memory: one device budget of 0.008 GB (device_gb 0.008): 20 pages"),
                  std::string::npos)
            << "rank " << r << ":\n"
            << log;
        EXPECT_NE(log.find("up to 864 with pages borrowed"), std::string::npos) << log;
        EXPECT_NE(log.find("stopped (signal 15)"), std::string::npos) << log;
        continue;
      }
      const int owned = 64 / world + (r < 64 % world ? 1 : 0);
      const std::string cache =
          Cat("rank=", r, "/", world, " slots=", owned / 2, " of ", owned, " experts");
      EXPECT_NE(log.find(cache), std::string::npos) << "rank " << r << ":\n" << log;
      if (world > 1) {
        EXPECT_NE(log.find("joined through 127.0.0.1:"), std::string::npos) << log;
        EXPECT_EQ(log.find("expert group: gloo backend, 0 combines"), std::string::npos) << log;
      }
      EXPECT_NE(log.find("stopped (signal 15)"), std::string::npos) << "rank " << r << ":\n" << log;
    }
  }
}

// Every pid that is still a live process whose command line names this manifest.
std::set<int> ProcessesOf(const std::string& manifest) {
  std::set<int> out;
  for (const auto& entry : std::filesystem::directory_iterator("/proc")) {
    const std::string name = entry.path().filename();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream in(entry.path() / "cmdline", std::ios::binary);
    std::string cmdline((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (cmdline.find(manifest) != std::string::npos && testing::ProcessAlive(std::stoi(name))) {
      out.insert(std::stoi(name));
    }
  }
  return out;
}

TEST(ExpertParallelE2E, KillingARankRestartsTheGroupAndServiceResumes) {
  Launched system(2, "kill");
  ASSERT_TRUE(system.WaitHealthy(120000)) << system.LauncherLog();
  const Json greedy = {{"model", "tiny-moe"},
                       {"prompt", "In the beginning God created"},
                       {"max_tokens", 12},
                       {"temperature", 0}};
  const std::string before = Answer(system.Complete(greedy));
  ASSERT_EQ(before.rfind("status ", 0), std::string::npos) << before;

  auto [leader_pid, leader_restarts] = system.Running("worker-g0-0");
  auto [follower_pid, follower_restarts] = system.Running("worker-g0-1");
  ASSERT_GT(leader_pid, 0);
  ASSERT_GT(follower_pid, 0);
  // A long request is running, and has produced a token, when rank 1 dies (a request that has
  // not would be put back in the queue instead). A stream shows when that is, however slow the
  // machine.
  testing::AsyncCall long_call(system.http(), "POST", "/v1/completions",
                               Json{{"model", "tiny-moe"},
                                    {"prompt", "And God said"},
                                    {"max_tokens", 1000},
                                    {"temperature", 0},
                                    {"stream", true}}
                                   .dump());
  ASSERT_TRUE(long_call.WaitForEvents(1, 60000)) << long_call.Received();
  ASSERT_EQ(kill(follower_pid, SIGKILL), 0);
  const testing::HttpReply long_reply = long_call.Finish();
  const auto events = testing::SseEvents(long_reply.body);
  ASSERT_GE(events.size(), 3u) << long_reply.body;
  EXPECT_EQ(events.back(), "[DONE]") << long_reply.body;
  EXPECT_NE(events[events.size() - 2].find("worker group lost"), std::string::npos)
      << long_reply.body;
  // The leader's goodbye ended the group, not the router's 5 s heartbeat timeout.
  const std::string router_log = ReadFile(system.dir() + "/run/logs/router.log");
  EXPECT_NE(router_log.find("group=g0 leader left:"), std::string::npos) << router_log;
  EXPECT_EQ(router_log.find("group=g0 lost: no heartbeat"), std::string::npos) << router_log;

  // Both ranks restart together, the group re-forms and serves the same answer.
  ASSERT_TRUE(WaitUntil(
      [&] {
        auto [l, lr] = system.Running("worker-g0-0");
        auto [f, fr] = system.Running("worker-g0-1");
        return l > 0 && f > 0 && l != leader_pid && f != follower_pid && lr == 1 && fr == 1;
      },
      60000))
      << system.State().dump() << "\n"
      << system.LauncherLog();
  ASSERT_TRUE(system.WaitHealthy(60000)) << system.LauncherLog();
  EXPECT_FALSE(testing::ProcessAlive(leader_pid));
  EXPECT_FALSE(testing::ProcessAlive(follower_pid));
  EXPECT_EQ(Answer(system.Complete(greedy)), before);
  // The leader said why it left.
  EXPECT_NE(system.RankLog(0).find("leaving: expert group g0: rank 0/2"), std::string::npos)
      << system.RankLog(0);
  EXPECT_NE(system.LauncherLog().find("restarting unit group:g0"), std::string::npos)
      << system.LauncherLog();

  const std::string manifest = system.manifest();
  EXPECT_EQ(system.Stop(), 0);
  EXPECT_TRUE(WaitUntil([&] { return ProcessesOf(manifest).empty(); }, 10000))
      << ProcessesOf(manifest).size() << " processes left behind";
}

}  // namespace
}  // namespace fmoe
