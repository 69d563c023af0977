// The reachability probe: its failures named as an operator reads them, and its bound.
#include "services/reach.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

namespace fmoe {
namespace {

// A listening socket on 127.0.0.1 at a port of the OS's choice.
class Listener {
 public:
  Listener() {
    fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(bind(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    EXPECT_EQ(listen(fd_, 4), 0);
    socklen_t len = sizeof(addr);
    getsockname(fd_, reinterpret_cast<sockaddr*>(&addr), &len);
    port_ = ntohs(addr.sin_port);
  }
  ~Listener() { close(fd_); }
  int port() const { return port_; }

 private:
  int fd_ = -1;
  int port_ = 0;
};

TEST(DescribeConnectError, NamesTheCommonFailures) {
  EXPECT_EQ(DescribeConnectError(ECONNREFUSED, 1000), "connection refused");
  EXPECT_EQ(DescribeConnectError(EHOSTUNREACH, 1000), "no route to host");
  EXPECT_EQ(DescribeConnectError(ENETUNREACH, 1000), "network is unreachable");
  EXPECT_EQ(DescribeConnectError(ETIMEDOUT, 250), "timed out after 250 ms");
  EXPECT_EQ(DescribeConnectError(EACCES, 1000), "permission denied");
}

TEST(ProbeTcp, ReachesAListenerAndNamesARefusal) {
  int closed_port = 0;
  {
    Listener listener;
    EXPECT_TRUE(ProbeTcp("127.0.0.1", listener.port(), 1000).ok());
    closed_port = listener.port();
  }
  // The port just closed: nobody listens there now.
  Status refused = ProbeTcp("127.0.0.1", closed_port, 1000);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.code(), ErrorCode::kUnavailable);
  EXPECT_EQ(refused.message(), "connection refused");
}

TEST(ProbeTcp, APeerThatNeverAnswersTimesOutAtTheBound) {
  // A listener that never accepts, its accept queue full: the kernel drops later SYNs, as a
  // firewall that drops the port does.
  const int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(listen(fd, 0), 0);
  socklen_t len = sizeof(addr);
  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  const int port = ntohs(addr.sin_port);
  std::vector<int> fillers;
  Status s;
  // Fill the queue: each probe that connects takes a slot until one no longer can.
  for (int i = 0; i < 16; ++i) {
    const int c = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    connect(c, reinterpret_cast<sockaddr*>(&addr), sizeof(addr));
    fillers.push_back(c);
    const auto start = std::chrono::steady_clock::now();
    s = ProbeTcp("127.0.0.1", port, 300);
    const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                        std::chrono::steady_clock::now() - start)
                        .count();
    EXPECT_LT(ms, 2000);
    if (!s.ok()) break;
  }
  for (int c : fillers) close(c);
  close(fd);
  ASSERT_FALSE(s.ok()) << "the accept queue never filled";
  EXPECT_EQ(s.code(), ErrorCode::kTimeout) << s.ToString();
  EXPECT_EQ(s.message(), "timed out after 300 ms");
}

TEST(ProbeTcp, AnAddressNobodyServesEndsWithinTheBound) {
  // TEST-NET-1 (RFC 5737): never routed. Without a default route the kernel says so at once;
  // with one, the SYN goes nowhere and the probe times out.
  const auto start = std::chrono::steady_clock::now();
  Status s = ProbeTcp("192.0.2.1", 9, 300);
  const auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(
                      std::chrono::steady_clock::now() - start)
                      .count();
  ASSERT_FALSE(s.ok());
  EXPECT_LT(ms, 2000) << "the probe is bounded by its timeout";
  if (s.code() == ErrorCode::kTimeout) {
    EXPECT_EQ(s.message(), "timed out after 300 ms");
    EXPECT_GE(ms, 290);
  } else {
    EXPECT_EQ(s.code(), ErrorCode::kUnavailable) << s.ToString();
  }
}

int64_t MsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(std::chrono::steady_clock::now() -
                                                               start)
      .count();
}

// A resolver that never answers in time: a DNS server that drops the queries, as a host cut off
// from its DNS sees. It answers after 3 s, long after each test's bound.
Resolver HungResolver(std::shared_ptr<std::atomic<int>> calls) {
  return [calls](const std::string&) -> Result<std::string> {
    ++*calls;
    std::this_thread::sleep_for(std::chrono::seconds(3));
    return std::string("127.0.0.1");
  };
}

TEST(ResolveIpv4, ALiteralAddressNeedsNoResolver) {
  auto calls = std::make_shared<std::atomic<int>>(0);
  auto r = ResolveIpv4("10.0.0.2", 100, HungResolver(calls));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(*r, "10.0.0.2");
  EXPECT_EQ(calls->load(), 0);
}

TEST(ResolveIpv4, ANameGoesThroughTheSystemResolver) {
  auto r = ResolveIpv4("localhost", 5000);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->rfind("127.", 0), 0u) << *r;
  // RFC 6761: never found. The machine's DNS says so at once, or does not answer (no network):
  // either way the call ends within its bound.
  const auto start = std::chrono::steady_clock::now();
  Status missing = ResolveIpv4("no-such-host.invalid", 1000).status();
  EXPECT_LT(MsSince(start), 2500);
  ASSERT_FALSE(missing.ok());
  if (missing.code() == ErrorCode::kTimeout) {
    EXPECT_EQ(missing.message(), "resolving no-such-host.invalid timed out after 1000 ms");
  } else {
    EXPECT_EQ(missing.code(), ErrorCode::kInvalidArgument) << missing.ToString();
    EXPECT_EQ(missing.message(), "cannot resolve no-such-host.invalid");
  }
}

