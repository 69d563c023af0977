#include "router/api.h"

#include <chrono>

#include <nlohmann/json.hpp>

#include "common/model_config.h"
#include "router/completions.h"

namespace fmoe {
namespace {

HttpResponse MethodNotAllowed(const HttpRequest& request, const std::string& allow) {
  HttpResponse res = ErrorResponse(
      405,
      "method " + request.method + " is not allowed on " + request.path + " (use " + allow + ")",
      "invalid_request_error", "method_not_allowed");
  res.headers.emplace_back("Allow", allow);
  return res;
}

}  // namespace

RouterApi::RouterApi(RouterApiOptions options, const WorkerLink& link, Completions* completions,
                     RouterMetrics* metrics)
    : options_(std::move(options)), link_(link), completions_(completions), metrics_(metrics) {
  created_ = std::chrono::duration_cast<std::chrono::seconds>(
                 std::chrono::system_clock::now().time_since_epoch())
                 .count();
}

bool RouterApi::Authorized(const HttpRequest& request) const {
  if (options_.api_keys.empty() || request.path == "/health") return true;
  auto it = request.headers.find("authorization");
  if (it == request.headers.end()) return false;
  const std::string& value = it->second;
  constexpr std::string_view kBearer = "Bearer ";
  if (value.size() < kBearer.size() || value.compare(0, kBearer.size(), kBearer) != 0) {
    return false;
  }
  const std::string_view given = std::string_view(value).substr(kBearer.size());
  // Every key is compared over its whole length whatever matches: the time says nothing about
  // which bytes were right.
  bool any = false;
  for (const std::string& key : options_.api_keys) {
    unsigned diff = static_cast<unsigned>(given.size() ^ key.size());
    for (size_t i = 0; i < key.size(); ++i) {
      const unsigned char g = i < given.size() ? static_cast<unsigned char>(given[i]) : 0;
      diff |= static_cast<unsigned>(g ^ static_cast<unsigned char>(key[i]));
    }
    any |= diff == 0;
  }
  return any;
}

void RouterApi::Handle(const HttpRequest& request, std::shared_ptr<HttpResponder> responder) const {
  const bool known = request.path == "/health" || request.path == "/metrics" ||
                     request.path == "/v1/models" || request.path == "/v1/completions" ||
                     request.path == "/v1/chat/completions";
  const std::string route = known ? request.path : "other";
  if (!Authorized(request)) {
    HttpResponse res =
        ErrorResponse(401, "missing or invalid API key: send \"Authorization: Bearer <key>\"",
                      "invalid_request_error", "invalid_api_key");
    res.headers.emplace_back("WWW-Authenticate", "Bearer");
    if (metrics_ != nullptr) metrics_->CountRequest(route, 401);
    responder->Respond(std::move(res));
    return;
  }
  if (request.method == "POST" && completions_ != nullptr) {
    // These count their own answers.
    if (request.path == "/v1/completions")
      return completions_->Handle(request, std::move(responder));
    if (request.path == "/v1/chat/completions") {
      return completions_->HandleChat(request, std::move(responder));
    }
  }
  HttpResponse res = HandleNow(request);
  if (metrics_ != nullptr) metrics_->CountRequest(route, res.status);
  responder->Respond(std::move(res));
}

HttpResponse RouterApi::HandleNow(const HttpRequest& request) const {
  if (request.path == "/v1/completions" || request.path == "/v1/chat/completions") {
    if (request.method != "POST") return MethodNotAllowed(request, "POST");
    return ErrorResponse(503, "this router serves no model", "service_unavailable");
  }
  if (request.path == "/metrics") {
    if (request.method != "GET") return MethodNotAllowed(request, "GET");
    HttpResponse res;
    res.content_type = "text/plain; version=0.0.4; charset=utf-8";
    res.body = metrics_ != nullptr ? metrics_->Render(*link_.View()) : "";
    return res;
  }
  if (request.path == "/health") {
    if (request.method != "GET" && request.method != "HEAD") {
      return MethodNotAllowed(request, "GET, HEAD");
    }
    return Health();
  }
  if (request.path == "/v1/models") {
    if (request.method != "GET") return MethodNotAllowed(request, "GET");
    return Models();
  }
  return ErrorResponse(404, "no route " + request.method + " " + request.path,
                       "invalid_request_error", "not_found");
}

HttpResponse RouterApi::Models() const {
  nlohmann::json model = {{"id", options_.model_name},
                          {"object", "model"},
                          {"created", created_},
                          {"owned_by", "fmoe"},
                          {"max_model_len", options_.context_length}};
  HttpResponse res;
  res.body = nlohmann::json{{"object", "list"}, {"data", nlohmann::json::array({model})}}.dump();
  return res;
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
              {"active_requests", g.active_requests},
              {"queued", g.queued},
              {"running", g.running}};
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
