// One harness for multi-process tests: starts the real binaries with their output in a log
// file, waits for conditions with deadlines, and makes sure nothing outlives the test.
#pragma once

#include <sys/types.h>

#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace fmoe::testing {

// Directory of the built executables.
std::string BinDir();
// A fresh temporary directory (removed by the caller if wanted).
std::string MakeTempDir(const std::string& prefix);

// A fresh temporary directory (MakeTempDir) removed with everything in it when this goes out of
// scope.
class ScopedTempDir {
 public:
  explicit ScopedTempDir(const std::string& prefix) : path_(MakeTempDir(prefix)) {}
  ~ScopedTempDir();
  ScopedTempDir(const ScopedTempDir&) = delete;
  ScopedTempDir& operator=(const ScopedTempDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};
// A TCP port on 127.0.0.1 that was free a moment ago, never one this process was given before
// (0 if none could be found).
int FreeTcpPort();
std::string ReadFile(const std::string& path);
void WriteFile(const std::string& path, const std::string& text);
// Polls `pred` every poll_ms until it is true or timeout_ms passes.
bool WaitUntil(const std::function<bool()>& pred, int timeout_ms, int poll_ms = 100);
// True if a process with this pid exists and is not a zombie.
bool ProcessAlive(pid_t pid);

class Child {
 public:
  // argv[0] is a path; stdout and stderr go to log_path.
  Child(std::vector<std::string> argv, std::string log_path);
  ~Child();  // SIGKILLs the child (and its process group) if still running.
  Child(const Child&) = delete;
  Child& operator=(const Child&) = delete;

  pid_t pid() const { return pid_; }
  void Signal(int sig);
  // Waits for exit; the raw wait status, or nullopt on timeout.
  std::optional<int> Wait(int timeout_ms);
  std::string Log() const { return ReadFile(log_path_); }

 private:
  pid_t pid_ = -1;
  bool reaped_ = false;
  std::string log_path_;
};

// A cluster that `fmoe launch` runs for a test suite, in a temporary directory of its own
// (manifest.yaml, launcher.log, run/ as the manifest's launcher.run_dir should say). Start
// waits for a state: the router's /health answering 200. The destructor sends SIGTERM, waits
// up to 30 s (then the Child's SIGKILL), and removes the directory.
class LaunchedCluster {
 public:
  explicit LaunchedCluster(const std::string& prefix);
  ~LaunchedCluster();
  LaunchedCluster(const LaunchedCluster&) = delete;
  LaunchedCluster& operator=(const LaunchedCluster&) = delete;

  const std::string& dir() const { return dir_; }
  // A manifest for the shipped tiny model: its map service, one group g0 of one cpu rank and
  // the router on free loopback ports (the router's HTTP on `http_port`), data and run
  // directories in dir(). `group_keys` and `router_keys` are more YAML lines of those sections
  // (indented as their keys: 4 and 2 spaces).
  std::string TinyManifest(int http_port, const std::string& group_keys,
                           const std::string& router_keys, int heartbeat_timeout_ms) const;
  // Writes `manifest_yaml` to dir()/manifest.yaml and launches it; true once 127.0.0.1:http_port
  // answers /health 200 within timeout_ms.
  bool Start(const std::string& manifest_yaml, int http_port, int timeout_ms);
  std::string LauncherLog() const { return ReadFile(dir_ + "/launcher.log"); }
  std::string LogOf(const std::string& process) const {
    return ReadFile(dir_ + "/run/logs/" + process + ".log");
  }

 private:
  std::string dir_;
  std::unique_ptr<Child> launcher_;
};

// Makes the cluster key of the manifest at `manifest_path` (security.key_file, created when
// missing, as its processes do) the key of every wire::Context this test process makes from now
// on, so that its own sockets may speak with the processes it starts. False, with `*error`, when
// the manifest or the key cannot be read.
bool UseClusterKeyOf(const std::string& manifest_path, std::string* error = nullptr);

// Runs a command to completion (timeout_ms) and returns {exit code, output}; code -1 on
// timeout or signal.
std::pair<int, std::string> RunCommand(const std::vector<std::string>& argv, int timeout_ms);

}  // namespace fmoe::testing
