// The router's worker link over real ZeroMQ (ipc endpoints), with fake leaders: DEALERs made with
// common/wire/wire.h under the worker's routing id w/<group>/<rank>. Covers WorkerGoodbye: from the
// group's current leader it takes the group out of service at once (started requests fail with
// kGroupLostError, dispatched-but-not-started ones go to another live group), a goodbye with a
// stale instance id or from a peer that is not the leader changes nothing, and the restarted
// leader (same routing id, new instance id) joins again. The last tests drive a real
// Worker::SendGoodbye: the goodbye leaves even though the socket is closed right after it.
// Loading: a real LoadReporter makes the group "loading" (with its progress, in the view and in
// /health's 503) until its leader's Hello. A request's sink that throws ends that request only.
// The heartbeat timeout is a minute, so only the goodbye can end a group within the waits here.
#include "router/worker_link.h"

#include <unistd.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "common/clock.h"
#include "common/json.h"
#include "common/model/model_config.h"
#include "common/wire/wire.h"
#include "gpu_worker/control/load_reporter.h"
#include "gpu_worker/control/worker.h"
#include "router/api.h"
#include "tests/router/link_fixture.h"

namespace fmoe {
namespace {

using namespace link_testing;  // tests/router/link_fixture.h
using namespace std::chrono_literals;

TEST(WorkerLink, GoodbyeFailsStartedRequestsAndMovesTheOthers) {
  Events events;
  Link link;
  auto g0 = std::make_unique<FakeLeader>(link.endpoint(), "g0", 0, 100);
  ASSERT_TRUE(g0->Join());
  ASSERT_EQ(g0->Heartbeat(), true);
  ASSERT_TRUE(WaitUntil([&] { return link.Alive("g0", 100); }));

  // Both requests go to g0, the only live group; it starts the first one.
  auto started = link->Submit(Prompt(), events.Sink(), 0);
  auto waiting = link->Submit(Prompt(), events.Sink(), 0);
  ASSERT_TRUE(started.ok() && waiting.ok());
  auto gen = g0->Next<Generate>();
  ASSERT_TRUE(gen);
  EXPECT_EQ(gen->request_id, *started);
  gen = g0->Next<Generate>();
  ASSERT_TRUE(gen);
  EXPECT_EQ(gen->request_id, *waiting);
  g0->Send(Token(*started, 5));
  ASSERT_EQ(events.WaitFor(*started, 1).size(), 1u);

  auto g1 = std::make_unique<FakeLeader>(link.endpoint(), "g1", 0, 200);
  ASSERT_TRUE(g1->Join());
  ASSERT_TRUE(WaitUntil([&] { return link.Alive("g1", 200); }));

  // A goodbye with a stale instance id, or from a peer that is not g0's leader, changes nothing.
  g0->Goodbye(99, "an older instance");
  EXPECT_EQ(g0->Heartbeat(), true);
  FakeLeader stranger(link.endpoint(), "g0", 1, 100);
  stranger.Goodbye(100, "not the leader");
  EXPECT_EQ(stranger.Heartbeat(), false);
  EXPECT_EQ(g0->Heartbeat(), true);
  EXPECT_EQ(events.Of(*started).size(), 1u);
  EXPECT_TRUE(events.Of(*waiting).empty());
  EXPECT_TRUE(link.Alive("g0", 100));

  // The leader's goodbye: the started request fails, the waiting one runs on g1.
  g0->Goodbye(100, "rank 1 failed all_to_all");
  const std::vector<TokenEvent> failed = events.WaitFor(*started, 2);
  ASSERT_EQ(failed.size(), 2u);
  EXPECT_EQ(failed[1].finish, FinishReason::kError);
  EXPECT_EQ(failed[1].error, kGroupLostError);
  gen = g1->Next<Generate>();
  ASSERT_TRUE(gen);
  EXPECT_EQ(gen->request_id, *waiting);
  EXPECT_EQ(gen->token_ids, Prompt().token_ids);
  EXPECT_TRUE(events.Of(*waiting).empty());
  ASSERT_TRUE(WaitUntil([&] { return !link.Group("g0")->alive; }));
  EXPECT_TRUE(link.Alive("g1", 200));
  EXPECT_EQ(g0->Heartbeat(), false);  // The router forgot it.

  g1->Send(Token(*waiting, 7, FinishReason::kLength));
  const std::vector<TokenEvent> moved = events.WaitFor(*waiting, 1);
  ASSERT_EQ(moved.size(), 1u);
  EXPECT_EQ(moved[0].token_id, 7);
  EXPECT_EQ(moved[0].finish, FinishReason::kLength);

  // The restarted leader: same routing id (ROUTER_HANDOVER), new instance id.
  g0.reset();
  g0 = std::make_unique<FakeLeader>(link.endpoint(), "g0", 0, 101);
  ASSERT_TRUE(g0->Join());
  EXPECT_EQ(g0->Heartbeat(), true);
  ASSERT_TRUE(WaitUntil([&] { return link.Alive("g0", 101); }));
  // The old instance's goodbye, arriving late, is ignored.
  g0->Goodbye(100, "late");
  EXPECT_EQ(g0->Heartbeat(), true);
  EXPECT_TRUE(link.Alive("g0", 101));
}

TEST(WorkerLink, GoodbyeWithoutAnotherGroupRequeuesOnTheSameGroup) {
  Events events;
  Link link;
  auto g0 = std::make_unique<FakeLeader>(link.endpoint(), "g0", 0, 300);
  ASSERT_TRUE(g0->Join());
  ASSERT_TRUE(WaitUntil([&] { return link.Alive("g0", 300); }));
  auto waiting = link->Submit(Prompt(), events.Sink(), 0);
  ASSERT_TRUE(waiting.ok());
  ASSERT_TRUE(g0->Next<Generate>());
  g0->Goodbye(300, "rank 3 exited");
  ASSERT_TRUE(WaitUntil([&] { return !link.Group("g0")->alive; }));
  EXPECT_EQ(link.Group("g0")->queued, 1u);  // Waits for a group to come back.
  EXPECT_TRUE(events.Of(*waiting).empty());
  g0.reset();
  g0 = std::make_unique<FakeLeader>(link.endpoint(), "g0", 0, 301);
  ASSERT_TRUE(g0->Join());
  auto gen = g0->Next<Generate>();
  ASSERT_TRUE(gen);
  EXPECT_EQ(gen->request_id, *waiting);
}

// What Worker::SendGoodbye relies on (common/wire/wire.h): a message still queued when its socket
// is closed leaves within the socket's linger, which Context::Close waits for. Here the router is
// not even bound when the leader's socket closes, so LINGER 0 would have dropped the goodbye.
TEST(WorkerLink, LingerCarriesAGoodbyeQueuedAtClose) {
  const std::string endpoint = IpcEndpoint("late-router");
  wire::Context leader_context;
  wire::SocketOptions o;
  o.routing_id = "w/g0/0";
  auto leader = wire::WorkerSocket::Connect(leader_context, wire::Role::kDealer, endpoint, o);
  ASSERT_TRUE(leader.ok()) << leader.status().ToString();
  ASSERT_TRUE((*leader)->Send(WorkerGoodbye{"g0", 42, "queued"}).ok());
  ASSERT_TRUE((*leader)->SetLinger(kWaitMs).ok());
  leader->reset();

  wire::Context router_context;
  auto router = wire::WorkerSocket::Bind(router_context, wire::Role::kRouter, endpoint);
  ASSERT_TRUE(router.ok()) << router.status().ToString();
  leader_context.Close();  // Returns once the goodbye is out.
  auto in = (*router)->Receive(0);
  if (!in) in = (*router)->Receive(kWaitMs);
  ASSERT_TRUE(in);
  EXPECT_EQ(in->peer, "w/g0/0");
  ASSERT_TRUE(std::holds_alternative<WorkerGoodbye>(in->message));
  EXPECT_EQ(std::get<WorkerGoodbye>(in->message).reason, "queued");
}

// A RequestExecutor whose every request produces one token at once (so it has started).
class OneTokenExecutor : public RequestExecutor {
 public:
  void Submit(Generate request) override {
    ++active_;
    worker->PostEvent(Token(request.request_id, 9));
  }
  void Cancel(uint64_t) override {}
  uint32_t active() const override { return active_; }
  Worker* worker = nullptr;

