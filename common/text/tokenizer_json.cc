#include "common/text/tokenizer_json.h"

#include <algorithm>
#include <unordered_map>
#include <utility>

#include "common/json.h"

namespace fmoe {
namespace {

using Json = nlohmann::json;

// A value for an error message: scalars as JSON, containers by kind (never a deep dump).
std::string Describe(const Json& v) {
  switch (v.type()) {
    case Json::value_t::object:
      return "an object";
    case Json::value_t::array:
      return "an array";
    case Json::value_t::discarded:
      return "nothing";
    default:
      return v.dump(-1, ' ', false, Json::error_handler_t::replace);
  }
}

// The largest id accepted for `n` tokens: ids may have gaps, but not absurd ones.
size_t SparseLimit(size_t n) { return std::min<size_t>(kMaxTokenId, 2 * n + 65536); }

std::string JsonQuote(std::string_view s) {
  return Json(std::string(s)).dump(-1, ' ', false, Json::error_handler_t::replace);
}

class Parser {
 public:
  explicit Parser(bool* unsupported) : unsupported_(unsupported) {}

  Status Run(const Json& root, TokenizerJson* out);

 private:
  static Status Fail(const std::string& field, const std::string& message) {
    return InvalidArgument(field + ": " + message);
  }
  Status Unsupported(const std::string& field, const std::string& message) {
    if (unsupported_ != nullptr) *unsupported_ = true;
    return Fail(field, message);
  }

  // Optional members: absent or null gives `fallback`.
  static Status Bool(const Json& obj, const char* key, const std::string& path, bool fallback,
                     bool* out);
  static Status String(const Json& obj, const char* key, const std::string& path,
                       std::optional<std::string>* out);
  static Result<int32_t> Id(const Json& v, const std::string& path);
  static Result<std::string> Type(const Json& obj, const std::string& path);

  Status AddedTokens(const Json& v, TokenizerJson* out);
  Status Normalizer(const Json& v, const std::string& path, TokenizerJson* out);
  Status PreTokenizer(const Json& v, const std::string& path, TokenizerJson* out);
  Status Model(const Json& v, TokenizerJson* out);
  Status PostProcessor(const Json& v, const std::string& path, TokenizerJson* out);
  Status Template(const Json& v, const std::string& path, TokenizerJson* out);
  Status Decoder(const Json& v, const std::string& path, TokenizerJson* out);
  Status CheckAddedAgainstVocab(TokenizerJson* out);

