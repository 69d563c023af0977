// fmoe-worker: one rank of a worker group. Reads the manifest, checks its device, loads the model
// (the leader: weights, tokenizer, engine), registers with the map service (and, as leader, with
// the router), reports readiness and serves until SIGINT/SIGTERM. Threads: main (control plane,
// gpu_worker/worker.h), engine (gpu_worker/engine.h, leader only), signal waiter.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <memory>
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
#include "gpu_worker/map_publisher.h"
#include "gpu_worker/model.h"
#include "gpu_worker/worker.h"

int main(int argc, char** argv) {
  using namespace fmoe;
  CLI::App app{"fmoe-worker: one rank of an fmoe worker group"};
  std::string manifest_path, group_name;
  int rank = 0;
  int ready_fd = -1;
  app.add_option("--manifest", manifest_path, "cluster manifest (YAML)")->required();
  app.add_option("--group", group_name, "worker group name in the manifest")->required();
  app.add_option("--rank", rank, "rank within the group")
      ->required()
      ->check(CLI::NonNegativeNumber);
  app.add_option("--ready-fd", ready_fd, "file descriptor to write READY to once serving");
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

  // The leader runs the model. (Expert-parallel ranks join the computation with issue 7.)
  std::unique_ptr<Tokenizer> tokenizer;
  std::unique_ptr<MixtralModel> runtime;
  std::unique_ptr<CachedExperts> experts;
  std::unique_ptr<Engine> engine;
  std::unique_ptr<MapPublisher> publisher;
  Worker* worker_ptr = nullptr;
  if (options.rank == 0) {
    auto tok = Tokenizer::Load(model->dir);
    if (!tok.ok()) {
      spdlog::error("{}", tok.status().message());
      return 1;
    }
    tokenizer = std::move(*tok);
    RuntimeOptions runtime_options;
    runtime_options.dtype = manifest.model.dtype;
    runtime_options.cuda_index = device->cuda_index;
    ExpertTable table;
    const auto t0 = std::chrono::steady_clock::now();
    int last_decile = -1;
    auto loaded = MixtralModel::Load(
        *model, runtime_options,
        [&](uint64_t done, uint64_t total) {
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
    runtime = std::move(*loaded);
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
    // Until expert parallelism runs the model on every rank, the leader holds every expert.
    cache_options.rank = 0;
    cache_options.world_size = 1;
    auto cached = CachedExperts::Create(std::move(table), cache_options);
    if (!cached.ok()) {
      spdlog::error("{}", cached.status().message());
      return 1;
    }
    experts = std::move(*cached);
    EngineOptions engine_options;
    engine_options.max_batch = options.max_batch;
    engine_options.eos_token_ids = model->eos_token_ids;
    if (auto eos = tokenizer->eos_id(); eos && engine_options.eos_token_ids.empty()) {
      engine_options.eos_token_ids.push_back(*eos);
    }
    // Contexts go to the map service through the worker's bounded queue; never blocks.
    publisher = std::make_unique<MapPublisher>([&worker_ptr](MapMessage m) {
      if (worker_ptr != nullptr) worker_ptr->PublishContext(std::move(m));
    });
    engine = std::make_unique<Engine>(engine_options, *runtime, *experts, tokenizer.get(),
                                      publisher.get(), [&worker_ptr](const TokenEvent& ev) {
                                        if (worker_ptr != nullptr) worker_ptr->PostEvent(ev);
                                      });
  }

  if (experts) {
    options.expert_figures = [&experts] {
      const CacheCounters t = experts->stats().total;
      return ExpertFigures{t.hits,
                           t.misses,
                           t.prefetches_issued,
                           t.prefetches_used,
                           t.bytes_moved,
                           static_cast<uint64_t>(t.stall_ns / 1000)};
    };
    options.on_directive = [&experts](const PrefetchDirective& d) { experts->PostDirective(d); };
  }
  Worker worker(options, *model, SteadyClock::Get(), engine.get());
  worker_ptr = &worker;
  if (Status s = worker.Start(); !s.ok()) {
    spdlog::error("{}", s.message());
    return 1;
  }
  std::thread engine_thread;
  if (engine) {
    engine_thread = std::thread([&] { engine->Run([&] { return signals.stop_requested(); }); });
  }
  worker.Run([&signals] { return signals.stop_requested(); },
             [ready_fd] {
               spdlog::info("ready");
               NotifyReady(ready_fd);
             });
  if (engine_thread.joinable()) {
    engine->Wake();
    engine_thread.join();
    const EngineStats& st = engine->stats();
    spdlog::info(
        "engine: {} iterations, {} prefill and {} decode tokens, {} requests finished, "
        "{} failed",
        st.iterations, st.prefill_tokens, st.decode_tokens, st.requests_finished,
        st.requests_failed);
    const CacheStats cs = experts->stats();
    const CacheCounters& t = cs.total;
    spdlog::info(
        "expert cache: {} hits, {} misses ({} late prefetches), {} prefetches ({} used, {} "
        "wasted), {} evictions, {:.1f} MB moved, {:.1f} ms stalled",
        t.hits, t.misses, t.late_prefetches, t.prefetches_issued, t.prefetches_used,
        t.prefetches_wasted, t.evictions, t.bytes_moved / 1e6, t.stall_ns / 1e6);
  }
  const ContextStats cx = worker.context_stats();
  spdlog::info(
      "map service contexts: {} published, {} sent, {} dropped (queue full), {} dropped (map "
      "service away), {} refused by the socket; {} directives and {} stored maps received",
      cx.published, cx.sent, cx.dropped_full, cx.dropped_offline, cx.send_failed, cx.directives,
      cx.maps_stored);
  spdlog::info("stopped (signal {})", signals.last_signal());
  return 0;
}
