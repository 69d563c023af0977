// `fmoe launch`: turns a manifest into processes (map service, then every local worker rank,
// then the router), checks what would otherwise fail obscurely (ports in use, unwritable
// directories, missing model or binaries), supervises them and stops them in reverse order on
// SIGINT/SIGTERM. Writes <run_dir>/launcher.json on every change for `fmoe status`, and holds
// <run_dir>/launcher.lock so two launchers never share a run directory. Runs on main's thread.
#pragma once

#include <string>
#include <vector>

#include "common/manifest.h"
#include "common/status.h"
#include "services/process.h"

namespace fmoe {

struct LaunchOptions {
  std::string bin_dir;  // Where fmoe-map-service, fmoe-worker, fmoe-router are.
};

// The processes a manifest asks for on this host, in start order.
std::vector<ProcessSpec> PlanProcesses(const Manifest& manifest, const std::string& bin_dir);

// Checks that need no child: binaries, model, directories, ports. One line on error, with the
// manifest key it concerns ("router.listen: 127.0.0.1:8000 is already in use").
Status Preflight(const Manifest& manifest, const std::vector<ProcessSpec>& plan);

// Runs the cluster until a stop signal (returns 0) or until supervision gives up (returns 1).
int Launch(const Manifest& manifest, const LaunchOptions& options);

// Path of the status file of a manifest's launcher.
std::string StatusFilePath(const Manifest& manifest);

}  // namespace fmoe
