// HTTP/1.1 server on Boost.Beast and Asio: the only file that includes Beast. Accepts
// connections, reads one request at a time per connection (keep-alive), enforces the body and
// header limits and an idle timeout, and hands parsed requests to a handler that must not
// block. Errors the server itself detects (bad framing, body too large) are answered with the
// OpenAI error object. Start() binds; Run() drives the io_context on the calling thread plus
// `threads - 1` more; Stop() may be called from any thread.
//
// A handler answers at once (HttpHandler) or later, from any thread, through an HttpResponder
// (AsyncHttpHandler): one whole response, or a chunked stream (server-sent events). While a
// request waits for its answer the connection is watched, so a client that goes away is noticed
// at once (OnClose) and its work can be cancelled.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "common/status.h"

namespace fmoe {

struct HttpRequest {
  std::string method;                          // "GET", "POST", ...
  std::string target;                          // As sent: "/v1/models?x=1".
  std::string path;                            // Without the query: "/v1/models".
  std::map<std::string, std::string> headers;  // Names lowercased.
  std::string body;
  std::string remote;  // "127.0.0.1:53210".
};

struct HttpResponse {
  int status = 200;
  std::string content_type = "application/json";
  std::string body;
  std::vector<std::pair<std::string, std::string>> headers;
};

// The OpenAI error object {"error": {"message", "type", "param", "code"}} with `status`; an
// empty `param` or `code` is null.
HttpResponse ApiError(int status, const std::string& message, const std::string& type,
                      const std::string& param, const std::string& code);

struct HttpServerOptions {
  std::string host = "127.0.0.1";    // Default: 127.0.0.1
  uint16_t port = 8000;              // Default: 8000
  size_t max_body_bytes = 1u << 20;  // Larger bodies get 413. Default: 1 MiB
  size_t max_header_bytes = 16384;   // Larger headers get 431. Default: 16 KiB
  int idle_timeout_s = 60;           // Idle keep-alive connections are closed. Default: 60
  int threads = 1;                   // io_context threads. Default: 1
};

using HttpHandler = std::function<HttpResponse(const HttpRequest&)>;

// The answer to one request. Any thread; every call is carried out on the connection's strand,
// in call order. Exactly one of: Respond, or BeginStream + Write... + End. Calls after the
// answer is complete, or after the client left, are ignored. A responder released without an
// answer sends 500.
class HttpResponder {
 public:
  virtual ~HttpResponder() = default;
  virtual void Respond(HttpResponse response) = 0;
  // Starts a chunked response, e.g. "text/event-stream".
  virtual void BeginStream(int status, const std::string& content_type,
                           std::vector<std::pair<std::string, std::string>> headers = {}) = 0;
  virtual void Write(std::string chunk) = 0;
  virtual void End() = 0;
  // `callback` runs once, on an io thread, if the client disconnects before the answer is
  // complete (at once if it already has).
  virtual void OnClose(std::function<void()> callback) = 0;
  virtual bool closed() const = 0;
  // What the request used, for the access log (a decorator records it; default: nothing).
  virtual void NoteUsage(uint32_t prompt_tokens, uint32_t completion_tokens) {
    (void)prompt_tokens;
    (void)completion_tokens;
  }
};

using AsyncHttpHandler =
    std::function<void(const HttpRequest&, std::shared_ptr<HttpResponder> responder)>;

class HttpServer {
 public:
  HttpServer(HttpServerOptions options, HttpHandler handler);
  HttpServer(HttpServerOptions options, AsyncHttpHandler handler);
  ~HttpServer();

  // Binds and listens. Error: kAlreadyExists "cannot listen on 127.0.0.1:8000: address already
  // in use", kInvalidArgument for a bad address, kIoError otherwise.
  Status Start();
  // Serves until Stop().
  void Run();
  // Stops accepting, closes idle connections and lets in-flight answers finish for up to
  // grace_ms. Answers still open then get `at_deadline` (called once on an io thread; it must
  // not block: it makes every open answer end, e.g. with an error event and [DONE]) and up to
  // final_ms to be written; then Run() returns. Without `at_deadline`, Run() returns at the end
  // of the grace period. A second call changes nothing.
  void Stop(int grace_ms = 1000, std::function<void()> at_deadline = {}, int final_ms = 2000);

  uint16_t port() const;  // The bound port (useful with port 0).

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace fmoe
