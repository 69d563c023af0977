// GrammarMatcher: accepts the bytes of one JSON text (or of a grammar's, regex's or choice's
// text, grammar.h) against a JsonGrammar, byte by byte (a token may end inside a UTF-8
// character, a string or a number). The state is a small set of pushdown stacks (more than one
// only while alternatives are still all possible), each a vector of Frames, so the token mask
// (token_mask.h) can copy and advance it along a trie.
// One matcher per request, used by one thread; the grammar it reads is shared and immutable.
//
// Bounds: at most kMaxMatchDepth nested values (deeper ones are rejected) and kMaxStacks live
// alternatives (further ones are dropped, which narrows the language and never widens it), and
// at most kMaxStepWork values started per byte (an ambiguous grammar's further ones dropped).
#pragma once

#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "common/text/json_schema.h"

namespace fmoe {

inline constexpr size_t kMaxMatchDepth = 48;
inline constexpr size_t kMaxStacks = 64;
inline constexpr size_t kMaxStepWork = 4096;  // Values started per byte (PushValue calls).

// Bytes a matcher accepts, as plain data: stack i is frames[ends[i-1] .. ends[i]).
struct MatchFrame {
  int32_t node = 0;
  uint8_t phase = 0;
  uint8_t ws = 0;          // Whitespace bytes in the current gap.
  uint8_t utf8_need = 0;   // Continuation bytes still due in a string or key.
  uint8_t utf8_range = 0;  // Which range the next continuation byte must be in (see .cc).
  uint32_t count = 0;      // Items, characters or digits so far.
  int32_t pos = 0;         // Trie node, property index or hex digits still due.
  uint64_t seen = 0;       // Object: properties already written.
  bool operator==(const MatchFrame&) const = default;
};
struct MatchState {
  std::vector<MatchFrame> frames;
  std::vector<uint32_t> ends;
  bool empty() const { return ends.empty(); }
};

// One byte of a JSON string's frame f (opened by '"'): the matcher's own rule, shared with the
// token mask's precomputed string scan. kClose: b is the closing quote (the frame is done).
enum class StringStep : uint8_t { kReject, kAccept, kClose };
StringStep StepString(MatchFrame& f, uint8_t b, uint32_t min_len, uint32_t max_len);
// f is in a string's body between characters (no escape or UTF-8 sequence under way).
bool InStringBody(const MatchFrame& f);
inline constexpr uint8_t kStringBodyPhase = 1;
// One byte of an object's key (the key rules: no escapes, no control bytes, UTF-8); the frame's
// key trie position is not moved. kClose: the closing quote.
StringStep StepKey(MatchFrame& f, uint8_t b);
// f is an object's key under way, off the declared names (an additional property's), between
// characters: any key text may follow.
bool InFreeKey(const JsonGrammar& g, const MatchFrame& f);

// The stepping logic, with scratch space (not thread-safe: one per thread or per matcher).
class GrammarStepper {
 public:
  explicit GrammarStepper(std::shared_ptr<const JsonGrammar> grammar);
  MatchState Initial() const;
  // out = the states after `byte`; false (out empty) when no stack accepts it.
  bool Step(const MatchState& in, uint8_t byte, MatchState* out);
  // True when the bytes so far are a whole JSON text of the grammar.
  bool Complete(const MatchState& state) const;
  const JsonGrammar& grammar() const { return *grammar_; }

 private:
  void Feed(std::vector<MatchFrame>& stack, uint8_t b, MatchState* out);
  void PushValue(std::vector<MatchFrame>& stack, int32_t node, uint8_t b, MatchState* out,
                 uint32_t hops);
  void Append(const std::vector<MatchFrame>& stack, MatchState* out);
  bool FeedObject(MatchFrame& f, const JsonGrammar::Node& n, uint8_t b, int32_t* push);
  void StartSeq(std::vector<MatchFrame>& stack, int32_t node, size_t from, uint8_t b,
                MatchState* out, uint32_t hops);
  std::shared_ptr<const JsonGrammar> grammar_;
  std::vector<MatchFrame> scratch_;
  size_t work_ = 0;  // Values started in this Step (at most kMaxStepWork).
};

class GrammarMatcher {
 public:
  explicit GrammarMatcher(std::shared_ptr<const JsonGrammar> grammar);
  // Accepts all of `bytes` or nothing (the state is unchanged on false).
  bool Accept(std::string_view bytes);
  bool complete() const { return stepper_.Complete(state_); }
  const MatchState& state() const { return state_; }
  GrammarStepper& stepper() { return stepper_; }
  const JsonGrammar& grammar() const { return stepper_.grammar(); }

 private:
  GrammarStepper stepper_;
  MatchState state_;
  MatchState next_, spare_;
};

}  // namespace fmoe
