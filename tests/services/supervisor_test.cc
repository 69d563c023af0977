// The supervisor's rules with a fake process runner and a manual clock: stage order, restart
// with doubling backoff, giving up after repeated crashes, reverse-order stop with SIGKILL
// after the timeout, start-up failures that name the process, and restart units (the ranks of
// a worker group: killed and restarted together, one failure counted once).
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
    if (fail_spawn.count(spec.name)) return Internal("fork: out of memory");
    int pid = next_pid_++;
    names_[pid] = spec.name;
    spawned.push_back(spec.name);
    return pid;
  }
  bool CheckReady(int pid) override { return ready.count(pid) > 0; }
  std::optional<ExitInfo> Reap(int pid) override {
    auto it = exits.find(pid);
    if (it == exits.end() || held.count(names_[pid])) return std::nullopt;
    ExitInfo e = it->second;
    exits.erase(it);
    return e;
  }
  void Signal(int pid, int sig) override {
    signals.emplace_back(names_[pid], sig);
    if (sig == SIGKILL || (sig == SIGTERM && !ignore_term.count(names_[pid]))) {
      exits.try_emplace(pid, ExitInfo{true, sig});  // One that has exited already keeps its exit.
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
  std::set<std::string> held;        // Their exits are not reaped yet.
  std::set<std::string> fail_spawn;  // Spawn fails for these.

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

// Two worker groups as restart units: g0 with two ranks, g1 with one.
std::vector<ProcessSpec> UnitPlan() {
  return {{"map-service", {"/bin/m"}, "/nonexistent/m.log", 0},
          {"worker-g0-0", {"/bin/w"}, "/nonexistent/w0.log", 1, "group:g0"},
          {"worker-g0-1", {"/bin/w"}, "/nonexistent/w1.log", 1, "group:g0"},
          {"worker-g1-0", {"/bin/w"}, "/nonexistent/g1.log", 1, "group:g1"},
          {"router", {"/bin/r"}, "/nonexistent/r.log", 2}};
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

// Starts every stage of any plan, making each process ready as soon as it is spawned.
void StartAllReady(Supervisor& sup, FakeRunner& runner) {
  for (int i = 0; i < 8 && sup.phase() == Supervisor::Phase::kStarting; ++i) {
    sup.Step();
    for (const auto& name : runner.spawned) runner.MakeReady(name);
  }
  ASSERT_EQ(sup.phase(), Supervisor::Phase::kRunning);
}

using Signals = std::vector<std::pair<std::string, int>>;
using Names = std::vector<std::string>;

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

// The launcher's order: the router starts before the workers (it reports their loading) but
// stops before them (it drains first).
TEST(Supervisor, AStopStageOverridesTheStopOrder) {
  FakeRunner runner;
  ManualClock clock;
  std::vector<ProcessSpec> plan = {{"map-service", {"/bin/m"}, "/nonexistent/m.log", 0},
                                   {"router", {"/bin/r"}, "/nonexistent/r.log", 1},
                                   {"worker-g0-0", {"/bin/w"}, "/nonexistent/w0.log", 2}};
  plan[1].stop_stage = 2;
  plan[2].stop_stage = 1;
  Supervisor sup(Options(), plan, runner, clock);
  StartAllReady(sup, runner);
  EXPECT_EQ(runner.spawned, (Names{"map-service", "router", "worker-g0-0"}));
  sup.BeginStop();
  EXPECT_EQ(runner.signals, (Signals{{"router", SIGTERM}}));
  sup.Step();
  EXPECT_EQ(runner.signals, (Signals{{"router", SIGTERM}, {"worker-g0-0", SIGTERM}}));
  sup.Step();
  EXPECT_EQ(runner.signals.back(), std::make_pair(std::string("map-service"), SIGTERM));
  sup.Step();
  EXPECT_EQ(sup.phase(), Supervisor::Phase::kStopped);
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

// ---- restart units ----

TEST(SupervisorUnit, MemberCrashKillsTheOtherMembersOfItsUnitOnly) {
  FakeRunner runner;
  ManualClock clock;
  Supervisor sup(Options(), UnitPlan(), runner, clock);
  StartAllReady(sup, runner);
  const int old_pid = Find(sup, "worker-g0-0").pid;

  runner.Crash("worker-g0-1", 3);
  sup.Step();
  EXPECT_EQ(runner.signals, (Signals{{"worker-g0-0", SIGTERM}}));
  const ProcStatus& crashed = Find(sup, "worker-g0-1");
  const ProcStatus& killed = Find(sup, "worker-g0-0");
  EXPECT_EQ(crashed.state, ProcState::kBackoff);
  EXPECT_EQ(crashed.last_exit, "exit code 3");
  EXPECT_EQ(crashed.crashes_ms.size(), 1u);
  EXPECT_EQ(killed.state, ProcState::kBackoff) << "killed: shown as waiting for the restart";
  EXPECT_EQ(killed.pid, old_pid) << "not reaped yet (it comes first in this step's order)";
  sup.Step();
  EXPECT_EQ(killed.state, ProcState::kBackoff);
  EXPECT_EQ(killed.pid, -1);
  EXPECT_EQ(killed.last_exit, "killed by signal 15 (Terminated)");
  EXPECT_TRUE(killed.crashes_ms.empty()) << "killed by its unit: not a crash of its own";
  EXPECT_EQ(killed.restart_at_ms, crashed.restart_at_ms);
  EXPECT_EQ(runner.signals.size(), 1u);
  for (const auto& name : {"map-service", "worker-g1-0", "router"}) {
    EXPECT_EQ(Find(sup, name).state, ProcState::kRunning) << name;
  }
  EXPECT_EQ(sup.phase(), Supervisor::Phase::kRunning);
}

TEST(SupervisorUnit, ProcessesOutsideAUnitAndOtherUnitsRestartAlone) {
  FakeRunner runner;
  ManualClock clock;
  Supervisor sup(Options(), UnitPlan(), runner, clock);
  StartAllReady(sup, runner);
  const size_t spawned = runner.spawned.size();
  runner.Crash("router");
  runner.Crash("worker-g1-0");
  sup.Step();
  EXPECT_TRUE(runner.signals.empty()) << "nobody else is killed";
  EXPECT_EQ(Find(sup, "worker-g0-0").state, ProcState::kRunning);
  EXPECT_EQ(Find(sup, "worker-g0-1").state, ProcState::kRunning);
  clock.AdvanceMs(100);
  sup.Step();
  EXPECT_EQ(Names(runner.spawned.begin() + spawned, runner.spawned.end()),
            (Names{"router", "worker-g1-0"}));
  EXPECT_EQ(Find(sup, "router").restarts, 1);
  EXPECT_EQ(Find(sup, "worker-g1-0").restarts, 1);
  EXPECT_EQ(Find(sup, "worker-g0-0").restarts, 0);
}

TEST(SupervisorUnit, AllMembersRestartTogetherAfterTheBackoff) {
  FakeRunner runner;
  ManualClock clock;
  Supervisor sup(Options(), UnitPlan(), runner, clock);
  StartAllReady(sup, runner);
  const size_t spawned = runner.spawned.size();

  runner.Crash("worker-g0-1", 3);
  sup.Step();
  clock.AdvanceMs(99);
  sup.Step();
  EXPECT_EQ(runner.spawned.size(), spawned);
  clock.AdvanceMs(1);
  sup.Step();
  EXPECT_EQ(Names(runner.spawned.begin() + spawned, runner.spawned.end()),
            (Names{"worker-g0-0", "worker-g0-1"}));
  for (const auto& name : {"worker-g0-0", "worker-g0-1"}) {
    EXPECT_EQ(Find(sup, name).state, ProcState::kStarting) << name;
    EXPECT_EQ(Find(sup, name).restarts, 1) << name;
  }
  runner.MakeReady("worker-g0-0");
  runner.MakeReady("worker-g0-1");
  sup.Step();
  EXPECT_EQ(Find(sup, "worker-g0-0").state, ProcState::kRunning);
  EXPECT_EQ(Find(sup, "worker-g0-1").state, ProcState::kRunning);

  // The unit's second failure (begun by the other member) waits twice as long.
  runner.Crash("worker-g0-0", 1);
  sup.Step();
  EXPECT_EQ(runner.signals.back(), std::make_pair(std::string("worker-g0-1"), SIGTERM));
  clock.AdvanceMs(199);
  sup.Step();
  EXPECT_EQ(runner.spawned.size(), spawned + 2);
  clock.AdvanceMs(1);
  sup.Step();
  EXPECT_EQ(Names(runner.spawned.begin() + spawned + 2, runner.spawned.end()),
            (Names{"worker-g0-0", "worker-g0-1"}));
  EXPECT_EQ(Find(sup, "worker-g0-0").restarts, 2);
  EXPECT_EQ(Find(sup, "worker-g0-1").restarts, 2);
  EXPECT_EQ(sup.phase(), Supervisor::Phase::kRunning);
}

TEST(SupervisorUnit, OneGroupFailureCountsOneCrash) {
  FakeRunner runner;
  ManualClock clock;
  Supervisor sup(Options(), UnitPlan(), runner, clock);  // max_restarts 3.
  StartAllReady(sup, runner);
  // Three failures, each ending both ranks by themselves (a peer died, the other's collective
  // failed), alternating which exit is reaped first: every one counts once, on that member.
  int64_t backoff = 100;
  for (int i = 0; i < 3; ++i) {
    const std::string first = i % 2 == 0 ? "worker-g0-1" : "worker-g0-0";
    const std::string second = i % 2 == 0 ? "worker-g0-0" : "worker-g0-1";
    runner.held.insert(second);
    runner.Crash(first, 3);
    runner.Crash(second, 3);
    sup.Step();
    runner.held.clear();
    sup.Step();
    EXPECT_EQ(Find(sup, second).state, ProcState::kBackoff);
    EXPECT_EQ(Find(sup, second).last_exit, "exit code 3");
    clock.AdvanceMs(backoff - 1);
    sup.Step();
    ASSERT_EQ(Find(sup, first).state, ProcState::kBackoff)
        << "failure " << i + 1 << ": the backoff doubles once per failure";
    clock.AdvanceMs(1);
    sup.Step();
    runner.MakeReady("worker-g0-0");
    runner.MakeReady("worker-g0-1");
    sup.Step();
    ASSERT_EQ(sup.phase(), Supervisor::Phase::kRunning) << "failure " << i + 1;
    ASSERT_EQ(Find(sup, "worker-g0-1").state, ProcState::kRunning) << "failure " << i + 1;
    backoff *= 2;
  }
  EXPECT_EQ(Find(sup, "worker-g0-1").crashes_ms.size(), 2u);
  EXPECT_EQ(Find(sup, "worker-g0-0").crashes_ms.size(), 1u);
  // The unit's fourth failure gives up (no member crashed more than max_restarts times itself),
  // naming the unit and the exit that began the failure.
  runner.Crash("worker-g0-0", 3);
  sup.Step();
  EXPECT_EQ(sup.phase(), Supervisor::Phase::kFailed);
  EXPECT_EQ(sup.failure(),
            "unit group:g0 (worker-g0-0, worker-g0-1) failed 4 times within 10 s (last: "
            "worker-g0-0 exited (exit code 3)); giving up. Its log: /nonexistent/w0.log");
}

TEST(SupervisorUnit, AMemberExitingWithinTheSameFailureIsNotACrash) {
  FakeRunner runner;
  ManualClock clock;
  SupervisorOptions options = Options();
  options.max_restarts = 1;
  Supervisor sup(options, UnitPlan(), runner, clock);
  StartAllReady(sup, runner);
  // worker-g0-0's own exit (code 3) is reaped after worker-g0-1's, during the unit's backoff.
  runner.held.insert("worker-g0-0");
  runner.Crash("worker-g0-1", 3);
  sup.Step();
  EXPECT_EQ(Find(sup, "worker-g0-0").state, ProcState::kBackoff);
  EXPECT_GT(Find(sup, "worker-g0-0").pid, 0) << "killed, not reaped yet";
  clock.AdvanceMs(50);
  runner.exits[runner.PidOf("worker-g0-0")] = ExitInfo{false, 3};
  runner.held.clear();
  sup.Step();
  EXPECT_EQ(Find(sup, "worker-g0-0").state, ProcState::kBackoff);
  EXPECT_EQ(Find(sup, "worker-g0-0").last_exit, "exit code 3");
  EXPECT_TRUE(Find(sup, "worker-g0-0").crashes_ms.empty());
  EXPECT_EQ(sup.phase(), Supervisor::Phase::kRunning) << "one failure, within max_restarts 1";
  clock.AdvanceMs(50);
  sup.Step();
  EXPECT_EQ(Find(sup, "worker-g0-0").state, ProcState::kStarting);
  EXPECT_EQ(Find(sup, "worker-g0-1").state, ProcState::kStarting);
}

TEST(SupervisorUnit, AMemberThatIgnoresSigtermIsKilledAfterTheGrace) {
  FakeRunner runner;
  ManualClock clock;
  Supervisor sup(Options(), UnitPlan(), runner, clock);
  StartAllReady(sup, runner);
  runner.ignore_term.insert("worker-g0-0");  // Stuck in a collective, say.
  runner.Crash("worker-g0-1", 3);
  sup.Step();
  EXPECT_EQ(runner.signals, (Signals{{"worker-g0-0", SIGTERM}}));
  clock.AdvanceMs(1999);
  sup.Step();
  EXPECT_EQ(runner.signals.size(), 1u);
  clock.AdvanceMs(1);
  sup.Step();
  EXPECT_EQ(runner.signals, (Signals{{"worker-g0-0", SIGTERM}, {"worker-g0-0", SIGKILL}}));
  sup.Step();
  EXPECT_EQ(Find(sup, "worker-g0-0").state, ProcState::kStarting) << "restarted with its unit";
  EXPECT_EQ(Find(sup, "worker-g0-1").state, ProcState::kStarting);
}

TEST(SupervisorUnit, AMemberNotYetReapedDelaysTheUnitRestart) {
  FakeRunner runner;
  ManualClock clock;
  Supervisor sup(Options(), UnitPlan(), runner, clock);
  StartAllReady(sup, runner);
  const size_t spawned = runner.spawned.size();
  runner.held.insert("worker-g0-0");  // Its SIGKILL takes effect late (a busy host, say).
  runner.Crash("worker-g0-1", 3);
  sup.Step();
  clock.AdvanceMs(5000);
  sup.Step();
  sup.Step();
  EXPECT_EQ(runner.spawned.size(), spawned) << "the unit waits for its last member";
  EXPECT_EQ(Find(sup, "worker-g0-1").state, ProcState::kBackoff);
  EXPECT_EQ(Find(sup, "worker-g0-0").state, ProcState::kBackoff);
  runner.held.clear();
  sup.Step();  // Reaped, and the time has long come: both start in this step.
  EXPECT_EQ(Names(runner.spawned.begin() + spawned, runner.spawned.end()),
            (Names{"worker-g0-0", "worker-g0-1"}));
  EXPECT_EQ(Find(sup, "worker-g0-0").restarts, 1);
  EXPECT_EQ(Find(sup, "worker-g0-1").restarts, 1);
}

TEST(SupervisorUnit, ReadyTimeoutAfterARestartFailsTheUnitAgain) {
  FakeRunner runner;
  ManualClock clock;
  Supervisor sup(Options(), UnitPlan(), runner, clock);
  StartAllReady(sup, runner);
  runner.Crash("worker-g0-1", 3);
  sup.Step();
  clock.AdvanceMs(100);
  sup.Step();
  runner.MakeReady("worker-g0-0");  // worker-g0-1 never gets ready.
  sup.Step();
  runner.signals.clear();
  clock.AdvanceMs(5000);
  sup.Step();  // Killed for its ready timeout...
  EXPECT_EQ(runner.signals, (Signals{{"worker-g0-1", SIGKILL}}));
  sup.Step();  // ...reaped as the unit's second crash: the other member is killed.
  EXPECT_EQ(runner.signals, (Signals{{"worker-g0-1", SIGKILL}, {"worker-g0-0", SIGTERM}}));
  EXPECT_EQ(Find(sup, "worker-g0-1").crashes_ms.size(), 2u);
  EXPECT_TRUE(Find(sup, "worker-g0-0").crashes_ms.empty());
  const size_t spawned = runner.spawned.size();
  clock.AdvanceMs(200);  // Doubled: the unit's second crash in the window.
  sup.Step();
  EXPECT_EQ(Names(runner.spawned.begin() + spawned, runner.spawned.end()),
            (Names{"worker-g0-0", "worker-g0-1"}));
  EXPECT_EQ(Find(sup, "worker-g0-0").restarts, 2);
}

TEST(SupervisorUnit, AMemberThatCannotBeSpawnedFailsTheUnitAgain) {
  FakeRunner runner;
  ManualClock clock;
  Supervisor sup(Options(), UnitPlan(), runner, clock);
  StartAllReady(sup, runner);
  runner.Crash("worker-g0-0", 3);
  sup.Step();
  runner.fail_spawn.insert("worker-g0-1");
  runner.signals.clear();
  const size_t spawned = runner.spawned.size();
  clock.AdvanceMs(100);
  sup.Step();
  EXPECT_EQ(Names(runner.spawned.begin() + spawned, runner.spawned.end()), (Names{"worker-g0-0"}));
  EXPECT_EQ(runner.signals, (Signals{{"worker-g0-0", SIGTERM}}));
  EXPECT_EQ(Find(sup, "worker-g0-1").state, ProcState::kBackoff);
  EXPECT_EQ(Find(sup, "worker-g0-1").last_exit, "could not start: fork: out of memory");
  runner.fail_spawn.clear();
  sup.Step();  // The started member is reaped.
  EXPECT_EQ(Find(sup, "worker-g0-0").state, ProcState::kBackoff);
  clock.AdvanceMs(200);
  sup.Step();
  EXPECT_EQ(Find(sup, "worker-g0-0").state, ProcState::kStarting);
  EXPECT_EQ(Find(sup, "worker-g0-1").state, ProcState::kStarting);
  runner.MakeReady("worker-g0-1");
  sup.Step();
  runner.Crash("worker-g0-1", 1);
  sup.Step();
  EXPECT_EQ(Find(sup, "worker-g0-1").last_exit, "exit code 1") << "a later exit replaces it";
}

TEST(SupervisorUnit, UnitMemberExitDuringStartupFailsTheLaunch) {
  FakeRunner runner;
  ManualClock clock;
  Supervisor sup(Options(), UnitPlan(), runner, clock);
  sup.Step();
  runner.MakeReady("map-service");
  sup.Step();
  runner.Crash("worker-g0-1", 3);
  sup.Step();
  EXPECT_EQ(sup.phase(), Supervisor::Phase::kFailed);
  EXPECT_EQ(sup.failure(), "worker-g0-1 exited during start-up (exit code 3)");
  EXPECT_TRUE(runner.signals.empty());
}

TEST(SupervisorUnit, BeginStopDuringAUnitBackoffStopsCleanly) {
  FakeRunner runner;
  ManualClock clock;
  Supervisor sup(Options(), UnitPlan(), runner, clock);
  StartAllReady(sup, runner);
  const size_t spawned = runner.spawned.size();
  runner.held.insert("worker-g0-0");  // Killed by the unit but not reaped when the stop begins.
  runner.Crash("worker-g0-1", 3);
  sup.Step();
  runner.signals.clear();
  sup.BeginStop();
  EXPECT_EQ(Find(sup, "worker-g0-1").state, ProcState::kStopped);
  EXPECT_EQ(runner.signals, (Signals{{"router", SIGTERM}}));
  clock.AdvanceMs(500);  // Past the unit's restart time: nothing restarts while stopping.
  sup.Step();
  EXPECT_EQ(runner.signals,
            (Signals{{"router", SIGTERM}, {"worker-g0-0", SIGTERM}, {"worker-g1-0", SIGTERM}}));
  sup.Step();
  EXPECT_EQ(sup.phase(), Supervisor::Phase::kStopping) << "waits for the killed member";
  runner.held.clear();
  sup.Step();
  EXPECT_EQ(runner.signals.back(), std::make_pair(std::string("map-service"), SIGTERM));
  sup.Step();
  EXPECT_EQ(sup.phase(), Supervisor::Phase::kStopped);
  for (const auto& p : sup.processes()) EXPECT_EQ(p.state, ProcState::kStopped) << p.spec.name;
  EXPECT_EQ(runner.spawned.size(), spawned);
}

// ---- processes the cluster serves on without ----

// The launcher's map service: not essential, not needed at start.
std::vector<ProcessSpec> OptionalMapPlan() {
  std::vector<ProcessSpec> plan = UnitPlan();
  plan[0].essential = false;
  plan[0].needed_at_start = false;
  for (auto& p : plan) {
    if (!p.unit.empty()) p.essential = false;
  }
  return plan;
}

TEST(SupervisorOptional, ACrashLoopOfANonEssentialProcessStopsOnlyItForTheWindow) {
  FakeRunner runner;
  ManualClock clock;
  Supervisor sup(Options(), OptionalMapPlan(), runner, clock);  // max_restarts 3, window 10 s.
  StartAllReady(sup, runner);
  for (int i = 0; i < 3; ++i) {
    runner.Crash("map-service", 3);
    sup.Step();
    clock.AdvanceMs(2000);
    sup.Step();
    runner.MakeReady("map-service");
    sup.Step();
  }
  runner.signals.clear();
  runner.Crash("map-service", 3);
  sup.Step();
  EXPECT_EQ(sup.phase(), Supervisor::Phase::kRunning) << "the rest serves on";
  EXPECT_TRUE(sup.failure().empty());
  EXPECT_EQ(Find(sup, "map-service").state, ProcState::kFailed);
  EXPECT_TRUE(Find(sup, "map-service").given_up);
  EXPECT_TRUE(runner.signals.empty()) << "nothing else is stopped";
  EXPECT_EQ(Find(sup, "router").state, ProcState::kRunning);
  EXPECT_EQ(Find(sup, "worker-g0-0").state, ProcState::kRunning);
  const size_t spawned = runner.spawned.size();
  clock.AdvanceMs(9999);
  sup.Step();
  EXPECT_EQ(runner.spawned.size(), spawned) << "down for the whole window";
  clock.AdvanceMs(1);
  sup.Step();
  EXPECT_EQ(runner.spawned.size(), spawned + 1);
  EXPECT_EQ(Find(sup, "map-service").state, ProcState::kStarting);
  EXPECT_FALSE(Find(sup, "map-service").given_up);
  EXPECT_TRUE(Find(sup, "map-service").crashes_ms.empty()) << "its crashes are forgotten";
  runner.MakeReady("map-service");
  sup.Step();
  EXPECT_EQ(Find(sup, "map-service").state, ProcState::kRunning);
  // An essential process still gives up for everyone.
  for (int i = 0; i < 4; ++i) {
    runner.Crash("router", 3);
    sup.Step();
    clock.AdvanceMs(1000);
    sup.Step();
    runner.MakeReady("router");
    sup.Step();
  }
  EXPECT_EQ(sup.phase(), Supervisor::Phase::kFailed);
}

TEST(SupervisorOptional, StartUpGoesOnWithoutAProcessNotNeededAtStart) {
  FakeRunner runner;
  ManualClock clock;
  Supervisor sup(Options(), OptionalMapPlan(), runner, clock);
  sup.Step();
  ASSERT_EQ(runner.spawned, (Names{"map-service"}));
  runner.Crash("map-service", 1);  // A full disk, say.
  sup.Step();
  EXPECT_EQ(sup.phase(), Supervisor::Phase::kStarting);
  EXPECT_EQ(Find(sup, "map-service").state, ProcState::kBackoff);
  sup.Step();
  EXPECT_EQ(runner.spawned, (Names{"map-service", "worker-g0-0", "worker-g0-1", "worker-g1-0"}))
      << "the next stage starts without it";
  clock.AdvanceMs(100);
  sup.Step();
  EXPECT_EQ(runner.spawned.back(), "map-service") << "restarted after its backoff";
  for (const std::string w : {"worker-g0-0", "worker-g0-1", "worker-g1-0"}) runner.MakeReady(w);
  sup.Step();
  runner.MakeReady("router");
  sup.Step();
  EXPECT_EQ(sup.phase(), Supervisor::Phase::kRunning);
  // A worker is needed at start: its exit during start-up still fails the launch.
  FakeRunner runner2;
  Supervisor sup2(Options(), OptionalMapPlan(), runner2, clock);
  sup2.Step();
  runner2.MakeReady("map-service");
  sup2.Step();
  runner2.Crash("worker-g1-0", 2);
  sup2.Step();
  EXPECT_EQ(sup2.phase(), Supervisor::Phase::kFailed);
}

TEST(SupervisorOptional, AMissedReadyDeadlineAtStartIsACrashForOneNotNeededAtStart) {
  FakeRunner runner;
  ManualClock clock;
  Supervisor sup(Options(), OptionalMapPlan(), runner, clock);
  sup.Step();
  clock.AdvanceMs(5000);
  sup.Step();
  EXPECT_EQ(runner.signals.back(), std::make_pair(std::string("map-service"), SIGKILL));
  sup.Step();  // Reaped: a crash.
  EXPECT_EQ(sup.phase(), Supervisor::Phase::kStarting);
  EXPECT_EQ(Find(sup, "map-service").state, ProcState::kBackoff);
  sup.Step();
  EXPECT_EQ(runner.spawned.size(), 4u) << "the workers start";
}

TEST(SupervisorOptional, ANonEssentialUnitIsGivenUpOnAloneAndRestartsTogetherAfterTheWindow) {
  FakeRunner runner;
  ManualClock clock;
  Supervisor sup(Options(), OptionalMapPlan(), runner, clock);
  StartAllReady(sup, runner);
  int64_t backoff = 100;
  for (int i = 0; i < 3; ++i) {
    runner.Crash("worker-g0-0", 3);
    sup.Step();
    sup.Step();  // worker-g0-1, killed by the unit, reaped.
    clock.AdvanceMs(backoff);
    sup.Step();
    runner.MakeReady("worker-g0-0");
    runner.MakeReady("worker-g0-1");
    sup.Step();
    ASSERT_EQ(Find(sup, "worker-g0-1").state, ProcState::kRunning) << i;
    backoff *= 2;
  }
  runner.signals.clear();
  runner.Crash("worker-g0-0", 3);
  sup.Step();
  EXPECT_EQ(sup.phase(), Supervisor::Phase::kRunning);
  EXPECT_EQ(runner.signals, (Signals{{"worker-g0-1", SIGTERM}})) << "its unit only";
  sup.Step();
  for (const std::string w : {"worker-g0-0", "worker-g0-1"}) {
    EXPECT_EQ(Find(sup, w).state, ProcState::kFailed) << w;
    EXPECT_TRUE(Find(sup, w).given_up) << w;
  }
  EXPECT_EQ(Find(sup, "worker-g1-0").state, ProcState::kRunning);
  EXPECT_EQ(Find(sup, "router").state, ProcState::kRunning);
  const size_t spawned = runner.spawned.size();
  clock.AdvanceMs(9999);
  sup.Step();
  EXPECT_EQ(runner.spawned.size(), spawned);
  clock.AdvanceMs(1);
  sup.Step();
  EXPECT_EQ(runner.spawned.size(), spawned + 2) << "both ranks, together";
  for (const std::string w : {"worker-g0-0", "worker-g0-1"}) {
    EXPECT_EQ(Find(sup, w).state, ProcState::kStarting) << w;
    EXPECT_FALSE(Find(sup, w).given_up) << w;
    EXPECT_TRUE(Find(sup, w).crashes_ms.empty()) << w;
  }
}

TEST(Supervisor, AProcessesOwnStopTimeoutReplacesTheDefault) {
  FakeRunner runner;
  ManualClock clock;
  std::vector<ProcessSpec> plan = Plan();
  plan[0].stop_timeout_ms = 5000;                  // The router: its drain.
  Supervisor sup(Options(), plan, runner, clock);  // stop_timeout_ms 1000.
  StartAll(sup, runner);
  runner.ignore_term.insert("router");
  sup.BeginStop();
  EXPECT_EQ(runner.signals, (Signals{{"router", SIGTERM}}));
  clock.AdvanceMs(4999);
  sup.Step();
  EXPECT_EQ(runner.signals.size(), 1u) << "still draining";
  clock.AdvanceMs(1);
  sup.Step();
  EXPECT_EQ(runner.signals.back(), std::make_pair(std::string("router"), SIGKILL));
}

}  // namespace
}  // namespace fmoe
