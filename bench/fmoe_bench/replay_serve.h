// The serving replay (DESIGN section 11): a ServeWorkload (replay_workload.h) run as the worker's
// engine runs requests, batched continuously, through the real expert cache
// (gpu_worker/cache/expert_cache.h) and policy over the simulated link (sim_link.h), with the map
// service's store and matcher for the fmoe policies, in simulated time (replay_time.h). Each MoE
// layer needs the union of the batch's experts and computes for the time model's time at the
// iteration's tokens once every expert it needs is resident. Cache figures are kept apart for
// iterations that hold a prefill or a chunk of one ("prefill") and those of decode steps only
// ("decode"). With a token budget per iteration, prefills run in chunks (chunked prefill). One
// thread. With `hybrid`, missing experts may be computed on the CPU (replay_hybrid.h).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "bench/fmoe_bench/replay_hybrid.h"
#include "bench/fmoe_bench/replay_time.h"
#include "bench/fmoe_bench/replay_workload.h"
#include "bench/fmoe_bench/sim_tier.h"
#include "common/status.h"
#include "gpu_worker/core/chunk_planner.h"
#include "map_service/map_store.h"

namespace fmoe::bench {

// Which requests run in each iteration, as gpu_worker/engine/engine.h batches: at each iteration
// boundary the requests that have arrived join, oldest first, up to max_batch; an iteration runs
// every running request's next step (the prefill of a request that just joined, a decode token
// for the others); a request leaves after its last step. Requests are indices 0..n-1 with their
// arrival times and step counts (>= 1).
//
// Chunked prefill (max_batched_tokens N > 0; `prompt` gives each request's prompt positions, one
// token each, 0 for one whose first step cannot be split): an iteration holds at most N tokens.
// Every step after a request's first is one token and always runs (even past N); then the
// requests still in their prefill, in the order they joined (oldest first), each take a chunk of
// their next prompt positions, as many as the budget left allows (a chunk is at least 1 token: a
// prefill left without budget waits for the next iteration). A request's first step ends with
// its last chunk. A chunk that is the whole prompt is the step whole.
class ContinuousBatcher {
 public:
  struct Slot {
    uint32_t request = 0;
    uint32_t step = 0;  // 0 = the request's first step (its prefill, whole or a chunk).
    // A chunk of the prefill: prompt positions [chunk_begin, chunk_end). Both 0: the step whole.
    uint32_t chunk_begin = 0, chunk_end = 0;
    bool chunk() const { return chunk_end > 0; }
  };
  ContinuousBatcher(std::vector<int64_t> arrival_ns, std::vector<uint32_t> steps,
                    uint32_t max_batch, std::vector<uint32_t> prompt = {},
                    uint32_t max_batched_tokens = 0);
  // Expert-aware chunks, as the engine's Scheduler::SetChunkAdvisor: a chunk the budget would
  // cut short of its prompt may grow to what the advisor asks (the first chunk of an iteration,
  // even past N); a later chunk the advisor would grow waits for an iteration where it is first.
  void SetChunkAdvisor(ChunkAdvisor advisor) { advisor_ = std::move(advisor); }

  // Admits the requests that arrived by `now_ns` into free slots (earliest arrival first, the
  // lower index on ties) and returns what the iteration runs: the running requests' steps (or
  // chunks), in the order they joined; empty when none is running.
  const std::vector<Slot>& Admit(int64_t now_ns);
  // Arrival of the next request not yet admitted; -1 when every one was.
  int64_t NextArrival() const;
  // Ends the iteration: every slot Admit returned has run; a request whose last chunk or step it
  // was moves to its next step, and those that ran their last leave (appended to `finished`).
  void Advance(std::vector<uint32_t>* finished);
  bool done() const { return finished_ == arrival_ns_.size(); }

