#include "router/completions.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <limits>
#include <mutex>

#include <spdlog/spdlog.h>
#include <nlohmann/json.hpp>

#include "common/model_config.h"
#include "common/process_util.h"

namespace fmoe {
namespace {

using Json = nlohmann::json;

HttpResponse ApiError(int status, const std::string& message, const std::string& type,
                      const std::string& param, const std::string& code) {
  Json body = {{"error",
                {{"message", message},
                 {"type", type},
                 {"param", param.empty() ? Json(nullptr) : Json(param)},
                 {"code", code.empty() ? Json(nullptr) : Json(code)}}}};
  HttpResponse res;
  res.status = status;
  res.body = body.dump();
  return res;
}

HttpResponse BadParam(const std::string& param, const std::string& message,
                      const std::string& code = "invalid_value") {
  return ApiError(400, message, "invalid_request_error", param, code);
}

// Parameters that would change the output and are not supported: refused, never ignored.
// Each is acceptable only at its neutral value.
bool Neutral(const std::string& key, const Json& v) {
  if (v.is_null()) return true;
  if (key == "n" || key == "best_of") return v.is_number_integer() && v.get<int64_t>() == 1;
  if (key == "echo" || key == "ignore_eos") return v.is_boolean() && !v.get<bool>();
  if (key == "suffix") return v.is_string() && v.get<std::string>().empty();
  if (key == "logit_bias") return v.is_object() && v.empty();
  if (key == "presence_penalty" || key == "frequency_penalty") {
    return v.is_number() && v.get<double>() == 0.0;
  }
  if (key == "repetition_penalty") return v.is_number() && v.get<double>() == 1.0;
  if (key == "min_tokens") return v.is_number_integer() && v.get<int64_t>() == 0;
  if (key == "logprobs") return v.is_boolean() && !v.get<bool>();  // Chat's neutral value.
  return false;  // top_logprobs, and anything else listed: only null.
}

constexpr const char* kUnsupported[] = {"n",
                                        "best_of",
                                        "echo",
                                        "suffix",
                                        "logit_bias",
                                        "presence_penalty",
                                        "frequency_penalty",
                                        "repetition_penalty",
                                        "min_tokens",
                                        "ignore_eos",
                                        "logprobs",
                                        "top_logprobs"};

const char* FinishName(FinishReason r) {
  switch (r) {
    case FinishReason::kStop:
      return "stop";
    case FinishReason::kLength:
      return "length";
    default:
      return nullptr;
  }
}

int64_t UnixSeconds() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// One request's rendering state; the link thread feeds it events.
struct CompletionState {
  std::mutex mu;
  std::shared_ptr<HttpResponder> responder;
  TextStream text;
  StopMatcher stop;
  std::string id;
  std::string model;
  int64_t created = 0;
  bool chat = false;
  bool stream = false;
  bool include_usage = false;
  uint32_t prompt_tokens = 0;
  uint32_t completion_tokens = 0;
  uint64_t hits = 0, misses = 0, bytes = 0;
  std::string out;  // Non-stream: the whole text.
  RouterMetrics* metrics = nullptr;
  using Time = std::chrono::steady_clock::time_point;
  Time arrived = std::chrono::steady_clock::now();
  Time first_token{}, last_token{};

  const char* route = "/v1/completions";
  void Count(int status) {
    if (metrics != nullptr) metrics->CountRequest(route, status);
  }
  void CountGeneration() {
    if (metrics == nullptr) return;
    using Ms = std::chrono::duration<double, std::milli>;
    const double ttft = completion_tokens ? Ms(first_token - arrived).count() : 0.0;
    const double tpot = completion_tokens > 1
                            ? Ms(last_token - first_token).count() / (completion_tokens - 1)
                            : 0.0;
    metrics->CountGeneration(ttft, tpot, completion_tokens);
  }

  CompletionState(const Tokenizer& tokenizer, std::vector<std::string> stops)
      : text(tokenizer, /*skip_special_tokens=*/true), stop(std::move(stops)) {}

