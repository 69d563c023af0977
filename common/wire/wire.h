// ZeroMQ transport for the wire messages: the only file that includes libzmq. A Socket is a
// ROUTER (binds, many peers, addressed by routing id) or a DEALER (connects, one peer). Sends
// never block; every received frame goes through codec Decode, and a bad frame is counted by
// reason and dropped, never returned. A Socket belongs to one thread (ZeroMQ's rule); Context is
// thread-safe and must outlive its sockets.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"
#include "common/wire/codec.h"
#include "common/wire/curve_key.h"
#include "common/wire/messages.h"

namespace fmoe::wire {

// A new CURVE key pair (libzmq's generator, from libsodium's random source).
Result<CurveKey> NewCurveKey();
// kInvalidArgument unless `key` is a Z85 pair whose public key belongs to its secret key.
Status CheckCurveKey(const CurveKey& key);
// The cluster key of this process: every Context made afterwards authenticates with it (see
// curve_key.h), none when nullopt (the default). Set once, in main(), before any Context.
void SetDefaultCurveKey(std::optional<CurveKey> key);
std::optional<CurveKey> DefaultCurveKey();

class Context {
 public:
  // With the process's default cluster key, if one is set (SetDefaultCurveKey).
  Context();
  // With `key` (nullopt: plain sockets, open to anyone who can reach them).
  explicit Context(std::optional<CurveKey> key);
  ~Context();
  Context(const Context&) = delete;
  Context& operator=(const Context&) = delete;
  void* native();  // zmq::context_t*
  // Terminates the context, as the destructor does: every socket must be closed already (by its
  // owner thread). Blocks until the messages that sockets closed with a linger (SetLinger) left
  // queued are sent, or their linger passes. Idempotent; no socket can be opened afterwards.
  void Close();
  // Whether its tcp and ipc sockets authenticate with a cluster key (inproc needs none).
  bool curve() const;
  // Connections its bound sockets refused because the peer did not hold the cluster key.
  uint64_t curve_refused() const;
  // Why sockets cannot be opened, when its key could not be put to use; Ok otherwise.
  const Status& status() const;

 private:
  friend class SocketBase;
  // Makes `socket` (a void* libzmq socket) a CURVE server (`server`) or client with the key.
  // Throws zmq::error_t.
  void ApplyCurve(void* socket, bool server);

  struct Impl;
  std::unique_ptr<Impl> impl_;
};

enum class Role { kRouter, kDealer };

struct SocketOptions {
  // Unsent messages are discarded at close: shutdown never waits on a dead peer. Default: 0
  int linger_ms = 0;
  // Frames above this are dropped by the decoder and counted as kOversized. Default: 8 MiB
  size_t max_message_bytes = 8u << 20;
  // ZMQ_MAXMSGSIZE: above this libzmq disconnects the sender outright. Default: 4x the above
  int64_t hard_max_message_bytes = 32 << 20;
  int send_hwm = 10000;  // ZMQ_SNDHWM, messages. Default: 10000
  int recv_hwm = 10000;  // ZMQ_RCVHWM, messages. Default: 10000
  // ROUTER: a send to an unknown peer fails (kNotFound) instead of vanishing. Default: true
  bool router_mandatory = true;
  // ROUTER: a reconnecting peer with a known routing id takes the id over. Default: true
  bool router_handover = true;
  std::string routing_id;  // DEALER: our identity at the ROUTER. Default: random
  // DEALER: queue messages only on completed connections (ZMQ_IMMEDIATE), so a peer that is
  // down makes Send fail at once instead of piling up stale messages. Default: false
  bool immediate = false;
  int zmtp_heartbeat_ivl_ms = 1000;      // ZMTP-level PINGs on idle links. Default: 1000
  int zmtp_heartbeat_timeout_ms = 5000;  // Connection dropped without PONG. Default: 5000
  int reconnect_ivl_ms = 100;            // DEALER reconnect backoff start. Default: 100
  int reconnect_ivl_max_ms = 2000;       // Default: 2000
  DecodeLimits limits;                   // max_bytes is forced to max_message_bytes.
};

struct Stats {
  uint64_t sent = 0;
  uint64_t send_failed = 0;  // HWM reached, unknown peer, closed.
  uint64_t received = 0;     // Valid messages delivered.
  std::array<uint64_t, static_cast<size_t>(DropReason::kCount)> dropped{};
  uint64_t dropped_total() const;
};

template <class Message>
struct Incoming {
  std::string peer;  // Sender's routing id (ROUTER); empty for DEALER.
  Message message;
};

class SocketBase {
 public:
  virtual ~SocketBase();
  SocketBase(const SocketBase&) = delete;
  SocketBase& operator=(const SocketBase&) = delete;

