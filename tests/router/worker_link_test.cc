// The router's worker link over real ZeroMQ (ipc endpoints), with fake leaders: DEALERs made with
// common/wire.h under the worker's routing id w/<group>/<rank>. Covers WorkerGoodbye: from the
// group's current leader it takes the group out of service at once (started requests fail with
// kGroupLostError, dispatched-but-not-started ones go to another live group), a goodbye with a
// stale instance id or from a peer that is not the leader changes nothing, and the restarted
// leader (same routing id, new instance id) joins again. The last tests drive a real
// Worker::SendGoodbye: the goodbye leaves even though the socket is closed right after it.
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
#include "common/model_config.h"
#include "common/wire.h"
#include "gpu_worker/worker.h"

namespace fmoe {
namespace {

using namespace std::chrono_literals;
using std::chrono::steady_clock;

constexpr int kWaitMs = 30000;  // Upper bound for a delivery (a loaded machine); normally ms.
constexpr auto kWait = std::chrono::milliseconds(kWaitMs);
constexpr int kHeartbeatTimeoutMs = 60000;

// A fresh ipc endpoint per call: tests may run in parallel.
std::string IpcEndpoint(const char* what) {
  static std::atomic<int> next{0};
  return "ipc:///tmp/fmoe-worker-link-test-" + std::to_string(getpid()) + "-" + what + "-" +
         std::to_string(next++);
}

// Polls `done` until it holds or kWait passes.
bool WaitUntil(const std::function<bool()>& done) {
  const auto end = steady_clock::now() + kWait;
  while (!done()) {
    if (steady_clock::now() >= end) return false;
    std::this_thread::sleep_for(2ms);
  }
  return true;
}

// Every event each request's sink got (sinks run on the link thread).
class Events {
 public:
  RequestSink Sink() {
    return [this](const TokenEvent& ev) {
      std::lock_guard<std::mutex> lock(mu_);
      events_[ev.request_id].push_back(ev);
      cv_.notify_all();
    };
  }
  std::vector<TokenEvent> Of(uint64_t id) const {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = events_.find(id);
    return it == events_.end() ? std::vector<TokenEvent>{} : it->second;
  }
  // Waits until request `id` has at least `n` events.
  std::vector<TokenEvent> WaitFor(uint64_t id, size_t n) const {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, kWait, [&] {
      auto it = events_.find(id);
      return it != events_.end() && it->second.size() >= n;
    });
    auto it = events_.find(id);
    return it == events_.end() ? std::vector<TokenEvent>{} : it->second;
  }

 private:
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  std::map<uint64_t, std::vector<TokenEvent>> events_;
};

// A WorkerLink running on its own thread, serving groups g0 and g1 of model "tiny".
class Link {
 public:
  Link() : link_(Options(), SteadyClock::Get()) {
    Status s = link_.Start();
    EXPECT_TRUE(s.ok()) << s.ToString();
    thread_ = std::thread([this] { link_.Run(stop_); });
  }
  ~Link() {
    stop_ = true;
    thread_.join();
  }
  WorkerLink& operator*() { return link_; }
  WorkerLink* operator->() { return &link_; }
  const std::string& endpoint() const { return endpoint_; }

  std::optional<GroupView> Group(const std::string& name) const {
    for (const GroupView& g : link_.View()->groups) {
      if (g.name == name) return g;
    }
    return std::nullopt;
  }
  bool Alive(const std::string& name, uint64_t instance_id) const {
    auto g = Group(name);
    return g && g->alive && g->instance_id == instance_id;
  }

 private:
  WorkerLinkOptions Options() {
    WorkerLinkOptions o;
    o.worker_endpoint = endpoint_;
    o.map_service_endpoint = IpcEndpoint("nowhere");  // No map service: pings go unanswered.
    o.model_name = "tiny";
    o.group_names = {"g0", "g1"};
    o.heartbeat_interval_ms = 100;
    o.heartbeat_timeout_ms = kHeartbeatTimeoutMs;
    return o;
  }

  std::string endpoint_ = IpcEndpoint("router");
  WorkerLink link_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

// A group leader played by the test: a DEALER under the worker's routing id.
class FakeLeader {
 public:
  FakeLeader(const std::string& endpoint, std::string group, uint32_t rank, uint64_t instance_id)
      : group_(std::move(group)), instance_id_(instance_id) {
    wire::SocketOptions o;
    o.routing_id = "w/" + group_ + "/" + std::to_string(rank);
    auto socket = wire::WorkerSocket::Connect(context_, wire::Role::kDealer, endpoint, o);
    EXPECT_TRUE(socket.ok()) << socket.status().ToString();
    if (socket.ok()) socket_ = std::move(socket).value();
  }

  void Send(const WorkerMessage& m) {
    Status s = socket_->Send(m);
    EXPECT_TRUE(s.ok()) << s.ToString();
  }
  // The next message of type T, skipping others; nullopt after kWait.
  template <class T>
  std::optional<T> Next() {
    const auto end = steady_clock::now() + kWait;
    while (steady_clock::now() < end) {
      auto in = socket_->Receive(10);
      if (in && std::holds_alternative<T>(in->message)) return std::get<T>(in->message);
    }
    return std::nullopt;
  }
  // Hello, answered accepted.
  bool Join() {
    WorkerHello hello;
    hello.group = group_;
    hello.model_name = "tiny";
    hello.instance_id = instance_id_;
    hello.max_batch = 4;
    hello.free_slots = 4;
    Send(hello);
    auto ack = Next<WorkerHelloAck>();
    return ack && ack->accepted;
  }
  // A heartbeat and its ack's `known`. The router handles a peer's messages in order, so the
  // ack also says that everything sent before it was handled.
  std::optional<bool> Heartbeat() {
    WorkerHeartbeat hb;
    hb.group = group_;
    hb.instance_id = instance_id_;
    hb.seq = ++seq_;
    Send(hb);
    auto ack = Next<WorkerHeartbeatAck>();
    if (!ack) return std::nullopt;
    EXPECT_EQ(ack->seq, seq_);
    return ack->known;
  }
  void Goodbye(uint64_t instance_id, std::string reason) {
    Send(WorkerGoodbye{group_, instance_id, std::move(reason)});
  }

 private:
  std::string group_;
  uint64_t instance_id_;
  uint64_t seq_ = 0;
  wire::Context context_;
  std::unique_ptr<wire::WorkerSocket> socket_;
};

TokenEvent Token(uint64_t request_id, int32_t token_id, FinishReason finish = FinishReason::kNone) {
  TokenEvent ev;
  ev.request_id = request_id;
  ev.token_id = token_id;
  ev.finish = finish;
  return ev;
}

Generate Prompt() {
  Generate g;
  g.token_ids = {1, 2, 3};
  g.sampling.max_tokens = 4;
  return g;
}

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

// What Worker::SendGoodbye relies on (common/wire.h): a message still queued when its socket is
// closed leaves within the socket's linger, which Context::Close waits for. Here the router is
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

}  // namespace
}  // namespace fmoe
