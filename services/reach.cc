#include "services/reach.h"

#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <cstring>

namespace fmoe {

std::string DescribeConnectError(int err, int timeout_ms) {
  switch (err) {
    case ECONNREFUSED:
      return "connection refused";
    case EHOSTUNREACH:
      return "no route to host";
    case ENETUNREACH:
      return "network is unreachable";
    case ETIMEDOUT:
    case EINPROGRESS:
      return "timed out after " + std::to_string(timeout_ms) + " ms";
    case ECONNRESET:
      return "connection reset";
    case EADDRNOTAVAIL:
      return "address not available";
    default:
      break;
  }
  std::string text = std::strerror(err);
  if (!text.empty()) text[0] = static_cast<char>(std::tolower(static_cast<unsigned char>(text[0])));
  return text;
}

Status ProbeTcp(const std::string& host, int port, int timeout_ms) {
  const auto start = std::chrono::steady_clock::now();
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &res) != 0 || !res) {
    return InvalidArgument("cannot resolve " + host);
  }
  int fd = socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) {
    const int err = errno;
    freeaddrinfo(res);
    return IoError(std::string("socket: ") + std::strerror(err));
  }
  int rc = connect(fd, res->ai_addr, res->ai_addrlen);
  int err = rc == 0 ? 0 : errno;
  freeaddrinfo(res);
  if (rc != 0 && err == EINPROGRESS) {
    // Waits out what is left of the deadline (resolution took some of it).
    const auto spent = std::chrono::duration_cast<std::chrono::milliseconds>(
                           std::chrono::steady_clock::now() - start)
                           .count();
    const int left = static_cast<int>(std::max<int64_t>(0, timeout_ms - spent));
    pollfd p{fd, POLLOUT, 0};
    int n = 0;
    do {
      n = poll(&p, 1, left);
    } while (n < 0 && errno == EINTR);
    if (n == 0) {
      close(fd);
      return Timeout("timed out after " + std::to_string(timeout_ms) + " ms");
    }
    socklen_t len = sizeof(err);
    if (n < 0 || getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0) err = errno;
  }
  close(fd);
  if (err == 0) return Status::Ok();
  return Unavailable(DescribeConnectError(err, timeout_ms));
}

std::optional<HostPort> TcpEndpoint(const std::string& endpoint) {
  if (endpoint.rfind("tcp://", 0) != 0) return std::nullopt;
  auto hp = ParseHostPort(endpoint.substr(6));
  if (!hp.ok()) return std::nullopt;
  return *hp;
}

}  // namespace fmoe