  bool* unsupported_;
  std::unordered_map<std::string, int32_t> vocab_ids_;
};

Status Parser::Bool(const Json& obj, const char* key, const std::string& path, bool fallback,
                    bool* out) {
  *out = fallback;
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return Status::Ok();
  if (!it->is_boolean()) return Fail(path + "." + key, Describe(*it) + " is not true or false");
  *out = it->get<bool>();
  return Status::Ok();
}

Status Parser::String(const Json& obj, const char* key, const std::string& path,
                      std::optional<std::string>* out) {
  out->reset();
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return Status::Ok();
  if (!it->is_string()) return Fail(path + "." + key, Describe(*it) + " is not a string");
  *out = it->get<std::string>();
  return Status::Ok();
}

Result<int32_t> Parser::Id(const Json& v, const std::string& path) {
  if (!v.is_number_integer()) return Fail(path, Describe(v) + " is not an integer id");
  bool in_range = v.is_number_unsigned() ? v.get<uint64_t>() <= uint64_t{kMaxTokenId}
                                         : v.get<int64_t>() >= 0 && v.get<int64_t>() <= kMaxTokenId;
  if (!in_range) {
    return Fail(path, Describe(v) + " is out of range (0.." + std::to_string(kMaxTokenId) + ")");
  }
  return static_cast<int32_t>(v.get<int64_t>());
}

Result<std::string> Parser::Type(const Json& obj, const std::string& path) {
  if (!obj.is_object()) return Fail(path, Describe(obj) + " is not an object");
  auto it = obj.find("type");
  if (it == obj.end() || !it->is_string()) return Fail(path + ".type", "missing or not a string");
  return it->get<std::string>();
}

Status Parser::Run(const Json& root, TokenizerJson* out) {
  if (!root.is_object()) return Fail("(root)", "not a JSON object");
  auto model = root.find("model");
  if (model == root.end()) return Fail("model", "missing");
  FMOE_RETURN_IF_ERROR(Model(*model, out));
  if (auto it = root.find("added_tokens"); it != root.end()) {
    FMOE_RETURN_IF_ERROR(AddedTokens(*it, out));
  }
  FMOE_RETURN_IF_ERROR(CheckAddedAgainstVocab(out));
  if (auto it = root.find("normalizer"); it != root.end()) {
    FMOE_RETURN_IF_ERROR(Normalizer(*it, "normalizer", out));
  }
  if (auto it = root.find("pre_tokenizer"); it != root.end()) {
    FMOE_RETURN_IF_ERROR(PreTokenizer(*it, "pre_tokenizer", out));
  }
  if (auto it = root.find("post_processor"); it != root.end()) {
    FMOE_RETURN_IF_ERROR(PostProcessor(*it, "post_processor", out));
  }
  auto decoder = root.find("decoder");
  if (decoder == root.end() || decoder->is_null()) {
    return Unsupported("decoder", "null is not supported (only ByteLevel)");
  }
  return Decoder(*decoder, "decoder", out);
}

Status Parser::Model(const Json& v, TokenizerJson* out) {
  if (!v.is_object()) return Fail("model", Describe(v) + " is not an object");
  if (auto it = v.find("type"); it != v.end()) {
    if (!it->is_string()) return Fail("model.type", Describe(*it) + " is not a string");
    if (it->get<std::string>() != "BPE") {
      return Unsupported("model.type",
                         JsonQuote(it->get<std::string>()) + " is not supported (only BPE)");
    }
  }
  bool byte_fallback = false;
  FMOE_RETURN_IF_ERROR(Bool(v, "byte_fallback", "model", false, &byte_fallback));
  if (byte_fallback) return Unsupported("model.byte_fallback", "true is not supported");
  FMOE_RETURN_IF_ERROR(Bool(v, "fuse_unk", "model", false, &out->fuse_unk));
  FMOE_RETURN_IF_ERROR(Bool(v, "ignore_merges", "model", false, &out->ignore_merges));
  if (auto it = v.find("dropout"); it != v.end() && !it->is_null()) {
    if (!it->is_number()) return Fail("model.dropout", Describe(*it) + " is not a number");
    if (it->get<double>() != 0.0) {
      return Unsupported("model.dropout", Describe(*it) + " is not supported (only null or 0)");
    }
  }
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    std::optional<std::string> s;
    FMOE_RETURN_IF_ERROR(String(v, key, "model", &s));
    if (s && !s->empty()) {
      return Unsupported(std::string("model.") + key,
                         JsonQuote(*s) + " is not supported (only null)");
    }
  }

  auto vocab = v.find("vocab");
  if (vocab == v.end() || !vocab->is_object()) {
    return Fail("model.vocab", "missing or not an object of token: id");
  }
  vocab_ids_.reserve(vocab->size());
  int32_t max_id = -1;
  for (const auto& [token, id_json] : vocab->items()) {
    std::string path = "model.vocab[" + JsonQuote(token) + "]";
    if (token.empty()) return Fail(path, "empty token");
    FMOE_ASSIGN_OR_RETURN(int32_t id, Id(id_json, path));
    vocab_ids_.emplace(token, id);
    max_id = std::max(max_id, id);
  }
  // Tables are indexed by id: refuse ids far beyond the number of tokens.
  if (static_cast<size_t>(max_id) > SparseLimit(vocab_ids_.size())) {
    return Fail("model.vocab", "id " + std::to_string(max_id) + " is far beyond the " +
                                   std::to_string(vocab_ids_.size()) +
                                   " tokens (ids must be dense)");
  }
  std::vector<const std::string*> by_id(static_cast<size_t>(max_id + 1), nullptr);
  for (const auto& [token, id] : vocab_ids_) {
    if (by_id[id] != nullptr) {
      // Name the pair in a stable order whatever the hash order.
      const std::string& a = std::min(*by_id[id], token);
      const std::string& b = std::max(*by_id[id], token);
      return Fail("model.vocab", "tokens " + JsonQuote(a) + " and " + JsonQuote(b) +
                                     " both have id " + std::to_string(id));
    }
    by_id[id] = &token;
  }
  out->vocab.assign(by_id.size(), std::string());
  out->present.assign(by_id.size(), false);
  for (size_t id = 0; id < by_id.size(); ++id) {
    if (by_id[id] == nullptr) continue;
    out->vocab[id] = *by_id[id];
    out->present[id] = true;
  }

