#include "bench/fmoe_bench/serve_client.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string_view>

#include <nlohmann/json.hpp>

namespace fmoe::bench {
namespace {

using Json = nlohmann::json;

// An HTTP/1.1 response read incrementally: the head, then a chunked, length-delimited or
// close-delimited body, whose bytes are handed to `on_body` as they arrive.
class ResponseReader {
 public:
  enum class State { kHead, kChunkSize, kChunkData, kChunkEnd, kTrailer, kLength, kToClose, kDone };

  // Returns false on a malformed response (error() says why).
  template <class OnBody>
  bool Feed(std::string_view bytes, OnBody&& on_body) {
    buffer_.append(bytes);
    for (;;) {
      switch (state_) {
        case State::kHead: {
          const size_t end = buffer_.find("\r\n\r\n");
          if (end == std::string::npos) return true;
          if (!ParseHead(buffer_.substr(0, end))) return false;
          buffer_.erase(0, end + 4);
          break;
        }
        case State::kChunkSize: {
          const size_t eol = buffer_.find("\r\n");
          if (eol == std::string::npos) return true;
          const std::string size_text = buffer_.substr(0, buffer_.find_first_of(";\r"));
          char* end = nullptr;
          errno = 0;
          const unsigned long long n = std::strtoull(size_text.c_str(), &end, 16);
          if (size_text.empty() || end != size_text.c_str() + size_text.size() || errno != 0) {
            return Fail("bad chunk size \"" + size_text + "\"");
          }
          buffer_.erase(0, eol + 2);
          remaining_ = n;
          state_ = n == 0 ? State::kTrailer : State::kChunkData;
          break;
        }
        case State::kChunkData:
        case State::kLength: {
          if (buffer_.empty() && remaining_ > 0) return true;
          const size_t take = static_cast<size_t>(std::min<uint64_t>(remaining_, buffer_.size()));
          on_body(std::string_view(buffer_).substr(0, take));
          buffer_.erase(0, take);
          remaining_ -= take;
          if (remaining_ > 0) return true;
          state_ = state_ == State::kLength ? State::kDone : State::kChunkEnd;
          break;
        }
        case State::kChunkEnd:
          if (buffer_.size() < 2) return true;
          if (buffer_.compare(0, 2, "\r\n") != 0) return Fail("chunk not followed by CRLF");
          buffer_.erase(0, 2);
          state_ = State::kChunkSize;
          break;
        case State::kTrailer: {
          const size_t eol = buffer_.find("\r\n");
          if (eol == std::string::npos) return true;
          buffer_.erase(0, eol + 2);
          if (eol == 0) state_ = State::kDone;
          break;
        }
        case State::kToClose:
          if (!buffer_.empty()) on_body(buffer_);
          buffer_.clear();
          return true;
        case State::kDone:
          return true;
      }
    }
  }

  // The connection closed: true when that ends the body.
  bool CloseEndsBody() {
    if (state_ == State::kToClose) state_ = State::kDone;
    return state_ == State::kDone;
  }

  State state() const { return state_; }
  int status() const { return status_; }
  const std::string& error() const { return error_; }

 private:
  bool Fail(std::string what) {
    error_ = "malformed response: " + std::move(what);
    return false;
  }

  bool ParseHead(const std::string& head) {
    if (head.size() < 12 || head.compare(0, 5, "HTTP/") != 0) return Fail("no status line");
    status_ = std::atoi(head.c_str() + 9);
    if (status_ < 100 || status_ > 999) return Fail("bad status line");
    std::string lower;
    for (char c : head) lower += static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    if (lower.find("\r\ntransfer-encoding: chunked") != std::string::npos) {
      state_ = State::kChunkSize;
    } else if (size_t cl = lower.find("\r\ncontent-length:"); cl != std::string::npos) {
      remaining_ = std::strtoull(lower.c_str() + cl + 17, nullptr, 10);
      state_ = remaining_ > 0 ? State::kLength : State::kDone;
    } else {
      state_ = State::kToClose;
    }
    return true;
  }

  State state_ = State::kHead;
  std::string buffer_;
  uint64_t remaining_ = 0;
  int status_ = 0;
  std::string error_;
};

int ConnectLoopback(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  if (fd < 0) return -1;
  int one = 1;
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    close(fd);
    return -1;
  }
  return fd;
}

std::string ApiErrorMessage(const std::string& body) {
  Json j = Json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (j.is_object() && j.contains("error") && j["error"].is_object() &&
      j["error"].contains("message") && j["error"]["message"].is_string()) {
    return j["error"]["message"].get<std::string>();
  }
  return body.substr(0, 200);
}

// Applies one server-sent event's data to the result; returns true at [DONE].
bool OnEvent(const std::string& data, BenchClock::time_point at, StreamResult& r) {
  if (data == "[DONE]") return true;
  Json j = Json::parse(data, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) {
    if (r.error.empty()) r.error = "event is not JSON: " + data.substr(0, 100);
    return false;
  }
  if (auto e = j.find("error"); e != j.end()) {
    if (r.error.empty()) {
      r.error = e->is_object() && e->contains("message") && (*e)["message"].is_string()
                    ? (*e)["message"].get<std::string>()
                    : e->dump();
    }
    return false;
  }
  if (auto c = j.find("choices"); c != j.end() && c->is_array() && !c->empty()) {
    const Json& choice = (*c)[0];
    // (json::empty() is false for every string: compare the string itself.)
    if (auto t = choice.find("text");
        t != choice.end() && t->is_string() && !t->get_ref<const std::string&>().empty()) {
      if (r.content_events == 0) r.first_content = at;
      r.last_content = at;
      ++r.content_events;
    }
    if (auto f = choice.find("finish_reason"); f != choice.end() && f->is_string()) {
      r.finish_reason = f->get<std::string>();
    }
  }
  if (auto u = j.find("usage"); u != j.end() && u->is_object()) {
    r.has_usage = true;
    r.prompt_tokens = u->value("prompt_tokens", int64_t{0});
    r.completion_tokens = u->value("completion_tokens", int64_t{0});
    if (auto x = u->find("fmoe_experts"); x != u->end() && x->is_object()) {
      r.expert_hits = x->value("hits", uint64_t{0});
      r.expert_misses = x->value("misses", uint64_t{0});
      r.bytes_moved = x->value("bytes_moved", uint64_t{0});
    }
  }
  return false;
}

}  // namespace

