// A minimal blocking HTTP/1.1 client for health probes (launcher readiness, `fmoe status`,
// tests): one request, "Connection: close", a deadline on every step. Not for serving traffic.
#pragma once

#include <string>

#include "common/status.h"

namespace fmoe {

struct HttpProbeResponse {
  int status = 0;
  std::string body;
};

// GET http://host:port/path. Errors: kUnavailable (refused, reset), kTimeout, kInvalidArgument
// (not an IPv4 literal or host name that resolves), kDataLoss (malformed response).
Result<HttpProbeResponse> HttpGet(const std::string& host, int port, const std::string& path,
                                  int timeout_ms);

}  // namespace fmoe
