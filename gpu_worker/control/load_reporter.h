// While a group's leader loads the model, tells the router how far it got: a WorkerLoading
// message every heartbeat interval, from its own thread and its own DEALER socket (routing id
// "w/GROUP/0/loading"), until Stop() or destruction. The router answers /health 503 "loading"
// with the progress meanwhile. Start/Stop by the owner; Progress() from any thread (the loader's
// callback). Sending never blocks the loader: a router that is not there yet misses reports.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "common/status.h"
#include "common/wire/wire.h"

namespace fmoe {

struct LoadReporterOptions {
  std::string group;            // Required.
  std::string router_endpoint;  // Required.
  int interval_ms = 500;        // Default: 500 (the heartbeat interval)
};

class LoadReporter {
 public:
  explicit LoadReporter(LoadReporterOptions options);
  ~LoadReporter();

  // Connects and starts reporting (0 of an unknown total until Progress).
  Status Start();
  void Progress(uint64_t loaded_bytes, uint64_t total_bytes);
  // Sends the last report and stops the thread; the socket closes without waiting.
  void Stop();
  uint64_t reports_sent() const { return sent_.load(); }

 private:
  void Loop();

  LoadReporterOptions options_;
  uint64_t instance_id_ = 0;
  wire::Context context_;
  std::unique_ptr<wire::WorkerSocket> socket_;
  std::atomic<uint64_t> loaded_{0};
  std::atomic<uint64_t> total_{0};
  std::atomic<uint64_t> sent_{0};
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;  // GUARDED_BY(mu_)
  std::thread thread_;
};

}  // namespace fmoe
