// Reachability of the cluster's processes from this host, for `fmoe status` and the workers-only
// launcher's wait: a TCP connect bounded by a deadline, its failure named as an operator reads it
// ("connection refused", "timed out after 1000 ms", "no route to host"). Pure functions plus
// blocking probes that each end within their timeout; no threads, no state.
#pragma once

#include <optional>
#include <string>

#include "common/manifest.h"
#include "common/status.h"

namespace fmoe {

// The failure of a connect as an operator reads it: "connection refused", "no route to host",
// "network is unreachable", "timed out after N ms", else strerror's text in lower case.
std::string DescribeConnectError(int err, int timeout_ms);

// Opens and closes a TCP connection to host:port within timeout_ms (name resolution included
// for literal addresses; a name goes through the system resolver). Errors: kInvalidArgument
// "cannot resolve HOST", kTimeout "timed out after N ms", kUnavailable with
// DescribeConnectError's text.
Status ProbeTcp(const std::string& host, int port, int timeout_ms);

// The host and port of "tcp://HOST:PORT"; nullopt for ipc:// (and anything else).
std::optional<HostPort> TcpEndpoint(const std::string& endpoint);

}  // namespace fmoe
