#include "common/http_probe.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "common/clock.h"

namespace fmoe {
namespace {

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) close(fd_);
  }
  int get() const { return fd_; }

 private:
  int fd_;
};

// Waits for `events` on fd until deadline; false on timeout.
bool WaitFor(int fd, short events, int64_t deadline_ms) {
  for (;;) {
    int64_t left = deadline_ms - SteadyClock::Get().NowMs();
    if (left <= 0) return false;
    pollfd p{fd, events, 0};
    int n = poll(&p, 1, static_cast<int>(left));
    if (n > 0) return true;
    if (n == 0) return false;
    if (errno != EINTR) return true;  // Let the following call report the error.
  }
}

}  // namespace

Result<HttpProbeResponse> HttpGet(const std::string& host, int port, const std::string& path,
                                  int timeout_ms) {
  const int64_t deadline = SteadyClock::Get().NowMs() + timeout_ms;
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) != 0 || !res) {
    return InvalidArgument("cannot resolve " + host);
  }
  sockaddr_in addr;
  std::memcpy(&addr, res->ai_addr, sizeof(addr));
  freeaddrinfo(res);

  Fd fd(socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (fd.get() < 0) return IoError(std::string("socket: ") + std::strerror(errno));
  const std::string where = host + ":" + std::to_string(port);
  if (connect(fd.get(), reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    if (errno != EINPROGRESS) return Unavailable(where + ": " + std::strerror(errno));
    if (!WaitFor(fd.get(), POLLOUT, deadline)) return Timeout(where + ": connect timed out");
    int err = 0;
    socklen_t len = sizeof(err);
    getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len);
    if (err != 0) return Unavailable(where + ": " + std::strerror(err));
  }

  std::string request = "GET " + path + " HTTP/1.1\r\nHost: " + where +
                        "\r\nConnection: close\r\nAccept: */*\r\n\r\n";
  size_t sent = 0;
  while (sent < request.size()) {
    if (!WaitFor(fd.get(), POLLOUT, deadline)) return Timeout(where + ": send timed out");
    ssize_t n = send(fd.get(), request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && errno != EAGAIN && errno != EINTR) {
      return Unavailable(where + ": " + std::strerror(errno));
    }
    if (n > 0) sent += static_cast<size_t>(n);
  }

  std::string raw;
  constexpr size_t kMaxResponse = 4u << 20;
  char buf[8192];
  for (;;) {
    if (!WaitFor(fd.get(), POLLIN, deadline)) return Timeout(where + ": response timed out");
    ssize_t n = recv(fd.get(), buf, sizeof(buf), 0);
    if (n == 0) break;
    if (n < 0) {
      if (errno == EAGAIN || errno == EINTR) continue;
      return Unavailable(where + ": " + std::strerror(errno));
    }
    raw.append(buf, static_cast<size_t>(n));
    if (raw.size() > kMaxResponse) return DataLoss(where + ": response larger than 4 MiB");
  }

  HttpProbeResponse out;
  if (raw.compare(0, 9, "HTTP/1.1 ") != 0 && raw.compare(0, 9, "HTTP/1.0 ") != 0) {
    return DataLoss(where + ": not an HTTP response");
  }
  out.status = std::atoi(raw.c_str() + 9);
  size_t body_at = raw.find("\r\n\r\n");
  if (out.status < 100 || body_at == std::string::npos) {
    return DataLoss(where + ": malformed HTTP response");
  }
  std::string head = raw.substr(0, body_at);
  out.body = raw.substr(body_at + 4);
  // Chunked bodies are reassembled; the probe targets answer with Content-Length or close.
  for (char& c : head) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  if (head.find("transfer-encoding: chunked") != std::string::npos) {
    std::string body;
    size_t pos = 0;
    while (pos < out.body.size()) {
      size_t eol = out.body.find("\r\n", pos);
      if (eol == std::string::npos) break;
      size_t len = std::strtoul(out.body.c_str() + pos, nullptr, 16);
      if (len == 0 || eol + 2 + len > out.body.size()) break;
      body.append(out.body, eol + 2, len);
      pos = eol + 2 + len + 2;
    }
    out.body = std::move(body);
  }
  return out;
}

}  // namespace fmoe
