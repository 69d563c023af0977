#include "common/text/tiktoken_tokenizer.h"

#include <array>
#include <charconv>
#include <limits>
#include <map>
#include <unordered_map>
#include <utility>

#include "common/text/bpe_parts.h"
#include "common/text/regex.h"
#include "common/text/unicode.h"

namespace fmoe {
namespace {

// Kimi's pre-tokenizer pattern. Kimi writes the letter classes as intersections,
// [\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]], which PCRE2 10.42 does not read; here each is a
// class behind a negative lookahead for Han, which matches the same characters.
constexpr std::string_view kKimiPattern =
    R"([\p{Han}]+)"
    R"(|[^\r\n\p{L}\p{N}]?(?:(?!\p{Han})[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}])*)"
    R"((?:(?!\p{Han})[\p{Ll}\p{Lm}\p{Lo}\p{M}])+(?i:'s|'t|'re|'ve|'m|'ll|'d)?)"
    R"(|[^\r\n\p{L}\p{N}]?(?:(?!\p{Han})[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}])+)"
    R"((?:(?!\p{Han})[\p{Ll}\p{Lm}\p{Lo}\p{M}])*(?i:'s|'t|'re|'ve|'m|'ll|'d)?)"
    R"(|\p{N}{1,3})"
    R"(| ?[^\s\p{L}\p{N}]+[\r\n]*)"
    R"(|\s*[\r\n]+)"
    R"(|\s+(?!\S))"
    R"(|\s+)";

constexpr int32_t kReservedSpecialTokens = 256 + 2;  // Kimi's num_reserved_special_tokens + 2.
constexpr size_t kChunkChars = 400'000;              // Kimi's TIKTOKEN_MAX_ENCODE_CHARS.
constexpr size_t kMaxRunChars = 25'000;              // Kimi's MAX_NO_WHITESPACES_CHARS.
// Ids must fit int32_t with the special tokens after them.
constexpr int64_t kMaxRank = std::numeric_limits<int32_t>::max() - (1 << 20);

// Python's str.isspace(): general category Zs, or bidirectional class WS, B or S. Kimi cuts its
// runs of whitespace with it.
bool IsPythonSpace(char32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || (cp >= 0x1C && cp <= 0x20) || cp == 0x85 || cp == 0xA0 ||
         cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 ||
         cp == 0x202F || cp == 0x205F || cp == 0x3000;
}

// Up to 40 bytes of `s` in quotes, bytes outside printable ASCII as \xHH.
std::string QuoteLine(std::string_view s) {
  constexpr size_t kMax = 40;
  std::string out = "\"";
  for (size_t i = 0; i < s.size() && i < kMax; ++i) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    if (c >= 0x20 && c < 0x7F && c != '"' && c != '\\') {
      out += static_cast<char>(c);
    } else {
      static constexpr char kHex[] = "0123456789ABCDEF";
      out += "\\x";
      out += kHex[c >> 4];
      out += kHex[c & 15];
    }
  }
  out += s.size() > kMax ? "\"..." : "\"";
  return out;
}

int Base64Value(char c) {
  if (c >= 'A' && c <= 'Z') return c - 'A';
  if (c >= 'a' && c <= 'z') return c - 'a' + 26;
  if (c >= '0' && c <= '9') return c - '0' + 52;
  if (c == '+') return 62;
  if (c == '/') return 63;
  return -1;
}

// Standard base64 with its padding (what Python's base64.b64decode reads in a tiktoken file).
bool DecodeBase64(std::string_view in, std::string* out) {
  out->clear();
  if (in.size() % 4 != 0) return false;
  size_t pad = 0;
  while (pad < 2 && pad < in.size() && in[in.size() - 1 - pad] == '=') ++pad;
  uint32_t bits = 0;
  int nbits = 0;
  for (size_t i = 0; i < in.size() - pad; ++i) {
    int v = Base64Value(in[i]);
    if (v < 0) return false;
    bits = (bits << 6) | static_cast<uint32_t>(v);
    nbits += 6;
    if (nbits >= 8) {
      nbits -= 8;
      out->push_back(static_cast<char>((bits >> nbits) & 0xFF));
    }
  }
  return true;
}

struct Line {
  int32_t rank;
  size_t number;  // 1-based.
};

}  // namespace