  std::optional<std::string> unk;
  FMOE_RETURN_IF_ERROR(String(v, "unk_token", "model", &unk));
  if (unk) {
    auto it = vocab_ids_.find(*unk);
    if (it == vocab_ids_.end())
      return Fail("model.unk_token", JsonQuote(*unk) + " is not in the vocab");
    out->unk_id = it->second;
  }

  auto merges = v.find("merges");
  if (merges == v.end() || merges->is_null()) return Status::Ok();
  if (!merges->is_array()) return Fail("model.merges", Describe(*merges) + " is not a list");
  out->merges.reserve(merges->size());
  for (size_t i = 0; i < merges->size(); ++i) {
    const Json& m = (*merges)[i];
    std::string path = "model.merges[" + std::to_string(i) + "]";
    std::string left, right;
    if (m.is_string()) {  // "a b"
      const std::string& s = m.get_ref<const std::string&>();
      size_t space = s.find(' ');
      if (space == std::string::npos || space == 0 || space + 1 == s.size() ||
          s.find(' ', space + 1) != std::string::npos) {
        return Fail(path, JsonQuote(s) + " is not two tokens separated by one space");
      }
      left = s.substr(0, space);
      right = s.substr(space + 1);
    } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
      left = m[0].get<std::string>();
      right = m[1].get<std::string>();
    } else {
      return Fail(path, Describe(m) + " is not \"a b\" or [\"a\", \"b\"]");
    }
    BpeMerge merge;
    for (auto [token, id] : {std::pair{&left, &merge.left}, std::pair{&right, &merge.right}}) {
      auto it = vocab_ids_.find(*token);
      if (it == vocab_ids_.end()) return Fail(path, JsonQuote(*token) + " is not in the vocab");
      *id = it->second;
    }
    auto it = vocab_ids_.find(left + right);
    if (it == vocab_ids_.end()) {
      return Fail(path, JsonQuote(left) + " + " + JsonQuote(right) + " is not in the vocab");
    }
    merge.result = it->second;
    out->merges.push_back(merge);
  }
  return Status::Ok();
}

Status Parser::AddedTokens(const Json& v, TokenizerJson* out) {
  if (v.is_null()) return Status::Ok();
  if (!v.is_array()) return Fail("added_tokens", Describe(v) + " is not a list");
  for (size_t i = 0; i < v.size(); ++i) {
    const Json& t = v[i];
    std::string path = "added_tokens[" + std::to_string(i) + "]";
    if (!t.is_object()) return Fail(path, Describe(t) + " is not an object");
    AddedTokenSpec spec;
    auto id = t.find("id");
    if (id == t.end()) return Fail(path + ".id", "missing");
    FMOE_ASSIGN_OR_RETURN(spec.id, Id(*id, path + ".id"));
    std::optional<std::string> content;
    FMOE_RETURN_IF_ERROR(String(t, "content", path, &content));
    if (!content || content->empty()) return Fail(path + ".content", "missing or empty");
    spec.content = std::move(*content);
    FMOE_RETURN_IF_ERROR(Bool(t, "special", path, false, &spec.special));
    FMOE_RETURN_IF_ERROR(Bool(t, "lstrip", path, false, &spec.lstrip));
    FMOE_RETURN_IF_ERROR(Bool(t, "rstrip", path, false, &spec.rstrip));
    FMOE_RETURN_IF_ERROR(Bool(t, "single_word", path, false, &spec.single_word));
    FMOE_RETURN_IF_ERROR(Bool(t, "normalized", path, !spec.special, &spec.normalized));
    out->added_tokens.push_back(std::move(spec));
  }
  return Status::Ok();
}

