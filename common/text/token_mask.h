// Token masks for constrained decoding. TokenVocab: every token id's bytes in a byte trie
// (built once per tokenizer, immutable, shared by all requests). TokenMasker: one request's
// GrammarMatcher and the allowed next tokens, found by walking the trie depth first with the
// matcher's state and pruning every prefix the grammar rejects, so a step costs the live part
// of the trie rather than vocab x token length; the states met are stepped once per byte and
// reused (a DFA built lazily per step), so free text of a class costs trie nodes, not steps.
// Special tokens are never allowed, except the end tokens (eos, stop_token_ids), which are allowed
// exactly when the text is complete, and the grammar's token terminals (<[id]>), allowed exactly
// where the grammar has them (any token may be one, special or not; as a terminal it stands for
// itself, never for its text). A mask depends on the matcher's state alone, so the last
// few are remembered by that state (a bounded repetition's count left out while no token can
// reach its bound): a state that recurs (free text between a structural tag's triggers, a
// regex's repeated class) costs a copy instead of a walk. One TokenMasker per
// request, used by one thread (the engine's).
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "common/text/grammar_matcher.h"

namespace fmoe {

class Tokenizer;

class TokenVocab {
 public:
  // bytes[id]: the token's bytes; special[id]: never allowed by a grammar (may be shorter).
  TokenVocab(std::vector<std::string> bytes, std::vector<bool> special);
  // Each token's bytes from the tokenizer: Decode({id}) for byte-level vocabularies; the piece
  // with U+2581 as a space and <0xHH> as a byte for SentencePiece ones.
  static std::shared_ptr<const TokenVocab> FromTokenizer(const Tokenizer& tokenizer);

  size_t size() const { return bytes_.size(); }
  const std::string& bytes(int32_t id) const { return bytes_[static_cast<size_t>(id)]; }
  bool special(int32_t id) const { return special_[static_cast<size_t>(id)]; }
  // A token a grammar's text may take: not special, 1 to kMaxTokenBytes bytes, none of them a
  // token terminal's lead byte (0xFF, which no UTF-8 text has).
  bool Text(int32_t id) const {
    const std::string& b = bytes_[static_cast<size_t>(id)];
    return !special_[static_cast<size_t>(id)] && !b.empty() && b.size() <= kMaxTokenBytes &&
           b.find(static_cast<char>(kTokenTerminalLead)) == std::string::npos;
  }

  struct Node {
    uint8_t byte = 0;
    uint32_t children_begin = 0, children_end = 0;  // Into nodes().
    uint32_t ids_begin = 0, ids_end = 0;            // Into ids(): tokens ending here.
  };
  const std::vector<Node>& nodes() const { return nodes_; }  // nodes()[0] is the root.
  const std::vector<int32_t>& ids() const { return ids_; }
  uint32_t max_depth() const { return max_depth_; }

  // Each token read from inside a JSON string, between characters (StepString with no length
  // bounds): it stays inside (kInside), closes the string at byte `close` (kCloses; what follows
  // is JSON after the string), or cannot be string content (kNot). `chars`: the characters it
  // adds to the string (up to the close). Lets TokenMasker skip the trie walk inside strings.
  struct StringScan {
    enum Kind : uint8_t { kNot, kInside, kCloses };
    Kind kind = kNot;
    uint32_t chars = 0;
    uint32_t close = 0;
  };
  const StringScan& string_scan(int32_t id) const { return scans_[static_cast<size_t>(id)]; }
  const std::vector<int32_t>& closing() const { return closing_; }  // The kCloses tokens.
  // The same for an object's key (StepKey: no escapes).
  const StringScan& key_scan(int32_t id) const { return key_scans_[static_cast<size_t>(id)]; }
  const std::vector<int32_t>& key_closing() const { return key_closing_; }
  static constexpr size_t kMaxTokenBytes = 256;  // Longer tokens are left out of the trie.

