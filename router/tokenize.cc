#include "router/tokenize.h"

#include <optional>

#include "common/json.h"
#include "common/text/unicode.h"

namespace fmoe {
namespace {

using Json = nlohmann::json;

// The body as an object whose "model", when given, is the served one; otherwise *error is set.
bool ReadBody(const std::string& body, const CompletionsOptions& options, Json* out,
              HttpResponse* error) {
  *out = Json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (out->is_discarded() || !out->is_object()) {
    *error = ApiError(400, "the request body must be a JSON object", "invalid_request_error", "",
                      "invalid_json");
    return false;
  }
  return ReadModel(*out, options, /*required=*/false, error);
}

}  // namespace

HttpResponse Tokenize(const std::string& body, const CompletionsOptions& options,
                      const Tokenizer& tokenizer) {
  HttpResponse error;
  Json j;
  if (!ReadBody(body, options, &j, &error)) return error;
  const bool chat = j.contains("messages");
  bool add_special = !chat;
  bool generation_prompt = true;
  bool token_strs = false;
  if (!ReadBool(j, "add_special_tokens", &add_special, &error) ||
      !ReadBool(j, "add_generation_prompt", &generation_prompt, &error) ||
      !ReadBool(j, "return_token_strs", &token_strs, &error)) {
    return error;
  }
  std::vector<int32_t> ids;
  if (chat) {
    auto rendered = TokenizeChat(j["messages"], options, tokenizer, generation_prompt, &error);
    if (!rendered.ok()) return error;
    ids = std::move(*rendered);
  } else {
    auto prompt = j.find("prompt");
    if (prompt == j.end() || !prompt->is_string()) {
      return BadParam("prompt", "'prompt' (a string) or 'messages' is required");
    }
    auto encoded = tokenizer.Encode(prompt->get<std::string>(), add_special);
    if (!encoded.ok()) {
      return BadParam("prompt", "the prompt cannot be tokenized: " + encoded.status().message());
    }
    ids = std::move(*encoded);
  }
  Json out = {{"count", ids.size()}, {"max_model_len", options.context_length}, {"tokens", ids}};
  if (token_strs) {
    Json strs = Json::array();
    for (int32_t id : ids) strs.push_back(ToValidUtf8(tokenizer.IdToToken(id)));
    out["token_strs"] = std::move(strs);
  } else {
    out["token_strs"] = nullptr;
  }
  HttpResponse res;
  res.body = JsonText(out);
  return res;
}

HttpResponse Detokenize(const std::string& body, const CompletionsOptions& options,
                        const Tokenizer& tokenizer) {
  HttpResponse error;
  Json j;
  if (!ReadBody(body, options, &j, &error)) return error;
  auto tokens = j.find("tokens");
  if (tokens == j.end() || !tokens->is_array()) {
    return BadParam("tokens", "'tokens' must be an array of token ids");
  }
  std::vector<int32_t> ids;
  const int64_t vocab = static_cast<int64_t>(tokenizer.vocab_size());
  for (const Json& t : *tokens) {
    if (!t.is_number_integer() || t.get<int64_t>() < 0 || t.get<int64_t>() >= vocab) {
      return BadParam("tokens", "'tokens' holds " + JsonTypeName(t) +
                                    ", not a token id of the vocabulary of " +
                                    std::to_string(vocab));
    }
    ids.push_back(t.get<int32_t>());
  }
  HttpResponse res;
  res.body = JsonText(Json{{"prompt", ToValidUtf8(tokenizer.Decode(ids, false))}});
  return res;
}

HttpResponse TokenizerInfo(const CompletionsOptions& options, const Tokenizer& tokenizer) {
  const auto text = [&](std::optional<int32_t> id) -> Json {
    if (!id) return nullptr;
    return ToValidUtf8(tokenizer.IdToToken(*id));
  };
  const std::optional<int32_t> pad = tokenizer.TokenToId("<pad>");
  Json out = {{"bos_token", text(tokenizer.bos_id())},
              {"eos_token", text(tokenizer.eos_id())},
              {"pad_token", text(pad && tokenizer.IsSpecial(*pad) ? pad : std::nullopt)},
              {"model_max_length", options.context_length},
              {"vocab_size", tokenizer.vocab_size()},
              {"chat_template", tokenizer.chat_template().empty()
                                    ? Json(nullptr)
                                    : Json(ToValidUtf8(tokenizer.chat_template()))}};
  HttpResponse res;
  res.body = JsonText(out);
  return res;
}

}  // namespace fmoe
