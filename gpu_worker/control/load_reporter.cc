#include "gpu_worker/control/load_reporter.h"

#include <algorithm>
#include <chrono>

#include <spdlog/spdlog.h>

#include "common/process_util.h"

namespace fmoe {

LoadReporter::LoadReporter(LoadReporterOptions options)
    : options_(std::move(options)), instance_id_(RandomId()) {}

LoadReporter::~LoadReporter() { Stop(); }

Status LoadReporter::Start() {
  wire::SocketOptions socket_options;
  socket_options.routing_id = "w/" + options_.group + "/0/loading";
  socket_options.send_hwm = 4;  // Reports are worth nothing late.
  socket_options.immediate = true;
  socket_options.linger_ms = 0;
  FMOE_ASSIGN_OR_RETURN(
      socket_, wire::WorkerSocket::Connect(context_, wire::Role::kDealer, options_.router_endpoint,
                                           socket_options));
  thread_ = std::thread([this] { Loop(); });
  return Status::Ok();
}

void LoadReporter::Progress(uint64_t loaded_bytes, uint64_t total_bytes) {
  total_.store(total_bytes);
  loaded_.store(total_bytes != 0 ? std::min(loaded_bytes, total_bytes) : loaded_bytes);
}

void LoadReporter::Stop() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stop_) return;
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  socket_.reset();
}

void LoadReporter::Loop() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    WorkerLoading report;
    report.group = options_.group;
    report.instance_id = instance_id_;
    report.total_bytes = total_.load();
    report.loaded_bytes = loaded_.load();
    if (Status s = socket_->Send(report); s.ok()) {
      sent_.fetch_add(1);
    } else {
      spdlog::debug("loading report not sent: {}", s.ToString());
    }
    if (cv_.wait_for(lock, std::chrono::milliseconds(options_.interval_ms),
                     [this] { return stop_; })) {
      return;
    }
  }
}

}  // namespace fmoe
