// Test fixtures for the router's worker link, shared by its tests: a WorkerLink on its own
// thread over a fresh ipc endpoint, serving groups g0 and g1 of model "tiny"; leaders played by
// the test (DEALERs under the worker's routing id w/<group>/<rank>); every event each request's
// sink got. Header-only, for tests.
#pragma once

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
#include "common/wire/wire.h"
#include "router/http_server.h"
#include "router/worker_link.h"

namespace fmoe::link_testing {

using namespace std::chrono_literals;
using std::chrono::steady_clock;

inline constexpr int kWaitMs =
    30000;  // Upper bound for a delivery (a loaded machine); normally ms.
inline constexpr auto kWait = std::chrono::milliseconds(kWaitMs);
inline constexpr int kHeartbeatTimeoutMs = 60000;

// The socket files of the ipc endpoints this process made, removed when it exits.
class IpcFiles {
 public:
  ~IpcFiles() {
    std::lock_guard<std::mutex> lock(mu_);
    for (const std::string& path : paths_) ::unlink(path.c_str());
  }
  void Add(std::string path) {
    std::lock_guard<std::mutex> lock(mu_);
    paths_.push_back(std::move(path));
  }

 private:
  std::mutex mu_;
  std::vector<std::string> paths_;
};

// A fresh ipc endpoint per call: tests may run in parallel.
inline std::string IpcEndpoint(const char* what) {
  static std::atomic<int> next{0};
  static IpcFiles files;
  const std::string path = "/tmp/fmoe-worker-link-test-" + std::to_string(getpid()) + "-" + what +
                           "-" + std::to_string(next++);
  files.Add(path);
  return "ipc://" + path;
}

// Polls `done` until it holds or kWait passes.
inline bool WaitUntil(const std::function<bool()>& done) {
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
    // The view held while it is read: a range-for over View()->groups would free it at once.
    const auto view = link_.View();
    for (const GroupView& g : view->groups) {
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

inline TokenEvent Token(uint64_t request_id, int32_t token_id,
                        FinishReason finish = FinishReason::kNone) {
  TokenEvent ev;
  ev.request_id = request_id;
  ev.token_id = token_id;
  ev.finish = finish;
  return ev;
}

inline Generate Prompt() {
  Generate g;
  g.token_ids = {1, 2, 3};
  g.sampling.max_tokens = 4;
  return g;
}

// Records what the route answers; thread-safe (the link thread writes).
class Recorder final : public HttpResponder {
 public:
  void Respond(HttpResponse response) override {
    std::lock_guard<std::mutex> lock(mu_);
    status_ = response.status;
    body_ = response.body;
    done_ = true;
  }
  void BeginStream(int status, const std::string&,
                   std::vector<std::pair<std::string, std::string>>) override {
    std::lock_guard<std::mutex> lock(mu_);
    status_ = status;
  }
  void Write(std::string chunk) override {
    std::lock_guard<std::mutex> lock(mu_);
    body_ += chunk;
  }
  void End() override {
    std::lock_guard<std::mutex> lock(mu_);
    done_ = true;
  }
  void OnClose(std::function<void()>) override {}
  bool closed() const override { return false; }

  bool done() const {
    std::lock_guard<std::mutex> lock(mu_);
    return done_;
  }
  int status() const {
    std::lock_guard<std::mutex> lock(mu_);
    return status_;
  }
  std::string body() const {
    std::lock_guard<std::mutex> lock(mu_);
    return body_;
  }

 private:
  mutable std::mutex mu_;
  int status_ = 0;
  std::string body_;
  bool done_ = false;
};

}  // namespace fmoe::link_testing
