#include "services/reach.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

namespace fmoe {
namespace {

// One resolution in flight: its thread fills `result` and wakes the waiters.
struct PendingResolution {
  std::mutex mu;
  std::condition_variable done_cv;
  std::optional<Result<std::string>> result;  // GUARDED_BY(mu)
};

// Names whose resolution is still running, so that a probe repeated every second against a
// hung DNS server starts no second thread for the same name. Never destroyed: a resolver thread
// may outlive main().
struct InFlight {
  std::mutex mu;
  std::map<std::string, std::weak_ptr<PendingResolution>> names;  // GUARDED_BY(mu)
};

InFlight& InFlightResolutions() {
  static InFlight* in_flight = new InFlight;
  return *in_flight;
}

}  // namespace

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

Result<std::string> SystemResolve(const std::string& host) {
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* res = nullptr;
  if (getaddrinfo(host.c_str(), nullptr, &hints, &res) != 0 || !res) {
    return InvalidArgument("cannot resolve " + host);
  }
  char text[INET_ADDRSTRLEN] = {};
  const auto* addr = reinterpret_cast<const sockaddr_in*>(res->ai_addr);
  const bool ok = inet_ntop(AF_INET, &addr->sin_addr, text, sizeof(text)) != nullptr;
  freeaddrinfo(res);
  if (!ok) return InvalidArgument("cannot resolve " + host);
  return std::string(text);
}

Result<std::string> ResolveIpv4(const std::string& host, int timeout_ms, const Resolver& resolver) {
  in_addr literal{};
  if (inet_pton(AF_INET, host.c_str(), &literal) == 1) return host;
  InFlight& in_flight = InFlightResolutions();
  std::shared_ptr<PendingResolution> pending;
  {
    std::lock_guard<std::mutex> lock(in_flight.mu);
    pending = in_flight.names[host].lock();
    if (!pending) {
      pending = std::make_shared<PendingResolution>();
      in_flight.names[host] = pending;
      Resolver resolve = resolver ? resolver : Resolver(SystemResolve);
      try {
        std::thread([&in_flight, pending, host, resolve = std::move(resolve)] {
          Result<std::string> r = InvalidArgument("cannot resolve " + host);
          try {
            r = resolve(host);
          } catch (...) {
          }
          {
            std::lock_guard<std::mutex> lock(in_flight.mu);
            auto it = in_flight.names.find(host);
            if (it != in_flight.names.end() && it->second.lock() == pending) {
              in_flight.names.erase(it);
            }
          }
          std::lock_guard<std::mutex> lock(pending->mu);
          pending->result = std::move(r);
          pending->done_cv.notify_all();
        }).detach();
      } catch (const std::system_error& e) {
        in_flight.names.erase(host);
        return IoError("resolving " + host + ": cannot start a thread: " + e.what());
      }
    }
  }
  std::unique_lock<std::mutex> lock(pending->mu);
  if (!pending->done_cv.wait_for(lock, std::chrono::milliseconds(std::max(0, timeout_ms)),
                                 [&] { return pending->result.has_value(); })) {
    return Timeout("resolving " + host + " timed out after " + std::to_string(timeout_ms) + " ms");
  }
  return *pending->result;
}

Status ProbeTcp(const std::string& host, int port, int timeout_ms, const Resolver& resolver) {
  const auto start = std::chrono::steady_clock::now();
  auto address = ResolveIpv4(host, timeout_ms, resolver);
  if (!address.ok()) return address.status();
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(port));
  if (inet_pton(AF_INET, address->c_str(), &sa.sin_addr) != 1) {
    return InvalidArgument("cannot resolve " + host);
  }
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (fd < 0) return IoError(std::string("socket: ") + std::strerror(errno));
  int rc = connect(fd, reinterpret_cast<const sockaddr*>(&sa), sizeof(sa));
  int err = rc == 0 ? 0 : errno;
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
