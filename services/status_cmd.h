// `fmoe status MANIFEST`, on any host: probes every process the manifest names, each within a
// timeout, and prints one line per process (host, role, address, state). The map service is
// reached on its socket (admin Stats), the router over HTTP (/health), each worker rank through
// what those two report about it, and a group's rank 0 also at its rendezvous port. The local
// launcher's status file, when this host has one, adds pids and restarts. Runs on main's thread;
// the probes run at once, each on a thread of its own, and the command ends within about twice
// the probe timeout.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "common/json.h"
#include "common/manifest.h"
#include "common/status.h"

namespace fmoe {

// Exit codes of `fmoe status` (2 is a manifest that does not load, as for every subcommand).
inline constexpr int kStatusAllUp = 0;
inline constexpr int kStatusUnhealthy = 1;    // All reachable; one reports a problem.
inline constexpr int kStatusUnreachable = 3;  // At least one process is not reachable.

struct StatusOptions {
  bool json = false;      // Default: false (a table)
  int timeout_ms = 1000;  // Per probe (connect, then the answer), 1..60000. Default: 1000
};

enum class ProbeState { kUp, kUnhealthy, kUnreachable };

// One process of the manifest as seen from here.
struct ProcessReport {
  std::string name;     // The launcher's name: map-service, router, worker-<group>-<rank>.
  std::string host;     // Its host, as the manifest writes it.
  std::string role;     // "map service", "router", "rank 2 of group g0".
  std::string address;  // What was probed: tcp://HOST:PORT, http://HOST:PORT, HOST:PORT.
  ProbeState state = ProbeState::kUnreachable;
  std::string detail;  // Figures (up), the problem (unhealthy) or the error (not reachable).
  // When this host's launcher runs it: its pid and restarts; -1 otherwise.
  int64_t pid = -1;
  int restarts = -1;
};

// What the probes found; the input of BuildReports.
struct ProbeResults {
  Status map_service;                        // Ok when its Stats came back.
  nlohmann::json map_stats;                  // The map service's Stats, when Ok.
  Status router;                             // Ok when /health answered (any HTTP status).
  int health_code = 0;                       // /health's HTTP status.
  nlohmann::json health;                     // /health's body.
  std::map<std::string, Status> rendezvous;  // Per group of more than one rank: rank 0's port.
  // This host's launcher status file (null when there is none) and whether its launcher runs.
  nlohmann::json launcher_state;
  bool launcher_alive = false;
};

// One report per process: the map service, the router, then each group's ranks in order.
std::vector<ProcessReport> BuildReports(const Manifest& manifest, const ProbeResults& probes);

// The table: a header, one line per process, then one line per process that is not up, e.g.
//   host 192.0.2.1 (rank 0 of group g0): not reachable: rendezvous 192.0.2.1:29500: timed out ...
std::string FormatStatusTable(const std::vector<ProcessReport>& reports);

// kStatusAllUp, kStatusUnhealthy or kStatusUnreachable.
int StatusExitCode(const std::vector<ProcessReport>& reports);

// Probes, prints (a table, or JSON) and returns the exit code.
int PrintStatus(const Manifest& manifest, const StatusOptions& options);

}  // namespace fmoe
