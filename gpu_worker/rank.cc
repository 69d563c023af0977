#include "gpu_worker/rank.h"

#include <algorithm>
#include <charconv>
#include <chrono>
#include <exception>
#include <filesystem>
#include <thread>
#include <utility>

#include "common/log.h"

namespace fmoe {
namespace {

double SecondsSince(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// "cpu" -> -1, "cuda:N" -> N.
Result<int> ParseDevice(const std::string& device) {
  if (device == "cpu") return -1;
  constexpr std::string_view kCuda = "cuda:";
  int index = -1;
  if (device.starts_with(kCuda) && device.size() > kCuda.size()) {
    const char* first = device.data() + kCuda.size();
    const char* last = device.data() + device.size();
    auto [end, ec] = std::from_chars(first, last, index);
    if (ec == std::errc() && end == last && index >= 0) return index;
  }
  return InvalidArgument("rank: device \"" + device + "\" is not cpu or cuda:N");
}

Status Check(const RankOptions& o) {
  if (o.model_dir.empty() && !o.model) return InvalidArgument("rank: no model directory");
  if (o.world_size == 0 || o.rank >= o.world_size) {
    return InvalidArgument("rank: rank " + std::to_string(o.rank) + " of a group of " +
                           std::to_string(o.world_size) + " does not exist");
  }
  if (Status s = SchedulerOptions{o.max_batch, o.max_batched_tokens}.Check(); !s.ok()) {
    return InvalidArgument("rank: " + s.message());
  }
  if (o.experts == RankExperts::kResident && o.world_size > 1) {
    return InvalidArgument("rank: every expert resident needs a group of one rank, not " +
                           std::to_string(o.world_size));
  }
  if (o.cache.shared && o.experts != RankExperts::kCached) {
    return InvalidArgument(
        "rank: one device budget for KV and experts (memory) needs an expert cache, not every "
        "expert resident");
  }
  if (o.world_size > 1 && (o.rendezvous_host.empty() || o.rendezvous_port == 0)) {
    return InvalidArgument("rank: group " + o.group + " of " + std::to_string(o.world_size) +
                           " ranks has no rendezvous address");
  }
  return Status::Ok();
}

std::string CacheDescription(const CachedExpertsOptions& c) {
  if (c.shared) {
    return fmt::format("one budget with the KV pool ({}, kv_floor {:g}, expert_floor {:g})",
                       c.shared->device_gb
                           ? fmt::format("{:g} GB", *c.shared->device_gb)
                           : fmt::format("{:g} of free device memory", c.shared->device_fraction),
                       c.shared->kv_floor, c.shared->expert_floor);
  }
  if (c.cache_auto) return fmt::format("auto ({:g} of free memory)", c.memory_utilization);
  return c.cache_gb ? fmt::format("{:g} GB", *c.cache_gb)
                    : fmt::format("{:g} of experts", c.cache_fraction.value_or(1.0));
}

}  // namespace

uint64_t KvReserveBytes(const ModelInfo& info, uint64_t pool_tokens, uint64_t sliding_tokens,
                        const std::string& dtype) {
  const uint32_t width = dtype == "float32" ? 4 : 2;
  const auto [full, sliding] = KvBytesPerTokenSplit(info, width);
  return pool_tokens * full + sliding_tokens * sliding;
}

Result<std::string> ResolveDtype(std::string_view requested, const ModelInfo& info, bool cuda,
                                 bool experts_on_disk) {
  if (requested == "float32" || requested == "bfloat16" || requested == "float16") {
    return std::string(requested);
  }
  if (requested != "auto") {
    return InvalidArgument("dtype \"" + std::string(requested) +
                           "\" is not auto, float32, bfloat16 or float16");
  }
  const bool half = info.torch_dtype == "bfloat16" || info.torch_dtype == "float16";
  if (cuda && half) return info.torch_dtype;
  // Experts read from disk are used as stored: a float checkpoint's dtype.
  if (experts_on_disk && half && !info.quant.quantized()) return info.torch_dtype;
  return std::string("float32");
}

Result<std::unique_ptr<Rank>> Rank::Assemble(RankOptions options, RankStage* failed) {
  RankStage stage = RankStage::kOptions;
  std::unique_ptr<Rank> rank(new Rank(std::move(options)));
  if (Status s = rank->Build(&stage); !s.ok()) {
    if (failed != nullptr) *failed = stage;
    return s;  // `rank` goes, with whatever was built, in reverse order.
  }
  return rank;
}

Rank::~Rank() = default;

Status Rank::Build(RankStage* stage) {
  RankOptions& o = options_;
  *stage = RankStage::kOptions;
  FMOE_RETURN_IF_ERROR(Check(o));
  FMOE_ASSIGN_OR_RETURN(const int cuda_index, ParseDevice(o.device));
  if (o.dtype != "auto") FMOE_RETURN_IF_ERROR(ResolveDtype(o.dtype, ModelInfo{}, false).status());

  *stage = RankStage::kLoad;
  if (o.model) {
    info_ = *o.model;
  } else {
    FMOE_ASSIGN_OR_RETURN(info_, LoadModelInfo(o.model_dir));
  }
  if (o.model_name.empty()) o.model_name = std::filesystem::path(info_.dir).filename().string();
  FMOE_ASSIGN_OR_RETURN(device_, ResolveDevice(o.device, cuda_index, o.threads));
  const bool on_disk =
      o.experts == RankExperts::kCached &&
      (o.cache.host_cache_gb || o.cache.host_cache_fraction || o.cache.host_cache_auto);
  FMOE_ASSIGN_OR_RETURN(dtype_, ResolveDtype(o.dtype, info_, device_.cuda, on_disk));
  spdlog::info(
      "effective config: group={} rank={}/{} device={} dtype={}{} experts={} max_batch={} "
      "max_batched_tokens={} chunk_overhead={} prefill_stream={}",
      o.group, o.rank, o.world_size, device_.description, dtype_,
      o.dtype == "auto" ? " (auto)" : "",
      o.experts == RankExperts::kResident
          ? std::string("all resident")
          : fmt::format("policy {}, cache {}, link {}GB/s+{}us", o.cache.policy,
                        CacheDescription(o.cache), o.cache.link.gbps, o.cache.link.latency_us),
      o.max_batch, o.max_batched_tokens, o.chunk_overhead, StreamModeName(o.prefill_stream));
  spdlog::info("model {} ({}): L={} J={} K={} h={} vocab={} fingerprint={} weight files={}",
               o.model_name, info_.architecture, info_.num_moe_layers, info_.num_experts,
               info_.top_k, info_.hidden_size, info_.vocab_size, FingerprintHex(info_.fingerprint),
               info_.weight_files.size());

  if (leader() && !o.record_trace.empty()) {
    *stage = RankStage::kTrace;
    FMOE_RETURN_IF_ERROR(OpenTrace());
  }
  *stage = RankStage::kLoad;
  if (leader() && o.tokenizer) {
    FMOE_ASSIGN_OR_RETURN(tokenizer_, Tokenizer::Load(info_.dir));
  }
  ExpertTable table;
  FMOE_RETURN_IF_ERROR(LoadWeights(&table));
  if (o.experts == RankExperts::kResident) {
    FMOE_ASSIGN_OR_RETURN(resident_, ResidentExperts::Create(std::move(table), device_.cuda_index));
    source_ = resident_.get();
  } else {
    CachedExpertsOptions cache = o.cache;
    cache.top_k = info_.top_k;
    cache.rank = o.rank;
    cache.world_size = o.world_size;
    cache.cuda_index = device_.cuda_index;
    if (cache.cache_auto)
      cache.reserve_bytes = KvReserveBytes(info_, kv_pool_tokens_, kv_sliding_tokens_, dtype_);
    if (cache.shared) cache.shared->page_quantum = model_->kv_block_bytes();
    if (o.prefill_stream == StreamMode::kOff) {
      cache.stream_slots = 0;
    } else if (cache.stream_slots == 0) {
      cache.stream_slots = 2 * ((info_.num_experts + o.world_size - 1) / o.world_size);
    }
    FMOE_ASSIGN_OR_RETURN(cached_, CachedExperts::Create(std::move(table), cache));
    source_ = cached_.get();
  }

  // The group, once the weights are in: a slow loader does not eat the others' timeout.
  *stage = RankStage::kJoin;
  ExpertGroupOptions g;
  g.group = o.group;
  g.rank = o.rank;
  g.world_size = o.world_size;
  g.rendezvous_host = o.rendezvous_host;
  g.rendezvous_port = o.rendezvous_port;
  g.host = o.host == "localhost" ? "127.0.0.1" : o.host;
  g.cuda_index = device_.cuda_index;
  g.rendezvous_timeout = o.rendezvous_timeout;
  g.collective_timeout = o.collective_timeout;
  g.liveness_timeout = o.liveness_timeout;
  g.liveness_interval = o.liveness_interval;
  FMOE_ASSIGN_OR_RETURN(group_, ExpertGroup::Join(g));
  model_->set_group(group_.get());
  if (o.cache.shared && cached_) {
    // One device budget: the pool lives in the cache's pages, as much on every rank of the group.
    std::optional<KvArena> arena = cached_->kv_arena();
    if (arena) FMOE_RETURN_IF_ERROR(AgreeKvArena(*group_, model_->kv_block_bytes(), &*arena));
    FMOE_RETURN_IF_ERROR(ConfigureKv(arena));
  }

  // Nothing below fails.
  if (!o.compute) return Status::Ok();
  if (leader()) {
    // Only the leader publishes contexts (DESIGN section 7).
    if (o.on_context) publisher_ = std::make_unique<MapPublisher>(o.on_context);
    observers_.Add(publisher_.get());
    observers_.Add(recorder_.get());
    EngineOptions e;
    e.max_batch = o.max_batch;
    e.max_batched_tokens = o.max_batched_tokens;
    // A grown chunk may pass the token budget, which sizes the sliding-window layers' pool
    // (KvSlidingPoolTokens): with such layers the chunks stay the budget's.
    const bool sliding = !info_.mla && info_.sliding_window.value_or(0) > 0;
    e.chunk_overhead = sliding ? 0.0 : o.chunk_overhead;
    if (sliding && o.chunk_overhead > 0 && o.max_batched_tokens > 0) {
      spdlog::info(
          "chunk_overhead {}: off for this model (its sliding-window layers' KV pool is sized "
          "by max_batched_tokens, which a grown chunk would pass)",
          o.chunk_overhead);
    }
    e.chunk_costs = [this] { return chunk_costs(); };
    e.prefill_stream = o.prefill_stream;
    if (o.stop_at_eos) {
      e.eos_token_ids = info_.eos_token_ids;
      if (auto eos = tokenizer_ ? tokenizer_->eos_id() : std::nullopt;
          eos && e.eos_token_ids.empty()) {
        e.eos_token_ids.push_back(*eos);
      }
    }
    e.group = group_.get();
    e.local_figures = [this] { return local_figures(); };
    e.on_group_failure = [this](const Status& why) { OnGroupFailure(why); };
    Engine::EventSink sink = o.on_token ? o.on_token : [](const TokenEvent&) {};
    engine_ = std::make_unique<Engine>(std::move(e), *model_, *source_, tokenizer_.get(),
                                       &observers_, std::move(sink));
  } else {
    follower_ = std::make_unique<Follower>(*model_, *source_, *group_, o.max_batch,
                                           [this] { return local_figures(); });
  }
  return Status::Ok();
}

Status Rank::OpenTrace() {
  TraceRecorderOptions t;
  t.path = options_.record_trace;
  // Speculation entries at the map service's prefetch distance, whatever the policy.
  t.speculation_distance = options_.trace_speculation_distance;
  t.header = WorkerTraceHeader(info_, options_.model_name, options_.group, options_.rank,
                               t.speculation_distance);
  auto opened = TraceRecorder::Open(t);
  if (!opened.ok()) {
    return Status(opened.status().code(), "cannot write the trace: " + opened.status().message());
  }
  recorder_ = std::move(*opened);
  if (!recorder_->kept_previous().empty()) {
    spdlog::info("kept the previous trace as {}", recorder_->kept_previous());
  }
  spdlog::info("recording the expert trace to {} (speculation distance {})", t.path,
               t.speculation_distance);
  return Status::Ok();
}

Status Rank::LoadWeights(ExpertTable* table) {
  RuntimeOptions r;
  r.dtype = dtype_;
  r.cuda_index = device_.cuda_index;
  r.row_block = options_.row_block;
  r.expert_rank = options_.rank;
  r.expert_world_size = options_.world_size;
  const CachedExpertsOptions& c = options_.cache;
  r.experts_on_disk = options_.experts == RankExperts::kCached &&
                      (c.host_cache_gb || c.host_cache_fraction || c.host_cache_auto);
  const auto t0 = std::chrono::steady_clock::now();
  int last_decile = -1;
  auto progress = [&](uint64_t done, uint64_t total) {
    if (options_.progress) options_.progress(done, total);
    if (total == 0) return;
    const int decile = static_cast<int>(10 * done / total);
    if (decile != last_decile && decile % 5 == 0) {
      spdlog::info("loading weights: {}% of {:.1f} MB", decile * 10, total / 1e6);
    }
    last_decile = decile;
  };
  FMOE_ASSIGN_OR_RETURN(model_, MoeModel::Load(info_, r, progress, table));
  spdlog::info("model loaded in {:.2f} s (dtype {})", SecondsSince(t0), dtype_);
  // One device budget: the pool lives in the expert cache's pages, made after it.
  if (options_.cache.shared && options_.experts == RankExperts::kCached) return Status::Ok();
  return ConfigureKv(std::nullopt);
}

Status Rank::ConfigureKv(std::optional<KvArena> arena) {
  // The paged KV pool; prefix caching needs every rank to share the same blocks, so only a
  // group of one rank has it.
  KvPoolOptions kv;
  if (arena) {
    kv_pool_tokens_ = uint64_t{arena->max_pages} * (arena->page_bytes / model_->kv_block_bytes()) *
                      kKvBlockTokens;
    kv.arena = arena;
    kv.return_hold_ms = options_.kv_return_hold_ms;
  } else {
    kv_pool_tokens_ = KvPoolTokens(info_, options_.max_batch, options_.kv_cache_tokens);
  }
  kv_sliding_tokens_ =
      KvSlidingPoolTokens(info_, options_.max_batch, options_.max_batched_tokens, kv_pool_tokens_);
  kv.tokens = kv_pool_tokens_;
  kv.sliding_tokens = kv_sliding_tokens_;
  kv.prefix_caching = options_.prefix_caching && options_.world_size == 1;
  model_->ConfigureKv(kv);
  FMOE_RETURN_IF_ERROR(model_->MaterializeKv());
  const KvPoolFigures f = model_->kv_figures();
  if (arena) {
    spdlog::info(
        "KV pool: {} positions its own, up to {} with pages borrowed from the expert cache, in "
        "blocks of {} ({:.1f} MB now, {} B per position){}",
        f.total_blocks * kKvBlockTokens, kv_pool_tokens_, kKvBlockTokens,
        static_cast<double>(f.bytes) / 1e6, f.bytes_per_token,
        kv.prefix_caching ? ", prefix caching" : "");
    return Status::Ok();
  }
  spdlog::info("KV pool: {} positions in blocks of {} ({:.1f} MB, {} B per position){}",
               kv_pool_tokens_, kKvBlockTokens, static_cast<double>(f.bytes) / 1e6,
               f.bytes_per_token,
               kv.prefix_caching && model_->kv_figures().fixed ? ", prefix caching" : "");
  return Status::Ok();
}

Result<std::unique_ptr<CachedExperts>> Rank::NewCachedExperts(CachedExpertsOptions options) const {
  if (!resident_) {
    return FailedPrecondition("rank: a new expert cache needs a rank with every expert resident");
  }
  options.top_k = info_.top_k;
  options.rank = options_.rank;
  options.world_size = options_.world_size;
  options.cuda_index = device_.cuda_index;
  return CachedExperts::Create(CloneExpertTable(resident_->experts()), options);
}

ChunkCosts Rank::chunk_costs() const {
  return cached_ ? CacheChunkCosts(info_, cached_->cache()) : ChunkCosts{};
}

ChunkCosts CacheChunkCosts(const ModelInfo& info, const ExpertCache& cache) {
  ChunkCosts c;
  c.experts = info.num_experts;
  c.top_k = info.top_k;
  c.moe_layers = info.num_moe_layers;
  const uint32_t owned = cache.owned();
  c.miss = owned == 0 ? 0.0 : 1.0 - std::min(1.0, static_cast<double>(cache.slots()) / owned);
  c.load_ns = cache.load_ns();
  return c;
}

ExpertFigures Rank::local_figures() const {
  if (!cached_) return {};
  const CacheCounters t = cached_->stats().total;
  const std::optional<HostTierStats> tier = cached_->host_tier_stats();
  return ExpertFigures{t.hits,
                       t.misses,
                       t.prefetches_issued,
                       t.prefetches_used,
                       t.bytes_moved,
                       static_cast<uint64_t>(t.stall_ns / 1000),
                       t.host_runs,
                       static_cast<uint64_t>(t.host_ns / 1000),
                       t.bytes_not_moved,
                       t.disk_reads,
                       tier ? tier->bytes_read : 0,
                       static_cast<uint64_t>(t.disk_stall_ns / 1000),
                       t.failed_loads,
                       t.failed_experts};
}

KvFigures Rank::kv_figures() const { return engine_ ? engine_->kv_figures() : KvFigures{}; }

EngineFigures Rank::engine_figures() const {
  return engine_ ? engine_->engine_figures() : EngineFigures{};
}

ExpertFigures Rank::group_figures() const {
  return engine_ ? engine_->group_figures() : local_figures();
}

void Rank::PostDirective(const PrefetchDirective& directive) {
  if (cached_) cached_->PostDirective(directive);
}

void Rank::RunCompute(const std::function<bool()>& stop, std::chrono::milliseconds grace) {
  if (engine_) {
    // Run is each iteration's boundary (engine.h); what still escapes it (a keep-alive plan's
    // send) starts it again alone, and breaks a group.
    while (!stop() && !group_failed()) {
      try {
        engine_->Run(stop);
        return;
      } catch (const std::exception& e) {
        spdlog::error("group={} the engine loop threw: {}", options_.group, e.what());
        if (options_.world_size > 1) {
          OnGroupFailure(Internal(std::string("the engine loop threw: ") + e.what()));
          return;
        }
      }
    }
    return;
  }
  if (!follower_) return;
  Status s;
  try {
    s = follower_->Run(stop, grace);
  } catch (const std::exception& e) {  // The group cannot go on, but the rank says so.
    s = Internal(std::string("the follower loop threw: ") + e.what());
  }
  if (s.ok()) {
    // The leader stopped cleanly. When the whole group is stopping (the launcher signals every
    // rank at once), this rank's own stop request is on its way: wait for it up to the grace
    // period rather than leaving with an error.
    const auto until = std::chrono::steady_clock::now() + grace;
    while (!stop() && std::chrono::steady_clock::now() < until) {
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  if (stop()) return;
  OnGroupFailure(s.ok() ? Unavailable("the leader of group " + options_.group + " stopped") : s);
}

void Rank::Wake() {
  if (engine_) engine_->Wake();
}

void Rank::OnGroupFailure(const Status& why) {
  {
    std::lock_guard<std::mutex> lock(failure_mu_);
    if (failure_.empty()) failure_ = why.message();
  }
  group_failed_ = true;
}

std::string Rank::group_failure() const {
  std::lock_guard<std::mutex> lock(failure_mu_);
  return failure_;
}

void Rank::Finish() {
  if (recorder_) {
    // Requests still running get their last recorded iteration marked last.
    const Status closed = recorder_->Close();
    const TraceRecorderStats& ts = recorder_->stats();
    if (closed.ok()) {
      spdlog::info("trace {}: {} records, {} requests ended, {} iterations dropped",
                   recorder_->path(), ts.records, ts.requests, ts.dropped);
    } else {
      spdlog::error("trace {}: {} ({} records written)", recorder_->path(), closed.message(),
                    ts.records);
    }
  }
  if (engine_) {
    const EngineStats& st = engine_->stats();
    spdlog::info(
        "engine: {} iterations, {} prefill and {} decode tokens, {} requests finished, "
        "{} failed",
        st.iterations, st.prefill_tokens, st.decode_tokens, st.requests_finished,
        st.requests_failed);
  } else if (follower_) {
    const FollowerStats& st = follower_->stats();
    spdlog::info("follower: {} plans, {} iterations, {} prefill and {} decode tokens", st.plans,
                 st.iterations, st.prefill_tokens, st.decode_tokens);
  }
  const GroupStats gs = group_->stats();
  spdlog::info(
      "expert group: {} backend, {} combines, {} broadcasts, {} sums, {:.2f} MB payload sent, "
      "{:.1f} ms in collectives",
      group_->backend(), gs.combines, gs.broadcasts, gs.sums, gs.payload_bytes / 1e6,
      gs.wait_us / 1e3);
  if (cached_) {
    const CacheCounters t = cached_->stats().total;
    spdlog::info(
        "expert cache: {} hits, {} misses ({} late prefetches), {} prefetches ({} used, {} "
        "wasted), {} evictions, {:.1f} MB moved, {:.1f} ms stalled",
        t.hits, t.misses, t.late_prefetches, t.prefetches_issued, t.prefetches_used,
        t.prefetches_wasted, t.evictions, t.bytes_moved / 1e6, t.stall_ns / 1e6);
    if (t.failed_loads > 0) {
      spdlog::warn(
          "expert cache: {} loads failed (their reads did, retries included); {} experts were "
          "handed to a layer as failed",
          t.failed_loads, t.failed_experts);
    }
  }
}

}  // namespace fmoe
