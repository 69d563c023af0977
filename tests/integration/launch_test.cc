// End to end: `fmoe launch` on a manifest with free ports brings up the map service, two worker
// ranks and the router; /health turns 200; a worker killed with SIGKILL is restarted and health
// returns; SIGTERM stops everything with exit code 0 and no process left behind. Also the
// failures a user meets first: bad manifest, port in use, unwritable data directory.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <set>
#include <string>

#include <gtest/gtest.h>

#include "common/http_client.h"
#include "common/json.h"
#include "tests/testing/process_harness.h"

namespace fmoe {
namespace {

using testing::BinDir;
using testing::Child;
using testing::FreeTcpPort;
using testing::ReadFile;
using testing::WaitUntil;
using Json = nlohmann::json;

struct Ports {
  int http = FreeTcpPort();
  int workers = FreeTcpPort();
  int map = FreeTcpPort();
};

class LaunchTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = testing::MakeTempDir("fmoe-launch");
    ASSERT_FALSE(dir_.empty());
  }
  void TearDown() override {
    std::error_code ec;
    if (!HasFailure()) std::filesystem::remove_all(dir_, ec);
  }

  std::string WriteManifest(const std::string& extra_group_fields = "",
                            const std::string& data_dir = "") {
    std::string path = dir_ + "/manifest.yaml";
    std::string text =
        "model:\n"
        "  path: " +
        std::string(FMOE_SOURCE_DIR) +
        "/deploy/models/tiny-moe\n"
        "map_service:\n"
        "  endpoint: tcp://127.0.0.1:" +
        std::to_string(ports_.map) +
        "\n"
        "  data_dir: " +
        (data_dir.empty() ? dir_ + "/maps" : data_dir) +
        "\n"
        "worker_groups:\n"
        "  - name: g0\n"
        "    rendezvous: 127.0.0.1:" +
        std::to_string(FreeTcpPort()) + "\n" + extra_group_fields +
        "    workers:\n"
        "      - device: cpu\n"
        "      - device: cpu\n"
        "router:\n"
        "  listen: 127.0.0.1:" +
        std::to_string(ports_.http) +
        "\n"
        "  worker_endpoint: tcp://127.0.0.1:" +
        std::to_string(ports_.workers) +
        "\n"
        "heartbeat:\n"
        "  interval_ms: 100\n"
        "  timeout_ms: 1000\n"
        "launcher:\n"
        "  run_dir: " +
        dir_ +
        "/run\n"
        "  ready_timeout_s: 60\n"
        "  stop_timeout_s: 10\n"
        "  restart:\n"
        "    initial_backoff_ms: 100\n"
        "    max_backoff_ms: 1000\n"
        "    max_restarts: 5\n"
        "    window_s: 60\n";
    testing::WriteFile(path, text);
    return path;
  }

  int HealthStatus() {
    auto res = http::Get("127.0.0.1", ports_.http, "/health", 1000);
    return res.ok() ? res->status : 0;
  }

  Json LauncherState() {
    Json j = Json::parse(ReadFile(dir_ + "/run/launcher.json"), nullptr, false);
    return j.is_discarded() ? Json::object() : j;
  }

  // pid, restarts of a process in the status file; {-1, -1} if absent.
  std::pair<int, int> ProcessOf(const Json& state, const std::string& name) {
    if (!state.contains("processes")) return {-1, -1};
    for (const auto& p : state["processes"]) {
      if (p.value("name", "") == name) {
        return {p.value("pid", -1),
                p.value("state", "") == "running" ? p.value("restarts", 0) : -1};
      }
    }
    return {-1, -1};
  }

  std::string dir_;
  Ports ports_;
};

