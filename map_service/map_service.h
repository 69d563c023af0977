// The map service process's core (DESIGN sections 5 and 8). The service thread owns the ROUTER
// socket, the registrations, the matchers and the expert map stores; the store writer thread
// (store_writer.h) owns RocksDB and the export/import files, so no disk write, fsync or file
// delays a directive. Ranks Register (recorded durably before the ack), heartbeat and stream
// their contexts; each context is matched against the model's MapStore by the sending rank's
// MapMatcher and the resulting PrefetchDirectives go to every live rank of the sender's group. A
// completed map waits for its model's turn, is written to RocksDB by the writer, then put in the
// store, then acknowledged (MapStored). Admin clients ask for Ping/Stats/Export/Import.
// Start() then Run() on the same thread; Run() returns when `stop` says so, after the drain.
#pragma once

#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/clock.h"
#include "common/histogram.h"
#include "common/peer_table.h"
#include "common/status.h"
#include "common/wire/messages.h"
#include "common/wire/wire.h"
#include "map_service/export_file.h"
#include "map_service/map_matcher.h"
#include "map_service/map_service_options.h"
#include "map_service/map_store.h"
#include "map_service/map_writes.h"
#include "map_service/model_registry.h"
#include "map_service/store_db.h"
#include "map_service/store_health.h"
#include "map_service/store_writer.h"

namespace fmoe {

class MapService {
 public:
  MapService(MapServiceOptions options, const Clock& clock);
  ~MapService();

  // Opens the store and binds the socket. Errors are one line, e.g.
  // "data directory /d is in use by another map service (its RocksDB lock is held)".
  Status Start();
  // Serves until stop() returns true (checked at least every 100 ms), then stops reading, gives
  // pending writes up to drain_timeout_ms (acknowledging those written), abandons the rest and
  // returns.
  void Run(const std::function<bool()>& stop);

  const MapServiceCounters& counters() const { return counters_; }
  // The Stats admin reply body (JSON object text).
  std::string StatsJson() const;
  // Stored maps of a model (0 when unknown).
  uint32_t stored_maps(uint64_t fingerprint) const { return models_.stored_maps(fingerprint); }

 private:
  struct RankState {
    std::string group;
    uint32_t rank = 0;
    uint32_t world_size = 0;
    uint64_t instance_id = 0;
    uint64_t model_fingerprint = 0;
  };

  void Turn(int timeout_ms, bool read_socket);
  void Drain();
  void Handle(const std::string& peer, const MapMessage& message);
  void OnRegister(const std::string& peer, const Register& reg);
  // `recording`: the registration's write was in flight (it counted in the model's recording).
  void OnRegistered(const std::string& peer, const Register& reg, const Status& written,
                    bool recording);
  void ReleaseHeld(const std::string& peer);
  void OnAdmin(const std::string& peer, const AdminRequest& request);
  bool FromRegistered(const std::string& peer);
  void Reply(const std::string& peer, const MapMessage& message);
  void ReplyAdmin(const std::string& peer, uint64_t id, const char* op, const std::string& path,
                  const Result<std::string>& body);
  void ExpireRanks();
  void DropPeer(const std::string& peer);
  void OnContext(const std::string& peer, const MapMessage& message);
  void SendDirectives(const std::string& group, const std::vector<PrefetchDirective>& directives);
  // Unregisters every rank serving the model (a drop); how many.
  size_t DropRanksOf(uint64_t fingerprint);

  MapServiceOptions options_;
  const Clock& clock_;
  int64_t started_ms_ = 0;
  wire::Context context_;
  std::unique_ptr<wire::MapSocket> socket_;
  // Per peer whose registration is being written: the messages it sent since, in order.
  static constexpr size_t kMaxHeldPerPeer = 1024;
  std::unordered_map<std::string, std::deque<MapMessage>> held_;
  PeerTable<RankState> ranks_;
  ModelRegistry models_;
  std::unordered_map<std::string, std::unique_ptr<MapMatcher>> matchers_;  // Per rank peer.
  std::vector<PrefetchDirective> directives_;                              // Scratch.
  MapServiceCounters counters_;
  Histogram match_us_ = Histogram::LatencyUs();   // Context received -> its directives sent.
  Histogram insert_us_ = Histogram::LatencyUs();  // Completed map -> written and stored.
  uint64_t contexts_ = 0;                         // Context messages received.
  std::vector<bool> readable_;                    // Poll's scratch.
  int64_t last_expiry_ms_ = 0;
  int64_t rate_window_start_ms_ = 0;
  uint64_t rate_window_start_count_ = 0;
  double ingest_rate_ = 0.0;  // Contexts per second over the last full 10 s window.
  // The durable work; last, so that it goes first (its completions touch the members above).
  MapWrites writes_;
};

}  // namespace fmoe
