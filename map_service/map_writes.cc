#include "map_service/map_writes.h"

#include <algorithm>
#include <chrono>
#include <utility>
#include <vector>

#include "common/json.h"
#include "common/log.h"
#include "common/model/model_config.h"

namespace fmoe {

MapWrites::MapWrites(const MapServiceOptions& options, const Clock& clock, ModelRegistry& models,
                     MapServiceCounters& counters, Histogram& insert_us, MapWritesHost host)
    : options_(options),
      models_(models),
      counters_(counters),
      insert_us_(insert_us),
      host_(std::move(host)),
      health_(clock, options.store_health) {}

void MapWrites::Open(std::unique_ptr<StoreDb> db) {
  writer_ = std::make_unique<StoreWriter>(
      std::move(db),
      StoreWriterOptions{options_.max_pending_writes, options_.writer_nice,
                         options_.before_store_job},
      &writer_done_);
}

void MapWrites::RunCompletions() {
  if (writer_->RunDone() > 0) PumpAllWrites();
}

size_t MapWrites::pending() const {
  return (writer_ != nullptr ? writer_->pending() : 0) + completed_waiting_;
}

bool MapWrites::Busy(std::string* why) {
  const size_t waiting = pending();
  if (waiting < options_.max_pending_writes) return false;
  ++counters_.busy_refusals;
  *why = "map service busy: " + std::to_string(waiting) +
         " store writes pending (max_pending_writes " +
         std::to_string(options_.max_pending_writes) + ")";
  return true;
}

void MapWrites::QueueCompletedMap(ModelMaps& model, PendingMap map) {
  if (pending() >= options_.max_pending_writes) {
    // Back-pressure: the map is neither stored nor acknowledged; the service never blocks.
    ++counters_.maps_dropped;
    if (!dropping_) {
      dropping_ = true;
      dropped_since_ = counters_.maps_dropped - 1;
      spdlog::warn(
          "store writes: {} pending (max_pending_writes): completed maps are dropped, neither "
          "stored nor acknowledged, until they drain",
          pending());
    }
    return;
  }
  if (dropping_) {
    dropping_ = false;
    spdlog::warn("store writes below max_pending_writes again: {} completed maps were dropped",
                 counters_.maps_dropped - dropped_since_);
  }
  model.completed.push_back(std::move(map));
  ++completed_waiting_;
  PumpWrites(model);
}

void MapWrites::PumpAllWrites() {
  for (auto& [fingerprint, model] : models_.models()) PumpWrites(*model);
}

// Hands the model's next map to the store writer, one at a time: the next map is planned against
// a store that holds the one before it. Completed maps go before imported ones.
void MapWrites::PumpWrites(ModelMaps& model) {
  while (!model.writing && !model.dropping && !writer_->full()) {
    const bool live = !model.completed.empty();
    std::deque<PendingMap>& queue = live ? model.completed : model.imported;
    if (queue.empty()) return;
    auto map = std::make_shared<PendingMap>(std::move(queue.front()));
    queue.pop_front();
    if (live) --completed_waiting_;
    if (!health_.healthy()) {
      // Degraded: refused at once, never queued behind a disk that fails.
      health_.Refused();
      MapSettled(model, *map, IoError(health_.Why()), {});
      continue;
    }
    auto plan = model.store->PlanInsert(map->row.sem, map->row.map);
    if (!plan.ok()) {
      MapSettled(model, *map, plan.status(), {});
      continue;
    }
    map->row.id = model.next_id;
    map->row.row = plan->index;
    map->row.stored_unix_ms = UnixMs();
    auto written = std::make_shared<Status>();
    StoreJob job;
    job.run = [map, written, fingerprint = model.shape.fingerprint,
               replaced_id = plan->replaced ? plan->replaced_id : 0](StoreDb& db, std::stop_token) {
      *written = db.PutMap(fingerprint, map->row, replaced_id);
    };
    // `model` outlives the job: a model is never forgotten while it is writing.
    job.done = [this, &model, map, written, plan = *plan](const Status& ran) {
      model.writing = false;
      // Durable first: a failed write leaves the in-memory store as it was.
      Status s = ran.ok() ? *written : ran;
      Failed(s);
      if (s.ok()) {
        ++model.next_id;
        s = model.store->Put(plan.index, map->row.id, map->row.sem, map->row.map);
      }
      MapSettled(model, *map, s, plan);
      PumpWrites(model);
    };
    model.writing = true;
    if (!writer_->TrySubmit(std::move(job))) {
      // Not after full() said no; should it happen, the map waits instead of vanishing.
      model.writing = false;
      queue.push_front(std::move(*map));
      if (live) ++completed_waiting_;
      return;
    }
  }
}

void MapWrites::MapSettled(ModelMaps& model, PendingMap& map, const Status& status,
                           const InsertResult& plan) {
  ImportState* import = map.import.get();
  const double us =
      std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - map.completed)
          .count();
  if (status.ok()) {
    ++model.inserted;
    ++counters_.maps_stored;
    if (plan.replaced) {
      ++model.replaced;
      ++counters_.maps_replaced;
    }
    if (import == nullptr) {
      insert_us_.Add(us);
      host_.reply(map.peer, MapStored{map.row.request_id, map.row.iteration, map.row.id,
                                      plan.replaced ? plan.replaced_id : 0});
    } else {
      ++import->imported;
      if (plan.replaced) ++import->replaced;
    }
  } else if (import != nullptr) {
    if (status.code() != ErrorCode::kInvalidArgument) {
      // The rest of the import is not written.
      std::erase_if(model.imported, [&](const PendingMap& p) { return p.import.get() == import; });
      FinishImport(*import, Status(status.code(), "import stopped after " +
                                                      std::to_string(import->imported) +
                                                      " maps: " + status.message()));
      return;
    }
    ++import->skipped;  // A map the store refuses (a non-finite value).
  } else if (status.code() == ErrorCode::kUnavailable) {
    ++counters_.maps_abandoned;  // Still pending when the drain at stop ended.
  } else if (status.code() == ErrorCode::kIoError) {
    ++counters_.maps_failed;  // The disk: StoreHealth logs these, once per interval.
    insert_us_.Add(us);
  } else {
    ++counters_.maps_failed;
    insert_us_.Add(us);
    spdlog::error("req={} iteration {}: map not stored: {}", map.row.request_id, map.row.iteration,
                  status.message());
  }
  if (import != nullptr && --import->remaining == 0) FinishImport(*import, Status::Ok());
}