TEST_F(LaunchTest, HealthRestartAndCleanStop) {
  std::string manifest = WriteManifest();
  Child launcher({BinDir() + "/fmoe", "launch", manifest}, dir_ + "/launcher.log");
  // The router answers before every rank has said READY to the launcher (it starts first, and
  // the leader's Hello may come before the followers' readiness): wait for both states.
  ASSERT_TRUE(WaitUntil(
      [&] { return HealthStatus() == 200 && LauncherState().value("phase", "") == "running"; },
      90000))
      << "launcher log:\n"
      << ReadFile(dir_ + "/launcher.log");

  auto health = http::Get("127.0.0.1", ports_.http, "/health", 1000);
  ASSERT_TRUE(health.ok());
  Json body = Json::parse(health->body);
  EXPECT_EQ(body["status"], "ok");
  ASSERT_EQ(body["groups"].size(), 1u);
  EXPECT_EQ(body["groups"][0]["name"], "g0");
  EXPECT_EQ(body["groups"][0]["alive"], true);
  EXPECT_EQ(body["groups"][0]["world_size"], 2);
  EXPECT_TRUE(body["map_service"].contains("alive"));

  // Every process is up and `fmoe status` says so.
  Json state = LauncherState();
  std::set<int> pids;
  for (const auto& name : {"map-service", "worker-g0-0", "worker-g0-1", "router"}) {
    auto [pid, restarts] = ProcessOf(state, name);
    EXPECT_GT(pid, 0) << name;
    EXPECT_EQ(restarts, 0) << name;
    pids.insert(pid);
  }
  ASSERT_TRUE(WaitUntil(
      [&] {
        return testing::RunCommand({BinDir() + "/fmoe", "status", manifest}, 20000).first == 0;
      },
      60000));

  // SIGKILL the group's leader: the launcher restarts it and the group comes back.
  const int old_pid = ProcessOf(state, "worker-g0-0").first;
  ASSERT_EQ(kill(old_pid, SIGKILL), 0);
  ASSERT_TRUE(WaitUntil(
      [&] {
        auto [pid, restarts] = ProcessOf(LauncherState(), "worker-g0-0");
        return pid > 0 && pid != old_pid && restarts == 1;
      },
      120000))
      << ReadFile(dir_ + "/run/launcher.json");
  int new_pid = ProcessOf(LauncherState(), "worker-g0-0").first;
  pids.insert(new_pid);
  ASSERT_TRUE(WaitUntil(
      [&] {
        auto res = http::Get("127.0.0.1", ports_.http, "/health", 1000);
        if (!res.ok() || res->status != 200) return false;
        Json j = Json::parse(res->body, nullptr, false);
        return !j.is_discarded() && j["groups"][0]["alive"] == true;
      },
      120000));
  EXPECT_FALSE(testing::ProcessAlive(old_pid));

  // SIGTERM: everything stops in order, exit code 0, no process left.
  launcher.Signal(SIGTERM);
  auto status = launcher.Wait(60000);
  ASSERT_TRUE(status.has_value()) << "launcher did not exit";
  ASSERT_TRUE(WIFEXITED(*status)) << "launcher was killed by a signal";
  EXPECT_EQ(WEXITSTATUS(*status), 0) << ReadFile(dir_ + "/launcher.log");
  for (int pid : pids) EXPECT_FALSE(testing::ProcessAlive(pid)) << "pid " << pid << " survived";
  EXPECT_EQ(LauncherState().value("phase", ""), "stopped");
  // Each child logged its effective configuration and a clean stop.
  for (const auto& name : {"map-service", "worker-g0-1", "router"}) {
    std::string log = ReadFile(dir_ + "/run/logs/" + name + ".log");
    EXPECT_NE(log.find("effective config"), std::string::npos) << name;
    EXPECT_NE(log.find("stopped (signal 15)"), std::string::npos) << name << ":\n" << log;
  }
}

