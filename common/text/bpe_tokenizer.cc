#include "common/text/bpe_tokenizer.h"

#include <algorithm>
#include <array>
#include <unordered_map>
#include <utility>

#include "common/text/bpe_parts.h"
#include "common/text/regex.h"
#include "common/text/unicode.h"

namespace fmoe {
namespace {

// GPT-2's word split, used by the ByteLevel pre-tokenizer when use_regex is true.
constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

uint64_t PairKey(int32_t left, int32_t right) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
}

// A stretch of text, or an added token (id >= 0) found in it.
struct Segment {
  std::string_view text;
  int32_t id = -1;
};

size_t PrevCharStart(std::string_view s, size_t end) {
  size_t i = end - 1;
  while (i > 0 && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80) --i;
  return i;
}

bool EndsWithWordChar(std::string_view s) {
  if (s.empty()) return false;
  char32_t cp;
  DecodeUtf8(s, PrevCharStart(s, s.size()), &cp);
  return IsUnicodeWordChar(cp);
}

bool StartsWithWordChar(std::string_view s) {
  if (s.empty()) return false;
  char32_t cp;
  DecodeUtf8(s, 0, &cp);
  return IsUnicodeWordChar(cp);
}

// Where the run of whitespace that ends at `end` begins.
size_t WhitespaceRunStart(std::string_view s, size_t end) {
  while (end > 0) {
    size_t start = PrevCharStart(s, end);
    char32_t cp;
    DecodeUtf8(s, start, &cp);
    if (!IsUnicodeWhitespace(cp)) break;
    end = start;
  }
  return end;
}

// Where the run of whitespace that starts at `begin` ends.
size_t WhitespaceRunEnd(std::string_view s, size_t begin) {
  while (begin < s.size()) {
    char32_t cp;
    size_t len = DecodeUtf8(s, begin, &cp);
    if (!IsUnicodeWhitespace(cp)) break;
    begin += len;
  }
  return begin;
}

// Turns the matches in a piece of `size` bytes into spans covering all of it, each flagged as a
// match or not (Hugging Face's Pattern::find_matches).
void Cover(size_t size, const std::vector<std::pair<size_t, size_t>>& matches,
           std::vector<std::pair<size_t, size_t>>* spans, std::vector<bool>* is_match) {
  spans->clear();
  is_match->clear();
  size_t prev = 0;
  for (auto [begin, end] : matches) {
    if (begin > prev) {
      spans->emplace_back(prev, begin);
      is_match->push_back(false);
    }
    spans->emplace_back(begin, end);
    is_match->push_back(true);
    prev = end;
  }
  if (prev < size) {
    spans->emplace_back(prev, size);
    is_match->push_back(false);
  }
}

// Applies a split behavior to `spans` (covering the piece in order, each flagged as a match)
// and appends the non-empty results to `out`.
void ApplyBehavior(std::string_view piece, const std::vector<std::pair<size_t, size_t>>& spans,
                   const std::vector<bool>& is_match, SplitBehavior behavior,
                   std::vector<std::string_view>* out) {
  std::vector<std::pair<size_t, size_t>> result;
  std::vector<bool> keep;
  bool previous_match = false;
  switch (behavior) {
    case SplitBehavior::kIsolated:
      result = spans;
      keep.assign(spans.size(), true);
      break;
    case SplitBehavior::kRemoved:
      result = spans;
      for (bool m : is_match) keep.push_back(!m);
      break;
    case SplitBehavior::kContiguous:
      for (size_t i = 0; i < spans.size(); ++i) {
        if (is_match[i] == previous_match && !result.empty()) {
          result.back().second = spans[i].second;
        } else {
          result.push_back(spans[i]);
        }
        previous_match = is_match[i];
      }
      keep.assign(result.size(), true);
      break;
    case SplitBehavior::kMergedWithPrevious:
      for (size_t i = 0; i < spans.size(); ++i) {
        if (is_match[i] && !previous_match && !result.empty()) {
          result.back().second = spans[i].second;
        } else {
          result.push_back(spans[i]);
        }
        previous_match = is_match[i];
      }
      keep.assign(result.size(), true);
      break;
    case SplitBehavior::kMergedWithNext:
      for (size_t i = spans.size(); i-- > 0;) {
        if (is_match[i] && !previous_match && !result.empty()) {
          result.back().first = spans[i].first;
        } else {
          result.push_back(spans[i]);
        }
        previous_match = is_match[i];
      }
      std::reverse(result.begin(), result.end());
      keep.assign(result.size(), true);
      break;
  }
  for (size_t i = 0; i < result.size(); ++i) {
    if (keep[i] && result[i].second > result[i].first) {
      out->push_back(piece.substr(result[i].first, result[i].second - result[i].first));
    }
  }
}

// The Isolated split: every match and every stretch between matches is a piece, handed to
// `next` as the regex finds it.
template <class Next>
Status SplitIsolated(const Regex& regex, std::string_view piece, const Next& next) {
  Status inner;
  size_t prev = 0;
  FMOE_RETURN_IF_ERROR(regex.ForEachMatch(piece, [&](size_t begin, size_t end) {
    if (!inner.ok()) return;
    if (begin > prev) inner = next(piece.substr(prev, begin - prev));
    if (inner.ok() && end > begin) inner = next(piece.substr(begin, end - begin));
    prev = end;
  }));
  FMOE_RETURN_IF_ERROR(inner);
  return prev < piece.size() ? next(piece.substr(prev)) : Status::Ok();
}

}  // namespace