 private:
  void Build(std::vector<int32_t>& order, size_t lo, size_t hi, uint32_t depth, uint32_t node);
  std::vector<std::string> bytes_;
  std::vector<bool> special_;
  std::vector<Node> nodes_;
  std::vector<int32_t> ids_;
  uint32_t max_depth_ = 0;
  std::vector<StringScan> scans_;
  std::vector<int32_t> closing_;
  std::vector<StringScan> key_scans_;
  std::vector<int32_t> key_closing_;
};

class TokenMasker {
 public:
  // end_ids: eos and stop tokens (allowed when complete, even when special). `remember`: how
  // many masks to keep by state (0: walk every time; benchmarks of the walk).
  static constexpr size_t kRememberedMasks = 4;
  TokenMasker(std::shared_ptr<const JsonGrammar> grammar, std::shared_ptr<const TokenVocab> vocab,
              std::vector<int32_t> end_ids, size_t remember = kRememberedMasks);

  // allowed[id] = 1 for the tokens that may come next (allowed.size() = n, the logits' size;
  // ids beyond the vocabulary are 0). Returns how many are allowed.
  size_t Fill(size_t n, std::vector<uint8_t>* allowed);
  // Advances by a drawn token; false (state unchanged) when the grammar rejects it.
  bool Accept(int32_t token);
  // Fills answered from a remembered mask (tests, benchmarks).
  uint64_t remembered() const { return remembered_; }
  bool complete() const { return matcher_.complete(); }
  bool IsEnd(int32_t token) const;

 private:
  // A token terminal of the grammar (JsonGrammar::tokens).
  bool Terminal(int32_t token) const;
  // The grammar's token terminals whose bytes the state takes next.
  void FillTerminals(std::vector<uint8_t>* allowed, size_t* count);
  // Fill without the remembered masks.
  // `walked`: the trie walk answered (not the string scans, nor the end alone).
  size_t FillWalked(size_t n, std::vector<uint8_t>* allowed, bool* walked);
  void Walk(uint32_t node, uint32_t depth, std::vector<uint8_t>* allowed, size_t* count);
  // The walk over the states met so far in this Fill, each stepped at most once per byte (a
  // repeated character class keeps one state, or a few, across most of the trie). False when
  // more than kMaxCachedStates states were met: Walk finishes the job.
  bool WalkCached(uint32_t node, int32_t state, std::vector<uint8_t>* allowed, size_t* count);
  int32_t CachedState(const MatchState& state);  // Its index; -1 when the cache is full.
  // A state's identity: its frames' and ends' bytes.
  static void StateKey(const MatchState& state, std::string* key);
  // The key a mask is remembered by: StateKey with the count of each bounded repetition that no
  // token can take to its bound (nor below its minimum) made one value, as its mask does not
  // depend on it (a regex's [^\n]{0,2000} of free text recurs as one state).
  void RememberKey(const MatchState& state, std::string* key);
  MatchState canonical_;
  // The last masks Fill computed, by the state they were for (least recently used replaced).
  size_t remember_ = kRememberedMasks;
  struct Remembered {
    std::string key;
    std::vector<uint8_t> allowed;
    size_t count = 0;
    uint64_t used = 0;
  };
  std::vector<Remembered> masks_;
  uint64_t fills_ = 0;
  uint64_t remembered_ = 0;
  std::string state_key_;
  static constexpr size_t kMaxCachedStates = 1024;  // About 1 MiB at most, kept for reuse.
  struct Cached {
    MatchState state;
    std::array<int32_t, 256> next;  // By byte: the state after it; -1 not yet stepped, -2 refused.
  };
  std::vector<Cached> cache_;  // The first cache_used_ are this Fill's.
  size_t cache_used_ = 0;
  std::unordered_map<std::string, int32_t> cache_index_;  // A state's bytes -> its index.
  std::string key_;
  MatchState stepped_;
  // Inside a string's body (one stack): the precomputed scans instead of the walk. False when
  // the state is not that.
  bool FillInString(std::vector<uint8_t>* allowed, size_t* count);
  // The tokens of `scans` inside (within `max_chars` more characters) and those of `closing`
  // whose rest the state after `closed` (the closing quote's) takes.
  void FillScanned(bool key, const MatchState& closed, uint64_t chars_before, uint64_t min_chars,
                   uint64_t max_chars, std::vector<uint8_t>* allowed, size_t* count);
  std::shared_ptr<const TokenVocab> vocab_;
  std::vector<int32_t> end_ids_;
  GrammarMatcher matcher_;
  std::vector<MatchState> levels_;  // levels_[d]: the state after d bytes of the walk.
  MatchState closed_, scratch_a_, scratch_b_;
  bool ended_ = false;  // An end token was accepted.
};

}  // namespace fmoe
