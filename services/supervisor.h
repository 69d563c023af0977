// Starts a set of processes stage by stage, keeps them running, and stops them in reverse.
// A step machine driven by Step() from the launcher's thread, with an injected Clock, so the
// restart and give-up rules are unit-tested without real processes.
//
// Per process:
//   PENDING --Start stage--> STARTING --ready--> RUNNING --exit--> BACKOFF --time--> STARTING
//   STARTING --exit or ready timeout--> (during start-up: the supervisor FAILS; later: BACKOFF)
//   BACKOFF/RUNNING --more than max_restarts crashes within window--> FAILED (gives up: the
//     supervisor FAILS for an essential process; any other stays FAILED for window_ms, is said
//     to be given up on, and then starts afresh with its crashes forgotten)
//   STARTING, not needed at start, during start-up --exit or ready timeout--> BACKOFF (a crash;
//     the next stage starts without it)
//   any --BeginStop--> STOPPING --exit--> STOPPED (SIGTERM, then SIGKILL after stop_timeout)
// Per restart unit (processes with the same ProcessSpec::unit, e.g. the ranks of one worker
// group), once the supervisor is RUNNING:
//   ALL STARTING/RUNNING --a member exits (or is killed after its ready timeout)--> FAILING
//     (OnExit: that exit is the unit's one crash; every other live member gets SIGTERM, then
//     SIGKILL after unit_kill_grace_ms; all members go to BACKOFF with one restart time, from the
//     unit's recent crashes)
//   FAILING --a member is reaped--> it stays BACKOFF, not counted as a crash (killed by the unit,
//     or it exited by itself within the same failure)
//   FAILING --restart time came and every member reaped--> ALL STARTING (RestartUnit)
//   ALL STARTING/RUNNING --a member exits, the unit's crash number max_restarts + 1 within the
//     window--> the supervisor FAILS (gives up) for an essential unit; any other unit fails as
//     above with a restart after window_ms, every member FAILED until then (given up on), its
//     crashes forgotten at the restart
// A unit's crashes are the sum of its members' crash times within the window, each failure
// recorded once, on the member whose exit was reaped first.
// Supervisor phase: STARTING -> RUNNING -> STOPPING -> STOPPED; FAILED when it gives up, which
// the owner answers with BeginStop().
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "common/clock.h"
#include "services/process.h"

namespace fmoe {

struct SupervisorOptions {
  int64_t ready_timeout_ms = 120000;  // Default: 120 s
  int64_t stop_timeout_ms = 10000;    // SIGTERM to SIGKILL. Default: 10 s
  int64_t initial_backoff_ms = 500;   // Default: 500 ms, doubled per recent crash
  int64_t max_backoff_ms = 10000;     // Default: 10 s
  int max_restarts = 5;               // Crashes (of a process or unit) within window_ms. Default: 5
  int64_t window_ms = 60000;          // Default: 60 s
  // When a unit fails, its other members get SIGTERM (a leader tells the router its group is
  // gone), then SIGKILL after this long. Default: 2 s
  int64_t unit_kill_grace_ms = 2000;
};

enum class ProcState { kPending, kStarting, kRunning, kBackoff, kStopping, kStopped, kFailed };
std::string_view ProcStateName(ProcState state);

struct ProcStatus {
  ProcessSpec spec;
  ProcState state = ProcState::kPending;
  int pid = -1;
  int restarts = 0;                // Total restarts since launch (with its unit's, too).
  int64_t started_ms = 0;          // Clock time of the current start.
  int64_t deadline_ms = 0;         // Ready deadline (STARTING), kill time (STOPPING).
  int64_t restart_at_ms = 0;       // BACKOFF: when to start again (with its unit).
  std::deque<int64_t> crashes_ms;  // Crash times within the window (unit failures it began).
  std::string last_exit;           // "exit code 1", "killed by signal 9 (Killed)".
  bool given_up = false;           // FAILED and waiting out the cool-down (restart_at_ms).
};

class Supervisor {
 public:
  enum class Phase { kStarting, kRunning, kStopping, kStopped, kFailed };

  Supervisor(SupervisorOptions options, std::vector<ProcessSpec> specs, ProcessRunner& runner,
             const Clock& clock);

  // Advances every process; call every few tens of milliseconds.
  void Step();
  // Stops everything in reverse stage order; `now` sends SIGKILL at once.
  void BeginStop(bool now = false);

  Phase phase() const { return phase_; }
  // Why the supervisor failed: one line naming the process.
  const std::string& failure() const { return failure_; }
  const std::vector<ProcStatus>& processes() const { return procs_; }
  // Called after any state change (to persist a status file).
  void set_on_change(std::function<void()> fn) { on_change_ = std::move(fn); }

 private:
  // A restart unit's state; BACKOFF members with a pid are killed ones not yet reaped.
  struct UnitState {
    bool failing = false;       // From a member's exit until RestartUnit.
    int64_t restart_at_ms = 0;  // When failing: the earliest restart.
    bool given_up = false;      // Failing for a cool-down: crashes are forgotten at the restart.
  };

  void StartProcess(ProcStatus& p);
  // `last_exit`: ExitInfo::Describe(), or "could not start: <why>".
  void OnExit(ProcStatus& p, std::string last_exit);
  void OnUnitMemberExit(ProcStatus& p);
  void RestartUnit(const std::string& name);
  // True when every member of the unit has been reaped.
  bool UnitReaped(const std::string& name) const;
  // "group:g0 (worker-g0-0, worker-g0-1)".
  std::string DescribeUnit(const std::string& name) const;
  // Drops crash times older than the window; returns how many are left.
  int RecentCrashes(ProcStatus& p, int64_t now);
  int64_t BackoffMs(int recent_crashes) const;
  void Fail(std::string why);
  // A non-essential process or unit given up on for a cool-down: `why` says what happened.
  void GiveUp(const std::string& why, const std::string& log_path);
  int64_t StopTimeoutMs(const ProcStatus& p) const {
    return p.spec.stop_timeout_ms > 0 ? p.spec.stop_timeout_ms : options_.stop_timeout_ms;
  }
  void AdvanceStartup();
  void AdvanceStop();
  void Changed();

  SupervisorOptions options_;
  std::vector<ProcStatus> procs_;
  std::map<std::string, UnitState> units_;  // Every non-empty ProcessSpec::unit.
  ProcessRunner& runner_;
  const Clock& clock_;
  Phase phase_ = Phase::kStarting;
  int start_stage_ = -1;  // Stage being started.
  int stop_stage_ = -1;   // Stage being stopped.
  bool kill_now_ = false;
  std::string failure_;
  std::function<void()> on_change_;
};

}  // namespace fmoe