struct BpeTokenizer::State {
  struct Step {
    PreTokenizerStep spec;
    std::optional<Regex> regex;  // kSplit with a regex, kDigits, kByteLevel with use_regex.
    bool map_bytes = false;      // kByteLevel: map to the alphabet here (else the model does).
  };

  // Added tokens.
  std::vector<AddedTokenSpec> added;
  TokenTrie raw_trie;         // Tokens with normalized == false.
  TokenTrie normalized_trie;  // Tokens with normalized == true (their normalized content).

  std::vector<NormalizationForm> normalizers;
  std::vector<Step> steps;
  bool model_input_raw = false;  // The model receives raw bytes and maps them itself.

  // The model.
  std::vector<std::string> tokens;       // id -> token (vocab form, or added content).
  std::vector<std::string> token_bytes;  // id -> what Decode writes.
  std::vector<bool> special;
  StringMap token_ids;  // vocab and added contents.
  StringMap vocab_ids;  // The model's vocab only.
  std::array<int32_t, 256> byte_ids{};
  std::unordered_map<uint64_t, PairMerge> merges;
  std::optional<int32_t> unk_id;
  bool fuse_unk = false;
  bool ignore_merges = false;
  WordCache cache;

  std::vector<int32_t> prefix, suffix;
  std::optional<int32_t> bos, eos;
  std::string chat_template;

  void SplitAdded(std::string_view text, const TokenTrie& trie, std::vector<Segment>* out) const;
  Status EncodeStretch(std::string_view text, std::vector<int32_t>* ids) const;
  // Runs steps[index..] on `piece` and the model on each word it becomes.
  Status PreTokenize(size_t index, std::string_view piece, std::vector<int32_t>* ids) const;
  void EncodeWord(std::string_view word, std::vector<int32_t>* ids) const;
  void MergeWord(std::string_view word, std::vector<int32_t>* ids) const;
};

// Hugging Face's AddedVocabulary::find_matches: leftmost-longest matches; single_word tokens
// must not touch a word character; lstrip/rstrip swallow the whitespace beside the token.
void BpeTokenizer::State::SplitAdded(std::string_view text, const TokenTrie& trie,
                                     std::vector<Segment>* out) const {
  if (trie.empty()) {
    if (!text.empty()) out->push_back({text, -1});
    return;
  }
  size_t emitted = 0;
  size_t pos = 0;
  while (pos < text.size()) {
    auto [len, index] = trie.LongestAt(text, pos);
    if (len == 0) {
      ++pos;
      continue;
    }
    const AddedTokenSpec& token = added[index];
    size_t start = pos;
    size_t stop = pos + len;
    pos = stop;
    if (token.single_word && ((start > 0 && EndsWithWordChar(text.substr(0, start))) ||
                              (stop < text.size() && StartsWithWordChar(text.substr(stop))))) {
      continue;
    }
    if (token.lstrip) start = std::max(emitted, WhitespaceRunStart(text, start));
    if (token.rstrip) stop = WhitespaceRunEnd(text, stop);
    if (start > emitted) out->push_back({text.substr(emitted, start - emitted), -1});
    out->push_back({text.substr(start, stop - start), token.id});
    emitted = stop;
    pos = stop;
  }
  if (emitted < text.size()) out->push_back({text.substr(emitted), -1});
}