// The map service is optional for serving: a crash loop past max_restarts stops only it, for
// the crash window; the router and the workers serve on and the launcher keeps running (it used
// to stop the whole cluster).
TEST_F(LaunchTest, AMapServiceCrashLoopStopsOnlyTheMapService) {
  std::string manifest = WriteManifest();
  std::string text = ReadFile(manifest);
  text.replace(text.find("max_restarts: 5"), 15, "max_restarts: 1");
  testing::WriteFile(manifest, text);
  Child launcher({BinDir() + "/fmoe", "launch", manifest}, dir_ + "/launcher.log");
  ASSERT_TRUE(WaitUntil(
      [&] { return HealthStatus() == 200 && LauncherState().value("phase", "") == "running"; },
      90000))
      << ReadFile(dir_ + "/launcher.log");
  // Two crashes within the window: the second is one more than max_restarts.
  for (int crash = 1; crash <= 2; ++crash) {
    int pid = -1;
    ASSERT_TRUE(WaitUntil(
        [&] {
          auto [p, restarts] = ProcessOf(LauncherState(), "map-service");
          pid = p;
          return p > 0 && restarts == crash - 1;
        },
        120000))
        << ReadFile(dir_ + "/run/launcher.json");
    ASSERT_EQ(kill(pid, SIGKILL), 0);
  }
  auto given_up = [&] {
    const Json state = LauncherState();
    if (!state.contains("processes")) return false;
    for (const auto& p : state["processes"]) {
      if (p.value("name", "") == "map-service") return p.value("given_up", false);
    }
    return false;
  };
  ASSERT_TRUE(WaitUntil(given_up, 60000)) << ReadFile(dir_ + "/run/launcher.json");
  EXPECT_EQ(LauncherState().value("phase", ""), "running");
  EXPECT_TRUE(testing::ProcessAlive(launcher.pid()));
  EXPECT_NE(ReadFile(dir_ + "/launcher.log").find("giving up on it for 60 s"), std::string::npos)
      << ReadFile(dir_ + "/launcher.log");
  // Serving goes on without maps.
  http::Request request;
  request.method = "POST";
  request.target = "/v1/completions";
  request.body =
      R"({"model": "tiny-moe", "prompt": "The river", "max_tokens": 4, "temperature": 0})";
  auto completion = http::Fetch("127.0.0.1", ports_.http, request, 120000);
  ASSERT_TRUE(completion.ok()) << completion.status().ToString();
  EXPECT_EQ(completion->status, 200) << completion->body;
  for (const auto& name : {"router", "worker-g0-0", "worker-g0-1"}) {
    EXPECT_GT(ProcessOf(LauncherState(), name).first, 0) << name;
  }

  launcher.Signal(SIGTERM);
  auto status = launcher.Wait(60000);
  ASSERT_TRUE(status.has_value());
  ASSERT_TRUE(WIFEXITED(*status));
  EXPECT_EQ(WEXITSTATUS(*status), 0) << ReadFile(dir_ + "/launcher.log");
}

TEST_F(LaunchTest, WorkersRejoinARestartedMapServiceAndRouter) {
  std::string manifest = WriteManifest();
  Child launcher({BinDir() + "/fmoe", "launch", manifest}, dir_ + "/launcher.log");
  ASSERT_TRUE(WaitUntil([&] { return HealthStatus() == 200; }, 90000))
      << ReadFile(dir_ + "/launcher.log");
  auto all_healthy = [&] {
    return testing::RunCommand({BinDir() + "/fmoe", "status", manifest}, 20000).first == 0;
  };
  ASSERT_TRUE(WaitUntil(all_healthy, 60000));

  for (const std::string name : {"map-service", "router"}) {
    const int old_pid = ProcessOf(LauncherState(), name).first;
    ASSERT_GT(old_pid, 0);
    ASSERT_EQ(kill(old_pid, SIGKILL), 0);
    ASSERT_TRUE(WaitUntil(
        [&] {
          auto [pid, restarts] = ProcessOf(LauncherState(), name);
          return pid > 0 && pid != old_pid && restarts == 1;
        },
        120000))
        << name << ": " << ReadFile(dir_ + "/run/launcher.json");
    // The restarted process lost its in-memory state; heartbeat acks tell the workers to
    // register (or say hello) again, and status turns healthy once every rank is back.
    ASSERT_TRUE(WaitUntil(all_healthy, 120000))
        << name << ":\n"
        << testing::RunCommand({BinDir() + "/fmoe", "status", manifest}, 20000).second;
  }
  std::string worker_log = ReadFile(dir_ + "/run/logs/worker-g0-0.log");
  EXPECT_NE(worker_log.find("registering again"), std::string::npos) << worker_log;

  launcher.Signal(SIGTERM);
  auto status = launcher.Wait(60000);
  ASSERT_TRUE(status.has_value());
  ASSERT_TRUE(WIFEXITED(*status));
  EXPECT_EQ(WEXITSTATUS(*status), 0);
}