 private:
  struct Running {
    uint32_t request = 0, step = 0;
    uint32_t done = 0;  // Prompt positions of the prefill run so far (chunked).
    uint32_t ran = 0;   // Chunked: where this iteration's chunk ends (0: the step whole).
    bool runs = false;  // In this iteration's slots.
  };
  std::vector<int64_t> arrival_ns_;
  std::vector<uint32_t> steps_;
  std::vector<uint32_t> prompt_;
  uint32_t max_batched_tokens_;
  std::vector<uint32_t> order_;  // Requests by arrival.
  size_t next_ = 0;              // Next in order_ to admit.
  uint32_t max_batch_;
  std::vector<Running> running_;
  std::vector<Slot> slots_;  // This iteration's.
  ChunkAdvisor advisor_;
  size_t finished_ = 0;
};

struct ServeConfig {
  std::string policy;     // A MakePolicy name, oracle included.
  double budget = 0.25;   // Fraction of the L * J experts the cache holds, (0, 1].
  uint32_t distance = 3;  // Prefetch distance d.
  bool online = false;    // Store starts empty (online) or warmed on the train split (offline).
  uint32_t max_batch = 1;
  // Chunked prefill: at most this many tokens per iteration (ContinuousBatcher), decode steps
  // first, then prompt chunks oldest first; a chunk's routing is exactly its positions' (merged
  // by MergePositions), so it needs the prompt-positions kind. 0: every prefill whole. Default: 0
  uint32_t max_batched_tokens = 0;
  // Expert-aware chunks (ChunkAdvisorFor): 0 = the budget's chunks. Default: 0
  double chunk_overhead = 0;
  TimeModel time;
  uint32_t store_capacity = 1000;
  uint32_t max_inflight_prefetches = 2;
  // Hybrid execution: at each layer start the experts the layer needs that are not resident are
  // split between the link and the CPU (SplitLayer, from the link time each still needs and the
  // CPU model's time at its tokens); the cache sees only the link's share, so a CPU-run expert
  // is neither loaded nor cached, and the policy is told of its use (a miss). The layer computes
  // once the link's experts are resident and the CPU's are done: the CPU's time is not
  // overlapped with the layer's compute (conservative). Default: off
  bool hybrid = false;
  CpuModel cpu;  // Required (enabled) when hybrid.
  // The disk tier (sim_tier.h): with disk.host_budget > 0 the experts live on a simulated disk
  // behind a host cache of that fraction of them (SimTieredLink, the cache tiered), read at
  // disk.gbps + disk.latency_us per expert of time.expert_mb; 0: every expert in host memory
  // (the link alone). Not with hybrid. Default: off
  DiskModel disk;
  // oracle: it knows the accesses to come, but batches depend on timing, which depends on the
  // oracle. It runs told the schedule of a run without stalls, then of its own previous run,
  // until the two agree; after this many runs, once more keeping to the last schedule (a batch
  // waits for its requests to arrive), so its knowledge is exact in every case.
  uint32_t oracle_passes = 3;
};

// The ContinuousBatcher's chunk advisor for a run: ExpertAwareChunk over the trace's model (J,
// K, L), the cache's misses (1 - budget of each layer's experts), the time model's expert load
// and a prompt token's compute (the layer time's slope between 512 and 1024 tokens, x L). Empty
// when c.chunk_overhead is 0 or prefills run whole.
ChunkAdvisor ChunkAdvisorFor(const ServeConfig& c, const TraceHeader& h);

// TTFT = end of its first step (its prefill's last chunk) - arrival; TPOT = (end of its last
// step - end of its first) / the steps after the first.
struct RequestTiming {
  uint64_t id = 0;
  bool has_prefill = true;
  uint32_t prompt_tokens = 0;
  uint32_t steps = 0;  // Steps it ran: its prefill (chunked or not) and decode steps.
  // From the start of the measured part: arrival, the start of its first iteration, the end of
  // its first step and of its last.
  int64_t arrival_ns = 0, start_ns = 0, first_token_ns = 0, last_token_ns = 0;
  uint32_t prefill_iterations = 0;  // Iterations its first step took (> 1: chunked).
  double ttft_ns() const { return static_cast<double>(first_token_ns - arrival_ns); }
  // 0 steps after the first: no TPOT.
  bool has_tpot() const { return steps >= 2; }
  double tpot_ns() const {
    return has_tpot() ? static_cast<double>(last_token_ns - first_token_ns) / (steps - 1) : 0.0;
  }
};

// Cache figures of one kind of iteration.
struct PhaseFigures {
  uint64_t iterations = 0;
  uint64_t tokens = 0;  // The batch's new tokens.
  // Request-steps: a prefill (a chunked one once, at its last chunk), or one request's decode
  // token (in a prefill's iterations only the prefills count).
  uint64_t requests = 0;
  uint64_t hits = 0, misses = 0, late_prefetches = 0;
  uint64_t on_demand_loads = 0, prefetches_issued = 0, prefetches_used = 0;
  double experts_moved = 0;  // Bytes copied over the link, in experts (cancelled copies in part).
  double stall_ns = 0;       // Waiting for the link, and with hybrid for the CPU.
  double time_ns = 0;        // The iterations' simulated time, stall included.
  uint64_t cpu_experts = 0;  // Missing experts computed on the CPU (also counted in misses).
  double cpu_ns = 0;         // The CPU's time on them.
  double cpu_stall_ns = 0;   // The part of stall_ns spent waiting for the CPU after the link.
  // Disk tier (ServeConfig::disk): loads handed to it and those whose expert was in host memory
  // (no read waited for); expert reads from disk (hinted ones included) and their bytes (of
  // time.expert_mb); the part of stall_ns with a needed expert still being read
  // (SimTierStats::disk_stall_ns: before its copy could start). Zero without the tier.
  uint64_t host_loads = 0, host_hits = 0;
  uint64_t disk_reads = 0;
  // Host-tier prefetch (SimTierStats): reads started by a hint (also in disk_reads), and hints
  // not read because an urgent read was waiting (yielded) or the use came before a read could
  // end (late).
  uint64_t hinted_reads = 0, hints_yielded = 0, hints_late = 0;
  double disk_bytes = 0;
  double disk_stall_ns = 0;

