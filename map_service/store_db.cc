#include "map_service/store_db.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <map>
#include <mutex>
#include <string_view>

#include <flatbuffers/flatbuffers.h>
#include <rocksdb/db.h>
#include <rocksdb/env.h>
#include <rocksdb/file_system.h>
#include <rocksdb/options.h>
#include <rocksdb/write_batch.h>

#include "common/log.h"
#include "common/model/model_config.h"
#include "common/process_util.h"
#include "common/rocks_logger.h"
#include "schemas/store_generated.h"

namespace fmoe {
namespace {

namespace fb = fmoe::store;

std::string ModelKey(uint64_t fp) { return "model/" + FingerprintHex(fp); }
std::string RankKey(const std::string& group, uint32_t rank) {
  return "rank/" + group + "/" + std::to_string(rank);
}
std::string MapsFamily(uint64_t fp) { return "maps/" + FingerprintHex(fp); }

// Map keys are the id in 8 big-endian bytes, so a scan returns them in id order.
std::string MapKey(uint64_t id) {
  std::string key(8, '\0');
  for (int i = 0; i < 8; ++i) key[static_cast<size_t>(i)] = static_cast<char>(id >> (56 - 8 * i));
  return key;
}

bool ParseMapKey(const rocksdb::Slice& key, uint64_t* id) {
  if (key.size() != 8) return false;
  uint64_t v = 0;
  for (size_t i = 0; i < 8; ++i) v = (v << 8) | static_cast<uint8_t>(key[i]);
  *id = v;
  return true;
}

std::string EncodeMap(const MapRow& m) {
  flatbuffers::FlatBufferBuilder b(256 + 4 * (m.sem.size() + m.map.size()));
  auto sem = b.CreateVector(m.sem);
  auto map = b.CreateVector(m.map);
  auto rec =
      fb::CreateStoredMap(b, m.id, m.row, m.request_id, m.iteration, m.stored_unix_ms, sem, map);
  b.Finish(fb::CreateStoreRecord(b, 1, fb::Record::StoredMap, rec.Union()), "FMST");
  return std::string(reinterpret_cast<const char*>(b.GetBufferPointer()), b.GetSize());
}

Status FromRocks(const rocksdb::Status& s, const std::string& what) {
  if (s.ok()) return Status::Ok();
  if (s.IsCorruption()) return DataLoss(what + ": " + s.ToString());
  return IoError(what + ": " + s.ToString());
}

std::string EncodeModel(const ModelRow& m) {
  flatbuffers::FlatBufferBuilder b(128);
  auto rec = fb::CreateModelRecord(b, m.fingerprint, m.num_layers, m.num_experts, m.top_k,
                                   m.hidden_size, m.first_seen_unix_ms);
  b.Finish(fb::CreateStoreRecord(b, 1, fb::Record::ModelRecord, rec.Union()), "FMST");
  return std::string(reinterpret_cast<const char*>(b.GetBufferPointer()), b.GetSize());
}

std::string EncodeRank(const RankRow& r) {
  flatbuffers::FlatBufferBuilder b(128);
  auto group = b.CreateString(r.group);
  auto rec = fb::CreateRankRecord(b, group, r.rank, r.world_size, r.instance_id,
                                  r.model_fingerprint, r.registered_unix_ms);
  b.Finish(fb::CreateStoreRecord(b, 1, fb::Record::RankRecord, rec.Union()), "FMST");
  return std::string(reinterpret_cast<const char*>(b.GetBufferPointer()), b.GetSize());
}

// Verifies a stored value; returns the record or nullptr with *why set.
const fb::StoreRecord* VerifyRecord(std::string_view value, std::vector<uint64_t>* aligned,
                                    std::string* why) {
  aligned->assign((value.size() + 7) / 8, 0);
  std::memcpy(aligned->data(), value.data(), value.size());
  const auto* buf = reinterpret_cast<const uint8_t*>(aligned->data());
  if (value.size() < 8 || !flatbuffers::BufferHasIdentifier(buf, "FMST")) {
    *why = "not a store record (bad identifier)";
    return nullptr;
  }
  flatbuffers::Verifier verifier(buf, value.size(), /*max_depth=*/8, /*max_tables=*/16,
                                 /*check_alignment=*/true);
  if (!fb::VerifyStoreRecordBuffer(verifier)) {
    *why = "record fails verification";
    return nullptr;
  }
  return fb::GetStoreRecord(buf);
}

// Tests only: StoreFaults under RocksDB (store_db.h).
rocksdb::IOStatus Injected(StoreFaults& faults, const std::string& what) {
  const int err = faults.failing();
  if (err == 0) return rocksdb::IOStatus::OK();
  faults.CountRefused();
  const std::string text = what + ": " + std::strerror(err) + " (injected)";
  return err == ENOSPC ? rocksdb::IOStatus::NoSpace(text) : rocksdb::IOStatus::IOError(text);
}

class FaultFile : public rocksdb::FSWritableFileOwnerWrapper {
 public:
  FaultFile(std::unique_ptr<rocksdb::FSWritableFile> file, std::shared_ptr<StoreFaults> faults,
            std::string name)
      : FSWritableFileOwnerWrapper(std::move(file)),
        faults_(std::move(faults)),
        name_(std::move(name)) {}
  using IOS = rocksdb::IOStatus;
  using IOO = rocksdb::IOOptions;
  using Dbg = rocksdb::IODebugContext;
  IOS Append(const rocksdb::Slice& d, const IOO& o, Dbg* g) override {
    IOS s = Injected(*faults_, "append to " + name_);
    return s.ok() ? FSWritableFileOwnerWrapper::Append(d, o, g) : s;
  }
  IOS Append(const rocksdb::Slice& d, const IOO& o, const rocksdb::DataVerificationInfo& v,
             Dbg* g) override {
    IOS s = Injected(*faults_, "append to " + name_);
    return s.ok() ? FSWritableFileOwnerWrapper::Append(d, o, v, g) : s;
  }
  IOS PositionedAppend(const rocksdb::Slice& d, uint64_t off, const IOO& o, Dbg* g) override {
    IOS s = Injected(*faults_, "append to " + name_);
    return s.ok() ? FSWritableFileOwnerWrapper::PositionedAppend(d, off, o, g) : s;
  }
  IOS PositionedAppend(const rocksdb::Slice& d, uint64_t off, const IOO& o,
                       const rocksdb::DataVerificationInfo& v, Dbg* g) override {
    IOS s = Injected(*faults_, "append to " + name_);
    return s.ok() ? FSWritableFileOwnerWrapper::PositionedAppend(d, off, o, v, g) : s;
  }
  IOS Flush(const IOO& o, Dbg* g) override {
    IOS s = Injected(*faults_, "flush of " + name_);
    return s.ok() ? FSWritableFileOwnerWrapper::Flush(o, g) : s;
  }
  IOS Sync(const IOO& o, Dbg* g) override {
    IOS s = Injected(*faults_, "sync of " + name_);
    return s.ok() ? FSWritableFileOwnerWrapper::Sync(o, g) : s;
  }
  IOS Fsync(const IOO& o, Dbg* g) override {
    IOS s = Injected(*faults_, "sync of " + name_);
    return s.ok() ? FSWritableFileOwnerWrapper::Fsync(o, g) : s;
  }
  IOS RangeSync(uint64_t off, uint64_t n, const IOO& o, Dbg* g) override {
    IOS s = Injected(*faults_, "sync of " + name_);
    return s.ok() ? FSWritableFileOwnerWrapper::RangeSync(off, n, o, g) : s;
  }