  Json Usage() const {
    const uint64_t total = hits + misses;
    return {{"prompt_tokens", prompt_tokens},
            {"completion_tokens", completion_tokens},
            {"total_tokens", prompt_tokens + completion_tokens},
            {"fmoe_experts",
             {{"hits", hits},
              {"misses", misses},
              {"hit_rate", total ? static_cast<double>(hits) / static_cast<double>(total) : 0.0},
              {"bytes_moved", bytes}}}};
  }

  Json Chunk(const std::string& piece, const char* finish) const {
    if (chat) {
      // Streamed: a delta (the first one carries the role); whole: the message.
      Json choice = {{"index", 0},
                     {"logprobs", nullptr},
                     {"finish_reason", finish ? Json(finish) : Json(nullptr)}};
      if (stream) {
        Json delta = Json::object();
        if (!role_sent) delta["role"] = "assistant";
        if (!piece.empty() || !role_sent) delta["content"] = piece;
        choice["delta"] = delta;
      } else {
        choice["message"] = {{"role", "assistant"}, {"content", piece}};
      }
      return {{"id", id},
              {"object", stream ? "chat.completion.chunk" : "chat.completion"},
              {"created", created},
              {"model", model},
              {"choices", Json::array({choice})}};
    }
    return {{"id", id},
            {"object", "text_completion"},
            {"created", created},
            {"model", model},
            {"choices", Json::array({{{"index", 0},
                                      {"text", piece},
                                      {"logprobs", nullptr},
                                      {"finish_reason", finish ? Json(finish) : Json(nullptr)}}})}};
  }

  void Send(const Json& event) {
    responder->Write("data: " + event.dump() + "\n\n");
    role_sent = true;
  }
  bool role_sent = false;  // Chat streams: the first delta carries the role.

  void OnEvent(const TokenEvent& ev) {
    std::lock_guard<std::mutex> lock(mu);
    // The figures are the request's totals so far; an event without them (an error) keeps the
    // last ones.
    hits = std::max(hits, ev.expert_hits);
    misses = std::max(misses, ev.expert_misses);
    bytes = std::max(bytes, ev.bytes_moved);
    if (ev.token_id >= 0) {
      last_token = std::chrono::steady_clock::now();
      if (completion_tokens == 0) first_token = last_token;
      ++completion_tokens;
      if (!stop.stopped()) Emit(stop.Feed(text.Push(ev.token_id)));
    }
    if (ev.finish == FinishReason::kNone) return;
    if (ev.finish == FinishReason::kStop || ev.finish == FinishReason::kLength) {
      if (!stop.stopped()) {
        Emit(stop.Feed(text.Finish()));
        if (!stop.stopped()) Emit(stop.Flush());
      }
      const char* finish = stop.stopped() ? "stop" : FinishName(ev.finish);
      CountGeneration();
      if (stream) {
        Send(Chunk("", finish));
        if (include_usage) {
          Json u = Chunk("", nullptr);
          u["choices"] = Json::array();
          u["usage"] = Usage();
          Send(u);
        }
        responder->Write("data: [DONE]\n\n");
        responder->End();
      } else {
        Json body = Chunk(out, finish);
        body["usage"] = Usage();
        HttpResponse res;
        res.body = body.dump();
        Count(200);
        responder->Respond(std::move(res));
      }
      return;
    }
    // Cancelled (the client left) or failed.
    const bool unavailable = ev.error == kGroupLostError || ev.error == kTimeoutError ||
                             ev.error == kNoGroupError || ev.error == "the router is stopping";
    const std::string message =
        ev.finish == FinishReason::kCancelled ? "the request was cancelled" : ev.error;
    HttpResponse err = unavailable ? ApiError(503, message, "service_unavailable", "",
                                              ev.error == kTimeoutError ? "timeout" : "unavailable")
                                   : ApiError(500, message.empty() ? "generation failed" : message,
                                              "server_error", "", "");
    if (stream) {
      responder->Write("data: " + err.body + "\n\n");
      responder->Write("data: [DONE]\n\n");
      responder->End();
    } else {
      Count(err.status);
      responder->Respond(std::move(err));
    }
  }

