// The launch plan and its pre-flight without starting anything: which processes run on this host
// (--host, --workers-only), the restart unit of each worker rank, and the checks workers-only
// skips (the router's and map service's ports and data directory belong to another host), the
// addresses of another host it names, and the workers-only wait for the map service and router.
#include "services/launcher.h"

#include <netinet/in.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include <gtest/gtest.h>
#include <spdlog/sinks/ostream_sink.h>
#include <spdlog/spdlog.h>

namespace fmoe {
namespace {

namespace fs = std::filesystem;

// Group g0: ranks 0 and 1 on node-1, rank 2 on node-2; group g1: one rank on node-2.
constexpr char kTwoHosts[] = R"(
model: {path: /models/tiny}
worker_groups:
  - name: g0
    rendezvous: node-1:29500
    workers:
      - {device: cuda:0, host: node-1}
      - {device: cuda:1, host: node-1}
      - {device: cuda:0, host: node-2}
  - name: g1
    rendezvous: node-2:29501
    workers:
      - {device: cuda:1, host: node-2}
launcher: {run_dir: /srv/run}
)";

Manifest Parse(const std::string& text) {
  Result<Manifest> m = ParseManifest(text, "/srv");
  EXPECT_TRUE(m.ok()) << m.status().ToString();
  return m.ok() ? *m : Manifest{};
}

std::vector<std::string> Names(const std::vector<ProcessSpec>& plan) {
  std::vector<std::string> names;
  for (const auto& p : plan) names.push_back(p.name);
  return names;
}

TEST(PlanProcesses, LocalRanksBetweenMapServiceAndRouterWithTheirGroupAsUnit) {
  const Manifest m = Parse(R"(
model: {path: /models/tiny}
worker_groups:
  - {name: g0, workers: [{}, {host: localhost}]}
  - {name: g1, workers: [{host: node-that-is-elsewhere.invalid}]}
launcher: {run_dir: /srv/run}
)");
  LaunchOptions options;
  options.bin_dir = "/opt/fmoe/bin";
  const std::vector<ProcessSpec> plan = PlanProcesses(m, options);
  // The router starts before the workers (it reports their loading) and stops first (it
  // drains); the map service starts first and stops last.
  ASSERT_EQ(Names(plan),
            (std::vector<std::string>{"map-service", "router", "worker-g0-0", "worker-g0-1"}));
  EXPECT_EQ(plan[0].stage, 0);
  EXPECT_EQ(plan[0].StopOrder(), 0);
  EXPECT_EQ(plan[0].unit, "");
  EXPECT_EQ(plan[1].stage, 1);
  EXPECT_EQ(plan[1].StopOrder(), 2);
  EXPECT_EQ(plan[1].unit, "");
  EXPECT_EQ(plan[2].stage, 2);
  EXPECT_EQ(plan[2].StopOrder(), 1);
  EXPECT_EQ(plan[2].unit, "group:g0");
  EXPECT_EQ(plan[3].unit, "group:g0");
  EXPECT_EQ(plan[3].argv, (std::vector<std::string>{"/opt/fmoe/bin/fmoe-worker", "--manifest", "",
                                                    "--group", "g0", "--rank", "1"}));
  EXPECT_EQ(plan[3].log_path, "/srv/run/logs/worker-g0-1.log");
}

// Only the router's give-up stops the cluster; the map service does not hold start-up; the
// router's stop timeout covers its drain.
TEST(PlanProcesses, OnlyTheRouterIsEssentialAndItsStopTimeoutCoversTheDrain) {
  const Manifest m = Parse(R"(
model: {path: /models/tiny}
worker_groups: [{name: g0, workers: [{}]}]
router: {drain_timeout_s: 45}
launcher: {run_dir: /srv/run, stop_timeout_s: 10}
)");
  const std::vector<ProcessSpec> plan = PlanProcesses(m, LaunchOptions{});
  ASSERT_EQ(Names(plan), (std::vector<std::string>{"map-service", "router", "worker-g0-0"}));
  EXPECT_FALSE(plan[0].essential);
  EXPECT_FALSE(plan[0].needed_at_start);
  EXPECT_TRUE(plan[1].essential);
  EXPECT_TRUE(plan[1].needed_at_start);
  EXPECT_EQ(plan[1].stop_timeout_ms, 50000) << "drain 45 s + 5 s";
  EXPECT_FALSE(plan[2].essential);
  EXPECT_TRUE(plan[2].needed_at_start);
  EXPECT_EQ(plan[2].stop_timeout_ms, 0) << "the launcher's stop_timeout_s";

  // A stop timeout above the drain's stays.
  const Manifest longer = Parse(R"(
model: {path: /models/tiny}
worker_groups: [{name: g0, workers: [{}]}]
launcher: {run_dir: /srv/run, stop_timeout_s: 120}
)");
  EXPECT_EQ(PlanProcesses(longer, LaunchOptions{})[1].stop_timeout_ms, 120000);
  EXPECT_EQ(longer.router.drain_timeout_s, 30) << "the default drain";
}

TEST(PlanProcesses, HostSelectsTheRanksWrittenWithThatName) {
  const Manifest m = Parse(kTwoHosts);
  LaunchOptions options;
  options.host = "node-2";
  std::vector<ProcessSpec> plan = PlanProcesses(m, options);
  EXPECT_EQ(Names(plan),
            (std::vector<std::string>{"map-service", "router", "worker-g0-2", "worker-g1-0"}));
  EXPECT_EQ(plan[2].unit, "group:g0");
  EXPECT_EQ(plan[3].unit, "group:g1");
  EXPECT_EQ(plan[2].argv.back(), "2") << "the rank is the index in the group";

  options.host = "node-1";
  EXPECT_EQ(Names(PlanProcesses(m, options)),
            (std::vector<std::string>{"map-service", "router", "worker-g0-0", "worker-g0-1"}));
  // With --host, loopback names are no longer local by themselves.
  const Manifest local = Parse("model: {path: m}\nworker_groups: [{name: g, workers: [{}]}]\n");
  EXPECT_EQ(Names(PlanProcesses(local, options)),
            (std::vector<std::string>{"map-service", "router"}));
}

TEST(PlanProcesses, WorkersOnlyDropsTheMapServiceAndTheRouter) {
  const Manifest m = Parse(kTwoHosts);
  LaunchOptions options;
  options.workers_only = true;
  options.host = "node-2";
  const std::vector<ProcessSpec> plan = PlanProcesses(m, options);
  EXPECT_EQ(Names(plan), (std::vector<std::string>{"worker-g0-2", "worker-g1-0"}));
  for (const auto& p : plan) EXPECT_EQ(p.stage, 2) << p.name;

  options.host = "node-3";  // No rank here: Launch refuses this plan (exit 2).
  EXPECT_TRUE(PlanProcesses(m, options).empty());
}

TEST(PlanProcesses, OnlyTheLeaderGetsTheGroupsTraceFile) {
  const Manifest m = Parse(R"(
model: {path: /models/tiny}
worker_groups:
  - {name: g0, record_trace: traces/g0.trc, workers: [{}, {}]}
  - {name: g1, workers: [{}]}
)");
  const std::vector<ProcessSpec> plan = PlanProcesses(m, LaunchOptions{});
  ASSERT_EQ(Names(plan), (std::vector<std::string>{"map-service", "router", "worker-g0-0",
                                                   "worker-g0-1", "worker-g1-0"}));
  EXPECT_EQ(plan[2].argv,
            (std::vector<std::string>{"fmoe-worker", "--manifest", "", "--group", "g0", "--rank",
                                      "0", "--record-trace", "/srv/traces/g0.trc"}));
  EXPECT_EQ(plan[3].argv.back(), "1") << "rank 1 does not record";
  EXPECT_EQ(plan[4].argv.back(), "0") << "g1 records no trace";
}

// A directory with stand-ins for the service binaries, removed at destruction.
class FakeBinDir {
 public:
  FakeBinDir() {
    std::string tmpl = ::testing::TempDir() + "/launcher_test.XXXXXX";
    EXPECT_NE(::mkdtemp(tmpl.data()), nullptr);
    path_ = tmpl;
    for (const char* name : {"fmoe-map-service", "fmoe-worker", "fmoe-router"}) {
      const std::string file = path_ + "/" + name;
      std::ofstream(file) << "#!/bin/sh\nexit 0\n";
      EXPECT_EQ(::chmod(file.c_str(), 0755), 0);
    }
  }
  ~FakeBinDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

// A TCP socket listening on a free loopback port, closed at destruction.
class BusyPort {
 public:
  BusyPort() {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(addr);
    EXPECT_EQ(::bind(fd_, reinterpret_cast<sockaddr*>(&addr), len), 0);
    EXPECT_EQ(::listen(fd_, 1), 0);
    EXPECT_EQ(::getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len), 0);
    port_ = ntohs(addr.sin_port);
  }
  ~BusyPort() { ::close(fd_); }
  int port() const { return port_; }