  double hit_rate() const { return hits + misses ? double(hits) / double(hits + misses) : 0; }
  double precision() const {
    return prefetches_issued ? double(prefetches_used) / double(prefetches_issued) : 0;
  }
  double recall() const {
    const uint64_t needed = prefetches_used + on_demand_loads;
    return needed ? double(prefetches_used) / double(needed) : 0;
  }
  double host_hit_rate() const { return host_loads ? double(host_hits) / double(host_loads) : 0; }
};

struct ServeResult {
  ServeConfig config;
  std::vector<RequestTiming> requests;  // The measured requests, in workload order.
  PhaseFigures prefill, decode;
  uint64_t iterations = 0;
  double mean_batch = 0;  // Requests per iteration.
  double total_ns = 0;    // First arrival to last token.
  uint64_t directives = 0;
  double match_score = 0;
  uint32_t oracle_passes = 0;  // oracle: runs made.
  // oracle: its last run kept to the schedule it was told rather than batching as it went (its
  // schedule had not settled after `oracle_passes` runs).
  bool oracle_forced = false;
  double wall_s = 0;
};

// Runs the `train` requests first when offline (all arriving at once, unmeasured: caches,
// frequency counts and EAM collections warm up), then measures `test`, request k arriving at
// `arrival_ns[k]` after the measured part starts. `warm_store`: offline fmoe policies (from
// WarmServeStore). kInvalidArgument for a bad config.
Result<ServeResult> RunServeReplay(const ServeWorkload& workload,
                                   const std::vector<uint32_t>& train,
                                   const std::vector<uint32_t>& test,
                                   const std::vector<int64_t>& arrival_ns,
                                   const ServeConfig& config, const MapStore* warm_store);

// The store a map service would hold after serving `train`: every step's map, request by request.
Result<MapStore> WarmServeStore(const ServeWorkload& workload, const std::vector<uint32_t>& train,
                                uint32_t capacity, uint32_t distance);

}  // namespace fmoe::bench
