#include "services/launcher.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <set>
#include <thread>

#include <spdlog/spdlog.h>

#include "common/clock.h"
#include "common/http_client.h"
#include "common/json.h"
#include "common/model/model_config.h"
#include "common/process_util.h"
#include "common/wire/curve_key.h"
#include "services/reach.h"
#include "services/supervisor.h"

namespace fmoe {
namespace {

namespace fs = std::filesystem;

std::string ThisHostName() {
  char name[256] = {0};
  return gethostname(name, sizeof(name) - 1) == 0 ? std::string(name) : std::string();
}

// Whether a rank on `host` runs here: `this_host` when given, else a loopback name, 0.0.0.0 or
// gethostname().
bool IsLocalHost(const std::string& host, const std::string& this_host) {
  if (!this_host.empty()) return host == this_host;
  if (host == "127.0.0.1" || host == "localhost" || host == "::1" || host == "0.0.0.0") {
    return true;
  }
  const std::string name = ThisHostName();
  return !name.empty() && host == name;
}

// How long the launcher's checks wait for a host name to resolve: a DNS server that does not
// answer must not hold the launch for the resolver's own timeouts.
constexpr int kResolveTimeoutMs = 5000;

// CheckTcpPortFree on `host`, a name resolved first within kResolveTimeoutMs (ResolveIpv4).
Status CheckPortFreeBounded(const std::string& host, int port) {
  auto address = ResolveIpv4(host, kResolveTimeoutMs);
  if (!address.ok()) {
    return InvalidArgument(
        fmt::format("{}:{}: cannot resolve {} ({})", host, port, host, address.status().message()));
  }
  Status s = CheckTcpPortFree(*address, port);
  if (s.ok() || *address == host) return s;
  return Status(s.code(), fmt::format("{} (resolved to {})", s.message(), *address));
}

// The TCP port of "tcp://host:port", or nullopt for ipc endpoints.
std::optional<HostPort> TcpOf(const std::string& endpoint) { return TcpEndpoint(endpoint); }

// A local rank's host must be an address of this machine: Gloo binds the rank's connections to
// it, and rank 0's rendezvous listens on it.
Status CheckLocalRankHosts(const Manifest& manifest, const LaunchOptions& options) {
  std::set<std::string> checked;
  for (size_t g = 0; g < manifest.worker_groups.size(); ++g) {
    const WorkerGroupSpec& group = manifest.worker_groups[g];
    for (size_t r = 0; r < group.workers.size(); ++r) {
      const std::string& host = group.workers[r].host;
      if (!IsLocalHost(host, options.host) || host == "::1" || !checked.insert(host).second) {
        continue;
      }
      const std::string launcher_host =
          options.host.empty() ? "" : " (this launcher's --host " + options.host + ")";
      const char* why =
          "; the rank binds its group's connections to it, so it must be an address of the host "
          "that runs the rank";
      auto address = ResolveIpv4(host, kResolveTimeoutMs);
      if (!address.ok()) {
        return InvalidArgument(
            fmt::format("worker_groups[{}].workers[{}].host: {} does not "
                        "resolve ({}){}{}",
                        g, r, host, address.status().message(), launcher_host, why));
      }
      Status s = CheckTcpPortFree(*address, 0);
      if (s.ok() || s.code() != ErrorCode::kInvalidArgument) continue;
      return InvalidArgument(
          fmt::format("worker_groups[{}].workers[{}].host: {} is not an address of this host{}{}",
                      g, r, host, launcher_host, why));
    }
  }
  return Status::Ok();
}

// One process a workers-only launcher waits for before it starts its ranks.
struct WaitTarget {
  std::string what;      // "the map service"
  std::string endpoint;  // tcp://HOST:PORT
  HostPort address;
  bool required = false;  // Not reachable by the limit: an error (else a warning).
  bool reachable = false;
  std::string last_error;
};

}  // namespace

int WaitForServices(const Manifest& manifest, const Clock& clock,
                    const std::function<bool(int64_t)>& wait) {
  const int64_t limit_ms = int64_t{manifest.launcher.services_wait_s} * 1000;
  if (limit_ms == 0) return 0;
  std::vector<WaitTarget> targets;
  if (auto hp = TcpEndpoint(manifest.map_service.endpoint)) {
    targets.push_back({"the map service", manifest.map_service.endpoint, *hp, false, false, ""});
  }
  if (auto hp = TcpEndpoint(manifest.router.worker_endpoint)) {
    targets.push_back({"the router", manifest.router.worker_endpoint, *hp, true, false, ""});
  }
  const int64_t start = clock.NowMs();
  int64_t next_report = start + 10000;
  for (const WaitTarget& t : targets) {
    spdlog::info("waiting for {} at {} (host {}), up to {} s (launcher.services_wait_s)", t.what,
                 t.endpoint, t.address.host, manifest.launcher.services_wait_s);
  }
  for (;;) {
    bool all = true;
    for (WaitTarget& t : targets) {
      if (t.reachable) continue;
      Status s = ProbeTcp(t.address.host, t.address.port, 1000);
      if (s.ok()) {
        t.reachable = true;
        spdlog::info("{} at {} (host {}) is reachable after {:.1f} s", t.what, t.endpoint,
                     t.address.host, static_cast<double>(clock.NowMs() - start) / 1000.0);
      } else {
        t.last_error = s.message();
        all = false;
      }
    }
    if (all) return 0;
    const int64_t now = clock.NowMs();
    if (now - start >= limit_ms) {
      int rc = 0;
      for (const WaitTarget& t : targets) rc = !t.reachable && t.required ? 1 : rc;
      for (const WaitTarget& t : targets) {
        if (t.reachable) continue;
        if (t.required) {
          std::fprintf(stderr,
                       "fmoe: %s at %s (host %s) is not reachable after %d s "
                       "(launcher.services_wait_s): %s\n",
                       t.what.c_str(), t.endpoint.c_str(), t.address.host.c_str(),
                       manifest.launcher.services_wait_s, t.last_error.c_str());
        } else {
          spdlog::warn(
              "{} at {} (host {}) is not reachable after {} s (launcher.services_wait_s): {}{}",
              t.what, t.endpoint, t.address.host, manifest.launcher.services_wait_s, t.last_error,
              rc == 0 ? "; starting the ranks anyway (they serve without maps and "
                        "register when it comes)"
                      : "");
        }
      }
      return rc;
    }
    if (now >= next_report) {
      next_report = now + 10000;
      for (const WaitTarget& t : targets) {
        if (t.reachable) continue;
        spdlog::info("still waiting for {} at {} (host {}), {} s: {}", t.what, t.endpoint,
                     t.address.host, (now - start) / 1000, t.last_error);
      }
    }
    if (wait(std::min<int64_t>(500, start + limit_ms - now))) return -1;
  }
}

namespace {

// Writes the status file atomically (temporary file, then rename).
void WriteStatusFile(const std::string& path, const Manifest& manifest, const Supervisor& sup,
                     uint64_t started_unix_ms) {
  nlohmann::json procs = nlohmann::json::array();
  for (const auto& p : sup.processes()) {
    procs.push_back({{"name", p.spec.name},
                     {"pid", p.pid},
                     {"state", std::string(ProcStateName(p.state))},
                     {"given_up", p.given_up},
                     {"restarts", p.restarts},
                     {"last_exit", p.last_exit},
                     {"log", p.spec.log_path}});
  }
  const char* phase = "starting";
  switch (sup.phase()) {
    case Supervisor::Phase::kStarting:
      phase = "starting";
      break;
    case Supervisor::Phase::kRunning:
      phase = "running";
      break;
    case Supervisor::Phase::kStopping:
      phase = "stopping";
      break;
    case Supervisor::Phase::kStopped:
      phase = "stopped";
      break;
    case Supervisor::Phase::kFailed:
      phase = "failed";
      break;
  }
  nlohmann::json body = {{"launcher_pid", getpid()},
                         {"manifest", manifest.source_path},
                         {"phase", phase},
                         {"failure", sup.failure()},
                         {"started_unix_ms", started_unix_ms},
                         {"updated_unix_ms", UnixMs()},
                         {"router", "http://" + manifest.router.listen},
                         {"processes", procs}};
  std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << body.dump(2) << "\n";
    if (!out) {
      spdlog::warn("cannot write {}", tmp);
      return;
    }
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) spdlog::warn("cannot write {}: {}", path, ec.message());
}

}  // namespace

