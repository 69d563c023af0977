// A rank: the model's dense weights and this rank's routed experts on one device, with what runs
// them, assembled in the one order every user needs (DESIGN section 7): config, device, dtype,
// trace (leader; before the weights, so a bad path fails at once), tokenizer (leader), weights,
// expert source (all resident, or the cache with its policy, budget and link), the group (joined
// once the weights are in, so a slow loader does not eat the others' timeout), the observers and
// the compute (the engine on rank 0, the follower elsewhere). fmoe-worker, fmoe-generate and the
// benchmarks assemble through here and keep only their own loops. The owner's thread: Assemble,
// Finish, accessors; the compute thread: RunCompute; any thread: Wake, PostDirective,
// group_failed, group_failure.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>

#include "common/model/model_config.h"
#include "common/status.h"
#include "common/text/tokenizer.h"
#include "common/wire/messages.h"
#include "gpu_worker/engine/engine.h"
#include "gpu_worker/engine/follower.h"
#include "gpu_worker/experts/cached_experts.h"
#include "gpu_worker/experts/expert_source.h"
#include "gpu_worker/group/expert_group.h"
#include "gpu_worker/model/device.h"
#include "gpu_worker/model/model.h"
#include "gpu_worker/observe/forward_observer.h"
#include "gpu_worker/observe/map_publisher.h"
#include "gpu_worker/observe/trace_recorder.h"

namespace fmoe {

// How the rank holds its routed experts.
enum class RankExperts {
  kResident,  // Every expert resident (ResidentExperts): no cache, no link. One rank only.
  kCached,    // The expert cache (CachedExperts): policy, budget, link, prefetching.
};

// Where Assemble failed, for callers that map it onto an exit code or one of their own flags.
enum class RankStage {
  kOptions,  // The options themselves: device or dtype string, rank, world size, rendezvous.
  kLoad,     // The model's config, the device, the tokenizer, the weights or the expert store.
  kTrace,    // The trace file could not be written.
  kJoin,     // The group could not be formed (rendezvous, process group).
};

struct RankOptions {
  // ---- model and device ----
  std::string model_dir;  // Hugging Face model directory. Required unless `model` is given.
  // The model's config when the caller has read it already (LoadModelInfo). Default: read from
  // model_dir
  std::optional<ModelInfo> model;
  // Served model id, for the trace header. Default: the directory's base name
  std::string model_name;
  std::string device = "cpu";  // "cpu" or "cuda:N". Default: cpu
  int threads = 0;             // LibTorch intra-op threads; 0 keeps LibTorch's. Default: 0
  // auto | float32 | bfloat16 | float16; auto: see ResolveDtype. Default: auto
  std::string dtype = "auto";
  int row_block = 4;      // Rows per matrix block on the CPU (RuntimeOptions). Default: 4
  bool tokenizer = true;  // The leader loads the tokenizer. Default: on
  // Called by the loader as the weights load (bytes done, total), besides the log. Default: none
  LoadProgress progress;

  // ---- experts ----
  RankExperts experts = RankExperts::kCached;  // Default: cached
  // kCached: policy, prefetch settings, budget, link. Its top_k, rank, world_size and cuda_index
  // are set from the model and this rank. Default: CachedExpertsOptions's
  CachedExpertsOptions cache;

  // ---- the expert-parallel group ----
  std::string group = "local";  // Name, for logs, errors and the trace header. Default: local
  uint32_t rank = 0;            // Default: 0 (the leader)
  uint32_t world_size = 1;      // Default: 1
  std::string rendezvous_host;  // Rank 0's TCPStore. Required when world_size > 1.
  uint16_t rendezvous_port = 0;
  std::string host = "127.0.0.1";  // This rank's address; "localhost" = 127.0.0.1. Default: that
  std::chrono::milliseconds rendezvous_timeout{120000};  // Default: 120 s
  std::chrono::milliseconds collective_timeout{60000};   // Default: 60 s
  // A rank silent this long breaks the group (ExpertGroupOptions: liveness). 0: off. Default: 0
  std::chrono::milliseconds liveness_timeout{0};
  std::chrono::milliseconds liveness_interval{250};  // Default: 250 ms

