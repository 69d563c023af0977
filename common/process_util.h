// Process plumbing shared by the executables: stop signals, readiness notification, pre-flight
// checks that turn "port in use" and "unwritable directory" into one clear line, random ids.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "common/status.h"

namespace fmoe {

// Catches SIGINT and SIGTERM on a dedicated thread (sigwait), so no handler runs inside library
// code. Install() once in main() before any other thread starts: it blocks both signals in the
// calling thread, which every later thread inherits. SIGPIPE is ignored.
class StopSignals {
 public:
  static StopSignals& Install();

  bool stop_requested() const { return count_.load() > 0; }
  // Number of stop signals received (a second Ctrl-C can mean "now").
  int count() const { return count_.load(); }
  int last_signal() const { return last_signal_.load(); }
  // Waits up to timeout_ms; returns stop_requested().
  bool WaitMs(int64_t timeout_ms);
  // Runs `fn` on the signal thread after each stop signal (e.g. io_context::stop).
  void OnStop(std::function<void()> fn);

 private:
  StopSignals() = default;
  void Run();

  std::atomic<int> count_{0};
  std::atomic<int> last_signal_{0};
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<std::function<void()>> callbacks_;  // GUARDED_BY(mu_)
};

// Writes "READY\n" to the launcher's readiness pipe and closes it; no-op for fd < 0.
void NotifyReady(int fd);

// Binds and closes a TCP socket at host:port. Error: kAlreadyExists
// "127.0.0.1:8000 is already in use", or kInvalidArgument for a host that does not resolve or
// that is not an address of this host ("10.0.0.2:8000: cannot bind: 10.0.0.2 is not an address
// of this host (Cannot assign requested address)").
Status CheckTcpPortFree(const std::string& host, int port);

// Creates `dir` (and parents) if needed and proves it writable by creating and deleting a file.
// Error: kIoError "<dir>: not writable (Permission denied)".
Status EnsureWritableDir(const std::string& dir);

// 64 random bits from the OS (instance ids, request ids).
uint64_t RandomId();

// Directory of the running executable (/proc/self/exe), for finding sibling binaries.
std::string ExecutableDir();

// The host's available memory in bytes (/proc/meminfo MemAvailable). kUnavailable when it cannot
// be read.
Result<uint64_t> HostAvailableBytes();

}  // namespace fmoe
