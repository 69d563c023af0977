// `fmoe launch`: turns a manifest into processes (map service, then every local worker rank,
// then the router; with --workers-only, the local worker ranks alone, for the other hosts of a
// multi-host manifest), checks what would otherwise fail obscurely (ports in use, unwritable
// directories, missing model or binaries), supervises them (the ranks of a group restart
// together) and stops them in reverse order on SIGINT/SIGTERM. Writes <run_dir>/launcher.json on
// every change for `fmoe status`, and holds <run_dir>/launcher.lock so two launchers never share
// a run directory (one per host). Runs on main's thread.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "common/clock.h"
#include "common/manifest.h"
#include "common/process_util.h"
#include "common/status.h"
#include "services/process.h"

namespace fmoe {

struct LaunchOptions {
  std::string bin_dir;  // Where fmoe-map-service, fmoe-worker, fmoe-router are.
  // This host's name as the manifest's workers[].host writes it: a rank is local when its host
  // equals it. Default: "" (local: a loopback name, 0.0.0.0 or gethostname()).
  std::string host;
  // Only this host's worker ranks: no map service, no router. Default: false
  bool workers_only = false;
};

// The processes a manifest asks for on this host, in start order. Each worker rank's unit is
// "group:<name>": the local ranks of a group restart together.
std::vector<ProcessSpec> PlanProcesses(const Manifest& manifest, const LaunchOptions& options);

// Checks that need no child: binaries, model, directories, ports (with workers_only: binaries,
// model and run_dir only). One line on error, with the manifest key it concerns
// ("router.listen: 127.0.0.1:8000 is already in use").
Status Preflight(const Manifest& manifest, const std::vector<ProcessSpec>& plan,
                 const LaunchOptions& options);

// The workers-only launcher's wait before it starts its ranks: until the map service and the
// router's worker endpoint (tcp ones) accept connections, up to launcher.services_wait_s, logging
// what it waits for, every 10 s what it still waits for, and when each became reachable. Returns
// 0 (go on; a map service still away is only a warning), 1 (the router not reachable by the
// limit; printed on stderr, naming it) or -1 (a stop signal came). `wait(ms)` sleeps up to ms
// and returns true when a stop was requested (StopSignals::WaitMs; tests advance a ManualClock).
int WaitForServices(const Manifest& manifest, const Clock& clock,
                    const std::function<bool(int64_t)>& wait);

// Runs the cluster until a stop signal (returns 0) or until supervision gives up (returns 1).
// Returns 2 for workers_only when no worker rank is local to this host.
int Launch(const Manifest& manifest, const LaunchOptions& options);

// Path of the status file of a manifest's launcher.
std::string StatusFilePath(const Manifest& manifest);

}  // namespace fmoe
