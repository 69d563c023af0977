#include "map_service/store_db.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <string_view>

#include <flatbuffers/flatbuffers.h>
#include <rocksdb/db.h>
#include <rocksdb/options.h>
#include <rocksdb/write_batch.h>

#include "common/model/model_config.h"
#include "common/process_util.h"
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

}  // namespace

struct StoreDb::Impl {
  std::string path;
  bool sync = false;
  std::unique_ptr<rocksdb::DB> db;
  std::map<std::string, rocksdb::ColumnFamilyHandle*> families;  // Owned; closed in ~Impl.

  ~Impl() {
    if (!db) return;
    for (auto& [name, handle] : families) {
      if (handle != db->DefaultColumnFamily()) db->DestroyColumnFamilyHandle(handle);
    }
    db->Close();
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

Result<std::unique_ptr<StoreDb>> StoreDb::Open(const StoreDbOptions& options) {
  FMOE_RETURN_IF_ERROR(EnsureWritableDir(options.path));
  auto impl = std::make_unique<Impl>();
  impl->path = options.path;
  impl->sync = options.sync;

  rocksdb::Options db_options;
  db_options.create_if_missing = true;
  db_options.create_missing_column_families = true;
  db_options.paranoid_checks = true;
  db_options.max_open_files = 256;
  db_options.keep_log_file_num = 4;

  std::vector<std::string> names;
  rocksdb::Status s = rocksdb::DB::ListColumnFamilies(db_options, options.path, &names);
  if (!s.ok()) names = {rocksdb::kDefaultColumnFamilyName};  // A new database.
  std::vector<rocksdb::ColumnFamilyDescriptor> descriptors;
  for (const auto& name : names) descriptors.emplace_back(name, rocksdb::ColumnFamilyOptions());
  std::vector<rocksdb::ColumnFamilyHandle*> handles;
  rocksdb::DB* raw = nullptr;
  s = rocksdb::DB::Open(db_options, options.path, descriptors, &handles, &raw);
  if (!s.ok()) {
    std::string text = s.ToString();
    if (s.IsIOError() && text.find("lock") != std::string::npos) {
      return AlreadyExists("data directory " + options.path +
                           " is in use by another map service (its RocksDB lock is held)");
    }
    return FromRocks(s, "data directory " + options.path);
  }
  impl->db.reset(raw);
  for (size_t i = 0; i < handles.size(); ++i) impl->families[names[i]] = handles[i];
  return std::unique_ptr<StoreDb>(new StoreDb(std::move(impl)));
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

Status StoreDb::RecordRegistration(const ModelRow* model, const RankRow& rank) {
  rocksdb::WriteBatch batch;
  if (model != nullptr) {
    std::string family = MapsFamily(model->fingerprint);
    if (impl_->families.count(family) == 0) {
      rocksdb::ColumnFamilyHandle* handle = nullptr;
      FMOE_RETURN_IF_ERROR(
          FromRocks(impl_->db->CreateColumnFamily(rocksdb::ColumnFamilyOptions(), family, &handle),
                    "creating column family " + family));
      impl_->families[family] = handle;
    }
    batch.Put(ModelKey(model->fingerprint), EncodeModel(*model));
  }
  batch.Put(RankKey(rank.group, rank.rank), EncodeRank(rank));
  return FromRocks(impl_->db->Write(impl_->WriteOpts(), &batch), "writing registration");
}

Status StoreDb::RecordModel(const ModelRow& model) {
  std::string family = MapsFamily(model.fingerprint);
  if (impl_->families.count(family) == 0) {
    rocksdb::ColumnFamilyHandle* handle = nullptr;
    FMOE_RETURN_IF_ERROR(
        FromRocks(impl_->db->CreateColumnFamily(rocksdb::ColumnFamilyOptions(), family, &handle),
                  "creating column family " + family));
    impl_->families[family] = handle;
  }
  rocksdb::WriteBatch batch;
  batch.Put(ModelKey(model.fingerprint), EncodeModel(model));
  return FromRocks(impl_->db->Write(impl_->WriteOpts(), &batch), "writing model record");
}

Status StoreDb::PutMap(uint64_t fingerprint, const MapRow& map, uint64_t replaced_id) {
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
  auto it = impl_->families.find(MapsFamily(fingerprint));
  if (it == impl_->families.end()) return 0;
  uint64_t n = 0;
  std::unique_ptr<rocksdb::Iterator> iter(
      impl_->db->NewIterator(rocksdb::ReadOptions(), it->second));
  for (iter->SeekToFirst(); iter->Valid(); iter->Next()) ++n;
  return n;
}

}  // namespace fmoe
