// Tests of common/wire over real ZeroMQ on tcp://127.0.0.1 (ports picked by the OS via ":*"):
// ROUTER <-> DEALER round trips, Poll, bad frames dropped and counted by reason while later valid
// messages still arrive, send errors (unknown peer, high-water mark) and bind errors. The one
// multipart frame is sent through the DEALER's native zmq socket: our API only sends one part.
#include "common/wire/wire.h"

#include <chrono>
#include <cstring>
#include <memory>
#include <random>

#include <gtest/gtest.h>
#include <zmq.hpp>

namespace fmoe::wire {
namespace {

using std::chrono::steady_clock;

constexpr int kWaitMs = 5000;  // Upper bound for a delivery on loopback; normally < 10 ms.
constexpr char kLoopbackAnyPort[] = "tcp://127.0.0.1:*";

template <class Message>
std::unique_ptr<Socket<Message>> MustBind(Context& ctx, Role role, const std::string& endpoint,
                                          const SocketOptions& options = {}) {
  auto r = Socket<Message>::Bind(ctx, role, endpoint, options);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return r.ok() ? std::move(r).value() : nullptr;
}

template <class Message>
std::unique_ptr<Socket<Message>> MustConnect(Context& ctx, Role role, const std::string& endpoint,
                                             const SocketOptions& options = {}) {
  auto r = Socket<Message>::Connect(ctx, role, endpoint, options);
  EXPECT_TRUE(r.ok()) << r.status().ToString();
  return r.ok() ? std::move(r).value() : nullptr;
}

SocketOptions WithId(std::string id) {
  SocketOptions o;
  o.routing_id = std::move(id);
  return o;
}

WorkerHello Hello(std::string group) {
  WorkerHello h;
  h.group = std::move(group);
  h.model_name = "tiny";
  h.free_slots = 4;
  return h;
}

TEST(Wire, BindAnyPortReportsRealEndpoint) {
  Context ctx;
  auto router = MustBind<WorkerMessage>(ctx, Role::kRouter, kLoopbackAnyPort);
  ASSERT_NE(router, nullptr);
  EXPECT_EQ(router->role(), Role::kRouter);
  EXPECT_TRUE(router->endpoint().starts_with("tcp://127.0.0.1:")) << router->endpoint();
  EXPECT_FALSE(router->endpoint().ends_with(":*")) << router->endpoint();
}

TEST(Wire, WorkerChannelRoundTripBothWays) {
  Context ctx;
  auto router = MustBind<WorkerMessage>(ctx, Role::kRouter, kLoopbackAnyPort);
  ASSERT_NE(router, nullptr);
  auto dealer =
      MustConnect<WorkerMessage>(ctx, Role::kDealer, router->endpoint(), WithId("leader-g0"));
  ASSERT_NE(dealer, nullptr);

  ASSERT_TRUE(dealer->Send(Hello("g0")).ok());
  auto in = router->Receive(kWaitMs);
  ASSERT_TRUE(in.has_value());
  EXPECT_EQ(in->peer, "leader-g0");
  ASSERT_TRUE(std::holds_alternative<WorkerHello>(in->message));
  EXPECT_EQ(std::get<WorkerHello>(in->message).group, "g0");
  EXPECT_EQ(std::get<WorkerHello>(in->message).free_slots, 4u);

  Generate g;
  g.request_id = 7;
  g.token_ids = {1, 2, 3};
  ASSERT_TRUE(router->Send(g, in->peer).ok());
  auto back = dealer->Receive(kWaitMs);
  ASSERT_TRUE(back.has_value());
  EXPECT_TRUE(back->peer.empty());
  ASSERT_TRUE(std::holds_alternative<Generate>(back->message));
  EXPECT_EQ(std::get<Generate>(back->message).token_ids, g.token_ids);

  EXPECT_EQ(dealer->stats().sent, 1u);
  EXPECT_EQ(dealer->stats().received, 1u);
  EXPECT_EQ(router->stats().sent, 1u);
  EXPECT_EQ(router->stats().received, 1u);
  EXPECT_EQ(router->stats().dropped_total(), 0u);
}

TEST(Wire, MapChannelRoundTripWithRandomRoutingId) {
  Context ctx;
  auto service = MustBind<MapMessage>(ctx, Role::kRouter, kLoopbackAnyPort);
  ASSERT_NE(service, nullptr);
  auto rank = MustConnect<MapMessage>(ctx, Role::kDealer, service->endpoint());
  ASSERT_NE(rank, nullptr);

  LayerObserved lo;
  lo.request_id = 3;
  lo.layer = 5;
  lo.probs = {0.25f, 0.75f};
  ASSERT_TRUE(rank->Send(lo).ok());
  auto in = service->Receive(kWaitMs);
  ASSERT_TRUE(in.has_value());
  EXPECT_EQ(in->peer.size(), 16u) << in->peer;  // Random hex id.
  ASSERT_TRUE(std::holds_alternative<LayerObserved>(in->message));
  EXPECT_EQ(std::get<LayerObserved>(in->message).probs, lo.probs);

  PrefetchDirective pd;
  pd.request_id = 3;
  pd.target_layer = 6;
  pd.entries = {{9, 0.5f, 1.0f}};
  ASSERT_TRUE(service->Send(pd, in->peer).ok());
  auto back = rank->Receive(kWaitMs);
  ASSERT_TRUE(back.has_value());
  ASSERT_TRUE(std::holds_alternative<PrefetchDirective>(back->message));
  EXPECT_EQ(std::get<PrefetchDirective>(back->message).entries.at(0).expert, 9u);
}

TEST(Wire, ReceiveTimesOut) {
  Context ctx;
  auto router = MustBind<WorkerMessage>(ctx, Role::kRouter, kLoopbackAnyPort);
  ASSERT_NE(router, nullptr);
  EXPECT_FALSE(router->Receive(0).has_value());
  const auto start = steady_clock::now();
  EXPECT_FALSE(router->Receive(50).has_value());
  EXPECT_GE(steady_clock::now() - start, std::chrono::milliseconds(45));
}

TEST(Wire, PollReportsReadableSockets) {
  Context ctx;
  auto a = MustBind<WorkerMessage>(ctx, Role::kRouter, kLoopbackAnyPort);
  auto b = MustBind<MapMessage>(ctx, Role::kRouter, kLoopbackAnyPort);
  ASSERT_NE(a, nullptr);
  ASSERT_NE(b, nullptr);
  auto dealer = MustConnect<MapMessage>(ctx, Role::kDealer, b->endpoint());
  ASSERT_NE(dealer, nullptr);

  std::vector<SocketBase*> sockets = {a.get(), b.get()};
  std::vector<bool> readable;
  auto n = Poll(sockets, 0, &readable);
  ASSERT_TRUE(n.ok()) << n.status().ToString();
  EXPECT_EQ(*n, 0);

  IterationEnd end;
  end.request_id = 1;
  ASSERT_TRUE(dealer->Send(end).ok());
  n = Poll(sockets, kWaitMs, &readable);
  ASSERT_TRUE(n.ok()) << n.status().ToString();
  EXPECT_EQ(*n, 1);
  ASSERT_EQ(readable.size(), 2u);
  EXPECT_FALSE(readable[0]);
  EXPECT_TRUE(readable[1]);
  EXPECT_TRUE(b->Receive(0).has_value());
}

// Each kind of bad frame is dropped and counted by reason; a valid message after them arrives.
TEST(Wire, BadFramesAreDroppedAndCounted) {
  Context ctx;
  SocketOptions router_options;
  router_options.max_message_bytes = 4096;
  router_options.hard_max_message_bytes = 64 * 1024;
  auto router = MustBind<WorkerMessage>(ctx, Role::kRouter, kLoopbackAnyPort, router_options);
  ASSERT_NE(router, nullptr);
  auto dealer = MustConnect<WorkerMessage>(ctx, Role::kDealer, router->endpoint());
  ASSERT_NE(dealer, nullptr);

  std::mt19937 rng(7);
  std::vector<uint8_t> garbage(200);
  for (uint8_t& b : garbage) b = static_cast<uint8_t>(rng());
  std::memcpy(garbage.data() + 4, kWorkerIdentifier, 4);
  const uint32_t root = 0x00ffff00;  // Far outside the frame.
  std::memcpy(garbage.data(), &root, 4);
  ASSERT_TRUE(dealer->SendRaw(garbage).ok());  // kMalformed

  const std::vector<uint8_t> truncated = {1, 2, 3};
  ASSERT_TRUE(dealer->SendRaw(truncated).ok());  // kTruncated

  Generate big;
  big.token_ids.assign(2000, 5);  // ~8 KB: above max_message_bytes, below the hard limit.
  ASSERT_TRUE(dealer->SendRaw(Encode(WorkerMessage(big))).ok());  // kOversized

  IterationEnd map_message;
  ASSERT_TRUE(dealer->SendRaw(Encode(MapMessage(map_message))).ok());  // kBadIdentifier

  WorkerHello future = Hello("g0");
  future.protocol_version = kProtocolVersion + 1;
  ASSERT_TRUE(dealer->Send(future).ok());  // kOutOfRange

  // Two parts from the DEALER arrive as three at the ROUTER: kBadFraming.
  auto* raw = static_cast<zmq::socket_t*>(dealer->native());
  const std::vector<uint8_t> valid = Encode(WorkerMessage(Hello("g0")));
  ASSERT_TRUE(raw->send(zmq::buffer(valid), zmq::send_flags::sndmore).has_value());
  ASSERT_TRUE(raw->send(zmq::buffer(valid), zmq::send_flags::none).has_value());

  ASSERT_TRUE(dealer->Send(Hello("after")).ok());
  auto in = router->Receive(kWaitMs);
  ASSERT_TRUE(in.has_value());
  ASSERT_TRUE(std::holds_alternative<WorkerHello>(in->message));
  EXPECT_EQ(std::get<WorkerHello>(in->message).group, "after");

  const Stats& s = router->stats();
  auto dropped = [&](DropReason r) { return s.dropped[static_cast<size_t>(r)]; };
  EXPECT_EQ(dropped(DropReason::kMalformed), 1u);
  EXPECT_EQ(dropped(DropReason::kTruncated), 1u);
  EXPECT_EQ(dropped(DropReason::kOversized), 1u);
  EXPECT_EQ(dropped(DropReason::kBadIdentifier), 1u);
  EXPECT_EQ(dropped(DropReason::kOutOfRange), 1u);
  EXPECT_EQ(dropped(DropReason::kBadFraming), 1u);
  EXPECT_EQ(s.dropped_total(), 6u);
  EXPECT_EQ(s.received, 1u);
  EXPECT_FALSE(router->Receive(0).has_value());
}

TEST(Wire, DealerDropsBadFramesFromRouter) {
  Context ctx;
  auto router = MustBind<MapMessage>(ctx, Role::kRouter, kLoopbackAnyPort);
  ASSERT_NE(router, nullptr);
  auto dealer = MustConnect<MapMessage>(ctx, Role::kDealer, router->endpoint(), WithId("rank0"));
  ASSERT_NE(dealer, nullptr);
  RankHeartbeat hb;
  hb.group = "g";
  ASSERT_TRUE(dealer->Send(hb).ok());
  ASSERT_TRUE(router->Receive(kWaitMs).has_value());

  ASSERT_TRUE(router->SendRaw(std::vector<uint8_t>{0, 0}, "rank0").ok());
  ASSERT_TRUE(router->SendRaw(Encode(WorkerMessage(Cancel{})), "rank0").ok());
  RankHeartbeatAck ack;
  ack.seq = 11;
  ASSERT_TRUE(router->Send(ack, "rank0").ok());
  auto in = dealer->Receive(kWaitMs);
  ASSERT_TRUE(in.has_value());
  EXPECT_EQ(std::get<RankHeartbeatAck>(in->message).seq, 11u);
  EXPECT_EQ(dealer->stats().dropped[static_cast<size_t>(DropReason::kTruncated)], 1u);
  EXPECT_EQ(dealer->stats().dropped[static_cast<size_t>(DropReason::kBadIdentifier)], 1u);
}

TEST(Wire, RouterSendToUnknownPeerIsNotFound) {
  Context ctx;
  auto router = MustBind<WorkerMessage>(ctx, Role::kRouter, kLoopbackAnyPort);
  ASSERT_NE(router, nullptr);
  const Status s = router->Send(Cancel{}, "nobody");
  EXPECT_EQ(s.code(), ErrorCode::kNotFound) << s.ToString();
  EXPECT_NE(s.message().find("nobody"), std::string::npos) << s.message();
  EXPECT_EQ(router->stats().send_failed, 1u);
  EXPECT_EQ(router->stats().sent, 0u);
}

TEST(Wire, PeerArgumentChecked) {
  Context ctx;
  auto router = MustBind<WorkerMessage>(ctx, Role::kRouter, kLoopbackAnyPort);
  ASSERT_NE(router, nullptr);
  auto dealer = MustConnect<WorkerMessage>(ctx, Role::kDealer, router->endpoint());
  ASSERT_NE(dealer, nullptr);
  EXPECT_EQ(router->Send(Cancel{}).code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(dealer->Send(Cancel{}, "someone").code(), ErrorCode::kInvalidArgument);
}

// A manifest address of another host (192.0.2.1, TEST-NET-1): named as such.
TEST(Wire, BindAnAddressOfAnotherHost) {
  Context ctx;
  auto socket = WorkerSocket::Bind(ctx, Role::kRouter, "tcp://192.0.2.1:5555");
  ASSERT_FALSE(socket.ok());
  EXPECT_EQ(socket.status().code(), ErrorCode::kInvalidArgument);
  EXPECT_EQ(socket.status().message(),
            "cannot bind tcp://192.0.2.1:5555: Cannot assign requested address (not an address "
            "of this host)");
}

TEST(Wire, BindAddressInUse) {
  Context ctx;
  auto first = MustBind<WorkerMessage>(ctx, Role::kRouter, kLoopbackAnyPort);
  ASSERT_NE(first, nullptr);
  auto second = WorkerSocket::Bind(ctx, Role::kRouter, first->endpoint());
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), ErrorCode::kAlreadyExists);
  EXPECT_EQ(second.status().message(),
            "cannot bind " + first->endpoint() + ": Address already in use");
}

TEST(Wire, BadEndpointsAreInvalidArgument) {
  Context ctx;
  for (const char* endpoint : {"", "127.0.0.1:5555", "udp://127.0.0.1:5555", "tcp://127.0.0.1",
                               "tcp://127.0.0.1:notaport"}) {
    auto bound = MapSocket::Bind(ctx, Role::kRouter, endpoint);
    ASSERT_FALSE(bound.ok()) << endpoint;
    EXPECT_EQ(bound.status().code(), ErrorCode::kInvalidArgument) << bound.status().ToString();
    EXPECT_NE(bound.status().message().find(endpoint), std::string::npos)
        << bound.status().message();
  }
  auto connected = MapSocket::Connect(ctx, Role::kDealer, "nope://x");
  ASSERT_FALSE(connected.ok());
  EXPECT_EQ(connected.status().code(), ErrorCode::kInvalidArgument);
}

// With no peer the DEALER queues up to its HWM, then fails fast instead of blocking.
TEST(Wire, DealerAtHighWaterMarkIsResourceExhausted) {
  Context ctx;
  std::string endpoint;
  {
    auto probe = MustBind<MapMessage>(ctx, Role::kRouter, kLoopbackAnyPort);
    ASSERT_NE(probe, nullptr);
    endpoint = probe->endpoint();
  }  // Closed: nobody listens there now.
  SocketOptions options;
  options.send_hwm = 4;
  auto dealer = MustConnect<MapMessage>(ctx, Role::kDealer, endpoint, options);
  ASSERT_NE(dealer, nullptr);
  const auto start = steady_clock::now();
  Status s;
  int accepted = 0;
  for (int i = 0; i < 1000; ++i) {
    IterationEnd end;
    end.request_id = static_cast<uint64_t>(i);
    s = dealer->Send(end);
    if (!s.ok()) break;
    ++accepted;
  }
  EXPECT_EQ(s.code(), ErrorCode::kResourceExhausted) << s.ToString();
  EXPECT_GE(accepted, 1);
  EXPECT_LE(accepted, 100);
  EXPECT_EQ(dealer->stats().send_failed, 1u);
  EXPECT_LT(steady_clock::now() - start, std::chrono::seconds(1));
}

}  // namespace
}  // namespace fmoe::wire
