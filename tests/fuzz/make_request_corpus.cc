// Writes the seed corpus of request_fuzz: /v1/completions bodies, one file each, into the directory
// named on the command line. Valid ones (string, one-string-array and token-id prompts, batches of
// them, stream with stream_options, stop as a string and an array, seed, temperature, top_p (one
// below float's range too), top_k, n, logprobs, echo (with logprobs too), the logits processing
// parameters, the unsupported parameters at their neutral values, Unicode and special tokens in the
// prompt) and invalid ones (missing and wrong model, n=17, best_of, each processing parameter out
// of range, bad JSON, huge max_tokens, mixed and nested prompt batches, ids outside the vocabulary,
// invalid UTF-8, lone surrogates, deep nesting, values out of range). Each seed is parsed first, as
// request_fuzz does, and must end as listed (accepted, or refused with that status and error code);
// exits 1 if one does not. Usage: make_request_corpus DIR
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <system_error>
#include <utility>
#include <vector>

#include "common/json.h"
#include "common/text/tokenizer.h"
#include "router/completion_request.h"
#include "router/http_server.h"

namespace fmoe {
namespace {

struct Seed {
  std::string name;
  std::string body;
  int status = 200;  // 200: accepted; else the error's HTTP status.
  std::string code;  // The error's "code" when refused.
};

Seed Ok(std::string name, std::string body) {
  return {.name = std::move(name), .body = std::move(body), .status = 200, .code = ""};
}

std::string Nested(int depth, const std::string& inner) {
  return std::string(depth, '[') + inner + std::string(depth, ']');
}

std::vector<Seed> Seeds() {
  const std::string m = R"("model":"tiny-moe",)";
  std::string seventeen_stops = R"("stop":[)";
  for (int i = 0; i < 17; ++i) seventeen_stops += (i ? ",\"s" : "\"s") + std::to_string(i) + "\"";
  seventeen_stops += "]";
  return {
      // Accepted.
      Ok("ok-string-prompt", "{" + m + R"("prompt":"Hello, world","max_tokens":8})"),
      Ok("ok-token-ids", "{" + m + R"("prompt":[1,15,200,4095],"max_tokens":4})"),
      Ok("ok-token-ids-in-array", "{" + m + R"("prompt":[[1,15,200]],"max_tokens":4})"),
      Ok("ok-batch-of-ids", "{" + m + R"("prompt":[[1,2],[3]],"n":2,"echo":true})"),
      Ok("ok-echo-scores-only", "{" + m +
                                    R"("prompt":[1,300,301],"echo":true,"logprobs":2,)"
                                    R"("max_tokens":0})"),
      Ok("ok-batch-of-strings", "{" + m + R"("prompt":["a","b c"],"logprobs":1,"echo":true})"),
      Ok("ok-one-string-array", "{" + m + R"("prompt":["Once upon a time"]})"),
      Ok("ok-stream-usage", "{" + m +
                                R"("prompt":"Count: 1, 2,","stream":true,)"
                                R"("stream_options":{"include_usage":true},"max_tokens":16})"),
      Ok("ok-stop-string", "{" + m + R"("prompt":"Q: hi\nA:","stop":"\n"})"),
      Ok("ok-stop-array", "{" + m + R"("prompt":"List:","stop":["\n\n","###","</s>"]})"),
      Ok("ok-sampling", "{" + m +
                            R"("prompt":"x","seed":42,"temperature":0.7,"top_p":0.9,"top_k":40,)"
                            R"("max_tokens":32})"),
      Ok("ok-edges", "{" + m +
                         R"("prompt":"a","temperature":0,"top_p":1,"top_k":-1,)"
                         R"("seed":18446744073709551615,"max_tokens":1000,"stream":false})"),
      Ok("ok-neutral", "{" + m +
                           R"("prompt":"a","n":1,"best_of":1,"echo":false,"suffix":"",)"
                           R"("logit_bias":{},"presence_penalty":0,"frequency_penalty":0.0,)"
                           R"("repetition_penalty":1.0,"min_tokens":0,"ignore_eos":false,)"
                           R"("logprobs":null,"top_logprobs":null,"max_tokens":null,"user":"u1"})"),
      Ok("ok-unicode", "{" + m + R"("prompt":"h\u00e9llo \u4e16\u754c \ud83d\ude00 )" +
                           "\xc3\xa9\xe4\xb8\x96\xf0\x9f\x99\x82\"}"),
      Ok("ok-choices-logprobs", "{" + m +
                                    R"("prompt":"hi","n":3,"seed":7,"logprobs":5,)"
                                    R"("temperature":1.2,"max_tokens":4})"),
      Ok("ok-processing", "{" + m +
                              R"("prompt":"hi","logit_bias":{"5":-100,"300":2.5},"min_p":0.05,)"
                              R"("presence_penalty":1.5,"frequency_penalty":-0.5,)"
                              R"("repetition_penalty":1.2,"min_tokens":2,"ignore_eos":true,)"
                              R"("stop_token_ids":[2,13],"max_tokens":8})"),
      Ok("ok-echo", "{" + m + R"("prompt":[1,300,301],"echo":true,"max_tokens":2})"),
      Ok("ok-echo-logprobs",
         "{" + m + R"("prompt":[1,300,301],"echo":true,"logprobs":2,"max_tokens":1})"),
      // Rounds to 0 as a float; the parser keeps the smallest positive float.
      Ok("ok-top-p-tiny", "{" + m + R"("prompt":"x","top_p":1e-50})"),
      Ok("ok-special-tokens", "{" + m + R"("prompt":"<s>User: hi</s>\n<pad><unk>"})"),
      // Refused.
      {"err-missing-model", R"({"prompt":"hi"})", 400, "missing_required"},
      {"err-wrong-model", R"({"model":"gpt-4","prompt":"hi"})", 404, "model_not_found"},
      {"err-model-not-string", R"({"model":7,"prompt":"hi"})", 400, "invalid_value"},
      {"err-missing-prompt", "{" + m + R"("max_tokens":4})", 400, "missing_required"},
      {"err-n-17", "{" + m + R"("prompt":"hi","n":17})", 400, "invalid_value"},
      {"err-best-of", "{" + m + R"("prompt":"hi","best_of":2})", 400, "unsupported_parameter"},
      // Structured output (router/structured_output.h).
      Ok("ok-json-schema",
         "{" + m +
             R"("prompt":"x","response_format":{"type":"json_schema",)"
             R"("json_schema":{"name":"A","schema":{"type":"object","properties":)"
             R"({"a":{"$ref":"#/$defs/B"}},"$defs":{"B":{"enum":[1,"x"]}}}}}})"),
      Ok("ok-structured-outputs", "{" + m +
                                      R"("prompt":"x","structured_outputs":{"json":)"
                                      R"({"type":"array","items":{"type":"integer"}}}})"),
      Ok("ok-guided-json-text", "{" + m + R"("prompt":"x","guided_json":"{\"type\":\"string\"}"})"),
      Ok("ok-structural-tag",
         "{" + m +
             R"("prompt":"x","response_format":{"type":"structural_tag","triggers":["<f="],)"
             R"("structures":[{"begin":"<f=get>","schema":{"type":"object","properties":)"
             R"({"city":{"type":"string"}}},"end":"</f>"}]}})"),
      Ok("ok-structural-tag-format",
         "{" + m +
             R"("prompt":"x","response_format":{"type":"structural_tag","format":{"type":)"
             R"("triggered_tags","triggers":["<f="],"tags":[{"type":"tag","begin":"<f=get>",)"
             R"("content":{"type":"json_schema","json_schema":{"type":"object"}},"end":["</f>"]}],)"
             R"("at_least_one":false,"stop_after_first":false}}})"),
      {"err-structural-tag-format",
       "{" + m +
           R"("prompt":"x","structured_outputs":{"structural_tag":{"format":{"type":)"
           R"("sequence","elements":[]}}}})",
       400, "unsupported_structural_tag"},
      {"err-structural-tag-trigger",
       "{" + m +
           R"("prompt":"x","structured_outputs":{"structural_tag":{"triggers":["<f","x<f"],)"
           R"("structures":[{"begin":"<f>","schema":{},"end":""}]}}})",
       400, "unsupported_structural_tag"},
      {"err-schema-pattern",
       "{" + m + R"("prompt":"x","guided_json":{"type":"string","pattern":"a"}})", 400,
       "unsupported_schema"},
      {"err-two-schemas",
       "{" + m +
           R"("prompt":"x","guided_json":{},"response_format":{"type":)"
           R"("json_object"}})",
       400, "invalid_value"},
      {"err-logprobs-21", "{" + m + R"("prompt":"hi","logprobs":21})", 400, "invalid_value"},
      {"err-logit-bias-id", "{" + m + R"("prompt":"hi","logit_bias":{"4096":1}})", 400,
       "invalid_value"},
      {"err-logit-bias-value", "{" + m + R"("prompt":"hi","logit_bias":{"5":101}})", 400,
       "invalid_value"},
      {"err-min-p", "{" + m + R"("prompt":"hi","min_p":1.5})", 400, "invalid_value"},
      {"err-penalty", "{" + m + R"("prompt":"hi","frequency_penalty":-2.5})", 400, "invalid_value"},
      {"err-repetition-penalty", "{" + m + R"("prompt":"hi","repetition_penalty":0})", 400,
       "invalid_value"},
      {"err-min-tokens", "{" + m + R"("prompt":"hi","max_tokens":2,"min_tokens":3})", 400,
       "invalid_value"},
      {"err-stop-token-ids", "{" + m + R"("prompt":"hi","stop_token_ids":[-1]})", 400,
       "invalid_value"},
      {"err-bad-json", "{" + m + R"("prompt":"hi")", 400, "invalid_json"},
      {"err-not-object", R"(["tiny-moe","hi"])", 400, "invalid_json"},
      {"err-empty-body", "", 400, "invalid_json"},
      {"err-huge-max-tokens", "{" + m + R"("prompt":"hi","max_tokens":1000000})", 400,
       "context_length_exceeded"},
      {"err-max-tokens-2p63", "{" + m + R"("prompt":"hi","max_tokens":9223372036854775808})", 400,
       "context_length_exceeded"},
      {"err-mixed-prompt", "{" + m + R"("prompt":[1,"a"]})", 400, "invalid_value"},
      {"err-mixed-batch", "{" + m + R"("prompt":["a",[1,2]]})", 400, "invalid_value"},
      {"err-nested-batch", "{" + m + R"("prompt":[[[1]],[2]]})", 400, "invalid_value"},
      {"err-batch-times-n", "{" + m + R"("prompt":["a","b","c","d","e"],"n":16})", 400,
       "invalid_value"},
      {"err-empty-prompt-array", "{" + m + R"("prompt":[]})", 400, "invalid_value"},
      {"err-token-outside-vocab", "{" + m + R"("prompt":[1,4096]})", 400, "invalid_value"},
      {"err-invalid-utf8", "{" + m + "\"prompt\":\"ab\xff\xfe\x80 \xc0\xaf\xed\xa0\x80\"}", 400,
       "invalid_json"},
      {"err-lone-surrogate", "{" + m + R"("prompt":"x\ud800y"})", 400, "invalid_json"},
      {"err-deep-nesting", Nested(300, "1"), 400, "invalid_json"},
      {"err-deep-logit-bias", "{" + m + R"("prompt":"x","logit_bias":)" + Nested(200, "") + "}",
       400, "invalid_value"},
      {"err-temperature", "{" + m + R"("prompt":"x","temperature":2.5})", 400, "invalid_value"},
      {"err-top-p-zero", "{" + m + R"("prompt":"x","top_p":0})", 400, "invalid_value"},
      {"err-top-k", "{" + m + R"("prompt":"x","top_k":1000001})", 400, "invalid_value"},
      {"err-seventeen-stops", "{" + m + R"("prompt":"x",)" + seventeen_stops + "}", 400,
       "invalid_value"},
      {"err-empty-stop", "{" + m + R"("prompt":"x","stop":["a",""]})", 400, "invalid_value"},
      {"err-stream-options-alone", "{" + m + R"("prompt":"x","stream_options":{}})", 400,
       "invalid_value"},
  };
}

// What ParseCompletionRequest made of `seed`, "" when it is what the seed expects.
std::string Mismatch(const Seed& seed, const Tokenizer& tokenizer) {
  CompletionsOptions options;
  options.model_name = "tiny-moe";
  options.context_length = 1024;
  HttpResponse error;
  auto parsed = ParseCompletionRequest(seed.body, options, tokenizer, &error);
  if (parsed.ok()) return seed.status == 200 ? "" : "accepted";
  const nlohmann::json body = nlohmann::json::parse(error.body, nullptr, false);
  std::string code = "?";
  if (body.is_object() && body.contains("error") && body["error"].is_object() &&
      body["error"].contains("code") && body["error"]["code"].is_string()) {
    code = body["error"]["code"].get<std::string>();
  }
  if (error.status == seed.status && code == seed.code) return "";
  return "refused with " + std::to_string(error.status) + " " + code + ": " + error.body;
}

int Main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: make_request_corpus DIR\n");
    return 2;
  }
  const std::filesystem::path dir = argv[1];
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  if (ec) {
    std::fprintf(stderr, "make_request_corpus: %s: %s\n", dir.c_str(), ec.message().c_str());
    return 1;
  }
  auto tokenizer = Tokenizer::Load(FMOE_SOURCE_DIR "/deploy/models/tiny-moe");
  if (!tokenizer.ok()) {
    std::fprintf(stderr, "make_request_corpus: %s\n", tokenizer.status().ToString().c_str());
    return 1;
  }
  const std::vector<Seed> seeds = Seeds();
  for (const Seed& seed : seeds) {
    const std::string mismatch = Mismatch(seed, **tokenizer);
    if (!mismatch.empty()) {
      std::fprintf(stderr, "make_request_corpus: seed %s expects %d %s but was %s\n",
                   seed.name.c_str(), seed.status, seed.code.c_str(), mismatch.c_str());
      return 1;
    }
    const std::filesystem::path path = dir / seed.name;
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(seed.body.data(), static_cast<std::streamsize>(seed.body.size()));
    if (!out.flush()) {
      std::fprintf(stderr, "make_request_corpus: %s: write failed\n", path.c_str());
      return 1;
    }
  }
  std::printf("make_request_corpus: %zu bodies in %s\n", seeds.size(), dir.c_str());
  return 0;
}

}  // namespace
}  // namespace fmoe

int main(int argc, char** argv) { return fmoe::Main(argc, argv); }
