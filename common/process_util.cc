#include "common/process_util.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <pthread.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

namespace fmoe {

StopSignals& StopSignals::Install() {
  static StopSignals* instance = [] {
    auto* s = new StopSignals();
    signal(SIGPIPE, SIG_IGN);
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &set, nullptr);
    std::thread([s] { s->Run(); }).detach();
    return s;
  }();
  return *instance;
}

void StopSignals::Run() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  for (;;) {
    int sig = 0;
    if (sigwait(&set, &sig) != 0) continue;
    std::vector<std::function<void()>> callbacks;
    {
      std::lock_guard<std::mutex> lock(mu_);
      last_signal_ = sig;
      ++count_;
      callbacks = callbacks_;
    }
    cv_.notify_all();
    for (auto& fn : callbacks) fn();
  }
}

bool StopSignals::WaitMs(int64_t timeout_ms) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms), [this] { return count_ > 0; });
  return count_ > 0;
}

void StopSignals::OnStop(std::function<void()> fn) {
  bool already;
  {
    std::lock_guard<std::mutex> lock(mu_);
    callbacks_.push_back(fn);
    already = count_ > 0;
  }
  if (already) fn();
}

void NotifyReady(int fd) {
  if (fd < 0) return;
  const char msg[] = "READY\n";
  ssize_t ignored = write(fd, msg, sizeof(msg) - 1);
  (void)ignored;
  close(fd);
}

Status CheckTcpPortFree(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = AI_PASSIVE;
  addrinfo* res = nullptr;
  std::string where = host + ":" + std::to_string(port);
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) != 0 || !res) {
    return InvalidArgument(where + ": cannot resolve " + host);
  }
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    freeaddrinfo(res);
    return IoError(std::string("socket: ") + std::strerror(errno));
  }
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  int rc = bind(fd, res->ai_addr, res->ai_addrlen);
  int err = errno;
  freeaddrinfo(res);
  close(fd);
  if (rc == 0) return Status::Ok();
  if (err == EADDRINUSE) return AlreadyExists(where + " is already in use");
  if (err == EADDRNOTAVAIL) {
    return InvalidArgument(where + ": cannot bind: " + host + " is not an address of this host (" +
                           std::strerror(err) + ")");
  }
  return IoError(where + ": cannot bind: " + std::strerror(err));
}

Status EnsureWritableDir(const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return IoError(dir + ": cannot create directory (" + ec.message() + ")");
  if (!fs::is_directory(dir, ec)) return IoError(dir + ": not a directory");
  fs::path probe = fs::path(dir) / (".write-probe-" + std::to_string(getpid()));
  bool written = false;
  int err = 0;
  {
    std::ofstream out(probe);
    written = out && (out << "probe") && out.flush();
    if (!written) err = errno;
  }
  fs::remove(probe, ec);  // Also when the write failed: a full disk keeps no probe file.
  if (!written) return IoError(dir + ": not writable (" + std::strerror(err) + ")");
  return Status::Ok();
}

uint64_t RandomId() {
  static thread_local std::mt19937_64 rng([] {
    std::random_device rd;
    return (static_cast<uint64_t>(rd()) << 32) ^ rd() ^
           static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  }());
  uint64_t v = 0;
  while (v == 0) v = rng();
  return v;
}

std::string ExecutableDir() {
  std::error_code ec;
  auto exe = std::filesystem::read_symlink("/proc/self/exe", ec);
  if (ec) return ".";
  return exe.parent_path().string();
}

Result<uint64_t> HostAvailableBytes() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  uint64_t kb = 0;
  std::string unit;
  while (in >> key >> kb >> unit) {
    if (key == "MemAvailable:") return kb * 1024;
  }
  return Unavailable("/proc/meminfo has no MemAvailable line");
}

}  // namespace fmoe
