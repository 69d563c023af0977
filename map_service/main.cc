// fmoe-map-service: the standalone expert map service. Reads the manifest, opens the store in
// its data directory, binds its socket, reports readiness, serves until SIGINT/SIGTERM.
#include <CLI/CLI.hpp>

#include "common/log.h"
#include "common/manifest.h"
#include "common/process_util.h"
#include "common/service_setup.h"
#include "common/wire/curve_key.h"
#include "map_service/map_service.h"

int main(int argc, char** argv) {
  using namespace fmoe;
  CLI::App app{"fmoe-map-service: expert map store, matching and prefetch directives"};
  std::string manifest_path;
  int ready_fd = -1;
  app.add_option("--manifest", manifest_path, "cluster manifest (YAML)")->required();
  app.add_option("--ready-fd", ready_fd, "file descriptor to write READY to once serving");
  CLI11_PARSE(app, argc, argv);

  Manifest manifest;
  if (int rc = SetUpService("fmoe-map-service", manifest_path, "map-service", &manifest); rc != 0) {
    return rc;
  }
  // Every ZeroMQ socket of this process authenticates with the cluster key.
  if (Status s = wire::UseClusterKey(manifest.security.curve, manifest.security.key_file, true);
      !s.ok()) {
    spdlog::error("{}", s.message());
    return 2;
  }
  StopSignals& signals = StopSignals::Install();

  // Manifest -> options, in this one place.
  MapServiceOptions options;
  options.endpoint = manifest.map_service.endpoint;
  options.data_dir = manifest.map_service.data_dir;
  options.sync = manifest.map_service.sync;
  options.store_capacity = manifest.map_service.store_capacity;
  options.prefetch_distance = manifest.map_service.prefetch_distance;
  options.heartbeat_timeout_ms = manifest.heartbeat.timeout_ms;
  options.memory_limit_mb = static_cast<uint64_t>(manifest.map_service.memory_limit_mb);
  spdlog::info(
      "effective config: endpoint={} data_dir={} sync={} store_capacity={} prefetch_distance={} "
      "memory_limit_mb={} heartbeat_timeout_ms={} max_pending_writes={} drain_timeout_ms={} "
      "writer_nice={}",
      options.endpoint, options.data_dir, options.sync, options.store_capacity,
      options.prefetch_distance, options.memory_limit_mb, options.heartbeat_timeout_ms,
      options.max_pending_writes, options.drain_timeout_ms, options.writer_nice);

  MapService service(options, SteadyClock::Get());
  if (Status s = service.Start(); !s.ok()) {
    spdlog::error("{}", s.message());
    return 1;
  }
  NotifyReady(ready_fd);
  service.Run([&signals] { return signals.stop_requested(); });
  spdlog::info("stopped (signal {})", signals.last_signal());
  return 0;
}
