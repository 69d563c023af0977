#include "common/text/token_mask.h"

#include <algorithm>
#include <numeric>
#include <type_traits>
#include <utility>

#include "common/text/sentencepiece_tokenizer.h"
#include "common/text/tokenizer.h"

namespace fmoe {
namespace {

// "<0x41>" -> 0x41.
std::optional<uint8_t> BytePiece(std::string_view piece) {
  if (piece.size() != 6 || piece.substr(0, 3) != "<0x" || piece[5] != '>') return std::nullopt;
  auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  const int hi = hex(piece[3]), lo = hex(piece[4]);
  if (hi < 0 || lo < 0) return std::nullopt;
  return static_cast<uint8_t>(hi * 16 + lo);
}

}  // namespace

TokenVocab::TokenVocab(std::vector<std::string> bytes, std::vector<bool> special)
    : bytes_(std::move(bytes)), special_(std::move(special)) {
  special_.resize(bytes_.size(), false);
  std::vector<int32_t> order;
  for (size_t id = 0; id < bytes_.size(); ++id) {
    if (Text(static_cast<int32_t>(id))) order.push_back(static_cast<int32_t>(id));
  }
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
    return bytes_[static_cast<size_t>(a)] != bytes_[static_cast<size_t>(b)]
               ? bytes_[static_cast<size_t>(a)] < bytes_[static_cast<size_t>(b)]
               : a < b;
  });
  nodes_.emplace_back();
  Build(order, 0, order.size(), 0, 0);
  for (bool key : {false, true}) {
    std::vector<StringScan>& scans = key ? key_scans_ : scans_;
    std::vector<int32_t>& closing = key ? key_closing_ : closing_;
    scans.resize(bytes_.size());
    for (size_t id = 0; id < bytes_.size(); ++id) {
      if (!Text(static_cast<int32_t>(id))) continue;
      MatchFrame f{.phase = kStringBodyPhase};
      StringScan& scan = scans[id];
      scan.kind = StringScan::kInside;
      for (size_t i = 0; i < bytes_[id].size(); ++i) {
        const auto b = static_cast<uint8_t>(bytes_[id][i]);
        const StringStep step = key ? StepKey(f, b) : StepString(f, b, 0, UINT32_MAX);
        if (step == StringStep::kReject) {
          scan.kind = StringScan::kNot;
          break;
        }
        if (step == StringStep::kClose) {
          scan.kind = StringScan::kCloses;
          scan.close = static_cast<uint32_t>(i);
          closing.push_back(static_cast<int32_t>(id));
          break;
        }
      }
      scan.chars = f.count;
    }
  }
}

// Tokens order[lo, hi) share their first `depth` bytes, the path to `node`; sorted, so those
// that end here come first and the rest group by their next byte.
void TokenVocab::Build(std::vector<int32_t>& order, size_t lo, size_t hi, uint32_t depth,
                       uint32_t node) {
  max_depth_ = std::max(max_depth_, depth);
  auto len = [&](size_t i) { return bytes_[static_cast<size_t>(order[i])].size(); };
  auto at = [&](size_t i) {
    return static_cast<uint8_t>(bytes_[static_cast<size_t>(order[i])][depth]);
  };
  nodes_[node].ids_begin = static_cast<uint32_t>(ids_.size());
  while (lo < hi && len(lo) == depth) ids_.push_back(order[lo++]);
  nodes_[node].ids_end = static_cast<uint32_t>(ids_.size());
  std::vector<std::pair<size_t, size_t>> groups;
  for (size_t i = lo; i < hi;) {
    size_t j = i + 1;
    while (j < hi && at(j) == at(i)) ++j;
    groups.push_back({i, j});
    i = j;
  }
  const auto first = static_cast<uint32_t>(nodes_.size());
  nodes_[node].children_begin = first;
  nodes_[node].children_end = first + static_cast<uint32_t>(groups.size());
  for (const auto& [i, j] : groups) nodes_.push_back(Node{.byte = at(i)});
  for (size_t k = 0; k < groups.size(); ++k) {
    Build(order, groups[k].first, groups[k].second, depth + 1, first + static_cast<uint32_t>(k));
  }
}

