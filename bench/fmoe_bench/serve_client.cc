#include "bench/fmoe_bench/serve_client.h"

#include <string_view>

#include "common/http_client.h"
#include "common/json.h"

namespace fmoe::bench {
namespace {

using Json = nlohmann::json;

std::string ApiErrorMessage(const std::string& body) {
  Json j = Json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (j.is_object() && j.contains("error") && j["error"].is_object() &&
      j["error"].contains("message") && j["error"]["message"].is_string()) {
    return j["error"]["message"].get<std::string>();
  }
  return body.substr(0, 200);
}

// Applies one server-sent event's data to the result; returns true at [DONE].
bool OnEvent(const std::string& data, BenchClock::time_point at, StreamResult& r) {
  if (data == "[DONE]") return true;
  Json j = Json::parse(data, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) {
    if (r.error.empty()) r.error = "event is not JSON: " + data.substr(0, 100);
    return false;
  }
  if (auto e = j.find("error"); e != j.end()) {
    if (r.error.empty()) {
      r.error = e->is_object() && e->contains("message") && (*e)["message"].is_string()
                    ? (*e)["message"].get<std::string>()
                    : e->dump();
    }
    return false;
  }
  if (auto c = j.find("choices"); c != j.end() && c->is_array() && !c->empty()) {
    const Json& choice = (*c)[0];
    // (json::empty() is false for every string: compare the string itself.)
    if (auto t = choice.find("text");
        t != choice.end() && t->is_string() && !t->get_ref<const std::string&>().empty()) {
      if (r.content_events == 0) r.first_content = at;
      r.last_content = at;
      ++r.content_events;
    }
    if (auto f = choice.find("finish_reason"); f != choice.end() && f->is_string()) {
      r.finish_reason = f->get<std::string>();
      r.finished = at;
    }
  }
  if (auto u = j.find("usage"); u != j.end() && u->is_object()) {
    r.has_usage = true;
    r.prompt_tokens = u->value("prompt_tokens", int64_t{0});
    r.completion_tokens = u->value("completion_tokens", int64_t{0});
    if (auto d = u->find("prompt_tokens_details"); d != u->end() && d->is_object()) {
      r.cached_tokens = d->value("cached_tokens", int64_t{0});
    }
    if (auto x = u->find("fmoe_experts"); x != u->end() && x->is_object()) {
      r.expert_hits = x->value("hits", uint64_t{0});
      r.expert_misses = x->value("misses", uint64_t{0});
      r.bytes_moved = x->value("bytes_moved", uint64_t{0});
    }
  }
  return false;
}

}  // namespace

StreamResult StreamCompletion(int port, const std::string& body, const std::string& authorization,
                              double timeout_s, const std::atomic<bool>& abort) {
  StreamResult r;
  r.sent = BenchClock::now();
  auto finish = [&](std::string error) {
    r.done = BenchClock::now();
    if (r.error.empty()) r.error = std::move(error);
    r.ok = r.error.empty();
    return r;
  };
  http::ClientOptions options;
  options.keep_alive = false;
  options.abort = &abort;
  http::Client client("127.0.0.1", port, options);
  http::Request request;
  request.method = "POST";
  request.target = "/v1/completions";
  request.headers.emplace_back("Accept", "text/event-stream");
  if (!authorization.empty()) request.headers.emplace_back("Authorization", authorization);
  request.body = body;

  http::SseReader events;
  std::string error_body;  // The body of a non-200 answer.
  bool done = false;
  auto res = client.Stream(request, static_cast<int>(timeout_s * 1000),
                           [&](const http::Response& head, std::string_view piece) {
                             const auto at = BenchClock::now();
                             r.http_status = head.status;
                             if (head.status != 200) {
                               error_body.append(piece);
                               return true;
                             }
                             for (const std::string& data : events.Feed(piece)) {
                               if (OnEvent(data, at, r)) done = true;
                             }
                             return !done;  // Nothing after [DONE] is read.
                           });
  if (!res.ok()) {
    if (abort.load()) return finish("aborted (the benchmark is stopping)");
    if (res.status().code() == ErrorCode::kTimeout) {
      return finish("no complete answer within " + std::to_string(static_cast<int>(timeout_s)) +
                    " s");
    }
    return finish(res.status().message());
  }
  r.http_status = res->status;
  if (r.http_status != 200) {
    return finish("HTTP " + std::to_string(r.http_status) + ": " + ApiErrorMessage(error_body));
  }
  if (!r.error.empty()) return finish("");
  if (!done) return finish("the stream ended without [DONE]");
  if (r.finish_reason.empty()) return finish("no finish_reason in the stream");
  if (!r.has_usage) return finish("no usage in the stream");
  return finish("");
}

}  // namespace fmoe::bench
