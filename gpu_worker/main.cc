// fmoe-worker: one rank of a worker group. Reads the manifest, checks its device, loads the model
// (dense weights and the routed experts this rank owns; the leader also the tokenizer), joins the
// group's ranks (c10d), registers with the map service (and, as leader, with the router), reports
// readiness and serves until SIGINT/SIGTERM. Threads: main (control plane, gpu_worker/worker.h),
// compute (the engine on the leader, gpu_worker/engine.h; the follower elsewhere,
// gpu_worker/follower.h), signal waiter. Exit 3: the group broke (a rank left, a collective
// timed out); the launcher restarts every rank of the group. With --record-trace the leader
// writes the expert routing trace (gpu_worker/trace_recorder.h) and closes it on the way out.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include <CLI/CLI.hpp>

#include "common/log.h"
#include "common/manifest.h"
#include "common/model_config.h"
#include "common/process_util.h"
#include "common/service_setup.h"
#include "common/tokenizer.h"
#include "gpu_worker/cached_experts.h"
#include "gpu_worker/device.h"
#include "gpu_worker/engine.h"
#include "gpu_worker/expert_group.h"
#include "gpu_worker/follower.h"
#include "gpu_worker/load_reporter.h"
#include "gpu_worker/map_publisher.h"
#include "gpu_worker/model.h"
#include "gpu_worker/trace_recorder.h"
#include "gpu_worker/worker.h"

