// libFuzzer target for the router's request parsing (router/completions.cc): each input is the
// body of a POST /v1/completions, parsed by ParseCompletionRequest for the model "tiny-moe" with
// a context of 1024 tokens and the tokenizer of deploy/models/tiny-moe (loaded once). Checked,
// besides ASan/UBSan/LeakSanitizer and exceptions escaping:
//   - a refused body comes with the HTTP answer: status 400 or 404 and a JSON body
//     {"error": {"message": string, "type": string, "param": string|null, "code": string|null}};
//   - an accepted one has a non-empty prompt of ids below the vocabulary size, 1 <= max_tokens
//     and prompt + max_tokens <= 1024, temperature in [0, 2], top_p in (0, 1], at most 16 stop
//     strings of 1 to 256 bytes each, and include_usage only with stream.
// A violation aborts with __builtin_trap. Seeds: tests/fuzz/make_request_corpus.cc.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>
#include <utility>

#include <nlohmann/json.hpp>

#include "common/tokenizer.h"
#include "router/completions.h"
#include "router/http_server.h"

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
  Check(!request.prompt_ids.empty());
  for (int32_t id : request.prompt_ids) {
    Check(id >= 0 && static_cast<size_t>(id) < tokenizer.vocab_size());
  }
  const SamplingParams& s = request.sampling;
  Check(s.max_tokens >= 1);
  Check(request.prompt_ids.size() + s.max_tokens <= kContextLength);
  Check(s.temperature >= 0.0f && s.temperature <= 2.0f);
  Check(s.top_p > 0.0f && s.top_p <= 1.0f);
  Check(s.stop.size() <= 16);
  for (const std::string& stop : s.stop) Check(!stop.empty() && stop.size() <= 256);
  Check(request.stream || !request.include_usage);
}

void FuzzOne(const std::string& body) {
  static const CompletionsOptions kOptions = [] {
    CompletionsOptions o;
    o.model_name = "tiny-moe";
    o.context_length = kContextLength;
    return o;
  }();
  const Tokenizer& tokenizer = TinyTokenizer();
  HttpResponse error;
  error.status = 0;  // So an error left unwritten is caught.
  auto parsed = ParseCompletionRequest(body, kOptions, tokenizer, &error);
  if (parsed.ok()) {
    CheckRequest(*parsed, tokenizer);
  } else {
    CheckError(error);
  }
}

}  // namespace
}  // namespace fmoe

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fmoe::FuzzOne(std::string(reinterpret_cast<const char*>(data), size));
  return 0;
}