 private:
  std::atomic<uint32_t> active_{0};
};

WorkerOptions LeaderOptions(const std::string& router_endpoint, uint32_t rank) {
  WorkerOptions o;
  o.group = "g0";
  o.rank = rank;
  o.world_size = 2;
  o.model_name = "tiny";
  o.map_service_endpoint = IpcEndpoint("no-map-service");
  o.router_endpoint = router_endpoint;
  o.max_batch = 4;
  o.heartbeat_interval_ms = 20;
  o.heartbeat_timeout_ms = kHeartbeatTimeoutMs;
  o.register_wait_ms = 0;
  return o;
}

TEST(WorkerLink, GoodbyeFromARealLeaderEndsItsGroupAtOnce) {
  Events events;
  Link link;
  OneTokenExecutor executor;
  Worker worker(LeaderOptions(link.endpoint(), 0), ModelInfo{}, SteadyClock::Get(), &executor);
  executor.worker = &worker;
  ASSERT_TRUE(worker.Start().ok());
  std::atomic<bool> stop{false};
  std::thread control([&] { worker.Run([&] { return stop.load(); }, [] {}); });
  const bool joined = WaitUntil([&] { return link.Group("g0")->alive; });
  uint64_t id = 0;
  if (joined) {
    auto submitted = link->Submit(Prompt(), events.Sink(), 0);
    EXPECT_TRUE(submitted.ok()) << submitted.status().ToString();
    if (submitted.ok()) id = *submitted;
    EXPECT_EQ(events.WaitFor(id, 1).size(), 1u);  // Started.
  }
  stop = true;
  control.join();
  ASSERT_TRUE(joined);
  ASSERT_NE(id, 0u);

  // Right after the goodbye the worker's sockets are closed: the linger carries it out.
  const auto said = steady_clock::now();
  Status s = worker.SendGoodbye("rank 1 failed all_to_all");
  EXPECT_TRUE(s.ok()) << s.ToString();
  EXPECT_LE(steady_clock::now() - said, 3s);  // The 200 ms linger, and slack for a busy machine.
  const std::vector<TokenEvent> failed = events.WaitFor(id, 2);
  ASSERT_EQ(failed.size(), 2u);
  EXPECT_EQ(failed[1].finish, FinishReason::kError);
  EXPECT_EQ(failed[1].error, kGroupLostError);
  EXPECT_TRUE(WaitUntil([&] { return !link.Group("g0")->alive; }));
  EXPECT_TRUE(worker.SendGoodbye("twice").ok());  // Finished: nothing more to say.
}

TEST(WorkerLink, GoodbyeFromAFollowerRankSendsNothing) {
  Worker never_started(LeaderOptions("ipc:///nonexistent", 0), ModelInfo{}, SteadyClock::Get());
  EXPECT_TRUE(never_started.SendGoodbye("never joined").ok());
  Worker follower(LeaderOptions("", 1), ModelInfo{}, SteadyClock::Get());
  ASSERT_TRUE(follower.Start().ok());  // A follower has no router socket.
  EXPECT_TRUE(follower.SendGoodbye("rank 0 is gone").ok());
}

TEST(WorkerLink, ALoadingLeaderShowsItsProgressUntilItsHello) {
  Link link;
  RouterApi api({"tiny", 1024, {}, {}}, *link);
  LoadReporter reporter({"g0", link.endpoint(), 20});
  ASSERT_TRUE(reporter.Start().ok());
  reporter.Progress(25, 100);
  ASSERT_TRUE(WaitUntil([&] {
    auto g = link.Group("g0");
    return g && g->loading && g->loaded_bytes == 25 && g->total_bytes == 100;
  }));
  EXPECT_FALSE(link.Group("g0")->alive);
  EXPECT_EQ(link->View()->loading_groups(), 1);
  EXPECT_NE(link->View()->UnavailableReason().find("g0: loading the model (25% of"),
            std::string::npos)
      << link->View()->UnavailableReason();
  HttpRequest health;
  health.method = "GET";
  health.path = health.target = "/health";
  HttpResponse res = api.HandleNow(health);
  EXPECT_EQ(res.status, 503);
  auto body = nlohmann::json::parse(res.body);
  EXPECT_EQ(body["status"], "loading");
  EXPECT_EQ(body["groups"][0]["loading"]["loaded_bytes"], 25);
  EXPECT_EQ(body["groups"][0]["loading"]["total_bytes"], 100);
  EXPECT_DOUBLE_EQ(body["groups"][0]["loading"]["progress"].get<double>(), 0.25);
  EXPECT_TRUE(body["groups"][1]["loading"].is_null());
  bool retry_after = false;
  for (const auto& [k, v] : res.headers) retry_after = retry_after || k == "Retry-After";
  EXPECT_TRUE(retry_after);
  // A request meanwhile is refused as unavailable (the completions route answers 503).
  Events events;
  EXPECT_EQ(link->Submit(Prompt(), events.Sink(), 0).status().code(), ErrorCode::kUnavailable);

  reporter.Progress(100, 100);
  ASSERT_TRUE(WaitUntil([&] { return link.Group("g0")->loaded_bytes == 100; }));
  reporter.Stop();
  FakeLeader g0(link.endpoint(), "g0", 0, 7);
  ASSERT_TRUE(g0.Join());
  ASSERT_TRUE(WaitUntil([&] { return link.Alive("g0", 7); }));
  EXPECT_FALSE(link.Group("g0")->loading);
  res = api.HandleNow(health);
  EXPECT_EQ(res.status, 200);
  EXPECT_TRUE(nlohmann::json::parse(res.body)["groups"][0]["loading"].is_null());
  EXPECT_GT(reporter.reports_sent(), 0u);
}

TEST(WorkerLink, ASinkThatThrowsEndsOnlyItsOwnRequest) {
  Events events;
  Link link;
  FakeLeader g0(link.endpoint(), "g0", 0, 11);
  ASSERT_TRUE(g0.Join());
  ASSERT_TRUE(WaitUntil([&] { return link.Alive("g0", 11); }));
  auto bad = link->Submit(
      Prompt(), [](const TokenEvent&) { throw std::runtime_error("a rendering bug"); }, 0);
  auto good = link->Submit(Prompt(), events.Sink(), 0);
  ASSERT_TRUE(bad.ok() && good.ok());
  ASSERT_TRUE(g0.Next<Generate>());
  ASSERT_TRUE(g0.Next<Generate>());
  g0.Send(Token(*bad, 5));
  // The throwing request is cancelled at its leader; the link thread serves on.
  auto cancel = g0.Next<Cancel>();
  ASSERT_TRUE(cancel);
  EXPECT_EQ(cancel->request_id, *bad);
  g0.Send(Token(*good, 6));
  g0.Send(Token(*good, 7, FinishReason::kLength));
  auto got = events.WaitFor(*good, 2);
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[1].finish, FinishReason::kLength);
  EXPECT_EQ(g0.Heartbeat(), true);
}

}  // namespace
}  // namespace fmoe
