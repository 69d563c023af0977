// Parsing and validation of the bodies of POST /v1/completions and /v1/chat/completions into a
// CompletionRequest: the OpenAI parameters (and vLLM's extensions) that change the output are
// applied or refused with 400 naming them, never silently ignored. Errors are the HTTP answer to
// send: the OpenAI error object naming the parameter and a code. Stateless and thread-safe.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "common/status.h"
#include "common/text/chat_template.h"
#include "common/text/think_splitter.h"
#include "common/text/tokenizer.h"
#include "common/text/tool_calls.h"
#include "common/wire/messages.h"
#include "router/http_server.h"

namespace fmoe {

struct CompletionsOptions {
  std::string model_name;       // The served model id. Required.
  uint32_t context_length = 0;  // Prompt + max_tokens must fit. Required.
  // Why context_length is below the model's context, for the 400 (e.g. a group's KV pool).
  std::string context_limit;
  int64_t request_timeout_ms = 600000;  // Whole request. Default: 600 s
  // /v1/completions without max_tokens: OpenAI's default, shrunk to fit the context. Chat
  // completions without max_tokens may use the rest of the context (as vLLM). Default: 16
  uint32_t default_max_tokens = 16;
  // The model's chat template, compiled; null: /v1/chat/completions answers 400.
  const ChatTemplate* chat_template = nullptr;
  std::string bos_token;  // The template's bos_token and eos_token variables.
  std::string eos_token;
  // gpt-oss (harmony): chat answers keep the special tokens in their text and are split into
  // reasoning_content (the analysis channel) and content (common/text/harmony.h).
  bool harmony_channels = false;
  // Reasoning models that think between <think> and </think> (DeepSeek-R1, Qwen3, GLM-4.5,
  // MiniMax-M2, Kimi-K2-Thinking; ThinkStyleFor picks the style): chat answers' thinking is
  // reasoning_content, the rest content (common/text/think_splitter.h). Markers that are special
  // tokens are decoded as their text, the other special tokens still skipped. Not with
  // harmony_channels. Default: none
  std::optional<ThinkStyle> think_style;
  // How this model writes tool calls (common/text/tool_calls.h; ToolCallFormatFor picks it from
  // the architecture): chat requests with `tools` and tool_choice auto have their answers parsed
  // into tool_calls. kNone: such requests are refused (tool_choice none still renders tools).
  ToolCallFormat tool_call_format = ToolCallFormat::kNone;
  // The Responses API's kept responses: how many, and the directory they are stored in across
  // restarts ("": memory only). Default: 1024, memory only
  size_t responses_capacity = 1024;
  std::string responses_dir;
};

enum class RequestKind { kText, kChat };

inline constexpr uint32_t kMaxChoices = 16;   // n
inline constexpr size_t kMaxPrompts = 64;     // Completions' batch of prompts; also prompts x n.
inline constexpr size_t kMaxLogitBias = 300;  // logit_bias entries
inline constexpr size_t kMaxTools = 128;      // tools
// Nesting of a tool's definition or a call's arguments (they are copied and written out by
// recursive code, which a value nested a hundred thousand deep would overflow).
inline constexpr size_t kMaxToolJsonDepth = 64;
inline constexpr size_t kMaxToolCalls = 128;  // An assistant message's tool_calls.
// echo with logprobs: the prompt's logprobs' bytes in their one event (the frame limit is 8 MiB).
inline constexpr uint64_t kMaxPromptLogprobBytes = 6u << 20;

// A validated completion request.
struct PromptInput {
  std::vector<int32_t> ids;
  std::string text;  // With echo: the prompt as text.
};

struct CompletionRequest {
  RequestKind kind = RequestKind::kText;
  // One prompt; completions may send a batch (prompt p's choices are p * n .. p * n + n - 1).
  std::vector<PromptInput> prompts;
  // Checked with CheckSampling (common/wire/sampling_limits.h). sampling.seed: choice c of each
  // prompt draws with seed + c. sampling.stop stays empty: the stop strings are `stop`.
  SamplingParams sampling;
  // Stop strings (1 to 16 of 1 to 256 bytes): the router matches them in each choice's text and
  // cancels the choice's worker request at the first (router/completions.h).
  std::vector<std::string> stop;
  bool stream = false;
  bool include_usage = false;  // stream_options.include_usage
  uint32_t n = 1;              // Independent choices per prompt.
  bool echo = false;           // Completions: the prompt's text starts each choice's text.
  // Chat (vLLM's include_reasoning): false leaves reasoning_content out (null) where the model's
  // reasoning is split out. Read by Completions::Run. Default: true
  bool include_reasoning = true;
  // Chat with `tools` and tool_choice auto: the answer is parsed into tool calls in this format
  // (kNone: not parsed), with the argument types the tools declare.
  ToolCallFormat tool_format = ToolCallFormat::kNone;
  ToolCallOptions tool_options;
  // tool_choice "required" forced as its one tool's named call (gpt-oss): the choice still ends
  // with finish_reason "tool_calls", as "required" does, not "stop" as a named function does.
  bool tool_choice_required = false;
  // Top-level fields this server does not know (at most 16, cut to 64 bytes), logged as ignored
  // as vLLM does; those it knows and does not apply are refused instead.
  std::vector<std::string> ignored_fields;
};

// Parses a body of `kind`. On error, *error holds the HTTP answer.
Result<CompletionRequest> ParseRequest(const std::string& body, const CompletionsOptions& options,
                                       const Tokenizer& tokenizer, RequestKind kind,
                                       HttpResponse* error);
inline Result<CompletionRequest> ParseCompletionRequest(const std::string& body,
                                                        const CompletionsOptions& options,
                                                        const Tokenizer& tokenizer,
                                                        HttpResponse* error) {
  return ParseRequest(body, options, tokenizer, RequestKind::kText, error);
}
inline Result<CompletionRequest> ParseChatRequest(const std::string& body,
                                                  const CompletionsOptions& options,
                                                  const Tokenizer& tokenizer, HttpResponse* error) {
  return ParseRequest(body, options, tokenizer, RequestKind::kChat, error);
}

// A chat body's "messages" rendered through the model's template and tokenized (used by the
// completions and by POST /tokenize). On error, *error holds the HTTP answer.
// `tools` (may be null): the request's tools, for the template. `template_kwargs` (may be null):
// the request's chat_template_kwargs, more variables for the template (e.g. enable_thinking).
Result<std::vector<int32_t>> TokenizeChat(const nlohmann::json& messages,
                                          const CompletionsOptions& options,
                                          const Tokenizer& tokenizer, bool add_generation_prompt,
                                          HttpResponse* error,
                                          const nlohmann::ordered_json* tools = nullptr,
                                          const nlohmann::ordered_json* template_kwargs = nullptr);

// How deep `value` nests (a scalar: 0), counted without recursion.
size_t JsonDepth(const nlohmann::json& value);

// JSON text of an answer; model text is bytes until proven UTF-8, so ill-formed sequences are
// written as U+FFFD instead of throwing.
std::string JsonText(const nlohmann::json& j);

// What a client's JSON value is, for an error message: "null", "true", "the integer 7", "a
// string", "an array", ... Never the value itself (a nested one could be a megabyte deep).
std::string JsonTypeName(const nlohmann::json& j);

// Readers shared by the routes' parsers (completions, /tokenize): each sets *error (400 or
// 404, naming the key) and returns false on a bad value. "model", when present or `required`,
// must be the served model. A boolean key absent or null leaves *out as it is.
bool ReadModel(const nlohmann::json& body, const CompletionsOptions& options, bool required,
               HttpResponse* error);
bool ReadBool(const nlohmann::json& body, const char* key, bool* out, HttpResponse* error);

// 400 invalid_request_error naming `param`.
HttpResponse BadParam(const std::string& param, const std::string& message,
                      const std::string& code = "invalid_value");

// How a request reader refuses: sets *error to `response` and returns false.
bool Refuse(HttpResponse* error, HttpResponse response);

}  // namespace fmoe
