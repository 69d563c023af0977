// The map service's durable work (service thread; MapService owns one): completed maps through
// the store writer (store_writer.h) into RocksDB, then into their model's MapStore, then
// acknowledged to their sender (MapStored); exports, imports and drops of a model; recording a
// model or a registration for the service; back-pressure at max_pending_writes; the store's
// health when the disk fails (store_health.h) and its recovery; the drain at stop. A job's `run`
// runs on the store writer thread and touches only the database, the file and the state its
// lambdas share; everything else here runs on the service thread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "common/clock.h"
#include "common/histogram.h"
#include "common/status.h"
#include "common/wire/messages.h"
#include "common/wire/wire.h"
#include "map_service/export_file.h"
#include "map_service/map_service_options.h"
#include "map_service/model_registry.h"
#include "map_service/store_db.h"
#include "map_service/store_health.h"
#include "map_service/store_writer.h"

namespace fmoe {

// An import in progress: answered once, when its last map is settled or it fails.
struct ImportState {
  std::string peer;
  uint64_t id = 0;  // The AdminRequest's.
  std::string path;
  uint64_t fingerprint = 0;
  size_t remaining = 0;  // Maps queued or being written.
  uint64_t imported = 0;
  uint64_t replaced = 0;
  uint64_t skipped = 0;
  bool finished = false;  // Answered.
};

// What the durable work needs of the service that owns it (all called on the service thread).
struct MapWritesHost {
  // Sends `message` to `peer` (MapStored).
  std::function<void(const std::string& peer, const MapMessage& message)> reply;
  // Answers an admin request (`op` and `path` for the log).
  std::function<void(const std::string& peer, uint64_t id, const char* op, const std::string& path,
                     const Result<std::string>& body)>
      reply_admin;
  // Unregisters every rank serving the model; returns how many.
  std::function<size_t(uint64_t fingerprint)> drop_ranks_of;
  // One turn of the service loop without reading its socket (completions run), for the drain.
  std::function<void(int timeout_ms)> turn;
};

class MapWrites {
 public:
  MapWrites(const MapServiceOptions& options, const Clock& clock, ModelRegistry& models,
            MapServiceCounters& counters, Histogram& insert_us, MapWritesHost host);

  // Hands the opened database to the store writer thread (Start, after loading from it).
  void Open(std::unique_ptr<StoreDb> db);
  bool open() const { return writer_ != nullptr; }
  // Notified when the writer finished a job; RunCompletions then runs their `done` and, when
  // any ran, pumps every model's waiting maps.
  wire::Notifier& notifier() { return writer_done_; }
  void RunCompletions();
  // Submits a job of the service's own (a registration's record); false when the writer is full
  // or stopping.
  bool Submit(StoreJob job) { return writer_->TrySubmit(std::move(job)); }

  // Store writer jobs queued or running plus completed maps waiting for their write.
  size_t pending() const;
  // At max_pending_writes: counts a busy refusal and says why.
  bool Busy(std::string* why);
  size_t completed_waiting() const { return completed_waiting_; }

  // A completed map, for its model's turn at the writer; dropped (counted, logged once) past
  // max_pending_writes, never blocking.
  void QueueCompletedMap(ModelMaps& model, PendingMap map);
  void StartExport(const std::string& peer, const AdminRequest& request);
  void StartImport(const std::string& peer, const AdminRequest& request);
  // `fmoe maps --drop FP`: the model's ranks are dropped (they register again at their next
  // heartbeat, and get a fresh, empty store once the drop is done), its waiting maps discarded,
  // then the store writer removes its records; only then is its memory freed.
  void StartDrop(const std::string& peer, const AdminRequest& request);

  StoreHealth& health() { return health_; }
  const StoreHealth& health() const { return health_; }
  // A store write's result: a disk failure puts the store in its degraded state; true when it
  // is degraded.
  bool Failed(const Status& status) { return health_.Failed(status); }
  // Degraded and the backoff passed: the store writer tries to make the store writable again.
  void MaybeRecover();

  // At stop: exports and imports end early, writes get up to drain_timeout_ms, the rest is
  // abandoned (counted and logged).
  void Drain();
  // Stops the writer, running the completions of the finished and abandoned jobs, and abandons
  // every waiting map and import. Called by Drain, and by the service's destructor when it
  // never ran.
  void Abandon();

 private:
  void PumpWrites(ModelMaps& model);
  void PumpAllWrites();
  void MapSettled(ModelMaps& model, PendingMap& map, const Status& status,
                  const InsertResult& plan);
  void OnImportRead(const std::shared_ptr<ImportState>& import, Result<MapExportContents> file);
  void QueueImportedMaps(const std::shared_ptr<ImportState>& import, ModelMaps& model,
                         std::vector<MapRow> maps);
  void FinishImport(ImportState& import, const Status& status);
  void OnDropped(const std::string& peer, uint64_t id, uint64_t fingerprint,
                 const Result<uint64_t>& removed);

  const MapServiceOptions& options_;
  ModelRegistry& models_;
  MapServiceCounters& counters_;
  Histogram& insert_us_;  // Completed map -> written and stored.
  MapWritesHost host_;
  wire::Notifier writer_done_;  // The store writer finished a job.
  std::unique_ptr<StoreWriter> writer_;
  StoreHealth health_;
  size_t completed_waiting_ = 0;  // Completed maps in every model's `completed` queue.
  bool dropping_ = false;         // Completed maps are being dropped (back-pressure).
  uint64_t dropped_since_ = 0;    // maps_dropped when dropping began.
};

}  // namespace fmoe
