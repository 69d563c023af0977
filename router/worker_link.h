// The router's side of the wire: one thread owns a ROUTER socket that worker-group leaders
// connect to (Hello, Heartbeat) and a DEALER to the map service (admin pings for liveness).
// It keeps which groups are alive and publishes an immutable ClusterView snapshot that HTTP
// handlers read without blocking. Start() on the owner thread, then Run() on the link thread;
// View() from any thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/clock.h"
#include "common/messages.h"
#include "common/peer_table.h"
#include "common/status.h"
#include "common/wire.h"

namespace fmoe {

struct WorkerLinkOptions {
  std::string worker_endpoint = "tcp://127.0.0.1:5556";  // ROUTER bind. Default as manifest.
  std::string map_service_endpoint = "tcp://127.0.0.1:5555";
  std::string model_name;                // Leaders serving another model are refused.
  std::vector<std::string> group_names;  // Groups of the manifest, in order.
  int heartbeat_interval_ms = 500;       // Default: 500
  int heartbeat_timeout_ms = 3000;       // Default: 3000
};

struct GroupView {
  std::string name;
  bool alive = false;
  bool ever_connected = false;
  uint32_t world_size = 0;
  uint32_t max_batch = 0;
  uint32_t free_slots = 0;
  uint32_t active_requests = 0;
  int64_t silence_ms = -1;  // Since the last heartbeat; -1 if never seen.
  uint64_t instance_id = 0;
  uint64_t model_fingerprint = 0;
};

struct ClusterView {
  std::vector<GroupView> groups;
  bool map_service_alive = false;
  int64_t map_service_silence_ms = -1;  // Since the last admin reply; -1 if never.
  std::string map_service_endpoint;
  int alive_groups() const;
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

 private:
  struct Leader {
    std::string group;
    uint64_t instance_id = 0;
    uint64_t model_fingerprint = 0;
    uint32_t world_size = 0;
    uint32_t max_batch = 0;
    uint32_t free_slots = 0;
    uint32_t active_requests = 0;
  };

  void HandleWorker(const std::string& peer, const WorkerMessage& message);
  void OnHello(const std::string& peer, const WorkerHello& hello);
  void PingMapService();
  void Publish();

  WorkerLinkOptions options_;
  const Clock& clock_;
  wire::Context context_;
  std::unique_ptr<wire::WorkerSocket> workers_;
  std::unique_ptr<wire::MapSocket> map_service_;
  PeerTable<Leader> leaders_;  // Keyed by routing id. Link thread only.
  // Last time each group's leader was heard from, kept after it expires. Link thread only.
  std::map<std::string, int64_t> last_seen_by_group_;
  uint64_t ping_seq_ = 0;
  int64_t last_ping_ms_ = 0;
  int64_t last_map_reply_ms_ = -1;

  mutable std::mutex view_mu_;
  std::shared_ptr<const ClusterView> view_;  // GUARDED_BY(view_mu_)
};

}  // namespace fmoe
