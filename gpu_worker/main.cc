// fmoe-worker: one rank of a worker group. Reads the manifest, assembles its rank
// (gpu_worker/rank.h: the device, the model's dense weights and the routed experts this rank owns,
// the expert cache, the group's c10d join, the engine on the leader or the follower elsewhere),
// registers with the map service (and, as leader, with the router), reports readiness and serves
// until SIGINT/SIGTERM. Threads: main (control plane, gpu_worker/control/worker.h), compute
// (Rank::RunCompute), signal waiter. Exit 2: a bad argument; 1: the rank could not be assembled;
// 3: the group broke or could not be joined (a rank left, a collective timed out); the launcher
// restarts every rank of the group. With --record-trace the leader writes the expert routing
// trace (gpu_worker/observe/trace_recorder.h) and closes it on the way out.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <memory>
#include <string>
#include <thread>

#include <CLI/CLI.hpp>

#include "common/log.h"
#include "common/manifest.h"
#include "common/process_util.h"
#include "common/service_setup.h"
#include "common/wire/curve_key.h"
#include "gpu_worker/control/load_reporter.h"
#include "gpu_worker/control/outbox.h"
#include "gpu_worker/control/worker.h"
#include "gpu_worker/rank.h"

namespace {

using namespace fmoe;

// dtype "auto" resolves per device (cpu: float32), but the ranks of a group combine their expert
// outputs bit for bit and must compute in one dtype: a group mixing cpu and cuda ranks computes
// in float32 throughout.
std::string GroupDtype(const std::string& dtype, const WorkerGroupSpec& group) {
  if (dtype != "auto") return dtype;
  const bool all_cpu = std::all_of(group.workers.begin(), group.workers.end(),
                                   [](const WorkerSpec& w) { return w.cuda_index < 0; });
  const bool all_cuda = std::none_of(group.workers.begin(), group.workers.end(),
                                     [](const WorkerSpec& w) { return w.cuda_index < 0; });
  return all_cpu || all_cuda ? dtype : "float32";
}

// Manifest -> the rank's options, in this one place (the control plane's are in main).
RankOptions RankFromManifest(const Manifest& manifest, const WorkerGroupSpec& group, uint32_t rank,
                             const HostPort& rendezvous) {
  const WorkerSpec& spec = group.workers[rank];
  RankOptions o;
  o.model_dir = manifest.model.path;
  o.model_name = manifest.model.name;
  o.device = spec.device;
  // Ranks of a group share the machine's cores.
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  o.threads = static_cast<int>(std::max<size_t>(1, cores / group.workers.size()));
  o.dtype = GroupDtype(manifest.model.dtype, group);
  o.experts = RankExperts::kCached;
  o.cache.policy = group.policy;
  o.cache.policy_options.prefetch_distance =
      static_cast<uint32_t>(manifest.map_service.prefetch_distance);
  o.cache.cache_gb = group.expert_cache_gb;
  o.cache.cache_fraction = group.expert_cache_fraction;
  o.cache.cache_auto = group.expert_cache_auto;
  o.cache.memory_utilization = group.memory_utilization;
  if (group.memory) {
    CachedExpertsOptions::SharedBudget b;
    b.device_gb = group.memory->device_gb;
    b.device_fraction = group.memory->device_fraction;
    b.kv_floor = group.memory->kv_floor;
    b.expert_floor = group.memory->expert_floor;
    o.cache.shared = b;
    o.kv_return_hold_ms = std::llround(group.memory->return_hold_s * 1000);
  }
  o.cache.host_cache_gb = group.host_cache_gb;
  o.cache.host_cache_fraction = group.host_cache_fraction;
  o.cache.host_cache_auto = group.host_cache_auto;
  o.cache.link.gbps = group.link.gbps;
  o.cache.link.latency_us = group.link.latency_us;
  o.cache.hybrid = group.hybrid.enabled;
  o.cache.host_slowdown = group.hybrid.host_slowdown;
  // A cuda rank's intra-op threads do its host expert runs (hybrid.cpu_threads); a cpu rank's
  // are its compute threads and stay as they are.
  if (group.hybrid.enabled && group.hybrid.cpu_threads > 0 && spec.cuda_index >= 0) {
    o.threads = group.hybrid.cpu_threads;
  }
  o.group = group.name;
  o.rank = rank;
  o.world_size = static_cast<uint32_t>(group.workers.size());
  o.rendezvous_host = rendezvous.host;
  o.rendezvous_port = rendezvous.port;
  o.host = spec.host;
  o.rendezvous_timeout =
      std::chrono::milliseconds(static_cast<int64_t>(group.rendezvous_timeout_s * 1000));
  o.collective_timeout =
      std::chrono::milliseconds(static_cast<int64_t>(group.collective_timeout_s * 1000));
  // A rank cut off from the others is noticed within the heartbeat timeout, as a silent leader
  // is at the router, instead of when a collective times out (nothing closes on a cut link).
  if (manifest.heartbeat.timeout_ms < o.collective_timeout.count()) {
    o.liveness_timeout = std::chrono::milliseconds(manifest.heartbeat.timeout_ms);
    o.liveness_interval = std::chrono::milliseconds(manifest.heartbeat.interval_ms);
  }
  // Speculation entries at the map service's prefetch distance, whatever the policy.
  o.trace_speculation_distance = static_cast<uint32_t>(manifest.map_service.prefetch_distance);
  o.max_batch = static_cast<uint32_t>(group.max_batch);
  o.max_batched_tokens = static_cast<uint32_t>(group.max_batched_tokens);
  o.chunk_overhead = group.chunk_overhead;
  o.prefill_stream = StreamModeFromName(group.prefill_stream).value_or(StreamMode::kOff);
  o.cache.stream_slots = static_cast<uint32_t>(group.prefill_stream_slots);
  o.kv_cache_tokens = static_cast<uint64_t>(group.kv_cache_tokens);
  o.prefix_caching = group.prefix_caching;
  return o;
}

// Exit codes: the launcher restarts a rank that exits 1 and the whole group for 3.
constexpr int kExitLoad = 1;
constexpr int kExitBadOptions = 2;
constexpr int kExitGroup = 3;

struct Args {
  std::string manifest_path;
  std::string group_name;
  int rank = 0;
  int ready_fd = -1;
  std::string record_trace;
};

// Where this rank stands: its manifest, its group, the group's rendezvous.
struct Place {
  Manifest manifest;
  const WorkerGroupSpec* group = nullptr;
  HostPort rendezvous;
};

// The manifest read (the log set up), the cluster key loaded, the group and rank found; 0, or
// the exit code after logging why.
int FindPlace(const Args& args, Place* place) {
  const std::string log_name = "worker-" + args.group_name + "-" + std::to_string(args.rank);
  if (int rc = SetUpService("fmoe-worker", args.manifest_path, log_name, &place->manifest);
      rc != 0) {
    return rc;
  }
  const Manifest& manifest = place->manifest;
  // Every ZeroMQ socket of this process authenticates with the cluster key.
  if (Status s = wire::UseClusterKey(manifest.security.curve, manifest.security.key_file, true);
      !s.ok()) {
    spdlog::error("{}", s.message());
    return kExitBadOptions;
  }
  place->group = FindGroup(manifest, args.group_name);
  if (place->group == nullptr) {
    spdlog::error("group \"{}\" is not in {}", args.group_name, args.manifest_path);
    return kExitBadOptions;
  }
  if (args.rank >= static_cast<int>(place->group->workers.size())) {
    spdlog::error("group {} has {} ranks; rank {} does not exist", args.group_name,
                  place->group->workers.size(), args.rank);
    return kExitBadOptions;
  }
  auto rendezvous = ParseHostPort(place->group->rendezvous);
  if (!rendezvous.ok()) {
    spdlog::error("worker_groups.{}.rendezvous: {}", place->group->name,
                  rendezvous.status().message());
    return kExitBadOptions;
  }
  place->rendezvous = *rendezvous;
  return 0;
}

// Manifest -> the control plane's options, in this one place (the rank's: RankFromManifest).
WorkerOptions ControlFromManifest(const Manifest& manifest, const WorkerGroupSpec& group,
                                  uint32_t rank) {
  WorkerOptions options;
  options.group = group.name;
  options.rank = rank;
  options.world_size = static_cast<uint32_t>(group.workers.size());
  options.model_name = manifest.model.name;
  options.map_service_endpoint = manifest.map_service.endpoint;
  options.router_endpoint = manifest.router.worker_endpoint;
  options.max_batch = static_cast<uint32_t>(group.max_batch);
  options.heartbeat_interval_ms = manifest.heartbeat.interval_ms;
  options.heartbeat_timeout_ms = manifest.heartbeat.timeout_ms;
  // The ablations of the fmoe policy change how the map service matches this rank's contexts.
  options.semantic = group.policy != "fmoe-traj";
  options.delta = group.policy != "fmoe-traj-sem";
  return options;
}

// The leader tells the router how the load goes, so clients see "loading" at once; null when
// the reporter cannot start (logged) or on the other ranks.
std::unique_ptr<LoadReporter> StartLoadReporter(const Place& place, const WorkerOptions& options,
                                                RankOptions* rank_options) {
  if (options.rank != 0) return nullptr;
  auto reporter = std::make_unique<LoadReporter>(LoadReporterOptions{
      place.group->name, options.router_endpoint, place.manifest.heartbeat.interval_ms});
  if (Status s = reporter->Start(); !s.ok()) {
    spdlog::warn("loading progress will not reach the router: {}", s.message());
    return nullptr;
  }
  rank_options->progress = [r = reporter.get()](uint64_t done, uint64_t total) {
    r->Progress(done, total);
  };
  return reporter;
}

// Every rank runs the model (DESIGN section 7): dense weights replicated, routed experts
// (l * J + j) % world == rank; the leader also tokenizes, samples and serves the router. The
// rank's token events and contexts go to `outbox`, which the control plane sends from.
int AssembleRank(const Args& args, const Place& place, const WorkerOptions& options, Outbox* outbox,
                 std::unique_ptr<Rank>* rank) {
  const bool leader = options.rank == 0;
  RankOptions rank_options =
      RankFromManifest(place.manifest, *place.group, options.rank, place.rendezvous);
  if (!args.record_trace.empty() && !leader) {
    spdlog::warn("--record-trace {} ignored: only the leader (rank 0) records", args.record_trace);
  } else {
    rank_options.record_trace = args.record_trace;
  }
  rank_options.on_token = [outbox](const TokenEvent& ev) { outbox->PostEvent(ev); };
  rank_options.on_context = [outbox](MapMessage m) { outbox->PublishContext(std::move(m)); };
  std::unique_ptr<LoadReporter> load_reporter = StartLoadReporter(place, options, &rank_options);
  RankStage stage = RankStage::kOptions;
  auto assembled = Rank::Assemble(std::move(rank_options), &stage);
  if (load_reporter) load_reporter->Stop();  // The Hello takes over.
  if (!assembled.ok()) {
    spdlog::error("{}{}", stage == RankStage::kTrace ? "--record-trace: " : "",
                  assembled.status().message());
    // A rank that cannot join exits 3: the launcher restarts the whole group.
    return stage == RankStage::kJoin      ? kExitGroup
           : stage == RankStage::kOptions ? kExitBadOptions
                                          : kExitLoad;
  }
  *rank = std::move(*assembled);
  return 0;
}

// Runs the compute thread and the control loop until a stop signal or a broken group, then
// takes both down; the exit code.
int Serve(const Args& args, const Place& place, StopSignals& signals, Rank& rank, Worker& worker) {
  const bool leader = args.rank == 0;
  // The compute thread: after a stop signal a follower keeps following until the leader's stop
  // plan (it is stopping too) or the grace period ends.
  const auto grace = std::chrono::milliseconds(2 * place.manifest.heartbeat.timeout_ms);
  std::atomic<bool> compute_done{false};
  std::thread compute_thread([&] {
    rank.RunCompute([&] { return signals.stop_requested(); }, grace);
    compute_done = true;
  });
  worker.Run([&] { return signals.stop_requested() || rank.group_failed(); },
             [ready_fd = args.ready_fd] {
               spdlog::info("ready");
               NotifyReady(ready_fd);
             });
  rank.Wake();
  // A rank blocked in a collective comes back within the keep-alive interval (or when a peer
  // leaves); past the grace period it is abandoned.
  const auto join_deadline = std::chrono::steady_clock::now() + grace + std::chrono::seconds(5);
  while (!compute_done && std::chrono::steady_clock::now() < join_deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (!compute_done) {
    spdlog::error("the {} thread did not return; leaving without it",
                  leader ? "engine" : "follower");
    spdlog::default_logger()->flush();
    std::_Exit(rank.group_failed() ? kExitGroup : 0);
  }
  compute_thread.join();
  rank.Finish();
  const ContextStats cx = worker.context_stats();
  spdlog::info(
      "map service contexts: {} published, {} sent, {} dropped (queue full), {} dropped (map "
      "service away), {} refused by the socket; {} directives and {} stored maps received",
      cx.published, cx.sent, cx.dropped_full, cx.dropped_offline, cx.send_failed, cx.directives,
      cx.maps_stored);
  if (rank.group_failed()) {
    const std::string why = rank.group_failure();
    // The router fails this group's running requests and re-queues the rest at once.
    if (Status s = worker.SendGoodbye(why); !s.ok()) spdlog::warn("{}", s.message());
    spdlog::error("leaving: {} (the launcher restarts the group)", why);
    spdlog::default_logger()->flush();
    // Nothing here is worth a careful teardown: a process group with a dead peer may block in
    // its destructor.
    std::_Exit(kExitGroup);
  }
  spdlog::info("stopped (signal {})", signals.last_signal());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"fmoe-worker: one rank of an fmoe worker group"};
  Args args;
  app.add_option("--manifest", args.manifest_path, "cluster manifest (YAML)")->required();
  app.add_option("--group", args.group_name, "worker group name in the manifest")->required();
  app.add_option("--rank", args.rank, "rank within the group")
      ->required()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--ready-fd", args.ready_fd, "file descriptor to write READY to once serving");
  app.add_option(
      "--record-trace", args.record_trace,
      "write the expert routing trace (common/model/expert_trace.h) to this file; leader "
      "(rank 0) only");
  CLI11_PARSE(app, argc, argv);

  Place place;
  if (int rc = FindPlace(args, &place); rc != 0) return rc;
  StopSignals& signals = StopSignals::Install();
  WorkerOptions options =
      ControlFromManifest(place.manifest, *place.group, static_cast<uint32_t>(args.rank));
  spdlog::info("worker: group={} rank={}/{} map_service={} router={}", options.group, options.rank,
               options.world_size, options.map_service_endpoint,
               options.rank == 0 ? options.router_endpoint : "-");

  Outbox outbox(options.context_queue);
  std::unique_ptr<Rank> rank;
  if (int rc = AssembleRank(args, place, options, &outbox, &rank); rc != 0) return rc;
  if (options.rank == 0) {
    options.expert_figures = [&rank] { return rank->group_figures(); };
    options.kv_figures = [&rank] { return rank->kv_figures(); };
    options.engine_figures = [&rank] { return rank->engine_figures(); };
  }
  // Every rank receives the group's directives and keeps those for its own experts.
  options.on_directive = [&rank](const PrefetchDirective& d) { rank->PostDirective(d); };
  Worker worker(options, rank->info(), SteadyClock::Get(), rank->engine(), &outbox);
  if (Status s = worker.Start(); !s.ok()) {
    spdlog::error("{}", s.message());
    return kExitLoad;
  }
  return Serve(args, place, signals, *rank, worker);
}
