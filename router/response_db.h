// The Responses API's stored responses on disk (router.responses_dir): a RocksDB database, the
// only router file that includes RocksDB. Each response is two records written in one batch
// with the WAL on: "c/<id>" its conversation (JSON text) and "s/<id>" its last use (8 bytes,
// little-endian). Load reads them back and checks them; a record that does not read back whole
// (a torn or foreign value, a conversation that is not a JSON array) is reported and skipped,
// never dropped from the database. RocksDB's own log is not written beside the data. Not
// thread-safe: ResponseStore serializes its calls.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"

namespace fmoe {

class ResponseDb {
 public:
  // Opens (or creates) the database in `dir`. kUnavailable naming the directory when it cannot
  // be opened (another router holds it, a read-only or full disk, files that are not a
  // database).
  static Result<std::unique_ptr<ResponseDb>> Open(const std::string& dir);
  ~ResponseDb();
  ResponseDb(const ResponseDb&) = delete;
  ResponseDb& operator=(const ResponseDb&) = delete;

  struct Row {
    std::string id;
    uint64_t last_use = 0;
    std::string conversation;  // JSON text of an array.
  };
  // Every response whose two records read back whole, in ascending last_use; `skipped` (if
  // given): the ids of those that did not. kUnavailable when the database cannot be read.
  Result<std::vector<Row>> Load(std::vector<std::string>* skipped = nullptr);
  Status Put(const std::string& id, uint64_t last_use, const std::string& conversation);
  Status Touch(const std::string& id, uint64_t last_use);  // The last-use record only.
  Status Delete(const std::string& id);

  // Tests: writes `value` under `key` as it is (a corrupt record).
  Status PutRawForTest(const std::string& key, const std::string& value);

 private:
  struct Impl;
  explicit ResponseDb(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace fmoe
