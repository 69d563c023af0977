#include "common/rocks_logger.h"

#include <chrono>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <mutex>

#include <spdlog/spdlog.h>

namespace fmoe {
namespace {

// RocksDB's info log, into ours: warnings and errors only (no LOG file beside the data, so a
// full disk cannot take the log down with it), at most kLines per kWindow, then one line with
// the count of the rest. Called from RocksDB's threads and the store writer.
class RocksLogger final : public rocksdb::Logger {
 public:
  RocksLogger() : rocksdb::Logger(rocksdb::InfoLogLevel::WARN_LEVEL) {}
  void LogHeader(const char*, va_list) override {}
  void Logv(const char* format, va_list ap) override {
    Emit(rocksdb::InfoLogLevel::INFO_LEVEL, format, ap);
  }
  void Logv(const rocksdb::InfoLogLevel level, const char* format, va_list ap) override {
    Emit(level, format, ap);
  }

 private:
  static constexpr int kLines = 5;
  static constexpr auto kWindow = std::chrono::seconds(10);

#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wformat-nonliteral"
  void Emit(rocksdb::InfoLogLevel level, const char* format, va_list ap) {
    if (level < GetInfoLogLevel() || level == rocksdb::InfoLogLevel::HEADER_LEVEL) return;
    char text[1024];
    std::vsnprintf(text, sizeof(text), format, ap);
    const auto now = std::chrono::steady_clock::now();
    std::lock_guard<std::mutex> lock(mu_);
    if (now - window_start_ >= kWindow) {
      if (suppressed_ > 0) {
        spdlog::warn("rocksdb: {} more messages in the last {} s", suppressed_,
                     std::chrono::duration_cast<std::chrono::seconds>(now - window_start_).count());
      }
      window_start_ = now;
      lines_ = 0;
      suppressed_ = 0;
    }
    if (lines_ >= kLines) {
      ++suppressed_;
      return;
    }
    ++lines_;
    if (level >= rocksdb::InfoLogLevel::ERROR_LEVEL) {
      spdlog::error("rocksdb: {}", text);
    } else {
      spdlog::warn("rocksdb: {}", text);
    }
  }
#pragma GCC diagnostic pop

  std::mutex mu_;
  std::chrono::steady_clock::time_point window_start_{};  // GUARDED_BY(mu_)
  int lines_ = 0;                                         // GUARDED_BY(mu_)
  uint64_t suppressed_ = 0;                               // GUARDED_BY(mu_)
};

}  // namespace

std::shared_ptr<rocksdb::Logger> MakeRocksLogger() { return std::make_shared<RocksLogger>(); }

}  // namespace fmoe
