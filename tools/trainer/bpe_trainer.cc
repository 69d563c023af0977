#include "tools/trainer/bpe_trainer.h"

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <optional>
#include <unordered_map>
#include <unordered_set>

#include "common/json.h"
#include "common/text/regex.h"
#include "common/text/unicode.h"

namespace fmoe {
namespace {

// The ByteLevel pre-tokenizer's split (use_regex = true), so that training sees the words that
// BpeTokenizer and Hugging Face will see.
constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};

uint64_t PairKey(int32_t left, int32_t right) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32) | static_cast<uint32_t>(right);
}
int32_t PairLeft(uint64_t key) { return static_cast<int32_t>(key >> 32); }
int32_t PairRight(uint64_t key) { return static_cast<int32_t>(key & 0xFFFFFFFFu); }

// A heap entry: most frequent first; ties go to the smaller left id, then the smaller right id.
struct Candidate {
  int64_t count;
  uint64_t pair;
};
bool Lower(const Candidate& a, const Candidate& b) {
  if (a.count != b.count) return a.count < b.count;
  return a.pair > b.pair;  // The pair key orders by (left, right).
}

struct Word {
  std::vector<int32_t> symbols;
  int64_t count;
};

}  // namespace

struct BpeTrainer::Impl {
  BpeTrainerOptions options;
  Status options_status;
  std::optional<Regex> regex;
  std::unordered_map<std::string, int64_t, StringHash, std::equal_to<>> word_counts;
  bool trained = false;
  std::vector<std::string> vocab;  // id -> token in the byte-level alphabet.
  std::vector<std::pair<int32_t, int32_t>> merges;

  Status Validate();
  void CountWords(std::string_view text);
};

Status BpeTrainer::Impl::Validate() {
  const size_t n = options.special_tokens.size();
  if (options.vocab_size < n + 256) {
    return InvalidArgument("bpe trainer: vocab_size " + std::to_string(options.vocab_size) +
                           " is below the " + std::to_string(n) + " specials + 256 bytes");
  }
  std::unordered_set<std::string> seen;
  std::unordered_set<std::string> bytes(ByteLevelAlphabet().begin(), ByteLevelAlphabet().end());
  for (size_t i = 0; i < n; ++i) {
    const std::string& t = options.special_tokens[i];
    std::string where = "bpe trainer: special_tokens[" + std::to_string(i) + "]";
    if (t.empty() || !IsValidUtf8(t)) return InvalidArgument(where + ": empty or not UTF-8");
    if (!seen.insert(t).second) return InvalidArgument(where + ": \"" + t + "\" is listed twice");
    if (bytes.count(t) != 0) {
      return InvalidArgument(where + ": \"" + t + "\" is one of the 256 byte symbols");
    }
  }
  for (const std::string* t : {&options.bos_token, &options.eos_token}) {
    if (!t->empty() && seen.count(*t) == 0) {
      return InvalidArgument("bpe trainer: \"" + *t + "\" (bos/eos) is not a special token");
    }
  }
  auto re = Regex::Compile(kGpt2Pattern);
  if (!re.ok()) return re.status();
  regex = std::move(*re);
  return Status::Ok();
}

// Counts the words of a stretch of text that holds no special token.
void BpeTrainer::Impl::CountWords(std::string_view text) {
  auto count = [&](std::string_view word) {
    auto it = word_counts.find(word);
    if (it == word_counts.end()) {
      word_counts.emplace(std::string(word), 1);
    } else {
      ++it->second;
    }
  };
  size_t prev = 0;
  Status st = regex->ForEachMatch(text, [&](size_t begin, size_t end) {
    if (begin > prev) count(text.substr(prev, begin - prev));  // Text no alternative matched.
    if (end > begin) count(text.substr(begin, end - begin));
    prev = end;
  });
  (void)st;  // The GPT-2 pattern cannot hit PCRE2's limits: each alternative is linear.
  if (prev < text.size()) count(text.substr(prev));
}

BpeTrainer::BpeTrainer(BpeTrainerOptions options) : impl_(std::make_shared<Impl>()) {
  impl_->options = std::move(options);
  impl_->options_status = impl_->Validate();
}

