// The map service process's core (DESIGN sections 5 and 8). The service thread owns the ROUTER
// socket, the registrations, the matchers and the expert map stores; the store writer thread
// (store_writer.h) owns RocksDB and the export/import files, so no disk write, fsync or file
// delays a directive. Ranks Register (recorded durably before the ack), heartbeat and stream
// their contexts; each context is matched against the model's MapStore by the sending rank's
// MapMatcher and the resulting PrefetchDirectives go to every live rank of the sender's group. A
// completed map waits for its model's turn, is written to RocksDB by the writer, then put in the
// store, then acknowledged (MapStored). Admin clients ask for Ping/Stats/Export/Import.
// Start() then Run() on the same thread; Run() returns when `stop` says so, after the drain.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/clock.h"
#include "common/histogram.h"
#include "common/peer_table.h"
#include "common/status.h"
#include "common/wire/messages.h"
#include "common/wire/wire.h"
#include "map_service/export_file.h"
#include "map_service/map_matcher.h"
#include "map_service/map_store.h"
#include "map_service/store_db.h"
#include "map_service/store_health.h"
#include "map_service/store_writer.h"

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
  // Memory all models' stores may take together (MapStore::BytesFor at store_capacity): a
  // registration or import of a model beyond it is refused, a stored model beyond it is not
  // loaded at start. Default: 4096 (MiB)
  uint64_t memory_limit_mb = 4096;
  // Disk trouble: retry backoff and log interval while the store is degraded. Default: 1 s to
  // 30 s, a line per 10 s
  StoreHealthOptions store_health;
  // Durable work pending at once: store writer jobs queued or running (map and registration
  // writes, exports, imports) plus completed maps waiting for their write. At the limit new work
  // is refused (README, "Back-pressure"). Default: 1024
  uint32_t max_pending_writes = 1024;
  int drain_timeout_ms = 2000;  // At stop, how long pending writes may still take. Default: 2000
  // The store writer thread's nice value, 0..19: its work yields the CPU to matching. Default: 10
  int writer_nice = 10;
  // Tests only: runs on the store writer before each job (StoreWriterOptions). Default: none
  std::function<void(std::stop_token)> before_store_job;
  // Tests only: write failures injected under RocksDB (StoreDbOptions). Default: none
  std::shared_ptr<StoreFaults> store_faults;
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
  uint64_t maps_failed = 0;   // Write failures (or a degraded store): not stored nor acknowledged.
  uint64_t maps_dropped = 0;  // Not stored nor acknowledged: max_pending_writes were pending.
  uint64_t maps_abandoned = 0;  // Not stored nor acknowledged: still pending when the drain ended.
  uint64_t busy_refusals = 0;   // Registrations and admin requests refused at max_pending_writes.
  uint64_t held_dropped = 0;    // Beyond kMaxHeldPerPeer while the peer's registration was written.
  uint64_t admin_requests = 0;
  uint64_t models_dropped = 0;
};

class MapService {
 public:
  MapService(MapServiceOptions options, const Clock& clock);
  ~MapService();

  // Opens the store and binds the socket. Errors are one line, e.g.
  // "data directory /d is in use by another map service (its RocksDB lock is held)".
  Status Start();
  // Serves until stop() returns true (checked at least every 100 ms), then stops reading, gives
  // pending writes up to drain_timeout_ms (acknowledging those written), abandons the rest and
  // returns.
  void Run(const std::function<bool()>& stop);

  const MapServiceCounters& counters() const { return counters_; }
  // The Stats admin reply body (JSON object text).
  std::string StatsJson() const;
  // Stored maps of a model (0 when unknown).
  uint32_t stored_maps(uint64_t fingerprint) const;

 private:
  struct ImportState;
  // A completed map on its way to disk, then into the store, then to its sender.
  struct PendingMap {
    MapRow row;
    std::string peer;                     // Gets MapStored; empty for an imported map.
    std::shared_ptr<ImportState> import;  // The import it comes from, or null.
    std::chrono::steady_clock::time_point completed;
  };
  // One model's store; `store` has a stable address (matchers refer to it). Its maps are written
  // one at a time: a map is planned (its row, the entry it replaces) against the store that holds
  // every map written before it, so the store only ever holds what is on disk.
  struct ModelMaps {
    ModelRow shape;
    std::unique_ptr<MapStore> store;
    uint64_t next_id = 1;
    uint64_t inserted = 0;
    uint64_t replaced = 0;
    bool recorded = false;  // Its model record is on disk.
    int recording = 0;      // Writes in flight that record it (registrations, an import's).
    bool writing = false;   // One of its maps is with the store writer.
    bool dropping = false;  // Its removal is with the store writer (StartDrop).
    uint64_t bytes = 0;     // MapStore::BytesFor its store.
    std::deque<PendingMap> completed;  // From contexts, in completion order.
    std::deque<PendingMap> imported;   // From imports; written while `completed` is empty.
  };
  // A stored model not loaded at start (beyond memory_limit_mb, or a shape no store can take):
  // its records stay on disk until it is dropped.
  struct NotLoaded {
    ModelRow shape;
    std::string reason;
  };
  struct RankState {
    std::string group;
    uint32_t rank = 0;
    uint32_t world_size = 0;
    uint64_t instance_id = 0;
    uint64_t model_fingerprint = 0;
  };