void MapWrites::StartExport(const std::string& peer, const AdminRequest& request) {
  auto fail = [&](const Status& s) {
    host_.reply_admin(peer, request.id, "export", request.path, s);
  };
  if (request.path.empty() || request.path[0] != '/') {
    return fail(InvalidArgument("export path \"" + request.path +
                                "\" must be absolute (it is written by the map service)"));
  }
  auto model = models_.Recorded(request.model_fingerprint);
  if (!model.ok()) return fail(model.status());
  if (std::string why; Busy(&why)) return fail(Unavailable(why + "; try again later"));
  // Read back from RocksDB, the durable truth, behind every write submitted before it, and
  // copied once, into the file's buffer.
  auto body = std::make_shared<Result<std::string>>(Internal("export did not run"));
  StoreJob job;
  job.run = [body, shape = (*model)->shape, expected = (*model)->store->size(),
             path = request.path](StoreDb& db, std::stop_token stop) {
    MapExportBuilder file(shape, expected);
    std::vector<std::string> corrupt;
    const Status scanned = db.ScanMaps(
        shape.fingerprint, shape.hidden_size,
        static_cast<size_t>(shape.num_layers) * shape.num_experts,
        [&](const MapView& m) {
          file.Add(m);
          return !stop.stop_requested();
        },
        &corrupt);
    if (!scanned.ok()) {
      *body = scanned;
      return;
    }
    auto bytes = file.Write(path, stop);
    if (!bytes.ok()) {
      *body = bytes.status();
      return;
    }
    spdlog::info("exported {} maps of model {} to {} ({} bytes)", file.maps(),
                 FingerprintHex(shape.fingerprint), path, *bytes);
    nlohmann::json json = {{"model", FingerprintHex(shape.fingerprint)},
                           {"maps", file.maps()},
                           {"corrupt_skipped", corrupt.size()},
                           {"path", path},
                           {"bytes", *bytes}};
    *body = json.dump();
  };
  job.done = [this, body, peer, id = request.id, path = request.path](const Status& ran) {
    host_.reply_admin(peer, id, "export", path, ran.ok() ? *body : Result<std::string>(ran));
  };
  if (!writer_->TrySubmit(std::move(job))) fail(Unavailable("the map service is stopping"));
}