Status BpeTrainer::Add(std::string_view text) {
  Impl& m = *impl_;
  FMOE_RETURN_IF_ERROR(m.options_status);
  if (m.trained) return FailedPrecondition("bpe trainer: Add after Train");
  size_t bad = FirstInvalidUtf8(text);
  if (bad != text.size()) {
    return InvalidArgument("bpe trainer: text is not valid UTF-8 at byte " + std::to_string(bad));
  }
  // Special tokens in the text are never part of a word (the tokenizer splits them out first).
  size_t start = 0;
  while (start < text.size()) {
    size_t best = std::string_view::npos;
    size_t best_len = 0;
    for (const std::string& s : m.options.special_tokens) {
      size_t at = text.find(s, start);
      if (at < best || (at == best && s.size() > best_len)) {
        best = at;
        best_len = s.size();
      }
    }
    if (best == std::string_view::npos) {
      m.CountWords(text.substr(start));
      break;
    }
    m.CountWords(text.substr(start, best - start));
    start = best + best_len;
  }
  return Status::Ok();
}

Status BpeTrainer::Train(const std::function<void(size_t, size_t)>& progress) {
  Impl& m = *impl_;
  FMOE_RETURN_IF_ERROR(m.options_status);
  if (m.trained) return FailedPrecondition("bpe trainer: Train called twice");
  m.trained = true;

  const int32_t first_byte = static_cast<int32_t>(m.options.special_tokens.size());
  m.vocab = m.options.special_tokens;
  for (const std::string& b : ByteLevelAlphabet()) m.vocab.push_back(b);
  std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>> ids;
  for (size_t i = 0; i < m.vocab.size(); ++i) ids.emplace(m.vocab[i], static_cast<int32_t>(i));

  // Words as symbol ids, and the pair counts with the words each pair occurs in.
  std::vector<Word> words;
  words.reserve(m.word_counts.size());
  for (const auto& [text, count] : m.word_counts) {
    Word w{{}, count};
    w.symbols.reserve(text.size());
    for (unsigned char c : text) w.symbols.push_back(first_byte + c);
    words.push_back(std::move(w));
  }
  m.word_counts = {};
  std::unordered_map<uint64_t, int64_t> pair_count;
  std::unordered_map<uint64_t, std::vector<uint32_t>> pair_words;
  for (uint32_t w = 0; w < words.size(); ++w) {
    const std::vector<int32_t>& s = words[w].symbols;
    for (size_t i = 0; i + 1 < s.size(); ++i) {
      uint64_t key = PairKey(s[i], s[i + 1]);
      pair_count[key] += words[w].count;
      pair_words[key].push_back(w);
    }
  }
  std::vector<Candidate> heap;
  heap.reserve(pair_count.size());
  for (const auto& [key, count] : pair_count) heap.push_back({count, key});
  std::make_heap(heap.begin(), heap.end(), Lower);

  const size_t target = m.options.vocab_size;
  const size_t wanted = target - m.vocab.size();
  const int64_t min_frequency = std::max<int64_t>(1, m.options.min_frequency);
  std::unordered_map<uint64_t, int64_t> delta;
  std::vector<uint32_t> affected;
  while (m.vocab.size() < target && !heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), Lower);
    Candidate top = heap.back();
    heap.pop_back();
    auto current = pair_count.find(top.pair);
    int64_t count = current == pair_count.end() ? 0 : current->second;
    if (count != top.count) {  // Stale: the count fell since this entry was pushed.
      if (count > 0) {
        heap.push_back({count, top.pair});
        std::push_heap(heap.begin(), heap.end(), Lower);
      }
      continue;
    }
    if (count < min_frequency) break;

    const int32_t a = PairLeft(top.pair);
    const int32_t b = PairRight(top.pair);
    std::string merged = m.vocab[a] + m.vocab[b];
    int32_t id;
    if (auto it = ids.find(merged); it != ids.end()) {
      id = it->second;  // Reached before by another pair of pieces.
    } else {
      id = static_cast<int32_t>(m.vocab.size());
      m.vocab.push_back(merged);
      ids.emplace(std::move(merged), id);
    }
    m.merges.emplace_back(a, b);

    affected = std::move(pair_words[top.pair]);
    pair_words.erase(top.pair);
    std::sort(affected.begin(), affected.end());
    affected.erase(std::unique(affected.begin(), affected.end()), affected.end());
    delta.clear();
    for (uint32_t w : affected) {
      std::vector<int32_t>& s = words[w].symbols;
      const int64_t c = words[w].count;
      size_t out = 0;
      for (size_t i = 0; i < s.size();) {
        if (i + 1 < s.size() && s[i] == a && s[i + 1] == b) {
          // The pairs around the merged one change: (x a) -> (x id), (b y) -> (id y).
          if (out > 0) {
            delta[PairKey(s[out - 1], a)] -= c;
            uint64_t key = PairKey(s[out - 1], id);
            delta[key] += c;
            pair_words[key].push_back(w);
          }
          if (i + 2 < s.size()) {
            delta[PairKey(b, s[i + 2])] -= c;
            uint64_t key = PairKey(id, s[i + 2]);
            delta[key] += c;
            pair_words[key].push_back(w);
          }
          delta[top.pair] -= c;
          s[out++] = id;
          i += 2;
        } else {
          s[out++] = s[i++];
        }
      }
      s.resize(out);
    }
    for (const auto& [key, d] : delta) {
      if (d == 0) continue;
      int64_t& n = pair_count[key];
      n += d;
      if (n <= 0) {
        pair_count.erase(key);
        pair_words.erase(key);
      } else if (d > 0) {
        heap.push_back({n, key});
        std::push_heap(heap.begin(), heap.end(), Lower);
      }
    }
    if (progress && (m.merges.size() % 64 == 0)) progress(m.merges.size(), wanted);
  }
  if (progress) progress(m.merges.size(), wanted);
  return Status::Ok();
}

