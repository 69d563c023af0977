// The router's HTTP routes. Handlers only read the ClusterView snapshot and never block.
// GET /health: 200 with groups and the map service when at least one group is alive, 503 with
// the reason otherwise. Every other route answers 404 with the OpenAI error object. The
// OpenAI-compatible completion routes arrive with the router issue.
#pragma once

#include <string>

#include "router/http_server.h"
#include "router/worker_link.h"

namespace fmoe {

struct RouterApiOptions {
  std::string model_name;  // Served model id.
};

class RouterApi {
 public:
  RouterApi(RouterApiOptions options, const WorkerLink& link);
  // Thread-safe.
  HttpResponse Handle(const HttpRequest& request) const;

 private:
  HttpResponse Health() const;

  RouterApiOptions options_;
  const WorkerLink& link_;
};

}  // namespace fmoe