// Added tokens share the id space with the vocab: an added token that is also a vocab entry
// must carry the vocab's id, and no id may name two different strings.
Status Parser::CheckAddedAgainstVocab(TokenizerJson* out) {
  std::unordered_map<int32_t, size_t> by_id;
  std::unordered_map<std::string, size_t> by_content;
  for (size_t i = 0; i < out->added_tokens.size(); ++i) {
    const AddedTokenSpec& t = out->added_tokens[i];
    std::string path = "added_tokens[" + std::to_string(i) + "]";
    if (static_cast<size_t>(t.id) > SparseLimit(vocab_ids_.size() + out->added_tokens.size())) {
      return Fail(path + ".id", std::to_string(t.id) + " is far beyond the " +
                                    std::to_string(vocab_ids_.size()) +
                                    " tokens of model.vocab (ids must be dense)");
    }
    if (auto it = by_id.find(t.id); it != by_id.end()) {
      return Fail(path, "id " + std::to_string(t.id) + " is also added_tokens[" +
                            std::to_string(it->second) + "]");
    }
    if (auto it = by_content.find(t.content); it != by_content.end()) {
      return Fail(
          path, JsonQuote(t.content) + " is also added_tokens[" + std::to_string(it->second) + "]");
    }
    by_id.emplace(t.id, i);
    by_content.emplace(t.content, i);
    if (auto it = vocab_ids_.find(t.content); it != vocab_ids_.end() && it->second != t.id) {
      return Fail(path, JsonQuote(t.content) + " has id " + std::to_string(t.id) +
                            " but model.vocab gives it " + std::to_string(it->second));
    }
    if (static_cast<size_t>(t.id) < out->present.size() && out->present[t.id] &&
        out->vocab[t.id] != t.content) {
      return Fail(path, "id " + std::to_string(t.id) + " is " + JsonQuote(out->vocab[t.id]) +
                            " in model.vocab, not " + JsonQuote(t.content));
    }
  }
  return Status::Ok();
}

Status Parser::Normalizer(const Json& v, const std::string& path, TokenizerJson* out) {
  if (v.is_null()) return Status::Ok();
  FMOE_ASSIGN_OR_RETURN(std::string type, Type(v, path));
  if (type == "Sequence") {
    auto list = v.find("normalizers");
    if (list == v.end() || !list->is_array()) {
      return Fail(path + ".normalizers", "missing or not a list");
    }
    for (size_t i = 0; i < list->size(); ++i) {
      FMOE_RETURN_IF_ERROR(
          Normalizer((*list)[i], path + ".normalizers[" + std::to_string(i) + "]", out));
    }
    return Status::Ok();
  }
  static const std::pair<const char*, NormalizationForm> kForms[] = {
      {"NFC", NormalizationForm::kNfc},
      {"NFD", NormalizationForm::kNfd},
      {"NFKC", NormalizationForm::kNfkc},
      {"NFKD", NormalizationForm::kNfkd}};
  for (const auto& [name, form] : kForms) {
    if (type == name) {
      out->normalizers.push_back(form);
      return Status::Ok();
    }
  }
  return Unsupported(path + ".type", "normalizer type " + JsonQuote(type) +
                                         " is not supported (NFC, NFD, NFKC, NFKD, Sequence)");
}