TEST_F(LaunchTest, BadManifestExitsTwoNamingTheKey) {
  std::string manifest = WriteManifest();
  std::string text = ReadFile(manifest);
  size_t at = text.find("      - device: cpu\n", text.find("      - device: cpu\n") + 1);
  text.replace(at, 20, "      - device: \"cuda:x\"\n");
  testing::WriteFile(manifest, text);
  auto [code, out] = testing::RunCommand({BinDir() + "/fmoe", "launch", manifest}, 20000);
  EXPECT_EQ(code, 2) << out;
  EXPECT_NE(out.find("worker_groups[0].workers[1].device"), std::string::npos) << out;
  EXPECT_NE(out.find("cuda:x"), std::string::npos) << out;
}

TEST_F(LaunchTest, PortInUseIsOneClearLine) {
  std::string manifest = WriteManifest();
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(static_cast<uint16_t>(ports_.http));
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(listen(fd, 4), 0);
  auto [code, out] = testing::RunCommand({BinDir() + "/fmoe", "launch", manifest}, 20000);
  close(fd);
  EXPECT_EQ(code, 1) << out;
  std::string expected =
      "fmoe: router.listen: 127.0.0.1:" + std::to_string(ports_.http) + " is already in use";
  EXPECT_NE(out.find(expected), std::string::npos) << out;
  EXPECT_EQ(out.find("terminate called"), std::string::npos) << out;
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/run/launcher.json")) << "nothing was started";
}

TEST_F(LaunchTest, UnwritableDataDirIsOneClearLine) {
  testing::WriteFile(dir_ + "/not-a-dir", "x");
  std::string manifest = WriteManifest("", dir_ + "/not-a-dir/maps");
  auto [code, out] = testing::RunCommand({BinDir() + "/fmoe", "launch", manifest}, 20000);
  EXPECT_EQ(code, 1) << out;
  EXPECT_NE(out.find("fmoe: map_service.data_dir: " + dir_ + "/not-a-dir/maps"), std::string::npos)
      << out;
  EXPECT_EQ(out.find("terminate called"), std::string::npos) << out;
}

