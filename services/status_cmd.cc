#include "services/status_cmd.h"

#include <signal.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <exception>
#include <fstream>
#include <future>
#include <sstream>

#include <fmt/format.h>

#include "common/http_client.h"
#include "common/wire/wire.h"
#include "services/launcher.h"
#include "services/reach.h"

namespace fmoe {
namespace {

using Json = nlohmann::json;

bool PidAlive(int64_t pid) {
  return pid > 0 && (kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM);
}

// A connect first, so that an unreachable host is named as such (ZeroMQ's connect never fails);
// then the admin Stats, within the same timeout.
// A host name is resolved once, within the timeout, and the probes use its address: ZeroMQ and
// the HTTP client would resolve it again without a deadline.
Status ProbeMapService(const std::string& endpoint, int timeout_ms, Json* stats) {
  std::string connect_to = endpoint;
  if (auto hp = TcpEndpoint(endpoint)) {
    auto address = ResolveIpv4(hp->host, timeout_ms);
    if (!address.ok()) return address.status();
    FMOE_RETURN_IF_ERROR(ProbeTcp(*address, hp->port, timeout_ms));
    connect_to = fmt::format("tcp://{}:{}", *address, hp->port);
  }
  wire::Context context;
  wire::SocketOptions opts;
  opts.send_hwm = 1;
  auto socket = wire::MapSocket::Connect(context, wire::Role::kDealer, connect_to, opts);
  if (!socket.ok()) return socket.status();
  AdminRequest req;
  req.id = 1;
  req.op = AdminOp::kStats;
  FMOE_RETURN_IF_ERROR((*socket)->Send(req));
  auto reply = (*socket)->Receive(timeout_ms);
  if (!reply) {
    return Timeout(fmt::format(
        "connected, but no answer within {} ms (a process without the cluster key?)", timeout_ms));
  }
  const auto* r = std::get_if<AdminReply>(&reply->message);
  if (r == nullptr) return DataLoss("unexpected reply");
  if (!r->ok) return Unavailable(r->error);
  *stats = Json::parse(r->json, nullptr, false);
  if (stats->is_discarded() || !stats->is_object()) return DataLoss("malformed stats reply");
  return Status::Ok();
}

Status ProbeRouter(const std::string& listen, int timeout_ms, int* code, Json* health) {
  auto hp = ParseHostPort(listen);
  if (!hp.ok()) return hp.status();
  auto address = ResolveIpv4(hp->host, timeout_ms);
  if (!address.ok()) return address.status();
  FMOE_RETURN_IF_ERROR(ProbeTcp(*address, hp->port, timeout_ms));
  auto res = http::Get(*address, hp->port, "/health", timeout_ms);
  if (!res.ok()) return res.status();
  *code = res->status;
  *health = Json::parse(res->body, nullptr, false);
  if (health->is_discarded() || !health->is_object()) *health = Json::object();
  return Status::Ok();
}

// Runs fn on a thread of its own; a throw becomes an error (no exception leaves a probe).
template <class Fn>
std::future<Status> Async(Fn fn) {
  return std::async(std::launch::async, [fn = std::move(fn)]() -> Status {
    try {
      return fn();
    } catch (const std::exception& e) {
      return Internal(std::string("probe failed: ") + e.what());
    } catch (...) {
      return Internal("probe failed");
    }
  });
}

ProbeResults Probe(const Manifest& manifest, const StatusOptions& options) {
  ProbeResults out;
  const int t = options.timeout_ms;
  Json stats;
  int code = 0;
  Json health;
  auto map_future =
      Async([&] { return ProbeMapService(manifest.map_service.endpoint, t, &stats); });
  auto router_future =
      Async([&] { return ProbeRouter(manifest.router.listen, t, &code, &health); });
  std::map<std::string, std::future<Status>> rendezvous;
  for (const WorkerGroupSpec& g : manifest.worker_groups) {
    if (g.workers.size() < 2) continue;  // One rank has no rendezvous.
    rendezvous[g.name] = Async([&g, t] {
      auto hp = ParseHostPort(g.rendezvous);
      if (!hp.ok()) return hp.status();
      return ProbeTcp(hp->host, hp->port, t);
    });
  }
  out.map_service = map_future.get();
  out.map_stats = std::move(stats);
  out.router = router_future.get();
  out.health_code = code;
  out.health = std::move(health);
  for (auto& [name, f] : rendezvous) out.rendezvous[name] = f.get();

  std::ifstream in(StatusFilePath(manifest));
  if (in) {
    std::stringstream ss;
    ss << in.rdbuf();
    Json state = Json::parse(ss.str(), nullptr, false);
    if (!state.is_discarded() && state.is_object() && state.contains("processes")) {
      out.launcher_state = std::move(state);
      out.launcher_alive = PidAlive(out.launcher_state.value("launcher_pid", int64_t{0})) &&
                           out.launcher_state.value("phase", "") != "stopped";
    }
  }
  return out;
}

std::string StateText(const ProcessReport& r) {
  switch (r.state) {
    case ProbeState::kUp:
      return "up";
    case ProbeState::kUnhealthy:
      return "unhealthy";
    case ProbeState::kUnreachable:
      return "not reachable";
  }
  return "?";
}

void MarkUnhealthy(ProcessReport* r, const std::string& why) {
  if (r->state == ProbeState::kUp) r->state = ProbeState::kUnhealthy;
  r->detail += (r->detail.empty() ? "" : "; ") + why;
}

ProcessReport ReportMapService(const Manifest& manifest, const ProbeResults& p) {
  ProcessReport r;
  r.name = "map-service";
  r.role = "map service";
  r.address = manifest.map_service.endpoint;
  auto hp = TcpEndpoint(manifest.map_service.endpoint);
  r.host = hp ? hp->host : "this host (ipc)";
  if (!p.map_service.ok()) {
    r.detail = p.map_service.message();
    return r;
  }
  r.state = ProbeState::kUp;
  const Json& s = p.map_stats;
  const size_t ranks = s.contains("ranks") && s["ranks"].is_array() ? s["ranks"].size() : 0;
  const size_t models = s.contains("models") && s["models"].is_array() ? s["models"].size() : 0;
  r.detail = fmt::format("{} rank(s) registered, {} model(s)", ranks, models);
  // A store whose disk refuses writes: matching goes on, nothing new is kept.
  const Json store = s.value("store", Json::object());
  const Json state = store.is_object() ? store.value("state", Json("ok")) : Json("ok");
  if (state.is_string() && state.get<std::string>() != "ok") {
    const Json reason = store.value("reason", Json(""));
    MarkUnhealthy(&r, "store " + state.get<std::string>() + " (read-only" +
                          (reason.is_string() && !reason.get<std::string>().empty()
                               ? ": " + reason.get<std::string>()
                               : std::string()) +
                          ")");
  }
  return r;
}

ProcessReport ReportRouter(const Manifest& manifest, const ProbeResults& p) {
  ProcessReport r;
  r.name = "router";
  r.role = "router";
  r.address = "http://" + manifest.router.listen;
  auto hp = ParseHostPort(manifest.router.listen);
  r.host = hp.ok() ? hp->host : manifest.router.listen;
  if (!p.router.ok()) {
    r.detail = p.router.message();
    return r;
  }
  r.state = ProbeState::kUp;
  size_t alive = 0;
  size_t groups = 0;
  if (p.health.contains("groups") && p.health["groups"].is_array()) {
    for (const auto& g : p.health["groups"]) {
      ++groups;
      if (g.is_object() && g.value("alive", false)) ++alive;
    }
  }
  r.detail = fmt::format("/health {} {}, {} of {} group(s) alive", p.health_code,
                         p.health.value("status", std::string("?")), alive, groups);
  if (p.health_code != 200) MarkUnhealthy(&r, p.health.value("reason", std::string("not ready")));
  return r;
}

// A rank is known through the map service (its registration and heartbeats) and, for rank 0,
// the router (its group) and the rendezvous port it serves.
ProcessReport ReportRank(const WorkerGroupSpec& g, size_t rank, const ProbeResults& p) {
  ProcessReport r;
  r.name = "worker-" + g.name + "-" + std::to_string(rank);
  r.host = g.workers[rank].host;
  r.role = fmt::format("rank {} of group {}", rank, g.name);
  r.address = r.host;
  const bool serves_rendezvous = rank == 0 && g.workers.size() > 1;
  if (serves_rendezvous) {
    r.address = g.rendezvous + " (rendezvous)";
    auto it = p.rendezvous.find(g.name);
    if (it != p.rendezvous.end() && !it->second.ok()) {
      r.detail = "rendezvous " + g.rendezvous + ": " + it->second.message();
      return r;
    }
  }
  std::optional<bool> group_alive;  // At the router, for rank 0.
  if (rank == 0 && p.router.ok() && p.health.contains("groups") && p.health["groups"].is_array()) {
    for (const auto& h : p.health["groups"]) {
      if (h.is_object() && h.value("name", "") == g.name) group_alive = h.value("alive", false);
    }
  }
  if (!p.map_service.ok()) {
    if (group_alive.value_or(false)) {
      r.state = ProbeState::kUp;
      r.detail = "group alive at the router (map service not reachable: registration unknown)";
    } else {
      r.detail = "unknown: the map service, which reports the ranks, is not reachable";
    }
    return r;
  }
  const Json* entry = nullptr;
  if (p.map_stats.contains("ranks") && p.map_stats["ranks"].is_array()) {
    for (const auto& e : p.map_stats["ranks"]) {
      if (e.is_object() && e.value("group", "") == g.name &&
          e.value("rank", int64_t{-1}) == static_cast<int64_t>(rank)) {
        entry = &e;
      }
    }
  }
  if (entry == nullptr) {
    r.detail = "not registered at the map service";
    return r;
  }
  const int64_t silence = entry->value("silence_ms", int64_t{0});
  if (!entry->value("alive", false)) {
    r.detail = fmt::format("registered at the map service, but silent for {} ms", silence);
    return r;
  }
  r.state = ProbeState::kUp;
  r.detail = fmt::format("registered at the map service, heard {} ms ago", silence);
  if (rank == 0 && p.router.ok()) {
    if (group_alive.value_or(false)) {
      r.detail += "; group alive at the router";
    } else {
      MarkUnhealthy(&r, "group not alive at the router");
    }
  }
  return r;
}

// The local launcher's view of the processes it runs: pid, restarts, a process given up on.
void AddLauncherView(const ProbeResults& p, std::vector<ProcessReport>* reports) {
  if (!p.launcher_alive || !p.launcher_state.contains("processes")) return;
  for (const auto& proc : p.launcher_state["processes"]) {
    if (!proc.is_object()) continue;
    const std::string name = proc.value("name", "");
    for (ProcessReport& r : *reports) {
      if (r.name != name) continue;
      const int64_t pid = proc.value("pid", int64_t{-1});
      r.pid = pid;
      r.restarts = proc.value("restarts", 0);
      r.detail += fmt::format("; pid {}, {} restart(s)", pid, r.restarts);
      const auto given_up = proc.find("given_up");
      if (given_up != proc.end() && given_up->is_boolean() && given_up->get<bool>()) {
        MarkUnhealthy(&r,
                      "given up on after a crash loop; restarted after the crash window "
                      "(see its log)");
      } else if (proc.value("state", "") != "running" || !PidAlive(pid)) {
        MarkUnhealthy(&r, "this host's launcher reports it " + proc.value("state", "?"));
      }
    }
  }
}

}  // namespace

std::vector<ProcessReport> BuildReports(const Manifest& manifest, const ProbeResults& probes) {
  std::vector<ProcessReport> reports;
  reports.push_back(ReportMapService(manifest, probes));
  reports.push_back(ReportRouter(manifest, probes));
  for (const WorkerGroupSpec& g : manifest.worker_groups) {
    for (size_t rank = 0; rank < g.workers.size(); ++rank) {
      reports.push_back(ReportRank(g, rank, probes));
    }
  }
  AddLauncherView(probes, &reports);
  return reports;
}

std::string FormatStatusTable(const std::vector<ProcessReport>& reports) {
  size_t w_host = 4;
  size_t w_role = 4;
  size_t w_address = 7;
  for (const auto& r : reports) {
    w_host = std::max(w_host, r.host.size());
    w_role = std::max(w_role, r.role.size());
    w_address = std::max(w_address, r.address.size());
  }
  std::string out = fmt::format("{:<{}}  {:<{}}  {:<{}}  {}\n", "HOST", w_host, "ROLE", w_role,
                                "ADDRESS", w_address, "STATE");
  size_t up = 0;
  size_t unreachable = 0;
  for (const auto& r : reports) {
    out += fmt::format("{:<{}}  {:<{}}  {:<{}}  {}: {}\n", r.host, w_host, r.role, w_role,
                       r.address, w_address, StateText(r), r.detail);
    up += r.state == ProbeState::kUp;
    unreachable += r.state == ProbeState::kUnreachable;
  }
  out += fmt::format("{} of {} process(es) up", up, reports.size());
  if (unreachable > 0) out += fmt::format(", {} not reachable", unreachable);
  if (reports.size() - up - unreachable > 0) {
    out += fmt::format(", {} unhealthy", reports.size() - up - unreachable);
  }
  out += "\n";
  for (const auto& r : reports) {
    if (r.state == ProbeState::kUp) continue;
    out += fmt::format("host {} ({}): {}: {}\n", r.host, r.role, StateText(r), r.detail);
  }
  return out;
}

int StatusExitCode(const std::vector<ProcessReport>& reports) {
  int code = kStatusAllUp;
  for (const auto& r : reports) {
    if (r.state == ProbeState::kUnreachable) return kStatusUnreachable;
    if (r.state == ProbeState::kUnhealthy) code = kStatusUnhealthy;
  }
  return code;
}

int PrintStatus(const Manifest& manifest, const StatusOptions& options) {
  const ProbeResults probes = Probe(manifest, options);
  const std::vector<ProcessReport> reports = BuildReports(manifest, probes);
  const int code = StatusExitCode(reports);
  const int64_t launcher_pid = probes.launcher_state.is_object()
                                   ? probes.launcher_state.value("launcher_pid", int64_t{0})
                                   : 0;
  if (options.json) {
    Json rows = Json::array();
    for (const auto& r : reports) {
      rows.push_back({{"name", r.name},
                      {"host", r.host},
                      {"role", r.role},
                      {"address", r.address},
                      {"state", StateText(r)},
                      {"healthy", r.state == ProbeState::kUp},
                      {"detail", r.detail},
                      {"local", r.pid > 0},
                      {"pid", r.pid},
                      {"restarts", r.restarts}});
    }
    Json out = {{"healthy", code == kStatusAllUp},         {"exit_code", code},
                {"timeout_ms", options.timeout_ms},        {"launcher_pid", launcher_pid},
                {"launcher_alive", probes.launcher_alive}, {"processes", rows}};
    std::printf("%s\n", out.dump(2).c_str());
  } else {
    if (probes.launcher_state.is_object()) {
      std::printf("launcher on this host: pid %lld, %s (%s)\n",
                  static_cast<long long>(launcher_pid),
                  probes.launcher_alive ? "running" : "not running",
                  probes.launcher_state.value("phase", "?").c_str());
    } else {
      std::printf("launcher on this host: none (no %s)\n", StatusFilePath(manifest).c_str());
    }
    std::printf("%s", FormatStatusTable(reports).c_str());
  }
  return code;
}

}  // namespace fmoe
