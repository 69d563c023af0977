#include "bench/fmoe_bench/serve_cluster.h"

#include <arpa/inet.h>
#include <dirent.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <thread>

#include "common/http_client.h"
#include "common/json.h"
#include "services/process.h"

namespace fmoe::bench {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

// A TCP port on 127.0.0.1 that was free a moment ago and is not in `taken`.
int FreePort(std::set<int>& taken) {
  for (int attempt = 0; attempt < 64; ++attempt) {
    const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) break;
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof(addr);
    int port = 0;
    if (bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
        getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0) {
      port = ntohs(addr.sin_port);
    }
    close(fd);
    if (port > 0 && taken.insert(port).second) return port;
  }
  return 0;  // Fails the launcher's pre-flight with a clear message.
}

std::string Quoted(const std::string& s) { return nlohmann::json(s).dump(); }

std::string Number(double v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%g", v);
  return buf;
}

// Fields of /proc/PID/stat after the command name: state is [0], ppid [1], pgrp [2].
std::vector<std::string> StatFields(pid_t pid) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/stat");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  const size_t paren = text.rfind(')');
  std::vector<std::string> out;
  if (paren == std::string::npos) return out;
  std::istringstream fields(text.substr(paren + 1));
  for (std::string f; fields >> f;) out.push_back(f);
  return out;
}

}  // namespace

Manifest DeriveManifest(const Manifest& base, const std::string& policy, double fraction,
                        const std::string& dir) {
  Manifest m = base;
  std::set<int> taken;
  m.map_service.endpoint = "tcp://127.0.0.1:" + std::to_string(FreePort(taken));
  m.map_service.data_dir = (fs::path(dir) / "maps").string();
  m.router.listen = "127.0.0.1:" + std::to_string(FreePort(taken));
  m.router.worker_endpoint = "tcp://127.0.0.1:" + std::to_string(FreePort(taken));
  for (WorkerGroupSpec& g : m.worker_groups) {
    g.policy = policy;
    g.expert_cache_gb.reset();
    g.expert_cache_auto = false;
    if (g.memory && fraction < 1) {
      // One device budget: the policy runs keep it; the all-resident reference does not.
      g.expert_cache_fraction.reset();
    } else {
      g.memory.reset();
      g.expert_cache_fraction = fraction;
    }
    g.rendezvous = "127.0.0.1:" + std::to_string(FreePort(taken));
  }
  m.launcher.run_dir = (fs::path(dir) / "run").string();
  // The run's own cluster key, not one beside the base manifest (the base's default follows
  // its run_dir).
  m.security.key_file = (fs::path(m.launcher.run_dir) / "cluster.key").string();
  return m;
}

std::string ManifestYaml(const Manifest& m) {
  // DescribeManifest writes every key (it follows the manifest's fields as they grow) but
  // redacts the API keys; they are put back here.
  std::string yaml = DescribeManifest(m);
  const size_t keys = yaml.find("\n  api_keys: [");
  if (keys != std::string::npos) {
    const size_t end = yaml.find('\n', keys + 1);
    std::string list = "\n  api_keys: [";
    for (size_t i = 0; i < m.router.api_keys.size(); ++i) {
      list += (i ? ", " : "") + Quoted(m.router.api_keys[i]);
    }
    yaml.replace(keys, end - keys, list + "]");
  }
  return yaml;
}

Result<Manifest> WriteManifest(const Manifest& manifest, const std::string& path) {
  std::error_code ec;
  fs::create_directories(fs::path(path).parent_path(), ec);
  {
    std::ofstream out(path, std::ios::trunc);
    out << ManifestYaml(manifest);
    if (!out) return IoError(path + ": cannot write the derived manifest");
  }
  Result<Manifest> loaded = LoadManifest(path);
  if (!loaded.ok()) {
    return Internal("the derived manifest " + path +
                    " does not load: " + loaded.status().message());
  }
  // It must read back as written (the first line names the source file).
  auto body = [](const Manifest& m) {
    const std::string text = DescribeManifest(m);
    return text.substr(text.find('\n') + 1);
  };
  if (body(*loaded) != body(manifest) || loaded->router.api_keys != manifest.router.api_keys) {
    return Internal("the derived manifest " + path + " does not read back as written");
  }
  return loaded;
}