  void Emit(const std::string& piece) {
    if (piece.empty()) return;
    if (stream) {
      Send(Chunk(piece, nullptr));
    } else {
      out += piece;
    }
  }
};

}  // namespace

namespace {

// The chat messages' text: content as a string, or an array of {"type": "text", "text": ...}
// parts (joined), or null for an assistant turn without text.
bool ReadMessages(const Json& messages, std::vector<ChatMessage>* out, HttpResponse* error) {
  auto bad = [&](const std::string& message) {
    *error = BadParam("messages", message);
    return false;
  };
  if (!messages.is_array() || messages.empty()) {
    return bad("'messages' must be a non-empty array of {role, content} objects");
  }
  if (messages.size() > 4096) return bad("at most 4096 messages are allowed");
  for (size_t i = 0; i < messages.size(); ++i) {
    const Json& m = messages[i];
    const std::string at = "messages[" + std::to_string(i) + "]";
    if (!m.is_object()) return bad(at + " must be an object");
    auto role = m.find("role");
    if (role == m.end() || !role->is_string() || role->get<std::string>().empty()) {
      return bad(at + ".role must be a non-empty string");
    }
    ChatMessage msg;
    msg.role = role->get<std::string>();
    if (msg.role != "system" && msg.role != "user" && msg.role != "assistant" &&
        msg.role != "developer") {
      return bad(at + ".role '" + msg.role +
                 "' is not supported (system, developer, user or assistant)");
    }
    if (msg.role == "developer") msg.role = "system";
    auto content = m.find("content");
    if (content == m.end() || content->is_null()) {
      if (msg.role != "assistant") return bad(at + ".content is required");
    } else if (content->is_string()) {
      msg.content = content->get<std::string>();
    } else if (content->is_array()) {
      for (const Json& part : *content) {
        if (!part.is_object() || part.value("type", "") != "text" || !part.contains("text") ||
            !part["text"].is_string()) {
          return bad(at + ".content: only parts of type 'text' are supported");
        }
        msg.content += part["text"].get<std::string>();
      }
    } else {
      return bad(at + ".content must be a string or an array of text parts");
    }
    for (const char* unsupported : {"tool_calls", "function_call", "tool_call_id"}) {
      if (auto it = m.find(unsupported); it != m.end() && !it->is_null()) {
        *error = BadParam("messages", at + "." + unsupported + " is not supported by this server",
                          "unsupported_parameter");
        return false;
      }
    }
    out->push_back(std::move(msg));
  }
  return true;
}

}  // namespace

Result<CompletionRequest> ParseCompletionRequest(const std::string& body,
                                                 const CompletionsOptions& options,
                                                 const Tokenizer& tokenizer, HttpResponse* error) {
  return ParseRequest(body, options, tokenizer, RequestKind::kText, error);
}

Result<CompletionRequest> ParseChatRequest(const std::string& body,
                                           const CompletionsOptions& options,
                                           const Tokenizer& tokenizer, HttpResponse* error) {
  return ParseRequest(body, options, tokenizer, RequestKind::kChat, error);
}

Result<CompletionRequest> ParseRequest(const std::string& body, const CompletionsOptions& options,
                                       const Tokenizer& tokenizer, RequestKind kind,
                                       HttpResponse* error) {
  auto fail = [&](HttpResponse res) -> Result<CompletionRequest> {
    *error = std::move(res);
    return InvalidArgument(error->body);
  };
  Json j = Json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) {
    return fail(ApiError(400, "the request body is not valid JSON", "invalid_request_error", "",
                         "invalid_json"));
  }
  if (!j.is_object()) {
    return fail(ApiError(400, "the request body must be a JSON object", "invalid_request_error", "",
                         "invalid_json"));
  }
  for (const char* key : kUnsupported) {
    auto it = j.find(key);
    if (it != j.end() && !Neutral(key, *it)) {
      return fail(BadParam(key, std::string("'") + key + "' is not supported by this server",
                           "unsupported_parameter"));
    }
  }
  // model
  auto model = j.find("model");
  if (model == j.end() || model->is_null()) {
    return fail(BadParam("model", "you must provide a model parameter", "missing_required"));
  }
  if (!model->is_string()) return fail(BadParam("model", "'model' must be a string"));
  if (model->get<std::string>() != options.model_name) {
    return fail(ApiError(404,
                         "the model '" + model->get<std::string>() +
                             "' does not exist; this "
                             "server serves '" +
                             options.model_name + "'",
                         "invalid_request_error", "model", "model_not_found"));
  }
  CompletionRequest out;
  out.kind = kind;
  if (kind == RequestKind::kChat) {
    for (const char* key : {"tools", "tool_choice", "functions", "function_call"}) {
      auto it = j.find(key);
      if (it != j.end() && !it->is_null() && !(it->is_array() && it->empty()) &&
          !(it->is_string() && it->get<std::string>() == "none")) {
        return fail(BadParam(key, std::string("'") + key + "' is not supported by this server",
                             "unsupported_parameter"));
      }
    }
    if (auto rf = j.find("response_format");
        rf != j.end() && !rf->is_null() && !(rf->is_object() && rf->value("type", "") == "text")) {
      return fail(BadParam("response_format", "only {\"type\": \"text\"} is supported",
                           "unsupported_parameter"));
    }
    auto messages = j.find("messages");
    if (messages == j.end() || messages->is_null()) {
      return fail(BadParam("messages", "you must provide messages", "missing_required"));
    }
    std::vector<ChatMessage> chat;
    if (!ReadMessages(*messages, &chat, error)) return InvalidArgument("messages");
    if (options.chat_template == nullptr) {
      return fail(BadParam("messages",
                           "this model has no chat template; use /v1/completions with a prompt",
                           "no_chat_template"));
    }
    auto text = options.chat_template->Render(chat, options.bos_token, options.eos_token,
                                              /*add_generation_prompt=*/true);
    if (!text.ok()) return fail(BadParam("messages", text.status().message()));
    // The template writes the special tokens itself (BOS included).
    auto ids = tokenizer.Encode(*text, /*add_special_tokens=*/false);
    if (!ids.ok()) {
      return fail(
          BadParam("messages", "the conversation cannot be tokenized: " + ids.status().message()));
    }
    out.prompt_ids = std::move(*ids);
  }
  // prompt
  auto prompt = kind == RequestKind::kText ? j.find("prompt") : j.end();
  if (kind == RequestKind::kText && (prompt == j.end() || prompt->is_null())) {
    return fail(BadParam("prompt", "you must provide a prompt", "missing_required"));
  }

