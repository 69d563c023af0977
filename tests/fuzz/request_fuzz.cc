// libFuzzer target for the router's request parsing (router/completion_request.cc,
// router/tokenize.cc): each input is a request body, parsed as a POST /v1/completions, a POST
// /v1/chat/completions (through the tiny model's chat template), a POST /tokenize and a POST
// /detokenize, for the model "tiny-moe" with a context of 1024 tokens and the tokenizer of
// deploy/models/tiny-moe (loaded once). Checked, besides ASan/UBSan/LeakSanitizer and
// exceptions escaping:
//   - a refused body comes with the HTTP answer: status 400 or 404 and a JSON body
//     {"error": {"message": string, "type": string, "param": string|null, "code": string|null}};
//   - an accepted one has a non-empty prompt of ids below the vocabulary size, 1 <= max_tokens
//     and prompt + max_tokens <= 1024, temperature in [0, 2], top_p in (0, 1], min_p in [0, 1],
//     penalties in range, logit_bias ids in the vocabulary with |bias| <= 100, 1 <= n <= 16,
//     logprobs in [-1, 20], min_tokens <= max_tokens (CheckSampling holds), at most 16 stop
//     strings of 1 to 256 bytes each (kept by the router, none in the sampling parameters), and
//     include_usage only with stream;
//   - /tokenize answers count == len(tokens) and /detokenize a string, both as valid JSON.
// A violation aborts with __builtin_trap. Seeds: tests/fuzz/make_request_corpus.cc.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <utility>

#include <cmath>
#include <optional>

#include "common/json.h"
#include "common/text/chat_template.h"
#include "common/text/tokenizer.h"
#include "common/wire/sampling_limits.h"
#include "router/completion_request.h"
#include "router/http_server.h"
#include "router/tokenize.h"

namespace fmoe {
namespace {

using Json = nlohmann::json;

constexpr uint32_t kContextLength = 1024;

void Check(bool ok) {
  if (!ok) __builtin_trap();
}

const Tokenizer& TinyTokenizer() {
  static const std::unique_ptr<Tokenizer> tokenizer = [] {
    auto loaded = Tokenizer::Load(FMOE_SOURCE_DIR "/deploy/models/tiny-moe");
    if (!loaded.ok()) {
      std::fprintf(stderr, "request_fuzz: %s\n", loaded.status().ToString().c_str());
      std::abort();
    }
    return std::move(*loaded);
  }();
  return *tokenizer;
}

bool IsStringOrNull(const Json& error, const char* key) {
  auto it = error.find(key);
  return it != error.end() && (it->is_string() || it->is_null());
}

void CheckError(const HttpResponse& error) {
  Check(error.status == 400 || error.status == 404);
  const Json body = Json::parse(error.body, nullptr, /*allow_exceptions=*/false);
  Check(body.is_object());
  auto it = body.find("error");
  Check(it != body.end() && it->is_object());
  const Json& e = *it;
  Check(e.contains("message") && e["message"].is_string());
  Check(e.contains("type") && e["type"].is_string());
  Check(IsStringOrNull(e, "param"));
  Check(IsStringOrNull(e, "code"));
}

void CheckRequest(const CompletionRequest& request, const Tokenizer& tokenizer) {
  Check(!request.prompts.empty() && request.prompts.size() <= kMaxPrompts);
  Check(request.kind == RequestKind::kText || request.prompts.size() == 1);
  const SamplingParams& s = request.sampling;
  // max_tokens 0 only scores a prompt: completions with echo.
  Check(s.max_tokens >= 1 || (request.echo && request.kind == RequestKind::kText));
  for (const PromptInput& p : request.prompts) {
    Check(!p.ids.empty());
    for (int32_t id : p.ids) Check(id >= 0 && static_cast<size_t>(id) < tokenizer.vocab_size());
    Check(p.ids.size() + s.max_tokens <= kContextLength);
    Check(request.echo || p.text.empty());
  }
  Check(request.prompts.size() * request.n <= kMaxPrompts);
  Check(s.temperature >= 0.0f && s.temperature <= 2.0f);
  Check(s.top_p > 0.0f && s.top_p <= 1.0f);
  Check(s.min_p >= 0.0f && s.min_p <= 1.0f);
  Check(std::fabs(s.presence_penalty) <= 2.0f && std::fabs(s.frequency_penalty) <= 2.0f);
  Check(s.repetition_penalty > 0.0f && std::isfinite(s.repetition_penalty));
  for (const auto& [id, bias] : s.logit_bias) {
    Check(id >= 0 && static_cast<size_t>(id) < tokenizer.vocab_size() && std::fabs(bias) <= 100);
  }
  Check(request.n >= 1 && request.n <= kMaxChoices);
  Check(s.logprobs >= -1 && s.logprobs <= kMaxLogprobs);
  Check(s.min_tokens <= s.max_tokens);
  for (int32_t id : s.stop_token_ids) {
    Check(id >= 0 && static_cast<size_t>(id) < tokenizer.vocab_size());
  }
  Check(s.stop.empty());  // Stop strings stay at the router (request.stop).
  Check(request.stop.size() <= 16);
  for (const std::string& stop : request.stop) Check(!stop.empty() && stop.size() <= 256);
  Check(CheckSampling(s, static_cast<uint32_t>(tokenizer.vocab_size()), nullptr));
  Check(request.stream || !request.include_usage);
}

// /tokenize and /detokenize: an answer is 200 with its shape, or an error object.
void CheckTokenRoute(const HttpResponse& res, bool tokenize) {
  if (res.status != 200) return CheckError(res);
  const Json body = Json::parse(res.body, nullptr, /*allow_exceptions=*/false);
  Check(body.is_object());
  if (tokenize) {
    Check(body.contains("tokens") && body["tokens"].is_array());
    Check(body.contains("count") && body["count"] == body["tokens"].size());
  } else {
    Check(body.contains("prompt") && body["prompt"].is_string());
  }
}

void FuzzOne(const std::string& body) {
  const Tokenizer& tokenizer = TinyTokenizer();
  static const std::optional<ChatTemplate> kTemplate = [&]() -> std::optional<ChatTemplate> {
    auto compiled = ChatTemplate::Compile(tokenizer.chat_template());
    if (!compiled.ok()) return std::nullopt;
    return std::move(*compiled);
  }();
  static const CompletionsOptions kOptions = [] {
    CompletionsOptions o;
    o.model_name = "tiny-moe";
    o.context_length = kContextLength;
    o.chat_template = kTemplate ? &*kTemplate : nullptr;
    o.bos_token = "<s>";
    o.eos_token = "</s>";
    return o;
  }();
  for (RequestKind kind : {RequestKind::kText, RequestKind::kChat}) {
    HttpResponse error;
    error.status = 0;  // So an error left unwritten is caught.
    auto parsed = ParseRequest(body, kOptions, tokenizer, kind, &error);
    if (parsed.ok()) {
      CheckRequest(*parsed, tokenizer);
    } else {
      CheckError(error);
    }
  }
  CheckTokenRoute(Tokenize(body, kOptions, tokenizer), true);
  CheckTokenRoute(Detokenize(body, kOptions, tokenizer), false);
}

}  // namespace
}  // namespace fmoe

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fmoe::FuzzOne(std::string(reinterpret_cast<const char*>(data), size));
  return 0;
}