Status Parser::PreTokenizer(const Json& v, const std::string& path, TokenizerJson* out) {
  if (v.is_null()) return Status::Ok();
  FMOE_ASSIGN_OR_RETURN(std::string type, Type(v, path));
  PreTokenizerStep step;
  if (type == "Sequence") {
    auto list = v.find("pretokenizers");
    if (list == v.end() || !list->is_array()) {
      return Fail(path + ".pretokenizers", "missing or not a list");
    }
    for (size_t i = 0; i < list->size(); ++i) {
      FMOE_RETURN_IF_ERROR(
          PreTokenizer((*list)[i], path + ".pretokenizers[" + std::to_string(i) + "]", out));
    }
    return Status::Ok();
  } else if (type == "ByteLevel") {
    step.kind = PreTokenizerStep::Kind::kByteLevel;
    FMOE_RETURN_IF_ERROR(Bool(v, "add_prefix_space", path, true, &step.add_prefix_space));
    FMOE_RETURN_IF_ERROR(Bool(v, "use_regex", path, true, &step.use_regex));
  } else if (type == "Digits") {
    step.kind = PreTokenizerStep::Kind::kDigits;
    FMOE_RETURN_IF_ERROR(Bool(v, "individual_digits", path, false, &step.individual_digits));
  } else if (type == "Split") {
    step.kind = PreTokenizerStep::Kind::kSplit;
    auto pattern = v.find("pattern");
    if (pattern == v.end() || !pattern->is_object() || pattern->size() != 1) {
      return Fail(path + ".pattern", "missing or not {\"Regex\": ...} or {\"String\": ...}");
    }
    auto [kind, value] = *pattern->items().begin();
    if ((kind != "Regex" && kind != "String") || !value.is_string()) {
      return Fail(path + ".pattern", "not {\"Regex\": \"...\"} or {\"String\": \"...\"}");
    }
    step.is_regex = kind == "Regex";
    step.pattern = value.get<std::string>();
    FMOE_RETURN_IF_ERROR(Bool(v, "invert", path, false, &step.invert));
    std::optional<std::string> behavior;
    FMOE_RETURN_IF_ERROR(String(v, "behavior", path, &behavior));
    static const std::pair<const char*, SplitBehavior> kBehaviors[] = {
        {"Removed", SplitBehavior::kRemoved},
        {"Isolated", SplitBehavior::kIsolated},
        {"MergedWithPrevious", SplitBehavior::kMergedWithPrevious},
        {"MergedWithNext", SplitBehavior::kMergedWithNext},
        {"Contiguous", SplitBehavior::kContiguous}};
    bool known = false;
    for (const auto& [name, b] : kBehaviors) {
      if (behavior && *behavior == name) {
        step.behavior = b;
        known = true;
      }
    }
    if (!known) {
      return Fail(path + ".behavior", (behavior ? JsonQuote(*behavior) : std::string("missing")) +
                                          " is not Removed, Isolated, MergedWithPrevious, "
                                          "MergedWithNext or Contiguous");
    }
  } else {
    return Unsupported(path + ".type",
                       "pre_tokenizer type " + JsonQuote(type) +
                           " is not supported (ByteLevel, Split, Digits, Sequence)");
  }
  out->pre_tokenizer.push_back(std::move(step));
  return Status::Ok();
}

Status Parser::PostProcessor(const Json& v, const std::string& path, TokenizerJson* out) {
  if (v.is_null()) return Status::Ok();
  FMOE_ASSIGN_OR_RETURN(std::string type, Type(v, path));
  if (type == "ByteLevel") return Status::Ok();  // Only moves offsets, which we do not report.
  if (type == "TemplateProcessing") return Template(v, path, out);
  if (type == "Sequence") {
    auto list = v.find("processors");
    if (list == v.end() || !list->is_array()) {
      return Fail(path + ".processors", "missing or not a list");
    }
    for (size_t i = 0; i < list->size(); ++i) {
      FMOE_RETURN_IF_ERROR(
          PostProcessor((*list)[i], path + ".processors[" + std::to_string(i) + "]", out));
    }
    return Status::Ok();
  }
  return Unsupported(path + ".type",
                     "post_processor type " + JsonQuote(type) +
                         " is not supported (ByteLevel, TemplateProcessing, Sequence)");
}

