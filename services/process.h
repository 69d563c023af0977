// Child processes of the launcher behind an interface, so the supervisor's restart logic is
// tested with a fake. PosixProcessRunner forks and execs: the child gets its own process group
// (a terminal's Ctrl-C reaches only the launcher, which stops children in order), dies with the
// launcher (PR_SET_PDEATHSIG), writes stdout and stderr to its log file, and reports readiness
// by writing a line to fd 3 (passed as --ready-fd 3). Used from the launcher's thread only.
#pragma once

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"

namespace fmoe {

struct ProcessSpec {
  std::string name;               // "map-service", "worker-g0-1", "router".
  std::vector<std::string> argv;  // argv[0] is the executable's path.
  std::string log_path;           // Output is appended here.
  int stage = 0;                  // Started in increasing stage order, stopped in decreasing.
  // Processes with the same non-empty unit are restarted together (the ranks of one worker
  // group, "group:g0": a c10d group is re-formed only by all its ranks starting afresh).
  std::string unit = {};  // Default: none (restarted alone). "= {}": initialisers may omit it.
  // Stopped in decreasing order of this instead, when >= 0 (the router starts before the workers
  // so clients see them load, and stops first so it drains). Default: -1 (the stage)
  int stop_stage = -1;  // "= -1": initialisers may omit it.
  // What giving up on it (or its unit) after too many crashes does: true = the supervisor fails
  // and the cluster stops (the router: nothing serves without it); false = only it (its unit)
  // stays down for a cool-down of the crash window, then starts afresh, while the rest serves
  // on. Default: true
  bool essential = true;
  // Whether start-up waits for it: false = an exit or a missed ready deadline during start-up is
  // a crash like any later one, and the next stage starts without it (the map service: serving
  // needs no map). Default: true
  bool needed_at_start = true;
  // SIGTERM to SIGKILL for this process, when > 0 (the router: its drain). Default: 0, the
  // supervisor's stop_timeout_ms
  int64_t stop_timeout_ms = 0;
  int StopOrder() const { return stop_stage >= 0 ? stop_stage : stage; }
};

struct ExitInfo {
  bool signaled = false;
  int code = 0;  // Exit code, or the signal number when signaled.
  // "exit code 1" or "killed by signal 9 (Killed)".
  std::string Describe() const;
};

class ProcessRunner {
 public:
  virtual ~ProcessRunner() = default;
  // Starts the child; returns its pid.
  virtual Result<int> Spawn(const ProcessSpec& spec) = 0;
  // True once the child has written to its readiness pipe. Non-blocking.
  virtual bool CheckReady(int pid) = 0;
  // Reaps the child if it has ended. Non-blocking.
  virtual std::optional<ExitInfo> Reap(int pid) = 0;
  virtual void Signal(int pid, int signal) = 0;
};

class PosixProcessRunner final : public ProcessRunner {
 public:
  ~PosixProcessRunner() override;
  Result<int> Spawn(const ProcessSpec& spec) override;
  bool CheckReady(int pid) override;
  std::optional<ExitInfo> Reap(int pid) override;
  void Signal(int pid, int signal) override;

 private:
  std::map<int, int> ready_fds_;  // pid -> read end of its readiness pipe.
};

// The last non-empty line of a file (at most the final 64 KiB are read); "" if none.
std::string LastLogLine(const std::string& path);

}  // namespace fmoe
