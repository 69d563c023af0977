#include "common/text/grammar.h"

#include <algorithm>
#include <map>
#include <optional>
#include <utility>

#include "common/json.h"

namespace fmoe {
namespace {

using Kind = JsonGrammar::Kind;
using Ranges = std::vector<std::pair<uint32_t, uint32_t>>;

constexpr uint32_t kMaxCodePoint = 0x10FFFF;

// Sorted, merged, without surrogates (UTF-8 has none).
Ranges Normalize(Ranges r) {
  Ranges cut;
  for (auto [a, b] : r) {
    if (a > b) continue;
    if (a < 0xD800 && b >= 0xD800) {
      cut.push_back({a, 0xD7FF});
      a = 0xE000;
    } else if (a >= 0xD800 && a <= 0xDFFF) {
      a = 0xE000;
    }
    if (b >= 0xD800 && b <= 0xDFFF) b = 0xD7FF;
    if (a <= b) cut.push_back({a, std::min(b, kMaxCodePoint)});
  }
  std::sort(cut.begin(), cut.end());
  Ranges out;
  for (const auto& [a, b] : cut) {
    if (!out.empty() && a <= out.back().second + 1) {
      out.back().second = std::max(out.back().second, b);
    } else {
      out.push_back({a, b});
    }
  }
  return out;
}

Ranges Complement(const Ranges& r) {
  Ranges n = Normalize(r), out;
  uint32_t next = 0;
  for (const auto& [a, b] : n) {
    if (a > next) out.push_back({next, a - 1});
    next = b + 1;
  }
  if (next <= kMaxCodePoint) out.push_back({next, kMaxCodePoint});
  return Normalize(out);
}

void AppendUtf8(uint32_t cp, std::string* out) {
  if (cp < 0x80) {
    *out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    *out += static_cast<char>(0xC0 | (cp >> 6));
    *out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    *out += static_cast<char>(0xE0 | (cp >> 12));
    *out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    *out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    *out += static_cast<char>(0xF0 | (cp >> 18));
    *out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    *out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    *out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

int HexValue(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// Builds the node table; the parsers below call it. `where` strings name positions in errors.
class Builder {
 public:
  explicit Builder(std::string what) : what_(std::move(what)) {}

  Result<int32_t> New(Kind kind) {
    if (g_.nodes.size() >= kMaxGrammarNodes) {
      return InvalidArgument(what_ + ": too large (more than " + std::to_string(kMaxGrammarNodes) +
                             " grammar nodes)");
    }
    g_.nodes.push_back(JsonGrammar::Node{.kind = kind});
    return static_cast<int32_t>(g_.nodes.size() - 1);
  }
  Result<int32_t> Seq(std::vector<int32_t> elems) {
    if (elems.size() == 1) return elems[0];
    FMOE_ASSIGN_OR_RETURN(int32_t id, New(Kind::kSeq));
    g_.nodes[id].alts = std::move(elems);
    return id;
  }
  Result<int32_t> Alt(std::vector<int32_t> alts) {
    if (alts.size() == 1) return alts[0];
    FMOE_ASSIGN_OR_RETURN(int32_t id, New(Kind::kAnyOf));
    g_.nodes[id].alts = std::move(alts);
    return id;
  }
  Result<int32_t> Repeat(int32_t child, uint32_t min, uint32_t max) {
    if (min == 1 && max == 1) return child;
    FMOE_ASSIGN_OR_RETURN(int32_t id, New(Kind::kRepeat));
    g_.nodes[id].items = child;
    g_.nodes[id].min_items = min;
    g_.nodes[id].max_items = max;
    return id;
  }
  Result<int32_t> Char(Ranges ranges) {
    ranges = Normalize(std::move(ranges));
    if (ranges.empty()) return InvalidArgument(what_ + ": a character class matches no character");
    FMOE_ASSIGN_OR_RETURN(int32_t id, New(Kind::kChar));
    g_.nodes[id].ranges = std::move(ranges);
    return id;
  }
  // The texts (one or more, at least one byte each) as one trie.
  Result<int32_t> Literal(const std::vector<std::string>& texts) {
    FMOE_ASSIGN_OR_RETURN(int32_t id, New(Kind::kLiteral));
    const int32_t root = NewTrieNode();
    g_.nodes[id].trie_root = root;
    for (const std::string& text : texts) {
      literal_bytes_ += text.size();
      if (literal_bytes_ > kMaxLiteralBytes) {
        return InvalidArgument(what_ + ": literals exceed " + std::to_string(kMaxLiteralBytes) +
                               " bytes");
      }
      const int32_t at = g_.AddPath(root, text);
      g_.tries[at].terminal = 0;
    }
    return id;
  }
  // A token terminal: the token `id` itself (JsonGrammar::tokens).
  Result<int32_t> Token(int32_t id) {
    if (id < 0 || id > kMaxTokenTerminal) {
      return InvalidArgument(what_ + ": token id " + std::to_string(id) + " is out of range");
    }
    NoteToken(id);
    return Literal({TokenTerminalBytes(id)});
  }
  Result<int32_t> Ref() { return New(Kind::kRef); }
  // Copies another table's nodes and tries into this one (a compiled schema); returns its root
  // here.
  Result<int32_t> Import(const JsonGrammar& other) {
    if (g_.nodes.size() + other.nodes.size() > kMaxGrammarNodes) {
      return InvalidArgument(what_ + ": too large (more than " + std::to_string(kMaxGrammarNodes) +
                             " grammar nodes)");
    }
    const auto node_base = static_cast<int32_t>(g_.nodes.size());
    const auto trie_base = static_cast<int32_t>(g_.tries.size());
    const auto node = [&](int32_t i) { return i < 0 ? i : i + node_base; };
    const auto trie = [&](int32_t i) { return i < 0 ? i : i + trie_base; };
    for (JsonGrammar::Node n : other.nodes) {
      for (JsonGrammar::Property& p : n.props) p.node = node(p.node);
      n.additional = node(n.additional);
      n.key_trie = trie(n.key_trie);
      n.items = node(n.items);
      n.trie_root = trie(n.trie_root);
      for (int32_t& a : n.alts) a = node(a);
      n.target = node(n.target);
      g_.nodes.push_back(std::move(n));
    }
    for (JsonGrammar::TrieNode t : other.tries) {
      for (auto& edge : t.next) edge.second = trie(edge.second);
      g_.tries.push_back(std::move(t));
    }
    for (const int32_t id : other.tokens) NoteToken(id);
    return node(other.root);
  }

  JsonGrammar& grammar() { return g_; }

  // Marks nullable nodes and refuses left recursion (a cycle through edges that consume
  // nothing), naming the cycle's node by `name_of`.
  template <typename NameOf>
  Status Finish(int32_t root, NameOf name_of) {
    g_.root = root;
    for (bool changed = true; changed;) {
      changed = false;
      for (JsonGrammar::Node& n : g_.nodes) {
        if (n.nullable) continue;
        bool nullable = false;
        switch (n.kind) {
          case Kind::kSeq:
            nullable = std::all_of(n.alts.begin(), n.alts.end(),
                                   [&](int32_t a) { return g_.nodes[a].nullable; });
            break;
          case Kind::kAnyOf:
            nullable = std::any_of(n.alts.begin(), n.alts.end(),
                                   [&](int32_t a) { return g_.nodes[a].nullable; });
            break;
          case Kind::kRepeat:
            nullable = n.min_items == 0 || g_.nodes[n.items].nullable;
            break;
          case Kind::kRef:
            nullable = g_.nodes[n.target].nullable;
            break;
          default:
            break;
        }
        if (nullable) {
          n.nullable = true;
          changed = true;
        }
      }
    }
    std::vector<uint8_t> color(g_.nodes.size(), 0);  // 0 new, 1 on the path, 2 done.
    for (size_t start = 0; start < g_.nodes.size(); ++start) {
      if (color[start] != 0) continue;
      std::vector<std::pair<int32_t, size_t>> stack{{static_cast<int32_t>(start), 0}};
      color[start] = 1;
      while (!stack.empty()) {
        auto& [node, edge] = stack.back();
        const std::vector<int32_t> edges = FirstEdges(node);
        if (edge == edges.size()) {
          color[node] = 2;
          stack.pop_back();
          continue;
        }
        const int32_t next = edges[edge++];
        if (color[next] == 1) {
          return InvalidArgument(what_ + ": " + name_of(next) +
                                 " is left-recursive (it can reach itself before consuming "
                                 "input)");
        }
        if (color[next] == 0) {
          color[next] = 1;
          stack.push_back({next, 0});
        }
      }
    }
    return Status::Ok();
  }

  std::shared_ptr<const JsonGrammar> Take() {
    return std::make_shared<const JsonGrammar>(std::move(g_));
  }

 private:
  // `id` in the grammar's sorted token terminals.
  void NoteToken(int32_t id) {
    const auto at = std::lower_bound(g_.tokens.begin(), g_.tokens.end(), id);
    if (at == g_.tokens.end() || *at != id) g_.tokens.insert(at, id);
  }
  int32_t NewTrieNode() {
    g_.tries.emplace_back();
    return static_cast<int32_t>(g_.tries.size() - 1);
  }
  // The nodes a node may start with before consuming a byte.
  std::vector<int32_t> FirstEdges(int32_t node) const {
    const JsonGrammar::Node& n = g_.nodes[node];
    switch (n.kind) {
      case Kind::kRef:
        return {n.target};
      case Kind::kAnyOf:
        return n.alts;
      case Kind::kRepeat:
        return {n.items};
      case Kind::kSeq: {
        std::vector<int32_t> out;
        for (int32_t a : n.alts) {
          out.push_back(a);
          if (!g_.nodes[a].nullable) break;
        }
        return out;
      }
      default:
        return {};
    }
  }

  std::string what_;
  JsonGrammar g_;
  size_t literal_bytes_ = 0;
};

// What GBNF and regexes share: a cursor over the text with positions for errors.
class Cursor {
 public:
  Cursor(std::string_view text, bool lines) : text_(text), lines_(lines) {}
  bool done() const { return pos_ >= text_.size(); }
  char peek(size_t ahead = 0) const {
    return pos_ + ahead < text_.size() ? text_[pos_ + ahead] : '\0';
  }
  char take() { return text_[pos_++]; }
  bool eat(char c) {
    if (peek() != c || done()) return false;
    ++pos_;
    return true;
  }
  size_t pos() const { return pos_; }
  void set_pos(size_t p) { pos_ = p; }
  std::string_view text() const { return text_; }

  Status Error(const std::string& message) const { return ErrorAt(pos_, message); }
  Status ErrorAt(size_t at, const std::string& message) const {
    if (!lines_) return InvalidArgument("regex at " + std::to_string(at) + ": " + message);
    size_t line = 1, col = 1;
    for (size_t i = 0; i < at && i < text_.size(); ++i) {
      if (text_[i] == '\n') {
        ++line;
        col = 1;
      } else {
        ++col;
      }
    }
    return InvalidArgument("grammar line " + std::to_string(line) + " col " + std::to_string(col) +
                           ": " + message);
  }

  // One UTF-8 character of the text.
  Result<uint32_t> TakeUtf8() {
    const auto b = static_cast<uint8_t>(take());
    if (b < 0x80) return b;
    int need = b >= 0xF0 ? 3 : b >= 0xE0 ? 2 : b >= 0xC0 ? 1 : -1;
    if (need < 0 || b > 0xF4) return ErrorAt(pos_ - 1, "not UTF-8");
    uint32_t cp = b & (0x3F >> need);
    for (int i = 0; i < need; ++i) {
      if (done() || (static_cast<uint8_t>(peek()) & 0xC0) != 0x80) return Error("not UTF-8");
      cp = (cp << 6) | (static_cast<uint8_t>(take()) & 0x3F);
    }
    // The shortest form only: an overlong encoding (0xC1 0xBC for '|') is not UTF-8.
    static constexpr uint32_t kLeast[] = {0, 0x80, 0x800, 0x10000};
    if (cp < kLeast[need] || cp > kMaxCodePoint || (cp >= 0xD800 && cp <= 0xDFFF)) {
      return Error("not UTF-8");
    }
    return cp;
  }

  // `digits` hex digits (or {...} when braces and the next is '{').
  Result<uint32_t> Hex(int digits, bool braces) {
    uint32_t v = 0;
    if (braces && eat('{')) {
      int n = 0;
      while (!eat('}')) {
        const int h = HexValue(peek());
        if (done() || h < 0 || ++n > 6) return Error("bad \\x{...} escape");
        take();
        v = v * 16 + static_cast<uint32_t>(h);
      }
      if (n == 0) return Error("bad \\x{...} escape");
    } else {
      for (int i = 0; i < digits; ++i) {
        const int h = HexValue(peek());
        if (done() || h < 0) return Error("expected " + std::to_string(digits) + " hex digits");
        take();
        v = v * 16 + static_cast<uint32_t>(h);
      }
    }
    if (v > kMaxCodePoint || (v >= 0xD800 && v <= 0xDFFF)) {
      return Error("escape is not a Unicode scalar value");
    }
    return v;
  }

  // {m}, {m,}, {m,n}, {,n} after '{' was seen; *max = UINT32_MAX for none.
  Status Counts(uint32_t* min, uint32_t* max) {
    auto number = [&](uint32_t* out) -> bool {
      if (peek() < '0' || peek() > '9' || done()) return false;
      uint64_t v = 0;
      while (!done() && peek() >= '0' && peek() <= '9') {
        v = std::min<uint64_t>(v * 10 + static_cast<uint64_t>(take() - '0'), uint64_t{1} << 40);
      }
      *out = v > kMaxRepeat ? kMaxRepeat + 1 : static_cast<uint32_t>(v);
      return true;
    };
    const size_t at = pos_;
    SkipBlanks();
    const bool has_min = number(min);
    if (!has_min) *min = 0;
    SkipBlanks();
    if (eat(',')) {
      SkipBlanks();
      if (!number(max)) *max = UINT32_MAX;
    } else {
      if (!has_min) return ErrorAt(at, "bad repetition {...}");
      *max = *min;
    }
    SkipBlanks();
    if (!eat('}')) return ErrorAt(at, "bad repetition {...}");
    if (*min > kMaxRepeat || (*max != UINT32_MAX && *max > kMaxRepeat)) {
      return ErrorAt(at, "repetition count above " + std::to_string(kMaxRepeat));
    }
    if (*max < *min) return ErrorAt(at, "repetition {m,n} with n < m");
    return Status::Ok();
  }

  void SkipBlanks() {
    while (!done() && (peek() == ' ' || peek() == '\t')) ++pos_;
  }

 private:
  std::string_view text_;
  bool lines_;
  size_t pos_ = 0;
};

// ---- GBNF ----

bool IsNameChar(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
         c == '-';
}

class GbnfParser {
 public:
  explicit GbnfParser(std::string_view text) : c_(text, /*lines=*/true), b_("grammar") {}

  Result<std::shared_ptr<const JsonGrammar>> Run() {
    Space();
    while (!c_.done()) {
      const size_t at = c_.pos();
      std::string name = Name();
      if (name.empty()) return c_.Error("expected a rule name");
      Space();
      if (c_.text().substr(c_.pos(), 3) != "::=") return c_.Error("expected ::= after " + name);
      c_.set_pos(c_.pos() + 3);
      Space();
      if (rules_.count(name) != 0 && rules_[name].defined) {
        return c_.ErrorAt(at, "rule " + name + " is defined twice");
      }
      FMOE_ASSIGN_OR_RETURN(int32_t ref, RuleRef(name, at));
      FMOE_ASSIGN_OR_RETURN(int32_t body, Alternatives(0));
      rules_[name].defined = true;
      b_.grammar().nodes[ref].target = body;
      Space();
      if (c_.eat(';')) Space();
    }
    auto root = rules_.find("root");
    if (root == rules_.end() || !root->second.defined) {
      return InvalidArgument("grammar: no rule named root");
    }
    for (const auto& [name, rule] : rules_) {
      if (!rule.defined) return c_.ErrorAt(rule.first_use, "no rule named " + name);
    }
    std::vector<std::string> names(b_.grammar().nodes.size());
    for (const auto& [name, rule] : rules_) names[rule.node] = "rule " + name;
    FMOE_RETURN_IF_ERROR(b_.Finish(root->second.node, [&](int32_t node) {
      return names[node].empty() ? std::string("a rule") : names[node];
    }));
    return b_.Take();
  }

 private:
  struct Rule {
    int32_t node = -1;  // Its kRef node.
    bool defined = false;
    size_t first_use = 0;
  };

  // Whitespace, newlines and # comments.
  void Space() {
    while (!c_.done()) {
      const char ch = c_.peek();
      if (ch == ' ' || ch == '\t' || ch == '\n' || ch == '\r') {
        c_.take();
      } else if (ch == '#') {
        while (!c_.done() && c_.peek() != '\n') c_.take();
      } else {
        break;
      }
    }
  }
  std::string Name() {
    std::string out;
    while (!c_.done() && IsNameChar(c_.peek())) out += c_.take();
    return out;
  }
  // At a name followed by ::= (the next rule's start)?
  bool AtRuleStart() {
    const size_t at = c_.pos();
    const bool named = !Name().empty();
    Space();
    const bool yes = named && c_.text().substr(c_.pos(), 3) == "::=";
    c_.set_pos(at);
    return yes;
  }

  Result<int32_t> RuleRef(const std::string& name, size_t at) {
    auto it = rules_.find(name);
    if (it != rules_.end()) return it->second.node;
    if (rules_.size() >= kMaxGrammarRules) {
      return c_.ErrorAt(at, "more than " + std::to_string(kMaxGrammarRules) + " rules");
    }
    FMOE_ASSIGN_OR_RETURN(int32_t ref, b_.Ref());
    rules_[name] = Rule{.node = ref, .first_use = at};
    return ref;
  }

  Result<int32_t> Alternatives(uint32_t depth) {
    if (depth > kMaxGrammarNesting) {
      return c_.Error("parentheses nest deeper than " + std::to_string(kMaxGrammarNesting));
    }
    std::vector<int32_t> alts;
    while (true) {
      FMOE_ASSIGN_OR_RETURN(int32_t seq, Sequence(depth));
      alts.push_back(seq);
      Space();
      if (!c_.eat('|')) break;
      Space();
    }
    // Alternatives that are all literals become one trie: one stack for any number of them.
    std::vector<std::string> texts;
    for (int32_t alt : alts) {
      auto it = literal_text_.find(alt);
      if (it == literal_text_.end()) break;
      texts.push_back(it->second);
    }
    if (alts.size() > 1 && texts.size() == alts.size()) return b_.Literal(texts);
    return b_.Alt(std::move(alts));
  }

  Result<int32_t> Sequence(uint32_t depth) {
    std::vector<int32_t> elems;
    while (true) {
      Space();
      if (c_.done()) break;
      const char ch = c_.peek();
      if (ch == '|' || ch == ')' || ch == ';') break;
      if (IsNameChar(ch) && AtRuleStart()) break;
      FMOE_ASSIGN_OR_RETURN(int32_t elem, Element(depth));
      FMOE_ASSIGN_OR_RETURN(elem, Postfix(elem));
      elems.push_back(elem);
    }
    return b_.Seq(std::move(elems));
  }

  Result<int32_t> Postfix(int32_t elem) {
    while (true) {
      uint32_t min = 0, max = 0;
      if (c_.eat('*')) {
        max = UINT32_MAX;
      } else if (c_.eat('+')) {
        min = 1;
        max = UINT32_MAX;
      } else if (c_.eat('?')) {
        max = 1;
      } else if (c_.eat('{')) {
        FMOE_RETURN_IF_ERROR(c_.Counts(&min, &max));
      } else {
        return elem;
      }
      FMOE_ASSIGN_OR_RETURN(elem, b_.Repeat(elem, min, max));
    }
  }

  // An escape after '\' in a literal or class: the code point.
  Result<uint32_t> Escape() {
    if (c_.done()) return c_.Error("unfinished escape");
    const char e = c_.take();
    switch (e) {
      case 'n':
        return uint32_t{'\n'};
      case 'r':
        return uint32_t{'\r'};
      case 't':
        return uint32_t{'\t'};
      case 'x':
        return c_.Hex(2, false);
      case 'u':
        return c_.Hex(4, false);
      case 'U':
        return c_.Hex(8, false);
      case '\\':
      case '"':
      case '\'':
      case '[':
      case ']':
      case '-':
      case '/':
      case '^':
        return static_cast<uint32_t>(e);
      default:
        return c_.ErrorAt(c_.pos() - 2, std::string("unknown escape \\") + e);
    }
  }

  Result<int32_t> Element(uint32_t depth) {
    const char ch = c_.peek();
    if (ch == '"') {
      c_.take();
      std::string text;
      while (true) {
        if (c_.done()) return c_.Error("unterminated literal");
        if (c_.eat('"')) break;
        uint32_t cp = 0;
        if (c_.eat('\\')) {
          FMOE_ASSIGN_OR_RETURN(cp, Escape());
        } else {
          FMOE_ASSIGN_OR_RETURN(cp, c_.TakeUtf8());
        }
        AppendUtf8(cp, &text);
      }
      if (text.empty()) return b_.Seq({});
      FMOE_ASSIGN_OR_RETURN(int32_t id, b_.Literal({text}));
      literal_text_[id] = std::move(text);
      return id;
    }
    if (ch == '[') {
      c_.take();
      const bool negated = c_.eat('^');
      Ranges ranges;
      while (true) {
        if (c_.done()) return c_.Error("unterminated character class");
        if (c_.eat(']')) break;
        FMOE_ASSIGN_OR_RETURN(uint32_t lo, ClassChar());
        uint32_t hi = lo;
        if (c_.peek() == '-' && c_.peek(1) != ']' && c_.pos() + 1 < c_.text().size()) {
          c_.take();
          FMOE_ASSIGN_OR_RETURN(hi, ClassChar());
          if (hi < lo) return c_.Error("character range is backwards");
        }
        ranges.push_back({lo, hi});
      }
      return b_.Char(negated ? Complement(ranges) : ranges);
    }
    if (ch == '.') {
      c_.take();
      return b_.Char({{0, kMaxCodePoint}});
    }
    if (ch == '<') return TokenTerminal();
    if (ch == '!') {
      return c_.Error("a negated token (!<[id]>) is not supported; write the text it may be");
    }
    if (ch == '(') {
      c_.take();
      Space();
      FMOE_ASSIGN_OR_RETURN(int32_t inner, Alternatives(depth + 1));
      Space();
      if (!c_.eat(')')) return c_.Error("expected )");
      return inner;
    }
    if (IsNameChar(ch)) {
      const size_t at = c_.pos();
      return RuleRef(Name(), at);
    }
    return c_.Error(std::string("unexpected '") + ch + "'");
  }

  Result<uint32_t> ClassChar() {
    if (c_.eat('\\')) return Escape();
    return c_.TakeUtf8();
  }

  // llama.cpp's <[id]>: the token of that id itself (a special token such as gpt-oss's
  // <|message|>), which no text matches, not even its own spelling in other tokens.
  Result<int32_t> TokenTerminal() {
    const size_t at = c_.pos();
    c_.take();  // '<'
    if (!c_.eat('[')) {
      return c_.ErrorAt(at, "a token is written <[id]> (its id); <text> is not supported");
    }
    uint64_t id = 0;
    size_t digits = 0;
    while (!c_.done() && c_.peek() >= '0' && c_.peek() <= '9') {
      id = id * 10 + static_cast<uint64_t>(c_.take() - '0');
      if (++digits > 10) break;
    }
    if (digits == 0 || digits > 10 || !c_.eat(']') || !c_.eat('>')) {
      return c_.ErrorAt(at, "a token is written <[id]>, its id in decimal");
    }
    if (id > static_cast<uint64_t>(kMaxTokenTerminal)) {
      return c_.ErrorAt(at, "token id " + std::to_string(id) + " is out of range");
    }
    return b_.Token(static_cast<int32_t>(id));
  }

  Cursor c_;
  Builder b_;
  std::map<std::string, Rule> rules_;
  std::map<int32_t, std::string> literal_text_;  // Literal nodes of one text: that text.
};

// ---- Regex ----

class RegexParser {
 public:
  explicit RegexParser(std::string_view text) : c_(text, /*lines=*/false), b_("regex") {}

  Result<std::shared_ptr<const JsonGrammar>> Run() {
    c_.eat('^');
    FMOE_ASSIGN_OR_RETURN(int32_t root, Alternatives(0));
    if (!c_.done()) return c_.Error("unbalanced )");
    FMOE_RETURN_IF_ERROR(b_.Finish(root, [](int32_t) { return std::string("the pattern"); }));
    return b_.Take();
  }

 private:
  Result<int32_t> Alternatives(uint32_t depth) {
    if (depth > kMaxGrammarNesting) {
      return c_.Error("groups nest deeper than " + std::to_string(kMaxGrammarNesting));
    }
    std::vector<int32_t> alts;
    while (true) {
      FMOE_ASSIGN_OR_RETURN(int32_t seq, Sequence(depth));
      alts.push_back(seq);
      if (!c_.eat('|')) break;
    }
    return b_.Alt(std::move(alts));
  }

  Result<int32_t> Sequence(uint32_t depth) {
    std::vector<int32_t> elems;
    while (!c_.done() && c_.peek() != '|' && c_.peek() != ')') {
      if (c_.peek() == '$') {
        // Only at the very end (of the pattern, or of a top-level alternative).
        if (c_.pos() + 1 == c_.text().size() || (depth == 0 && c_.peek(1) == '|')) {
          c_.take();
          continue;
        }
        return c_.Error("$ is only supported at the end");
      }
      if (c_.peek() == '^') return c_.Error("^ is only supported at the start");
      FMOE_ASSIGN_OR_RETURN(int32_t atom, Atom(depth));
      FMOE_ASSIGN_OR_RETURN(atom, Quantifiers(atom));
      elems.push_back(atom);
    }
    return b_.Seq(std::move(elems));
  }

  Result<int32_t> Quantifiers(int32_t atom) {
    bool quantified = false;
    while (true) {
      uint32_t min = 0, max = 0;
      const size_t at = c_.pos();
      if (c_.eat('*')) {
        max = UINT32_MAX;
      } else if (c_.eat('+')) {
        min = 1;
        max = UINT32_MAX;
      } else if (c_.eat('?')) {
        max = 1;
      } else if (c_.peek() == '{' && IsCounts()) {
        c_.take();
        FMOE_RETURN_IF_ERROR(c_.Counts(&min, &max));
      } else {
        return atom;
      }
      if (quantified) return c_.ErrorAt(at, "a quantifier cannot follow a quantifier");
      quantified = true;
      if (c_.eat('?')) {  // Lazy: the same language.
      } else if (c_.peek() == '+') {
        return c_.Error("possessive quantifiers are not supported");
      }
      FMOE_ASSIGN_OR_RETURN(atom, b_.Repeat(atom, min, max));
    }
  }

  // '{' starts a repetition (else it is a literal, as in Python).
  bool IsCounts() const {
    size_t i = c_.pos() + 1;
    const std::string_view t = c_.text();
    bool digit = false;
    while (i < t.size() && ((t[i] >= '0' && t[i] <= '9') || t[i] == ',')) {
      digit = digit || t[i] != ',';
      ++i;
    }
    return digit && i < t.size() && t[i] == '}';
  }

  Result<int32_t> Atom(uint32_t depth) {
    const size_t at = c_.pos();
    const char ch = c_.take();
    switch (ch) {
      case '(': {
        if (c_.eat('?')) {
          if (c_.eat(':')) {
          } else if (c_.peek() == '=' || c_.peek() == '!' ||
                     (c_.peek() == '<' && (c_.peek(1) == '=' || c_.peek(1) == '!'))) {
            return c_.ErrorAt(at, "lookaround is not supported");
          } else if (c_.eat('P') || c_.peek() == '<') {
            if (c_.peek() == '=') return c_.ErrorAt(at, "backreferences are not supported");
            if (!c_.eat('<')) return c_.ErrorAt(at, "unsupported group (?P");
            while (!c_.done() && c_.peek() != '>') c_.take();
            if (!c_.eat('>')) return c_.ErrorAt(at, "unterminated group name");
          } else {
            return c_.ErrorAt(at,
                              "inline flags and (?...) groups other than (?: ), (?P<name> ) "
                              "and (?<name> ) are not supported");
          }
        }
        FMOE_ASSIGN_OR_RETURN(int32_t inner, Alternatives(depth + 1));
        if (!c_.eat(')')) return c_.Error("missing )");
        return inner;
      }
      case '[':
        return Class();
      case '.':
        return b_.Char(Complement({{'\n', '\n'}}));
      case '*':
      case '+':
      case '?':
        return c_.ErrorAt(at, std::string("nothing to repeat before '") + ch + "'");
      case '\\': {
        FMOE_ASSIGN_OR_RETURN(Ranges r, EscapeClass(/*in_class=*/false));
        return b_.Char(std::move(r));
      }
      default: {
        c_.set_pos(at);
        FMOE_ASSIGN_OR_RETURN(uint32_t cp, c_.TakeUtf8());
        return b_.Char({{cp, cp}});
      }
    }
  }

  // After '\': the characters the escape stands for.
  Result<Ranges> EscapeClass(bool in_class) {
    const size_t at = c_.pos() - 1;
    if (c_.done()) return c_.Error("unfinished escape");
    const char e = c_.take();
    static const Ranges kDigit = {{'0', '9'}};
    static const Ranges kWord = {{'0', '9'}, {'A', 'Z'}, {'_', '_'}, {'a', 'z'}};
    static const Ranges kSpace = {{'\t', '\r'}, {' ', ' '}};
    auto one = [](uint32_t cp) { return Ranges{{cp, cp}}; };
    switch (e) {
      case 'd':
        return kDigit;
      case 'D':
        return Complement(kDigit);
      case 'w':
        return kWord;
      case 'W':
        return Complement(kWord);
      case 's':
        return kSpace;
      case 'S':
        return Complement(kSpace);
      case 'n':
        return one('\n');
      case 't':
        return one('\t');
      case 'r':
        return one('\r');
      case 'f':
        return one('\f');
      case 'v':
        return one('\v');
      case '0':
        return one(0);
      case 'x': {
        FMOE_ASSIGN_OR_RETURN(uint32_t cp, c_.Hex(2, true));
        return one(cp);
      }
      case 'u': {
        FMOE_ASSIGN_OR_RETURN(uint32_t cp, c_.Hex(4, true));
        return one(cp);
      }
      case 'b':
        if (in_class) return one('\b');
        [[fallthrough]];
      case 'B':
      case 'A':
      case 'z':
      case 'Z':
      case 'G':
        return c_.ErrorAt(at,
                          std::string("\\") + e + " (an anchor or word boundary) is not supported");
      case 'p':
      case 'P':
        return c_.ErrorAt(at,
                          std::string("\\") + e + "{...} (Unicode properties) is not supported");
      case 'k':
        return c_.ErrorAt(at, "backreferences are not supported");
      default:
        if (e >= '1' && e <= '9') return c_.ErrorAt(at, "backreferences are not supported");
        if ((e >= 'a' && e <= 'z') || (e >= 'A' && e <= 'Z')) {
          return c_.ErrorAt(at, std::string("unknown escape \\") + e);
        }
        if (static_cast<uint8_t>(e) >= 0x80) {
          c_.set_pos(c_.pos() - 1);
          FMOE_ASSIGN_OR_RETURN(uint32_t cp, c_.TakeUtf8());
          return one(cp);
        }
        return one(static_cast<uint8_t>(e));
    }
  }

  Result<int32_t> Class() {
    const size_t at = c_.pos() - 1;
    const bool negated = c_.eat('^');
    Ranges ranges;
    bool first = true;
    while (true) {
      if (c_.done()) return c_.ErrorAt(at, "unterminated character class");
      if (c_.peek() == ']' && !first) {
        c_.take();
        break;
      }
      first = false;
      if (c_.peek() == '[' && c_.peek(1) == ':') {
        return c_.Error("POSIX classes [:...:] are not supported");
      }
      std::optional<uint32_t> lo;
      if (c_.eat('\\')) {
        FMOE_ASSIGN_OR_RETURN(Ranges r, EscapeClass(/*in_class=*/true));
        if (r.size() == 1 && r[0].first == r[0].second) {
          lo = r[0].first;
        } else {
          ranges.insert(ranges.end(), r.begin(), r.end());
          continue;
        }
      } else {
        FMOE_ASSIGN_OR_RETURN(uint32_t cp, c_.TakeUtf8());
        lo = cp;
      }
      uint32_t hi = *lo;
      if (c_.peek() == '-' && c_.pos() + 1 < c_.text().size() && c_.peek(1) != ']') {
        c_.take();
        if (c_.eat('\\')) {
          FMOE_ASSIGN_OR_RETURN(Ranges r, EscapeClass(/*in_class=*/true));
          if (r.size() != 1 || r[0].first != r[0].second) {
            return c_.Error("a range cannot end in a class escape");
          }
          hi = r[0].first;
        } else {
          FMOE_ASSIGN_OR_RETURN(hi, c_.TakeUtf8());
        }
        if (hi < *lo) return c_.Error("character range is backwards");
      }
      ranges.push_back({*lo, hi});
    }
    return b_.Char(negated ? Complement(ranges) : ranges);
  }

  Cursor c_;
  Builder b_;
};

void AppendGbnfLiteral(std::string_view text, std::string* out) {
  static constexpr char kHex[] = "0123456789ABCDEF";
  *out += '"';
  for (char c : text) {
    const auto b = static_cast<uint8_t>(c);
    if (c == '"' || c == '\\') {
      *out += '\\';
      *out += c;
    } else if (b < 0x20 || b == 0x7F) {
      *out += "\\x";
      *out += kHex[b >> 4];
      *out += kHex[b & 15];
    } else {
      *out += c;
    }
  }
  *out += '"';
}

// A structural tag: the free text is an Aho-Corasick automaton over the triggers' code points,
// one node per state (a kRef, filled once every state has one): the text may end, or a
// character moves to the next state; the character that completes a trigger moves to the
// dispatch of that trigger's structures, each ending back in the first state.
class StructuralTagCompiler {
 public:
  explicit StructuralTagCompiler(const nlohmann::json& spec) : spec_(spec) {}

  Result<std::shared_ptr<const JsonGrammar>> Run() {
    if (!spec_.is_object()) return Error("", "must be a JSON object");
    FMOE_RETURN_IF_ERROR(ReadFlag("at_least_one", &at_least_one_));
    FMOE_RETURN_IF_ERROR(ReadFlag("stop_after_first", &stop_after_first_));
    FMOE_RETURN_IF_ERROR(ReadTokenIds());
    FMOE_RETURN_IF_ERROR(ReadTriggers());
    FMOE_RETURN_IF_ERROR(ReadStructures());
    BuildAutomaton();
    FMOE_ASSIGN_OR_RETURN(int32_t root, BuildNodes());
    FMOE_RETURN_IF_ERROR(
        b_.Finish(root, [](int32_t node) { return "grammar node " + std::to_string(node); }));
    return b_.Take();
  }

 private:
  struct Structure {
    std::string begin, end;
    size_t trigger = 0;  // The trigger its begin starts with.
    int32_t schema = -1;
  };
  struct State {
    std::map<uint32_t, int32_t> next;  // Trie edges by code point.
    int32_t fail = 0;
    int32_t trigger = -1;  // The trigger that ends here.
  };

  static Result<std::vector<uint32_t>> CodePoints(const std::string& text) {
    std::vector<uint32_t> out;
    Cursor c(text, /*lines=*/false);
    while (!c.done()) {
      FMOE_ASSIGN_OR_RETURN(uint32_t cp, c.TakeUtf8());
      out.push_back(cp);
    }
    return out;
  }

  static Status Error(const std::string& member, const std::string& what) {
    return InvalidArgument("structural tag" + (member.empty() ? "" : " " + member) + ": " + what);
  }

  // A text member of `object`, UTF-8, at most kMaxTagTextBytes.
  Result<std::string> Text(const nlohmann::json& object, const char* key, const std::string& where,
                           bool allow_empty) {
    auto it = object.find(key);
    if (it == object.end() || !it->is_string()) {
      return Error(where + "." + key, it == object.end() ? "is missing" : "must be a string");
    }
    const std::string& text = it->get_ref<const std::string&>();
    return CheckText(text, where + "." + key, allow_empty);
  }
  static Result<std::string> CheckText(const std::string& text, const std::string& where,
                                       bool allow_empty) {
    if (text.empty() && !allow_empty) return Error(where, "is empty");
    if (text.size() > kMaxTagTextBytes) {
      return Error(where, "is longer than " + std::to_string(kMaxTagTextBytes) + " bytes");
    }
    if (!CodePoints(text).ok()) return Error(where, "is not valid UTF-8");
    return text;
  }

  Status ReadFlag(const char* key, bool* out) {
    auto it = spec_.find(key);
    if (it == spec_.end()) return Status::Ok();
    if (!it->is_boolean()) return Error(key, "must be true or false");
    *out = it->get<bool>();
    return Status::Ok();
  }

  Status ReadTokenIds() {
    auto it = spec_.find("token_ids");
    if (it == spec_.end()) return Status::Ok();
    if (!it->is_object()) return Error("token_ids", "must be an object of texts to token ids");
    if (it->size() > kMaxTagTokens) {
      return Error("token_ids", "has more than " + std::to_string(kMaxTagTokens) + " tokens");
    }
    for (auto t = it->begin(); t != it->end(); ++t) {
      const std::string where = "token_ids[\"" + t.key() + "\"]";
      FMOE_ASSIGN_OR_RETURN(std::string text, CheckText(t.key(), where, /*allow_empty=*/false));
      if (!t->is_number_integer() || t->get<int64_t>() < 0 ||
          t->get<int64_t>() > kMaxTokenTerminal) {
        return Error(where, "must be a token id (an integer from 0 to " +
                                std::to_string(kMaxTokenTerminal) + ")");
      }
      tokens_.emplace_back(std::move(text), static_cast<int32_t>(t->get<int64_t>()));
    }
    return Status::Ok();
  }

  // `text` cut where token_ids' texts are (the longest at each place, leftmost first): texts
  // and tokens in order.
  struct Part {
    std::string text;
    int32_t token = -1;
  };
  std::vector<Part> Split(std::string_view text) const {
    std::vector<Part> parts;
    size_t from = 0;
    for (size_t at = 0; at < text.size();) {
      const std::pair<std::string, int32_t>* best = nullptr;
      for (const auto& t : tokens_) {
        if (text.substr(at).starts_with(t.first) &&
            (best == nullptr || t.first.size() > best->first.size())) {
          best = &t;
        }
      }
      if (best == nullptr) {
        ++at;
        continue;
      }
      if (at > from) parts.push_back({std::string(text.substr(from, at - from))});
      parts.push_back({"", best->second});
      at += best->first.size();
      from = at;
    }
    if (from < text.size()) parts.push_back({std::string(text.substr(from))});
    return parts;
  }
  // The node of a begin or end text: its literals and token terminals in a row.
  Result<int32_t> TextNode(std::string_view text) {
    std::vector<int32_t> seq;
    for (const Part& p : Split(text)) {
      FMOE_ASSIGN_OR_RETURN(int32_t n, p.token >= 0 ? b_.Token(p.token) : b_.Literal({p.text}));
      seq.push_back(n);
    }
    return b_.Seq(std::move(seq));
  }

  Status ReadTriggers() {
    auto it = spec_.find("triggers");
    if (it == spec_.end() || !it->is_array() || it->empty()) {
      return Error("triggers", "must be a non-empty array of strings");
    }
    if (it->size() > kMaxTagTriggers) {
      return Error("triggers", "has more than " + std::to_string(kMaxTagTriggers) + " strings");
    }
    for (size_t i = 0; i < it->size(); ++i) {
      const std::string where = "triggers[" + std::to_string(i) + "]";
      if (!(*it)[i].is_string()) return Error(where, "must be a string");
      FMOE_ASSIGN_OR_RETURN(std::string t,
                            CheckText((*it)[i].get<std::string>(), where, /*allow_empty=*/false));
      for (const auto& [token, id] : tokens_) {
        if (t.find(token) != std::string::npos) {
          return Error(where, "holds the token \"" + token + "\" (token_ids): a trigger is text");
        }
      }
      triggers_.push_back(std::move(t));
    }
    for (size_t i = 0; i < triggers_.size(); ++i) {
      for (size_t j = 0; j < triggers_.size(); ++j) {
        if (i == j || triggers_[i].find(triggers_[j]) == std::string::npos) continue;
        if (triggers_[i] == triggers_[j]) {
          return Error("triggers[" + std::to_string(std::max(i, j)) + "]",
                       "repeats triggers[" + std::to_string(std::min(i, j)) + "]");
        }
        return Error("triggers[" + std::to_string(i) + "]",
                     "contains triggers[" + std::to_string(j) + "] (\"" + triggers_[j] +
                         "\"): a trigger may not contain another");
      }
    }
    return Status::Ok();
  }

  Status ReadStructures() {
    auto it = spec_.find("structures");
    if (it == spec_.end() || !it->is_array() || it->empty()) {
      return Error("structures", "must be a non-empty array of objects");
    }
    if (it->size() > kMaxTagStructures) {
      return Error("structures",
                   "has more than " + std::to_string(kMaxTagStructures) + " structures");
    }
    for (size_t i = 0; i < it->size(); ++i) {
      const std::string where = "structures[" + std::to_string(i) + "]";
      const nlohmann::json& s = (*it)[i];
      if (!s.is_object()) return Error(where, "must be an object");
      Structure st;
      FMOE_ASSIGN_OR_RETURN(st.begin, Text(s, "begin", where, /*allow_empty=*/false));
      FMOE_ASSIGN_OR_RETURN(st.end, Text(s, "end", where, /*allow_empty=*/true));
      const auto trigger = std::find_if(triggers_.begin(), triggers_.end(),
                                        [&](const auto& t) { return st.begin.starts_with(t); });
      if (trigger == triggers_.end()) {
        return Error(where + ".begin", "does not start with any of the triggers");
      }
      st.trigger = static_cast<size_t>(trigger - triggers_.begin());
      if (!tokens_.empty()) {
        const Part first = Split(st.begin).front();
        if (first.token >= 0 || !first.text.starts_with(*trigger)) {
          return Error(where + ".begin", "has a token (token_ids) within its trigger");
        }
      }
      auto schema = s.find("schema");
      if (schema == s.end()) return Error(where + ".schema", "is missing");
      if (!schema->is_object() && !schema->is_boolean()) {
        return Error(where + ".schema", "must be a JSON Schema object");
      }
      auto compiled = CompileJsonSchemaValue(*schema);
      if (!compiled.ok()) return Error(where + ".schema", compiled.status().message());
      FMOE_ASSIGN_OR_RETURN(st.schema, b_.Import(**compiled));
      structures_.push_back(std::move(st));
    }
    return Status::Ok();
  }

  // The trie of the triggers' code points, its failure links, and each state's moves.
  void BuildAutomaton() {
    states_.emplace_back();
    for (size_t t = 0; t < triggers_.size(); ++t) {
      int32_t at = 0;
      const std::vector<uint32_t> cps = *CodePoints(triggers_[t]);  // Checked by CheckText.
      for (const uint32_t cp : cps) {
        auto [edge, fresh] = states_[at].next.try_emplace(cp, static_cast<int32_t>(states_.size()));
        if (fresh) states_.emplace_back();
        at = edge->second;
      }
      if (states_[at].trigger < 0) states_[at].trigger = static_cast<int32_t>(t);
    }
    // Breadth first: a state's failure is the longest proper suffix of its text in the trie.
    std::vector<int32_t> order{0};
    for (size_t k = 0; k < order.size(); ++k) {
      const int32_t s = order[k];
      for (const auto& [cp, child] : states_[s].next) {
        states_[child].fail = s == 0 ? 0 : Move(states_[s].fail, cp);
        order.push_back(child);
      }
    }
  }
  // The state after `cp` in `s` (the root when no suffix of the text goes on with it).
  int32_t Move(int32_t s, uint32_t cp) const {
    for (;;) {
      if (auto it = states_[s].next.find(cp); it != states_[s].next.end()) return it->second;
      if (s == 0) return 0;
      s = states_[s].fail;
    }
  }

  Result<int32_t> BuildNodes() {
    // Node of each state (a kRef filled below); trigger states have none: they dispatch.
    std::vector<int32_t> node(states_.size(), -1);
    for (size_t s = 0; s < states_.size(); ++s) {
      if (states_[s].trigger < 0) {
        FMOE_ASSIGN_OR_RETURN(node[s], b_.Ref());
      }
    }
    // After a structure: free text again, or (stop_after_first) the end of the output.
    FMOE_ASSIGN_OR_RETURN(const int32_t nothing, b_.Seq({}));
    const int32_t after = stop_after_first_ ? nothing : node[0];
    // Each trigger's dispatch: one of its structures, then what comes after one.
    std::vector<int32_t> dispatch(triggers_.size(), -1);
    for (size_t t = 0; t < triggers_.size(); ++t) {
      std::vector<int32_t> alts;
      for (const Structure& st : structures_) {
        if (st.trigger != t) continue;
        std::vector<int32_t> seq;
        if (st.begin.size() > triggers_[t].size()) {
          FMOE_ASSIGN_OR_RETURN(int32_t rest, TextNode(st.begin.substr(triggers_[t].size())));
          seq.push_back(rest);
        }
        seq.push_back(st.schema);
        if (!st.end.empty()) {
          FMOE_ASSIGN_OR_RETURN(int32_t end, TextNode(st.end));
          seq.push_back(end);
        }
        seq.push_back(after);
        FMOE_ASSIGN_OR_RETURN(int32_t one, b_.Seq(std::move(seq)));
        alts.push_back(one);
      }
      if (alts.empty()) {
        return Error("triggers[" + std::to_string(t) + "]", "starts none of the structures");
      }
      FMOE_ASSIGN_OR_RETURN(dispatch[t], b_.Alt(std::move(alts)));
    }
    for (size_t s = 0; s < states_.size(); ++s) {
      if (states_[s].trigger >= 0) continue;
      // The characters that move somewhere other than the root: the edges of the state and of
      // its failure chain.
      std::map<uint32_t, int32_t> moves;
      for (int32_t f = static_cast<int32_t>(s);; f = states_[f].fail) {
        for (const auto& [cp, child] : states_[f].next) moves.try_emplace(cp, child);
        if (f == 0) break;
      }
      FMOE_ASSIGN_OR_RETURN(int32_t empty, b_.Seq({}));
      std::vector<int32_t> alts{empty};
      Ranges taken;
      for (const auto& [cp, to] : moves) {
        taken.push_back({cp, cp});
        FMOE_ASSIGN_OR_RETURN(int32_t ch, b_.Char({{cp, cp}}));
        const int32_t then = states_[to].trigger >= 0 ? dispatch[states_[to].trigger] : node[to];
        FMOE_ASSIGN_OR_RETURN(int32_t step, b_.Seq({ch, then}));
        alts.push_back(step);
      }
      FMOE_ASSIGN_OR_RETURN(int32_t other, b_.Char(Complement(taken)));
      FMOE_ASSIGN_OR_RETURN(int32_t back, b_.Seq({other, node[0]}));
      alts.push_back(back);
      FMOE_ASSIGN_OR_RETURN(int32_t any, b_.Alt(std::move(alts)));
      b_.grammar().nodes[node[s]].target = any;
    }
    if (!at_least_one_) return node[0];
    // at_least_one: the output opens with one of the structures (its whole begin), and the
    // free text with triggers follows it (ending after its next structure with
    // stop_after_first), as xgrammar's triggered tags do.
    std::vector<int32_t> first;
    for (const Structure& st : structures_) {
      std::vector<int32_t> seq;
      FMOE_ASSIGN_OR_RETURN(int32_t begin, TextNode(st.begin));
      seq.push_back(begin);
      seq.push_back(st.schema);
      if (!st.end.empty()) {
        FMOE_ASSIGN_OR_RETURN(int32_t end, TextNode(st.end));
        seq.push_back(end);
      }
      seq.push_back(node[0]);
      FMOE_ASSIGN_OR_RETURN(int32_t one, b_.Seq(std::move(seq)));
      first.push_back(one);
    }
    return b_.Alt(std::move(first));
  }
  const nlohmann::json& spec_;
  bool at_least_one_ = false;
  bool stop_after_first_ = false;
  Builder b_{"structural tag"};
  std::vector<std::string> triggers_;
  std::vector<std::pair<std::string, int32_t>> tokens_;  // token_ids: text, id.
  std::vector<Structure> structures_;
  std::vector<State> states_;
};

}  // namespace

Result<std::shared_ptr<const JsonGrammar>> CompileGrammar(std::string_view gbnf) {
  if (gbnf.size() > kMaxGrammarBytes) {
    return InvalidArgument("grammar: larger than " + std::to_string(kMaxGrammarBytes) + " bytes");
  }
  try {
    return GbnfParser(gbnf).Run();
  } catch (const std::exception& e) {  // std::bad_alloc.
    return InvalidArgument(std::string("grammar: ") + e.what());
  }
}

Result<std::shared_ptr<const JsonGrammar>> CompileRegex(std::string_view regex) {
  if (regex.size() > kMaxRegexBytes) {
    return InvalidArgument("regex: longer than " + std::to_string(kMaxRegexBytes) + " bytes");
  }
  try {
    return RegexParser(regex).Run();
  } catch (const std::exception& e) {
    return InvalidArgument(std::string("regex: ") + e.what());
  }
}

Result<std::shared_ptr<const JsonGrammar>> CompileChoice(const std::vector<std::string>& choices) {
  if (choices.empty()) return InvalidArgument("choice: no strings to choose from");
  if (choices.size() > kMaxGuidedChoices) {
    return InvalidArgument("choice: more than " + std::to_string(kMaxGuidedChoices) + " strings");
  }
  size_t bytes = 0;
  for (const std::string& c : choices) bytes += c.size();
  if (bytes > kMaxGuidedChoiceBytes) {
    return InvalidArgument("choice: the strings exceed " + std::to_string(kMaxGuidedChoiceBytes) +
                           " bytes");
  }
  return CompileGrammar(ChoiceGrammar(choices));
}

Result<std::shared_ptr<const JsonGrammar>> CompileStructuralTag(std::string_view spec_json) {
  if (spec_json.size() > kMaxSchemaBytes) {
    return InvalidArgument("structural tag: larger than " + std::to_string(kMaxSchemaBytes) +
                           " bytes");
  }
  const nlohmann::json spec = nlohmann::json::parse(spec_json, nullptr, /*allow_exceptions=*/false);
  if (spec.is_discarded()) return InvalidArgument("structural tag: not valid JSON");
  try {
    return StructuralTagCompiler(spec).Run();
  } catch (const std::exception& e) {  // std::bad_alloc.
    return InvalidArgument(std::string("structural tag: ") + e.what());
  }
}

std::string ChoiceGrammar(const std::vector<std::string>& choices) {
  std::string out = "root ::= ";
  for (size_t i = 0; i < choices.size(); ++i) {
    if (i > 0) out += " | ";
    AppendGbnfLiteral(choices[i], &out);
  }
  out += '\n';
  return out;
}

}  // namespace fmoe
