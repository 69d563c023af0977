// ZeroMQ transport (see wire.h); the only file that includes libzmq (through cppzmq). zmq::error_t
// is caught here and turned into Status: nothing throws out of this file. Frames are
// [routing id][payload] on a ROUTER and [payload] on a DEALER; anything else is kBadFraming.
#include "common/wire/wire.h"

#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <mutex>
#include <random>
#include <system_error>
#include <thread>
#include <utility>

#include <zmq.hpp>

#include "common/log.h"

namespace fmoe::wire {
namespace {

using SteadyClock = std::chrono::steady_clock;

// ZMQ_HEARTBEAT_TTL is carried in deciseconds in a uint16 (libzmq rejects more than this).
constexpr int kMaxHeartbeatTtlMs = 6553599;
// A warning (not one per frame) every this many drops on a socket; each drop is logged at debug.
constexpr uint64_t kDropWarnEvery = 1000;

std::string RandomRoutingId() {
  std::random_device rd;
  std::mt19937_64 gen((uint64_t{rd()} << 32) ^ rd());
  const uint64_t v = gen();
  static constexpr char kHex[] = "0123456789abcdef";
  std::string id(16, '0');
  for (int i = 0; i < 16; ++i) id[i] = kHex[(v >> (4 * (15 - i))) & 0xf];
  return id;
}

// Routing ids for logs: printable ASCII as is, anything else as \xNN.
std::string Printable(std::string_view id) {
  std::string out;
  for (unsigned char ch : id) {
    if (ch >= 0x20 && ch < 0x7f) {
      out += static_cast<char>(ch);
    } else {
      static constexpr char kHex[] = "0123456789abcdef";
      out += "\\x";
      out += kHex[ch >> 4];
      out += kHex[ch & 0xf];
    }
  }
  return out;
}

bool KnownTransport(std::string_view endpoint) {
  for (std::string_view scheme : {"tcp://", "ipc://", "inproc://"}) {
    if (endpoint.size() > scheme.size() && endpoint.substr(0, scheme.size()) == scheme) {
      return true;
    }
  }
  return false;
}

// tcp://host:* and tcp://host:0 ask the OS for a port; endpoint() then reports the real one.
bool WildcardPort(std::string_view endpoint) {
  return endpoint.ends_with(":*") || endpoint.ends_with(":0");
}

Status BindOrConnectError(const zmq::error_t& e, bool bind, const std::string& endpoint) {
  std::string m =
      std::string(bind ? "cannot bind " : "cannot connect ") + endpoint + ": " + e.what();
  if (bind && e.num() == EADDRNOTAVAIL) {
    // A manifest address of another host ("tcp://10.0.0.1:5555" on 10.0.0.2).
    m += " (not an address of this host)";
  }
  switch (e.num()) {
    case EADDRINUSE:
      return AlreadyExists(std::move(m));
    case EINVAL:
    case EPROTONOSUPPORT:
    case ENOCOMPATPROTO:
    case ENODEV:
    case EADDRNOTAVAIL:
      return InvalidArgument(std::move(m));
    case ETERM:
      return FailedPrecondition(std::move(m));
    default:
      return IoError(std::move(m));
  }
}

void ApplyOptions(zmq::socket_t& s, Role role, const SocketOptions& o, const std::string& id) {
  s.set(zmq::sockopt::linger, o.linger_ms);
  s.set(zmq::sockopt::maxmsgsize, o.hard_max_message_bytes);
  s.set(zmq::sockopt::sndhwm, o.send_hwm);
  s.set(zmq::sockopt::rcvhwm, o.recv_hwm);
  if (o.zmtp_heartbeat_ivl_ms > 0) {
    s.set(zmq::sockopt::heartbeat_ivl, o.zmtp_heartbeat_ivl_ms);
    s.set(zmq::sockopt::heartbeat_timeout, o.zmtp_heartbeat_timeout_ms);
    // The peer drops us after this long without traffic, even if our PINGs stop arriving.
    s.set(zmq::sockopt::heartbeat_ttl, std::min(o.zmtp_heartbeat_timeout_ms, kMaxHeartbeatTtlMs));
  }
  s.set(zmq::sockopt::reconnect_ivl, o.reconnect_ivl_ms);
  s.set(zmq::sockopt::reconnect_ivl_max, o.reconnect_ivl_max_ms);
  if (role == Role::kRouter) {
    s.set(zmq::sockopt::router_mandatory, o.router_mandatory);
    s.set(zmq::sockopt::router_handover, o.router_handover);
  } else {
    s.set(zmq::sockopt::routing_id, id);
    // Off: queue (up to the HWM) while not yet connected, so a restarting peer loses nothing.
    // On: queue only on completed connections, for traffic that is worthless when late.
    s.set(zmq::sockopt::immediate, o.immediate);
  }
}

}  // namespace

// ---- Context ----

namespace {

std::mutex g_default_key_mutex;
std::optional<CurveKey> g_default_key;

constexpr size_t kCurveKeyBytes = 32;
// libzmq asks the ZAP handler bound here about each CURVE handshake of the context's sockets.
constexpr char kZapEndpoint[] = "inproc://zeromq.zap.01";
constexpr char kZapDomain[] = "fmoe";
// A refused peer is logged at most this often (with the count since the last line).
constexpr auto kRefusalLogEvery = std::chrono::seconds(10);

bool Z85Decode(const std::string& z85, std::array<uint8_t, kCurveKeyBytes>* out) {
  if (z85.size() != 40) return false;
  return zmq_z85_decode(out->data(), z85.c_str()) != nullptr;
}

}  // namespace

Result<CurveKey> NewCurveKey() {
  char pub[41] = {0};
  char sec[41] = {0};
  if (zmq_curve_keypair(pub, sec) != 0) {
    return FailedPrecondition(std::string("cluster key: libzmq cannot make CURVE keys: ") +
                              zmq_strerror(zmq_errno()) + " (libzmq built without libsodium?)");
  }
  return CurveKey{pub, sec};
}

Status CheckCurveKey(const CurveKey& key) {
  std::array<uint8_t, kCurveKeyBytes> bin{};
  if (!Z85Decode(key.public_key, &bin) || !Z85Decode(key.secret_key, &bin)) {
    return InvalidArgument("cluster key: not a pair of 40-character Z85 keys");
  }
  char derived[41] = {0};
  if (zmq_curve_public(derived, key.secret_key.c_str()) != 0) {
    return FailedPrecondition(std::string("cluster key: libzmq cannot derive a CURVE key: ") +
                              zmq_strerror(zmq_errno()));
  }
  if (key.public_key != derived) {
    return InvalidArgument("cluster key: the public key does not belong to the secret key");
  }
  return Status::Ok();
}

void SetDefaultCurveKey(std::optional<CurveKey> key) {
  std::lock_guard<std::mutex> lock(g_default_key_mutex);
  g_default_key = std::move(key);
}

std::optional<CurveKey> DefaultCurveKey() {
  std::lock_guard<std::mutex> lock(g_default_key_mutex);
  return g_default_key;
}

struct Context::Impl {
  zmq::context_t context;
  std::optional<CurveKey> key;
  std::array<uint8_t, kCurveKeyBytes> public_key{};
  std::array<uint8_t, kCurveKeyBytes> secret_key{};
  Status status;
  std::thread zap;
  std::atomic<bool> zap_stop{false};
  std::atomic<uint64_t> refused{0};
  bool closed = false;

