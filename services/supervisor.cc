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
    p.last_exit = "could not start: " + pid.status().message();
    OnExit(p, ExitInfo{false, 127});
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

void Supervisor::OnExit(ProcStatus& p, const ExitInfo& exit) {
  if (p.last_exit.rfind("could not start", 0) != 0) p.last_exit = exit.Describe();
  p.pid = -1;
  if (phase_ == Phase::kStarting) {
    p.state = ProcState::kFailed;
    std::string line = LastLogLine(p.spec.log_path);
    Fail(p.spec.name + " exited during start-up (" + p.last_exit + ")" +
         (line.empty() ? "" : ": " + line));
    return;
  }
  const int64_t now = clock_.NowMs();
  p.crashes_ms.push_back(now);
  while (!p.crashes_ms.empty() && now - p.crashes_ms.front() > options_.window_ms) {
    p.crashes_ms.pop_front();
  }
  const int recent = static_cast<int>(p.crashes_ms.size());
  if (recent > options_.max_restarts) {
    p.state = ProcState::kFailed;
    Fail(p.spec.name + " crashed " + std::to_string(recent) + " times within " +
         std::to_string(options_.window_ms / 1000) + " s (last: " + p.last_exit +
         "); giving up. Its log: " + p.spec.log_path);
    return;
  }
  int64_t backoff = options_.initial_backoff_ms;
  for (int i = 1; i < recent && backoff < options_.max_backoff_ms; ++i) backoff *= 2;
  backoff = std::min(backoff, options_.max_backoff_ms);
  p.state = ProcState::kBackoff;
  p.restart_at_ms = now + backoff;
  spdlog::warn("{} {}; restarting in {} ms ({} crash(es) in the last {} s)", p.spec.name,
               p.last_exit, backoff, recent, options_.window_ms / 1000);
  Changed();
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
          OnExit(p, *exit);
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
        if (phase_ == Phase::kStarting) {
          p.state = ProcState::kFailed;
          Fail(why + ". Its log: " + p.spec.log_path);
        } else {
          spdlog::warn("{}; killing it", why);
          p.state = ProcState::kRunning;  // Its exit is reaped as a crash.
        }
      }
    } else if (p.state == ProcState::kBackoff && now >= p.restart_at_ms &&
               phase_ == Phase::kRunning) {
      ++p.restarts;
      StartProcess(p);
    }
  }
  if (phase_ == Phase::kStarting) AdvanceStartup();
  if (phase_ == Phase::kStopping) AdvanceStop();
}

void Supervisor::AdvanceStartup() {
  // The current stage must be fully running before the next one starts.
  bool stage_running = true;
  for (const auto& p : procs_) {
    if (p.spec.stage == start_stage_ && p.state != ProcState::kRunning) stage_running = false;
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
    stop_stage_ = procs_.empty() ? -1 : procs_.back().spec.stage + 1;
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
      if (p.spec.stage != stop_stage_ || p.pid <= 0) continue;
      stage_left = true;
      if (now >= p.deadline_ms && p.state == ProcState::kStopping) {
        spdlog::warn("{} did not stop within {} ms; sending SIGKILL", p.spec.name,
                     options_.stop_timeout_ms);
        runner_.Signal(p.pid, SIGKILL);
        p.deadline_ms = now + options_.stop_timeout_ms;
      }
    }
    if (stage_left) return;
    // Move to the next lower stage that has live processes, and signal them.
    int next = -1;
    for (const auto& p : procs_) {
      if (p.spec.stage < stop_stage_) next = std::max(next, p.spec.stage);
    }
    if (next < 0) {
      phase_ = Phase::kStopped;
      Changed();
      return;
    }
    stop_stage_ = next;
    for (auto& p : procs_) {
      if (p.spec.stage != next) continue;
      if (p.pid > 0) {
        p.state = ProcState::kStopping;
        p.deadline_ms = now + options_.stop_timeout_ms;
        runner_.Signal(p.pid, kill_now_ ? SIGKILL : SIGTERM);
      } else {
        p.state = ProcState::kStopped;
      }
    }
    Changed();
  }
}

}  // namespace fmoe