Status BpeTrainer::Save(const std::string& path) const {
  const Impl& m = *impl_;
  FMOE_RETURN_IF_ERROR(m.options_status);
  if (!m.trained) return FailedPrecondition("bpe trainer: Save before Train");
  using Json = nlohmann::ordered_json;

  Json added = Json::array();
  for (size_t i = 0; i < m.options.special_tokens.size(); ++i) {
    added.push_back({{"id", i},
                     {"content", m.options.special_tokens[i]},
                     {"single_word", false},
                     {"lstrip", false},
                     {"rstrip", false},
                     {"normalized", false},
                     {"special", true}});
  }
  Json byte_level = {{"type", "ByteLevel"},
                     {"add_prefix_space", false},
                     {"trim_offsets", true},
                     {"use_regex", true}};
  Json post = byte_level;
  if (!m.options.bos_token.empty()) {
    const std::string& bos = m.options.bos_token;
    auto bos_id = static_cast<int32_t>(
        std::find(m.options.special_tokens.begin(), m.options.special_tokens.end(), bos) -
        m.options.special_tokens.begin());
    Json special = {{"SpecialToken", {{"id", bos}, {"type_id", 0}}}};
    post = {{"type", "TemplateProcessing"},
            {"single", {special, {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
            {"pair",
             {special,
              {{"Sequence", {{"id", "A"}, {"type_id", 0}}}},
              {{"SpecialToken", {{"id", bos}, {"type_id", 1}}}},
              {{"Sequence", {{"id", "B"}, {"type_id", 1}}}}}},
            {"special_tokens", {{bos, {{"id", bos}, {"ids", {bos_id}}, {"tokens", {bos}}}}}}};
  }
  // Written field by field: a JSON object of the vocab would look every key up linearly.
  auto str = [](const std::string& v) { return Json(v).dump(); };
  std::string text = "{\n";
  auto field = [&](const char* key, const Json& value) {
    text.append(" ").append(str(key)).append(": ").append(value.dump()).append(",\n");
  };
  field("version", "1.0");
  field("truncation", nullptr);
  field("padding", nullptr);
  field("added_tokens", added);
  field("normalizer", nullptr);
  field("pre_tokenizer", byte_level);
  field("post_processor", post);
  field("decoder", byte_level);
  text += " \"model\": {\n";
  text +=
      "  \"type\": \"BPE\", \"dropout\": null, \"unk_token\": null, "
      "\"continuing_subword_prefix\": null, \"end_of_word_suffix\": null, "
      "\"fuse_unk\": false, \"byte_fallback\": false, \"ignore_merges\": false,\n";
  text += "  \"vocab\": {";
  for (size_t i = 0; i < m.vocab.size(); ++i) {
    text.append(i == 0 ? "\n   " : ",\n   ").append(str(m.vocab[i])).append(": ");
    text.append(std::to_string(i));
  }
  text += "\n  },\n  \"merges\": [";
  for (size_t i = 0; i < m.merges.size(); ++i) {
    const auto& [a, b] = m.merges[i];
    text.append(i == 0 ? "\n   " : ",\n   ").append(str(m.vocab[a] + " " + m.vocab[b]));
  }
  text += "\n  ]\n }\n}\n";

  std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::binary | std::ios::trunc);
    if (!out) return IoError("bpe trainer: " + tmp + ": cannot create");
    out << text;
    if (!out.flush()) return IoError("bpe trainer: " + tmp + ": write failed");
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) return IoError("bpe trainer: " + path + ": " + ec.message());
  return Status::Ok();
}

}  // namespace fmoe