  // ---- trace recording (the leader only; ignored on other ranks) ----
  std::string record_trace;                 // The trace file. Default: "" (none)
  uint32_t trace_speculation_distance = 3;  // Layers ahead of each speculation entry. Default: 3

  // ---- compute ----
  // Build the engine (rank 0) or the follower (other ranks). Off: the caller runs the model
  // itself (the runtime and cache benchmarks). Default: on
  bool compute = true;
  uint32_t max_batch = 8;  // Requests per iteration. Default: 8
  // Tokens per engine step (EngineOptions::max_batched_tokens); 0 = whole prompts. Default: 0
  uint32_t max_batched_tokens = 0;
  // Expert-aware prefill chunks (EngineOptions::chunk_overhead); 0 = the budget's. Default: 0
  double chunk_overhead = 0;
  // Streaming prefills' experts (EngineOptions::prefill_stream). Not off: a cached rank gets a
  // stream buffer of cache.stream_slots, or (0) two layers of the experts it owns. Default: off
  StreamMode prefill_stream = StreamMode::kOff;
  // Positions of the paged KV pool (model_config.h KvPoolTokens); 0 = its default. Default: 0
  uint64_t kv_cache_tokens = 0;  // Ignored with one device budget (cache.shared).
  // One device budget: how long the KV pool keeps a borrowed page it no longer needs
  // (KvPoolOptions::return_hold_ms). Default: 0
  int64_t kv_return_hold_ms = 0;
  // Prefix caching over the pool (a group of one rank only). Default: on
  bool prefix_caching = true;
  // The model's eos ids (config.json, else the tokenizer's) end requests; off, requests run to
  // max_tokens (the benchmarks). Default: on
  bool stop_at_eos = true;
  Engine::EventSink on_token;  // The engine's token events (engine thread). Default: dropped
  // The leader's map-service contexts: when set, a MapPublisher hands them here (engine thread;
  // must not block). Default: none (no publisher)
  std::function<void(MapMessage)> on_context;
};

// The compute dtype for `requested`: float32, bfloat16 or float16 as given; "auto" is the
// checkpoint's torch_dtype when the device is cuda and that is bfloat16 or float16, else float32
// (so cpu stays float32, unless the experts are left on disk: below). kInvalidArgument naming
// the accepted values otherwise.
// The KV cache memory `expert_cache_gb: auto` keeps free: the paged pool's positions
// (model_config.h KvPoolTokens) at the bytes the runtime's KV cache holds per token
// (KvBytesPerToken: MLA's latents, not per-head keys); the sliding-window layers at
// `sliding_tokens` (KvSlidingPoolTokens).
// The model's and an expert cache's side of the chunk and stream estimates (core/chunk_planner.h):
// experts, top_k, MoE layers, the cache's miss fraction and measured load time; token_ns unset.
ChunkCosts CacheChunkCosts(const ModelInfo& info, const ExpertCache& cache);

uint64_t KvReserveBytes(const ModelInfo& info, uint64_t pool_tokens, uint64_t sliding_tokens,
                        const std::string& dtype);

// With `experts_on_disk` (the host tier reads experts as stored) and a float checkpoint, auto is
// its torch_dtype on any device.
Result<std::string> ResolveDtype(std::string_view requested, const ModelInfo& info, bool cuda,
                                 bool experts_on_disk = false);

class Rank {
 public:
  // Builds every part in order; on failure nothing is left running, and `failed` (when given)
  // is set to the stage that failed (untouched on success). Errors name what was wrong: "rank:
  // device \"gpu\" is not cpu or cuda:N", the model loader's "model: /m/model.safetensors: tensor
  // ...", the group's "expert group g0: rank 1/2: ...".
  static Result<std::unique_ptr<Rank>> Assemble(RankOptions options, RankStage* failed = nullptr);
  ~Rank();
  Rank(const Rank&) = delete;
  Rank& operator=(const Rank&) = delete;

  const RankOptions& options() const { return options_; }
  const ModelInfo& info() const { return info_; }
  const DeviceInfo& device() const { return device_; }
  const std::string& dtype() const { return dtype_; }  // The resolved compute dtype.
  bool leader() const { return options_.rank == 0; }