void MapWrites::StartImport(const std::string& peer, const AdminRequest& request) {
  auto fail = [&](const Status& s) {
    host_.reply_admin(peer, request.id, "import", request.path, s);
  };
  if (request.path.empty() || request.path[0] != '/') {
    return fail(InvalidArgument("import path \"" + request.path +
                                "\" must be absolute (it is read by the map service)"));
  }
  if (!health_.healthy()) return fail(Unavailable(health_.Why() + "; import again later"));
  if (std::string why; Busy(&why)) return fail(Unavailable(why + "; try again later"));
  auto import = std::make_shared<ImportState>();
  import->peer = peer;
  import->id = request.id;
  import->path = request.path;
  // The file is read and verified on the store writer; its maps are then inserted here as
  // completed ones (OnImportRead).
  auto file = std::make_shared<Result<MapExportContents>>(Internal("import did not run"));
  StoreJob job;
  job.run = [file, path = request.path, max_bytes = options_.max_import_bytes,
             fingerprint = request.model_fingerprint](StoreDb&, std::stop_token stop) {
    *file = ReadMapExport(path, max_bytes, fingerprint, stop);
  };
  job.done = [this, import, file](const Status& ran) {
    OnImportRead(import, ran.ok() ? std::move(*file) : Result<MapExportContents>(ran));
  };
  if (!writer_->TrySubmit(std::move(job))) fail(Unavailable("the map service is stopping"));
}

void MapWrites::OnImportRead(const std::shared_ptr<ImportState>& import,
                             Result<MapExportContents> file) {
  if (!file.ok()) return FinishImport(*import, file.status());
  ModelRow shape = file->shape;
  shape.first_seen_unix_ms = UnixMs();
  import->fingerprint = shape.fingerprint;
  import->skipped = file->skipped;
  if (const ModelMaps* known = models_.Find(shape.fingerprint); known != nullptr) {
    const ModelRow& k = known->shape;
    if (k.num_layers != shape.num_layers || k.num_experts != shape.num_experts ||
        k.top_k != shape.top_k || k.hidden_size != shape.hidden_size) {
      return FinishImport(*import, FailedPrecondition(import->path + " holds model " +
                                                      FingerprintHex(shape.fingerprint) +
                                                      " with a different shape than the one "
                                                      "stored"));
    }
  }
  if (const NotLoaded* skipped = models_.FindNotLoaded(shape.fingerprint); skipped != nullptr) {
    return FinishImport(*import, FailedPrecondition("model " + FingerprintHex(shape.fingerprint) +
                                                    " is stored but was not loaded at start (" +
                                                    skipped->reason + ")"));
  }
  if (const ModelMaps* known = models_.Find(shape.fingerprint);
      known != nullptr && known->dropping) {
    return FinishImport(*import, Unavailable("model " + FingerprintHex(shape.fingerprint) +
                                             " is being dropped; import again later"));
  }
  auto model = models_.Open(shape);
  if (!model.ok()) return FinishImport(*import, model.status());
  if ((*model)->recorded) return QueueImportedMaps(import, **model, std::move(file->maps));
  // A model no rank has registered yet: its record is written before its maps.
  auto maps = std::make_shared<std::vector<MapRow>>(std::move(file->maps));
  auto written = std::make_shared<Status>();
  StoreJob job;
  job.run = [written, shape](StoreDb& db, std::stop_token) { *written = db.RecordModel(shape); };
  job.done = [this, import, maps, written, fingerprint = shape.fingerprint](const Status& ran) {
    ModelMaps& m = *models_.Find(fingerprint);
    --m.recording;
    const Status s = ran.ok() ? *written : ran;
    Failed(s);
    if (!s.ok()) {
      models_.ForgetIfUnrecorded(fingerprint);
      return FinishImport(*import, s);
    }
    m.recorded = true;
    QueueImportedMaps(import, m, std::move(*maps));
  };
  ++(*model)->recording;
  if (!writer_->TrySubmit(std::move(job))) {
    --(*model)->recording;
    models_.ForgetIfUnrecorded(shape.fingerprint);
    FinishImport(*import, Unavailable("the map service is stopping"));
  }
}