 private:
  int fd_ = -1;
  int port_ = 0;
};

TEST(Preflight, WorkersOnlySkipsTheRouterAndMapServiceChecks) {
  FakeBinDir bin;
  BusyPort busy;
  const std::string run_dir = bin.path() + "/run";
  const Manifest m = Parse(std::string("model: {path: ") + FMOE_SOURCE_DIR +
                           "/deploy/models/tiny-moe}\n"
                           "map_service: {data_dir: /proc/fmoe-not-writable/maps}\n"
                           "worker_groups: [{name: g0, workers: [{}, {}]}]\n"
                           "router: {listen: \"127.0.0.1:" +
                           std::to_string(busy.port()) +
                           "\"}\n"
                           "launcher: {run_dir: " +
                           run_dir + "}\n");
  LaunchOptions options;
  options.bin_dir = bin.path();
  Status full = Preflight(m, PlanProcesses(m, options), options);
  ASSERT_FALSE(full.ok());
  EXPECT_NE(full.message().find("map_service.data_dir"), std::string::npos) << full.message();

  options.workers_only = true;
  Status workers = Preflight(m, PlanProcesses(m, options), options);
  EXPECT_TRUE(workers.ok()) << workers.ToString();
  EXPECT_TRUE(fs::is_directory(run_dir + "/logs")) << "run_dir is still checked (and made)";

  // The model is still checked.
  Manifest no_model = m;
  no_model.model.path = bin.path() + "/no-model";
  Status missing = Preflight(no_model, PlanProcesses(no_model, options), options);
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.message().rfind("model.path", 0), 0u) << missing.message();
}

