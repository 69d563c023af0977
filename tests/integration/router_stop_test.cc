// SIGTERM to the router of a launched system (the shipped tiny model) while long requests run:
// it drains for router.drain_timeout_s (1 s here), then every stream still open ends with an
// error event ("the router is stopping") followed by data: [DONE], and a whole request still
// open gets 503 with the error object; a request that finished in time is whole. Every request
// is a 1000-token one; the test waits for states (each stream's first event, the router counting
// them all as running), never for times.
#include <signal.h>

#include <memory>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "common/json.h"
#include "tests/testing/http_call.h"
#include "tests/testing/process_harness.h"

namespace fmoe {
namespace {

using testing::FreeTcpPort;
using testing::WaitUntil;
using Json = nlohmann::json;

TEST(RouterStopTest, OpenStreamsEndWithAnErrorEventAndDoneWhenTheDrainEnds) {
  testing::LaunchedCluster cluster("fmoe-router-stop");
  const int http = FreeTcpPort();
  ASSERT_TRUE(cluster.Start(
      cluster.TinyManifest(http, "    max_batch: 4\n", "  drain_timeout_s: 1\n", 5000), http,
      180000))
      << cluster.LauncherLog();
  auto health = [&] {
    auto r = testing::HttpCall(http, "GET", "/health");
    return r.status == 0 ? Json() : Json::parse(r.body, nullptr, false);
  };
  Json body = {{"model", "tiny-moe"}, {"prompt", "And God said"}, {"max_tokens", 1000},
               {"temperature", 0},    {"ignore_eos", true},       {"stream", true}};
  std::vector<std::unique_ptr<testing::AsyncCall>> streams;
  for (int i = 0; i < 3; ++i) {
    streams.push_back(
        std::make_unique<testing::AsyncCall>(http, "POST", "/v1/completions", body.dump()));
    ASSERT_TRUE(streams.back()->WaitForEvents(1, 120000)) << streams.back()->Received();
  }
  body.erase("stream");
  testing::AsyncCall whole(http, "POST", "/v1/completions", body.dump());
  ASSERT_TRUE(WaitUntil([&] { return health()["groups"][0]["running"] == 4; }, 60000))
      << health().dump();

  Json state = Json::parse(testing::ReadFile(cluster.dir() + "/run/launcher.json"));
  int64_t pid = 0;
  for (const auto& p : state["processes"]) {
    if (p["name"] == "router") pid = p["pid"].get<int64_t>();
  }
  ASSERT_GT(pid, 0) << state.dump();
  ASSERT_EQ(kill(static_cast<pid_t>(pid), SIGTERM), 0);

  int cut = 0;
  for (auto& call : streams) {
    const testing::HttpReply r = call->Finish();
    EXPECT_EQ(r.status, 200) << r.body;
    const std::vector<std::string> events = testing::SseEvents(r.body);
    ASSERT_GE(events.size(), 2u) << r.body;
    EXPECT_EQ(events.back(), "[DONE]") << "every stream ends with [DONE]: " << r.body;
    const Json last = Json::parse(events[events.size() - 2], nullptr, false);
    if (last.contains("error")) {
      ++cut;
      EXPECT_EQ(last["error"]["message"], "the router is stopping") << last.dump();
      EXPECT_EQ(last["error"]["code"], "unavailable") << last.dump();
    } else {
      EXPECT_EQ(last["choices"][0]["finish_reason"], "length") << "or it finished: " << r.body;
    }
  }
  const testing::HttpReply w = whole.Finish();
  if (w.status == 503) {
    ++cut;
    EXPECT_EQ(Json::parse(w.body, nullptr, false)["error"]["message"], "the router is stopping")
        << w.body;
  } else {
    EXPECT_EQ(w.status, 200) << w.body;
  }
  EXPECT_GT(cut, 0) << "1000 tokens each take longer than the 1 s drain";
  // Then the router exits as it should (the launcher starts it again).
  EXPECT_TRUE(WaitUntil(
      [&] { return cluster.LogOf("router").find("stopped (signal 15)") != std::string::npos; },
      30000))
      << cluster.LogOf("router");
  EXPECT_NE(cluster.LogOf("router").find("open request(s): the router is stopping"),
            std::string::npos);
}

}  // namespace
}  // namespace fmoe
