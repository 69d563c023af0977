// The router's HTTP routes; none blocks. GET /health: 200 with groups and the map service when
// at least one group is alive, 503 with the reason otherwise. GET /v1/models: the served model.
// POST /v1/completions and /v1/chat/completions: router/completions.h. A known route with the wrong
// method answers 405, every other route 404, both with the OpenAI error object. GET /metrics:
// Prometheus text. With API keys configured, every route but /health needs "Authorization: Bearer
// <key>" (compared in constant time); otherwise 401.
#pragma once

#include <string>
#include <vector>

#include "router/http_server.h"
#include "router/metrics.h"
#include "router/worker_link.h"

namespace fmoe {

struct RouterApiOptions {
  std::string model_name;             // Served model id.
  uint32_t context_length = 0;        // For /v1/models.
  std::vector<std::string> api_keys;  // Bearer keys; empty = no authentication.
};

class Completions;

class RouterApi {
 public:
  // `completions` may be null (no model loaded in this router): its route then answers 503.
  RouterApi(RouterApiOptions options, const WorkerLink& link, Completions* completions = nullptr,
            RouterMetrics* metrics = nullptr);
  // Thread-safe.
  void Handle(const HttpRequest& request, std::shared_ptr<HttpResponder> responder) const;
  // The routes that answer at once.
  HttpResponse HandleNow(const HttpRequest& request) const;

 private:
  HttpResponse Health() const;
  HttpResponse Models() const;
  bool Authorized(const HttpRequest& request) const;

  RouterApiOptions options_;
  const WorkerLink& link_;
  Completions* completions_;
  RouterMetrics* metrics_;
  int64_t created_ = 0;
};

}  // namespace fmoe