  void StartCurve(const CurveKey& k);
  void ZapLoop(zmq::socket_t socket);
  void Close();
};

// The ZAP handler (RFC 27): admits a CURVE client whose public key is the cluster's, refuses any
// other. Runs until Close; polls so that it sees the stop flag.
void Context::Impl::ZapLoop(zmq::socket_t socket) {
  uint64_t refused_since_log = 0;
  auto last_log = SteadyClock::now() - kRefusalLogEvery;
  std::string last_address;
  while (!zap_stop.load()) {
    try {
      zmq_pollitem_t item{socket.handle(), 0, ZMQ_POLLIN, 0};
      if (zmq_poll(&item, 1, 100) <= 0 || (item.revents & ZMQ_POLLIN) == 0) continue;
      // version, request id, domain, address, routing id, mechanism, credentials...
      std::vector<zmq::message_t> parts;
      do {
        parts.emplace_back();
        if (!socket.recv(parts.back(), zmq::recv_flags::dontwait)) break;
      } while (parts.back().more() && parts.size() < 16);
      while (!parts.empty() && parts.back().more()) {  // Drain a malformed, overlong request.
        zmq::message_t rest;
        if (!socket.recv(rest, zmq::recv_flags::dontwait)) break;
        parts.back() = std::move(rest);
      }
      const auto text = [&](size_t i) {
        return i < parts.size() ? parts[i].to_string() : std::string();
      };
      const bool admitted = parts.size() >= 7 && text(0) == "1.0" && text(5) == "CURVE" &&
                            parts[6].size() == kCurveKeyBytes &&
                            std::memcmp(parts[6].data(), public_key.data(), kCurveKeyBytes) == 0;
      if (!admitted) {
        refused.fetch_add(1);
        ++refused_since_log;
        last_address = text(3);
        if (SteadyClock::now() - last_log >= kRefusalLogEvery) {
          spdlog::warn(
              "wire: refused {} connection(s) from peers without the cluster key (last from {})",
              refused_since_log, last_address.empty() ? "?" : last_address);
          refused_since_log = 0;
          last_log = SteadyClock::now();
        }
      }
      const std::string reply[] = {
          "1.0", text(1), admitted ? "200" : "400", admitted ? "OK" : "not the cluster key",
          "",    ""};
      for (size_t i = 0; i < std::size(reply); ++i) {
        socket.send(zmq::buffer(reply[i]),
                    i + 1 < std::size(reply) ? zmq::send_flags::sndmore : zmq::send_flags::none);
      }
    } catch (const zmq::error_t& e) {
      if (e.num() == ETERM) break;
      spdlog::warn("wire: the cluster key's handler: {}; serving on", e.what());
    }
  }
  socket.close();
}

void Context::Impl::StartCurve(const CurveKey& k) {
  if (Status s = CheckCurveKey(k); !s.ok()) {
    status = s;
    return;
  }
  key = k;
  Z85Decode(k.public_key, &public_key);
  Z85Decode(k.secret_key, &secret_key);
  try {
    zmq::socket_t socket(context, zmq::socket_type::rep);
    socket.set(zmq::sockopt::linger, 0);
    socket.bind(kZapEndpoint);
    zap = std::thread([this, sock = std::move(socket)]() mutable { ZapLoop(std::move(sock)); });
  } catch (const zmq::error_t& e) {
    status = IoError(std::string("wire: cannot start the cluster key's handler: ") + e.what());
  } catch (const std::system_error& e) {
    status = IoError(std::string("wire: cannot start the cluster key's handler: ") + e.what());
  }
}

void Context::Impl::Close() {
  if (closed) return;
  closed = true;
  zap_stop = true;
  if (zap.joinable()) zap.join();
  context.close();
}

Context::Context() : Context(DefaultCurveKey()) {}
Context::Context(std::optional<CurveKey> key) : impl_(std::make_unique<Impl>()) {
  if (key) impl_->StartCurve(*key);
}
Context::~Context() { impl_->Close(); }
void* Context::native() { return &impl_->context; }
void Context::Close() { impl_->Close(); }
bool Context::curve() const { return impl_->key.has_value(); }
uint64_t Context::curve_refused() const { return impl_->refused.load(); }
const Status& Context::status() const { return impl_->status; }

void Context::ApplyCurve(void* socket, bool server) {
  const auto set = [socket](int option, const void* value, size_t size) {
    if (zmq_setsockopt(socket, option, value, size) != 0) throw zmq::error_t();
  };
  const Impl& k = *impl_;
  if (server) {
    const int on = 1;
    set(ZMQ_CURVE_SERVER, &on, sizeof(on));
    set(ZMQ_CURVE_SECRETKEY, k.secret_key.data(), k.secret_key.size());
    set(ZMQ_ZAP_DOMAIN, kZapDomain, std::strlen(kZapDomain));
  } else {
    set(ZMQ_CURVE_SERVERKEY, k.public_key.data(), k.public_key.size());
    set(ZMQ_CURVE_PUBLICKEY, k.public_key.data(), k.public_key.size());
    set(ZMQ_CURVE_SECRETKEY, k.secret_key.data(), k.secret_key.size());
  }
}

// ---- SocketBase ----

struct SocketBase::Impl {
  zmq::socket_t socket;
};

uint64_t Stats::dropped_total() const {
  uint64_t total = 0;
  for (uint64_t n : dropped) total += n;
  return total;
}

SocketBase::SocketBase(Role role, std::string endpoint, const SocketOptions& options)
    : role_(role), endpoint_(std::move(endpoint)), options_(options) {
  options_.limits.max_bytes = options_.max_message_bytes;
}

SocketBase::~SocketBase() = default;

void* SocketBase::native() { return impl_ ? &impl_->socket : nullptr; }

Status SocketBase::Open(Context& context, bool bind) {
  const char* verb = bind ? "bind" : "connect";
  if (!KnownTransport(endpoint_)) {
    return InvalidArgument(std::string("cannot ") + verb + " \"" + endpoint_ +
                           "\": not a tcp://host:port, ipc://path or inproc://name endpoint");
  }
  std::string routing_id = options_.routing_id;
  if (role_ == Role::kDealer) {
    if (routing_id.empty()) routing_id = RandomRoutingId();
    if (routing_id.size() > 255 || routing_id[0] == '\0') {
      return InvalidArgument("routing id \"" + Printable(routing_id) +
                             "\": must be 1-255 bytes and not start with a zero byte");
    }
  }
  if (!context.status().ok()) return context.status();
  const std::string requested = endpoint_;
  std::unique_ptr<Impl> impl;
  try {
    auto& ctx = *static_cast<zmq::context_t*>(context.native());
    impl = std::make_unique<Impl>(Impl{zmq::socket_t(
        ctx, role_ == Role::kRouter ? zmq::socket_type::router : zmq::socket_type::dealer)});
  } catch (const zmq::error_t& e) {
    return e.num() == ETERM ? FailedPrecondition("wire: context closed")
                            : IoError(std::string("wire: cannot create a socket: ") + e.what());
  }
  try {
    ApplyOptions(impl->socket, role_, options_, routing_id);
    // The cluster key (inproc has no handshake to secure). A bound socket is the CURVE server,
    // a connecting one presents the cluster's pair as its client key.
    if (context.curve() && !endpoint_.starts_with("inproc://")) {
      context.ApplyCurve(impl->socket.handle(), bind);
    }
  } catch (const zmq::error_t& e) {
    return InvalidArgument("wire: socket options for " + requested + ": " + e.what() +
                           " (check HWMs, heartbeat and reconnect intervals)");
  }
  try {
    if (bind) {
      impl->socket.bind(endpoint_);
      if (WildcardPort(endpoint_)) endpoint_ = impl->socket.get(zmq::sockopt::last_endpoint);
    } else {
      impl->socket.connect(endpoint_);
    }
    impl_ = std::move(impl);
  } catch (const zmq::error_t& e) {
    return BindOrConnectError(e, bind, requested);
  }
  spdlog::debug("wire: {} {} {}{}", role_ == Role::kRouter ? "ROUTER" : "DEALER", verb, endpoint_,
                role_ == Role::kDealer ? " as " + Printable(routing_id) : std::string());
  return Status::Ok();
}

Status SocketBase::SendRaw(std::span<const uint8_t> frame, std::string_view peer) {
  if (!impl_) return FailedPrecondition("wire: socket " + endpoint_ + " is not open");
  if (role_ == Role::kRouter && peer.empty()) {
    return InvalidArgument("wire: a ROUTER send needs the peer's routing id");
  }
  if (role_ == Role::kDealer && !peer.empty()) {
    return InvalidArgument("wire: a DEALER send takes no peer");
  }
  zmq::socket_t& s = impl_->socket;
  try {
    if (role_ == Role::kRouter) {
      // With ROUTER_MANDATORY the first part fails for an unknown peer (EHOSTUNREACH) or a full
      // pipe (EAGAIN); once it is accepted the rest of the message always is.
      if (!s.send(zmq::const_buffer(peer.data(), peer.size()),
                  zmq::send_flags::sndmore | zmq::send_flags::dontwait)) {
        ++stats_.send_failed;
        return ResourceExhausted("wire: send to peer " + Printable(peer) + " on " + endpoint_ +
                                 ": high-water mark reached");
      }
    }
    if (!s.send(zmq::const_buffer(frame.data(), frame.size()), zmq::send_flags::dontwait)) {
      ++stats_.send_failed;
      return ResourceExhausted("wire: send on " + endpoint_ + ": high-water mark reached");
    }
  } catch (const zmq::error_t& e) {
    ++stats_.send_failed;
    if (e.num() == EHOSTUNREACH) {
      return NotFound("wire: peer " + Printable(peer) + " is not connected to " + endpoint_);
    }
    if (e.num() == ETERM) return Unavailable("wire: send on " + endpoint_ + ": context closed");
    return IoError("wire: send on " + endpoint_ + ": " + e.what());
  }
  ++stats_.sent;
  return Status::Ok();
}

Status SocketBase::SetLinger(int ms) {
  if (!impl_) return FailedPrecondition("wire: socket " + endpoint_ + " is not open");
  try {
    impl_->socket.set(zmq::sockopt::linger, ms);
  } catch (const zmq::error_t& e) {
    return InvalidArgument("wire: linger " + std::to_string(ms) + " ms on " + endpoint_ + ": " +
                           e.what());
  }
  options_.linger_ms = ms;
  return Status::Ok();
}

template <class Message>
bool SocketBase::ReceiveDecoded(int timeout_ms, Incoming<Message>* out) {
  if (!impl_) return false;
  zmq::socket_t& s = impl_->socket;
  const auto deadline = SteadyClock::now() + std::chrono::milliseconds(std::max(timeout_ms, 0));
  const size_t expected_parts = role_ == Role::kRouter ? 2 : 1;
  std::array<zmq::message_t, 2> parts;
  zmq::message_t extra;
  DecodeError error;
  for (;;) {
    size_t count = 0;
    try {
      if (!s.recv(parts[0], zmq::recv_flags::dontwait)) {
        int wait_ms = -1;
        if (timeout_ms >= 0) {
          const auto left =
              std::chrono::ceil<std::chrono::milliseconds>(deadline - SteadyClock::now());
          if (left.count() <= 0) return false;
          wait_ms = static_cast<int>(left.count());
        }
        zmq_pollitem_t item{s.handle(), 0, ZMQ_POLLIN, 0};
        if (zmq_poll(&item, 1, wait_ms) < 0) return false;  // EINTR or ETERM: let the caller look.
        continue;
      }
      // The parts of one message arrive together, so draining them never waits.
      count = 1;
      bool more = parts[0].more();
      while (more) {
        zmq::message_t& dst = count < parts.size() ? parts[count] : extra;
        if (!s.recv(dst, zmq::recv_flags::dontwait)) break;
        more = dst.more();
        ++count;
      }
    } catch (const zmq::error_t& e) {
      spdlog::debug("wire: receive on {}: {}", endpoint_, e.what());
      return false;
    }
    std::string peer;
    if (role_ == Role::kRouter) peer = parts[0].to_string();
    DropReason reason = DropReason::kBadFraming;
    if (count != expected_parts) {
      error.detail = std::to_string(count) + " frames, expected " + std::to_string(expected_parts);
    } else {
      const zmq::message_t& payload = parts[expected_parts - 1];
      std::span<const uint8_t> frame(static_cast<const uint8_t*>(payload.data()), payload.size());
      if (Decode(frame, options_.limits, &out->message, &error)) {
        out->peer = std::move(peer);
        ++stats_.received;
        return true;
      }
      reason = error.reason;
    }
    ++stats_.dropped[static_cast<size_t>(reason)];
    spdlog::debug("wire: dropped frame on {} peer={}: {}: {}", endpoint_, Printable(peer),
                  DropReasonName(reason), error.detail);
    const uint64_t total = stats_.dropped_total();
    if (total == 1 || total % kDropWarnEvery == 0) {
      spdlog::warn("wire: {} invalid frame(s) dropped on {} so far; last from peer={}: {}: {}",
                   total, endpoint_, Printable(peer), DropReasonName(reason), error.detail);
    }
  }
}

// ---- Socket<Message> ----

template <class Message>
Result<std::unique_ptr<Socket<Message>>> Socket<Message>::Bind(Context& context, Role role,
                                                               const std::string& endpoint,
                                                               const SocketOptions& options) {
  std::unique_ptr<Socket> socket(new Socket(role, endpoint, options));
  FMOE_RETURN_IF_ERROR(socket->Open(context, /*bind=*/true));
  return Result<std::unique_ptr<Socket>>(std::move(socket));
}

template <class Message>
Result<std::unique_ptr<Socket<Message>>> Socket<Message>::Connect(Context& context, Role role,
                                                                  const std::string& endpoint,
                                                                  const SocketOptions& options) {
  std::unique_ptr<Socket> socket(new Socket(role, endpoint, options));
  FMOE_RETURN_IF_ERROR(socket->Open(context, /*bind=*/false));
  return Result<std::unique_ptr<Socket>>(std::move(socket));
}

template <class Message>
Status Socket<Message>::Send(const Message& message, std::string_view peer) {
  const std::vector<uint8_t> frame = Encode(message);
  return SendRaw(frame, peer);
}

template <class Message>
std::optional<Incoming<Message>> Socket<Message>::Receive(int timeout_ms) {
  Incoming<Message> in;
  if (!ReceiveDecoded(timeout_ms, &in)) return std::nullopt;
  return in;
}

template class Socket<WorkerMessage>;
template class Socket<MapMessage>;

// ---- Poll ----

Notifier::Notifier() : fd_(eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC)) {}

