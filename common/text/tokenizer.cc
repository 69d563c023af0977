#include "common/text/tokenizer.h"

#include <algorithm>
#include <charconv>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>

#include <spdlog/spdlog.h>

#include "common/json.h"
#include "common/text/bpe_tokenizer.h"
#include "common/text/sentencepiece_tokenizer.h"
#include "common/text/tiktoken_tokenizer.h"
#include "common/text/tokenizer_json.h"
#include "common/text/unicode.h"

namespace fmoe {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

constexpr uintmax_t kMaxFileBytes = 1ull << 30;

Result<std::string> ReadFile(const fs::path& path) {
  std::error_code ec;
  uintmax_t size = fs::file_size(path, ec);
  if (ec) return IoError(path.string() + ": " + ec.message());
  if (size > kMaxFileBytes) {
    return InvalidArgument(path.string() + ": " + std::to_string(size) + " bytes is too large");
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return IoError(path.string() + ": cannot open");
  std::string text(static_cast<size_t>(size), '\0');
  if (!in.read(text.data(), static_cast<std::streamsize>(size))) {
    return IoError(path.string() + ": read failed");
  }
  return text;
}

// "bos_token": "<s>" | {"content": "<s>", ...} | null.
Status ReadTokenField(const Json& root, const char* key, std::optional<std::string>* out) {
  auto it = root.find(key);
  if (it == root.end() || it->is_null()) return Status::Ok();
  if (it->is_string()) {
    *out = it->get<std::string>();
    return Status::Ok();
  }
  if (it->is_object()) {
    auto content = it->find("content");
    if (content != it->end() && content->is_string()) {
      *out = content->get<std::string>();
      return Status::Ok();
    }
  }
  return InvalidArgument(std::string(key) + ": not a string or {\"content\": \"...\"}");
}

Status ReadBoolField(const Json& root, const char* key, std::optional<bool>* out) {
  auto it = root.find(key);
  if (it == root.end() || it->is_null()) return Status::Ok();
  if (!it->is_boolean()) return InvalidArgument(std::string(key) + ": not true or false");
  *out = it->get<bool>();
  return Status::Ok();
}

// "chat_template": "..." | [{"name": "default", "template": "..."}, ...].
Status ReadChatTemplate(const Json& root, std::string* out) {
  auto it = root.find("chat_template");
  if (it == root.end() || it->is_null()) return Status::Ok();
  if (it->is_string()) {
    *out = it->get<std::string>();
    return Status::Ok();
  }
  if (it->is_array()) {
    const Json* chosen = nullptr;
    for (const Json& entry : *it) {
      if (!entry.is_object() || !entry.contains("template") || !entry["template"].is_string()) {
        return InvalidArgument("chat_template: a list entry is not {\"name\", \"template\"}");
      }
      bool is_default = entry.contains("name") && entry["name"] == "default";
      if (chosen == nullptr || is_default) chosen = &entry;
      if (is_default) break;
    }
    if (chosen != nullptr) *out = (*chosen)["template"].get<std::string>();
    return Status::Ok();
  }
  return InvalidArgument("chat_template: not a string or a list of named templates");
}

// "added_tokens_decoder": {"<id>": {"content": "...", "special": bool, ...}, ...}.
Status ReadAddedTokens(const Json& root, std::vector<TokenizerConfig::AddedToken>* out) {
  auto it = root.find("added_tokens_decoder");
  if (it == root.end() || it->is_null()) return Status::Ok();
  if (!it->is_object()) return InvalidArgument("added_tokens_decoder: not an object");
  for (const auto& [key, value] : it->items()) {
    std::string field = "added_tokens_decoder[\"" + key + "\"]";
    TokenizerConfig::AddedToken token;
    auto [ptr, ec] = std::from_chars(key.data(), key.data() + key.size(), token.id);
    if (key.empty() || key[0] < '0' || key[0] > '9' || ec != std::errc() ||
        ptr != key.data() + key.size() || token.id > std::numeric_limits<int32_t>::max()) {
      return InvalidArgument(field + ": not a token id");
    }
    if (!value.is_object() || !value.contains("content") || !value["content"].is_string()) {
      return InvalidArgument(field + ": not {\"content\": \"...\", ...}");
    }
    token.content = value["content"].get<std::string>();
    if (auto special = value.find("special"); special != value.end() && !special->is_null()) {
      if (!special->is_boolean()) return InvalidArgument(field + ".special: not true or false");
      token.special = special->get<bool>();
    }
    out->push_back(std::move(token));
  }
  std::sort(out->begin(), out->end(), [](const auto& a, const auto& b) { return a.id < b.id; });
  return Status::Ok();
}

// `added_tokens`: also read added_tokens_decoder (for a tiktoken.model).
Result<TokenizerConfig> ReadConfig(const fs::path& dir, bool added_tokens) {
  TokenizerConfig config;
  fs::path path = dir / "tokenizer_config.json";
  std::error_code ec;
  if (fs::exists(path, ec)) {
    FMOE_ASSIGN_OR_RETURN(std::string text, ReadFile(path));
    Json root;
    if (Status s = ParseJsonText(text, &root); !s.ok()) return s.WithContext(path.string());
    if (!root.is_object()) return InvalidArgument(path.string() + ": not a JSON object");
    Status st = ReadTokenField(root, "bos_token", &config.bos_token);
    if (st.ok()) st = ReadTokenField(root, "eos_token", &config.eos_token);
    if (st.ok()) st = ReadBoolField(root, "add_bos_token", &config.add_bos_token);
    if (st.ok()) st = ReadBoolField(root, "add_eos_token", &config.add_eos_token);
    if (st.ok()) st = ReadChatTemplate(root, &config.chat_template);
    if (st.ok() && added_tokens) st = ReadAddedTokens(root, &config.added_tokens);
    if (!st.ok()) return st.WithContext(path.string());
  }
  fs::path jinja = dir / "chat_template.jinja";
  if (config.chat_template.empty() && fs::exists(jinja, ec)) {
    FMOE_ASSIGN_OR_RETURN(config.chat_template, ReadFile(jinja));
  }
  return config;
}

}  // namespace

Result<std::unique_ptr<Tokenizer>> Tokenizer::Load(const std::string& dir) {
  fs::path root(dir);
  fs::path json_path = root / "tokenizer.json";
  fs::path model_path = root / "tokenizer.model";
  fs::path tiktoken_path = root / "tiktoken.model";
  std::error_code ec;
  bool have_json = fs::exists(json_path, ec);
  bool have_model = fs::exists(model_path, ec);
  bool tiktoken = !have_json && !have_model && fs::exists(tiktoken_path, ec);
  auto config = ReadConfig(root, tiktoken);
  if (!config.ok()) return config.status().WithContext("tokenizer");
  if (tiktoken) {
    auto text = ReadFile(tiktoken_path);
    if (!text.ok()) return text.status().WithContext("tokenizer");
    auto tok = TiktokenTokenizer::Create(*text, tiktoken_path.string(), *config);
    if (!tok.ok()) return tok.status().WithContext("tokenizer");
    return std::unique_ptr<Tokenizer>(std::move(*tok));
  }
  if (have_json) {
    auto text = ReadFile(json_path);
    if (!text.ok()) return text.status().WithContext("tokenizer");
    bool unsupported = false;
    auto spec = ParseTokenizerJson(*text, &unsupported);
    if (spec.ok()) {
      auto tok = BpeTokenizer::Create(std::move(*spec), *config);
      if (!tok.ok()) return tok.status().WithContext("tokenizer: " + dir);
      return std::unique_ptr<Tokenizer>(std::move(*tok));
    }
    if (!unsupported || !have_model) {
      return spec.status().WithContext("tokenizer: " + json_path.string());
    }
    // A SentencePiece-style tokenizer.json (byte_fallback, Metaspace) next to its
    // tokenizer.model: the model file says the same thing in a form we read.
    spdlog::warn("tokenizer: {}: {}; using {}", json_path.string(), spec.status().message(),
                 model_path.string());
  }
  if (!have_model) {
    return NotFound("tokenizer: " + dir + ": no tokenizer.json, tokenizer.model or tiktoken.model");
  }
  auto tok = SentencePieceTokenizer::Load(model_path.string(), *config);
  if (!tok.ok()) return tok.status().WithContext("tokenizer");
  return std::unique_ptr<Tokenizer>(std::move(*tok));
}

// ---- TextStream ----
//
// Decodes a window of the ids, ids_[prefix_..], and returns what it adds past emitted_ bytes,
// up to the last complete character. The window starts at a token that decodes to something on
// its own, so context-dependent decoding (SentencePiece drops the leading space of the first
// piece written) is the same in the window as in the whole stream; it moves forward whenever
// everything in it has been returned, so each Push costs a few tokens' decoding.

TextStream::TextStream(const Tokenizer& tokenizer, bool skip_special_tokens)
    : tokenizer_(tokenizer), skip_special_(skip_special_tokens) {}

std::string TextStream::Push(int32_t id) {
  ids_.push_back(id);
  std::span<const int32_t> window(ids_.data() + prefix_, ids_.size() - prefix_);
  std::string text = tokenizer_.Decode(window, skip_special_);
  size_t end = text.size() - IncompleteUtf8Tail(text);
  std::string piece;
  if (end > emitted_bytes_) {
    piece = ToValidUtf8(std::string_view(text).substr(emitted_bytes_, end - emitted_bytes_));
  }
  emitted_bytes_ = std::max(emitted_bytes_, end);
  if (end == text.size()) {
    // Everything decoded so far is out: restart the window at the last token that decodes to
    // something by itself (the window always keeps one such token).
    for (size_t i = ids_.size(); i-- > prefix_;) {
      if (!tokenizer_.Decode(std::span<const int32_t>(&ids_[i], 1), skip_special_).empty()) {
        std::span<const int32_t> rest(ids_.data() + i, ids_.size() - i);
        emitted_bytes_ = tokenizer_.Decode(rest, skip_special_).size();
        prefix_ = i;
        break;
      }
    }
  }
  return piece;
}

std::string TextStream::Finish() {
  std::span<const int32_t> window(ids_.data() + prefix_, ids_.size() - prefix_);
  std::string text = tokenizer_.Decode(window, skip_special_);
  std::string rest = text.size() > emitted_bytes_
                         ? ToValidUtf8(std::string_view(text).substr(emitted_bytes_))
                         : std::string();
  emitted_bytes_ = text.size();
  return rest;
}

// ---- StopMatcher ----

StopMatcher::StopMatcher(std::vector<std::string> stops) {
  for (std::string& s : stops) {
    if (!s.empty()) stops_.push_back(std::move(s));
  }
}

std::string StopMatcher::Feed(std::string_view text) {
  if (stopped_) return "";
  pending_.append(text);
  // The earliest stop string in the pending text; the longest one when several start there.
  size_t best = std::string::npos;
  const std::string* best_stop = nullptr;
  for (const std::string& stop : stops_) {
    size_t at = pending_.find(stop);
    if (at == std::string::npos) continue;
    if (at < best || (at == best && stop.size() > best_stop->size())) {
      best = at;
      best_stop = &stop;
    }
  }
  if (best_stop != nullptr) {
    stopped_ = true;
    matched_ = *best_stop;
    std::string out = pending_.substr(0, best);
    pending_.clear();
    return out;
  }
  // Hold back the longest end of the text that could still grow into a stop string.
  size_t hold = 0;
  for (const std::string& stop : stops_) {
    for (size_t n = std::min(stop.size() - 1, pending_.size()); n > hold; --n) {
      if (pending_.compare(pending_.size() - n, n, stop, 0, n) == 0) {
        hold = n;
        break;
      }
    }
  }
  std::string out = pending_.substr(0, pending_.size() - hold);
  pending_.erase(0, pending_.size() - hold);
  return out;
}

std::string StopMatcher::Flush() {
  if (stopped_) return "";
  std::string out;
  out.swap(pending_);
  return out;
}

}  // namespace fmoe
