// A worker rank's control plane: registration and heartbeats with the map service (every rank)
// and the router (the leader, rank 0), reconnection when either restarts, and the hand-off of
// requests to the engine. One thread owns both sockets: Start() then Run() on that thread; the
// engine runs on its own thread and hands its events back through PostEvent (any thread), which
// wakes Run. Inference never waits on the map service: readiness is reported once registered,
// or after register_wait_ms without an answer. Without an executor (a rank that runs no model)
// a Generate is answered with an error event.
//
// Contexts (IterationStart, LayerObserved, IterationEnd) come from the engine thread through
// PublishContext, which never blocks: a bounded queue drops its oldest entry when full, and
// while the map service is not registered they are dropped (stale guidance is worthless), all
// counted. Directives from the map service go to `on_directive` on the control thread.
//
// A leader whose group is dead (a rank failed a collective) calls SendGoodbye once Run has
// returned, then exits: the router hears WorkerGoodbye at once, not after its heartbeat timeout.
// SendGoodbye returns once the goodbye is sent (at most 200 ms), so the process may then _exit.
//
// Link state, per peer (map service; router for the leader):
//   UNREGISTERED --(Register/Hello sent, ack accepted)--> REGISTERED
//   REGISTERED --(ack says unknown: the peer restarted)--> UNREGISTERED
//   REGISTERED --(no ack for heartbeat timeout)--> LOST --(any ack)--> REGISTERED
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/clock.h"
#include "common/model/model_config.h"
#include "common/status.h"
#include "common/wire/messages.h"
#include "common/wire/wire.h"
#include "gpu_worker/control/outbox.h"
#include "gpu_worker/core/request_executor.h"

namespace fmoe {

struct WorkerOptions {
  std::string group;                 // Required.
  uint32_t rank = 0;                 // Default: 0 (the leader)
  uint32_t world_size = 1;           // Default: 1
  std::string model_name;            // Required: the served model id.
  std::string map_service_endpoint;  // Required.
  std::string router_endpoint;       // Required for rank 0.
  uint32_t max_batch = 8;            // Default: 8
  int heartbeat_interval_ms = 500;   // Default: 500
  int heartbeat_timeout_ms = 3000;   // Default: 3000
  int register_wait_ms = 5000;       // Readiness waits this long for the map service. Default: 5000
  // The expert cache's totals for heartbeats; called on the control thread. Default: none
  std::function<ExpertFigures()> expert_figures;
  // The KV pool's figures for heartbeats; called on the control thread. Default: none
  std::function<KvFigures()> kv_figures;
  // The engine's prompt chunks for heartbeats; called on the control thread. Default: none
  std::function<EngineFigures()> engine_figures;
  // Where prefetch directives go (the expert cache); called on the control thread. Default: none
  std::function<void(const PrefetchDirective&)> on_directive;
  bool semantic = true;         // Ask the map service for semantic matching. Default: on
  bool delta = true;            // Ask for the similarity-aware selection. Default: on
  size_t context_queue = 4096;  // Contexts waiting to be sent; the oldest is dropped. Default: 4096
};

// The worker's side of the context stream, for logs and tests.
struct ContextStats {
  uint64_t published = 0;        // PublishContext calls.
  uint64_t sent = 0;             // Handed to the socket.
  uint64_t dropped_full = 0;     // Oldest dropped from the full queue.
  uint64_t dropped_offline = 0;  // Dropped while the map service was not registered.
  uint64_t send_failed = 0;      // The socket refused (its high-water mark was reached).
  uint64_t directives = 0;       // PrefetchDirectives received.
  uint64_t maps_stored = 0;      // MapStored acknowledgements received.
};

class Worker {
 public:
  // `executor` may be null (no model on this rank); it must outlive the worker. `outbox`: where
  // the compute thread posts events and contexts (it must outlive the worker); null: the worker
  // owns one of `options.context_queue` contexts.
  Worker(WorkerOptions options, ModelInfo model, const Clock& clock,
         RequestExecutor* executor = nullptr, Outbox* outbox = nullptr);
  ~Worker();

  // Any thread: queues a token event for the router and wakes Run (the outbox's PostEvent).
  void PostEvent(TokenEvent event) { outbox_->PostEvent(std::move(event)); }
  // Any thread, never blocks: queues a context (IterationStart, LayerObserved or IterationEnd)
  // for the map service and wakes Run (the outbox's PublishContext).
  void PublishContext(MapMessage context) { outbox_->PublishContext(std::move(context)); }
  ContextStats context_stats() const;

  Status Start();
  // Serves until stop() is true (checked every <= 50 ms); calls on_ready once.
  void Run(const std::function<bool()>& stop, const std::function<void()>& on_ready);
  // Control thread, after Run has returned; the worker is finished afterwards. The leader sends
  // WorkerGoodbye{group, instance id, reason (cut to the wire's string limit)} to the router,
  // never blocking on the send, then closes both sockets and waits at most kGoodbyeLingerMs for
  // the goodbye to leave. Other ranks (and a leader never started) do nothing and return OK.
  // Errors: the send's (kResourceExhausted when the router is not connected); the router then
  // notices by its heartbeat timeout.
  Status SendGoodbye(const std::string& reason);
  static constexpr int kGoodbyeLingerMs = 200;

  bool map_registered() const { return map_.state == LinkState::kRegistered; }
  bool router_registered() const { return router_.state == LinkState::kRegistered; }

 private:
  enum class LinkState { kUnregistered, kRegistered, kLost };
  struct Link {
    const char* name = "";
    LinkState state = LinkState::kUnregistered;
    int64_t last_sent_ms = -1;  // Last Register/Hello or heartbeat sent.
    int64_t last_ack_ms = -1;
    uint64_t seq = 0;
    bool refused_logged = false;
  };

  bool leader() const { return options_.rank == 0; }
  void Tick();
  // Dispatch* handle one message each, logging what its handler throws (a Generate that threw
  // is answered with an error event).
  void DispatchMap(const MapMessage& message);
  void DispatchRouter(const WorkerMessage& message);
  void OnMapMessage(const MapMessage& message);
  void OnRouterMessage(const WorkerMessage& message);
  void Acked(Link& link, bool known);
  void CheckLost(Link& link);
  void SendEvents();
  void SendContexts();

  WorkerOptions options_;
  ModelInfo model_;
  const Clock& clock_;
  uint64_t instance_id_ = 0;
  wire::Context context_;
  std::unique_ptr<wire::MapSocket> map_socket_;
  std::unique_ptr<wire::WorkerSocket> router_socket_;
  Link map_{"map service"};
  Link router_{"router"};
  int64_t started_ms_ = 0;
  RequestExecutor* executor_;
  std::unique_ptr<Outbox> own_outbox_;  // When the constructor was given none.
  Outbox* outbox_;
  mutable std::mutex stats_mu_;
  ContextStats context_stats_;  // GUARDED_BY(stats_mu_); published and dropped_full: the outbox's
};

}  // namespace fmoe
