#include "tests/testing/http_call.h"

#include <chrono>

namespace fmoe::testing {
namespace {

// The client's answer within this long (generous: a busy 2-core machine).
constexpr int kCallTimeoutMs = 120000;

// "Name: value\r\n" lines as header fields.
std::vector<std::pair<std::string, std::string>> ParseHeaderLines(const std::string& lines) {
  std::vector<std::pair<std::string, std::string>> out;
  size_t at = 0;
  for (size_t eol; (eol = lines.find("\r\n", at)) != std::string::npos; at = eol + 2) {
    const std::string line = lines.substr(at, eol - at);
    const size_t colon = line.find(':');
    if (colon == std::string::npos) continue;
    size_t value = colon + 1;
    while (value < line.size() && line[value] == ' ') ++value;
    out.emplace_back(line.substr(0, colon), line.substr(value));
  }
  return out;
}

http::Request MakeRequest(const std::string& method, const std::string& path,
                          const std::string& body, const std::string& auth,
                          const std::string& headers) {
  http::Request r;
  r.method = method;
  r.target = path;
  r.body = body;
  if (!auth.empty()) r.headers.emplace_back("Authorization", auth);
  for (auto& field : ParseHeaderLines(headers)) r.headers.push_back(std::move(field));
  return r;
}

http::ClientOptions OneShot() {
  http::ClientOptions o;
  o.keep_alive = false;
  return o;
}

// The number of data: events in an event stream's body.
size_t CountEvents(const std::string& body) {
  size_t n = 0;
  for (size_t at = body.find("data: "); at != std::string::npos; at = body.find("data: ", at + 6)) {
    ++n;
  }
  return n;
}

}  // namespace

double GroupMetric(const std::string& text, const std::string& name, const std::string& group) {
  const std::string key = name + "{group=\"" + group + "\"} ";
  const size_t at = text.find(key);
  if (at == std::string::npos) return -1;
  return std::stod(text.substr(at + key.size(), text.find('\n', at) - at - key.size()));
}

HttpReply HttpCall(int port, const std::string& method, const std::string& path,
                   const std::string& body, const std::string& auth, const std::string& headers) {
  HttpReply r;
  auto res = http::Fetch("127.0.0.1", port, MakeRequest(method, path, body, auth, headers),
                         kCallTimeoutMs);
  if (!res.ok()) return r;
  r.status = res->status;
  r.head = std::move(res->head);
  r.body = std::move(res->body);
  return r;
}

AsyncCall::AsyncCall(int port, const std::string& method, const std::string& path,
                     const std::string& body, const std::string& auth)
    : client_("127.0.0.1", port, OneShot()), request_(MakeRequest(method, path, body, auth, "")) {
  reader_ = std::thread([this] { Read(); });
}

AsyncCall::~AsyncCall() {
  Leave();
  if (reader_.joinable()) reader_.join();
}

void AsyncCall::Read() {
  auto res = client_.Stream(request_, kCallTimeoutMs,
                            [this](const http::Response& head, std::string_view piece) {
                              std::lock_guard<std::mutex> lock(mu_);
                              reply_.status = head.status;
                              reply_.head = head.head;
                              reply_.body.append(piece);
                              cv_.notify_all();
                              return true;
                            });
  std::lock_guard<std::mutex> lock(mu_);
  if (res.ok()) {
    reply_.status = res->status;
    reply_.head = res->head;
  }
  ended_ = true;
  cv_.notify_all();
}

bool AsyncCall::WaitForEvents(size_t n, int timeout_ms) {
  std::unique_lock<std::mutex> lock(mu_);
  return cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms),
                      [&] { return CountEvents(reply_.body) >= n; });
}

bool AsyncCall::WaitForEnd(int timeout_ms) {
  std::unique_lock<std::mutex> lock(mu_);
  return cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms), [&] { return ended_; });
}

std::string AsyncCall::Received() {
  std::lock_guard<std::mutex> lock(mu_);
  return reply_.head + "\r\n" + reply_.body;
}

void AsyncCall::Leave() { client_.Cancel(); }

HttpReply AsyncCall::Finish() {
  if (reader_.joinable()) reader_.join();
  std::lock_guard<std::mutex> lock(mu_);
  return reply_;
}

std::vector<std::string> SseEvents(const std::string& sse) {
  http::SseReader reader;
  return reader.Feed(sse);
}

}  // namespace fmoe::testing
