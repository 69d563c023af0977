// The map service process's core: one thread owns the ROUTER socket, the registrations and the
// RocksDB store (DESIGN sections 5 and 8). Ranks Register (recorded durably before the ack),
// heartbeat, and stream contexts; admin clients ask for Ping/Stats. Start() then Run() on the
// same thread; Run() returns when `stop` says so. Matching and the expert map store arrive with
// the store (issue: map service); this file owns ingest, liveness and persistence of shapes.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>

#include "common/clock.h"
#include "common/messages.h"
#include "common/peer_table.h"
#include "common/status.h"
#include "common/wire.h"
#include "map_service/store_db.h"

namespace fmoe {

struct MapServiceOptions {
  std::string endpoint = "tcp://127.0.0.1:5555";  // ROUTER bind. Default: tcp://127.0.0.1:5555
  std::string data_dir;                           // Required: RocksDB directory.
  bool sync = false;                              // fsync each write. Default: false
  int store_capacity = 1000;                      // Maps per model. Default: 1000
  int prefetch_distance = 3;                      // d. Default: 3
  int heartbeat_timeout_ms = 3000;  // A rank silent this long is dropped. Default: 3000
};

struct MapServiceCounters {
  uint64_t registrations = 0;
  uint64_t registrations_refused = 0;
  uint64_t ranks_expired = 0;
  uint64_t iteration_starts = 0;
  uint64_t layers_observed = 0;
  uint64_t iteration_ends = 0;
  uint64_t from_unregistered = 0;  // Context messages from a peer that has not registered.
  uint64_t admin_requests = 0;
};

class MapService {
 public:
  MapService(MapServiceOptions options, const Clock& clock);
  ~MapService();

  // Opens the store and binds the socket. Errors are one line, e.g.
  // "data directory /d is in use by another map service (its RocksDB lock is held)".
  Status Start();
  // Serves until stop() returns true (checked at least every 100 ms).
  void Run(const std::function<bool()>& stop);

  const MapServiceCounters& counters() const { return counters_; }
  // The Stats admin reply body (JSON object text).
  std::string StatsJson() const;

 private:
  struct RankState {
    std::string group;
    uint32_t rank = 0;
    uint32_t world_size = 0;
    uint64_t instance_id = 0;
    uint64_t model_fingerprint = 0;
  };

  void Handle(const std::string& peer, const MapMessage& message);
  RegisterAck OnRegister(const std::string& peer, const Register& reg);
  void OnAdmin(const std::string& peer, const AdminRequest& request);
  bool FromRegistered(const std::string& peer);
  void Reply(const std::string& peer, const MapMessage& message);
  void ExpireRanks();

  MapServiceOptions options_;
  const Clock& clock_;
  int64_t started_ms_ = 0;
  wire::Context context_;
  std::unique_ptr<wire::MapSocket> socket_;
  std::unique_ptr<StoreDb> db_;
  std::unordered_map<uint64_t, ModelRow> models_;
  PeerTable<RankState> ranks_;
  MapServiceCounters counters_;
};

}  // namespace fmoe