  auto encode = [&](const std::string& text) -> bool {
    auto ids = tokenizer.Encode(text, /*add_special_tokens=*/true);
    if (!ids.ok()) {
      *error = BadParam("prompt", "the prompt cannot be tokenized: " + ids.status().message());
      return false;
    }
    out.prompt_ids = std::move(*ids);
    return true;
  };
  if (kind == RequestKind::kChat) {
    // The conversation is already tokenized.
  } else if (prompt->is_string()) {
    if (!encode(prompt->get<std::string>())) return InvalidArgument("prompt");
  } else if (prompt->is_array() && prompt->size() == 1 && (*prompt)[0].is_string()) {
    if (!encode((*prompt)[0].get<std::string>())) return InvalidArgument("prompt");
  } else if (prompt->is_array() && !prompt->empty() &&
             std::all_of(prompt->begin(), prompt->end(),
                         [](const Json& x) { return x.is_number_integer(); })) {
    for (const Json& x : *prompt) {
      const int64_t id = x.get<int64_t>();
      if (id < 0 || id >= static_cast<int64_t>(tokenizer.vocab_size())) {
        return fail(BadParam("prompt", "prompt token " + std::to_string(id) +
                                           " is not in the vocabulary of " +
                                           std::to_string(tokenizer.vocab_size())));
      }
      out.prompt_ids.push_back(static_cast<int32_t>(id));
    }
  } else if (prompt->is_array() && prompt->size() > 1) {
    return fail(BadParam("prompt", "batched prompts are not supported: send one prompt per request",
                         "unsupported_parameter"));
  } else {
    return fail(BadParam("prompt", "'prompt' must be a string or an array of token ids"));
  }
  if (out.prompt_ids.empty()) return fail(BadParam("prompt", "the prompt is empty"));
  const uint64_t prompt_len = out.prompt_ids.size();
  auto context_error = [&](uint64_t completion) {
    return ApiError(400,
                    "this model's maximum context length is " +
                        std::to_string(options.context_length) + " tokens; the request needs " +
                        std::to_string(prompt_len + completion) + " (" +
                        std::to_string(prompt_len) + " in the prompt, " +
                        std::to_string(completion) + " for the completion)",
                    "invalid_request_error", "max_tokens", "context_length_exceeded");
  };
  // max_tokens
  auto max_tokens = j.find("max_tokens");
  if (auto mct = j.find("max_completion_tokens");
      kind == RequestKind::kChat && mct != j.end() && !mct->is_null()) {
    max_tokens = mct;  // The newer name in the chat API.
  }
  uint64_t max_new = options.default_max_tokens;
  if (max_tokens != j.end() && !max_tokens->is_null()) {
    // JSON integers that are not negative parse as unsigned, the others as signed.
    if (!max_tokens->is_number_integer() ||
        (max_tokens->is_number_unsigned() ? max_tokens->get<uint64_t>() == 0
                                          : max_tokens->get<int64_t>() < 1)) {
      return fail(BadParam("max_tokens", "'max_tokens' must be an integer of at least 1"));
    }
    max_new = max_tokens->get<uint64_t>();
    // Compared without a sum that could wrap around for values near 2^64.
    if (max_new > options.context_length || prompt_len > options.context_length - max_new) {
      return fail(context_error(max_new));
    }
  } else if (prompt_len + max_new > options.context_length) {
    if (prompt_len >= options.context_length) return fail(context_error(1));
    max_new = options.context_length - prompt_len;  // The default shrinks to fit.
  }
  out.sampling.max_tokens = static_cast<uint32_t>(max_new);
  // temperature, top_p, top_k, seed
  if (auto t = j.find("temperature"); t != j.end() && !t->is_null()) {
    if (!t->is_number() || !(t->get<double>() >= 0.0 && t->get<double>() <= 2.0)) {
      return fail(BadParam("temperature", "'temperature' must be a number from 0 to 2"));
    }
    out.sampling.temperature = t->get<float>();
  } else {
    out.sampling.temperature = 1.0f;  // OpenAI's default.
  }
  if (auto p = j.find("top_p"); p != j.end() && !p->is_null()) {
    if (!p->is_number() || !(p->get<double>() > 0.0 && p->get<double>() <= 1.0)) {
      return fail(BadParam("top_p", "'top_p' must be a number above 0 and at most 1"));
    }
    // A value below float's range (1e-50) would round to 0, which the worker refuses: keep the
    // smallest normal float instead (the top token only, as asked).
    out.sampling.top_p = std::max(p->get<float>(), std::numeric_limits<float>::min());
  }
  if (auto k = j.find("top_k"); k != j.end() && !k->is_null()) {
    if (!k->is_number_integer() || (k->is_number_unsigned() && k->get<uint64_t>() > 1000000) ||
        k->get<int64_t>() < -1 || k->get<int64_t>() > 1000000) {
      return fail(BadParam("top_k", "'top_k' must be an integer from -1 (off) to 1000000"));
    }
    out.sampling.top_k = static_cast<int32_t>(std::max<int64_t>(0, k->get<int64_t>()));
  }
  if (auto s = j.find("seed"); s != j.end() && !s->is_null()) {
    if (!s->is_number_integer()) return fail(BadParam("seed", "'seed' must be an integer"));
    out.sampling.seed =
        s->is_number_unsigned() ? s->get<uint64_t>() : static_cast<uint64_t>(s->get<int64_t>());
  } else {
    out.sampling.seed = RandomId();
  }
  // stop
  if (auto s = j.find("stop"); s != j.end() && !s->is_null()) {
    std::vector<std::string> stops;
    if (s->is_string()) {
      stops.push_back(s->get<std::string>());
    } else if (s->is_array() &&
               std::all_of(s->begin(), s->end(), [](const Json& x) { return x.is_string(); })) {
      for (const Json& x : *s) stops.push_back(x.get<std::string>());
    } else {
      return fail(BadParam("stop", "'stop' must be a string or an array of strings"));
    }
    if (stops.size() > 16) return fail(BadParam("stop", "at most 16 stop strings are allowed"));
    for (const auto& st : stops) {
      if (st.empty() || st.size() > 256) {
        return fail(BadParam("stop", "each stop string must have 1 to 256 bytes"));
      }
    }
    out.sampling.stop = std::move(stops);
  }
  // stream, stream_options
  if (auto s = j.find("stream"); s != j.end() && !s->is_null()) {
    if (!s->is_boolean()) return fail(BadParam("stream", "'stream' must be a boolean"));
    out.stream = s->get<bool>();
  }
  if (auto so = j.find("stream_options"); so != j.end() && !so->is_null()) {
    if (!out.stream) {
      return fail(BadParam("stream_options", "'stream_options' is only allowed with stream"));
    }
    if (!so->is_object()) {
      return fail(BadParam("stream_options", "'stream_options' must be an object"));
    }
    if (auto u = so->find("include_usage"); u != so->end() && !u->is_null()) {
      if (!u->is_boolean()) {
        return fail(BadParam("stream_options", "'include_usage' must be a boolean"));
      }
      out.include_usage = u->get<bool>();
    }
  }
  return out;
}