std::string TailFile(const std::string& path, int lines) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return "";
  in.seekg(0, std::ios::end);
  const std::streamoff size = in.tellg();
  const std::streamoff from = size > 65536 ? size - 65536 : 0;
  in.seekg(from);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::deque<std::string> kept;
  std::istringstream split(text);
  for (std::string line; std::getline(split, line);) {
    kept.push_back(line);
    if (static_cast<int>(kept.size()) > lines) kept.pop_front();
  }
  std::string out;
  for (const std::string& line : kept) out += line + "\n";
  return out;
}

Result<std::unique_ptr<LaunchedCluster>> LaunchedCluster::Start(const std::string& fmoe_bin,
                                                                const Manifest& manifest,
                                                                const std::string& log_path) {
  if (access(fmoe_bin.c_str(), X_OK) != 0) {
    return NotFound(fmoe_bin + ": the launcher binary is not there or not executable (--fmoe)");
  }
  Result<HostPort> listen = ParseHostPort(manifest.router.listen);
  if (!listen.ok()) return listen.status();
  // Orphaned descendants become our children, so Stop() can find and reap them.
  prctl(PR_SET_CHILD_SUBREAPER, 1);
  const int log_fd = open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (log_fd < 0) return IoError(log_path + ": cannot open (" + std::strerror(errno) + ")");
  std::vector<std::string> args = {fmoe_bin, "launch", manifest.source_path};
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  const pid_t parent = getpid();
  const pid_t pid = fork();
  if (pid < 0) {
    const int err = errno;
    close(log_fd);
    return IoError(std::string("fork: ") + std::strerror(err));
  }
  if (pid == 0) {
    // Only async-signal-safe calls from here on.
    setpgid(0, 0);  // A terminal's Ctrl-C reaches us alone; we stop the launcher in order.
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != parent) _exit(125);
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);  // We block SIGINT/SIGTERM for sigwait; undo.
    signal(SIGPIPE, SIG_DFL);
    const int null_fd = open("/dev/null", O_RDONLY);
    if (null_fd >= 0) dup2(null_fd, 0);
    dup2(log_fd, 1);
    dup2(log_fd, 2);
    execv(argv[0], argv.data());
    const char msg[] = "fmoe-bench: exec of the launcher failed\n";
    ssize_t ignored = write(2, msg, sizeof(msg) - 1);
    (void)ignored;
    _exit(127);
  }
  close(log_fd);
  std::unique_ptr<LaunchedCluster> c(new LaunchedCluster());
  c->pid_ = pid;
  c->router_port_ = listen->port;
  c->log_path_ = log_path;
  c->run_dir_ = manifest.launcher.run_dir;
  return c;
}

LaunchedCluster::~LaunchedCluster() {
  Status ignored = Stop(10);
  (void)ignored;
}