int main(int argc, char** argv) {
  using namespace fmoe;
  CLI::App app{"fmoe-worker: one rank of an fmoe worker group"};
  std::string manifest_path, group_name;
  int rank = 0;
  int ready_fd = -1;
  std::string record_trace;
  app.add_option("--manifest", manifest_path, "cluster manifest (YAML)")->required();
  app.add_option("--group", group_name, "worker group name in the manifest")->required();
  app.add_option("--rank", rank, "rank within the group")
      ->required()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--ready-fd", ready_fd, "file descriptor to write READY to once serving");
  app.add_option("--record-trace", record_trace,
                 "write the expert routing trace (common/expert_trace.h) to this file; leader "
                 "(rank 0) only");
  CLI11_PARSE(app, argc, argv);

  Manifest manifest;
  const std::string log_name = "worker-" + group_name + "-" + std::to_string(rank);
  if (int rc = SetUpService("fmoe-worker", manifest_path, log_name, &manifest); rc != 0) {
    return rc;
  }
  StopSignals& signals = StopSignals::Install();
  const WorkerGroupSpec* group = FindGroup(manifest, group_name);
  if (group == nullptr) {
    spdlog::error("group \"{}\" is not in {}", group_name, manifest_path);
    return 2;
  }
  if (rank >= static_cast<int>(group->workers.size())) {
    spdlog::error("group {} has {} ranks; rank {} does not exist", group_name,
                  group->workers.size(), rank);
    return 2;
  }
  const WorkerSpec& spec = group->workers[static_cast<size_t>(rank)];

  auto model = LoadModelInfo(manifest.model.path);
  if (!model.ok()) {
    spdlog::error("{}", model.status().message());
    return 1;
  }
  // Ranks of a group share the machine's cores.
  const unsigned cores = std::max(1u, std::thread::hardware_concurrency());
  const int threads = static_cast<int>(std::max<size_t>(1, cores / group->workers.size()));
  auto device = ResolveDevice(spec.device, spec.cuda_index, threads);
  if (!device.ok()) {
    spdlog::error("{}", device.status().message());
    return 1;
  }

  // Manifest -> options, in this one place.
  WorkerOptions options;
  options.group = group->name;
  options.rank = static_cast<uint32_t>(rank);
  options.world_size = static_cast<uint32_t>(group->workers.size());
  options.model_name = manifest.model.name;
  options.map_service_endpoint = manifest.map_service.endpoint;
  options.router_endpoint = manifest.router.worker_endpoint;
  options.max_batch = static_cast<uint32_t>(group->max_batch);
  options.heartbeat_interval_ms = manifest.heartbeat.interval_ms;
  options.heartbeat_timeout_ms = manifest.heartbeat.timeout_ms;
  // The ablations of the fmoe policy change how the map service matches this rank's contexts.
  options.semantic = group->policy != "fmoe-traj";
  options.delta = group->policy != "fmoe-traj-sem";
  spdlog::info(
      "effective config: group={} rank={}/{} device={} policy={} max_batch={} map_service={} "
      "router={} link={}GB/s+{}us cache={}",
      options.group, options.rank, options.world_size, device->description, group->policy,
      options.max_batch, options.map_service_endpoint,
      options.rank == 0 ? options.router_endpoint : "-", group->link.gbps, group->link.latency_us,
      group->expert_cache_gb
          ? fmt::format("{:g} GB", *group->expert_cache_gb)
          : fmt::format("{:g} of experts", group->expert_cache_fraction.value_or(1.0)));
  spdlog::info("model {} ({}): L={} J={} K={} h={} vocab={} fingerprint={} weight files={}",
               manifest.model.name, model->architecture, model->num_moe_layers, model->num_experts,
               model->top_k, model->hidden_size, model->vocab_size,
               FingerprintHex(model->fingerprint), model->weight_files.size());

  // Every rank runs the model (DESIGN section 7): dense weights replicated, routed experts
  // (l * J + j) % world == rank; the leader also tokenizes, samples and serves the router.
  const bool leader = options.rank == 0;
  // The trace is opened before the weights load, so a bad path fails the start at once.
  std::unique_ptr<TraceRecorder> recorder;
  if (!record_trace.empty() && !leader) {
    spdlog::warn("--record-trace {} ignored: only the leader (rank 0) records", record_trace);
  } else if (!record_trace.empty()) {
    TraceRecorderOptions trace_options;
    trace_options.path = record_trace;
    // Speculation entries at the map service's prefetch distance, whatever the policy.
    trace_options.speculation_distance =
        static_cast<uint32_t>(manifest.map_service.prefetch_distance);
    trace_options.header = WorkerTraceHeader(*model, manifest.model.name, group->name, options.rank,
                                             trace_options.speculation_distance);
    auto opened = TraceRecorder::Open(trace_options);
    if (!opened.ok()) {
      spdlog::error("--record-trace: cannot write the trace: {}", opened.status().message());
      return 1;
    }
    recorder = std::move(*opened);
    if (!recorder->kept_previous().empty()) {
      spdlog::info("kept the previous trace as {}", recorder->kept_previous());
    }
    spdlog::info("recording the expert trace to {} (speculation distance {})", record_trace,
                 trace_options.speculation_distance);
  }
  std::unique_ptr<Tokenizer> tokenizer;
  if (leader) {
    auto tok = Tokenizer::Load(model->dir);
    if (!tok.ok()) {
      spdlog::error("{}", tok.status().message());
      return 1;
    }
    tokenizer = std::move(*tok);
  }
  RuntimeOptions runtime_options;
  runtime_options.dtype = manifest.model.dtype;
  runtime_options.cuda_index = device->cuda_index;
  runtime_options.expert_rank = options.rank;
  runtime_options.expert_world_size = options.world_size;
  ExpertTable table;
  // The leader tells the router how the load goes, so clients see "loading" at once.
  std::unique_ptr<LoadReporter> load_reporter;
  if (leader) {
    load_reporter = std::make_unique<LoadReporter>(
        LoadReporterOptions{group->name, options.router_endpoint, manifest.heartbeat.interval_ms});
    if (Status s = load_reporter->Start(); !s.ok()) {
      spdlog::warn("loading progress will not reach the router: {}", s.message());
      load_reporter.reset();
    }
  }
  const auto t0 = std::chrono::steady_clock::now();
  int last_decile = -1;
  auto loaded = MoeModel::Load(
      *model, runtime_options,
      [&](uint64_t done, uint64_t total) {
        if (load_reporter) load_reporter->Progress(done, total);
        if (total == 0) return;
        const int decile = static_cast<int>(10 * done / total);
        if (decile != last_decile && decile % 5 == 0) {
          spdlog::info("loading weights: {}% of {:.1f} MB", decile * 10, total / 1e6);
        }
        last_decile = decile;
      },
      &table);
  if (!loaded.ok()) {
    spdlog::error("{}", loaded.status().message());
    return 1;
  }
  std::unique_ptr<MoeModel> runtime = std::move(*loaded);
  spdlog::info("model loaded in {:.2f} s (dtype {})",
               std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count(),
               runtime_options.dtype);
  CachedExpertsOptions cache_options;
  cache_options.policy = group->policy;
  cache_options.top_k = model->top_k;
  cache_options.policy_options.prefetch_distance =
      static_cast<uint32_t>(manifest.map_service.prefetch_distance);
  cache_options.cache_gb = group->expert_cache_gb;
  cache_options.cache_fraction = group->expert_cache_fraction;
  cache_options.link.gbps = group->link.gbps;
  cache_options.link.latency_us = group->link.latency_us;
  cache_options.cuda_index = device->cuda_index;
  cache_options.rank = options.rank;
  cache_options.world_size = options.world_size;
  auto cached = CachedExperts::Create(std::move(table), cache_options);
  if (!cached.ok()) {
    spdlog::error("{}", cached.status().message());
    return 1;
  }
  std::unique_ptr<CachedExperts> experts = std::move(*cached);

  // The group: rendezvous once the weights are in, so a slow loader does not eat the others'
  // collective timeout.
  auto rendezvous = ParseHostPort(group->rendezvous);
  if (!rendezvous.ok()) {
    spdlog::error("worker_groups.{}.rendezvous: {}", group->name, rendezvous.status().message());
    return 2;
  }
  ExpertGroupOptions group_options;
  group_options.group = group->name;
  group_options.rank = options.rank;
  group_options.world_size = options.world_size;
  group_options.rendezvous_host = rendezvous->host;
  group_options.rendezvous_port = rendezvous->port;
  group_options.host = spec.host == "localhost" ? "127.0.0.1" : spec.host;
  group_options.cuda_index = device->cuda_index;
  group_options.rendezvous_timeout =
      std::chrono::milliseconds(static_cast<int64_t>(group->rendezvous_timeout_s * 1000));
  group_options.collective_timeout =
      std::chrono::milliseconds(static_cast<int64_t>(group->collective_timeout_s * 1000));
  auto joined = ExpertGroup::Join(group_options);
  if (!joined.ok()) {
    spdlog::error("{}", joined.status().message());
    return 3;
  }
  std::unique_ptr<ExpertGroup> expert_group = std::move(*joined);
  runtime->set_group(expert_group.get());

  auto local_figures = [&experts] {
    const CacheCounters t = experts->stats().total;
    return ExpertFigures{t.hits,
                         t.misses,
                         t.prefetches_issued,
                         t.prefetches_used,
                         t.bytes_moved,
                         static_cast<uint64_t>(t.stall_ns / 1000)};
  };
  // Set once when the group breaks (a peer left, a collective timed out, the ranks disagree).
  std::atomic<bool> group_failed{false};
  std::mutex failure_mu;
  std::string failure;
  auto on_group_failure = [&](const Status& why) {
    {
      std::lock_guard<std::mutex> lock(failure_mu);
      if (failure.empty()) failure = why.message();
    }
    group_failed = true;
  };

  std::unique_ptr<Engine> engine;
  std::unique_ptr<MapPublisher> publisher;
  ObserverFanOut observers;  // The publisher and, when recording, the trace recorder.
  std::unique_ptr<Follower> follower;
  Worker* worker_ptr = nullptr;
  if (leader) {
    EngineOptions engine_options;
    engine_options.max_batch = options.max_batch;
    engine_options.eos_token_ids = model->eos_token_ids;
    if (auto eos = tokenizer->eos_id(); eos && engine_options.eos_token_ids.empty()) {
      engine_options.eos_token_ids.push_back(*eos);
    }
    engine_options.group = expert_group.get();
    engine_options.local_figures = local_figures;
    engine_options.on_group_failure = on_group_failure;
    // Only the leader publishes contexts (DESIGN section 7), through the worker's bounded queue;
    // never blocks.
    publisher = std::make_unique<MapPublisher>([&worker_ptr](MapMessage m) {
      if (worker_ptr != nullptr) worker_ptr->PublishContext(std::move(m));
    });
    observers.Add(publisher.get());
    observers.Add(recorder.get());
    engine = std::make_unique<Engine>(engine_options, *runtime, *experts, tokenizer.get(),
                                      &observers, [&worker_ptr](const TokenEvent& ev) {
                                        if (worker_ptr != nullptr) worker_ptr->PostEvent(ev);
                                      });
    options.expert_figures = [&engine] { return engine->group_figures(); };
  } else {
    follower = std::make_unique<Follower>(*runtime, *experts, *expert_group, options.max_batch,
                                          local_figures);
  }
  // Every rank receives the group's directives and keeps those for its own experts.
  options.on_directive = [&experts](const PrefetchDirective& d) { experts->PostDirective(d); };

  if (load_reporter) load_reporter->Stop();  // The Hello takes over.
  Worker worker(options, *model, SteadyClock::Get(), engine.get());
  worker_ptr = &worker;
  if (Status s = worker.Start(); !s.ok()) {
    spdlog::error("{}", s.message());
    return 1;
  }
  std::thread compute_thread;
  std::atomic<bool> compute_done{false};
  if (engine) {
    compute_thread = std::thread([&] {
      // Run is each iteration's boundary (engine.h); what still escapes it (a keep-alive plan's
      // send) starts it again alone, and breaks a group.
      while (!signals.stop_requested() && !group_failed.load()) {
        try {
          engine->Run([&] { return signals.stop_requested(); });
          break;
        } catch (const std::exception& e) {
          spdlog::error("group={} the engine loop threw: {}", options.group, e.what());
          if (options.world_size > 1) {
            on_group_failure(Internal(std::string("the engine loop threw: ") + e.what()));
            break;
          }
        }
      }
      compute_done = true;
    });
  } else {
    compute_thread = std::thread([&] {
      // After a stop signal, keep following until the leader's stop plan (it is stopping too)
      // or the grace period ends, so the group winds down without a broken collective.
      Status s;
      try {
        s = follower->Run([&] { return signals.stop_requested(); },
                          std::chrono::milliseconds(2 * manifest.heartbeat.timeout_ms));
      } catch (const std::exception& e) {  // The group cannot go on, but the rank says so.
        s = Internal(std::string("the follower loop threw: ") + e.what());
      }
      if (!s.ok() && !signals.stop_requested()) on_group_failure(s);
      if (s.ok() && !signals.stop_requested()) {
        on_group_failure(Unavailable("the leader of group " + group->name + " stopped"));
      }
      compute_done = true;
    });
  }
  worker.Run([&] { return signals.stop_requested() || group_failed.load(); },
             [ready_fd] {
               spdlog::info("ready");
               NotifyReady(ready_fd);
             });
  if (engine) engine->Wake();
  // A rank blocked in a collective comes back within the keep-alive interval (or when a peer
  // leaves); past the grace period it is abandoned.
  const auto join_deadline = std::chrono::steady_clock::now() +
                             std::chrono::milliseconds(2 * manifest.heartbeat.timeout_ms + 5000);
  while (!compute_done && std::chrono::steady_clock::now() < join_deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  if (!compute_done) {
    spdlog::error("the {} thread did not return; leaving without it",
                  leader ? "engine" : "follower");
    spdlog::default_logger()->flush();
    std::_Exit(group_failed ? 3 : 0);
  }
  compute_thread.join();
  if (recorder) {
    // Requests still running get their last recorded iteration marked last.
    const Status closed = recorder->Close();
    const TraceRecorderStats& ts = recorder->stats();
    if (closed.ok()) {
      spdlog::info("trace {}: {} records, {} requests ended, {} iterations dropped",
                   recorder->path(), ts.records, ts.requests, ts.dropped);
    } else {
      spdlog::error("trace {}: {} ({} records written)", recorder->path(), closed.message(),
                    ts.records);
    }
  }
  if (engine) {
    const EngineStats& st = engine->stats();
    spdlog::info(
        "engine: {} iterations, {} prefill and {} decode tokens, {} requests finished, "
        "{} failed",
        st.iterations, st.prefill_tokens, st.decode_tokens, st.requests_finished,
        st.requests_failed);
  } else {
    const FollowerStats& st = follower->stats();
    spdlog::info("follower: {} plans, {} iterations, {} prefill and {} decode tokens", st.plans,
                 st.iterations, st.prefill_tokens, st.decode_tokens);
  }
  const GroupStats gs = expert_group->stats();
  spdlog::info(
      "expert group: {} backend, {} combines, {} broadcasts, {} sums, {:.2f} MB payload sent, "
      "{:.1f} ms in collectives",
      expert_group->backend(), gs.combines, gs.broadcasts, gs.sums, gs.payload_bytes / 1e6,
      gs.wait_us / 1e3);
  const CacheStats cs = experts->stats();
  const CacheCounters& t = cs.total;
  spdlog::info(
      "expert cache: {} hits, {} misses ({} late prefetches), {} prefetches ({} used, {} "
      "wasted), {} evictions, {:.1f} MB moved, {:.1f} ms stalled",
      t.hits, t.misses, t.late_prefetches, t.prefetches_issued, t.prefetches_used,
      t.prefetches_wasted, t.evictions, t.bytes_moved / 1e6, t.stall_ns / 1e6);
  const ContextStats cx = worker.context_stats();
  spdlog::info(
      "map service contexts: {} published, {} sent, {} dropped (queue full), {} dropped (map "
      "service away), {} refused by the socket; {} directives and {} stored maps received",
      cx.published, cx.sent, cx.dropped_full, cx.dropped_offline, cx.send_failed, cx.directives,
      cx.maps_stored);
  if (group_failed) {
    std::string why;
    {
      std::lock_guard<std::mutex> lock(failure_mu);
      why = failure;
    }
    // The router fails this group's running requests and re-queues the rest at once.
    if (Status s = worker.SendGoodbye(why); !s.ok()) spdlog::warn("{}", s.message());
    spdlog::error("leaving: {} (the launcher restarts the group)", why);
    spdlog::default_logger()->flush();
    // Nothing here is worth a careful teardown: a process group with a dead peer may block in
    // its destructor.
    std::_Exit(3);
  }
  spdlog::info("stopped (signal {})", signals.last_signal());
  return 0;
}
