// RocksDB's info log, into ours (spdlog): warnings and errors only, throttled, and no LOG file
// beside the data (so a full disk cannot take the log down with it). The map service's store and
// the router's stored responses set it as their databases' info_log.
#pragma once

#include <memory>

#include <rocksdb/env.h>

namespace fmoe {

std::shared_ptr<rocksdb::Logger> MakeRocksLogger();

}  // namespace fmoe
