#include "services/process.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <ctime>
#include <fstream>

namespace fmoe {

std::string ExitInfo::Describe() const {
  if (!signaled) return "exit code " + std::to_string(code);
  const char* name = strsignal(code);
  return "killed by signal " + std::to_string(code) + " (" + (name ? name : "?") + ")";
}

PosixProcessRunner::~PosixProcessRunner() {
  for (auto& [pid, fd] : ready_fds_) close(fd);
}

Result<int> PosixProcessRunner::Spawn(const ProcessSpec& spec) {
  if (spec.argv.empty()) return InvalidArgument(spec.name + ": empty command");
  int log_fd = open(spec.log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0644);
  if (log_fd < 0) {
    return IoError(spec.log_path + ": cannot open log (" + std::strerror(errno) + ")");
  }
  {
    std::time_t t = std::time(nullptr);
    char when[64];
    std::strftime(when, sizeof(when), "%Y-%m-%dT%H:%M:%S", std::localtime(&t));
    std::string banner = std::string("==== ") + when + " fmoe launcher starts " + spec.name + ":";
    for (const auto& a : spec.argv) banner += " " + a;
    banner += " ====\n";
    ssize_t ignored = write(log_fd, banner.data(), banner.size());
    (void)ignored;
  }
  int pipe_fds[2];
  if (pipe2(pipe_fds, O_CLOEXEC) != 0) {
    close(log_fd);
    return IoError(std::string("pipe: ") + std::strerror(errno));
  }
  // Everything the child needs is prepared before fork: after it, only async-signal-safe calls.
  std::vector<std::string> args = spec.argv;
  args.push_back("--ready-fd");
  args.push_back("3");
  std::vector<char*> argv;
  for (auto& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);
  const pid_t parent = getpid();

  pid_t pid = fork();
  if (pid < 0) {
    int err = errno;
    close(log_fd);
    close(pipe_fds[0]);
    close(pipe_fds[1]);
    return IoError(std::string("fork: ") + std::strerror(err));
  }
  if (pid == 0) {
    setpgid(0, 0);
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != parent) _exit(125);  // The launcher died before prctl took effect.
    sigset_t none;
    sigemptyset(&none);
    sigprocmask(SIG_SETMASK, &none, nullptr);  // The launcher blocks SIGINT/SIGTERM; undo.
    signal(SIGPIPE, SIG_DFL);
    int null_fd = open("/dev/null", O_RDONLY);
    if (null_fd >= 0) dup2(null_fd, 0);
    dup2(log_fd, 1);
    dup2(log_fd, 2);
    if (pipe_fds[1] == 3) {
      fcntl(3, F_SETFD, 0);
    } else {
      dup2(pipe_fds[1], 3);
    }
    execv(argv[0], argv.data());
    const char msg[] = "fmoe launcher: exec failed: ";
    ssize_t ignored = write(2, msg, sizeof(msg) - 1);
    const char* err = strerror(errno);
    ignored = write(2, err, strlen(err));
    ignored = write(2, "\n", 1);
    (void)ignored;
    _exit(127);
  }
  close(log_fd);
  close(pipe_fds[1]);
  fcntl(pipe_fds[0], F_SETFL, O_NONBLOCK);
  ready_fds_[pid] = pipe_fds[0];
  return static_cast<int>(pid);
}

bool PosixProcessRunner::CheckReady(int pid) {
  auto it = ready_fds_.find(pid);
  if (it == ready_fds_.end()) return false;
  char buf[16];
  ssize_t n = read(it->second, buf, sizeof(buf));
  if (n > 0) {
    close(it->second);
    ready_fds_.erase(it);
    return true;
  }
  return false;
}

std::optional<ExitInfo> PosixProcessRunner::Reap(int pid) {
  int status = 0;
  pid_t r = waitpid(pid, &status, WNOHANG);
  if (r != pid) return std::nullopt;
  if (auto it = ready_fds_.find(pid); it != ready_fds_.end()) {
    close(it->second);
    ready_fds_.erase(it);
  }
  ExitInfo info;
  if (WIFSIGNALED(status)) {
    info.signaled = true;
    info.code = WTERMSIG(status);
  } else {
    info.code = WEXITSTATUS(status);
  }
  return info;
}

void PosixProcessRunner::Signal(int pid, int signal) {
  if (pid > 0) kill(pid, signal);
}

std::string LastLogLine(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return "";
  in.seekg(0, std::ios::end);
  std::streamoff size = in.tellg();
  std::streamoff from = size > 65536 ? size - 65536 : 0;
  in.seekg(from);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  size_t end = text.find_last_not_of("\r\n \t");
  if (end == std::string::npos) return "";
  size_t start = text.rfind('\n', end);
  return text.substr(start == std::string::npos ? 0 : start + 1,
                     end - (start == std::string::npos ? 0 : start + 1) + 1);
}

}  // namespace fmoe