Completions::Completions(CompletionsOptions options, const Tokenizer& tokenizer, WorkerLink& link,
                         RouterMetrics* metrics)
    : options_(std::move(options)), tokenizer_(tokenizer), link_(link), metrics_(metrics) {}

void Completions::Handle(const HttpRequest& request, std::shared_ptr<HttpResponder> responder) {
  Run(RequestKind::kText, request, std::move(responder));
}

void Completions::HandleChat(const HttpRequest& request, std::shared_ptr<HttpResponder> responder) {
  Run(RequestKind::kChat, request, std::move(responder));
}

void Completions::Run(RequestKind kind, const HttpRequest& request,
                      std::shared_ptr<HttpResponder> responder) {
  HttpResponse error;
  auto parsed = ParseRequest(request.body, options_, tokenizer_, kind, &error);
  const char* route = kind == RequestKind::kChat ? "/v1/chat/completions" : "/v1/completions";
  if (!parsed.ok()) {
    if (metrics_ != nullptr) metrics_->CountRequest(route, error.status);
    responder->Respond(std::move(error));
    return;
  }
  auto state = std::make_shared<CompletionState>(tokenizer_, parsed->sampling.stop);
  state->responder = responder;
  state->metrics = metrics_;
  state->chat = kind == RequestKind::kChat;
  state->route = route;
  state->id = (state->chat ? "chatcmpl-" : "cmpl-") + FingerprintHex(RandomId());
  state->model = options_.model_name;
  state->created = UnixSeconds();
  state->stream = parsed->stream;
  state->include_usage = parsed->include_usage;
  state->prompt_tokens = static_cast<uint32_t>(parsed->prompt_ids.size());
  Generate g;
  g.token_ids = std::move(parsed->prompt_ids);
  g.sampling = parsed->sampling;
  // Headers first for a stream, so the client sees it start; under the state's lock so no
  // event is written before them.
  std::lock_guard<std::mutex> lock(state->mu);
  auto id = link_.Submit(
      std::move(g), [state](const TokenEvent& ev) { state->OnEvent(ev); },
      options_.request_timeout_ms);
  if (!id.ok()) {
    if (id.status().code() == ErrorCode::kResourceExhausted) {
      HttpResponse res = ApiError(429, id.status().message() + "; retry later",
                                  "rate_limit_exceeded", "", "queue_full");
      res.headers.emplace_back("Retry-After", "1");
      state->Count(429);
      responder->Respond(std::move(res));
    } else {
      const std::string reason = link_.View()->UnavailableReason();
      state->Count(503);
      responder->Respond(ApiError(503, reason, "service_unavailable", "", "unavailable"));
    }
    return;
  }
  if (state->stream) {
    state->Count(200);
    responder->BeginStream(200, "text/event-stream");
  }
  WorkerLink* link = &link_;
  const uint64_t request_id = *id;
  responder->OnClose([link, request_id] { link->Cancel(request_id); });
}

}  // namespace fmoe
