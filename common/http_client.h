// The one HTTP/1.1 client of fmoe, on Boost.Beast: for the launcher's readiness probe and
// `fmoe status`, `fmoe-bench serve`, `http_load` and the integration tests (the router's server
// is the only other HTTP code). Blocking calls, each bounded by a deadline over its whole
// exchange; the connection is kept alive between calls unless either side says close; a body is
// read whole or handed over piece by piece as it arrives (sized, chunked or ended by close; always
// de-chunked); a response above the body limit is refused. Beast stays in http_client.cc.
#pragma once

#include <atomic>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/status.h"

namespace fmoe::http {

struct Request {
  std::string method = "GET";
  std::string target = "/";
  // More header fields. The client sets Host, Content-Length and, when the connection is not
  // kept, "Connection: close"; a body without a Content-Type here is sent as application/json.
  std::vector<std::pair<std::string, std::string>> headers;
  std::string body;
};

struct Response {
  int status = 0;
  // The status line and each header line as received, each ending in "\r\n".
  std::string head;
  std::vector<std::pair<std::string, std::string>> fields;
  std::string body;  // De-chunked; empty when the body went to a BodyFn.

  // The first value of the field named `name` (any case), or "" when there is none.
  std::string Field(std::string_view name) const;
};

struct ClientOptions {
  int connect_timeout_ms = 5000;
  bool keep_alive = true;
  size_t max_body_bytes = size_t{64} << 20;
  // When set, the call in progress ends (kUnavailable, "cancelled") within ~50 ms of it
  // becoming true, as after Cancel().
  const std::atomic<bool>* abort = nullptr;
};

// A piece of the body as it arrives (de-chunked), with the response's head. Returning false stops
// reading: the call returns the response (without the rest of the body) and closes the connection.
using BodyFn = std::function<bool(const Response& head, std::string_view piece)>;

// A connection to host:port, opened at the first call and kept while both sides allow. Not
// thread-safe, except Cancel().
//
// Errors of Call and Stream: kInvalidArgument (the host does not resolve), kUnavailable
// (refused, reset, closed before a complete answer, cancelled), kTimeout (the deadline passed),
// kDataLoss (not HTTP, or a body above the limit). A request on a kept connection that the server
// had closed meanwhile is sent once more on a new one.
class Client {
 public:
  Client(std::string host, int port, ClientOptions options = {});
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // Sends `request` and reads the whole response within timeout_ms.
  Result<Response> Call(const Request& request, int timeout_ms);
  // As Call, the body handed to on_body as it arrives.
  Result<Response> Stream(const Request& request, int timeout_ms, const BodyFn& on_body);
  // Thread-safe: ends the call in progress within ~50 ms, and every later one at once, with
  // kUnavailable; the connection is closed.
  void Cancel();
  // Closes the kept connection (the next call opens another).
  void Close();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// One request on a connection of its own ("Connection: close").
Result<Response> Fetch(const std::string& host, int port, const Request& request, int timeout_ms);
// GET path, on a connection of its own.
Result<Response> Get(const std::string& host, int port, const std::string& path, int timeout_ms);

// Server-sent events: Feed takes body bytes as they come and returns the data of each event they
// complete (its data: lines joined by "\n"); comments, other fields and data-less events are
// skipped. Lines may end in "\n" or "\r\n".
class SseReader {
 public:
  std::vector<std::string> Feed(std::string_view bytes);

 private:
  std::string pending_;  // Bytes of the line not yet complete.
  std::string data_;     // The data of the event being read.
  bool has_data_ = false;
};

}  // namespace fmoe::http