 private:
  std::shared_ptr<StoreFaults> faults_;
  std::string name_;
};

class FaultFileSystem : public rocksdb::FileSystemWrapper {
 public:
  explicit FaultFileSystem(std::shared_ptr<StoreFaults> faults)
      : FileSystemWrapper(rocksdb::FileSystem::Default()), faults_(std::move(faults)) {}
  const char* Name() const override { return "FmoeFaultFileSystem"; }
  using IOS = rocksdb::IOStatus;
  using IOO = rocksdb::IOOptions;
  using Dbg = rocksdb::IODebugContext;
  using File = std::unique_ptr<rocksdb::FSWritableFile>;
  IOS NewWritableFile(const std::string& f, const rocksdb::FileOptions& o, File* r,
                      Dbg* g) override {
    if (IOS s = Injected(*faults_, "creating " + f); !s.ok()) return s;
    return Wrap(f, target()->NewWritableFile(f, o, r, g), r);
  }
  IOS ReopenWritableFile(const std::string& f, const rocksdb::FileOptions& o, File* r,
                         Dbg* g) override {
    if (IOS s = Injected(*faults_, "opening " + f); !s.ok()) return s;
    return Wrap(f, target()->ReopenWritableFile(f, o, r, g), r);
  }
  IOS ReuseWritableFile(const std::string& f, const std::string& old, const rocksdb::FileOptions& o,
                        File* r, Dbg* g) override {
    if (IOS s = Injected(*faults_, "creating " + f); !s.ok()) return s;
    return Wrap(f, target()->ReuseWritableFile(f, old, o, r, g), r);
  }
  IOS RenameFile(const std::string& from, const std::string& to, const IOO& o, Dbg* g) override {
    if (IOS s = Injected(*faults_, "renaming " + from); !s.ok()) return s;
    return target()->RenameFile(from, to, o, g);
  }
  IOS CreateDir(const std::string& d, const IOO& o, Dbg* g) override {
    if (IOS s = Injected(*faults_, "creating " + d); !s.ok()) return s;
    return target()->CreateDir(d, o, g);
  }