TEST(Preflight, FullLaunchNamesTheBusyRouterPort) {
  FakeBinDir bin;
  BusyPort busy;
  const Manifest m = Parse(std::string("model: {path: ") + FMOE_SOURCE_DIR +
                           "/deploy/models/tiny-moe}\n"
                           "map_service: {data_dir: " +
                           bin.path() +
                           "/maps}\n"
                           "worker_groups: [{name: g0, workers: [{}]}]\n"
                           "router: {listen: \"127.0.0.1:" +
                           std::to_string(busy.port()) +
                           "\"}\n"
                           "launcher: {run_dir: " +
                           bin.path() + "/run}\n");
  LaunchOptions options;
  options.bin_dir = bin.path();
  Status s = Preflight(m, PlanProcesses(m, options), options);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.message(),
            "router.listen: 127.0.0.1:" + std::to_string(busy.port()) + " is already in use");
  options.workers_only = true;
  EXPECT_TRUE(Preflight(m, PlanProcesses(m, options), options).ok());
}

// Addresses of another host: 192.0.2.1 (TEST-NET-1) is no address of this machine.
TEST(Preflight, AnAddressOfAnotherHostIsNamed) {
  FakeBinDir bin;
  const std::string common = std::string("model: {path: ") + FMOE_SOURCE_DIR +
                             "/deploy/models/tiny-moe}\n"
                             "map_service: {data_dir: " +
                             bin.path() + "/maps}\nlauncher: {run_dir: " + bin.path() +
                             "/run}\nsecurity: {curve: false}\n";
  LaunchOptions options;
  options.bin_dir = bin.path();
  const Manifest router_elsewhere = Parse(common +
                                          "worker_groups: [{name: g0, workers: [{}]}]\n"
                                          "router: {listen: \"192.0.2.1:8000\"}\n");
  Status s = Preflight(router_elsewhere, PlanProcesses(router_elsewhere, options), options);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.message(),
            "router.listen: 192.0.2.1:8000: cannot bind: 192.0.2.1 is not an address of this "
            "host (Cannot assign requested address)");

  // A rank this launcher runs (its --host) on an address of another machine.
  const Manifest rank_elsewhere =
      Parse(common + "worker_groups: [{name: g0, workers: [{}, {host: 192.0.2.1}]}]\n");
  options.workers_only = true;
  options.host = "192.0.2.1";
  s = Preflight(rank_elsewhere, PlanProcesses(rank_elsewhere, options), options);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.message().rfind("worker_groups[0].workers[1].host: 192.0.2.1 is not an address of "
                              "this host (this launcher's --host 192.0.2.1); ",
                              0),
            0u)
      << s.message();
  options.host = "127.0.0.1";  // Rank 0's: an address of this machine.
  EXPECT_TRUE(Preflight(rank_elsewhere, PlanProcesses(rank_elsewhere, options), options).ok());
}

