#include "services/maps_cmd.h"

#include <cstdio>
#include <filesystem>

#include "common/json.h"
#include "common/wire/wire.h"

namespace fmoe {
namespace {

using Json = nlohmann::json;

bool ParseFingerprint(const std::string& text, uint64_t* out) {
  if (text.empty() || text.size() > 16) return false;
  uint64_t v = 0;
  for (char c : text) {
    int d = (c >= '0' && c <= '9')   ? c - '0'
            : (c >= 'a' && c <= 'f') ? c - 'a' + 10
            : (c >= 'A' && c <= 'F') ? c - 'A' + 10
                                     : -1;
    if (d < 0) return false;
    v = (v << 4) | static_cast<uint64_t>(d);
  }
  *out = v;
  return true;
}

void PrintStats(const Json& s) {
  std::printf("map service %s, up %.0f s, data %s\n", s.value("endpoint", "?").c_str(),
              s.value("uptime_s", 0.0), s.value("data_dir", "?").c_str());
  std::printf("%-18s %6s %6s %6s %9s %9s\n", "MODEL", "L", "J", "h", "MAPS", "REPLACED");
  for (const auto& m : s["models"]) {
    std::printf("%-18s %6d %6d %6d %4d/%-4d %9llu\n", m.value("fingerprint", "?").c_str(),
                m.value("num_layers", 0), m.value("num_experts", 0), m.value("hidden_size", 0),
                m.value("maps", 0), m.value("capacity", 0),
                static_cast<unsigned long long>(m.value("replaced", uint64_t{0})));
  }
  const Json& c = s["counters"];
  const Json& lat = s["match_latency_us"];
  std::printf(
      "contexts %llu (%.1f/s over the last 10 s), invalid %llu, directives sent %llu, maps "
      "stored %llu\n",
      static_cast<unsigned long long>(s.value("contexts", uint64_t{0})),
      s.value("ingest_per_s", 0.0),
      static_cast<unsigned long long>(c.value("contexts_invalid", uint64_t{0})),
      static_cast<unsigned long long>(c.value("directives_sent", uint64_t{0})),
      static_cast<unsigned long long>(c.value("maps_stored", uint64_t{0})));
  std::printf("match latency: p50 %.0f us, p99 %.0f us over %llu matches\n", lat.value("p50", 0.0),
              lat.value("p99", 0.0),
              static_cast<unsigned long long>(lat.value("count", uint64_t{0})));
  if (s.contains("models_not_loaded")) {
    for (const auto& m : s["models_not_loaded"]) {
      std::printf("not loaded: model %s (L=%d J=%d h=%d): %s\n",
                  m.value("fingerprint", "?").c_str(), m.value("num_layers", 0),
                  m.value("num_experts", 0), m.value("hidden_size", 0),
                  m.value("reason", "?").c_str());
    }
  }
  if (s.contains("store") && s["store"].value("state", "ok") != "ok") {
    const Json& st = s["store"];
    std::printf("store: %s (read-only) for %.0f s: %s; %llu writes failed or refused\n",
                st.value("state", "?").c_str(), st.value("degraded_s", 0.0),
                st.value("reason", "?").c_str(),
                static_cast<unsigned long long>(st.value("writes_failed", uint64_t{0})));
  }
}

}  // namespace

int RunMaps(const Manifest& manifest, const MapsCommand& command) {
  if (!command.export_path.empty() + !command.import_path.empty() + !command.drop.empty() > 1) {
    std::fprintf(stderr, "fmoe maps: --export, --import and --drop exclude each other\n");
    return 2;
  }
  AdminRequest req;
  req.id = 1;
  req.op = AdminOp::kStats;
  if (!command.model.empty() && !ParseFingerprint(command.model, &req.model_fingerprint)) {
    std::fprintf(stderr, "fmoe maps: --model \"%s\" is not a fingerprint (up to 16 hex digits)\n",
                 command.model.c_str());
    return 2;
  }
  if (!command.export_path.empty() || !command.import_path.empty()) {
    req.op = command.export_path.empty() ? AdminOp::kImport : AdminOp::kExport;
    std::error_code ec;
    auto path = std::filesystem::absolute(
        command.export_path.empty() ? command.import_path : command.export_path, ec);
    if (ec) {
      std::fprintf(stderr, "fmoe maps: %s\n", ec.message().c_str());
      return 2;
    }
    req.path = path.lexically_normal().string();
  }
  if (!command.drop.empty()) {
    if (!ParseFingerprint(command.drop, &req.model_fingerprint) || req.model_fingerprint == 0) {
      std::fprintf(stderr, "fmoe maps: --drop \"%s\" is not a model fingerprint (hex)\n",
                   command.drop.c_str());
      return 2;
    }
    req.op = AdminOp::kDrop;
  }
  const std::string& endpoint = manifest.map_service.endpoint;
  wire::Context context;
  wire::SocketOptions opts;
  opts.send_hwm = 1;
  auto socket = wire::MapSocket::Connect(context, wire::Role::kDealer, endpoint, opts);
  if (!socket.ok()) {
    std::fprintf(stderr, "fmoe maps: %s\n", socket.status().message().c_str());
    return 1;
  }
  if (Status s = (*socket)->Send(req); !s.ok()) {
    std::fprintf(stderr, "fmoe maps: %s\n", s.message().c_str());
    return 1;
  }
  auto reply = (*socket)->Receive(command.timeout_ms);
  if (!reply) {
    std::fprintf(stderr, "fmoe maps: no answer from the map service at %s within %d s\n",
                 endpoint.c_str(), command.timeout_ms / 1000);
    return 1;
  }
  const auto* r = std::get_if<AdminReply>(&reply->message);
  if (r == nullptr) {
    std::fprintf(stderr, "fmoe maps: unexpected %s from %s\n",
                 std::string(wire::MessageName(reply->message)).c_str(), endpoint.c_str());
    return 1;
  }
  if (!r->ok) {
    std::fprintf(stderr, "fmoe maps: %s\n", r->error.c_str());
    return 1;
  }
  Json body = Json::parse(r->json, nullptr, false);
  if (body.is_discarded()) {
    std::fprintf(stderr, "fmoe maps: malformed reply from %s\n", endpoint.c_str());
    return 1;
  }
  if (command.json) {
    std::printf("%s\n", body.dump(2).c_str());
  } else if (req.op == AdminOp::kExport) {
    std::printf("exported %llu maps of model %s to %s (%llu bytes)\n",
                static_cast<unsigned long long>(body.value("maps", uint64_t{0})),
                body.value("model", "?").c_str(), body.value("path", "?").c_str(),
                static_cast<unsigned long long>(body.value("bytes", uint64_t{0})));
  } else if (!command.drop.empty()) {
    std::printf("dropped model %s: %llu maps removed, %llu MiB freed\n",
                body.value("model", "?").c_str(),
                static_cast<unsigned long long>(body.value("maps_removed", uint64_t{0})),
                static_cast<unsigned long long>(body.value("bytes_freed", uint64_t{0}) >> 20));
  } else if (req.op == AdminOp::kImport) {
    std::printf(
        "imported %llu maps of model %s (%llu replaced a stored map, %llu skipped); the store "
        "holds %llu\n",
        static_cast<unsigned long long>(body.value("imported", uint64_t{0})),
        body.value("model", "?").c_str(),
        static_cast<unsigned long long>(body.value("replaced", uint64_t{0})),
        static_cast<unsigned long long>(body.value("skipped", uint64_t{0})),
        static_cast<unsigned long long>(body.value("maps", uint64_t{0})));
  } else {
    PrintStats(body);
  }
  return 0;
}

}  // namespace fmoe