 private:
  IOS Wrap(const std::string& name, IOS opened, File* file) {
    if (opened.ok()) *file = std::make_unique<FaultFile>(std::move(*file), faults_, name);
    return opened;
  }
  std::shared_ptr<StoreFaults> faults_;
};

// A read-only database takes no RocksDB lock; this one (an OFD lock on its LOCK file, which
// conflicts with RocksDB's) keeps a second map service out meanwhile. Returns the fd, or -1 with
// *err set (EAGAIN or EACCES: another process holds the lock).
int LockReadOnly(const std::string& path, int* err) {
  const std::string file = path + "/LOCK";
  const int fd = ::open(file.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) {
    *err = errno;
    return -1;
  }
  struct flock lock {};
  lock.l_type = F_WRLCK;
  lock.l_whence = SEEK_SET;
  if (::fcntl(fd, F_OFD_SETLK, &lock) != 0) {
    *err = errno;
    ::close(fd);
    return -1;
  }
  return fd;
}

}  // namespace

struct StoreDb::Impl {
  std::string path;
  bool sync = false;
  std::string read_only_reason;  // Empty while writable.
  int read_only_lock = -1;       // LockReadOnly's fd while read-only.
  std::shared_ptr<rocksdb::Logger> logger = MakeRocksLogger();
  std::unique_ptr<rocksdb::Env> env;  // The fault-injecting Env of a test, or null.
  std::unique_ptr<rocksdb::DB> db;
  std::map<std::string, rocksdb::ColumnFamilyHandle*> families;  // Owned; closed in ~Impl.

  ~Impl() {
    Close();
    if (read_only_lock >= 0) ::close(read_only_lock);
  }

  void Close() {
    if (!db) return;
    for (auto& [name, handle] : families) {
      if (handle != db->DefaultColumnFamily()) db->DestroyColumnFamilyHandle(handle);
    }
    families.clear();
    db->Close().PermitUncheckedError();
    db.reset();
  }

  rocksdb::Options DbOptions() const {
    rocksdb::Options o;
    o.create_if_missing = true;
    o.create_missing_column_families = true;
    o.paranoid_checks = true;
    o.max_open_files = 256;
    o.info_log = logger;
    o.info_log_level = rocksdb::InfoLogLevel::WARN_LEVEL;
    if (env) o.env = env.get();
    return o;
  }