  MoeModel& model() { return *model_; }
  const Tokenizer* tokenizer() const { return tokenizer_.get(); }  // Null unless loaded.
  ExpertSource& experts() { return *source_; }
  ResidentExperts* resident() { return resident_.get(); }  // kResident; else null.
  CachedExperts* cached() { return cached_.get(); }        // kCached; else null.
  ExpertGroup& group() { return *group_; }
  TraceRecorder* recorder() { return recorder_.get(); }  // Null unless recording.
  Engine* engine() { return engine_.get(); }             // compute on rank 0; else null.
  Follower* follower() { return follower_.get(); }       // compute on other ranks; else null.

  // A new expert cache over a copy of this rank's experts, with this rank's top_k, rank, world
  // size and device (kResident ranks: the cache benchmark's configurations).
  Result<std::unique_ptr<CachedExperts>> NewCachedExperts(CachedExpertsOptions options) const;

  // This rank's expert-cache totals (zero with every expert resident); any thread.
  ExpertFigures local_figures() const;
  // The model's and the expert cache's side of the expert-aware chunk estimate (engine thread);
  // nothing known without an expert cache (every expert resident: nothing to load).
  ChunkCosts chunk_costs() const;
  // The group's totals as of the last iteration on the leader's engine, else this rank's.
  ExpertFigures group_figures() const;
  // The leader's KV pool as of its engine's last step (empty without an engine); any thread.
  KvFigures kv_figures() const;
  // The engine's prompt chunks (leader; zeros on a follower). Any thread.
  EngineFigures engine_figures() const;
  // Any thread: a map-service directive for the expert cache (ignored with every expert
  // resident); the cache keeps the entries of this rank's experts.
  void PostDirective(const PrefetchDirective& directive);

  // The compute thread: the engine (rank 0) or the follower until stop() holds. A follower keeps
  // following for up to `grace` after that, until the leader's stop plan, so the group winds
  // down without a broken collective. A lone engine whose loop throws starts again; in a group,
  // that, a failed collective, a bad plan or a leader that stops first breaks the group.
  void RunCompute(const std::function<bool()>& stop, std::chrono::milliseconds grace);
  void Wake();  // Any thread: the engine's wait ends (to notice a stop).
  bool group_failed() const { return group_failed_.load(); }
  std::string group_failure() const;  // Why the group broke; "" while it works.

  // The owner, once the compute thread has returned: closes the trace (the running requests'
  // last iterations marked last) and logs the totals of the engine or follower, the group and
  // the expert cache.
  void Finish();

 private:
  explicit Rank(RankOptions options) : options_(std::move(options)) {}
  Status Build(RankStage* stage);
  Status OpenTrace();
  Status LoadWeights(ExpertTable* table);
  // The model's paged KV pool: its own memory, or (one device budget) the expert cache's pages.
  Status ConfigureKv(std::optional<KvArena> arena);
  void OnGroupFailure(const Status& why);

  RankOptions options_;
  ModelInfo info_;
  DeviceInfo device_;
  std::string dtype_;
  uint64_t kv_pool_tokens_ = 0;     // The paged KV pool's positions.
  uint64_t kv_sliding_tokens_ = 0;  // Its sliding-window layers'.
  // Destroyed in reverse: the compute first, then what it uses.
  std::unique_ptr<TraceRecorder> recorder_;
  std::unique_ptr<Tokenizer> tokenizer_;
  std::unique_ptr<MoeModel> model_;
  std::unique_ptr<ResidentExperts> resident_;
  std::unique_ptr<CachedExperts> cached_;
  ExpertSource* source_ = nullptr;  // resident_ or cached_.
  std::unique_ptr<ExpertGroup> group_;
  std::unique_ptr<MapPublisher> publisher_;
  ObserverFanOut observers_;  // The publisher and the recorder.
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<Follower> follower_;

  std::atomic<bool> group_failed_{false};
  mutable std::mutex failure_mu_;
  std::string failure_;  // GUARDED_BY(failure_mu_); the first cause.
};

}  // namespace fmoe
