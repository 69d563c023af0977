#include "common/text/grammar_matcher.h"

#include <algorithm>
#include <utility>

namespace fmoe {
namespace {

using Kind = JsonGrammar::Kind;

// Phases. Object: { "key" : value , ... }
enum : uint8_t {
  kObjOpen = 0,    // Expects '{'.
  kObjFirst,       // After '{': a key or '}'.
  kObjKey,         // In a key; pos: key trie node (-1: not a declared name's prefix).
  kObjAfterKey,    // Expects ':'; pos: the property (-2: an additional one).
  kObjColon,       // Expects the value.
  kObjAfterValue,  // ',' or '}'.
  kObjComma,       // Expects a key.
};
enum : uint8_t { kArrOpen = 0, kArrFirst, kArrAfterItem, kArrComma };
enum : uint8_t { kStrOpen = 0, kStrBody, kStrEscape, kStrHex };
static_assert(kStrBody == kStringBodyPhase);
enum : uint8_t {
  kNumStart = 0,
  kNumMinus,
  kNumZero,  // Endable.
  kNumInt,   // Endable.
  kNumDot,
  kNumFrac,  // Endable.
  kNumE,
  kNumExpSign,
  kNumExp,  // Endable.
};

bool IsWs(uint8_t b) { return b == ' ' || b == '\n' || b == '\t'; }
bool IsDigit(uint8_t b) { return b >= '0' && b <= '9'; }
bool IsHex(uint8_t b) { return IsDigit(b) || (b >= 'a' && b <= 'f') || (b >= 'A' && b <= 'F'); }

// Whitespace in a gap, at most kMaxWhitespace bytes.
bool Ws(MatchFrame& f, uint8_t b) {
  if (!IsWs(b) || f.ws >= kMaxWhitespace) return false;
  ++f.ws;
  return true;
}

// One byte of UTF-8 (RFC 3629: no overlongs, surrogates or code points above U+10FFFF). Ranges
// of the next continuation byte: 0: 80-BF, 1: A0-BF (after E0), 2: 80-9F (after ED),
// 3: 90-BF (after F0), 4: 80-8F (after F4). Returns whether b starts a character.
bool Utf8(MatchFrame& f, uint8_t b, bool* starts) {
  if (f.utf8_need > 0) {
    static constexpr uint8_t kLo[] = {0x80, 0xA0, 0x80, 0x90, 0x80};
    static constexpr uint8_t kHi[] = {0xBF, 0xBF, 0x9F, 0xBF, 0x8F};
    if (b < kLo[f.utf8_range] || b > kHi[f.utf8_range]) return false;
    --f.utf8_need;
    f.utf8_range = 0;
    *starts = false;
    return true;
  }
  *starts = true;
  if (b < 0x80) return true;
  if (b >= 0xC2 && b <= 0xDF) {
    f.utf8_need = 1;
  } else if (b >= 0xE0 && b <= 0xEF) {
    f.utf8_need = 2;
    f.utf8_range = b == 0xE0 ? 1 : b == 0xED ? 2 : 0;
  } else if (b >= 0xF0 && b <= 0xF4) {
    f.utf8_need = 3;
    f.utf8_range = b == 0xF0 ? 3 : b == 0xF4 ? 4 : 0;
  } else {
    return false;
  }
  return true;
}

bool Endable(const JsonGrammar& g, const MatchFrame& f) {
  const JsonGrammar::Node& n = g.nodes[f.node];
  switch (n.kind) {
    case Kind::kNumber:
    case Kind::kInteger:
      return f.phase == kNumZero || f.phase == kNumInt || f.phase == kNumFrac || f.phase == kNumExp;
    case Kind::kLiteral:
      return g.tries[f.pos].terminal >= 0;
    case Kind::kSeq:  // pos: the next element.
      for (size_t i = static_cast<size_t>(f.pos); i < n.alts.size(); ++i) {
        if (!g.nodes[n.alts[i]].nullable) return false;
      }
      return true;
    case Kind::kRepeat:  // count: the iterations begun.
      return f.count >= n.min_items || g.nodes[n.items].nullable;
    case Kind::kChar:  // count: 1 once the character is whole.
      return f.count == 1;
    default:
      return false;
  }
}

// The code points a UTF-8 character may still become, given its bytes so far: f.pos holds
// their value bits, f.utf8_need the bytes still due; `len` its whole length.
std::pair<uint32_t, uint32_t> CharInterval(const MatchFrame& f, uint32_t len) {
  static constexpr uint32_t kMin[] = {0, 0, 0x80, 0x800, 0x10000};
  const uint32_t shift = 6u * f.utf8_need;
  return {std::max(static_cast<uint32_t>(f.pos) << shift, kMin[len]),
          std::min((static_cast<uint32_t>(f.pos) << shift) | ((1u << shift) - 1), 0x10FFFFu)};
}

bool CharMayMatch(const JsonGrammar::Node& n, const MatchFrame& f, uint32_t len) {
  const auto [lo, hi] = CharInterval(f, len);
  for (const auto& [a, b] : n.ranges) {
    if (a <= hi && b >= lo) return true;
  }
  return false;
}

// Every code point the character may still become is in the class: its remaining bytes cannot
// fail it (only UTF-8's own rules, which Utf8 checks).
bool CharMustMatch(const JsonGrammar::Node& n, const MatchFrame& f, uint32_t len) {
  const auto [lo, hi] = CharInterval(f, len);
  for (const auto& [a, b] : n.ranges) {
    if (a <= lo && hi <= b) return true;
  }
  return false;
}

}  // namespace

bool InStringBody(const MatchFrame& f) { return f.phase == kStrBody && f.utf8_need == 0; }

StringStep StepString(MatchFrame& f, uint8_t b, uint32_t min_len, uint32_t max_len) {
  switch (f.phase) {
    case kStrOpen:
      if (b != '"') return StringStep::kReject;
      f.phase = kStrBody;
      return StringStep::kAccept;
    case kStrBody: {
      bool starts = false;
      if (f.utf8_need != 0) {  // Inside a character: only its continuation bytes.
        return Utf8(f, b, &starts) ? StringStep::kAccept : StringStep::kReject;
      }
      if (b == '"') return f.count < min_len ? StringStep::kReject : StringStep::kClose;
      if (b == '\\') {  // An escape counts as one character.
        if (f.count >= max_len) return StringStep::kReject;
        ++f.count;
        f.phase = kStrEscape;
        return StringStep::kAccept;
      }
      if (b < 0x20 || !Utf8(f, b, &starts)) return StringStep::kReject;
      if (starts) {
        if (f.count >= max_len) return StringStep::kReject;
        ++f.count;
      }
      return StringStep::kAccept;
    }
    case kStrEscape:
      if (b == 'u') {
        f.phase = kStrHex;
        f.pos = 4;
        return StringStep::kAccept;
      }
      if (b != '"' && b != '\\' && b != '/' && b != 'b' && b != 'f' && b != 'n' && b != 'r' &&
          b != 't') {
        return StringStep::kReject;
      }
      f.phase = kStrBody;
      return StringStep::kAccept;
    case kStrHex:
      // No surrogates (\uD800-\uDFFF): a pair would count as two characters where validators
      // count one code point, and a lone one is not Unicode. Characters beyond the BMP are
      // written as UTF-8.
      if (!IsHex(b)) return StringStep::kReject;
      if (f.pos == 4) f.utf8_range = (b == 'd' || b == 'D') ? 1 : 0;  // Marks \uD...
      if (f.pos == 3) {
        const bool surrogate = f.utf8_range == 1 && !(b >= '0' && b <= '7');
        f.utf8_range = 0;
        if (surrogate) return StringStep::kReject;
      }
      if (--f.pos == 0) f.phase = kStrBody;
      return StringStep::kAccept;
    default:
      return StringStep::kReject;
  }
}

StringStep StepKey(MatchFrame& f, uint8_t b) {
  bool starts = false;
  if (b == '"') {
    return f.utf8_need == 0 ? StringStep::kClose : StringStep::kReject;
  }
  if (b == '\\' || b < 0x20 || !Utf8(f, b, &starts)) return StringStep::kReject;
  return StringStep::kAccept;
}

bool InFreeKey(const JsonGrammar& g, const MatchFrame& f) {
  if (f.node < 0) return false;
  const JsonGrammar::Node& n = g.nodes[static_cast<size_t>(f.node)];
  return n.kind == Kind::kObject && f.phase == kObjKey && f.pos < 0 && n.additional >= 0 &&
         f.utf8_need == 0;
}

GrammarStepper::GrammarStepper(std::shared_ptr<const JsonGrammar> grammar)
    : grammar_(std::move(grammar)) {}

MatchState GrammarStepper::Initial() const {
  // A sentinel-free start: one stack holding a marker frame with node -1 ("expects the root").
  MatchState s;
  s.frames.push_back(MatchFrame{.node = -1});
  s.ends.push_back(1);
  return s;
}

bool GrammarStepper::Complete(const MatchState& state) const {
  const JsonGrammar& g = *grammar_;
  for (size_t i = 0; i < state.ends.size(); ++i) {
    size_t begin = i == 0 ? 0 : state.ends[i - 1];
    size_t end = state.ends[i];
    // The root marker stays at the bottom with phase 1 once the root value started.
    if (state.frames[begin].phase == 0 && g.nodes[g.root].nullable) return true;
    if (state.frames[begin].phase != 1) continue;
    while (end > begin + 1 && Endable(g, state.frames[end - 1])) --end;
    if (end == begin + 1) return true;
  }
  return false;
}

bool GrammarStepper::Step(const MatchState& in, uint8_t byte, MatchState* out) {
  out->frames.clear();
  out->ends.clear();
  work_ = 0;
  for (size_t i = 0; i < in.ends.size(); ++i) {
    const size_t begin = i == 0 ? 0 : in.ends[i - 1];
    scratch_.assign(in.frames.begin() + static_cast<std::ptrdiff_t>(begin),
                    in.frames.begin() + in.ends[i]);
    Feed(scratch_, byte, out);
  }
  return !out->empty();
}

void GrammarStepper::Append(const std::vector<MatchFrame>& stack, MatchState* out) {
  if (out->ends.size() >= kMaxStacks) return;
  for (size_t i = 0; i < out->ends.size(); ++i) {
    const size_t begin = i == 0 ? 0 : out->ends[i - 1];
    if (out->ends[i] - begin == stack.size() &&
        std::equal(stack.begin(), stack.end(),
                   out->frames.begin() + static_cast<std::ptrdiff_t>(begin))) {
      return;
    }
  }
  out->frames.insert(out->frames.end(), stack.begin(), stack.end());
  out->ends.push_back(static_cast<uint32_t>(out->frames.size()));
}

void GrammarStepper::PushValue(std::vector<MatchFrame>& stack, int32_t node, uint8_t b,
                               MatchState* out, uint32_t hops) {
  const JsonGrammar& g = *grammar_;
  if (hops > g.nodes.size()) return;   // The compilers refuse cycles; a bound all the same.
  if (++work_ > kMaxStepWork) return;  // Narrows an ambiguous grammar's language, never widens.
  const JsonGrammar::Node& n = g.nodes[node];
  if (n.kind == Kind::kRef) return PushValue(stack, n.target, b, out, hops + 1);
  if (n.kind == Kind::kAnyOf) {
    for (int32_t alt : n.alts) {
      std::vector<MatchFrame> copy = stack;
      PushValue(copy, alt, b, out, hops + 1);
    }
    return;
  }
  if (n.kind == Kind::kSeq) return StartSeq(stack, node, 0, b, out, hops);
  if (n.kind == Kind::kRepeat) {
    // The first iteration starts with b; the frame stays while more may follow.
    if (n.max_items == 0) return;
    if (n.max_items > 1) {
      if (stack.size() >= kMaxMatchDepth) return;
      stack.push_back(MatchFrame{.node = node, .count = 1});
    }
    return PushValue(stack, n.items, b, out, hops + 1);
  }
  if (stack.size() >= kMaxMatchDepth) return;
  MatchFrame f{.node = node};
  if (n.kind == Kind::kLiteral) f.pos = n.trie_root;
  stack.push_back(f);
  Feed(stack, b, out);
}

// Element `from` or a later one of the sequence `node` starts with b (the nullable ones before
// it matched ""); the sequence's frame stays below it unless that element is its last.
void GrammarStepper::StartSeq(std::vector<MatchFrame>& stack, int32_t node, size_t from, uint8_t b,
                              MatchState* out, uint32_t hops) {
  const JsonGrammar& g = *grammar_;
  const JsonGrammar::Node& n = g.nodes[node];
  for (size_t i = from; i < n.alts.size(); ++i) {
    std::vector<MatchFrame> copy = stack;
    if (i + 1 < n.alts.size()) {
      if (copy.size() >= kMaxMatchDepth) return;
      copy.push_back(MatchFrame{.node = node, .pos = static_cast<int32_t>(i + 1)});
    }
    PushValue(copy, n.alts[i], b, out, hops + 1);
    if (!g.nodes[n.alts[i]].nullable) return;
  }
}

// The object frame f takes b: true when accepted; *push >= 0 when the property's value starts
// with b (the caller pushes it).
bool GrammarStepper::FeedObject(MatchFrame& f, const JsonGrammar::Node& n, uint8_t b,
                                int32_t* push) {
  const JsonGrammar& g = *grammar_;
  const uint64_t all = n.props.size() == 64 ? ~uint64_t{0} : (uint64_t{1} << n.props.size()) - 1;
  const bool more_keys = n.additional >= 0 || (all & ~f.seen) != 0;
  auto start_key = [&] {
    f.phase = kObjKey;
    f.pos = n.key_trie;
    f.utf8_need = 0;
    f.ws = 0;
  };
  switch (f.phase) {
    case kObjOpen:
      if (b != '{') return false;
      f.phase = kObjFirst;
      return true;
    case kObjFirst:
    case kObjComma:
      if (Ws(f, b)) return true;
      if (b == '"' && more_keys) {
        start_key();
        return true;
      }
      if (b == '}' && f.phase == kObjFirst && n.required_mask == 0) {
        f.phase = 0xFF;  // Done: the caller pops.
        return true;
      }
      return false;
    case kObjKey: {
      if (b == '"') {
        if (f.utf8_need != 0) return false;
        const int32_t prop = f.pos >= 0 ? g.tries[f.pos].terminal : -1;
        if (prop >= 0) {
          if (f.seen & (uint64_t{1} << prop)) return false;
          f.seen |= uint64_t{1} << prop;
          f.pos = prop;
        } else if (n.additional >= 0) {
          f.pos = -2;
        } else {
          return false;
        }
        f.phase = kObjAfterKey;
        f.ws = 0;
        return true;
      }
      if (StepKey(f, b) == StringStep::kReject) return false;
      if (f.pos >= 0) {
        f.pos = g.Child(f.pos, b);
        // A declared name still unwritten must pass here, unless any key may follow.
        if (n.additional < 0 && (f.pos < 0 || (g.tries[f.pos].below & ~f.seen) == 0)) {
          return false;
        }
      } else if (n.additional < 0) {
        return false;
      }
      return true;
    }
    case kObjAfterKey:
      if (Ws(f, b)) return true;
      if (b != ':') return false;
      f.phase = kObjColon;
      f.ws = 0;
      return true;
    case kObjColon:
      if (Ws(f, b)) return true;
      *push = f.pos >= 0 ? n.props[static_cast<size_t>(f.pos)].node : n.additional;
      f.phase = kObjAfterValue;
      f.ws = 0;
      return true;
    case kObjAfterValue:
      if (Ws(f, b)) return true;
      if (b == ',' && more_keys) {
        f.phase = kObjComma;
        f.ws = 0;
        return true;
      }
      if (b == '}' && (n.required_mask & ~f.seen) == 0) {
        f.phase = 0xFF;
        return true;
      }
      return false;
    default:
      return false;
  }
}

void GrammarStepper::Feed(std::vector<MatchFrame>& stack, uint8_t b, MatchState* out) {
  const JsonGrammar& g = *grammar_;
  while (!stack.empty()) {
    MatchFrame& f = stack.back();
    if (f.node < 0) {  // The root marker: the document starts with b; nothing follows it.
      if (f.phase != 0) return;
      f.phase = 1;
      return PushValue(stack, g.root, b, out, 0);
    }
    const JsonGrammar::Node& n = g.nodes[f.node];
    switch (n.kind) {
      case Kind::kObject: {
        int32_t push = -1;
        if (!FeedObject(f, n, b, &push)) return;
        if (push >= 0) return PushValue(stack, push, b, out, 0);
        if (f.phase == 0xFF) stack.pop_back();
        return Append(stack, out);
      }
      case Kind::kArray:
        switch (f.phase) {
          case kArrOpen:
            if (b != '[') return;
            f.phase = kArrFirst;
            return Append(stack, out);
          case kArrFirst:
            if (Ws(f, b)) return Append(stack, out);
            if (b == ']' && n.min_items == 0) {
              stack.pop_back();
              return Append(stack, out);
            }
            if (n.max_items == 0) return;
            f.phase = kArrAfterItem;
            f.count = 1;
            f.ws = 0;
            return PushValue(stack, n.items, b, out, 0);
          case kArrAfterItem:
            if (Ws(f, b)) return Append(stack, out);
            if (b == ',' && f.count < n.max_items) {
              f.phase = kArrComma;
              f.ws = 0;
              return Append(stack, out);
            }
            if (b == ']' && f.count >= n.min_items) {
              stack.pop_back();
              return Append(stack, out);
            }
            return;
          case kArrComma:
            if (Ws(f, b)) return Append(stack, out);
            f.phase = kArrAfterItem;
            ++f.count;
            f.ws = 0;
            return PushValue(stack, n.items, b, out, 0);
          default:
            return;
        }
      case Kind::kString:
        switch (StepString(f, b, n.min_len, n.max_len)) {
          case StringStep::kReject:
            return;
          case StringStep::kAccept:
            return Append(stack, out);
          case StringStep::kClose:
            stack.pop_back();
            return Append(stack, out);
        }
        return;
      case Kind::kNumber:
      case Kind::kInteger: {
        const bool real = n.kind == Kind::kNumber;
        bool ok = false;
        switch (f.phase) {
          case kNumStart:
          case kNumMinus:
            if (b == '-' && f.phase == kNumStart) {
              f.phase = kNumMinus;
              ok = true;
            } else if (b == '0') {
              f.phase = kNumZero;
              ok = true;
            } else if (b >= '1' && b <= '9') {
              f.phase = kNumInt;
              f.count = 1;
              ok = true;
            } else {
              return;
            }
            break;
          case kNumZero:
          case kNumInt:
            if (f.phase == kNumInt && IsDigit(b) && f.count < kMaxIntDigits) {
              ++f.count;
              ok = true;
            } else if (real && b == '.') {
              f.phase = kNumDot;
              ok = true;
            } else if (real && (b == 'e' || b == 'E')) {
              f.phase = kNumE;
              ok = true;
            }
            break;
          case kNumDot:
            if (!IsDigit(b)) return;
            f.phase = kNumFrac;
            f.count = 1;
            ok = true;
            break;
          case kNumFrac:
            if (IsDigit(b) && f.count < kMaxFracDigits) {
              ++f.count;
              ok = true;
            } else if (b == 'e' || b == 'E') {
              f.phase = kNumE;
              ok = true;
            }
            break;
          case kNumE:
          case kNumExpSign:
            if ((b == '+' || b == '-') && f.phase == kNumE) {
              f.phase = kNumExpSign;
              ok = true;
            } else if (IsDigit(b)) {
              f.phase = kNumExp;
              f.count = 1;
              ok = true;
            } else {
              return;
            }
            break;
          case kNumExp:
            if (IsDigit(b) && f.count < kMaxExpDigits) {
              ++f.count;
              ok = true;
            }
            break;
          default:
            return;
        }
        if (ok) return Append(stack, out);
        stack.pop_back();  // An endable number ends before b; the parent takes b.
        continue;
      }
      case Kind::kLiteral: {
        const int32_t next = g.Child(f.pos, b);
        const bool ends = g.tries[f.pos].terminal >= 0;
        if (next >= 0) {
          if (!ends) {
            f.pos = next;
            return Append(stack, out);
          }
          // A text ends here and a longer one goes on with b: both stay possible.
          std::vector<MatchFrame> copy = stack;
          copy.back().pos = next;
          Append(copy, out);
        }
        if (!ends) return;
        stack.pop_back();
        continue;
      }
      case Kind::kSeq: {
        // An element ended before b: a later one starts with b, or the sequence ends before b.
        const int32_t node = f.node;
        const auto from = static_cast<size_t>(f.pos);
        stack.pop_back();
        StartSeq(stack, node, from, b, out, 0);
        if (!Endable(g, MatchFrame{.node = node, .pos = static_cast<int32_t>(from)})) return;
        continue;
      }
      case Kind::kRepeat: {
        // An iteration ended before b: the next one starts with b, or the repetition ends.
        const int32_t node = f.node;
        const uint32_t count = f.count;
        stack.pop_back();
        if (count < n.max_items) {
          std::vector<MatchFrame> copy = stack;
          // Unbounded: counts past min_items are all alike (so the states stay few).
          uint32_t next = count + 1;
          if (n.max_items == UINT32_MAX && next > n.min_items) next = std::max(n.min_items, 1u);
          if (next < n.max_items) copy.push_back(MatchFrame{.node = node, .count = next});
          PushValue(copy, n.items, b, out, 0);
        }
        if (count < n.min_items && !g.nodes[n.items].nullable) return;
        continue;
      }
      case Kind::kChar: {
        if (f.count == 1) {  // The character is whole: the parent takes b.
          stack.pop_back();
          continue;
        }
        // phase 1: the class takes whatever the character's remaining bytes are, so its value
        // bits are dropped (pos and seen 0), and a whole character keeps none either: frames that
        // can only go on alike are equal, which keeps the token mask's states few.
        bool starts = false;
        if (!Utf8(f, b, &starts)) return;
        uint32_t len = 0;
        if (starts) {
          len = f.utf8_need + 1u;
          static constexpr uint8_t kLeadBits[] = {0, 0x7F, 0x1F, 0x0F, 0x07};
          f.pos = b & kLeadBits[len];
          f.seen = len;  // The character's length, for CharMayMatch.
        } else if (f.phase == 0) {
          len = static_cast<uint32_t>(f.seen);
          f.pos = (f.pos << 6) | (b & 0x3F);
        }
        if (f.phase == 0) {
          if (!CharMayMatch(n, f, len)) return;
          if (f.utf8_need > 0 && CharMustMatch(n, f, len)) {
            f.phase = 1;
            f.pos = 0;
            f.seen = 0;
          }
        }
        if (f.utf8_need == 0) {
          f.count = 1;
          f.phase = 0;
          f.pos = 0;
          f.seen = 0;
        }
        return Append(stack, out);
      }
      case Kind::kAnyOf:
      case Kind::kRef:
        return;  // Never on a stack: PushValue resolves them.
    }
  }
}

GrammarMatcher::GrammarMatcher(std::shared_ptr<const JsonGrammar> grammar)
    : stepper_(std::move(grammar)), state_(stepper_.Initial()) {}

bool GrammarMatcher::Accept(std::string_view bytes) {
  spare_ = state_;
  for (char c : bytes) {
    if (!stepper_.Step(spare_, static_cast<uint8_t>(c), &next_)) return false;
    std::swap(spare_, next_);
  }
  std::swap(state_, spare_);
  return true;
}

}  // namespace fmoe
