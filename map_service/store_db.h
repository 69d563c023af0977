// The map service's RocksDB database: the only file that includes RocksDB. The default column
// family holds model shapes ("model/<fp>") and rank registrations ("rank/<group>/<rank>") as
// FlatBuffers StoreRecords (schemas/store.fbs); each model's expert maps get a column family
// "maps/<fp>". Every write is one WriteBatch with the WAL on. Records read back are verified;
// a corrupt one is reported and skipped. RocksDB's own log goes to ours (warnings and errors,
// throttled), never to a LOG file beside the data. On a data directory it cannot write (a full
// or read-only disk) Open falls back to a read-only database when the existing data can be read;
// Recover() makes it writable again. Not thread-safe: one owner thread at a time.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"

namespace fmoe {

// Tests only: failures injected under RocksDB (a FileSystem wrapper in store_db.cc). While
// FailWrites(err) holds, every write to a file of the store (new files, appends, syncs,
// renames, new directories) fails with err, as a full (ENOSPC), failing (EIO) or read-only
// (EROFS) disk would; Heal() ends it. Thread-safe.
class StoreFaults {
 public:
  void FailWrites(int err) { errno_.store(err); }
  void Heal() { errno_.store(0); }
  int failing() const { return errno_.load(); }
  uint64_t refused() const { return refused_.load(); }  // Writes failed so far.
  void CountRefused() { refused_.fetch_add(1); }

 private:
  std::atomic<int> errno_{0};
  std::atomic<uint64_t> refused_{0};
};

struct StoreDbOptions {
  std::string path;   // Required: the data directory.
  bool sync = false;  // fsync the WAL on every write. Default: false
};

struct ModelRow {
  uint64_t fingerprint = 0;
  uint32_t num_layers = 0;
  uint32_t num_experts = 0;
  uint32_t top_k = 0;
  uint32_t hidden_size = 0;
  uint64_t first_seen_unix_ms = 0;
};

struct RankRow {
  std::string group;
  uint32_t rank = 0;
  uint32_t world_size = 0;
  uint64_t instance_id = 0;
  uint64_t model_fingerprint = 0;
  uint64_t registered_unix_ms = 0;
};

// One stored expert map (schemas/store.fbs StoredMap).
struct MapRow {
  uint64_t id = 0;   // Entry id, > 0; the key in the model's column family.
  uint32_t row = 0;  // Row in the in-memory matrices.
  uint64_t request_id = 0;
  uint32_t iteration = 0;
  uint64_t stored_unix_ms = 0;
  std::vector<float> sem;  // h
  std::vector<float> map;  // L x J
};

// A stored map as read: valid only during the ScanMaps callback that receives it.
struct MapView {
  uint64_t id = 0;
  uint32_t row = 0;
  uint64_t request_id = 0;
  uint32_t iteration = 0;
  uint64_t stored_unix_ms = 0;
  std::span<const float> sem;
  std::span<const float> map;
};

class StoreDb {
 public:
  // Errors: kAlreadyExists "data directory D is in use by another map service" when its lock is
  // held; kIoError for an unusable directory, or an unwritable one without a database to read.
  // An existing database in a directory that cannot be written is opened read-only:
  // read_only_reason() then says why, and every write fails with kIoError until Recover().
  // `faults`: tests only, failures injected under RocksDB.
  static Result<std::unique_ptr<StoreDb>> Open(const StoreDbOptions& options,
                                               std::shared_ptr<StoreFaults> faults = nullptr);
  ~StoreDb();

  // Why the database is read-only (opened so), or empty when it is writable.
  const std::string& read_only_reason() const;

  // Makes the store writable again after a failed write: clears RocksDB's background error
  // (DB::Resume) or, when that cannot, closes the database and opens it again for writing
  // (read-only meanwhile, when the disk still refuses), then proves a write (a WAL record that
  // leaves no key). kIoError while the disk still refuses.
  Status Recover();

  struct Contents {
    std::vector<ModelRow> models;
    std::vector<RankRow> ranks;
    std::vector<std::string> corrupt;  // "key: reason" of each record skipped.
  };
  Result<Contents> LoadAll();

  // Records a registration: the model's shape when `model` is not null (first sight of it, which
  // also creates its maps column family) and the rank, in one WriteBatch.
  Status RecordRegistration(const ModelRow* model, const RankRow& rank);

  // Records a model's shape alone (an import of a model no rank has registered yet).
  Status RecordModel(const ModelRow& model);

  // Removes a model: its record, its maps and the records of the ranks registered with it, in
  // one WriteBatch; then drops its column family (best effort: an empty one left behind is
  // harmless). Returns how many maps were removed. Nothing is removed when the write fails.
  Result<uint64_t> DropModel(uint64_t fingerprint);

  // Stores `map` in the model's column family and, when replaced_id is not 0, deletes the entry
  // it replaces, in one WriteBatch. kFailedPrecondition when the model has no column family.
  Status PutMap(uint64_t fingerprint, const MapRow& map, uint64_t replaced_id);

  struct MapContents {
    std::vector<MapRow> maps;          // In row order (ties by id).
    std::vector<std::string> corrupt;  // "maps/<fp>/<id>: reason" of each record skipped.
  };
  // Every stored map of a model, verified against its shape (sem of `hidden` floats, map of
  // `map_width` finite floats, key equal to the id).
  Result<MapContents> LoadMaps(uint64_t fingerprint, uint32_t hidden, size_t map_width);

  // The same maps and checks in id order, each handed to `visit` without a copy (false from
  // `visit` ends the scan); the corrupt ones are appended to *corrupt instead.
  Status ScanMaps(uint64_t fingerprint, uint32_t hidden, size_t map_width,
                  const std::function<bool(const MapView&)>& visit,
                  std::vector<std::string>* corrupt);

  // Number of stored maps of a model (0 when it has none).
  uint64_t CountMaps(uint64_t fingerprint);

  const std::string& path() const;

 private:
  struct Impl;
  explicit StoreDb(std::unique_ptr<Impl> impl);
  Status Writable() const;
  Status Readable() const;
  std::unique_ptr<Impl> impl_;
};

}  // namespace fmoe