TEST_F(LaunchTest, StatusWithNothingRunningNamesEachProcessNotReachable) {
  std::string manifest = WriteManifest();
  auto [code, out] = testing::RunCommand({BinDir() + "/fmoe", "status", manifest}, 20000);
  EXPECT_EQ(code, 3) << out;
  EXPECT_NE(out.find("launcher on this host: none"), std::string::npos) << out;
  EXPECT_NE(out.find("host 127.0.0.1 (router): not reachable: connection refused"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("host 127.0.0.1 (map service): not reachable: connection refused"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("host 127.0.0.1 (rank 1 of group g0): not reachable: unknown"),
            std::string::npos)
      << out;
}

// A group across two "hosts" of the loopback network: rank 0 on 127.0.0.1, started by the full
// launcher; rank 1 on 127.0.0.2, started by `fmoe launch --workers-only --host 127.0.0.2` with a
// run_dir of its own, before the map service and router exist: it says what it waits for, then
// when each is reachable. `fmoe status` from a third directory (a host that runs nothing) reports
// every process up; with a manifest that adds a group on hosts nobody serves, it names those
// ranks not reachable, exits 3, and returns within its bound.
TEST_F(LaunchTest, StatusFromAnyHostAndAWorkersOnlyLauncherThatWaits) {
  const std::string base = WriteManifest();
  std::string text = ReadFile(base);
  auto replace = [](std::string* s, const std::string& from, const std::string& to) {
    const size_t at = s->find(from);
    ASSERT_NE(at, std::string::npos) << from;
    s->replace(at, from.size(), to);
  };
  replace(&text, "      - device: cpu\n      - device: cpu\n",
          "      - {device: cpu, host: 127.0.0.1}\n      - {device: cpu, host: 127.0.0.2}\n");
  replace(&text, "  stop_timeout_s: 10\n", "  stop_timeout_s: 10\n  services_wait_s: 120\n");
  text += "security: {curve: false}\n";
  auto write_for = [&](const std::string& host_dir, const std::string& extra) {
    std::string t = text;
    replace(&t, dir_ + "/run\n", dir_ + "/" + host_dir + "/run\n");
    std::filesystem::create_directories(dir_ + "/" + host_dir);
    testing::WriteFile(dir_ + "/" + host_dir + "/manifest.yaml", t + extra);
    return dir_ + "/" + host_dir + "/manifest.yaml";
  };
  const std::string main_manifest = write_for("a", "");
  const std::string b_manifest = write_for("b", "");
  const std::string other_manifest = write_for("c", "");

  Child b({BinDir() + "/fmoe", "launch", b_manifest, "--workers-only", "--host", "127.0.0.2"},
          dir_ + "/b.log");
  const std::string router_at =
      "the router at tcp://127.0.0.1:" + std::to_string(ports_.workers) + " (host 127.0.0.1)";
  ASSERT_TRUE(WaitUntil(
      [&] {
        return ReadFile(dir_ + "/b.log").find("waiting for " + router_at) != std::string::npos;
      },
      30000))
      << ReadFile(dir_ + "/b.log");
  EXPECT_NE(ReadFile(dir_ + "/b.log")
                .find("waiting for the map service at tcp://127.0.0.1:" +
                      std::to_string(ports_.map) + " (host 127.0.0.1)"),
            std::string::npos)
      << ReadFile(dir_ + "/b.log");
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/b/run/logs/worker-g0-1.log"))
      << "no rank starts before the router is reachable";

  Child a({BinDir() + "/fmoe", "launch", main_manifest}, dir_ + "/a.log");
  ASSERT_TRUE(WaitUntil(
      [&] {
        const std::string log = ReadFile(dir_ + "/b.log");
        return log.find(router_at + " is reachable after") != std::string::npos &&
               log.find("fmoe is up (worker ranks only): worker-g0-1 on host 127.0.0.2") !=
                   std::string::npos;
      },
      120000))
      << "b:\n"
      << ReadFile(dir_ + "/b.log") << "a:\n"
      << ReadFile(dir_ + "/a.log");
  ASSERT_TRUE(WaitUntil([&] { return HealthStatus() == 200; }, 90000)) << ReadFile(dir_ + "/a.log");

  // (a) From a host that runs none of the processes: every process up, exit 0.
  std::pair<int, std::string> up;
  ASSERT_TRUE(WaitUntil(
      [&] {
        up = testing::RunCommand({BinDir() + "/fmoe", "status", other_manifest}, 20000);
        return up.first == 0;
      },
      60000))
      << up.second;
  EXPECT_NE(up.second.find("launcher on this host: none"), std::string::npos) << up.second;
  EXPECT_NE(up.second.find("4 of 4 process(es) up"), std::string::npos) << up.second;
  for (const std::string role :
       {"map service", "router", "rank 0 of group g0", "rank 1 of group g0"}) {
    EXPECT_NE(up.second.find(role), std::string::npos) << role << "\n" << up.second;
  }

  // (b) A manifest with one more group on hosts nobody serves: a TEST-NET address for its
  // leader (its rendezvous probe times out, or the route is refused at once) and 127.0.0.3 for
  // its other rank (never registered).
  const std::string ghost_manifest = write_for("d", "");
  std::string ghost = ReadFile(ghost_manifest);
  replace(&ghost, "router:\n",
          "  - name: g9\n"
          "    rendezvous: 192.0.2.1:29500\n"
          "    workers: [{device: cpu, host: 192.0.2.1}, {device: cpu, host: 127.0.0.3}]\n"
          "router:\n");
  testing::WriteFile(ghost_manifest, ghost);
  const auto start = std::chrono::steady_clock::now();
  auto [code, out] = testing::RunCommand(
      {BinDir() + "/fmoe", "status", ghost_manifest, "--timeout-ms", "500"}, 20000);
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                      std::chrono::steady_clock::now() - start)
                      .count();
  EXPECT_EQ(code, 3) << out;
  EXPECT_LT(ms, 5000) << "every probe is bounded (500 ms each, run at once)\n" << out;
  EXPECT_NE(out.find("host 192.0.2.1 (rank 0 of group g9): not reachable: rendezvous "
                     "192.0.2.1:29500: "),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("host 127.0.0.3 (rank 1 of group g9): not reachable: not registered at the "
                     "map service"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("4 of 6 process(es) up, 2 not reachable"), std::string::npos) << out;

  // The same from the main host: its launcher's pids join the lines.
  auto [main_code, main_out] =
      testing::RunCommand({BinDir() + "/fmoe", "status", main_manifest}, 20000);
  EXPECT_EQ(main_code, 0) << main_out;
  EXPECT_NE(main_out.find("launcher on this host: pid"), std::string::npos) << main_out;
  EXPECT_NE(main_out.find("restart(s)"), std::string::npos) << main_out;

  for (Child* c : {&a, &b}) {
    c->Signal(SIGTERM);
    auto status = c->Wait(60000);
    ASSERT_TRUE(status.has_value());
    ASSERT_TRUE(WIFEXITED(*status));
    EXPECT_EQ(WEXITSTATUS(*status), 0);
  }
}

// A worker host whose router never comes: the launcher names it and gives up at
// launcher.services_wait_s; a rank host that is not this machine's is named before anything.
TEST_F(LaunchTest, WorkersOnlyLauncherNamesWhatItWaitedForAndAForeignHost) {
  std::string text = ReadFile(WriteManifest());
  const size_t at = text.find("  stop_timeout_s: 10\n");
  ASSERT_NE(at, std::string::npos);
  text.insert(at, "  services_wait_s: 2\n");
  text += "security: {curve: false}\n";
  testing::WriteFile(dir_ + "/manifest.yaml", text);
  const auto start = std::chrono::steady_clock::now();
  auto [code, out] = testing::RunCommand({BinDir() + "/fmoe", "launch", dir_ + "/manifest.yaml",
                                          "--workers-only", "--host", "127.0.0.1"},
                                         30000);
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                      std::chrono::steady_clock::now() - start)
                      .count();
  EXPECT_EQ(code, 1) << out;
  EXPECT_GE(ms, 2000) << out;
  const std::string router = "tcp://127.0.0.1:" + std::to_string(ports_.workers);
  EXPECT_NE(out.find("waiting for the router at " + router + " (host 127.0.0.1), up to 2 s"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("fmoe: the router at " + router +
                     " (host 127.0.0.1) is not reachable after 2 s (launcher.services_wait_s): "
                     "connection refused"),
            std::string::npos)
      << out;
  EXPECT_NE(out.find("the map service at tcp://127.0.0.1:" + std::to_string(ports_.map) +
                     " (host 127.0.0.1) is not reachable after 2 s"),
            std::string::npos)
      << out;
  EXPECT_FALSE(std::filesystem::exists(dir_ + "/run/logs/worker-g0-0.log")) << "no rank started";

  // 192.0.2.1 (TEST-NET) is no address of this machine.
  std::string foreign = text;
  const size_t w = foreign.find("      - device: cpu\n");
  ASSERT_NE(w, std::string::npos);
  foreign.replace(w, 20, "      - {device: cpu, host: 192.0.2.1}\n");
  testing::WriteFile(dir_ + "/manifest.yaml", foreign);
  auto [fcode, fout] = testing::RunCommand({BinDir() + "/fmoe", "launch", dir_ + "/manifest.yaml",
                                            "--workers-only", "--host", "192.0.2.1"},
                                           30000);
  EXPECT_EQ(fcode, 1) << fout;
  EXPECT_NE(fout.find("fmoe: worker_groups[0].workers[0].host: 192.0.2.1 is not an address of "
                      "this host (this launcher's --host 192.0.2.1)"),
            std::string::npos)
      << fout;
}

}  // namespace
}  // namespace fmoe