bool LaunchedCluster::Reap(bool wait_a_little) {
  if (reaped_ || pid_ < 0) return true;
  for (int i = 0; i < (wait_a_little ? 5 : 1); ++i) {
    int status = 0;
    const pid_t r = waitpid(pid_, &status, WNOHANG);
    if (r == pid_ || (r < 0 && errno == ECHILD)) {
      reaped_ = true;
      ExitInfo info;
      if (r == pid_ && WIFSIGNALED(status)) {
        info.signaled = true;
        info.code = WTERMSIG(status);
      } else if (r == pid_) {
        info.code = WEXITSTATUS(status);
      }
      exit_ = info.Describe();
      return true;
    }
    if (wait_a_little) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

bool LaunchedCluster::Running() { return !Reap(false); }

Status LaunchedCluster::WaitReady(double timeout_s, const std::function<bool()>& stop) {
  const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                           std::chrono::duration<double>(timeout_s));
  std::string last = "no answer yet";
  for (;;) {
    if (!Running()) {
      return Unavailable("the launcher exited (" + exit_ + ") before the router was ready");
    }
    if (stop && stop()) return FailedPrecondition("interrupted while waiting for the router");
    Result<http::Response> health = http::Get("127.0.0.1", router_port_, "/health", 1000);
    if (health.ok()) {
      last = std::to_string(health->status) + " " + health->body.substr(0, 300);
      nlohmann::json j = nlohmann::json::parse(health->body, nullptr, false);
      bool ready = health->status == 200 && j.is_object();
      if (ready && j.contains("groups") && j["groups"].is_array()) {
        for (const auto& g : j["groups"]) ready = ready && g.value("alive", false);
      }
      if (ready && j.contains("map_service") && j["map_service"].is_object()) {
        ready = j["map_service"].value("alive", false);
      }
      if (ready) return Status::Ok();
    } else {
      last = health.status().message();
    }
    if (Clock::now() >= deadline) {
      return Timeout("the router on 127.0.0.1:" + std::to_string(router_port_) +
                     " was not ready (every group and the map service alive) within " +
                     Number(timeout_s) + " s; last /health: " + last);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
  }
}

std::vector<pid_t> LaunchedCluster::OrphanedChildren() const {
  std::vector<pid_t> out;
  const std::string self = std::to_string(getpid());
  DIR* proc = opendir("/proc");
  if (proc == nullptr) return out;
  while (dirent* e = readdir(proc)) {
    char* end = nullptr;
    const long pid = std::strtol(e->d_name, &end, 10);
    if (pid <= 0 || *end != '\0' || pid == pid_) continue;
    const std::vector<std::string> f = StatFields(static_cast<pid_t>(pid));
    if (f.size() > 1 && f[1] == self) out.push_back(static_cast<pid_t>(pid));
  }
  closedir(proc);
  return out;
}

Status LaunchedCluster::Stop(double timeout_s, const std::function<bool()>& hurry) {
  if (pid_ < 0) return Status::Ok();
  std::string killed;
  if (!Reap(false)) {
    kill(pid_, SIGTERM);
    const auto deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                             std::chrono::duration<double>(timeout_s));
    while (!Reap(true) && Clock::now() < deadline && !(hurry && hurry())) {
    }
    if (!Reap(false)) {
      kill(-pid_, SIGKILL);
      kill(pid_, SIGKILL);
      while (!Reap(true)) {
      }
      killed = "the launcher (pid " + std::to_string(pid_) + ") did not stop within " +
               Number(timeout_s) + " s and was killed";
    }
  }
  // The launcher stops its children before it exits; anything left (it was killed, or it lost
  // track of a child) was re-parented to us. Its children get SIGTERM when it dies; give them
  // 5 s, then SIGKILL.
  const auto grace = Clock::now() + std::chrono::seconds(5);
  std::set<pid_t> signalled;
  for (;;) {
    std::vector<pid_t> left = OrphanedChildren();
    for (pid_t p : left) waitpid(p, nullptr, WNOHANG);  // Zombies go away here.
    left = OrphanedChildren();
    if (left.empty()) break;
    const bool late = Clock::now() >= grace;
    for (pid_t p : left) {
      if (signalled.insert(p).second) kill(p, SIGTERM);
      if (late) {
        kill(p, SIGKILL);
        waitpid(p, nullptr, 0);
        killed += std::string(killed.empty() ? "" : "; ") + "process " + std::to_string(p) +
                  " was left behind and was killed";
      }
    }
    if (!late) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  pid_ = -1;
  if (!killed.empty()) return Unavailable(killed);
  return Status::Ok();
}

std::string LaunchedCluster::LogTails(int lines) const {
  std::string out = "---- " + log_path_ + " (last " + std::to_string(lines) + " lines)\n" +
                    TailFile(log_path_, lines);
  std::vector<std::string> logs;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(fs::path(run_dir_) / "logs", ec)) {
    if (e.path().extension() == ".log") logs.push_back(e.path().string());
  }
  std::sort(logs.begin(), logs.end());
  for (const std::string& log : logs) {
    out += "---- " + log + " (last " + std::to_string(lines) + " lines)\n" + TailFile(log, lines);
  }
  return out;
}

}  // namespace fmoe::bench
