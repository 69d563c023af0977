// The map service process's core: one thread owns the ROUTER socket, the registrations, the
// expert map stores and RocksDB (DESIGN sections 5 and 8). Ranks Register (recorded durably
// before the ack), heartbeat and stream their contexts; each context is matched against the
// model's MapStore by the sending rank's MapMatcher and the resulting PrefetchDirectives go to
// every live rank of the sender's group; a completed map is written to RocksDB, then to the
// store, then acknowledged (MapStored). Admin clients ask for Ping/Stats/Export/Import.
// Start() then Run() on the same thread; Run() returns when `stop` says so.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>

#include "common/clock.h"
#include "common/histogram.h"
#include "common/messages.h"
#include "common/peer_table.h"
#include "common/status.h"
#include "common/wire.h"
#include "map_service/map_matcher.h"
#include "map_service/map_store.h"
#include "map_service/store_db.h"

namespace fmoe {

struct MapServiceOptions {
  std::string endpoint = "tcp://127.0.0.1:5555";  // ROUTER bind. Default: tcp://127.0.0.1:5555
  std::string data_dir;                           // Required: RocksDB directory.
  bool sync = false;                              // fsync each write. Default: false
  int store_capacity = 1000;                      // Maps per model. Default: 1000
  int prefetch_distance = 3;                      // d. Default: 3
  int heartbeat_timeout_ms = 3000;         // A rank silent this long is dropped. Default: 3000
  bool semantic = true;                    // Semantic search at iteration start. Default: on
  bool delta = true;                       // Similarity-aware expert selection. Default: on
  uint32_t max_requests_per_rank = 65536;  // In-flight requests matched per rank. Default: 65536
  uint64_t max_import_bytes = 4ull << 30;  // Largest export file Import reads. Default: 4 GiB
};

struct MapServiceCounters {
  uint64_t registrations = 0;
  uint64_t registrations_refused = 0;
  uint64_t ranks_expired = 0;
  uint64_t iteration_starts = 0;
  uint64_t layers_observed = 0;
  uint64_t iteration_ends = 0;
  uint64_t from_unregistered = 0;  // Context messages from a peer that has not registered.
  uint64_t contexts_invalid = 0;   // Wrong shape, out of order, unknown request.
  uint64_t contexts_refused = 0;   // Beyond max_requests_per_rank.
  uint64_t directives_sent = 0;    // Directive messages sent (one per rank of the group).
  uint64_t directives_failed = 0;  // Sends that failed (the rank's queue is full or gone).
  uint64_t maps_stored = 0;
  uint64_t maps_replaced = 0;    // Stored maps that replaced another (deduplication).
  uint64_t maps_incomplete = 0;  // Iterations that ended before every layer was observed.
  uint64_t maps_failed = 0;      // Write failures: the map was not stored nor acknowledged.
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
  // Stored maps of a model (0 when unknown).
  uint32_t stored_maps(uint64_t fingerprint) const;

 private:
  // One model's store; `store` has a stable address (matchers refer to it).
  struct ModelMaps {
    ModelRow shape;
    std::unique_ptr<MapStore> store;
    uint64_t next_id = 1;
    uint64_t inserted = 0;
    uint64_t replaced = 0;
  };
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
  void DropPeer(const std::string& peer);
  Result<ModelMaps*> OpenModel(const ModelRow& shape);
  // Persists, then stores, one map; fills `row->id` and `row->row`.
  Result<InsertResult> StoreMap(ModelMaps& model, MapRow* row);
  void OnContext(const std::string& peer, const MapMessage& message);
  void SendDirectives(const std::string& group, const std::vector<PrefetchDirective>& directives);
  Result<std::string> Export(const AdminRequest& request);
  Result<std::string> Import(const AdminRequest& request);
  Result<ModelMaps*> ModelFor(uint64_t fingerprint);

  MapServiceOptions options_;
  const Clock& clock_;
  int64_t started_ms_ = 0;
  wire::Context context_;
  std::unique_ptr<wire::MapSocket> socket_;
  std::unique_ptr<StoreDb> db_;
  std::unordered_map<uint64_t, ModelRow> models_;
  PeerTable<RankState> ranks_;
  std::unordered_map<uint64_t, std::unique_ptr<ModelMaps>> stores_;
  std::unordered_map<std::string, std::unique_ptr<MapMatcher>> matchers_;  // Per rank peer.
  std::vector<PrefetchDirective> directives_;                              // Scratch.
  MapServiceCounters counters_;
  Histogram match_us_ = Histogram::LatencyUs();   // Context received -> its directives sent.
  Histogram insert_us_ = Histogram::LatencyUs();  // Completed map -> written and stored.
  uint64_t contexts_ = 0;                         // Context messages received.
  int64_t rate_window_start_ms_ = 0;
  uint64_t rate_window_start_count_ = 0;
  double ingest_rate_ = 0.0;  // Contexts per second over the last full 10 s window.
};

}  // namespace fmoe