  // Opens the database (every column family) into db/families, or returns RocksDB's error.
  rocksdb::Status OpenDb(bool read_only, std::unique_ptr<rocksdb::DB>* out,
                         std::map<std::string, rocksdb::ColumnFamilyHandle*>* out_families) const {
    const rocksdb::Options options = DbOptions();
    std::vector<std::string> names;
    rocksdb::Status s = rocksdb::DB::ListColumnFamilies(options, path, &names);
    if (!s.ok()) names = {rocksdb::kDefaultColumnFamilyName};  // A new database.
    std::vector<rocksdb::ColumnFamilyDescriptor> descriptors;
    for (const auto& name : names) descriptors.emplace_back(name, rocksdb::ColumnFamilyOptions());
    std::vector<rocksdb::ColumnFamilyHandle*> handles;
    rocksdb::DB* raw = nullptr;
    s = read_only ? rocksdb::DB::OpenForReadOnly(options, path, descriptors, &handles, &raw)
                  : rocksdb::DB::Open(options, path, descriptors, &handles, &raw);
    if (!s.ok()) return s;
    out->reset(raw);
    out_families->clear();
    for (size_t i = 0; i < handles.size(); ++i) (*out_families)[names[i]] = handles[i];
    return s;
  }

  // The model's column family, created when it has none; *created says so.
  Result<rocksdb::ColumnFamilyHandle*> Family(uint64_t fingerprint, bool* created) {
    const std::string family = MapsFamily(fingerprint);
    *created = false;
    if (auto it = families.find(family); it != families.end()) return it->second;
    rocksdb::ColumnFamilyHandle* handle = nullptr;
    FMOE_RETURN_IF_ERROR(
        FromRocks(db->CreateColumnFamily(rocksdb::ColumnFamilyOptions(), family, &handle),
                  "creating column family " + family));
    families[family] = handle;
    *created = true;
    return handle;
  }

  // Undoes Family's creation after the write that needed it failed (best effort: an empty family
  // left behind is harmless and reused).
  void ForgetFamily(uint64_t fingerprint) {
    auto it = families.find(MapsFamily(fingerprint));
    if (it == families.end()) return;
    if (!db->DropColumnFamily(it->second).ok()) return;
    db->DestroyColumnFamilyHandle(it->second).PermitUncheckedError();
    families.erase(it);
  }

  // A WAL record that leaves no key: proves the disk takes writes again.
  Status Probe() {
    rocksdb::WriteBatch batch;
    batch.Put("health/probe", "");
    batch.Delete("health/probe");
    return FromRocks(db->Write(WriteOpts(), &batch), "probe write to " + path);
  }