struct TiktokenTokenizer::State {
  size_t ranks = 0;                       // N: ids 0..N-1 are ranks.
  std::vector<std::string> token_bytes;   // id -> bytes (special tokens: their text).
  std::vector<bool> special;              // id -> skipped by Decode(skip_special_tokens).
  StringMap rank_of;                      // bytes -> rank.
  std::array<int32_t, 256> byte_ranks{};  // The rank of each single byte.
  StringMap special_ids;                  // text -> id.
  std::vector<int32_t> special_by_index;
  TokenTrie special_trie;  // Index into special_by_index.
  std::optional<Regex> regex;
  WordCache cache;
  std::optional<int32_t> bos, eos;
  std::vector<int32_t> prefix, suffix;
  std::string chat_template;

  Status EncodeText(std::string_view text, bool specials, std::vector<int32_t>* ids) const;
  Status EncodePiece(std::string_view piece, bool specials, std::vector<int32_t>* ids) const;
  void EncodeWord(std::string_view word, std::vector<int32_t>* ids) const;
  // A token's id: special tokens by their text, the others in the byte-level alphabet.
  std::optional<int32_t> Lookup(std::string_view token) const;
};

// Kimi's cuts: chunks of kChunkChars characters, each cut again before the character that makes
// a run of whitespace or of non-whitespace longer than kMaxRunChars (its
// _split_whitespaces_or_nonwhitespaces); each piece is encoded by itself.
Status TiktokenTokenizer::State::EncodeText(std::string_view text, bool specials,
                                            std::vector<int32_t>* ids) const {
  if (text.size() <= kMaxRunChars) return EncodePiece(text, specials, ids);  // Nothing to cut.
  size_t chunk = 0;
  while (chunk < text.size()) {
    size_t slice = chunk;
    size_t run = 0;
    char32_t cp;
    DecodeUtf8(text, chunk, &cp);
    bool run_space = IsPythonSpace(cp);
    size_t i = chunk;
    for (size_t chars = 0; chars < kChunkChars && i < text.size(); ++chars) {
      size_t len = DecodeUtf8(text, i, &cp);
      bool space = IsPythonSpace(cp);
      if (space != run_space) {
        run = 1;
        run_space = space;
      } else if (++run > kMaxRunChars) {
        FMOE_RETURN_IF_ERROR(EncodePiece(text.substr(slice, i - slice), specials, ids));
        slice = i;
        run = 1;
      }
      i += len;
    }
    FMOE_RETURN_IF_ERROR(EncodePiece(text.substr(slice, i - slice), specials, ids));
    chunk = i;
  }
  return Status::Ok();
}

// tiktoken's encode (allowed_special="all") or encode_ordinary on one piece: the special tokens in
// it, and the pattern's matches between them (text no match covers is dropped, as tiktoken does).
Status TiktokenTokenizer::State::EncodePiece(std::string_view piece, bool specials,
                                             std::vector<int32_t>* ids) const {
  auto ordinary = [&](std::string_view text) -> Status {
    if (text.empty()) return Status::Ok();
    return regex->ForEachMatch(
        text, [&](size_t begin, size_t end) { EncodeWord(text.substr(begin, end - begin), ids); });
  };
  size_t emitted = 0;
  if (specials && !special_trie.empty()) {
    for (size_t pos = 0; pos < piece.size();) {
      auto [len, index] = special_trie.LongestAt(piece, pos);
      if (len == 0) {
        ++pos;
        continue;
      }
      FMOE_RETURN_IF_ERROR(ordinary(piece.substr(emitted, pos - emitted)));
      ids->push_back(special_by_index[index]);
      pos += len;
      emitted = pos;
    }
  }
  return ordinary(piece.substr(emitted));
}