Status BpeTokenizer::State::EncodeStretch(std::string_view text, std::vector<int32_t>* ids) const {
  std::string normalized;
  if (!normalizers.empty()) {
    normalized = std::string(text);
    for (NormalizationForm form : normalizers) {
      FMOE_ASSIGN_OR_RETURN(normalized, Normalize(normalized, form));
    }
    text = normalized;
  }
  std::vector<Segment> segments;
  SplitAdded(text, normalized_trie, &segments);
  for (const Segment& seg : segments) {
    if (seg.id >= 0) {
      ids->push_back(seg.id);
    } else {
      FMOE_RETURN_IF_ERROR(PreTokenize(0, seg.text, ids));
    }
  }
  return Status::Ok();
}

// Depth first: each piece a step makes goes through the remaining steps and the model at once,
// so a long text never becomes a list of all its words.
Status BpeTokenizer::State::PreTokenize(size_t index, std::string_view piece,
                                        std::vector<int32_t>* ids) const {
  if (piece.empty()) return Status::Ok();
  if (index == steps.size()) {
    EncodeWord(piece, ids);
    return Status::Ok();
  }
  const Step& step = steps[index];
  if (step.spec.kind == PreTokenizerStep::Kind::kByteLevel) {
    std::string spaced;
    if (step.spec.add_prefix_space && piece.front() != ' ') {
      spaced.reserve(piece.size() + 1);
      spaced.push_back(' ');
      spaced.append(piece);
      piece = spaced;
    }
    auto next = [&](std::string_view sub) -> Status {
      if (!step.map_bytes) return PreTokenize(index + 1, sub, ids);
      std::string mapped;
      ByteLevelEncode(sub, &mapped);
      return PreTokenize(index + 1, mapped, ids);
    };
    if (!step.regex) return next(piece);
    return SplitIsolated(*step.regex, piece, next);
  }
  SplitBehavior behavior = step.spec.behavior;
  if (step.spec.kind == PreTokenizerStep::Kind::kDigits) {
    behavior = step.spec.individual_digits ? SplitBehavior::kIsolated : SplitBehavior::kContiguous;
  }
  if (behavior == SplitBehavior::kIsolated && step.regex) {  // Whatever `invert` says.
    return SplitIsolated(*step.regex, piece,
                         [&](std::string_view sub) { return PreTokenize(index + 1, sub, ids); });
  }
  // The other behaviors look at neighbours: find the matches, flag them, apply the behavior.
  std::vector<std::pair<size_t, size_t>> matches;
  if (step.regex) {
    FMOE_RETURN_IF_ERROR(step.regex->FindAll(piece, &matches));
  } else if (!step.spec.pattern.empty()) {
    for (size_t at = piece.find(step.spec.pattern); at != std::string_view::npos;
         at = piece.find(step.spec.pattern, at + step.spec.pattern.size())) {
      matches.emplace_back(at, at + step.spec.pattern.size());
    }
  }
  std::vector<std::pair<size_t, size_t>> spans;
  std::vector<bool> is_match;
  Cover(piece.size(), matches, &spans, &is_match);
  matches = {};
  if (step.spec.invert) is_match.flip();
  std::vector<std::string_view> pieces;
  ApplyBehavior(piece, spans, is_match, behavior, &pieces);
  for (std::string_view sub : pieces) FMOE_RETURN_IF_ERROR(PreTokenize(index + 1, sub, ids));
  return Status::Ok();
}

void BpeTokenizer::State::EncodeWord(std::string_view word, std::vector<int32_t>* ids) const {
  if (word.empty()) return;
  bool cacheable = word.size() <= WordCache::kMaxWordBytes;
  if (cacheable && cache.Get(word, ids)) return;
  size_t first = ids->size();
  MergeWord(word, ids);
  if (cacheable)
    cache.Put(word, std::span<const int32_t>(ids->data() + first, ids->size() - first));
}

void BpeTokenizer::State::MergeWord(std::string_view word, std::vector<int32_t>* ids) const {
  if (ignore_merges) {
    std::string mapped;
    std::string_view key = word;
    if (model_input_raw) {
      ByteLevelEncode(word, &mapped);
      key = mapped;
    }
    if (auto it = vocab_ids.find(key); it != vocab_ids.end()) {
      ids->push_back(it->second);
      return;
    }
  }

  size_t first = ids->size();
  bool last_unknown = false;
  auto push = [&](int32_t id) {
    if (id < 0) {
      if (!unk_id) return;  // No unk token: the character is dropped, as Hugging Face does.
      if (fuse_unk && last_unknown) return;
      id = *unk_id;
      last_unknown = true;
    } else {
      last_unknown = false;
    }
    ids->push_back(id);
  };
  if (model_input_raw) {
    for (unsigned char c : word) push(byte_ids[c]);
  } else {
    for (size_t i = 0; i < word.size();) {
      char32_t cp;
      size_t len = DecodeUtf8(word, i, &cp);
      auto it = vocab_ids.find(word.substr(i, len));
      push(it == vocab_ids.end() ? -1 : it->second);
      i += len;
    }
  }
  MergeSymbols(ids, first, [&](int32_t left, int32_t right, PairMerge* merge) {
    auto it = merges.find(PairKey(left, right));
    if (it == merges.end()) return false;
    *merge = it->second;
    return true;
  });
}