// The cluster key: a full launch makes it (0600); a workers-only host must hold a copy.
TEST(Preflight, AFullLaunchMakesTheClusterKeyAndAWorkersOnlyHostNeedsIt) {
  FakeBinDir bin;
  const Manifest m = Parse(std::string("model: {path: ") + FMOE_SOURCE_DIR +
                           "/deploy/models/tiny-moe}\n"
                           "map_service: {data_dir: " +
                           bin.path() +
                           "/maps}\n"
                           "worker_groups: [{name: g0, workers: [{}]}]\n"
                           "launcher: {run_dir: " +
                           bin.path() + "/run}\n");
  LaunchOptions options;
  options.bin_dir = bin.path();
  options.workers_only = true;
  Status missing = Preflight(m, PlanProcesses(m, options), options);
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.code(), ErrorCode::kNotFound);
  EXPECT_EQ(missing.message().rfind("security.key_file: cluster key: ", 0), 0u)
      << missing.message();
  EXPECT_NE(missing.message().find("/run/cluster.key does not exist (copy it"), std::string::npos)
      << missing.message();
  EXPECT_FALSE(fs::exists(bin.path() + "/run/cluster.key")) << "a workers-only host makes none";

  options.workers_only = false;
  Status full = Preflight(m, PlanProcesses(m, options), options);
  EXPECT_TRUE(full.ok()) << full.ToString();
  struct stat st {};
  ASSERT_EQ(stat((bin.path() + "/run/cluster.key").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);
  options.workers_only = true;
  EXPECT_TRUE(Preflight(m, PlanProcesses(m, options), options).ok());
}

// A map store on a disk that refuses writes is served read-only: the launch goes on. A data
// directory that cannot hold a store at all still stops it. Needs a full tmpfs (root).
TEST(Preflight, AStoreOnAFullDiskDoesNotStopTheLaunch) {
  FakeBinDir bin;
  const std::string disk = bin.path() + "/disk";
  fs::create_directories(disk);
  if (::mount("tmpfs", disk.c_str(), "tmpfs", 0, "size=64k") != 0) {
    GTEST_SKIP() << "cannot mount a tmpfs: " << std::strerror(errno);
  }
  struct Unmount {
    std::string dir;
    ~Unmount() { ::umount2(dir.c_str(), MNT_DETACH); }
  } unmount{disk};
  const std::string data_dir = disk + "/maps";
  fs::create_directories(data_dir);
  {
    std::ofstream current(data_dir + "/CURRENT");
    current << "MANIFEST-000001\n";
  }
  {  // Fill the disk.
    std::ofstream fill(disk + "/fill", std::ios::binary);
    const std::string block(4096, 'x');
    for (int i = 0; i < 1024 && fill.write(block.data(), block.size()); ++i) {
    }
  }
  const Manifest m = Parse(std::string("model: {path: ") + FMOE_SOURCE_DIR +
                           "/deploy/models/tiny-moe}\n"
                           "map_service: {data_dir: " +
                           data_dir +
                           "}\n"
                           "worker_groups: [{name: g0, workers: [{}]}]\n"
                           "launcher: {run_dir: " +
                           bin.path() + "/run}\n");
  LaunchOptions options;
  options.bin_dir = bin.path();
  Status with_store = Preflight(m, PlanProcesses(m, options), options);
  EXPECT_TRUE(with_store.ok()) << with_store.ToString();
  for (const auto& entry : fs::directory_iterator(data_dir)) {
    EXPECT_EQ(entry.path().filename().string().rfind(".write-probe", 0), std::string::npos)
        << "the failed probe is removed";
  }
  fs::remove(data_dir + "/CURRENT");
  {  // Fill what that freed.
    std::ofstream fill(disk + "/fill", std::ios::binary | std::ios::app);
    const std::string block(512, 'x');
    for (int i = 0; i < 1024 && fill.write(block.data(), block.size()); ++i) {
    }
  }
  Status without = Preflight(m, PlanProcesses(m, options), options);
  ASSERT_FALSE(without.ok());
  EXPECT_NE(without.message().find("map_service.data_dir"), std::string::npos) << without.message();
  ::umount2(disk.c_str(), MNT_DETACH);
}

}  // namespace
}  // namespace fmoe

namespace fmoe {
namespace {

// A socket listening on 127.0.0.1:port (0: a port of the OS's choice).
class TcpListener {
 public:
  explicit TcpListener(int port = 0) {
    fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    int one = 1;
    setsockopt(fd_, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(port));
    EXPECT_EQ(bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0) << strerror(errno);
    EXPECT_EQ(listen(fd_, 16), 0);
    socklen_t len = sizeof(addr);
    getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
  }
  ~TcpListener() { close(fd_); }
  int port() const { return port_; }

