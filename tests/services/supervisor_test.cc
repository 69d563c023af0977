// The supervisor's rules with a fake process runner and a manual clock: stage order, restart
// with doubling backoff, giving up after repeated crashes, reverse-order stop with SIGKILL
// after the timeout, and start-up failures that name the process.
#include "services/supervisor.h"

#include <signal.h>

#include <map>
#include <set>

#include <gtest/gtest.h>

namespace fmoe {
namespace {

class FakeRunner : public ProcessRunner {
 public:
  Result<int> Spawn(const ProcessSpec& spec) override {
    int pid = next_pid_++;
    names_[pid] = spec.name;
    spawned.push_back(spec.name);
    return pid;
  }
  bool CheckReady(int pid) override { return ready.count(pid) > 0; }
  std::optional<ExitInfo> Reap(int pid) override {
    auto it = exits.find(pid);
    if (it == exits.end()) return std::nullopt;
    ExitInfo e = it->second;
    exits.erase(it);
    return e;
  }
  void Signal(int pid, int sig) override {
    signals.emplace_back(names_[pid], sig);
    if (sig == SIGKILL || (sig == SIGTERM && !ignore_term.count(names_[pid]))) {
      exits[pid] = ExitInfo{true, sig};
    }
  }

  int PidOf(const std::string& name) const {
    int found = -1;
    for (const auto& [pid, n] : names_) {
      if (n == name) found = pid;  // The newest.
    }
    return found;
  }
  void MakeReady(const std::string& name) { ready.insert(PidOf(name)); }
  void Crash(const std::string& name, int code = 1) { exits[PidOf(name)] = ExitInfo{false, code}; }

  std::vector<std::string> spawned;
  std::vector<std::pair<std::string, int>> signals;
  std::set<int> ready;
  std::map<int, ExitInfo> exits;
  std::set<std::string> ignore_term;

