// fmoe-worker: one rank of a worker group. Reads the manifest, loads the model's description,
// checks its device, registers with the map service (and, as leader, with the router), reports
// readiness and serves until SIGINT/SIGTERM.
#include <CLI/CLI.hpp>

#include "common/log.h"
#include "common/manifest.h"
#include "common/model_config.h"
#include "common/process_util.h"
#include "common/service_setup.h"
#include "gpu_worker/device.h"
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
  auto device = ResolveDevice(spec.device, spec.cuda_index);
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
  spdlog::info(
      "effective config: group={} rank={}/{} device={} policy={} max_batch={} map_service={} "
      "router={} link={}Gb/s+{}us cache={}",
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

  Worker worker(options, *model, SteadyClock::Get());
  if (Status s = worker.Start(); !s.ok()) {
    spdlog::error("{}", s.message());
    return 1;
  }
  worker.Run([&signals] { return signals.stop_requested(); },
             [ready_fd] {
               spdlog::info("ready");
               NotifyReady(ready_fd);
             });
  spdlog::info("stopped (signal {})", signals.last_signal());
  return 0;
}