std::string StatusFilePath(const Manifest& manifest) {
  return (fs::path(manifest.launcher.run_dir) / "launcher.json").string();
}

std::vector<ProcessSpec> PlanProcesses(const Manifest& manifest, const LaunchOptions& options) {
  const fs::path bin(options.bin_dir);
  const fs::path logs = fs::path(manifest.launcher.run_dir) / "logs";
  std::vector<ProcessSpec> plan;
  if (!options.workers_only) {
    // Serving needs no map (DESIGN section 8: the caches fall back to their own policy), so the
    // map service never stops the cluster: start-up goes on without it, and a crash loop only
    // stops it for a while.
    ProcessSpec maps{"map-service",
                     {(bin / "fmoe-map-service").string(), "--manifest", manifest.source_path},
                     (logs / "map-service.log").string(),
                     0};
    maps.essential = false;
    maps.needed_at_start = false;
    plan.push_back(std::move(maps));
  }
  for (const auto& group : manifest.worker_groups) {
    for (size_t r = 0; r < group.workers.size(); ++r) {
      std::string name = "worker-" + group.name + "-" + std::to_string(r);
      if (!IsLocalHost(group.workers[r].host, options.host)) {
        // Expected on the hosts of a multi-host manifest; worth a warning on a single host.
        spdlog::log(options.workers_only ? spdlog::level::info : spdlog::level::warn,
                    "{} runs on {}: not started by this launcher", name, group.workers[r].host);
        continue;
      }
      std::vector<std::string> argv = {(bin / "fmoe-worker").string(),
                                       "--manifest",
                                       manifest.source_path,
                                       "--group",
                                       group.name,
                                       "--rank",
                                       std::to_string(r)};
      // Only the leader records the group's trace.
      if (r == 0 && !group.record_trace.empty()) {
        argv.insert(argv.end(), {"--record-trace", group.record_trace});
      }
      ProcessSpec worker{name, std::move(argv), (logs / (name + ".log")).string(), 2,
                         "group:" + group.name};
      worker.stop_stage = 1;  // After the router, which drains first.
      // A group that keeps failing is given up on for a while; the other groups serve on.
      worker.essential = false;
      plan.push_back(std::move(worker));
    }
  }
  if (!options.workers_only) {
    // Before the workers: it answers /health "loading" while they load.
    ProcessSpec router{"router",
                       {(bin / "fmoe-router").string(), "--manifest", manifest.source_path},
                       (logs / "router.log").string(),
                       1};
    router.stop_stage = 2;  // Stopped first: it stops accepting and lets answers finish.
    // Its drain, and then 5 s to end the streams still open, before SIGKILL.
    router.stop_timeout_ms =
        std::max<int64_t>(int64_t{manifest.launcher.stop_timeout_s} * 1000,
                          static_cast<int64_t>(manifest.router.drain_timeout_s * 1000) + 5000);
    plan.insert(plan.begin() + 1, std::move(router));
  }
  return plan;
}