  void Turn(int timeout_ms, bool read_socket);
  void Drain();
  void Handle(const std::string& peer, const MapMessage& message);
  void OnRegister(const std::string& peer, const Register& reg);
  // `recording`: the registration's write was in flight (it counted in the model's recording).
  void OnRegistered(const std::string& peer, const Register& reg, const Status& written,
                    bool recording);
  void ReleaseHeld(const std::string& peer);
  void OnAdmin(const std::string& peer, const AdminRequest& request);
  bool FromRegistered(const std::string& peer);
  void Reply(const std::string& peer, const MapMessage& message);
  void ReplyAdmin(const std::string& peer, uint64_t id, const char* op, const std::string& path,
                  const Result<std::string>& body);
  void ExpireRanks();
  void DropPeer(const std::string& peer);
  Result<ModelMaps*> OpenModel(const ModelRow& shape);
  MapStoreOptions StoreOptions(const ModelRow& shape) const;
  uint64_t memory_used() const;
  Status CheckShape(const ModelRow& shape, uint64_t* bytes) const;
  void ForgetIfUnrecorded(uint64_t fingerprint);
  void OnContext(const std::string& peer, const MapMessage& message);
  void SendDirectives(const std::string& group, const std::vector<PrefetchDirective>& directives);
  Result<ModelMaps*> ModelFor(uint64_t fingerprint);

  // Durable work (map_service_writes.cc).
  size_t pending_writes() const;
  bool Busy(std::string* why);
  void QueueCompletedMap(ModelMaps& model, PendingMap map);
  void PumpWrites(ModelMaps& model);
  void PumpAllWrites();
  void MapSettled(ModelMaps& model, PendingMap& map, const Status& status,
                  const InsertResult& plan);
  void StartExport(const std::string& peer, const AdminRequest& request);
  void StartImport(const std::string& peer, const AdminRequest& request);
  void OnImportRead(const std::shared_ptr<ImportState>& import, Result<MapExportContents> file);
  void QueueImportedMaps(const std::shared_ptr<ImportState>& import, ModelMaps& model,
                         std::vector<MapRow> maps);
  void FinishImport(ImportState& import, const Status& status);
  void AbandonPendingWrites();
  void StartDrop(const std::string& peer, const AdminRequest& request);
  void OnDropped(const std::string& peer, uint64_t id, uint64_t fingerprint,
                 const Result<uint64_t>& removed);
  // Disk trouble: a store write's result (true when it degraded the store), the recovery job.
  bool StoreWriteFailed(const Status& status);
  void MaybeRecoverStore();

  MapServiceOptions options_;
  const Clock& clock_;
  int64_t started_ms_ = 0;
  wire::Context context_;
  std::unique_ptr<wire::MapSocket> socket_;
  wire::Notifier writer_done_;  // The store writer finished a job.
  std::unique_ptr<StoreWriter> writer_;
  size_t completed_waiting_ = 0;  // Completed maps in every model's `completed` queue.
  bool dropping_ = false;         // Completed maps are being dropped (back-pressure).
  uint64_t dropped_since_ = 0;    // maps_dropped when dropping began.
  // Per peer whose registration is being written: the messages it sent since, in order.
  static constexpr size_t kMaxHeldPerPeer = 1024;
  std::unordered_map<std::string, std::deque<MapMessage>> held_;
  PeerTable<RankState> ranks_;
  std::unordered_map<uint64_t, std::unique_ptr<ModelMaps>> stores_;
  std::unordered_map<uint64_t, NotLoaded> not_loaded_;
  StoreHealth health_;
  std::unordered_map<std::string, std::unique_ptr<MapMatcher>> matchers_;  // Per rank peer.
  std::vector<PrefetchDirective> directives_;                              // Scratch.
  MapServiceCounters counters_;
  Histogram match_us_ = Histogram::LatencyUs();   // Context received -> its directives sent.
  Histogram insert_us_ = Histogram::LatencyUs();  // Completed map -> written and stored.
  uint64_t contexts_ = 0;                         // Context messages received.
  std::vector<bool> readable_;                    // Poll's scratch.
  int64_t last_expiry_ms_ = 0;
  int64_t rate_window_start_ms_ = 0;
  uint64_t rate_window_start_count_ = 0;
  double ingest_rate_ = 0.0;  // Contexts per second over the last full 10 s window.
};

}  // namespace fmoe
