// Reads a Hugging Face tokenizer.json (BPE model) into plain structs, validating every field:
// the JSON library stays in tokenizer_json.cc and BpeTokenizer works on these types only.
// Errors are kInvalidArgument and name the field: `model.merges[12]: "ab" + "c" is not in the
// vocab`; the caller prepends the file. Stateless; safe from any thread.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "common/status.h"
#include "common/text/unicode.h"

namespace fmoe {

// Ids are kept below this so that a hostile file cannot make us allocate gigabytes.
inline constexpr int32_t kMaxTokenId = (1 << 24) - 1;

struct AddedTokenSpec {
  int32_t id = 0;
  std::string content;
  bool special = false;
  bool lstrip = false;       // The match takes the whitespace on its left.
  bool rstrip = false;       // ... and on its right.
  bool single_word = false;  // Matches only when not inside a word.
  bool normalized = false;   // Matched against the normalized text (else the raw text).
};

enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

struct PreTokenizerStep {
  enum class Kind { kSplit, kByteLevel, kDigits };
  Kind kind = Kind::kSplit;
  // kSplit: `pattern` is a regex (`is_regex`) or a literal string.
  std::string pattern;
  bool is_regex = true;
  SplitBehavior behavior = SplitBehavior::kIsolated;
  bool invert = false;
  // kByteLevel.
  bool add_prefix_space = false;
  bool use_regex = true;
  // kDigits.
  bool individual_digits = false;
};

struct BpeMerge {
  int32_t left = 0;
  int32_t right = 0;
  int32_t result = 0;  // The id of left's string + right's string.
};

struct TokenizerJson {
  std::vector<AddedTokenSpec> added_tokens;
  std::vector<NormalizationForm> normalizers;   // Applied in order.
  std::vector<PreTokenizerStep> pre_tokenizer;  // Applied in order.
  // The BPE model. `vocab[id]` is the token ("" and !present for ids nothing uses).
  std::vector<std::string> vocab;
  std::vector<bool> present;
  std::vector<BpeMerge> merges;  // In rank order.
  std::optional<int32_t> unk_id;
  bool fuse_unk = false;
  bool ignore_merges = false;
  // The post-processor's ids around the sequence when special tokens are added.
  std::vector<int32_t> post_prefix;
  std::vector<int32_t> post_suffix;
  bool decoder_byte_level = false;
};

// Parses JSON text; kInvalidArgument "not valid JSON: <where and why>" (no exception escapes).
Status ParseJsonText(std::string_view text, nlohmann::json* out);

// `unsupported` (may be null) is set when the file is well-formed but uses a component this
// reader does not implement (a Metaspace pre-tokenizer, byte_fallback, a Unigram model, ...).
Result<TokenizerJson> ParseTokenizerJson(std::string_view text, bool* unsupported = nullptr);

}  // namespace fmoe
