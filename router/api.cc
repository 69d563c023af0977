#include "router/api.h"

#include <nlohmann/json.hpp>

#include "common/model_config.h"

namespace fmoe {

RouterApi::RouterApi(RouterApiOptions options, const WorkerLink& link)
    : options_(std::move(options)), link_(link) {}

HttpResponse RouterApi::Handle(const HttpRequest& request) const {
  if (request.path == "/health") {
    if (request.method != "GET" && request.method != "HEAD") {
      HttpResponse res = ErrorResponse(
          405, "method " + request.method + " is not allowed on " + request.path + " (use GET)",
          "invalid_request_error", "method_not_allowed");
      res.headers.emplace_back("Allow", "GET, HEAD");
      return res;
    }
    return Health();
  }
  return ErrorResponse(404, "no route " + request.method + " " + request.path,
                       "invalid_request_error", "not_found");
}

HttpResponse RouterApi::Health() const {
  using Json = nlohmann::json;
  auto view = link_.View();
  Json groups = Json::array();
  for (const auto& g : view->groups) {
    Json j = {{"name", g.name},
              {"alive", g.alive},
              {"world_size", g.world_size},
              {"max_batch", g.max_batch},
              {"free_slots", g.free_slots},
              {"active_requests", g.active_requests}};
    j["last_heartbeat_ms"] = g.silence_ms >= 0 ? Json(g.silence_ms) : Json(nullptr);
    j["instance"] = g.instance_id ? Json(FingerprintHex(g.instance_id)) : Json(nullptr);
    j["model_fingerprint"] =
        g.model_fingerprint ? Json(FingerprintHex(g.model_fingerprint)) : Json(nullptr);
    groups.push_back(std::move(j));
  }
  Json map_service = {{"endpoint", view->map_service_endpoint}, {"alive", view->map_service_alive}};
  map_service["last_reply_ms"] =
      view->map_service_silence_ms >= 0 ? Json(view->map_service_silence_ms) : Json(nullptr);
  bool ok = view->alive_groups() > 0;
  Json body = {{"status", ok ? "ok" : "unavailable"},
               {"model", options_.model_name},
               {"groups", groups},
               {"map_service", map_service}};
  if (!ok) body["reason"] = view->UnavailableReason();
  HttpResponse res;
  res.status = ok ? 200 : 503;
  res.body = body.dump();
  res.headers.emplace_back("Cache-Control", "no-store");
  return res;
}

}  // namespace fmoe
