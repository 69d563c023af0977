#include "tests/harness/http_call.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>

namespace fmoe::testing {
namespace {

std::string Dechunk(const std::string& body) {
  std::string out;
  size_t at = 0;
  for (;;) {
    const size_t eol = body.find("\r\n", at);
    if (eol == std::string::npos) return out;
    const size_t n = std::stoul(body.substr(at, eol - at), nullptr, 16);
    if (n == 0) return out;
    out += body.substr(eol + 2, n);
    at = eol + 2 + n + 2;
  }
}

// The reply in raw bytes `in`, the body de-chunked; status 0 without a complete head.
HttpReply ParseReply(const std::string& in) {
  HttpReply r;
  const size_t head_end = in.find("\r\n\r\n");
  if (head_end == std::string::npos || in.size() < 12) return r;
  r.status = std::stoi(in.substr(9, 3));
  r.head = in.substr(0, head_end);
  r.body = in.substr(head_end + 4);
  if (r.head.find("Transfer-Encoding: chunked") != std::string::npos) r.body = Dechunk(r.body);
  return r;
}

// The number of data: events in raw bytes (the router writes each event as one chunk).
size_t CountEvents(const std::string& in) {
  size_t n = 0;
  for (size_t at = in.find("data: "); at != std::string::npos; at = in.find("data: ", at + 6)) {
    ++n;
  }
  return n;
}

}  // namespace

int ConnectLoopback(int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return -1;
  }
  timeval tv{60, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  return fd;
}

std::string HttpRequestText(const std::string& method, const std::string& path,
                            const std::string& body, const std::string& auth,
                            const std::string& headers) {
  return method + " " + path + " HTTP/1.1\r\nHost: test\r\nConnection: close\r\n" +
         (auth.empty() ? "" : "Authorization: " + auth + "\r\n") + headers +
         "Content-Type: application/json\r\nContent-Length: " + std::to_string(body.size()) +
         "\r\n\r\n" + body;
}

HttpReply HttpCall(int port, const std::string& method, const std::string& path,
                   const std::string& body, const std::string& auth, const std::string& headers) {
  HttpReply r;
  const int fd = ConnectLoopback(port);
  if (fd < 0) return r;
  const std::string req = HttpRequestText(method, path, body, auth, headers);
  send(fd, req.data(), req.size(), MSG_NOSIGNAL);
  std::string in;
  char buf[8192];
  for (;;) {
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n <= 0) break;
    in.append(buf, static_cast<size_t>(n));
  }
  close(fd);
  return ParseReply(in);
}

AsyncCall::AsyncCall(int port, const std::string& method, const std::string& path,
                     const std::string& body, const std::string& auth) {
  fd_ = ConnectLoopback(port);
  if (fd_ < 0) {
    ended_ = true;
    return;
  }
  const std::string req = HttpRequestText(method, path, body, auth);
  send(fd_, req.data(), req.size(), MSG_NOSIGNAL);
  reader_ = std::thread([this] { Read(); });
}

AsyncCall::~AsyncCall() {
  Leave();
  if (reader_.joinable()) reader_.join();
}

void AsyncCall::Read() {
  char buf[8192];
  for (;;) {
    const ssize_t n = recv(fd_, buf, sizeof(buf), 0);
    std::lock_guard<std::mutex> lock(mu_);
    if (n <= 0) {
      close(fd_);
      ended_ = true;
      cv_.notify_all();
      return;
    }
    in_.append(buf, static_cast<size_t>(n));
    cv_.notify_all();
  }
}

bool AsyncCall::WaitForEvents(size_t n, int timeout_ms) {
  std::unique_lock<std::mutex> lock(mu_);
  return cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms),
                      [&] { return CountEvents(in_) >= n; });
}

bool AsyncCall::WaitForEnd(int timeout_ms) {
  std::unique_lock<std::mutex> lock(mu_);
  return cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms), [&] { return ended_; });
}

std::string AsyncCall::Received() {
  std::lock_guard<std::mutex> lock(mu_);
  return in_;
}

void AsyncCall::Leave() {
  std::lock_guard<std::mutex> lock(mu_);
  // Wakes the reader's recv; the reader closes the socket (unread data makes it a reset).
  if (!ended_) shutdown(fd_, SHUT_RDWR);
}

HttpReply AsyncCall::Finish() {
  if (reader_.joinable()) reader_.join();
  std::lock_guard<std::mutex> lock(mu_);
  return ParseReply(in_);
}

std::vector<std::string> SseEvents(const std::string& sse) {
  std::vector<std::string> out;
  size_t at = 0;
  while ((at = sse.find("data: ", at)) != std::string::npos) {
    const size_t end = sse.find("\n\n", at);
    out.push_back(sse.substr(at + 6, end - at - 6));
    at = end;
  }
  return out;
}

}  // namespace fmoe::testing