// {"single": [{"SpecialToken": {"id": "<s>"}}, {"Sequence": {"id": "A"}}],
//  "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}}
Status Parser::Template(const Json& v, const std::string& path, TokenizerJson* out) {
  auto single = v.find("single");
  if (single == v.end() || !single->is_array()) {
    return Fail(path + ".single", "missing or not a list");
  }
  auto specials = v.find("special_tokens");
  if (specials != v.end() && !specials->is_null() && !specials->is_object()) {
    return Fail(path + ".special_tokens", Describe(*specials) + " is not an object");
  }
  std::vector<int32_t> prefix, suffix;
  bool seen_sequence = false;
  for (size_t i = 0; i < single->size(); ++i) {
    const Json& item = (*single)[i];
    std::string ipath = path + ".single[" + std::to_string(i) + "]";
    if (!item.is_object() || item.size() != 1) {
      return Fail(ipath, "not {\"SpecialToken\": ...} or {\"Sequence\": ...}");
    }
    auto [kind, body] = *item.items().begin();
    if (!body.is_object() || !body.contains("id") || !body["id"].is_string()) {
      return Fail(ipath + "." + kind + ".id", "missing or not a string");
    }
    std::string id = body["id"].get<std::string>();
    if (kind == "Sequence") {
      if (id != "A") return Fail(ipath, "a single-sequence template can only hold $A, not $" + id);
      if (seen_sequence) return Fail(ipath, "$A appears twice");
      seen_sequence = true;
    } else if (kind == "SpecialToken") {
      if (specials == v.end() || !specials->is_object() || !specials->contains(id)) {
        return Fail(ipath, JsonQuote(id) + " is not in " + path + ".special_tokens");
      }
      const Json& entry = (*specials)[id];
      std::string epath = path + ".special_tokens[" + JsonQuote(id) + "].ids";
      if (!entry.is_object() || !entry.contains("ids") || !entry["ids"].is_array()) {
        return Fail(epath, "missing or not a list");
      }
      for (size_t k = 0; k < entry["ids"].size(); ++k) {
        std::string kpath = epath + "[" + std::to_string(k) + "]";
        FMOE_ASSIGN_OR_RETURN(int32_t tid, Id(entry["ids"][k], kpath));
        bool known = (static_cast<size_t>(tid) < out->present.size() && out->present[tid]);
        for (const AddedTokenSpec& t : out->added_tokens) known = known || t.id == tid;
        if (!known) return Fail(kpath, "id " + std::to_string(tid) + " is not a token");
        (seen_sequence ? suffix : prefix).push_back(tid);
      }
    } else {
      return Fail(ipath, JsonQuote(kind) + " is not SpecialToken or Sequence");
    }
  }
  if (!seen_sequence) return Fail(path + ".single", "has no $A");
  // A later processor wraps what the earlier ones produced.
  prefix.insert(prefix.end(), out->post_prefix.begin(), out->post_prefix.end());
  out->post_prefix = std::move(prefix);
  out->post_suffix.insert(out->post_suffix.end(), suffix.begin(), suffix.end());
  return Status::Ok();
}

Status Parser::Decoder(const Json& v, const std::string& path, TokenizerJson* out) {
  FMOE_ASSIGN_OR_RETURN(std::string type, Type(v, path));
  if (type == "ByteLevel") {
    out->decoder_byte_level = true;
    return Status::Ok();
  }
  if (type == "Sequence") {
    auto list = v.find("decoders");
    if (list == v.end() || !list->is_array() || list->empty()) {
      return Fail(path + ".decoders", "missing, empty or not a list");
    }
    for (size_t i = 0; i < list->size(); ++i) {
      FMOE_RETURN_IF_ERROR(Decoder((*list)[i], path + ".decoders[" + std::to_string(i) + "]", out));
    }
    return Status::Ok();
  }
  return Unsupported(path + ".type",
                     "decoder type " + JsonQuote(type) + " is not supported (only ByteLevel)");
}

}  // namespace

Status ParseJsonText(std::string_view text, nlohmann::json* out) {
  try {
    *out = Json::parse(text);
  } catch (const Json::exception& e) {
    // nlohmann reports "[json.exception.parse_error.101] parse error at line 3, column 5: ...".
    std::string what = e.what();
    size_t at = what.find("] ");
    return InvalidArgument("not valid JSON: " +
                           (at == std::string::npos ? what : what.substr(at + 2)));
  }
  return Status::Ok();
}

Result<TokenizerJson> ParseTokenizerJson(std::string_view text, bool* unsupported) {
  if (unsupported != nullptr) *unsupported = false;
  Json root;
  FMOE_RETURN_IF_ERROR(ParseJsonText(text, &root));
  TokenizerJson out;
  Parser parser(unsupported);
  FMOE_RETURN_IF_ERROR(parser.Run(root, &out));
  return out;
}

}  // namespace fmoe
