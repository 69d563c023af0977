// A raw HTTP/1.1 client for integration tests: one request per connection, read to the end, the
// chunked body de-chunked; and the data: payloads of a server-sent event stream. Raw, so tests
// see exactly what the router writes (status line, headers, chunking).
#pragma once

#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace fmoe::testing {

struct HttpReply {
  int status = 0;  // 0: no answer (connection refused, closed early).
  std::string head;
  std::string body;  // De-chunked.
};

// A connected socket to 127.0.0.1:port with a 60 s receive timeout, or -1.
int ConnectLoopback(int port);
// The request text; `auth` is the Authorization header's value (none when empty); `headers`
// are more header lines, each ending in "\r\n".
std::string HttpRequestText(const std::string& method, const std::string& path,
                            const std::string& body, const std::string& auth = "",
                            const std::string& headers = "");
HttpReply HttpCall(int port, const std::string& method, const std::string& path,
                   const std::string& body = "", const std::string& auth = "",
                   const std::string& headers = "");
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
  // The raw bytes received so far.
  std::string Received();
  // Closes the connection now; the reply keeps what had arrived.
  void Leave();
  // Waits for the end (bounded by the socket's receive timeout) and returns the reply.
  HttpReply Finish();

 private:
  void Read();

  int fd_ = -1;
  std::mutex mu_;
  std::condition_variable cv_;
  std::string in_;      // GUARDED_BY(mu_): raw bytes received so far.
  bool ended_ = false;  // GUARDED_BY(mu_): the reader closed fd_.
  std::thread reader_;
};

}  // namespace fmoe::testing