void MapWrites::QueueImportedMaps(const std::shared_ptr<ImportState>& import, ModelMaps& model,
                                  std::vector<MapRow> maps) {
  import->remaining = maps.size();
  if (maps.empty()) return FinishImport(*import, Status::Ok());
  const auto now = std::chrono::steady_clock::now();
  for (MapRow& row : maps) model.imported.push_back({std::move(row), "", import, now});
  PumpWrites(model);
}

void MapWrites::FinishImport(ImportState& import, const Status& status) {
  if (import.finished) return;
  import.finished = true;
  import.remaining = 0;
  if (!status.ok()) return host_.reply_admin(import.peer, import.id, "import", import.path, status);
  spdlog::info("imported {} maps of model {} from {} ({} replaced by deduplication, {} skipped)",
               import.imported, FingerprintHex(import.fingerprint), import.path, import.replaced,
               import.skipped);
  const ModelMaps* model = models_.Find(import.fingerprint);
  nlohmann::json body = {{"model", FingerprintHex(import.fingerprint)},
                         {"imported", import.imported},
                         {"replaced", import.replaced},
                         {"skipped", import.skipped},
                         {"maps", model == nullptr ? 0 : model->store->size()}};
  host_.reply_admin(import.peer, import.id, "import", import.path, body.dump());
}

// Degraded and the backoff passed: the store writer tries to make the store writable again,
// behind the jobs queued before (which fail fast while RocksDB holds its error).
void MapWrites::MaybeRecover() {
  if (!health_.RetryDue()) return;
  auto result = std::make_shared<Status>(Internal("recovery did not run"));
  StoreJob job;
  job.run = [result](StoreDb& db, std::stop_token) { *result = db.Recover(); };
  job.done = [this, result](const Status& ran) {
    health_.RetryDone(ran.ok() ? *result : ran);
    if (health_.healthy()) PumpAllWrites();
  };
  if (!writer_->TrySubmit(std::move(job))) health_.RetryDone(Unavailable("store writer full"));
}