Status Preflight(const Manifest& manifest, const std::vector<ProcessSpec>& plan,
                 const LaunchOptions& options) {
  for (const auto& p : plan) {
    if (access(p.argv[0].c_str(), X_OK) != 0) {
      return NotFound(p.argv[0] + ": not found or not executable (build the project first)");
    }
  }
  auto model = LoadModelInfo(manifest.model.path);
  if (!model.ok()) return model.status().WithContext("model.path");
  if (!model->runtime_unsupported.empty()) {
    return FailedPrecondition("model.path: " + model->dir + ": " + model->runtime_unsupported);
  }
  FMOE_RETURN_IF_ERROR(
      EnsureWritableDir(manifest.launcher.run_dir).WithContext("launcher.run_dir"));
  FMOE_RETURN_IF_ERROR(EnsureWritableDir((fs::path(manifest.launcher.run_dir) / "logs").string())
                           .WithContext("launcher.run_dir"));
  // The cluster key: made here on the main host when missing; a workers-only host holds a copy.
  if (manifest.security.curve) {
    auto key = wire::LoadCurveKey(manifest.security.key_file, !options.workers_only);
    if (!key.ok()) return key.status().WithContext("security.key_file");
  }
  FMOE_RETURN_IF_ERROR(CheckLocalRankHosts(manifest, options));
  if (options.workers_only) return Status::Ok();  // The map service and router run elsewhere.
  if (Status s = EnsureWritableDir(manifest.map_service.data_dir); !s.ok()) {
    // A store already there is served read-only while its disk refuses writes (the map service
    // retries and recovers, map_service/README.md); only a store that cannot exist is fatal.
    std::error_code ec;
    if (!fs::exists(fs::path(manifest.map_service.data_dir) / "CURRENT", ec)) {
      return s.WithContext("map_service.data_dir");
    }
    spdlog::warn(
        "map_service.data_dir: {}; the map service serves its store read-only until "
        "writes succeed again",
        s.message());
  }
  auto listen = ParseHostPort(manifest.router.listen);
  if (!listen.ok()) return listen.status().WithContext("router.listen");
  FMOE_RETURN_IF_ERROR(
      CheckPortFreeBounded(listen->host, listen->port).WithContext("router.listen"));
  if (auto hp = TcpOf(manifest.router.worker_endpoint)) {
    FMOE_RETURN_IF_ERROR(
        CheckPortFreeBounded(hp->host, hp->port).WithContext("router.worker_endpoint"));
  }
  if (auto hp = TcpOf(manifest.map_service.endpoint)) {
    FMOE_RETURN_IF_ERROR(
        CheckPortFreeBounded(hp->host, hp->port).WithContext("map_service.endpoint"));
  }
  return Status::Ok();
}

