// The map service's options and counters (map_service.h), shared by its parts: the model
// registry (model_registry.h) and the durable work (map_writes.h).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <stop_token>
#include <string>

#include "map_service/store_db.h"
#include "map_service/store_health.h"

namespace fmoe {

struct MapServiceOptions {
  std::string endpoint = "tcp://127.0.0.1:5555";  // ROUTER bind. Default: tcp://127.0.0.1:5555
  std::string data_dir;                           // Required: RocksDB directory.
  bool sync = false;                              // fsync each write. Default: false
  int store_capacity = 1000;                      // Maps per model. Default: 1000
  int prefetch_distance = 3;                      // d. Default: 3
  int heartbeat_timeout_ms = 3000;         // A rank silent this long is dropped. Default: 3000
  bool semantic = true;                    // Semantic search at iteration start. Default: on
  bool delta = true;                       // Similarity-aware expert selection. Default: on
  uint32_t max_requests_per_rank = 65536;  // In-flight requests matched per rank. Default: 65536
  uint64_t max_import_bytes = 4ull << 30;  // Largest export file Import reads. Default: 4 GiB
  // Memory all models' stores may take together (MapStore::BytesFor at store_capacity): a
  // registration or import of a model beyond it is refused, a stored model beyond it is not
  // loaded at start. Default: 4096 (MiB)
  uint64_t memory_limit_mb = 4096;
  // Disk trouble: retry backoff and log interval while the store is degraded. Default: 1 s to
  // 30 s, a line per 10 s
  StoreHealthOptions store_health;
  // Durable work pending at once: store writer jobs queued or running (map and registration
  // writes, exports, imports) plus completed maps waiting for their write. At the limit new work
  // is refused (README, "Back-pressure"). Default: 1024
  uint32_t max_pending_writes = 1024;
  int drain_timeout_ms = 2000;  // At stop, how long pending writes may still take. Default: 2000
  // The store writer thread's nice value, 0..19: its work yields the CPU to matching. Default: 10
  int writer_nice = 10;
  // Tests only: runs on the store writer before each job (StoreWriterOptions). Default: none
  std::function<void(std::stop_token)> before_store_job;
  // Tests only: write failures injected under RocksDB (StoreDbOptions). Default: none
  std::shared_ptr<StoreFaults> store_faults;
};

struct MapServiceCounters {
  uint64_t registrations = 0;
  uint64_t registrations_refused = 0;
  uint64_t ranks_expired = 0;
  uint64_t iteration_starts = 0;
  uint64_t layers_observed = 0;
  uint64_t iteration_ends = 0;
  uint64_t from_unregistered = 0;  // Context messages from a peer that has not registered.
  uint64_t contexts_invalid = 0;   // Wrong shape, out of order, unknown request.
  uint64_t contexts_refused = 0;   // Beyond max_requests_per_rank.
  uint64_t directives_sent = 0;    // Directive messages sent (one per rank of the group).
  uint64_t directives_failed = 0;  // Sends that failed (the rank's queue is full or gone).
  uint64_t maps_stored = 0;
  uint64_t maps_replaced = 0;    // Stored maps that replaced another (deduplication).
  uint64_t maps_incomplete = 0;  // Iterations that ended before every layer was observed.
  uint64_t maps_failed = 0;   // Write failures (or a degraded store): not stored nor acknowledged.
  uint64_t maps_dropped = 0;  // Not stored nor acknowledged: max_pending_writes were pending.
  uint64_t maps_abandoned = 0;  // Not stored nor acknowledged: still pending when the drain ended.
  uint64_t busy_refusals = 0;   // Registrations and admin requests refused at max_pending_writes.
  uint64_t held_dropped = 0;    // Beyond kMaxHeldPerPeer while the peer's registration was written.
  uint64_t admin_requests = 0;
  uint64_t models_dropped = 0;
};

}  // namespace fmoe
