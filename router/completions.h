// POST /v1/completions and POST /v1/chat/completions (OpenAI-compatible, with vLLM's shapes):
// parses the body (router/completion_request.h), submits one request per choice (`n`; with a
// seed, choice i draws with seed + i) to the WorkerLink, and answers as one JSON object or, with
// "stream": true, as server-sent events ending in "data: [DONE]". Text is rendered here from the
// token events (TextStream: never splits a UTF-8 character and turns ill-formed bytes into
// U+FFFD), with logprobs when asked. Stop strings are matched here and only here (StopMatcher,
// in the text after the first min_tokens tokens'): the choice ends at the token that completes
// one (finish_reason "stop", the text cut before it, that token counted in the usage) and its
// worker request is cancelled, later events for it ignored. A client that
// disconnects cancels its choices. Never blocks: the answer is written from the link thread
// through the HttpResponder. Whatever is thrown while rendering one request ends that request
// (500, or an error event in a stream) and cancels its choices; nothing escapes to the link
// thread.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "common/status.h"
#include "common/text/tokenizer.h"
#include "router/completion_request.h"
#include "router/http_server.h"
#include "router/metrics.h"
#include "router/responses.h"
#include "router/worker_link.h"

namespace fmoe {

class Completions {
 public:
  // `metrics` may be null.
  Completions(CompletionsOptions options, const Tokenizer& tokenizer, WorkerLink& link,
              RouterMetrics* metrics = nullptr);
  void Handle(const HttpRequest& request, std::shared_ptr<HttpResponder> responder);
  void HandleChat(const HttpRequest& request, std::shared_ptr<HttpResponder> responder);
  // Anthropic's Messages API (router/anthropic.h): a chat completion in the Messages shapes.
  void HandleMessages(const HttpRequest& request, std::shared_ptr<HttpResponder> responder);
  // OpenAI's Responses API (router/responses.h), with the responses kept for
  // previous_response_id.
  void HandleResponses(const HttpRequest& request, std::shared_ptr<HttpResponder> responder);
  const CompletionsOptions& options() const { return options_; }
  const Tokenizer& tokenizer() const { return tokenizer_; }

 private:
  // The API a chat body comes in: translated to chat, answered in its shapes.
  enum class Dialect { kOpenAI, kMessages, kResponses };
  void Run(RequestKind kind, const HttpRequest& request, std::shared_ptr<HttpResponder> responder,
           Dialect dialect = Dialect::kOpenAI);

  CompletionsOptions options_;
  const Tokenizer& tokenizer_;
  WorkerLink& link_;
  RouterMetrics* metrics_;
  ResponseStore responses_;  // The Responses API's kept responses.
};

}  // namespace fmoe
