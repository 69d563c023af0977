// HTTP for the integration tests, on the project's one client (common/http_client.h): a call
// read whole (the body de-chunked, the head as received, so tests see the router's status line
// and header fields), the data: payloads of a server-sent event stream, and a request read by a
// thread of its own.
#pragma once

#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "common/http_client.h"

namespace fmoe::testing {

struct HttpReply {
  int status = 0;  // 0: no answer (connection refused, closed early).
  std::string head;
  std::string body;  // De-chunked.
};

// One request on a connection of its own; `auth` is the Authorization header's value (none when
// empty); `headers` are more header lines, each ending in "\r\n". Status 0 without an answer.
HttpReply HttpCall(int port, const std::string& method, const std::string& path,
                   const std::string& body = "", const std::string& auth = "",
                   const std::string& headers = "");
// The value of `name{group="GROUP"}` in Prometheus text (/metrics); -1 when absent.
double GroupMetric(const std::string& text, const std::string& name,
                   const std::string& group = "g0");
// The data: payloads of an event stream, in order.
std::vector<std::string> SseEvents(const std::string& sse);

// A request whose answer a thread of its own reads, so a test can wait for states of it: its
// first event (a streamed request has produced a token: it runs), or its end. Leave() closes the
// connection (the router cancels the request). The destructor leaves and joins.
class AsyncCall {
 public:
  AsyncCall(int port, const std::string& method, const std::string& path, const std::string& body,
            const std::string& auth = "");
  ~AsyncCall();
  AsyncCall(const AsyncCall&) = delete;
  AsyncCall& operator=(const AsyncCall&) = delete;

  // True once `n` data: events have arrived (within timeout_ms).
  bool WaitForEvents(size_t n, int timeout_ms);
  // True once the server has ended the answer (within timeout_ms).
  bool WaitForEnd(int timeout_ms);
  // The head and the body received so far.
  std::string Received();
  // Closes the connection now; the reply keeps what had arrived.
  void Leave();
  // Waits for the end (bounded by the socket's receive timeout) and returns the reply.
  HttpReply Finish();

 private:
  void Read();

  http::Client client_;
  http::Request request_;
  std::mutex mu_;
  std::condition_variable cv_;
  HttpReply reply_;     // GUARDED_BY(mu_): the head and the body received so far.
  bool ended_ = false;  // GUARDED_BY(mu_): the call has returned.
  std::thread reader_;
};

}  // namespace fmoe::testing