BpeTokenizer::BpeTokenizer(std::unique_ptr<State> state) : state_(std::move(state)) {}
BpeTokenizer::~BpeTokenizer() = default;

Result<std::unique_ptr<BpeTokenizer>> BpeTokenizer::Create(TokenizerJson spec,
                                                           const TokenizerConfig& config) {
  auto s = std::make_unique<State>();
  size_t size = spec.vocab.size();
  for (const AddedTokenSpec& t : spec.added_tokens)
    size = std::max(size, static_cast<size_t>(t.id) + 1);
  s->tokens.assign(size, std::string());
  s->token_bytes.assign(size, std::string());
  s->special.assign(size, false);
  s->byte_ids.fill(-1);

  // Pre-tokenizer steps. The byte-level mapping of a ByteLevel step that ends the pipeline is
  // left to the model, which then caches words by their raw bytes.
  for (size_t i = 0; i < spec.pre_tokenizer.size(); ++i) {
    State::Step step;
    step.spec = spec.pre_tokenizer[i];
    std::string path = "pre_tokenizer step " + std::to_string(i);
    switch (step.spec.kind) {
      case PreTokenizerStep::Kind::kByteLevel:
        if (step.spec.use_regex) {
          FMOE_ASSIGN_OR_RETURN(Regex re, Regex::Compile(kGpt2Pattern));
          step.regex = std::move(re);
        }
        step.map_bytes = i + 1 < spec.pre_tokenizer.size();
        if (!step.map_bytes) s->model_input_raw = true;
        break;
      case PreTokenizerStep::Kind::kDigits: {
        FMOE_ASSIGN_OR_RETURN(Regex re, Regex::Compile(R"(\p{N})"));
        step.regex = std::move(re);
        break;
      }
      case PreTokenizerStep::Kind::kSplit:
        if (step.spec.is_regex) {
          auto re = Regex::Compile(step.spec.pattern);
          if (!re.ok()) return re.status().WithContext(path + " (Split) pattern");
          step.regex = std::move(*re);
        }
        break;
    }
    s->steps.push_back(std::move(step));
  }
  s->normalizers = spec.normalizers;

  // The model.
  for (size_t id = 0; id < spec.vocab.size(); ++id) {
    if (!spec.present[id]) continue;
    const std::string& token = spec.vocab[id];
    s->tokens[id] = token;
    s->vocab_ids.emplace(token, static_cast<int32_t>(id));
    s->token_ids.emplace(token, static_cast<int32_t>(id));
    if (spec.decoder_byte_level) {
      std::optional<std::string> bytes = ByteLevelDecode(token);
      s->token_bytes[id] = bytes ? std::move(*bytes) : token;
    } else {
      s->token_bytes[id] = token;
    }
  }
  for (int b = 0; b < 256; ++b) {
    auto it = s->vocab_ids.find(ByteLevelAlphabet()[b]);
    if (it != s->vocab_ids.end()) s->byte_ids[b] = it->second;
  }
  s->merges.reserve(spec.merges.size());
  for (size_t rank = 0; rank < spec.merges.size(); ++rank) {
    const BpeMerge& m = spec.merges[rank];
    // A pair listed twice keeps its later rank, as Hugging Face's map does.
    s->merges[PairKey(m.left, m.right)] = {static_cast<int32_t>(rank), m.result};
  }
  s->unk_id = spec.unk_id;
  s->fuse_unk = spec.fuse_unk;
  s->ignore_merges = spec.ignore_merges;

  // Added tokens: matched before the model, decoded as their content.
  s->added = std::move(spec.added_tokens);
  for (size_t i = 0; i < s->added.size(); ++i) {
    const AddedTokenSpec& t = s->added[i];
    s->tokens[t.id] = t.content;
    s->token_bytes[t.id] = t.content;
    s->special[t.id] = t.special;
    s->token_ids[t.content] = t.id;
    if (!t.normalized) {
      s->raw_trie.Add(t.content, static_cast<int32_t>(i));
      continue;
    }
    std::string content = t.content;
    for (NormalizationForm form : s->normalizers) {
      FMOE_ASSIGN_OR_RETURN(content, Normalize(content, form));
    }
    if (!content.empty()) s->normalized_trie.Add(content, static_cast<int32_t>(i));
  }

  // Post-processor, BOS/EOS and tokenizer_config.json.
  s->prefix = std::move(spec.post_prefix);
  s->suffix = std::move(spec.post_suffix);
  auto special_id = [&](const std::string& token, const char* field) -> Result<int32_t> {
    auto it = s->token_ids.find(token);
    if (it == s->token_ids.end()) {
      return InvalidArgument(std::string("tokenizer_config.json: ") + field + ": \"" + token +
                             "\" is not a token of tokenizer.json");
    }
    return it->second;
  };
  auto find_special = [&](std::initializer_list<const char*> names) -> std::optional<int32_t> {
    for (const char* name : names) {
      auto it = s->token_ids.find(std::string_view(name));
      if (it != s->token_ids.end() && s->special[it->second]) return it->second;
    }
    return std::nullopt;
  };
  if (config.bos_token) {
    FMOE_ASSIGN_OR_RETURN(int32_t id, special_id(*config.bos_token, "bos_token"));
    s->bos = id;
  } else if (s->prefix.size() == 1) {
    s->bos = s->prefix[0];
  } else {
    s->bos = find_special({"<s>", "<|begin_of_text|>", "<bos>", "<|startoftext|>"});
  }
  if (config.eos_token) {
    FMOE_ASSIGN_OR_RETURN(int32_t id, special_id(*config.eos_token, "eos_token"));
    s->eos = id;
  } else {
    s->eos = find_special({"</s>", "<|end_of_text|>", "<|endoftext|>", "<eos>"});
  }
  if (config.add_bos_token) {
    if (*config.add_bos_token && !s->bos) {
      return InvalidArgument(
          "tokenizer_config.json: add_bos_token: true but there is no BOS token");
    }
    s->prefix.clear();
    if (*config.add_bos_token) s->prefix.push_back(*s->bos);
  }
  if (config.add_eos_token) {
    if (*config.add_eos_token && !s->eos) {
      return InvalidArgument(
          "tokenizer_config.json: add_eos_token: true but there is no EOS token");
    }
    s->suffix.clear();
    if (*config.add_eos_token) s->suffix.push_back(*s->eos);
  }
  s->chat_template = config.chat_template;
  return std::unique_ptr<BpeTokenizer>(new BpeTokenizer(std::move(s)));
}

