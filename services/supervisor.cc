#include "services/supervisor.h"

#include <signal.h>

#include <algorithm>

#include <spdlog/spdlog.h>

namespace fmoe {

std::string_view ProcStateName(ProcState state) {
  switch (state) {
    case ProcState::kPending:
      return "pending";
    case ProcState::kStarting:
      return "starting";
    case ProcState::kRunning:
      return "running";
    case ProcState::kBackoff:
      return "backoff";
    case ProcState::kStopping:
      return "stopping";
    case ProcState::kStopped:
      return "stopped";
    case ProcState::kFailed:
      return "failed";
  }
  return "?";
}

Supervisor::Supervisor(SupervisorOptions options, std::vector<ProcessSpec> specs,
                       ProcessRunner& runner, const Clock& clock)
    : options_(options), runner_(runner), clock_(clock) {
  std::stable_sort(specs.begin(), specs.end(),
                   [](const ProcessSpec& a, const ProcessSpec& b) { return a.stage < b.stage; });
  for (auto& s : specs) {
    if (!s.unit.empty()) units_.try_emplace(s.unit);
    ProcStatus p;
    p.spec = std::move(s);
    procs_.push_back(std::move(p));
  }
}

void Supervisor::Changed() {
  if (on_change_) on_change_();
}

void Supervisor::StartProcess(ProcStatus& p) {
  auto pid = runner_.Spawn(p.spec);
  p.started_ms = clock_.NowMs();
  if (!pid.ok()) {
    p.pid = -1;
    p.state = ProcState::kStarting;  // Its failed start counts as an exit of a started process.
    OnExit(p, "could not start: " + pid.status().message());
    return;
  }
  p.pid = *pid;
  p.state = ProcState::kStarting;
  p.deadline_ms = p.started_ms + options_.ready_timeout_ms;
  spdlog::info("started {} (pid {})", p.spec.name, p.pid);
  Changed();
}

void Supervisor::Fail(std::string why) {
  if (phase_ == Phase::kFailed || phase_ == Phase::kStopping || phase_ == Phase::kStopped) return;
  failure_ = std::move(why);
  phase_ = Phase::kFailed;
  spdlog::error("{}", failure_);
  Changed();
}

void Supervisor::GiveUp(const std::string& why, const std::string& log_path) {
  spdlog::error(
      "{}; giving up on it for {} s: the rest of the cluster serves on without it, and "
      "it starts afresh after that. Its log: {}",
      why, options_.window_ms / 1000, log_path);
  Changed();
}

void Supervisor::OnExit(ProcStatus& p, std::string last_exit) {
  p.last_exit = std::move(last_exit);
  p.pid = -1;
  if (phase_ == Phase::kStarting && p.spec.needed_at_start) {
    p.state = ProcState::kFailed;
    std::string line = LastLogLine(p.spec.log_path);
    Fail(p.spec.name + " exited during start-up (" + p.last_exit + ")" +
         (line.empty() ? "" : ": " + line));
    return;
  }
  if (!p.spec.unit.empty()) {
    OnUnitMemberExit(p);
    return;
  }
  const int64_t now = clock_.NowMs();
  p.crashes_ms.push_back(now);
  const int recent = RecentCrashes(p, now);
  if (recent > options_.max_restarts) {
    p.state = ProcState::kFailed;
    const std::string why = p.spec.name + " crashed " + std::to_string(recent) + " times within " +
                            std::to_string(options_.window_ms / 1000) + " s (last: " + p.last_exit +
                            ")";
    if (p.spec.essential) {
      Fail(why + "; giving up. Its log: " + p.spec.log_path);
      return;
    }
    p.given_up = true;
    p.restart_at_ms = now + options_.window_ms;
    GiveUp(why, p.spec.log_path);
    return;
  }
  const int64_t backoff = BackoffMs(recent);
  p.state = ProcState::kBackoff;
  p.restart_at_ms = now + backoff;
  spdlog::warn("{} {}; restarting in {} ms ({} crash(es) in the last {} s)", p.spec.name,
               p.last_exit, backoff, recent, options_.window_ms / 1000);
  Changed();
}

int Supervisor::RecentCrashes(ProcStatus& p, int64_t now) {
  while (!p.crashes_ms.empty() && now - p.crashes_ms.front() > options_.window_ms) {
    p.crashes_ms.pop_front();
  }
  return static_cast<int>(p.crashes_ms.size());
}

int64_t Supervisor::BackoffMs(int recent_crashes) const {
  int64_t backoff = options_.initial_backoff_ms;
  for (int i = 1; i < recent_crashes && backoff < options_.max_backoff_ms; ++i) backoff *= 2;
  return std::min(backoff, options_.max_backoff_ms);
}

std::string Supervisor::DescribeUnit(const std::string& name) const {
  std::string members;
  for (const auto& p : procs_) {
    if (p.spec.unit != name) continue;
    if (!members.empty()) members += ", ";
    members += p.spec.name;
  }
  return name + " (" + members + ")";
}

bool Supervisor::UnitReaped(const std::string& name) const {
  for (const auto& p : procs_) {
    if (p.spec.unit == name && p.pid > 0) return false;
  }
  return true;
}

// A member's exit after start-up. The first exit reaped while the unit runs is its one crash for
// this failure (the rule of a single process, counted over all members); any member reaped while
// the unit is failing was killed by it, or ended by itself within the same failure (a rank whose
// collective failed because a peer died): it waits for the unit's restart, not counted.
void Supervisor::OnUnitMemberExit(ProcStatus& p) {
  UnitState& unit = units_.at(p.spec.unit);
  const std::string how =
      p.last_exit.rfind("could not start", 0) == 0 ? p.last_exit : "exited (" + p.last_exit + ")";
  if (unit.failing) {
    p.state = unit.given_up ? ProcState::kFailed : ProcState::kBackoff;
    p.restart_at_ms = unit.restart_at_ms;
    spdlog::info("{} {} while its unit {} restarts; not counted as a crash", p.spec.name, how,
                 p.spec.unit);
    Changed();
    return;
  }
  const int64_t now = clock_.NowMs();
  p.crashes_ms.push_back(now);
  int recent = 0;
  for (auto& q : procs_) {
    if (q.spec.unit == p.spec.unit) recent += RecentCrashes(q, now);
  }
  unit.failing = true;
  const bool give_up = recent > options_.max_restarts;
  if (give_up && p.spec.essential) {
    p.state = ProcState::kFailed;
    Fail("unit " + DescribeUnit(p.spec.unit) + " failed " + std::to_string(recent) +
         " times within " + std::to_string(options_.window_ms / 1000) + " s (last: " + p.spec.name +
         " " + how + "); giving up. Its log: " + p.spec.log_path);
    return;
  }
  const int64_t backoff = give_up ? options_.window_ms : BackoffMs(recent);
  unit.restart_at_ms = now + backoff;
  unit.given_up = give_up;
  for (auto& q : procs_) {
    if (q.spec.unit != p.spec.unit) continue;
    if (&q != &p && q.pid > 0) {
      runner_.Signal(q.pid, SIGTERM);  // Reaped as BACKOFF; SIGKILL after the grace (Step).
      q.deadline_ms = now + options_.unit_kill_grace_ms;
    }
    q.state = give_up ? ProcState::kFailed : ProcState::kBackoff;
    q.given_up = give_up;
    q.restart_at_ms = unit.restart_at_ms;
  }
  if (give_up) {
    GiveUp("unit " + DescribeUnit(p.spec.unit) + " failed " + std::to_string(recent) +
               " times within " + std::to_string(options_.window_ms / 1000) +
               " s (last: " + p.spec.name + " " + how + ")",
           p.spec.log_path);
    return;
  }
  spdlog::warn("{} {}; restarting unit {} in {} ms ({} crash(es) in the last {} s)", p.spec.name,
               how, DescribeUnit(p.spec.unit), backoff, recent, options_.window_ms / 1000);
  Changed();
}

// Starts every member again, in plan order. A member that cannot be spawned fails the unit anew
// (OnExit), which kills the members already started: the rest wait for the next restart.
void Supervisor::RestartUnit(const std::string& name) {
  UnitState& unit = units_.at(name);
  unit.failing = false;
  const bool after_give_up = unit.given_up;
  unit.given_up = false;
  spdlog::info("restarting unit {}{}", DescribeUnit(name),
               after_give_up ? " after its cool-down, its crashes forgotten" : "");
  for (auto& p : procs_) {
    if (p.spec.unit != name) continue;
    if (after_give_up) p.crashes_ms.clear();
    p.given_up = false;
    ++p.restarts;
    StartProcess(p);
    if (unit.failing || phase_ != Phase::kRunning) return;
  }
}

void Supervisor::Step() {
  const int64_t now = clock_.NowMs();
  for (auto& p : procs_) {
    if (p.pid > 0) {
      if (auto exit = runner_.Reap(p.pid)) {
        if (p.state == ProcState::kStopping || phase_ == Phase::kStopping ||
            phase_ == Phase::kStopped) {
          p.pid = -1;
          p.last_exit = exit->Describe();
          p.state = ProcState::kStopped;
          spdlog::info("{} stopped ({})", p.spec.name, p.last_exit);
          Changed();
        } else {
          OnExit(p, exit->Describe());
        }
        continue;
      }
    }
    if (phase_ == Phase::kStopping || phase_ == Phase::kStopped) continue;
    if (p.state == ProcState::kStarting) {
      if (runner_.CheckReady(p.pid)) {
        p.state = ProcState::kRunning;
        spdlog::info("{} is ready (pid {})", p.spec.name, p.pid);
        Changed();
      } else if (now >= p.deadline_ms) {
        std::string why = p.spec.name + " was not ready within " +
                          std::to_string(options_.ready_timeout_ms / 1000) + " s";
        runner_.Signal(p.pid, SIGKILL);
        if (phase_ == Phase::kStarting && p.spec.needed_at_start) {
          p.state = ProcState::kFailed;
          Fail(why + ". Its log: " + p.spec.log_path);
        } else {
          spdlog::warn("{}; killing it", why);
          p.state = ProcState::kRunning;  // Its exit is reaped as a crash.
        }
      }
    } else if (p.state == ProcState::kBackoff && p.pid > 0 && now >= p.deadline_ms) {
      // A member of a failed unit that did not leave within the grace.
      spdlog::warn("{} did not exit within {} ms of its unit's failure; sending SIGKILL",
                   p.spec.name, options_.unit_kill_grace_ms);
      runner_.Signal(p.pid, SIGKILL);
      p.deadline_ms = now + StopTimeoutMs(p);
    } else if ((p.state == ProcState::kBackoff || (p.state == ProcState::kFailed && p.given_up)) &&
               p.spec.unit.empty() && now >= p.restart_at_ms &&
               (phase_ == Phase::kRunning ||
                (phase_ == Phase::kStarting && !p.spec.needed_at_start))) {
      if (p.given_up) {
        spdlog::info("{}: its cool-down is over; starting it afresh, its crashes forgotten",
                     p.spec.name);
        p.crashes_ms.clear();
        p.given_up = false;
      }
      ++p.restarts;
      StartProcess(p);
    }
  }
  // A unit restarts once its time has come and its last member has been reaped.
  for (auto& [name, unit] : units_) {
    if (phase_ != Phase::kRunning) break;
    if (unit.failing && now >= unit.restart_at_ms && UnitReaped(name)) RestartUnit(name);
  }
  if (phase_ == Phase::kStarting) AdvanceStartup();
  if (phase_ == Phase::kStopping) AdvanceStop();
}

void Supervisor::AdvanceStartup() {
  // The current stage must be fully running before the next one starts.
  // One not needed at start counts once it is running or has failed its start (it is restarted
  // on its own).
  bool stage_running = true;
  for (const auto& p : procs_) {
    if (p.spec.stage != start_stage_ || p.state == ProcState::kRunning) continue;
    if (p.spec.needed_at_start || p.state == ProcState::kStarting ||
        p.state == ProcState::kPending) {
      stage_running = false;
    }
  }
  if (!stage_running) return;
  int next = -1;
  for (const auto& p : procs_) {
    if (p.spec.stage > start_stage_) {
      next = p.spec.stage;
      break;
    }
  }
  if (next < 0) {
    phase_ = Phase::kRunning;
    Changed();
    return;
  }
  start_stage_ = next;
  for (auto& p : procs_) {
    if (p.spec.stage == next) StartProcess(p);
    if (phase_ != Phase::kStarting) return;
  }
}

void Supervisor::BeginStop(bool now) {
  kill_now_ = kill_now_ || now;
  if (phase_ == Phase::kStopped) return;
  if (phase_ != Phase::kStopping) {
    phase_ = Phase::kStopping;
    stop_stage_ = -1;
    for (const auto& p : procs_) stop_stage_ = std::max(stop_stage_, p.spec.StopOrder() + 1);
    for (auto& p : procs_) {
      if (p.pid <= 0 && p.state != ProcState::kStopped) p.state = ProcState::kStopped;
    }
  }
  if (kill_now_) {
    for (auto& p : procs_) {
      if (p.pid > 0) runner_.Signal(p.pid, SIGKILL);
    }
  }
  AdvanceStop();
}

void Supervisor::AdvanceStop() {
  const int64_t now = clock_.NowMs();
  for (;;) {
    bool stage_left = false;
    for (auto& p : procs_) {
      if (p.spec.StopOrder() != stop_stage_ || p.pid <= 0) continue;
      stage_left = true;
      if (now >= p.deadline_ms && p.state == ProcState::kStopping) {
        spdlog::warn("{} did not stop within {} ms; sending SIGKILL", p.spec.name,
                     StopTimeoutMs(p));
        runner_.Signal(p.pid, SIGKILL);
        p.deadline_ms = now + StopTimeoutMs(p);
      }
    }
    if (stage_left) return;
    // Move to the next lower stage that has live processes, and signal them.
    int next = -1;
    for (const auto& p : procs_) {
      if (p.spec.StopOrder() < stop_stage_) next = std::max(next, p.spec.StopOrder());
    }
    if (next < 0) {
      phase_ = Phase::kStopped;
      Changed();
      return;
    }
    stop_stage_ = next;
    for (auto& p : procs_) {
      if (p.spec.StopOrder() != next) continue;
      if (p.pid > 0) {
        p.state = ProcState::kStopping;
        p.deadline_ms = now + StopTimeoutMs(p);
        runner_.Signal(p.pid, kill_now_ ? SIGKILL : SIGTERM);
      } else {
        p.state = ProcState::kStopped;
      }
    }
    Changed();
  }
}

}  // namespace fmoe