StreamResult StreamCompletion(int port, const std::string& body, const std::string& authorization,
                              double timeout_s, const std::atomic<bool>& abort) {
  StreamResult r;
  r.sent = BenchClock::now();
  const auto deadline = r.sent + std::chrono::duration_cast<BenchClock::duration>(
                                     std::chrono::duration<double>(timeout_s));
  auto finish = [&](std::string error) {
    r.done = BenchClock::now();
    if (r.error.empty()) r.error = std::move(error);
    r.ok = r.error.empty();
    return r;
  };
  const int fd = ConnectLoopback(port);
  if (fd < 0) return finish("cannot connect to 127.0.0.1:" + std::to_string(port));
  std::string request = "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:" + std::to_string(port) +
                        "\r\nConnection: close\r\nAccept: text/event-stream\r\n"
                        "Content-Type: application/json\r\nContent-Length: " +
                        std::to_string(body.size()) + "\r\n";
  if (!authorization.empty()) request += "Authorization: " + authorization + "\r\n";
  request += "\r\n" + body;
  for (size_t sent = 0; sent < request.size();) {
    const ssize_t n = send(fd, request.data() + sent, request.size() - sent, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      close(fd);
      return finish(std::string("send failed: ") + std::strerror(errno));
    }
    sent += static_cast<size_t>(n);
  }

  ResponseReader reader;
  std::string events;      // Body bytes not yet split into events.
  std::string error_body;  // The body of a non-200 answer.
  bool done = false;
  std::string failure;
  char buf[16384];
  while (!done && failure.empty()) {
    if (abort.load()) {
      failure = "aborted (the benchmark is stopping)";
      break;
    }
    const auto now = BenchClock::now();
    if (now >= deadline) {
      failure = "no complete answer within " + std::to_string(static_cast<int>(timeout_s)) + " s";
      break;
    }
    pollfd p{fd, POLLIN, 0};
    const int ready = poll(&p, 1, 100);
    if (ready < 0 && errno != EINTR) {
      failure = std::string("poll failed: ") + std::strerror(errno);
      break;
    }
    if (ready <= 0) continue;
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) continue;
    const auto at = BenchClock::now();
    if (n <= 0) {
      if (!reader.CloseEndsBody()) {
        failure = reader.state() == ResponseReader::State::kHead
                      ? "the connection closed before an answer"
                      : "the connection closed in the middle of the answer";
      }
      break;
    }
    const bool good =
        reader.Feed(std::string_view(buf, static_cast<size_t>(n)), [&](std::string_view data) {
          if (reader.status() != 200) {
            error_body.append(data);
            return;
          }
          events.append(data);
        });
    if (!good) {
      failure = reader.error();
      break;
    }
    r.http_status = reader.status();
    // Complete events end with a blank line.
    for (size_t end; !done && (end = events.find("\n\n")) != std::string::npos;) {
      std::string data;
      size_t at_line = 0;
      while (at_line < end) {
        size_t eol = events.find('\n', at_line);
        if (eol == std::string::npos || eol > end) eol = end;
        std::string_view line(events.data() + at_line, eol - at_line);
        if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
        if (line.starts_with("data:")) {
          line.remove_prefix(5);
          if (line.starts_with(' ')) line.remove_prefix(1);
          if (!data.empty()) data += '\n';
          data.append(line);
        }
        at_line = eol + 1;
      }
      events.erase(0, end + 2);
      if (!data.empty()) done = OnEvent(data, at, r);
    }
    if (reader.state() == ResponseReader::State::kDone) break;
  }
  close(fd);
  r.http_status = reader.status();
  if (!failure.empty()) return finish(failure);
  if (r.http_status != 200) {
    return finish("HTTP " + std::to_string(r.http_status) + ": " + ApiErrorMessage(error_body));
  }
  if (!r.error.empty()) return finish("");
  if (!done) return finish("the stream ended without [DONE]");
  if (r.finish_reason.empty()) return finish("no finish_reason in the stream");
  if (!r.has_usage) return finish("no usage in the stream");
  return finish("");
}

}  // namespace fmoe::bench