// `fmoe maps --drop FP`: the model's ranks are dropped (they register again at their next
// heartbeat, and get a fresh, empty store once the drop is done), its waiting maps discarded,
// then the store writer removes its records; only then is its memory freed.
void MapWrites::StartDrop(const std::string& peer, const AdminRequest& request) {
  const uint64_t fp = request.model_fingerprint;
  auto fail = [&](const Status& s) {
    host_.reply_admin(peer, request.id, "drop", "of model " + FingerprintHex(fp), s);
  };
  if (fp == 0) return fail(InvalidArgument("drop needs a model fingerprint"));
  if (!health_.healthy()) return fail(Unavailable(health_.Why() + "; drop again later"));
  ModelMaps* known = models_.Find(fp);
  if (known == nullptr && models_.FindNotLoaded(fp) == nullptr) {
    return fail(NotFound("model " + FingerprintHex(fp) + " is not stored"));
  }
  if (known != nullptr && known->dropping) {
    return fail(Unavailable("model " + FingerprintHex(fp) + " is already being dropped"));
  }
  if (std::string why; Busy(&why)) return fail(Unavailable(why + "; try again later"));
  auto removed = std::make_shared<Result<uint64_t>>(Internal("drop did not run"));
  StoreJob job;
  job.run = [removed, fp](StoreDb& db, std::stop_token) { *removed = db.DropModel(fp); };
  job.done = [this, removed, peer, id = request.id, fp](const Status& ran) {
    OnDropped(peer, id, fp, ran.ok() ? *removed : Result<uint64_t>(ran));
  };
  if (!writer_->TrySubmit(std::move(job))) return fail(Unavailable("the map service is stopping"));
  if (known == nullptr) return;
  ModelMaps& model = *known;
  model.dropping = true;
  const size_t ranks = host_.drop_ranks_of(fp);
  const size_t discarded = model.completed.size();
  counters_.maps_dropped += discarded;
  completed_waiting_ -= discarded;
  model.completed.clear();
  for (PendingMap& p : model.imported) {
    FinishImport(*p.import, FailedPrecondition("model " + FingerprintHex(fp) + " was dropped"));
  }
  model.imported.clear();
  spdlog::warn("dropping model {}: {} ranks unregistered, {} completed maps discarded",
               FingerprintHex(fp), ranks, discarded);
}

void MapWrites::OnDropped(const std::string& peer, uint64_t id, uint64_t fingerprint,
                          const Result<uint64_t>& removed) {
  ModelMaps* known = models_.Find(fingerprint);
  if (!removed.ok()) {
    Failed(removed.status());
    if (known != nullptr) known->dropping = false;
    return host_.reply_admin(peer, id, "drop", "of model " + FingerprintHex(fingerprint),
                             removed.status());
  }
  uint64_t bytes = 0;
  if (known != nullptr) {
    // Every rank of it was dropped at StartDrop and none registered since: no matcher refers
    // to its store, and its writes, submitted before the drop, are done.
    bytes = known->bytes;
    models_.Erase(fingerprint);
  }
  models_.EraseNotLoaded(fingerprint);
  ++counters_.models_dropped;
  spdlog::warn("dropped model {}: {} maps and its records removed, {} MiB freed",
               FingerprintHex(fingerprint), *removed, bytes >> 20);
  nlohmann::json body = {
      {"model", FingerprintHex(fingerprint)}, {"maps_removed", *removed}, {"bytes_freed", bytes}};
  host_.reply_admin(peer, id, "drop", "of model " + FingerprintHex(fingerprint), body.dump());
}

void MapWrites::Drain() {
  writer_->RequestStop();  // Exports and imports end early; writes go on.
  const size_t at_stop = pending();
  if (at_stop == 0) return Abandon();
  const auto deadline =
      std::chrono::steady_clock::now() + std::chrono::milliseconds(options_.drain_timeout_ms);
  while (pending() > 0 && std::chrono::steady_clock::now() < deadline) {
    host_.turn(20);
  }
  const size_t left = pending();
  const uint64_t abandoned_before = counters_.maps_abandoned;
  Abandon();
  if (left == 0) {
    spdlog::info("stopping: the {} store writes pending at stop were drained", at_stop);
  } else {
    spdlog::warn(
        "stopping: {} store writes pending at stop, {} still pending after {} ms were abandoned "
        "({} completed maps neither stored nor acknowledged)",
        at_stop, left, options_.drain_timeout_ms, counters_.maps_abandoned - abandoned_before);
  }
}

void MapWrites::Abandon() {
  writer_->Stop();  // Runs `done` of the finished jobs, then of the abandoned ones.
  const Status stopping = Unavailable("the map service is stopping");
  for (auto& [fingerprint, model] : models_.models()) {
    counters_.maps_abandoned += model->completed.size();
    model->completed.clear();
    for (PendingMap& p : model->imported) {
      FinishImport(*p.import, Status(stopping.code(), "import stopped after " +
                                                          std::to_string(p.import->imported) +
                                                          " maps: " + stopping.message()));
    }
    model->imported.clear();
  }
  completed_waiting_ = 0;
}

}  // namespace fmoe
