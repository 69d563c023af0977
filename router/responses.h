// OpenAI's Responses API (POST /v1/responses), the OpenAI Agents SDK's and LangChain's
// use_responses_api default: the request (instructions, input as a string or items: messages,
// function_call and function_call_output, function tools, tool_choice, sampling,
// max_output_tokens, previous_response_id) is translated into the chat completion it means,
// which ParseRequest validates like any chat request; Completions writes the answer as a
// `response` with output items (reasoning, message, function_call) and the streamed
// response.* events. Responses are kept (ResponseStore, bounded; in memory, and on disk when
// router.responses_dir is set) so a later request, also after a restart, can continue one by
// previous_response_id. Thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>

#include "common/json.h"
#include "common/status.h"
#include "router/http_server.h"

namespace fmoe {

class ResponseDb;

// The conversations of stored responses: id -> the chat messages up to and including the
// response's answer (instructions left out: they are not carried to the next turn), least
// recently used dropped past the capacity. With Open, every change is written through to a
// database on disk (response_db.h); a write the disk refuses is logged and the response stays
// in memory, so requests never fail for it.
class ResponseStore {
 public:
  explicit ResponseStore(size_t capacity = 1024);
  ~ResponseStore();
  // Loads the responses stored in `dir` (the most recently used, up to the capacity; older
  // ones are deleted there) and writes through from then on. On an error (kUnavailable naming
  // the directory) the store stays in memory only.
  Status Open(const std::string& dir);
  void Put(const std::string& id, nlohmann::json conversation);
  std::optional<nlohmann::json> Get(const std::string& id);
  size_t size() const;
  bool persistent() const;
  // Writes to the database it refused (since Open).
  uint64_t refused_writes() const;

 private:
  void Stored(const Status& s);  // Logs a refused write (throttled to the first and every 100th).
  mutable std::mutex mu_;
  size_t capacity_;
  std::unique_ptr<ResponseDb> db_;                         // GUARDED_BY(mu_); null: memory only.
  uint64_t clock_ = 0;                                     // GUARDED_BY(mu_): last-use stamps.
  uint64_t refused_ = 0;                                   // GUARDED_BY(mu_)
  std::list<std::pair<std::string, nlohmann::json>> lru_;  // GUARDED_BY(mu_), newest first.
  std::unordered_map<std::string, std::list<std::pair<std::string, nlohmann::json>>::iterator>
      index_;  // GUARDED_BY(mu_)
};

struct ResponsesRequest {
  nlohmann::json chat;          // The chat completion body it means.
  nlohmann::json conversation;  // Its chat messages without the instructions (to store).
  bool store = true;            // Keep the response for previous_response_id.
  // What the response object echoes: instructions, max_output_tokens, temperature, top_p, tools,
  // tool_choice, previous_response_id.
  nlohmann::json echo = nlohmann::json::object();
};

// The chat completion `body` (a Responses request) means, continuing a stored response when it
// names one. On error, *error holds the answer (400 naming the field; 404 for an unknown
// previous_response_id). Refused: input items other than messages, function calls and their
// outputs (images, files, built-in tools), text.format other than text, reasoning settings,
// tool_choice "required" or a named function (constrained decoding).
Result<ResponsesRequest> ResponsesToChat(const nlohmann::json& body, ResponseStore& store,
                                         HttpResponse* error);

}  // namespace fmoe
