// Reachability of the cluster's processes from this host, for `fmoe status` and the workers-only
// launcher's wait: a TCP connect bounded by a deadline, its failure named as an operator reads it
// ("connection refused", "timed out after 1000 ms", "no route to host"). Pure functions plus
// blocking probes that each end within their timeout. A host name is resolved on a thread of its
// own (getaddrinfo has no deadline), at most one per name at a time; no other state.
#pragma once

#include <functional>
#include <optional>
#include <string>

#include "common/manifest.h"
#include "common/status.h"

namespace fmoe {

// The failure of a connect as an operator reads it: "connection refused", "no route to host",
// "network is unreachable", "timed out after N ms", else strerror's text in lower case.
std::string DescribeConnectError(int err, int timeout_ms);

// Resolves a host name to one IPv4 address ("10.0.0.2"); blocking, without a deadline of its own.
// The system's: getaddrinfo. Tests pass their own to ResolveIpv4 and ProbeTcp.
using Resolver = std::function<Result<std::string>(const std::string& host)>;
Result<std::string> SystemResolve(const std::string& host);

// `host` as an IPv4 address within timeout_ms: a literal at once, without the resolver; a name
// through `resolver` (default SystemResolve) on a detached thread, waited for until the deadline.
// getaddrinfo waits on an unreachable DNS server for resolv.conf's timeout x attempts (10 s by
// default) per server; a resolution still running at the deadline is left to finish, and a
// later call for the same name waits on it instead of starting another. Errors:
// kInvalidArgument "cannot resolve HOST", kTimeout "resolving HOST timed out after N ms".
Result<std::string> ResolveIpv4(const std::string& host, int timeout_ms,
                                const Resolver& resolver = {});

// Opens and closes a TCP connection to host:port within timeout_ms, name resolution included
// (ResolveIpv4). Errors: ResolveIpv4's, kTimeout "timed out after N ms", kUnavailable with
// DescribeConnectError's text.
Status ProbeTcp(const std::string& host, int port, int timeout_ms, const Resolver& resolver = {});

// The host and port of "tcp://HOST:PORT"; nullopt for ipc:// (and anything else).
std::optional<HostPort> TcpEndpoint(const std::string& endpoint);

}  // namespace fmoe