  Role role() const { return role_; }
  const std::string& endpoint() const { return endpoint_; }
  const Stats& stats() const { return stats_; }
  void* native();  // zmq::socket_t*, for Poll.

  // Sends one frame as is (tests and tools). Never blocks.
  Status SendRaw(std::span<const uint8_t> frame, std::string_view peer = {});

  // Replaces SocketOptions::linger_ms from now on: how long the messages still queued when the
  // socket is closed may take to be sent (0 = dropped, -1 = forever), a wait Context::Close (or
  // the Context's destructor) does. For a last message worth flushing (a leader's goodbye).
  Status SetLinger(int ms);

 protected:
  SocketBase(Role role, std::string endpoint, const SocketOptions& options);
  Status Open(Context& context, bool bind);
  // Receives the next frame that decodes; false on timeout.
  template <class Message>
  bool ReceiveDecoded(int timeout_ms, Incoming<Message>* out);

  Role role_;
  std::string endpoint_;
  SocketOptions options_;
  Stats stats_;
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Message is WorkerMessage (router <-> worker leader) or MapMessage (rank <-> map service).
template <class Message>
class Socket : public SocketBase {
 public:
  // Errors: kInvalidArgument for a bad endpoint, kAlreadyExists when the address is in use
  // ("cannot bind tcp://127.0.0.1:5555: Address already in use"), kIoError otherwise.
  static Result<std::unique_ptr<Socket>> Bind(Context& context, Role role,
                                              const std::string& endpoint,
                                              const SocketOptions& options = {});
  static Result<std::unique_ptr<Socket>> Connect(Context& context, Role role,
                                                 const std::string& endpoint,
                                                 const SocketOptions& options = {});

  // ROUTER: `peer` is the destination routing id (required). DEALER: `peer` must be empty.
  // Never blocks: kResourceExhausted at the high-water mark, kNotFound for an unknown peer.
  Status Send(const Message& message, std::string_view peer = {});

  // Waits up to timeout_ms (0 = poll once, -1 = forever) for one valid message; nullopt when
  // none arrived in time. Invalid frames are counted in stats() and skipped.
  std::optional<Incoming<Message>> Receive(int timeout_ms);

 private:
  using SocketBase::SocketBase;
};

using WorkerSocket = Socket<WorkerMessage>;
using MapSocket = Socket<MapMessage>;

// Wakes a thread blocked in Poll from another thread (an eventfd): Notify() from any thread,
// Drain() by the polling thread once woken.
class Notifier {
 public:
  Notifier();
  ~Notifier();
  Notifier(const Notifier&) = delete;
  Notifier& operator=(const Notifier&) = delete;
  void Notify();
  void Drain();
  int fd() const { return fd_; }

 private:
  int fd_ = -1;
};

// Waits until at least one socket is readable, `notifier` (optional) is notified, or timeout_ms
// passes (-1 = forever). Sets (*readable)[i] for each readable socket and *notified. Returns the
// number of ready items; kUnavailable when interrupted by a signal (EINTR), so callers can check
// their stop flag.
Result<int> Poll(std::span<SocketBase* const> sockets, int timeout_ms, std::vector<bool>* readable,
                 Notifier* notifier = nullptr, bool* notified = nullptr);

}  // namespace fmoe::wire