int Launch(const Manifest& manifest, const LaunchOptions& options) {
  StopSignals& signals = StopSignals::Install();
  std::vector<ProcessSpec> plan = PlanProcesses(manifest, options);
  const std::string this_host = options.host.empty() ? ThisHostName() : options.host;
  if (options.workers_only && plan.empty()) {
    std::fprintf(stderr,
                 "fmoe: --workers-only: no worker rank of any group runs on this host (%s); "
                 "name it with --host as worker_groups[].workers[].host writes it\n",
                 this_host.c_str());
    return 2;
  }
  if (Status s = Preflight(manifest, plan, options); !s.ok()) {
    std::fprintf(stderr, "fmoe: %s\n", s.message().c_str());
    return 1;
  }
  // One launcher per run directory.
  const std::string lock_path = (fs::path(manifest.launcher.run_dir) / "launcher.lock").string();
  int lock_fd = open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (lock_fd < 0 || flock(lock_fd, LOCK_EX | LOCK_NB) != 0) {
    std::fprintf(stderr, "fmoe: another launcher is running with run_dir %s (see `fmoe status`)\n",
                 manifest.launcher.run_dir.c_str());
    return 1;
  }

  if (options.workers_only) {
    // The ranks need the router (the leader joins it) and the map service: say what they wait
    // for here, rather than leave each rank's log to show retries.
    const int waited = WaitForServices(manifest, SteadyClock::Get(),
                                       [&signals](int64_t ms) { return signals.WaitMs(ms); });
    if (waited != 0) {
      if (waited < 0)
        spdlog::info("signal {}: stopping before any rank started", signals.last_signal());
      flock(lock_fd, LOCK_UN);
      close(lock_fd);
      return waited < 0 ? 0 : 1;
    }
  }

  SupervisorOptions sup_options;
  sup_options.ready_timeout_ms = manifest.launcher.ready_timeout_s * 1000LL;
  sup_options.stop_timeout_ms = manifest.launcher.stop_timeout_s * 1000LL;
  sup_options.initial_backoff_ms = manifest.launcher.restart.initial_backoff_ms;
  sup_options.max_backoff_ms = manifest.launcher.restart.max_backoff_ms;
  sup_options.max_restarts = manifest.launcher.restart.max_restarts;
  sup_options.window_ms = manifest.launcher.restart.window_s * 1000LL;

  PosixProcessRunner runner;
  const Clock& clock = SteadyClock::Get();
  Supervisor sup(sup_options, plan, runner, clock);
  const std::string status_path = StatusFilePath(manifest);
  const uint64_t started_unix_ms = UnixMs();
  sup.set_on_change([&] { WriteStatusFile(status_path, manifest, sup, started_unix_ms); });
  if (manifest.security.curve) {
    spdlog::info("ZeroMQ sockets authenticate with the cluster key {}", manifest.security.key_file);
  } else {
    spdlog::warn(
        "security.curve is off: any peer that reaches the cluster's ZeroMQ sockets can "
        "speak on them (register models, pose as a worker, post directives)");
  }
  spdlog::info("launching {} processes from {} (logs in {}/logs){}", plan.size(),
               manifest.source_path, manifest.launcher.run_dir,
               options.workers_only ? ", worker ranks only" : "");
  std::string local_ranks;  // For the workers-only "up" line.
  for (const auto& p : plan) local_ranks += (local_ranks.empty() ? "" : ", ") + p.name;

  auto listen = ParseHostPort(manifest.router.listen);
  const std::string url = "http://" + manifest.router.listen;
  bool announced = false;
  int64_t health_deadline = 0;
  int64_t next_probe = 0;
  int handled_signals = 0;
  int64_t first_signal_ms = 0;
  for (;;) {
    sup.Step();
    if (signals.count() > handled_signals) {
      // A second signal within a second is the same request delivered twice (a wrapper
      // forwarding it, say); a later one means "stop now".
      bool now = handled_signals > 0 && clock.NowMs() - first_signal_ms >= 1000;
      if (handled_signals == 0) first_signal_ms = clock.NowMs();
      handled_signals = signals.count();
      spdlog::info("signal {}: stopping{}", signals.last_signal(),
                   now ? " now (second signal: SIGKILL)" : " in reverse order");
      sup.BeginStop(now);
    }
    if (sup.phase() == Supervisor::Phase::kFailed) sup.BeginStop();
    if (sup.phase() == Supervisor::Phase::kStopped) break;
    if (sup.phase() == Supervisor::Phase::kRunning && !announced && options.workers_only) {
      // Every local rank is ready; the router on another host serves them.
      announced = true;
      std::printf(
          "\nfmoe is up (worker ranks only): %s on host %s (logs: %s/logs); router %s\n"
          "  stop: Ctrl-C (or SIGTERM to pid %d); status: fmoe status %s\n\n",
          local_ranks.c_str(), this_host.c_str(), manifest.launcher.run_dir.c_str(), url.c_str(),
          getpid(), manifest.source_path.c_str());
      std::fflush(stdout);
    }
    if (sup.phase() == Supervisor::Phase::kRunning && !announced) {
      int64_t now = clock.NowMs();
      if (health_deadline == 0) health_deadline = now + sup_options.ready_timeout_ms;
      if (now >= next_probe) {
        next_probe = now + 200;
        auto health = http::Get(listen->host, listen->port, "/health", 1000);
        if (health.ok() && health->status == 200) {
          announced = true;
          std::printf(
              "\nfmoe is up: router %s, map service %s, %zu processes (logs: %s/logs)\n"
              "  try:  curl %s/health\n"
              "  stop: Ctrl-C (or SIGTERM to pid %d); status: fmoe status %s\n\n",
              url.c_str(), manifest.map_service.endpoint.c_str(), plan.size(),
              manifest.launcher.run_dir.c_str(), url.c_str(), getpid(),
              manifest.source_path.c_str());
          std::fflush(stdout);
        } else if (now >= health_deadline) {
          announced = true;
          spdlog::warn("router at {} does not report a live worker group yet: {}", url,
                       health.ok() ? health->body : health.status().message());
        }
      }
    }
    if (signals.stop_requested()) {
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    } else {
      signals.WaitMs(50);
    }
  }
  bool failed = !sup.failure().empty();
  if (failed) std::fprintf(stderr, "fmoe: %s\n", sup.failure().c_str());
  spdlog::info("all processes stopped");
  flock(lock_fd, LOCK_UN);
  close(lock_fd);
  return failed ? 1 : 0;
}

}  // namespace fmoe