TEST(ResolveIpv4, AHungResolverTimesOutAtTheBoundAndRunsOnceForTheName) {
  auto calls = std::make_shared<std::atomic<int>>(0);
  for (int i = 0; i < 3; ++i) {  // As the launcher's wait probes again and again.
    const auto start = std::chrono::steady_clock::now();
    auto r = ResolveIpv4("map.cluster.hung", 200, HungResolver(calls));
    const int64_t ms = MsSince(start);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), ErrorCode::kTimeout) << r.status().ToString();
    EXPECT_EQ(r.status().message(), "resolving map.cluster.hung timed out after 200 ms");
    EXPECT_GE(ms, 190);
    EXPECT_LT(ms, 1500) << "the resolution is bounded by its timeout";
  }
  EXPECT_EQ(calls->load(), 1) << "one resolution in flight per name";
}

TEST(ProbeTcp, ANameWhoseResolverHangsTimesOutAtTheBound) {
  // `fmoe status` and the workers-only launcher's wait probe each endpoint within a timeout;
  // a DNS server that does not answer must not hold them past it.
  Listener listener;
  auto calls = std::make_shared<std::atomic<int>>(0);
  const auto start = std::chrono::steady_clock::now();
  Status s = ProbeTcp("router.cluster.hung", listener.port(), 300, HungResolver(calls));
  const int64_t ms = MsSince(start);
  ASSERT_FALSE(s.ok());
  EXPECT_EQ(s.code(), ErrorCode::kTimeout) << s.ToString();
  EXPECT_EQ(s.message(), "resolving router.cluster.hung timed out after 300 ms");
  EXPECT_LT(ms, 1500);
  // A name that resolves in time reaches the listener.
  auto quick = [](const std::string&) -> Result<std::string> { return std::string("127.0.0.1"); };
  EXPECT_TRUE(ProbeTcp("router.cluster.quick", listener.port(), 1000, quick).ok());
  EXPECT_TRUE(ProbeTcp("localhost", listener.port(), 1000).ok());
}

TEST(TcpEndpoint, ParsesTcpAndLeavesIpc) {
  auto hp = TcpEndpoint("tcp://10.0.0.1:5555");
  ASSERT_TRUE(hp.has_value());
  EXPECT_EQ(hp->host, "10.0.0.1");
  EXPECT_EQ(hp->port, 5555);
  EXPECT_FALSE(TcpEndpoint("ipc:///tmp/fmoe.sock").has_value());
  EXPECT_FALSE(TcpEndpoint("tcp://10.0.0.1").has_value());
}

}  // namespace
}  // namespace fmoe