void TiktokenTokenizer::State::EncodeWord(std::string_view word, std::vector<int32_t>* ids) const {
  if (auto it = rank_of.find(word); it != rank_of.end()) {
    ids->push_back(it->second);
    return;
  }
  bool cacheable = word.size() <= WordCache::kMaxWordBytes;
  if (cacheable && cache.Get(word, ids)) return;
  size_t first = ids->size();
  for (unsigned char c : word) ids->push_back(byte_ranks[c]);
  thread_local std::string joined;
  MergeSymbols(ids, first, [&](int32_t left, int32_t right, PairMerge* merge) {
    joined.assign(token_bytes[left]);
    joined.append(token_bytes[right]);
    auto it = rank_of.find(joined);
    if (it == rank_of.end()) return false;
    *merge = {it->second, it->second};
    return true;
  });
  if (cacheable) {
    cache.Put(word, std::span<const int32_t>(ids->data() + first, ids->size() - first));
  }
}

TiktokenTokenizer::TiktokenTokenizer(std::unique_ptr<State> state) : state_(std::move(state)) {}
TiktokenTokenizer::~TiktokenTokenizer() = default;

Result<std::unique_ptr<TiktokenTokenizer>> TiktokenTokenizer::Create(
    std::string_view text, const std::string& path, const TokenizerConfig& config) {
  auto s = std::make_unique<State>();
  auto error = [&](size_t line, const std::string& what) {
    return InvalidArgument(path + ": line " + std::to_string(line) + ": " + what);
  };

  // The lines: "<base64 token> <rank>".
  std::vector<Line> lines;
  StringMap token_line;  // bytes -> index into `lines` (its rank once all are read).
  std::string bytes;
  size_t number = 0;
  for (size_t start = 0; start < text.size();) {
    size_t end = text.find('\n', start);
    if (end == std::string_view::npos) end = text.size();
    std::string_view line = text.substr(start, end - start);
    start = end + 1;
    ++number;
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    if (line.empty()) continue;
    size_t space = line.find(' ');
    if (space == std::string_view::npos) {
      return error(number,
                   "expected \"<base64 token> <rank>\", found no space in " + QuoteLine(line));
    }
    std::string_view token = line.substr(0, space);
    std::string_view rank_text = line.substr(space + 1);
    if (token.empty()) return error(number, "the token before the space is empty");
    if (!DecodeBase64(token, &bytes)) {
      return error(number, "token " + QuoteLine(token) + " is not base64");
    }
    if (bytes.empty()) return error(number, "token " + QuoteLine(token) + " is empty");
    int64_t rank = -1;
    const char* rank_end = rank_text.data() + rank_text.size();
    auto [ptr, ec] = std::from_chars(rank_text.data(), rank_end, rank);
    bool digits = !rank_text.empty() && rank_text[0] >= '0' && rank_text[0] <= '9';
    if (!digits || ptr != rank_end || (ec != std::errc() && ec != std::errc::result_out_of_range)) {
      return error(number, "rank " + QuoteLine(rank_text) + " is not a non-negative integer");
    }
    if (ec == std::errc::result_out_of_range || rank > kMaxRank) {
      return error(number, "rank " + QuoteLine(rank_text) + " is too large");
    }
    auto [it, inserted] = token_line.emplace(bytes, static_cast<int32_t>(lines.size()));
    if (!inserted) {
      return error(number, "token " + QuoteLine(token) + " is already on line " +
                               std::to_string(lines[it->second].number));
    }
    lines.push_back({static_cast<int32_t>(rank), number});
  }

  // The ranks are the ids 0..N-1: no rank twice, none left out. (tiktoken itself refuses a rank
  // given twice; Kimi numbers its special tokens from N, so a gap would make them collide.)
  const size_t n = lines.size();
  std::vector<size_t> line_of_rank(n, 0);
  for (const Line& l : lines) {
    if (static_cast<size_t>(l.rank) >= n) {
      return error(l.number, "rank " + std::to_string(l.rank) + " leaves a gap: the " +
                                 std::to_string(n) + " tokens must have the ranks 0.." +
                                 std::to_string(static_cast<int64_t>(n) - 1));
    }
    if (line_of_rank[l.rank] != 0) {
      return error(l.number, "rank " + std::to_string(l.rank) + " is already on line " +
                                 std::to_string(line_of_rank[l.rank]));
    }
    line_of_rank[l.rank] = l.number;
  }
  s->ranks = n;
  s->token_bytes.resize(n);
  for (auto& [token, value] : token_line) {
    value = lines[value].rank;
    s->token_bytes[value] = token;
  }
  s->rank_of = std::move(token_line);
  for (int b = 0; b < 256; ++b) {
    char c = static_cast<char>(b);
    auto it = s->rank_of.find(std::string_view(&c, 1));
    if (it == s->rank_of.end()) {
      return InvalidArgument(path + ": the byte " + QuoteLine(std::string_view(&c, 1)) +
                             " is not a token (every single byte must be one)");
    }
    s->byte_ranks[b] = it->second;
  }

  // Special tokens: N..N+257 as Kimi numbers them, named by added_tokens_decoder.
  const std::string config_path =
      path.substr(0, path.find_last_of('/') + 1) + "tokenizer_config.json";
  auto config_error = [&](int64_t id, const std::string& what) {
    return InvalidArgument(config_path + ": added_tokens_decoder[\"" + std::to_string(id) +
                           "\"]: " + what);
  };
  std::map<int64_t, const TokenizerConfig::AddedToken*> named;
  for (const TokenizerConfig::AddedToken& t : config.added_tokens) {
    if (t.id < static_cast<int64_t>(n)) {
      return config_error(t.id, "id " + std::to_string(t.id) + " is the rank of line " +
                                    std::to_string(line_of_rank[t.id]) + " of " + path);
    }
    if (t.id >= static_cast<int64_t>(n) + kReservedSpecialTokens) {
      return config_error(t.id, "id " + std::to_string(t.id) + " is past the special tokens " +
                                    std::to_string(n) + ".." +
                                    std::to_string(n + kReservedSpecialTokens - 1));
    }
    if (t.content.empty()) return config_error(t.id, "the content is empty");
    if (!IsValidUtf8(t.content)) return config_error(t.id, "the content is not UTF-8");
    if (!named.emplace(t.id, &t).second) return config_error(t.id, "the id is given twice");
  }
  const int64_t end = static_cast<int64_t>(n) + kReservedSpecialTokens;
  s->token_bytes.resize(end);
  s->special.assign(end, false);
  auto add_special = [&](int64_t id, std::string content, bool special) -> Status {
    auto [it, inserted] = s->special_ids.emplace(content, static_cast<int32_t>(id));
    if (!inserted) {
      return config_error(id,
                          QuoteLine(content) + " is also the token " + std::to_string(it->second));
    }
    s->special_trie.Add(content, static_cast<int32_t>(s->special_by_index.size()));
    s->special_by_index.push_back(static_cast<int32_t>(id));
    s->token_bytes[id] = std::move(content);
    s->special[id] = special;
    return Status::Ok();
  };
  for (int64_t id = static_cast<int64_t>(n); id < end; ++id) {
    auto it = named.find(id);
    if (it != named.end()) {
      FMOE_RETURN_IF_ERROR(add_special(id, it->second->content, it->second->special));
    } else {
      FMOE_RETURN_IF_ERROR(add_special(id, "<|reserved_token_" + std::to_string(id) + "|>", true));
    }
  }

  FMOE_ASSIGN_OR_RETURN(Regex regex, Regex::Compile(kKimiPattern));
  s->regex = std::move(regex);

  // BOS and EOS: tokenizer_config.json's, else Kimi's defaults [BOS] and [EOS].
  const State& state = *s;
  auto find = [&](const std::optional<std::string>& name, const char* fallback,
                  const char* field) -> Result<std::optional<int32_t>> {
    if (!name) {
      auto it = state.special_ids.find(std::string_view(fallback));
      if (it == state.special_ids.end()) return std::optional<int32_t>();
      return std::optional<int32_t>(it->second);
    }
    std::optional<int32_t> id = state.Lookup(*name);
    if (!id) {
      return InvalidArgument(config_path + ": " + field + ": " + QuoteLine(*name) +
                             " is not a token of " + path);
    }
    return id;
  };
  FMOE_ASSIGN_OR_RETURN(s->bos, find(config.bos_token, "[BOS]", "bos_token"));
  FMOE_ASSIGN_OR_RETURN(s->eos, find(config.eos_token, "[EOS]", "eos_token"));
  if (config.add_bos_token.value_or(false)) {
    if (!s->bos) return InvalidArgument(config_path + ": add_bos_token: there is no BOS token");
    s->prefix.push_back(*s->bos);
  }
  if (config.add_eos_token.value_or(false)) {
    if (!s->eos) return InvalidArgument(config_path + ": add_eos_token: there is no EOS token");
    s->suffix.push_back(*s->eos);
  }
  s->chat_template = config.chat_template;
  return std::unique_ptr<TiktokenTokenizer>(new TiktokenTokenizer(std::move(s)));
}

