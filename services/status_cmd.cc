#include "services/status_cmd.h"

#include <signal.h>

#include <cerrno>
#include <cstdio>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "common/http_client.h"
#include "common/wire/wire.h"
#include "services/launcher.h"

namespace fmoe {
namespace {

using Json = nlohmann::json;

bool PidAlive(int64_t pid) {
  return pid > 0 && (kill(static_cast<pid_t>(pid), 0) == 0 || errno == EPERM);
}

// Asks the map service for its Stats; nullopt-like empty object with "error" on failure.
Json MapServiceStats(const std::string& endpoint) {
  wire::Context context;
  wire::SocketOptions opts;
  opts.send_hwm = 1;
  auto socket = wire::MapSocket::Connect(context, wire::Role::kDealer, endpoint, opts);
  if (!socket.ok()) return {{"error", socket.status().message()}};
  AdminRequest req;
  req.id = 1;
  req.op = AdminOp::kStats;
  if (Status s = (*socket)->Send(req); !s.ok()) return {{"error", s.message()}};
  auto reply = (*socket)->Receive(2000);
  if (!reply) return {{"error", "no answer from " + endpoint + " within 2 s"}};
  const auto* r = std::get_if<AdminReply>(&reply->message);
  if (r == nullptr || !r->ok) return {{"error", r ? r->error : "unexpected reply"}};
  Json body = Json::parse(r->json, nullptr, false);
  if (body.is_discarded()) return {{"error", "malformed stats reply"}};
  return body;
}

}  // namespace

int PrintStatus(const Manifest& manifest, bool json) {
  const std::string path = StatusFilePath(manifest);
  std::ifstream in(path);
  if (!in) {
    std::fprintf(stderr, "fmoe: no launcher has run with run_dir %s (%s is missing)\n",
                 manifest.launcher.run_dir.c_str(), path.c_str());
    return 1;
  }
  std::stringstream ss;
  ss << in.rdbuf();
  Json state = Json::parse(ss.str(), nullptr, false);
  if (state.is_discarded() || !state.is_object() || !state.contains("processes")) {
    std::fprintf(stderr, "fmoe: %s is not a launcher status file\n", path.c_str());
    return 1;
  }
  const int64_t launcher_pid = state.value("launcher_pid", int64_t{0});
  const bool launcher_alive = PidAlive(launcher_pid) && state.value("phase", "") != "stopped";

  // Probes.
  Json health;
  std::string router_error;
  auto listen = ParseHostPort(manifest.router.listen);
  if (listen.ok()) {
    auto res = http::Get(listen->host, listen->port, "/health", 2000);
    if (res.ok()) {
      health = Json::parse(res->body, nullptr, false);
      if (health.is_discarded()) health = Json::object();
      health["http_status"] = res->status;
    } else {
      router_error = res.status().message();
    }
  }
  Json map_stats = MapServiceStats(manifest.map_service.endpoint);

  bool all_ok = launcher_alive;
  Json rows = Json::array();
  for (const auto& p : state["processes"]) {
    std::string name = p.value("name", "?");
    int64_t pid = p.value("pid", int64_t{-1});
    std::string st = p.value("state", "?");
    bool alive = launcher_alive && PidAlive(pid);
    std::string health_text;
    bool ok = alive && st == "running";
    if (name == "router") {
      if (!router_error.empty()) {
        ok = false;
        health_text = router_error;
      } else {
        int code = health.value("http_status", 0);
        health_text = "/health " + std::to_string(code);
        if (code != 200) {
          ok = false;
          health_text += ": " + health.value("reason", std::string("?"));
        }
      }
    } else if (name == "map-service") {
      if (map_stats.contains("error")) {
        ok = false;
        health_text = map_stats["error"].get<std::string>();
      } else {
        health_text = std::to_string(map_stats["ranks"].size()) + " ranks registered, " +
                      std::to_string(map_stats["models"].size()) + " model(s)";
        // A store whose disk refuses writes: matching goes on, nothing new is kept.
        const Json store = map_stats.value("store", Json::object());
        const Json state = store.is_object() ? store.value("state", Json("ok")) : Json("ok");
        if (state.is_string() && state.get<std::string>() != "ok") {
          ok = false;
          const Json reason = store.value("reason", Json(""));
          health_text += "; store " + state.get<std::string>() + " (read-only" +
                         (reason.is_string() && !reason.get<std::string>().empty()
                              ? ": " + reason.get<std::string>()
                              : std::string()) +
                         ")";
        }
      }
    } else if (name.rfind("worker-", 0) == 0) {
      // worker-<group>-<rank>: registered at the map service, and (leader) alive at the router.
      std::string rest = name.substr(7);
      std::string group = rest.substr(0, rest.rfind('-'));
      int rank = std::atoi(rest.substr(rest.rfind('-') + 1).c_str());
      bool registered = false;
      if (map_stats.contains("ranks")) {
        for (const auto& r : map_stats["ranks"]) {
          if (r.value("group", "") == group && r.value("rank", -1) == rank &&
              r.value("alive", false)) {
            registered = true;
          }
        }
      }
      health_text = registered ? "registered at map service" : "not registered at map service";
      if (!registered) ok = false;
      if (rank == 0 && health.contains("groups")) {
        for (const auto& g : health["groups"]) {
          if (g.value("name", "") != group) continue;
          bool group_alive = g.value("alive", false);
          health_text += group_alive ? "; group alive at router" : "; group not alive at router";
          if (!group_alive) ok = false;
        }
      }
    }
    if (!alive) health_text = (launcher_alive ? "process not running" : "launcher not running");
    const auto given_up = p.find("given_up");
    if (launcher_alive && given_up != p.end() && given_up->is_boolean() && given_up->get<bool>()) {
      health_text =
          "given up on after a crash loop; restarted after the crash window (see its log)";
    }
    all_ok = all_ok && ok;
    rows.push_back({{"name", name},
                    {"pid", pid},
                    {"state", st},
                    {"restarts", p.value("restarts", 0)},
                    {"healthy", ok},
                    {"health", health_text}});
  }

  if (json) {
    Json out = {{"launcher_pid", launcher_pid},
                {"launcher_alive", launcher_alive},
                {"phase", state.value("phase", "?")},
                {"router", state.value("router", "")},
                {"healthy", all_ok},
                {"processes", rows}};
    std::printf("%s\n", out.dump(2).c_str());
  } else {
    std::printf("launcher pid %lld: %s (%s)\n", static_cast<long long>(launcher_pid),
                launcher_alive ? "running" : "not running", state.value("phase", "?").c_str());
    std::printf("%-20s %8s  %-9s %8s  %s\n", "PROCESS", "PID", "STATE", "RESTARTS", "HEALTH");
    for (const auto& r : rows) {
      std::printf(
          "%-20s %8lld  %-9s %8d  %s %s\n", r["name"].get<std::string>().c_str(),
          static_cast<long long>(r["pid"].get<int64_t>()), r["state"].get<std::string>().c_str(),
          r["restarts"].get<int>(),
          r["healthy"].get<bool>() ? "ok:" : "FAIL:", r["health"].get<std::string>().c_str());
    }
  }
  return all_ok ? 0 : 1;
}

}  // namespace fmoe