std::shared_ptr<const TokenVocab> TokenVocab::FromTokenizer(const Tokenizer& tokenizer) {
  const size_t n = tokenizer.vocab_size();
  std::vector<std::string> bytes(n);
  std::vector<bool> special(n, false);
  const bool sentencepiece = dynamic_cast<const SentencePieceTokenizer*>(&tokenizer) != nullptr;
  for (size_t i = 0; i < n; ++i) {
    const auto id = static_cast<int32_t>(i);
    special[i] = tokenizer.IsSpecial(id);
    if (special[i]) continue;
    if (sentencepiece) {
      const std::string piece = tokenizer.IdToToken(id);
      if (auto b = BytePiece(piece)) {
        bytes[i] = std::string(1, static_cast<char>(*b));
        continue;
      }
      std::string text;
      for (size_t k = 0; k < piece.size(); ++k) {
        if (piece.compare(k, 3, "\xE2\x96\x81") == 0) {
          text += ' ';
          k += 2;
        } else {
          text += piece[k];
        }
      }
      bytes[i] = std::move(text);
    } else {
      const int32_t ids[] = {id};
      bytes[i] = tokenizer.Decode(ids, /*skip_special_tokens=*/false);
    }
  }
  return std::make_shared<const TokenVocab>(std::move(bytes), std::move(special));
}

TokenMasker::TokenMasker(std::shared_ptr<const JsonGrammar> grammar,
                         std::shared_ptr<const TokenVocab> vocab, std::vector<int32_t> end_ids,
                         size_t remember)
    : remember_(remember),
      vocab_(std::move(vocab)),
      end_ids_(std::move(end_ids)),
      matcher_(std::move(grammar)) {
  levels_.resize(vocab_->max_depth() + 1);
}

bool TokenMasker::IsEnd(int32_t token) const {
  return std::find(end_ids_.begin(), end_ids_.end(), token) != end_ids_.end();
}

size_t TokenMasker::Fill(size_t n, std::vector<uint8_t>* allowed) {
  ++fills_;
  if (remember_ == 0) {
    bool walked = false;
    return FillWalked(n, allowed, &walked);
  }
  if (!ended_) {
    RememberKey(matcher_.state(), &state_key_);
    for (Remembered& r : masks_) {
      if (r.allowed.size() != n || r.key != state_key_) continue;
      r.used = fills_;
      *allowed = r.allowed;
      ++remembered_;
      return r.count;
    }
  }
  bool walked = false;
  const size_t count = FillWalked(n, allowed, &walked);
  // Inside a string the scans answer at once, and the state counts the string's characters:
  // only the trie walks' masks are worth keeping.
  if (ended_ || !walked) return count;
  Remembered* slot = nullptr;
  if (masks_.size() < remember_) {
    slot = &masks_.emplace_back();
  } else {
    slot = &*std::min_element(
        masks_.begin(), masks_.end(),
        [](const Remembered& a, const Remembered& b) { return a.used < b.used; });
  }
  slot->key = state_key_;
  slot->allowed = *allowed;
  slot->count = count;
  slot->used = fills_;
  return count;
}

size_t TokenMasker::FillWalked(size_t n, std::vector<uint8_t>* allowed, bool* walked) {
  allowed->assign(n, 0);
  size_t count = 0;
  if (ended_ || matcher_.complete()) {
    for (int32_t id : end_ids_) {
      if (id >= 0 && static_cast<size_t>(id) < n && !(*allowed)[static_cast<size_t>(id)]) {
        (*allowed)[static_cast<size_t>(id)] = 1;
        ++count;
      }
    }
    if (ended_) return count;
  }
  if (FillInString(allowed, &count)) return count;  // No token terminal inside a string.
  *walked = true;
  cache_used_ = 0;
  cache_index_.clear();
  if (!WalkCached(0, CachedState(matcher_.state()), allowed, &count)) {
    levels_[0] = matcher_.state();  // Too many states: the plain walk adds what is missing.
    Walk(0, 0, allowed, &count);
  }
  FillTerminals(allowed, &count);
  return count;
}

void TokenMasker::StateKey(const MatchState& state, std::string* key) {
  static_assert(std::has_unique_object_representations_v<MatchFrame>,
                "a state's bytes are its identity");
  key->assign(reinterpret_cast<const char*>(state.frames.data()),
              state.frames.size() * sizeof(MatchFrame));
  // The frames' count too: frames and ends are read back to back.
  const uint64_t frames = state.frames.size();
  key->append(reinterpret_cast<const char*>(&frames), sizeof(frames));
  key->append(reinterpret_cast<const char*>(state.ends.data()),
              state.ends.size() * sizeof(uint32_t));
}