 private:
  int next_pid_ = 100;
  std::map<int, std::string> names_;
};

std::vector<ProcessSpec> Plan() {
  return {{"router", {"/bin/r"}, "/nonexistent/r.log", 2},
          {"map-service", {"/bin/m"}, "/nonexistent/m.log", 0},
          {"worker-g0-0", {"/bin/w"}, "/nonexistent/w0.log", 1},
          {"worker-g0-1", {"/bin/w"}, "/nonexistent/w1.log", 1}};
}

SupervisorOptions Options() {
  SupervisorOptions o;
  o.ready_timeout_ms = 5000;
  o.stop_timeout_ms = 1000;
  o.initial_backoff_ms = 100;
  o.max_backoff_ms = 1000;
  o.max_restarts = 3;
  o.window_ms = 10000;
  return o;
}

const ProcStatus& Find(const Supervisor& s, const std::string& name) {
  for (const auto& p : s.processes()) {
    if (p.spec.name == name) return p;
  }
  throw std::runtime_error("no process " + name);
}

// Starts all stages, making each ready in turn.
void StartAll(Supervisor& sup, FakeRunner& runner) {
  sup.Step();
  runner.MakeReady("map-service");
  sup.Step();
  runner.MakeReady("worker-g0-0");
  runner.MakeReady("worker-g0-1");
  sup.Step();
  runner.MakeReady("router");
  sup.Step();
}

TEST(Supervisor, StartsStagesInOrderOnlyAfterReadiness) {
  FakeRunner runner;
  ManualClock clock;
  Supervisor sup(Options(), Plan(), runner, clock);
  sup.Step();
  EXPECT_EQ(runner.spawned, std::vector<std::string>{"map-service"});
  sup.Step();
  EXPECT_EQ(runner.spawned.size(), 1u) << "workers must wait for the map service";
  runner.MakeReady("map-service");
  sup.Step();
  EXPECT_EQ(runner.spawned,
            (std::vector<std::string>{"map-service", "worker-g0-0", "worker-g0-1"}));
  runner.MakeReady("worker-g0-0");
  sup.Step();
  EXPECT_EQ(runner.spawned.size(), 3u) << "the router waits for every worker";
  runner.MakeReady("worker-g0-1");
  sup.Step();
  EXPECT_EQ(runner.spawned.back(), "router");
  EXPECT_EQ(sup.phase(), Supervisor::Phase::kStarting);
  runner.MakeReady("router");
  sup.Step();
  EXPECT_EQ(sup.phase(), Supervisor::Phase::kRunning);
}

TEST(Supervisor, RestartsACrashedProcessWithDoublingBackoff) {
  FakeRunner runner;
  ManualClock clock;
  Supervisor sup(Options(), Plan(), runner, clock);
  StartAll(sup, runner);
  ASSERT_EQ(sup.phase(), Supervisor::Phase::kRunning);

  runner.Crash("worker-g0-1");
  sup.Step();
  EXPECT_EQ(Find(sup, "worker-g0-1").state, ProcState::kBackoff);
  EXPECT_EQ(Find(sup, "worker-g0-1").last_exit, "exit code 1");
  clock.AdvanceMs(99);
  sup.Step();
  EXPECT_EQ(Find(sup, "worker-g0-1").state, ProcState::kBackoff);
  clock.AdvanceMs(1);
  sup.Step();
  EXPECT_EQ(Find(sup, "worker-g0-1").state, ProcState::kStarting);
  EXPECT_EQ(Find(sup, "worker-g0-1").restarts, 1);
  runner.MakeReady("worker-g0-1");
  sup.Step();
  EXPECT_EQ(Find(sup, "worker-g0-1").state, ProcState::kRunning);

  // A second crash in the window waits twice as long.
  runner.Crash("worker-g0-1");
  sup.Step();
  clock.AdvanceMs(199);
  sup.Step();
  EXPECT_EQ(Find(sup, "worker-g0-1").state, ProcState::kBackoff);
  clock.AdvanceMs(1);
  sup.Step();
  EXPECT_EQ(Find(sup, "worker-g0-1").state, ProcState::kStarting);
  EXPECT_EQ(sup.phase(), Supervisor::Phase::kRunning);
}

TEST(Supervisor, GivesUpAfterRepeatedCrashesInTheWindow) {
  FakeRunner runner;
  ManualClock clock;
  Supervisor sup(Options(), Plan(), runner, clock);
  StartAll(sup, runner);
  for (int i = 0; i < 3; ++i) {
    runner.Crash("map-service", 3);
    sup.Step();
    clock.AdvanceMs(2000);
    sup.Step();
    runner.MakeReady("map-service");
    sup.Step();
    ASSERT_EQ(sup.phase(), Supervisor::Phase::kRunning) << "crash " << i + 1;
  }
  runner.Crash("map-service", 3);
  sup.Step();
  EXPECT_EQ(sup.phase(), Supervisor::Phase::kFailed);
  EXPECT_EQ(sup.failure(),
            "map-service crashed 4 times within 10 s (last: exit code 3); giving up. Its log: "
            "/nonexistent/m.log");
}

TEST(Supervisor, CrashesOutsideTheWindowAreForgotten) {
  FakeRunner runner;
  ManualClock clock;
  Supervisor sup(Options(), Plan(), runner, clock);
  StartAll(sup, runner);
  for (int i = 0; i < 6; ++i) {
    runner.Crash("router");
    sup.Step();
    clock.AdvanceMs(11000);
    sup.Step();
    runner.MakeReady("router");
    sup.Step();
    ASSERT_EQ(sup.phase(), Supervisor::Phase::kRunning) << "crash " << i + 1;
  }
  EXPECT_EQ(Find(sup, "router").restarts, 6);
}

TEST(Supervisor, StopsInReverseOrderAndKillsAfterTheTimeout) {
  FakeRunner runner;
  ManualClock clock;
  Supervisor sup(Options(), Plan(), runner, clock);
  StartAll(sup, runner);
  runner.ignore_term.insert("worker-g0-1");
  sup.BeginStop();
  EXPECT_EQ(runner.signals, (std::vector<std::pair<std::string, int>>{{"router", SIGTERM}}));
  sup.Step();  // Router reaped; workers get SIGTERM.
  ASSERT_EQ(runner.signals.size(), 3u);
  EXPECT_EQ(runner.signals[1], std::make_pair(std::string("worker-g0-0"), SIGTERM));
  EXPECT_EQ(runner.signals[2], std::make_pair(std::string("worker-g0-1"), SIGTERM));
  sup.Step();
  EXPECT_EQ(runner.signals.size(), 3u) << "the map service waits for the stuck worker";
  EXPECT_EQ(sup.phase(), Supervisor::Phase::kStopping);
  clock.AdvanceMs(1000);
  sup.Step();
  EXPECT_EQ(runner.signals[3], std::make_pair(std::string("worker-g0-1"), SIGKILL));
  sup.Step();
  EXPECT_EQ(runner.signals.back(), std::make_pair(std::string("map-service"), SIGTERM));
  sup.Step();
  EXPECT_EQ(sup.phase(), Supervisor::Phase::kStopped);
  for (const auto& p : sup.processes()) EXPECT_EQ(p.state, ProcState::kStopped) << p.spec.name;
}

TEST(Supervisor, ExitDuringStartupFailsNamingTheProcess) {
  FakeRunner runner;
  ManualClock clock;
  Supervisor sup(Options(), Plan(), runner, clock);
  sup.Step();
  runner.Crash("map-service", 1);
  sup.Step();
  EXPECT_EQ(sup.phase(), Supervisor::Phase::kFailed);
  EXPECT_EQ(sup.failure(), "map-service exited during start-up (exit code 1)");
  EXPECT_EQ(runner.spawned.size(), 1u) << "nothing else starts";
}

TEST(Supervisor, NotReadyInTimeDuringStartupFails) {
  FakeRunner runner;
  ManualClock clock;
  Supervisor sup(Options(), Plan(), runner, clock);
  sup.Step();
  clock.AdvanceMs(5000);
  sup.Step();
  EXPECT_EQ(sup.phase(), Supervisor::Phase::kFailed);
  EXPECT_EQ(sup.failure(), "map-service was not ready within 5 s. Its log: /nonexistent/m.log");
  EXPECT_EQ(runner.signals.back(), std::make_pair(std::string("map-service"), SIGKILL));
}

}  // namespace
}  // namespace fmoe
