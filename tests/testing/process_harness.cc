#include "tests/testing/process_harness.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>

#include "common/manifest.h"
#include "common/wire/curve_key.h"
#include "tests/testing/http_call.h"

namespace fmoe::testing {

std::string BinDir() { return std::string(FMOE_BINARY_DIR) + "/bin"; }

std::string MakeTempDir(const std::string& prefix) {
  std::string templ = "/tmp/" + prefix + "-XXXXXX";
  char* dir = mkdtemp(templ.data());
  return dir ? std::string(dir) : std::string();
}

ScopedTempDir::~ScopedTempDir() {
  std::error_code ec;
  if (!path_.empty()) std::filesystem::remove_all(path_, ec);
}

int FreeTcpPort() {
  // The kernel may hand the same ephemeral port to two binds in a row once the first socket is
  // closed, so a test asking for several ports could get one twice: never return a port this
  // process has returned before.
  static std::mutex mu;
  static std::set<int> given;
  std::lock_guard<std::mutex> lock(mu);
  for (int attempt = 0; attempt < 1000; ++attempt) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0) continue;
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = 0;
    socklen_t len = sizeof(addr);
    const bool ok = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
                    getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
    close(fd);
    if (!ok) continue;
    const int port = ntohs(addr.sin_port);
    if (given.insert(port).second) return port;
  }
  return 0;
}

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

void WriteFile(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::trunc);
  out << text;
}

bool WaitUntil(const std::function<bool()>& pred, int timeout_ms, int poll_ms) {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (std::chrono::steady_clock::now() < deadline) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(poll_ms));
  }
  return pred();
}

bool ProcessAlive(pid_t pid) {
  if (pid <= 0 || kill(pid, 0) != 0) return false;
  std::string stat = ReadFile("/proc/" + std::to_string(pid) + "/stat");
  size_t close_paren = stat.rfind(')');
  if (close_paren == std::string::npos || close_paren + 2 >= stat.size()) return false;
  return stat[close_paren + 2] != 'Z';
}

Child::Child(std::vector<std::string> argv, std::string log_path) : log_path_(std::move(log_path)) {
  std::vector<char*> args;
  for (auto& a : argv) args.push_back(a.data());
  args.push_back(nullptr);
  int log_fd = open(log_path_.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  pid_ = fork();
  if (pid_ == 0) {
    setpgid(0, 0);
    int null_fd = open("/dev/null", O_RDONLY);
    dup2(null_fd, 0);
    dup2(log_fd, 1);
    dup2(log_fd, 2);
    execv(args[0], args.data());
    _exit(127);
  }
  close(log_fd);
}

Child::~Child() {
  if (pid_ > 0 && !reaped_) {
    kill(-pid_, SIGKILL);
    kill(pid_, SIGKILL);
    Wait(5000);
  }
}

void Child::Signal(int sig) {
  if (pid_ > 0 && !reaped_) kill(pid_, sig);
}

std::optional<int> Child::Wait(int timeout_ms) {
  if (reaped_) return std::nullopt;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  for (;;) {
    int status = 0;
    pid_t r = waitpid(pid_, &status, WNOHANG);
    if (r == pid_) {
      reaped_ = true;
      return status;
    }
    if (std::chrono::steady_clock::now() >= deadline) return std::nullopt;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
}

std::pair<int, std::string> RunCommand(const std::vector<std::string>& argv, int timeout_ms) {
  std::string dir = MakeTempDir("fmoe-cmd");
  std::string log = dir + "/out.log";
  int code = -1;
  {
    Child child(argv, log);
    auto status = child.Wait(timeout_ms);
    if (status && WIFEXITED(*status)) code = WEXITSTATUS(*status);
  }
  std::string out = ReadFile(log);
  std::remove(log.c_str());
  rmdir(dir.c_str());
  return {code, out};
}

LaunchedCluster::LaunchedCluster(const std::string& prefix) : dir_(MakeTempDir(prefix)) {}

LaunchedCluster::~LaunchedCluster() {
  if (launcher_) {
    launcher_->Signal(SIGTERM);
    launcher_->Wait(30000);
    launcher_.reset();
  }
  std::error_code ec;
  std::filesystem::remove_all(dir_, ec);
}

std::string LaunchedCluster::TinyManifest(int http_port, const std::string& group_keys,
                                          const std::string& router_keys,
                                          int heartbeat_timeout_ms) const {
  return "model:\n  name: tiny-moe\n  path: " + std::string(FMOE_SOURCE_DIR) +
         "/deploy/models/tiny-moe\n"
         "map_service:\n  endpoint: tcp://127.0.0.1:" +
         std::to_string(FreeTcpPort()) + "\n  data_dir: " + dir_ +
         "/maps\n"
         "worker_groups:\n  - name: g0\n" +
         group_keys + "    workers:\n      - device: cpu\nrouter:\n  listen: 127.0.0.1:" +
         std::to_string(http_port) +
         "\n  worker_endpoint: tcp://127.0.0.1:" + std::to_string(FreeTcpPort()) + "\n" +
         router_keys +
         "heartbeat:\n  interval_ms: 100\n  timeout_ms: " + std::to_string(heartbeat_timeout_ms) +
         "\nlauncher:\n  run_dir: " + dir_ + "/run\n  ready_timeout_s: 120\n";
}

bool LaunchedCluster::Start(const std::string& manifest_yaml, int http_port, int timeout_ms) {
  const std::string manifest = dir_ + "/manifest.yaml";
  WriteFile(manifest, manifest_yaml);
  launcher_ = std::make_unique<Child>(
      std::vector<std::string>{BinDir() + "/fmoe", "launch", manifest}, dir_ + "/launcher.log");
  return WaitUntil([&] { return HttpCall(http_port, "GET", "/health").status == 200; }, timeout_ms,
                   200);
}

bool UseClusterKeyOf(const std::string& manifest_path, std::string* error) {
  Result<Manifest> manifest = LoadManifest(manifest_path);
  Status s = manifest.ok() ? wire::UseClusterKey(manifest->security.curve,
                                                 manifest->security.key_file, /*create=*/true)
                           : manifest.status();
  if (!s.ok() && error != nullptr) *error = s.ToString();
  return s.ok();
}

}  // namespace fmoe::testing