void TokenMasker::RememberKey(const MatchState& state, std::string* key) {
  const JsonGrammar& g = matcher_.grammar();
  // The most bytes one token adds: the longest in the trie, or a token terminal's.
  const uint64_t reach =
      std::max<uint64_t>(vocab_->max_depth(), g.tokens.empty() ? 0 : kTokenTerminalSize);
  // A bounded repetition of items that take a byte each at least, past its minimum, with more
  // iterations left than a token has bytes: no token reaches its bound, and it may end whatever
  // its count, so every such count has the same mask. Returns that count, or its own.
  const auto canonical_count = [&](const MatchFrame& f) {
    if (f.node < 0) return f.count;  // The root marker.
    const JsonGrammar::Node& n = g.nodes[static_cast<size_t>(f.node)];
    if (n.kind == JsonGrammar::Kind::kRepeat && n.max_items != UINT32_MAX &&
        !g.nodes[static_cast<size_t>(n.items)].nullable && f.count >= n.min_items &&
        uint64_t{f.count} + reach < n.max_items) {
      return std::max(n.min_items, 1u);
    }
    return f.count;
  };
  const bool changes =
      std::any_of(state.frames.begin(), state.frames.end(),
                  [&](const MatchFrame& f) { return canonical_count(f) != f.count; });
  if (!changes) return StateKey(state, key);
  canonical_ = state;
  for (MatchFrame& f : canonical_.frames) f.count = canonical_count(f);
  StateKey(canonical_, key);
}

int32_t TokenMasker::CachedState(const MatchState& state) {
  StateKey(state, &key_);
  auto it = cache_index_.find(key_);
  if (it != cache_index_.end()) return it->second;
  if (cache_used_ >= kMaxCachedStates) return -1;
  if (cache_used_ == cache_.size()) cache_.emplace_back();
  Cached& c = cache_[cache_used_];
  c.state = state;
  c.next.fill(-1);
  const auto id = static_cast<int32_t>(cache_used_++);
  cache_index_.emplace(key_, id);
  return id;
}

bool TokenMasker::WalkCached(uint32_t node, int32_t state, std::vector<uint8_t>* allowed,
                             size_t* count) {
  if (state < 0) return false;
  const auto& nodes = vocab_->nodes();
  const auto& ids = vocab_->ids();
  GrammarStepper& stepper = matcher_.stepper();
  const size_t n = allowed->size();
  for (uint32_t c = nodes[node].children_begin; c < nodes[node].children_end; ++c) {
    const uint8_t b = nodes[c].byte;
    int32_t next = cache_[static_cast<size_t>(state)].next[b];
    if (next == -1) {
      if (stepper.Step(cache_[static_cast<size_t>(state)].state, b, &stepped_)) {
        next = CachedState(stepped_);
        if (next < 0) return false;
      } else {
        next = -2;
      }
      cache_[static_cast<size_t>(state)].next[b] = next;
    }
    if (next == -2) continue;
    for (uint32_t k = nodes[c].ids_begin; k < nodes[c].ids_end; ++k) {
      const auto id = static_cast<size_t>(ids[k]);
      if (id < n && !(*allowed)[id]) {
        (*allowed)[id] = 1;
        ++*count;
      }
    }
    if (nodes[c].children_end > nodes[c].children_begin && !WalkCached(c, next, allowed, count)) {
      return false;
    }
  }
  return true;
}

void TokenMasker::Walk(uint32_t node, uint32_t depth, std::vector<uint8_t>* allowed,
                       size_t* count) {
  const auto& nodes = vocab_->nodes();
  const auto& ids = vocab_->ids();
  GrammarStepper& stepper = matcher_.stepper();
  const size_t n = allowed->size();
  for (uint32_t c = nodes[node].children_begin; c < nodes[node].children_end; ++c) {
    if (!stepper.Step(levels_[depth], nodes[c].byte, &levels_[depth + 1])) continue;
    for (uint32_t k = nodes[c].ids_begin; k < nodes[c].ids_end; ++k) {
      const auto id = static_cast<size_t>(ids[k]);
      if (id < n && !(*allowed)[id]) {
        (*allowed)[id] = 1;
        ++*count;
      }
    }
    if (nodes[c].children_end > nodes[c].children_begin) Walk(c, depth + 1, allowed, count);
  }
}

