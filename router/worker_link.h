// The router's side of the wire: one thread owns a ROUTER socket that worker-group leaders
// connect to (Hello, Heartbeat, Generate, Cancel, TokenEvent) and a DEALER to the map service
// (admin pings for liveness). It keeps which groups are alive and publishes an immutable
// ClusterView snapshot that HTTP handlers read without blocking. Start() on the owner thread,
// then Run() on the link thread; View(), Submit() and Cancel() from any thread.
//
// Dispatch: Submit queues a request on the least-loaded live group (queued + running), bounded
// by the group's queue_limit. The link thread hands a group's queued requests to its leader
// while fewer than max_batch of them run there, so waiting happens here, where it is counted
// and can be retried. When a group is lost, its requests that produced no token yet go back to
// the front of another live group's queue; started ones end with an error. A group is lost when
// its leader's heartbeats stop, or at once when the leader says WorkerGoodbye (a rank died). A
// request past its deadline is cancelled and ends with an error.
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/clock.h"
#include "common/peer_table.h"
#include "common/status.h"
#include "common/wire/messages.h"
#include "common/wire/wire.h"

namespace fmoe {

// How a dispatched request ended, besides its worker's own events.
inline constexpr const char* kGroupLostError = "worker group lost";
inline constexpr const char* kTimeoutError = "request timed out";
inline constexpr const char* kNoGroupError = "no worker group is alive";
inline constexpr const char* kStoppingError = "the router is stopping";

// Called on the link thread with each of a request's events; the last one has finish set.
using RequestSink = std::function<void(const TokenEvent&)>;

struct WorkerLinkOptions {
  std::string worker_endpoint = "tcp://127.0.0.1:5556";  // ROUTER bind. Default as manifest.
  std::string map_service_endpoint = "tcp://127.0.0.1:5555";
  std::string model_name;  // Leaders serving another model are refused.
  // The served model's fingerprint (LoadModelInfo of the manifest's model.path, as each worker
  // computes it): a leader reporting another is refused. 0: not checked. Default: 0
  uint64_t model_fingerprint = 0;
  std::vector<std::string> group_names;  // Groups of the manifest, in order.
  // Ranks per group (same order; the manifest's workers): a leader reporting another world size
  // is refused. Missing or 0: not checked. Default: none
  std::vector<uint32_t> world_sizes;
  std::vector<int> queue_limits;    // Per group (same order). Default: 64 each
  int heartbeat_interval_ms = 500;  // Default: 500
  int heartbeat_timeout_ms = 3000;  // Default: 3000
};

struct GroupView {
  std::string name;
  bool alive = false;
  bool ever_connected = false;
  uint32_t world_size = 0;
  uint32_t max_batch = 0;
  uint32_t free_slots = 0;
  uint32_t active_requests = 0;
  ExpertFigures experts;    // The leader's expert cache totals, from its last heartbeat.
  KvFigures kv;             // Its KV pool, from its last heartbeat.
  EngineFigures engine;     // Its engine's prompt chunks, from its last heartbeat.
  uint32_t queued = 0;      // Waiting in the router for this group.
  uint32_t running = 0;     // Handed to its leader, not finished.
  int64_t silence_ms = -1;  // Since the last heartbeat; -1 if never seen.
  uint64_t instance_id = 0;
  uint64_t model_fingerprint = 0;
  // Its leader is loading the model (reports within the heartbeat timeout, no Hello yet).
  bool loading = false;
  uint64_t loaded_bytes = 0;
  uint64_t total_bytes = 0;  // 0 while unknown.
};

struct ClusterView {
  std::vector<GroupView> groups;
  bool map_service_alive = false;
  int64_t map_service_silence_ms = -1;  // Since the last admin reply; -1 if never.
  // "up" (a ping answered within the heartbeat timeout), "connecting" (no answer yet, within the
  // heartbeat timeout of the router's start) or "down". The router serves in every state.
  std::string map_service_state = "connecting";
  std::string map_service_endpoint;
  double map_match_p50_us = 0.0;  // From the map service's last Stats reply.
  double map_match_p99_us = 0.0;
  uint64_t map_match_count = 0;
  // Hellos refused since start, by reason: "group" (not in the manifest), "model" (another
  // model name), "fingerprint" (another model fingerprint), "world_size".
  std::map<std::string, uint64_t> hellos_refused;
  int alive_groups() const;
  int loading_groups() const;  // Not alive and loading.
  // Why no group can serve, e.g. "g0: no heartbeat for 3.4 s; g1: never connected".
  std::string UnavailableReason() const;
};

class WorkerLink {
 public:
  WorkerLink(WorkerLinkOptions options, const Clock& clock);
  ~WorkerLink();

  Status Start();
  void Run(const std::atomic<bool>& stop);
  std::shared_ptr<const ClusterView> View() const;