std::optional<int32_t> TiktokenTokenizer::State::Lookup(std::string_view token) const {
  if (auto it = special_ids.find(token); it != special_ids.end()) return it->second;
  std::optional<std::string> bytes = ByteLevelDecode(token);
  if (!bytes) return std::nullopt;
  if (auto it = rank_of.find(*bytes); it != rank_of.end()) return it->second;
  return std::nullopt;
}

Result<std::vector<int32_t>> TiktokenTokenizer::Encode(std::string_view text,
                                                       bool add_special_tokens) const {
  size_t bad = FirstInvalidUtf8(text);
  if (bad != text.size()) {
    return InvalidArgument("tokenizer: text is not valid UTF-8 at byte " + std::to_string(bad));
  }
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  if (add_special_tokens) ids = state_->prefix;
  Status st = state_->EncodeText(text, /*specials=*/true, &ids);
  if (!st.ok()) return st.WithContext("tokenizer");
  if (add_special_tokens) ids.insert(ids.end(), state_->suffix.begin(), state_->suffix.end());
  return ids;
}

Result<std::vector<int32_t>> TiktokenTokenizer::EncodeOrdinary(std::string_view text) const {
  size_t bad = FirstInvalidUtf8(text);
  if (bad != text.size()) {
    return InvalidArgument("tokenizer: text is not valid UTF-8 at byte " + std::to_string(bad));
  }
  std::vector<int32_t> ids;
  ids.reserve(text.size() / 3 + 4);
  Status st = state_->EncodeText(text, /*specials=*/false, &ids);
  if (!st.ok()) return st.WithContext("tokenizer");
  return ids;
}

