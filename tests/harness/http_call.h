// A raw HTTP/1.1 client for integration tests: one request per connection, read to the end, the
// chunked body de-chunked; and the data: payloads of a server-sent event stream. Raw, so tests
// see exactly what the router writes (status line, headers, chunking).
#pragma once

#include <string>
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

}  // namespace fmoe::testing
