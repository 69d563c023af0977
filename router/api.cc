#include "router/api.h"

#include <algorithm>
#include <chrono>

#include <spdlog/spdlog.h>

#include "common/json.h"
#include "common/model/model_config.h"
#include "common/process_util.h"
#include "common/text/unicode.h"
#include "router/anthropic.h"
#include "router/completion_request.h"
#include "router/completions.h"
#include "router/tokenize.h"

namespace fmoe {
namespace {

HttpResponse MethodNotAllowed(const HttpRequest& request, const std::string& allow) {
  HttpResponse res = ApiError(
      405,
      "method " + request.method + " is not allowed on " + request.path + " (use " + allow + ")",
      "invalid_request_error", "", "method_not_allowed");
  res.headers.emplace_back("Allow", allow);
  return res;
}

// A client's X-Request-Id is kept when it is 1..128 printable ASCII characters without spaces.
std::string RequestIdOf(const HttpRequest& request) {
  if (auto it = request.headers.find("x-request-id"); it != request.headers.end()) {
    const std::string& id = it->second;
    if (!id.empty() && id.size() <= 128 &&
        std::all_of(id.begin(), id.end(), [](char c) { return c > 0x20 && c < 0x7f; })) {
      return id;
    }
  }
  return FingerprintHex(RandomId());
}

// Adds the headers every answer carries and writes the access log line when the exchange ends.
class ObservedResponder final : public HttpResponder {
 public:
  ObservedResponder(std::shared_ptr<HttpResponder> inner, const HttpRequest& request,
                    std::string request_id, std::vector<std::pair<std::string, std::string>> extra)
      : inner_(std::move(inner)),
        method_(request.method),
        path_(request.path),
        remote_(request.remote),
        request_id_(std::move(request_id)),
        extra_(std::move(extra)) {}

  ~ObservedResponder() override {
    const auto end = ended_ ? end_ : std::chrono::steady_clock::now();
    const double ms = std::chrono::duration<double, std::milli>(end - start_).count();
    spdlog::info("{} {} {} tokens={}/{} {:.1f} ms id={} remote={}{}", method_, path_, status_,
                 prompt_tokens_, completion_tokens_, ms, request_id_, remote_,
                 inner_->closed() && !ended_ ? " (the client left)" : "");
  }

  void Respond(HttpResponse response) override {
    status_ = response.status;
    response.headers.insert(response.headers.end(), extra_.begin(), extra_.end());
    Ended();
    inner_->Respond(std::move(response));
  }
  void BeginStream(int status, const std::string& content_type,
                   std::vector<std::pair<std::string, std::string>> headers) override {
    status_ = status;
    headers.insert(headers.end(), extra_.begin(), extra_.end());
    inner_->BeginStream(status, content_type, std::move(headers));
  }
  void Write(std::string chunk) override { inner_->Write(std::move(chunk)); }
  void End() override {
    Ended();
    inner_->End();
  }
  void OnClose(std::function<void()> callback) override { inner_->OnClose(std::move(callback)); }
  bool closed() const override { return inner_->closed(); }
  void NoteUsage(uint32_t prompt_tokens, uint32_t completion_tokens) override {
    prompt_tokens_ = prompt_tokens;
    completion_tokens_ = completion_tokens;
  }

 private:
  void Ended() {
    if (ended_) return;
    ended_ = true;
    end_ = std::chrono::steady_clock::now();
  }

