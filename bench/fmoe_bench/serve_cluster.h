// One run's system for `fmoe-bench serve`: a manifest derived from the base one (policy, budget,
// fresh loopback ports, its own run and map directories) and the `fmoe launch` child that runs
// it. The owner (the serve command, on main's thread, which must outlive the child: the child
// dies with the thread that forked it) starts it, waits for /health, and stops it; the destructor
// stops it too, so no process outlives an error path. Leftovers are found because Start() makes
// this process a child subreaper: descendants orphaned by the launcher become our children.
#pragma once

#include <sys/types.h>

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "common/manifest.h"
#include "common/status.h"

namespace fmoe::bench {

// The base manifest for one run: every group gets `policy` and expert_cache_fraction `fraction`
// (expert_cache_gb dropped); the router, map service, worker endpoint and each group's rendezvous
// get ports that were free a moment ago; run_dir = dir/run (the cluster key in it), map
// data_dir = dir/maps.
Manifest DeriveManifest(const Manifest& base, const std::string& policy, double fraction,
                        const std::string& dir);

// The manifest as YAML that LoadManifest reads back to the same values: DescribeManifest's,
// with the API keys it redacts written out.
std::string ManifestYaml(const Manifest& manifest);

// Writes ManifestYaml to `path` and checks that it loads back to the same configuration.
// Returns the loaded manifest (source_path = path).
Result<Manifest> WriteManifest(const Manifest& manifest, const std::string& path);

// The last `lines` lines of a file ("" when it cannot be read).
std::string TailFile(const std::string& path, int lines);

class LaunchedCluster {
 public:
  // Starts `fmoe_bin launch manifest_path` in its own process group, output to log_path.
  static Result<std::unique_ptr<LaunchedCluster>> Start(const std::string& fmoe_bin,
                                                        const Manifest& manifest,
                                                        const std::string& log_path);
  ~LaunchedCluster();  // Stop(10 s) if still running.
  LaunchedCluster(const LaunchedCluster&) = delete;
  LaunchedCluster& operator=(const LaunchedCluster&) = delete;

  // Polls the router's /health until it answers 200 with every group and the map service alive.
  // Errors: the launcher exited (with its exit), timeout (with the last /health answer), or
  // `stop()` became true.
  Status WaitReady(double timeout_s, const std::function<bool()>& stop);

  // True while the launcher runs (reaps it once it has exited).
  bool Running();
  // "exit code 1" etc. once it has exited; "" while running.
  const std::string& exit_description() const { return exit_; }

  // SIGTERM, then SIGKILL after timeout_s (or at once when `hurry()` turns true); then every
  // process it left behind gets SIGTERM, SIGKILL after 5 s, and is reaped. Idempotent.
  // Returns an error naming what had to be killed.
  Status Stop(double timeout_s, const std::function<bool()>& hurry = {});

  // The tail of the launcher's log and of each process log in the run directory.
  std::string LogTails(int lines) const;

  int router_port() const { return router_port_; }
  pid_t pid() const { return pid_; }

 private:
  LaunchedCluster() = default;
  bool Reap(bool block_ms_100);
  std::vector<pid_t> OrphanedChildren() const;

  pid_t pid_ = -1;
  bool reaped_ = false;
  std::string exit_;
  int router_port_ = 0;
  std::string log_path_;
  std::string run_dir_;
};

}  // namespace fmoe::bench