  // Any thread. Queues `request` (its request_id is assigned here and returned) on the
  // least-loaded live group. kUnavailable when no group is alive, kResourceExhausted when that
  // group's queue is full. `timeout_ms` > 0 bounds the whole request.
  Result<uint64_t> Submit(Generate request, RequestSink sink, int64_t timeout_ms);
  // Any thread. The choices of one client request (n > 1, several prompts), admitted or refused
  // whole: refused as Submit refuses one request (the least-loaded group's queue full), else
  // every one queued, each on the least-loaded group then, even past a queue's limit. Ids in
  // the order given.
  struct Submission {
    Generate request;
    RequestSink sink;
  };
  Result<std::vector<uint64_t>> SubmitAll(std::vector<Submission> requests, int64_t timeout_ms);
  // Any thread. The request ends with kCancelled (its leader is told when it runs there).
  void Cancel(uint64_t request_id);
  // Any thread, never blocks: the router is stopping. Every open request ends at once with
  // kStoppingError (its leader told to cancel it where it runs), and later Submits are refused.
  void StopRequests();

 private:
  struct Leader {
    std::string group;
    uint64_t instance_id = 0;
    uint64_t model_fingerprint = 0;
    uint32_t world_size = 0;
    uint32_t max_batch = 0;
    uint32_t free_slots = 0;
    uint32_t active_requests = 0;
    ExpertFigures experts;
    KvFigures kv;
    EngineFigures engine;
  };

  struct Pending {
    Generate request;
    RequestSink sink;
    int64_t deadline_ms = 0;  // 0 = none.
    std::string group;
    std::string peer;      // The leader it runs on; empty while queued.
    bool started = false;  // A token event arrived.
  };

  void HandleWorker(const std::string& peer, const WorkerMessage& message);
  void OnHello(const std::string& peer, const WorkerHello& hello);
  void OnGoodbye(const std::string& peer, const WorkerGoodbye& goodbye);
  void OnLoading(const WorkerLoading& loading);
  void OnTokenEvent(const std::string& peer, const TokenEvent& event);
  void PingMapService();
  void Publish();
  void Dispatch();
  void GroupLost(const std::string& group);
  // Ends every open request with kStoppingError, cancelling the running ones at their leaders.
  void EndOpenRequests();
  void Finish(uint64_t id, FinishReason reason, const std::string& error);
  // Calls a request's sink; what it throws is logged and cancels the request.
  void Deliver(const RequestSink& sink, const TokenEvent& event);
  // Least-loaded live group, or "" (mu_ held).
  std::string PickGroup() const;

  WorkerLinkOptions options_;
  const Clock& clock_;
  wire::Context context_;
  std::unique_ptr<wire::WorkerSocket> workers_;
  std::unique_ptr<wire::MapSocket> map_service_;
  PeerTable<Leader> leaders_;  // Keyed by routing id. Link thread only.
  struct Loading {
    uint64_t loaded_bytes = 0;
    uint64_t total_bytes = 0;
    int64_t last_ms = 0;
  };
  // Groups whose leader reports loading, until its Hello or the heartbeat timeout. Link thread
  // only.
  std::map<std::string, Loading> loading_;
  // Last time each group's leader was heard from, kept after it expires. Link thread only.
  std::map<std::string, int64_t> last_seen_by_group_;
  std::map<std::string, uint64_t> hellos_refused_;  // By reason. Link thread only.
  uint64_t ping_seq_ = 0;
  int64_t last_ping_ms_ = 0;
  int64_t last_map_reply_ms_ = -1;
  int64_t started_ms_ = 0;
  double map_p50_us_ = 0.0, map_p99_us_ = 0.0;
  uint64_t map_count_ = 0;

  mutable std::mutex view_mu_;
  std::shared_ptr<const ClusterView> view_;  // GUARDED_BY(view_mu_)

  // Dispatch state, shared with Submit/Cancel.
  mutable std::mutex mu_;
  uint64_t next_id_ = 1;                                // GUARDED_BY(mu_)
  std::map<uint64_t, Pending> requests_;                // GUARDED_BY(mu_)
  std::map<std::string, std::deque<uint64_t>> queues_;  // Per group. GUARDED_BY(mu_)
  std::map<std::string, uint32_t> running_;             // Per group. GUARDED_BY(mu_)
  std::vector<uint64_t> cancels_;                       // GUARDED_BY(mu_)
  bool stopping_ = false;                               // GUARDED_BY(mu_)
  bool stop_ended_ = false;  // EndOpenRequests ran after StopRequests. Link thread only.
  // Groups alive and their max_batch, refreshed by the link thread. GUARDED_BY(mu_)
  std::map<std::string, std::pair<std::string, uint32_t>> live_;  // group -> (peer, max_batch)
  wire::Notifier notifier_;
};

}  // namespace fmoe