Notifier::~Notifier() {
  if (fd_ >= 0) close(fd_);
}

void Notifier::Notify() {
  const uint64_t one = 1;
  // EAGAIN means the counter is already non-zero: the poller will wake anyway.
  [[maybe_unused]] ssize_t n = write(fd_, &one, sizeof(one));
}

void Notifier::Drain() {
  uint64_t value = 0;
  [[maybe_unused]] ssize_t n = read(fd_, &value, sizeof(value));
}

Result<int> Poll(std::span<SocketBase* const> sockets, int timeout_ms, std::vector<bool>* readable,
                 Notifier* notifier, bool* notified) {
  std::vector<zmq_pollitem_t> items(sockets.size());
  for (size_t i = 0; i < sockets.size(); ++i) {
    auto* s = sockets[i] == nullptr ? nullptr : static_cast<zmq::socket_t*>(sockets[i]->native());
    if (s == nullptr)
      return InvalidArgument("wire: Poll: socket " + std::to_string(i) + " is not open");
    items[i] = zmq_pollitem_t{s->handle(), 0, ZMQ_POLLIN, 0};
  }
  if (notifier != nullptr) items.push_back(zmq_pollitem_t{nullptr, notifier->fd(), ZMQ_POLLIN, 0});
  const int rc = zmq_poll(items.data(), static_cast<int>(items.size()), timeout_ms);
  if (rc < 0) {
    const int err = zmq_errno();
    if (err == EINTR) return Unavailable("wire: Poll interrupted by a signal");
    if (err == ETERM) return FailedPrecondition("wire: Poll: context closed");
    return IoError(std::string("wire: Poll: ") + zmq_strerror(err));
  }
  readable->assign(sockets.size(), false);
  for (size_t i = 0; i < sockets.size(); ++i) (*readable)[i] = (items[i].revents & ZMQ_POLLIN) != 0;
  if (notifier != nullptr && notified != nullptr) {
    *notified = (items.back().revents & ZMQ_POLLIN) != 0;
  }
  return rc;
}

}  // namespace fmoe::wire
