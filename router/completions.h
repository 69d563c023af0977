// POST /v1/completions and POST /v1/chat/completions (OpenAI-compatible): parses and validates
// the request body, tokenizes the prompt (a chat's messages through the model's chat template),
// submits it to the WorkerLink, and answers as one JSON object or, with "stream": true, as
// server-sent events ending in "data: [DONE]". Text is rendered here from the token events
// (TextStream: never splits a UTF-8 character; StopMatcher: cuts at a stop string). A client that
// disconnects cancels its request. Never blocks: the answer is written from the link thread through
// the HttpResponder.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "common/chat_template.h"
#include "common/status.h"
#include "common/tokenizer.h"
#include "router/http_server.h"
#include "router/metrics.h"
#include "router/worker_link.h"

namespace fmoe {

struct CompletionsOptions {
  std::string model_name;               // The served model id. Required.
  uint32_t context_length = 0;          // Prompt + max_tokens must fit. Required.
  int64_t request_timeout_ms = 600000;  // Whole request. Default: 600 s
  uint32_t default_max_tokens = 16;     // OpenAI's default. Default: 16
  // The model's chat template, compiled; null: /v1/chat/completions answers 400.
  const ChatTemplate* chat_template = nullptr;
  std::string bos_token;  // The template's bos_token and eos_token variables.
  std::string eos_token;
};

enum class RequestKind { kText, kChat };

// A validated completion request.
struct CompletionRequest {
  RequestKind kind = RequestKind::kText;
  std::vector<int32_t> prompt_ids;
  SamplingParams sampling;
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
};

// Parses a /v1/completions body. Errors are the HTTP answer to send (400/404 with the OpenAI
// error object naming the parameter).
Result<CompletionRequest> ParseCompletionRequest(const std::string& body,
                                                 const CompletionsOptions& options,
                                                 const Tokenizer& tokenizer, HttpResponse* error);
// The same for a /v1/chat/completions body: "messages" instead of "prompt".
Result<CompletionRequest> ParseChatRequest(const std::string& body,
                                           const CompletionsOptions& options,
                                           const Tokenizer& tokenizer, HttpResponse* error);
Result<CompletionRequest> ParseRequest(const std::string& body, const CompletionsOptions& options,
                                       const Tokenizer& tokenizer, RequestKind kind,
                                       HttpResponse* error);

class Completions {
 public:
  // `metrics` may be null.
  Completions(CompletionsOptions options, const Tokenizer& tokenizer, WorkerLink& link,
              RouterMetrics* metrics = nullptr);
  void Handle(const HttpRequest& request, std::shared_ptr<HttpResponder> responder);
  void HandleChat(const HttpRequest& request, std::shared_ptr<HttpResponder> responder);

 private:
  void Run(RequestKind kind, const HttpRequest& request, std::shared_ptr<HttpResponder> responder);

  CompletionsOptions options_;
  const Tokenizer& tokenizer_;
  WorkerLink& link_;
  RouterMetrics* metrics_;
};

}  // namespace fmoe
