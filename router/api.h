// The router's HTTP routes; none blocks. GET /health: 200 with groups and the map service when
// at least one group is alive; 503 {"status": "loading"} with each group's loading progress
// while the workers load, 503 with the reason otherwise. GET /v1/models: the served model.
// POST /v1/completions and /v1/chat/completions: router/completions.h. POST /tokenize and
// /detokenize: router/tokenize.h. GET /metrics: Prometheus text. A known route with the wrong
// method answers 405, every other route 404, both with the OpenAI error object. With API keys
// configured, every route but /health needs "Authorization: Bearer <key>" (compared in constant
// time); otherwise 401.
//
// Every answer carries X-Request-Id (the client's, when it sent a usable one, else a new one)
// and, for allowed origins, CORS headers (preflight OPTIONS answered 204); each request ends with
// one access log line at info (method, path, status, tokens, latency, request id). Whatever a
// route throws becomes a 500 with the OpenAI error object; the process serves on.
#pragma once

#include <string>
#include <vector>

#include "common/json.h"
#include "router/http_server.h"
#include "router/metrics.h"
#include "router/worker_link.h"

namespace fmoe {

struct RouterApiOptions {
  std::string model_name;             // Served model id.
  uint32_t context_length = 0;        // For /v1/models.
  std::vector<std::string> api_keys;  // Bearer keys; empty = no authentication.
  // Origins allowed to call from a browser ("*" = any); empty = no CORS headers. Default: none
  std::vector<std::string> cors_allowed_origins;
};

class Completions;

class RouterApi {
 public:
  // `completions` may be null (no model loaded in this router): its routes then answer 503.
  RouterApi(RouterApiOptions options, const WorkerLink& link, Completions* completions = nullptr,
            RouterMetrics* metrics = nullptr);
  // Thread-safe.
  void Handle(const HttpRequest& request, std::shared_ptr<HttpResponder> responder) const;
  // The routes that answer at once.
  HttpResponse HandleNow(const HttpRequest& request) const;

 private:
  // `route`: the path as the metrics name it ("other" for an unknown path).
  void Route(const HttpRequest& request, const std::string& route,
             std::shared_ptr<HttpResponder> responder) const;
  HttpResponse Health() const;
  HttpResponse Models() const;
  nlohmann::json ModelJson() const;  // The served model's entry of /v1/models.
  bool Authorized(const HttpRequest& request) const;
  // The Access-Control-Allow-Origin value for the request's Origin, "" when none applies.
  std::string AllowedOrigin(const HttpRequest& request) const;

  RouterApiOptions options_;
  const WorkerLink& link_;
  Completions* completions_;
  RouterMetrics* metrics_;
  int64_t created_ = 0;
};

}  // namespace fmoe