Result<std::vector<int32_t>> BpeTokenizer::Encode(std::string_view text,
                                                  bool add_special_tokens) const {
  size_t bad = FirstInvalidUtf8(text);
  if (bad != text.size()) {
    return InvalidArgument("tokenizer: text is not valid UTF-8 at byte " + std::to_string(bad));
  }
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  if (add_special_tokens) ids = state_->prefix;
  std::vector<Segment> segments;
  state_->SplitAdded(text, state_->raw_trie, &segments);
  for (const Segment& seg : segments) {
    if (seg.id >= 0) {
      ids.push_back(seg.id);
    } else {
      Status st = state_->EncodeStretch(seg.text, &ids);
      if (!st.ok()) return st.WithContext("tokenizer");
    }
  }
  if (add_special_tokens) ids.insert(ids.end(), state_->suffix.begin(), state_->suffix.end());
  return ids;
}

std::string BpeTokenizer::Decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  return DecodeTokenBytes(ids, state_->token_bytes, state_->special, skip_special_tokens);
}

size_t BpeTokenizer::vocab_size() const { return state_->tokens.size(); }

std::optional<int32_t> BpeTokenizer::TokenToId(std::string_view token) const {
  auto it = state_->token_ids.find(token);
  if (it == state_->token_ids.end()) return std::nullopt;
  return it->second;
}

std::string BpeTokenizer::IdToToken(int32_t id) const {
  if (id < 0 || static_cast<size_t>(id) >= state_->tokens.size()) return "";
  return state_->tokens[id];
}

bool BpeTokenizer::IsSpecial(int32_t id) const {
  return id >= 0 && static_cast<size_t>(id) < state_->special.size() && state_->special[id];
}

std::optional<int32_t> BpeTokenizer::bos_id() const { return state_->bos; }
std::optional<int32_t> BpeTokenizer::eos_id() const { return state_->eos; }
const std::string& BpeTokenizer::chat_template() const { return state_->chat_template; }

}  // namespace fmoe
