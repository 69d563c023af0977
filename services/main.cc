// fmoe: the launcher and command-line tool.
//   fmoe launch MANIFEST     start and supervise the cluster in the foreground
//     [--workers-only] [--host NAME]   only this host's worker ranks (the other hosts)
//   fmoe status MANIFEST     each process of the manifest, on every host, and whether it is
//     [--json] [--timeout-ms N]  reachable from here (exit 0 all up, 1 unhealthy, 3 unreachable)
//   fmoe validate MANIFEST   check a manifest and print the effective configuration
//   fmoe generate --model DIR --prompt TEXT   run a model locally: execs fmoe-generate, the
//                                            LibTorch binary next to this one (LibTorch builds)
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include "common/log.h"
#include "common/manifest.h"
#include "common/model/model_config.h"
#include "common/process_util.h"
#include "common/wire/curve_key.h"
#include "services/generate_cmd.h"
#include "services/launcher.h"
#include "services/maps_cmd.h"
#include "services/status_cmd.h"

namespace {

// Loads the manifest or prints why not; exit code 2 for a bad manifest.
int LoadOrExplain(const std::string& path, fmoe::Manifest* out) {
  auto manifest = fmoe::LoadManifest(path);
  if (!manifest.ok()) {
    std::fprintf(stderr, "fmoe: %s\n", manifest.status().message().c_str());
    return 2;
  }
  *out = std::move(*manifest);
  return 0;
}

// Each group's expert tiers per rank against the model's experts: the device cache, the host
// tier (or every expert in host memory), and what stays on disk.
std::string DescribeTiers(const fmoe::Manifest& manifest, const fmoe::ModelInfo& info) {
  const uint64_t expert = fmoe::RoutedExpertBytes(info);
  const uint64_t all = uint64_t{info.num_moe_layers} * info.num_experts;
  if (expert == 0 || all == 0) return "";
  auto mb = [](double bytes) { return fmt::format("{:.1f} MB", bytes / 1e6); };
  std::string out = "expert tiers (per rank; a routed expert is " + mb(expert) + "):\n";
  for (const fmoe::WorkerGroupSpec& g : manifest.worker_groups) {
    const uint64_t world = std::max<size_t>(1, g.workers.size());
    const uint64_t owned = (all + world - 1) / world;
    auto slots = [&](std::optional<double> gb, std::optional<double> fraction) {
      const double n = gb ? std::floor(*gb * 1e9 / static_cast<double>(expert))
                          : std::floor(fraction.value_or(1.0) * static_cast<double>(owned) + 1e-9);
      return static_cast<uint64_t>(std::clamp<double>(n, 0, static_cast<double>(owned)));
    };
    out += fmt::format("  group {}: {} of {} experts per rank ({})\n", g.name, owned, all,
                       mb(static_cast<double>(owned * expert)));
    if (g.expert_cache_auto) {
      out += fmt::format("    device: auto ({:g} of the free memory, sized at start)\n",
                         g.memory_utilization);
    } else {
      const uint64_t d = slots(g.expert_cache_gb, g.expert_cache_fraction);
      out += fmt::format("    device: {} experts ({}){}\n", d, mb(static_cast<double>(d * expert)),
                         d == 0 ? ": holds no expert, the worker will refuse it" : "");
    }
    if (g.host_cache_auto) {
      out +=
          "    host: auto (every expert if they fit in the available memory less 4 GiB, else "
          "what fits); the rest read from the checkpoint on disk\n";
    } else if (g.host_cache_gb || g.host_cache_fraction) {
      const uint64_t h = slots(g.host_cache_gb, g.host_cache_fraction);
      out += fmt::format(
          "    host: {} experts ({}){}; {} experts ({}) read from the checkpoint on disk as "
          "needed\n",
          h, mb(static_cast<double>(h * expert)),
          h == 0 ? ": holds no expert, the worker will refuse it" : "", owned - std::min(h, owned),
          mb(static_cast<double>((owned - std::min(h, owned)) * expert)));
    } else {
      out += fmt::format("    host: every expert, read into host memory at start ({})\n",
                         mb(static_cast<double>(owned * expert)));
    }
  }
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  // `fmoe generate ARGS...` runs in fmoe-generate, which links the model runtime (this binary
  // does not link LibTorch); it parses ARGS itself, --help included.
  if (argc >= 2 && std::strcmp(argv[1], "generate") == 0) {
    return fmoe::ExecGenerate(fmoe::ExecutableDir(), std::string(argv[0]) + " generate",
                              std::vector<std::string>(argv + 2, argv + argc));
  }
  CLI::App app{"fmoe: serve Mixture-of-Experts models with offloaded, prefetched experts"};
  app.require_subcommand(1);
  std::string manifest_path;

  fmoe::LaunchOptions launch_options;
  auto* launch = app.add_subcommand("launch", "start the map service, workers and router");
  launch->add_option("manifest", manifest_path, "cluster manifest (YAML)")->required();
  launch->add_flag("--workers-only", launch_options.workers_only,
                   "start only this host's worker ranks: no map service, no router (the other "
                   "hosts of a multi-host manifest)");
  launch
      ->add_option("--host", launch_options.host,
                   "this host's name as workers[].host writes it; a rank is local when its host "
                   "equals NAME (default: a loopback name, 0.0.0.0 or the hostname)")
      ->type_name("NAME")
      ->check([](const std::string& name) {
        return name.empty() ? std::string("must not be empty") : std::string();
      });
  launch->footer(
      "Each host's launcher needs its own launcher.run_dir (not one shared between hosts): it "
      "holds the launcher's lock, launcher.json and the logs.");
  fmoe::StatusOptions status_options;
  auto* status = app.add_subcommand(
      "status", "probe each process of the manifest, on every host, and show its health");
  status->add_option("manifest", manifest_path, "cluster manifest (YAML)")->required();
  status->add_flag("--json", status_options.json, "print JSON");
  status
      ->add_option("--timeout-ms", status_options.timeout_ms,
                   "bound of each probe (connect, then the answer); the probes run at once")
      ->check(CLI::Range(1, 60000))
      ->capture_default_str();
  status->footer(
      "Exit status: 0 every process is up; 1 all are reachable but one reports a problem "
      "(/health not 200, a group not alive, a store read-only, a process given up on); 2 the "
      "manifest does not load; 3 at least one process is not reachable.");
  fmoe::MapsCommand maps_cmd;
  auto* maps =
      app.add_subcommand("maps", "show, export, import or drop the map service's expert maps");
  maps->add_option("manifest", manifest_path, "cluster manifest (YAML)")->required();
  auto* export_opt = maps->add_option("--export", maps_cmd.export_path,
                                      "write a model's maps to FILE (on the map service's host)");
  auto* import_opt =
      maps->add_option("--import", maps_cmd.import_path,
                       "load maps from FILE written by --export (on the map service's host)")
          ->excludes(export_opt);
  maps->add_option("--drop", maps_cmd.drop,
                   "remove model MODEL (fingerprint, hex) from the store: its maps and records")
      ->excludes(export_opt)
      ->excludes(import_opt);
  maps->add_option("--model", maps_cmd.model,
                   "model fingerprint (hex); default: the only stored model");
  maps->add_flag("--json", maps_cmd.json, "print the service's JSON reply");
  auto* validate = app.add_subcommand("validate", "check a manifest, print the effective config");
  validate->add_option("manifest", manifest_path, "cluster manifest (YAML)")->required();
  // Listed for --help; main() hands it to fmoe-generate before parsing.
  app.add_subcommand("generate",
                     "run a model locally on one prompt (fmoe generate --help for its options)");
  CLI11_PARSE(app, argc, argv);

  fmoe::Manifest manifest;
  if (int rc = LoadOrExplain(manifest_path, &manifest); rc != 0) return rc;
  if (validate->parsed()) {
    std::printf("%s", fmoe::DescribeManifest(manifest).c_str());
    // The model as every process will read it; a family the runtime does not run fails here.
    auto model = fmoe::LoadModelInfo(manifest.model.path);
    if (!model.ok()) {
      std::fprintf(stderr, "fmoe: model.path: %s\n", model.status().message().c_str());
      return 1;
    }
    std::printf("%s", fmoe::DescribeModel(*model).c_str());
    std::printf("%s", DescribeTiers(manifest, *model).c_str());
    if (!model->runtime_unsupported.empty()) {
      std::fprintf(stderr, "fmoe: model.path: %s: %s\n", model->dir.c_str(),
                   model->runtime_unsupported.c_str());
      return 1;
    }
    return 0;
  }
  if (status->parsed() || maps->parsed()) {
    // They speak to the map service: with the cluster's key, which the launcher made.
    if (fmoe::Status s =
            fmoe::wire::UseClusterKey(manifest.security.curve, manifest.security.key_file, false);
        !s.ok()) {
      // `fmoe status` still reports the processes (none, when no launcher made the key).
      if (maps->parsed() || s.code() != fmoe::ErrorCode::kNotFound) {
        std::fprintf(stderr, "fmoe: %s\n", s.message().c_str());
      }
      if (maps->parsed()) return 1;
    }
  }
  if (status->parsed()) return fmoe::PrintStatus(manifest, status_options);
  if (maps->parsed()) return fmoe::RunMaps(manifest, maps_cmd);

  if (fmoe::Status s = fmoe::InitLogging("fmoe", manifest.logging.level); !s.ok()) {
    std::fprintf(stderr, "fmoe: %s\n", s.message().c_str());
    return 2;
  }
  // One log line per line of the description (a log line holds no newline).
  spdlog::info("effective configuration:");
  std::istringstream description(fmoe::DescribeManifest(manifest));
  for (std::string line; std::getline(description, line);) spdlog::info("  {}", line);
  launch_options.bin_dir = fmoe::ExecutableDir();
  return fmoe::Launch(manifest, launch_options);
}
