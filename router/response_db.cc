#include "router/response_db.h"

#include <algorithm>
#include <filesystem>
#include <map>

#include <rocksdb/db.h>
#include <rocksdb/options.h>
#include <rocksdb/write_batch.h>

#include "common/json.h"
#include "common/rocks_logger.h"

namespace fmoe {
namespace {

constexpr std::string_view kConversation = "c/";
constexpr std::string_view kLastUse = "s/";

std::string Encode(uint64_t v) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[static_cast<size_t>(i)] = static_cast<char>(v >> (8 * i));
  return out;
}

Status FromRocks(const rocksdb::Status& s, const std::string& what) {
  if (s.ok()) return Status::Ok();
  return Unavailable(what + ": " + s.ToString());
}

}  // namespace

struct ResponseDb::Impl {
  std::string dir;
  std::unique_ptr<rocksdb::DB> db;
  rocksdb::WriteOptions write;  // The WAL on, no fsync: a write survives the process's death.
};

ResponseDb::ResponseDb(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ResponseDb::~ResponseDb() = default;

Result<std::unique_ptr<ResponseDb>> ResponseDb::Open(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) return Unavailable("responses directory " + dir + ": " + ec.message());
  rocksdb::Options o;
  o.create_if_missing = true;
  o.info_log = MakeRocksLogger();
  o.info_log_level = rocksdb::InfoLogLevel::WARN_LEVEL;
  o.keep_log_file_num = 1;
  o.max_manifest_file_size = 4 << 20;
  rocksdb::DB* raw = nullptr;
  rocksdb::Status s = rocksdb::DB::Open(o, dir, &raw);
  if (!s.ok()) {
    if (s.IsIOError() && s.ToString().find("lock") != std::string::npos) {
      return Unavailable("responses directory " + dir +
                         " is in use by another router (its RocksDB lock is held)");
    }
    return FromRocks(s, "responses directory " + dir);
  }
  auto impl = std::make_unique<Impl>();
  impl->dir = dir;
  impl->db.reset(raw);
  return std::unique_ptr<ResponseDb>(new ResponseDb(std::move(impl)));
}

Result<std::vector<ResponseDb::Row>> ResponseDb::Load(std::vector<std::string>* skipped) {
  std::map<std::string, Row> rows;
  std::map<std::string, bool> whole;  // id -> both records read back.
  std::unique_ptr<rocksdb::Iterator> it(impl_->db->NewIterator(rocksdb::ReadOptions()));
  for (it->SeekToFirst(); it->Valid(); it->Next()) {
    const std::string key = it->key().ToString();
    const std::string_view value(it->value().data(), it->value().size());
    if (key.starts_with(kLastUse)) {
      const std::string id = key.substr(kLastUse.size());
      Row& r = rows[id];
      r.id = id;
      if (value.size() != 8) {
        whole[id] = false;
        continue;
      }
      for (int i = 0; i < 8; ++i) {
        r.last_use |= static_cast<uint64_t>(static_cast<uint8_t>(value[static_cast<size_t>(i)]))
                      << (8 * i);
      }
      whole.try_emplace(id, true);
    } else if (key.starts_with(kConversation)) {
      const std::string id = key.substr(kConversation.size());
      Row& r = rows[id];
      r.id = id;
      const nlohmann::json parsed =
          nlohmann::json::parse(value, nullptr, /*allow_exceptions=*/false);
      if (parsed.is_discarded() || !parsed.is_array()) {
        whole[id] = false;
        continue;
      }
      r.conversation.assign(value);
      whole.try_emplace(id, true);
    } else {
      // A key of neither kind: not ours; reported by its own name.
      if (skipped != nullptr) skipped->push_back(key);
    }
  }
  if (!it->status().ok()) return FromRocks(it->status(), "reading " + impl_->dir);
  std::vector<Row> out;
  for (auto& [id, row] : rows) {
    if (!whole[id] || row.conversation.empty() || row.last_use == 0) {
      if (skipped != nullptr) skipped->push_back(id);
      continue;
    }
    out.push_back(std::move(row));
  }
  std::sort(out.begin(), out.end(),
            [](const Row& a, const Row& b) { return a.last_use < b.last_use; });
  return out;
}

Status ResponseDb::Put(const std::string& id, uint64_t last_use, const std::string& conversation) {
  rocksdb::WriteBatch batch;
  batch.Put(std::string(kConversation) + id, conversation);
  batch.Put(std::string(kLastUse) + id, Encode(last_use));
  return FromRocks(impl_->db->Write(impl_->write, &batch), "storing response " + id);
}

Status ResponseDb::Touch(const std::string& id, uint64_t last_use) {
  return FromRocks(impl_->db->Put(impl_->write, std::string(kLastUse) + id, Encode(last_use)),
                   "storing response " + id + "'s last use");
}

Status ResponseDb::Delete(const std::string& id) {
  rocksdb::WriteBatch batch;
  batch.Delete(std::string(kConversation) + id);
  batch.Delete(std::string(kLastUse) + id);
  return FromRocks(impl_->db->Write(impl_->write, &batch), "deleting response " + id);
}

Status ResponseDb::PutRawForTest(const std::string& key, const std::string& value) {
  return FromRocks(impl_->db->Put(impl_->write, key, value), "storing " + key);
}

}  // namespace fmoe