  std::shared_ptr<HttpResponder> inner_;
  std::string method_, path_, remote_, request_id_;
  std::vector<std::pair<std::string, std::string>> extra_;
  std::chrono::steady_clock::time_point start_ = std::chrono::steady_clock::now();
  std::chrono::steady_clock::time_point end_{};
  bool ended_ = false;
  int status_ = 0;
  uint32_t prompt_tokens_ = 0;
  uint32_t completion_tokens_ = 0;
};

constexpr std::string_view kModelPrefix = "/v1/models/";

bool IsKnownRoute(const std::string& path) {
  return path == "/health" || path == "/metrics" || path == "/v1/models" ||
         path == "/v1/completions" || path == "/v1/chat/completions" || path == "/tokenize" ||
         path == "/detokenize" || path == "/tokenizer_info" || path == "/version" ||
         path == "/ping" || path == "/v1/messages" || path == "/v1/responses";
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
  // Liveness probes carry no key.
  if (options_.api_keys.empty() || request.path == "/health" || request.path == "/ping") {
    return true;
  }
  std::string_view given;
  if (auto it = request.headers.find("authorization"); it != request.headers.end()) {
    const std::string& value = it->second;
    constexpr std::string_view kBearer = "Bearer ";
    if (value.size() < kBearer.size() || value.compare(0, kBearer.size(), kBearer) != 0) {
      return false;
    }
    given = std::string_view(value).substr(kBearer.size());
  } else if (auto key = request.headers.find("x-api-key"); key != request.headers.end()) {
    given = key->second;  // Anthropic's clients send the key so.
  } else {
    return false;
  }
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

std::string RouterApi::AllowedOrigin(const HttpRequest& request) const {
  if (options_.cors_allowed_origins.empty()) return "";
  auto origin = request.headers.find("origin");
  if (origin == request.headers.end()) return "";
  for (const std::string& allowed : options_.cors_allowed_origins) {
    if (allowed == "*") return "*";
    if (allowed == origin->second) return allowed;
  }
  return "";
}

void RouterApi::Handle(const HttpRequest& request, std::shared_ptr<HttpResponder> responder) const {
  const std::string request_id = RequestIdOf(request);
  std::vector<std::pair<std::string, std::string>> extra = {{"X-Request-Id", request_id}};
  const std::string origin = AllowedOrigin(request);
  if (!origin.empty()) {
    extra.emplace_back("Access-Control-Allow-Origin", origin);
    extra.emplace_back("Access-Control-Expose-Headers", "X-Request-Id");
    if (origin != "*") extra.emplace_back("Vary", "Origin");
  }
  auto observed =
      std::make_shared<ObservedResponder>(std::move(responder), request, request_id, extra);
  const std::string route = IsKnownRoute(request.path)               ? request.path
                            : request.path.starts_with(kModelPrefix) ? "/v1/models/{id}"
                                                                     : "other";
  try {
    if (request.method == "OPTIONS" && !origin.empty() &&
        request.headers.count("access-control-request-method") > 0) {
      // A browser's preflight: no credentials are sent with it.
      HttpResponse res;
      res.status = 204;
      res.content_type.clear();
      res.headers = {{"Access-Control-Allow-Methods", "GET, POST, OPTIONS"},
                     {"Access-Control-Allow-Headers", "Authorization, Content-Type, X-Request-Id"},
                     {"Access-Control-Max-Age", "600"}};
      if (metrics_ != nullptr) metrics_->CountRequest(route, 204);
      observed->Respond(std::move(res));
      return;
    }
    Route(request, route, observed);
  } catch (const std::exception& e) {
    spdlog::error("{} {} id={}: {}", request.method, request.path, request_id, e.what());
    if (metrics_ != nullptr) metrics_->CountRequest(route, 500);
    observed->Respond(ApiError(500, "internal error", "server_error", "", ""));
  } catch (...) {
    spdlog::error("{} {} id={}: unknown exception", request.method, request.path, request_id);
    if (metrics_ != nullptr) metrics_->CountRequest(route, 500);
    observed->Respond(ApiError(500, "internal error", "server_error", "", ""));
  }
}

void RouterApi::Route(const HttpRequest& request, const std::string& route,
                      std::shared_ptr<HttpResponder> responder) const {
  if (!Authorized(request)) {
    HttpResponse res =
        ApiError(401, "missing or invalid API key: send \"Authorization: Bearer <key>\"",
                 "invalid_request_error", "", "invalid_api_key");
    res.headers.emplace_back("WWW-Authenticate", "Bearer");
    if (metrics_ != nullptr) metrics_->CountRequest(route, 401);
    responder->Respond(request.path == "/v1/messages" ? MessagesError(res) : std::move(res));
    return;
  }
  if (request.method == "POST" && completions_ != nullptr) {
    // These count their own answers.
    if (request.path == "/v1/completions") {
      return completions_->Handle(request, std::move(responder));
    }
    if (request.path == "/v1/chat/completions") {
      return completions_->HandleChat(request, std::move(responder));
    }
    if (request.path == "/v1/messages") {
      return completions_->HandleMessages(request, std::move(responder));
    }
    if (request.path == "/v1/responses") {
      return completions_->HandleResponses(request, std::move(responder));
    }
  }
  HttpResponse res = HandleNow(request);
  if (metrics_ != nullptr) metrics_->CountRequest(route, res.status);
  responder->Respond(std::move(res));
}

HttpResponse RouterApi::HandleNow(const HttpRequest& request) const {
  if (request.path == "/v1/completions" || request.path == "/v1/chat/completions" ||
      request.path == "/v1/messages" || request.path == "/v1/responses") {
    if (request.method != "POST") return MethodNotAllowed(request, "POST");
    return ApiError(503, "this router serves no model", "service_unavailable", "", "");
  }
  if (request.path == "/tokenize" || request.path == "/detokenize") {
    if (request.method != "POST") return MethodNotAllowed(request, "POST");
    if (completions_ == nullptr) {
      return ApiError(503, "this router serves no model", "service_unavailable", "", "");
    }
    return request.path == "/tokenize"
               ? Tokenize(request.body, completions_->options(), completions_->tokenizer())
               : Detokenize(request.body, completions_->options(), completions_->tokenizer());
  }
  if (request.path == "/tokenizer_info") {
    if (request.method != "GET") return MethodNotAllowed(request, "GET");
    if (completions_ == nullptr) {
      return ApiError(503, "this router serves no model", "service_unavailable", "", "");
    }
    return TokenizerInfo(completions_->options(), completions_->tokenizer());
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
  if (request.path.starts_with(kModelPrefix)) {  // openai's models.retrieve.
    if (request.method != "GET") return MethodNotAllowed(request, "GET");
    const std::string id = request.path.substr(kModelPrefix.size());
    if (id != options_.model_name) {
      return ApiError(404, "the model `" + ToValidUtf8(id) + "` does not exist",
                      "invalid_request_error", "model", "model_not_found");
    }
    HttpResponse res;
    res.body = JsonText(ModelJson());
    return res;
  }
  if (request.path == "/version") {
    if (request.method != "GET") return MethodNotAllowed(request, "GET");
    HttpResponse res;
    res.body = JsonText(nlohmann::json{{"version", FMOE_VERSION}});
    return res;
  }
  if (request.path == "/ping") {  // vLLM's (SageMaker's) liveness probe: the process answers.
    if (request.method != "GET" && request.method != "POST") {
      return MethodNotAllowed(request, "GET, POST");
    }
    HttpResponse res;
    res.body = "{}";
    return res;
  }
  return ApiError(404, "no route " + request.method + " " + request.path, "invalid_request_error",
                  "", "not_found");
}

nlohmann::json RouterApi::ModelJson() const {
  return {{"id", options_.model_name},
          {"object", "model"},
          {"created", created_},
          {"owned_by", "fmoe"},
          {"max_model_len", options_.context_length}};
}

HttpResponse RouterApi::Models() const {
  HttpResponse res;
  res.body =
      JsonText(nlohmann::json{{"object", "list"}, {"data", nlohmann::json::array({ModelJson()})}});
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
              {"running", g.running},
              {"kv_cache",
               {{"blocks", g.kv.total_blocks},
                {"blocks_used", g.kv.used_blocks},
                {"block_tokens", 16},
                {"prefix_cache_hit_rate", g.kv.prefix_queries
                                              ? static_cast<double>(g.kv.prefix_hits) /
                                                    static_cast<double>(g.kv.prefix_queries)
                                              : 0.0},
                {"preemptions", g.kv.preemptions}}},
              {"prompt_chunks",
               {{"run", g.engine.prompt_chunks},
                {"grown", g.engine.chunks_grown},
                {"token_ns", g.engine.prompt_token_ns}}}};
    j["prompt_chunks"]["streamed_iterations"] = g.engine.streamed_iterations;
    if (g.kv.max_blocks != 0) {
      // One device budget: the split between the KV pool and the expert cache now.
      j["kv_cache"]["max_blocks"] = g.kv.max_blocks;
      j["device_memory"] = {{"kv_bytes", g.kv.kv_bytes}, {"expert_bytes", g.kv.expert_bytes}};
      if (!g.kv.ranks.empty()) {
        // A group of several ranks: each rank's pool borrows from its own cache.
        Json ranks = Json::array();
        for (const KvFigures::RankSplit& r : g.kv.ranks) {
          ranks.push_back({{"kv_bytes", r.kv_bytes}, {"expert_bytes", r.expert_bytes}});
        }
        j["device_memory"]["ranks"] = std::move(ranks);
      }
    }
    j["last_heartbeat_ms"] = g.silence_ms >= 0 ? Json(g.silence_ms) : Json(nullptr);
    j["instance"] = g.instance_id ? Json(FingerprintHex(g.instance_id)) : Json(nullptr);
    j["model_fingerprint"] =
        g.model_fingerprint ? Json(FingerprintHex(g.model_fingerprint)) : Json(nullptr);
    if (g.loading && !g.alive) {
      j["loading"] = {{"loaded_bytes", g.loaded_bytes},
                      {"total_bytes", g.total_bytes},
                      {"progress", g.total_bytes ? static_cast<double>(g.loaded_bytes) /
                                                       static_cast<double>(g.total_bytes)
                                                 : 0.0}};
    } else {
      j["loading"] = nullptr;
    }
    groups.push_back(std::move(j));
  }
  Json map_service = {{"endpoint", view->map_service_endpoint},
                      {"alive", view->map_service_alive},
                      {"status", view->map_service_state}};
  map_service["last_reply_ms"] =
      view->map_service_silence_ms >= 0 ? Json(view->map_service_silence_ms) : Json(nullptr);
  const bool ok = view->alive_groups() > 0;
  const bool loading = !ok && view->loading_groups() > 0;
  // The map service is optional for serving: without it the router answers 200 "degraded" (the
  // workers serve with their cache's own policy, without prefetch guidance).
  const bool degraded = ok && view->map_service_state == "down";
  if (view->map_service_state == "down") {
    map_service["reason"] = view->map_service_silence_ms >= 0
                                ? "no answer for " +
                                      std::to_string(view->map_service_silence_ms / 1000) +
                                      " s; serving without prefetch guidance"
                                : "never answered; serving without prefetch guidance";
  }
  Json body = {{"status", degraded  ? "degraded"
                          : ok      ? "ok"
                          : loading ? "loading"
                                    : "unavailable"},
               {"model", options_.model_name},
               {"groups", groups},
               {"map_service", map_service}};
  if (!ok) body["reason"] = view->UnavailableReason();
  HttpResponse res;
  res.status = ok ? 200 : 503;
  res.body = JsonText(body);
  res.headers.emplace_back("Cache-Control", "no-store");
  if (loading) res.headers.emplace_back("Retry-After", "2");
  return res;
}

}  // namespace fmoe