  rocksdb::WriteOptions WriteOpts() const {
    rocksdb::WriteOptions w;
    w.sync = sync;
    w.disableWAL = false;
    return w;
  }
};

StoreDb::StoreDb(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
StoreDb::~StoreDb() = default;

const std::string& StoreDb::path() const { return impl_->path; }

const std::string& StoreDb::read_only_reason() const { return impl_->read_only_reason; }

Result<std::unique_ptr<StoreDb>> StoreDb::Open(const StoreDbOptions& options,
                                               std::shared_ptr<StoreFaults> faults) {
  const Status writable = EnsureWritableDir(options.path);
  std::error_code ec;
  const bool exists = std::filesystem::exists(options.path + "/CURRENT", ec);
  if (!writable.ok() && !exists) return writable;  // Nothing to serve from.
  auto impl = std::make_unique<Impl>();
  impl->path = options.path;
  impl->sync = options.sync;
  if (faults) {
    impl->env = rocksdb::NewCompositeEnv(std::make_shared<FaultFileSystem>(std::move(faults)));
  }
  const auto in_use = [&] {
    return AlreadyExists("data directory " + options.path +
                         " is in use by another map service (its RocksDB lock is held)");
  };
  rocksdb::Status s = impl->OpenDb(/*read_only=*/false, &impl->db, &impl->families);
  if (s.ok()) return std::unique_ptr<StoreDb>(new StoreDb(std::move(impl)));
  if (s.IsIOError() && s.ToString().find("lock") != std::string::npos) return in_use();
  if (!s.IsIOError() || !exists) return FromRocks(s, "data directory " + options.path);
  // The disk refuses writes (full, failing or read-only): serve what is stored, read-only.
  impl->read_only_reason =
      writable.ok() ? FromRocks(s, "data directory " + options.path).message() : writable.message();
  int err = 0;
  impl->read_only_lock = LockReadOnly(options.path, &err);
  if (impl->read_only_lock < 0) {
    if (err == EAGAIN || err == EACCES) return in_use();
    return IoError("data directory " + options.path + " is not writable (" +
                   impl->read_only_reason + ") and its LOCK file cannot be locked (" +
                   std::strerror(err) + ")");
  }
  rocksdb::Status ro = impl->OpenDb(/*read_only=*/true, &impl->db, &impl->families);
  if (!ro.ok()) {
    return IoError("data directory " + options.path + " is not writable (" +
                   impl->read_only_reason + ") nor readable: " + ro.ToString());
  }
  return std::unique_ptr<StoreDb>(new StoreDb(std::move(impl)));
}

Status StoreDb::Recover() {
  Impl& d = *impl_;
  if (d.db != nullptr && d.read_only_reason.empty()) {
    rocksdb::Status s = d.db->Resume();
    if (s.ok()) return d.Probe();
    // RocksDB stops a database for good after some failures (a WAL it could not create on a
    // full disk is fatal): reopen it. Every acknowledged write is in its WAL.
    d.read_only_reason = FromRocks(s, "resuming " + d.path).message();
  }
  if (d.read_only_lock >= 0) ::close(d.read_only_lock);
  d.read_only_lock = -1;
  d.Close();
  rocksdb::Status s = d.OpenDb(/*read_only=*/false, &d.db, &d.families);
  if (!s.ok()) {
    // Still refused: serve reads (exports) from a read-only instance meanwhile.
    d.read_only_reason = FromRocks(s, "reopening " + d.path + " for writing").message();
    int err = 0;
    d.read_only_lock = LockReadOnly(d.path, &err);
    if (d.read_only_lock < 0 || !d.OpenDb(/*read_only=*/true, &d.db, &d.families).ok()) {
      d.Close();
    }
    return IoError(d.read_only_reason);
  }
  d.read_only_reason.clear();
  return d.Probe();
}

Result<StoreDb::Contents> StoreDb::LoadAll() {
  Contents out;
  std::unique_ptr<rocksdb::Iterator> it(impl_->db->NewIterator(rocksdb::ReadOptions()));
  std::vector<uint64_t> aligned;
  for (it->SeekToFirst(); it->Valid(); it->Next()) {
    std::string key = it->key().ToString();
    std::string why;
    const fb::StoreRecord* rec =
        VerifyRecord(std::string_view(it->value().data(), it->value().size()), &aligned, &why);
    if (rec == nullptr) {
      out.corrupt.push_back(key + ": " + why);
      continue;
    }
    if (const auto* m = rec->record_as_ModelRecord(); m != nullptr && key.rfind("model/", 0) == 0) {
      out.models.push_back({m->fingerprint(), m->num_layers(), m->num_experts(), m->top_k(),
                            m->hidden_size(), m->first_seen_unix_ms()});
    } else if (const auto* r = rec->record_as_RankRecord();
               r != nullptr && r->group() != nullptr && key.rfind("rank/", 0) == 0) {
      out.ranks.push_back({r->group()->str(), r->rank(), r->world_size(), r->instance_id(),
                           r->model_fingerprint(), r->registered_unix_ms()});
    } else {
      out.corrupt.push_back(key + ": record type does not match its key");
    }
  }
  FMOE_RETURN_IF_ERROR(FromRocks(it->status(), "reading " + impl_->path));
  return out;
}

Status StoreDb::Writable() const {
  if (impl_->read_only_reason.empty()) return Status::Ok();
  return IoError("the store is read-only: " + impl_->read_only_reason);
}

Status StoreDb::Readable() const {
  if (impl_->db != nullptr) return Status::Ok();
  return IoError("the store is not open: " + impl_->read_only_reason);
}

Status StoreDb::RecordRegistration(const ModelRow* model, const RankRow& rank) {
  FMOE_RETURN_IF_ERROR(Writable());
  rocksdb::WriteBatch batch;
  bool created = false;
  if (model != nullptr) {
    FMOE_RETURN_IF_ERROR(impl_->Family(model->fingerprint, &created).status());
    batch.Put(ModelKey(model->fingerprint), EncodeModel(*model));
  }
  batch.Put(RankKey(rank.group, rank.rank), EncodeRank(rank));
  Status s = FromRocks(impl_->db->Write(impl_->WriteOpts(), &batch), "writing registration");
  if (!s.ok() && created) impl_->ForgetFamily(model->fingerprint);
  return s;
}

Status StoreDb::RecordModel(const ModelRow& model) {
  FMOE_RETURN_IF_ERROR(Writable());
  bool created = false;
  FMOE_RETURN_IF_ERROR(impl_->Family(model.fingerprint, &created).status());
  rocksdb::WriteBatch batch;
  batch.Put(ModelKey(model.fingerprint), EncodeModel(model));
  Status s = FromRocks(impl_->db->Write(impl_->WriteOpts(), &batch), "writing model record");
  if (!s.ok() && created) impl_->ForgetFamily(model.fingerprint);
  return s;
}

Result<uint64_t> StoreDb::DropModel(uint64_t fingerprint) {
  FMOE_RETURN_IF_ERROR(Writable());
  rocksdb::WriteBatch batch;
  batch.Delete(ModelKey(fingerprint));
  // The ranks registered with it.
  std::unique_ptr<rocksdb::Iterator> it(impl_->db->NewIterator(rocksdb::ReadOptions()));
  std::vector<uint64_t> aligned;
  for (it->Seek("rank/"); it->Valid() && it->key().starts_with("rank/"); it->Next()) {
    std::string why;
    const fb::StoreRecord* rec =
        VerifyRecord(std::string_view(it->value().data(), it->value().size()), &aligned, &why);
    const fb::RankRecord* r = rec != nullptr ? rec->record_as_RankRecord() : nullptr;
    if (r != nullptr && r->model_fingerprint() == fingerprint) batch.Delete(it->key());
  }
  FMOE_RETURN_IF_ERROR(FromRocks(it->status(), "reading " + impl_->path));
  it.reset();
  const uint64_t maps = CountMaps(fingerprint);
  auto family = impl_->families.find(MapsFamily(fingerprint));
  if (family != impl_->families.end()) {
    // Every 8-byte key sorts below 9 bytes of 0xff.
    FMOE_RETURN_IF_ERROR(FromRocks(
        batch.DeleteRange(family->second, MapKey(0), std::string(9, '\xff')), "dropping maps"));
  }
  FMOE_RETURN_IF_ERROR(FromRocks(impl_->db->Write(impl_->WriteOpts(), &batch),
                                 "removing model " + FingerprintHex(fingerprint)));
  impl_->ForgetFamily(fingerprint);
  return maps;
}

Status StoreDb::PutMap(uint64_t fingerprint, const MapRow& map, uint64_t replaced_id) {
  FMOE_RETURN_IF_ERROR(Writable());
  auto it = impl_->families.find(MapsFamily(fingerprint));
  if (it == impl_->families.end()) {
    return FailedPrecondition("model " + FingerprintHex(fingerprint) + " has no map store");
  }
  rocksdb::WriteBatch batch;
  if (replaced_id != 0) batch.Delete(it->second, MapKey(replaced_id));
  batch.Put(it->second, MapKey(map.id), EncodeMap(map));
  return FromRocks(impl_->db->Write(impl_->WriteOpts(), &batch),
                   "writing map " + std::to_string(map.id));
}

Status StoreDb::ScanMaps(uint64_t fingerprint, uint32_t hidden, size_t map_width,
                         const std::function<bool(const MapView&)>& visit,
                         std::vector<std::string>* corrupt) {
  FMOE_RETURN_IF_ERROR(Readable());
  const std::string family = MapsFamily(fingerprint);
  auto fam = impl_->families.find(family);
  if (fam == impl_->families.end()) return Status::Ok();
  std::unique_ptr<rocksdb::Iterator> it(
      impl_->db->NewIterator(rocksdb::ReadOptions(), fam->second));
  std::vector<uint64_t> aligned;
  auto finite = [](const flatbuffers::Vector<float>* v) {
    return std::all_of(v->begin(), v->end(), [](float x) { return std::isfinite(x); });
  };
  for (it->SeekToFirst(); it->Valid(); it->Next()) {
    uint64_t key_id = 0;
    const bool key_ok = ParseMapKey(it->key(), &key_id);
    auto where = [&] {
      return family + "/" +
             (key_ok ? std::to_string(key_id)
                     : "<key of " + std::to_string(it->key().size()) + " bytes>");
    };
    std::string why;
    const fb::StoreRecord* rec =
        VerifyRecord(std::string_view(it->value().data(), it->value().size()), &aligned, &why);
    const fb::StoredMap* m = rec != nullptr ? rec->record_as_StoredMap() : nullptr;
    if (rec == nullptr) {
      corrupt->push_back(where() + ": " + why);
    } else if (!key_ok || m == nullptr) {
      corrupt->push_back(where() + ": not a stored map");
    } else if (m->id() != key_id || m->id() == 0) {
      corrupt->push_back(where() + ": holds id " + std::to_string(m->id()));
    } else if (m->sem() == nullptr || m->sem()->size() != hidden) {
      corrupt->push_back(where() + ": semantic embedding is not " + std::to_string(hidden) +
                         " floats");
    } else if (m->map() == nullptr || m->map()->size() != map_width) {
      corrupt->push_back(where() + ": expert map is not " + std::to_string(map_width) + " floats");
    } else if (!finite(m->sem()) || !finite(m->map())) {
      corrupt->push_back(where() + ": holds a non-finite value");
    } else {
      const MapView view{m->id(),
                         m->row(),
                         m->request_id(),
                         m->iteration(),
                         m->stored_unix_ms(),
                         {m->sem()->data(), m->sem()->size()},
                         {m->map()->data(), m->map()->size()}};
      if (!visit(view)) return Status::Ok();
    }
  }
  return FromRocks(it->status(), "reading " + family);
}

Result<StoreDb::MapContents> StoreDb::LoadMaps(uint64_t fingerprint, uint32_t hidden,
                                               size_t map_width) {
  MapContents out;
  FMOE_RETURN_IF_ERROR(ScanMaps(
      fingerprint, hidden, map_width,
      [&](const MapView& m) {
        out.maps.push_back({m.id, m.row, m.request_id, m.iteration, m.stored_unix_ms,
                            std::vector<float>(m.sem.begin(), m.sem.end()),
                            std::vector<float>(m.map.begin(), m.map.end())});
        return true;
      },
      &out.corrupt));
  std::sort(out.maps.begin(), out.maps.end(), [](const MapRow& a, const MapRow& b) {
    return a.row != b.row ? a.row < b.row : a.id < b.id;
  });
  return out;
}

uint64_t StoreDb::CountMaps(uint64_t fingerprint) {
  if (impl_->db == nullptr) return 0;
  auto it = impl_->families.find(MapsFamily(fingerprint));
  if (it == impl_->families.end()) return 0;
  uint64_t n = 0;
  std::unique_ptr<rocksdb::Iterator> iter(
      impl_->db->NewIterator(rocksdb::ReadOptions(), it->second));
  for (iter->SeekToFirst(); iter->Valid(); iter->Next()) ++n;
  return n;
}

}  // namespace fmoe