std::string TiktokenTokenizer::Decode(std::span<const int32_t> ids,
                                      bool skip_special_tokens) const {
  return DecodeTokenBytes(ids, state_->token_bytes, state_->special, skip_special_tokens);
}

size_t TiktokenTokenizer::vocab_size() const { return state_->token_bytes.size(); }

std::optional<int32_t> TiktokenTokenizer::TokenToId(std::string_view token) const {
  return state_->Lookup(token);
}

std::string TiktokenTokenizer::IdToToken(int32_t id) const {
  if (id < 0 || static_cast<size_t>(id) >= state_->token_bytes.size()) return "";
  if (static_cast<size_t>(id) >= state_->ranks) return state_->token_bytes[id];
  std::string token;
  ByteLevelEncode(state_->token_bytes[id], &token);
  return token;
}

bool TiktokenTokenizer::IsSpecial(int32_t id) const {
  return id >= 0 && static_cast<size_t>(id) < state_->special.size() && state_->special[id];
}

std::optional<int32_t> TiktokenTokenizer::bos_id() const { return state_->bos; }
std::optional<int32_t> TiktokenTokenizer::eos_id() const { return state_->eos; }
const std::string& TiktokenTokenizer::chat_template() const { return state_->chat_template; }

}  // namespace fmoe