bool TokenMasker::FillInString(std::vector<uint8_t>* allowed, size_t* count) {
  const MatchState& state = matcher_.state();
  GrammarStepper& stepper = matcher_.stepper();
  const JsonGrammar& g = stepper.grammar();
  if (state.ends.size() != 1) return false;
  const MatchFrame& top = state.frames.back();
  if (InFreeKey(g, top)) {
    if (!stepper.Step(state, '"', &closed_)) closed_ = MatchState{};
    FillScanned(/*key=*/true, closed_, 0, 0, UINT64_MAX, allowed, count);
    return true;
  }
  if (top.node < 0 || g.nodes[static_cast<size_t>(top.node)].kind != JsonGrammar::Kind::kString ||
      !InStringBody(top)) {
    return false;
  }
  const JsonGrammar::Node& n = g.nodes[static_cast<size_t>(top.node)];
  // The state after the closing quote is the same for every token, the string's length aside.
  scratch_a_ = state;
  scratch_a_.frames.back().count = std::max<uint32_t>(top.count, n.min_len);
  if (!stepper.Step(scratch_a_, '"', &closed_)) closed_ = MatchState{};
  FillScanned(/*key=*/false, closed_, top.count, n.min_len, n.max_len, allowed, count);
  return true;
}

void TokenMasker::FillScanned(bool key, const MatchState& closed, uint64_t chars_before,
                              uint64_t min_chars, uint64_t max_chars, std::vector<uint8_t>* allowed,
                              size_t* count) {
  GrammarStepper& stepper = matcher_.stepper();
  const size_t limit = std::min(allowed->size(), vocab_->size());
  auto scan_of = [&](int32_t id) -> const TokenVocab::StringScan& {
    return key ? vocab_->key_scan(id) : vocab_->string_scan(id);
  };
  for (size_t id = 0; id < limit; ++id) {
    const TokenVocab::StringScan& scan = scan_of(static_cast<int32_t>(id));
    if (scan.kind == TokenVocab::StringScan::kInside && chars_before + scan.chars <= max_chars) {
      (*allowed)[id] = 1;
      ++*count;
    }
  }
  if (closed.empty()) return;
  for (int32_t id : key ? vocab_->key_closing() : vocab_->closing()) {
    if (static_cast<size_t>(id) >= limit) continue;
    const TokenVocab::StringScan& scan = scan_of(id);
    const uint64_t chars = chars_before + scan.chars;
    if (chars < min_chars || chars > max_chars) continue;
    const std::string& bytes = vocab_->bytes(id);
    const MatchState* at = &closed;
    bool ok = true;
    for (size_t i = scan.close + 1; ok && i < bytes.size(); ++i) {
      MatchState* next = at == &scratch_a_ ? &scratch_b_ : &scratch_a_;
      ok = stepper.Step(*at, static_cast<uint8_t>(bytes[i]), next);
      at = next;
    }
    if (ok) {
      (*allowed)[static_cast<size_t>(id)] = 1;
      ++*count;
    }
  }
}

bool TokenMasker::Accept(int32_t token) {
  if (IsEnd(token)) {
    if (ended_ || matcher_.complete()) {
      ended_ = true;
      return true;
    }
    if (!Terminal(token)) return false;  // An end token the grammar also has (<|call|>).
  }
  if (ended_ || token < 0 || static_cast<size_t>(token) >= vocab_->size()) return false;
  if (Terminal(token)) return matcher_.Accept(TokenTerminalBytes(token));
  if (!vocab_->Text(token)) return false;
  return matcher_.Accept(vocab_->bytes(token));
}

bool TokenMasker::Terminal(int32_t token) const {
  const std::vector<int32_t>& tokens = matcher_.grammar().tokens;
  return std::binary_search(tokens.begin(), tokens.end(), token);
}

void TokenMasker::FillTerminals(std::vector<uint8_t>* allowed, size_t* count) {
  GrammarStepper& stepper = matcher_.stepper();
  for (const int32_t id : matcher_.grammar().tokens) {
    if (static_cast<size_t>(id) >= allowed->size() || (*allowed)[static_cast<size_t>(id)]) continue;
    const std::string bytes = TokenTerminalBytes(id);
    scratch_a_ = matcher_.state();
    bool ok = true;
    for (const char c : bytes) {
      ok = stepper.Step(scratch_a_, static_cast<uint8_t>(c), &scratch_b_);
      if (!ok) break;
      std::swap(scratch_a_, scratch_b_);
    }
    if (ok) {
      (*allowed)[static_cast<size_t>(id)] = 1;
      ++*count;
    }
  }
}

}  // namespace fmoe