 private:
  int fd_ = -1;
  int port_ = 0;
};

// Lines the default logger writes while it lives.
class LogLines {
 public:
  LogLines() : sink_(std::make_shared<spdlog::sinks::ostream_sink_mt>(out_)) {
    spdlog::default_logger()->sinks().push_back(sink_);
  }
  ~LogLines() {
    auto& sinks = spdlog::default_logger()->sinks();
    sinks.erase(std::remove(sinks.begin(), sinks.end(), sink_), sinks.end());
  }
  std::string Text() {
    sink_->flush();
    return out_.str();
  }

 private:
  std::ostringstream out_;
  std::shared_ptr<spdlog::sinks::ostream_sink_mt> sink_;
};

Manifest WaitManifest(int map_port, int router_port, int wait_s) {
  return Parse(
      "model: {path: m}\nworker_groups: [{name: g0, workers: [{}]}]\n"
      "map_service: {endpoint: \"tcp://127.0.0.1:" +
      std::to_string(map_port) +
      "\"}\n"
      "router: {worker_endpoint: \"tcp://127.0.0.1:" +
      std::to_string(router_port) +
      "\"}\n"
      "launcher: {services_wait_s: " +
      std::to_string(wait_s) + "}\n");
}

// The workers-only wait, on a ManualClock: what it waits for, every 10 s what it still waits
// for, when each is reachable; a router that never comes ends it at the limit.
TEST(WaitForServices, LogsWhatItWaitsForAndGivesUpOnTheRouterAtTheLimit) {
  TcpListener map_service;
  int router_port = 0;
  {
    TcpListener gone;
    router_port = gone.port();
  }
  const Manifest m = WaitManifest(map_service.port(), router_port, 25);
  ManualClock clock(1000);
  LogLines log;
  int waits = 0;
  const int rc = WaitForServices(m, clock, [&](int64_t ms) {
    EXPECT_GT(ms, 0);
    EXPECT_LE(ms, 500);
    clock.AdvanceMs(ms);
    ++waits;
    return false;
  });
  EXPECT_EQ(rc, 1);
  EXPECT_EQ(waits, 50) << "one probe each 500 ms for 25 s";
  const std::string text = log.Text();
  const std::string router =
      "the router at tcp://127.0.0.1:" + std::to_string(router_port) + " (host 127.0.0.1)";
  const std::string maps =
      "the map service at tcp://127.0.0.1:" + std::to_string(map_service.port()) +
      " (host 127.0.0.1)";
  EXPECT_NE(text.find("waiting for " + router + ", up to 25 s (launcher.services_wait_s)"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find(maps + " is reachable after 0.0 s"), std::string::npos) << text;
  EXPECT_NE(text.find("still waiting for " + router + ", 10 s: connection refused"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("still waiting for " + router + ", 20 s: connection refused"),
            std::string::npos)
      << text;
  EXPECT_EQ(text.find("still waiting for the map service"), std::string::npos) << text;
}

TEST(WaitForServices, GoesOnOnceTheRouterListensAndStopsOnASignal) {
  TcpListener map_service;
  int router_port = 0;
  {
    TcpListener gone;
    router_port = gone.port();
  }
  const Manifest m = WaitManifest(map_service.port(), router_port, 600);
  ManualClock clock(0);
  LogLines log;
  std::unique_ptr<TcpListener> router;
  const int rc = WaitForServices(m, clock, [&](int64_t ms) {
    clock.AdvanceMs(ms);
    if (clock.NowMs() >= 3000 && !router) router = std::make_unique<TcpListener>(router_port);
    return false;
  });
  EXPECT_EQ(rc, 0);
  EXPECT_NE(log.Text().find("the router at tcp://127.0.0.1:" + std::to_string(router_port) +
                            " (host 127.0.0.1) is reachable after 3.0 s"),
            std::string::npos)
      << log.Text();
  router.reset();

  // A stop signal while waiting: -1, at once.
  int waits = 0;
  EXPECT_EQ(WaitForServices(m, clock,
                            [&](int64_t) {
                              ++waits;
                              return true;
                            }),
            -1);
  EXPECT_EQ(waits, 1);

  // services_wait_s: 0 waits for nothing.
  EXPECT_EQ(WaitForServices(WaitManifest(map_service.port(), router_port, 0), clock,
                            [&](int64_t) -> bool {
                              ADD_FAILURE() << "waited";
                              return true;
                            }),
            0);
}

}  // namespace
}  // namespace fmoe
