// The template language: the part of Jinja2 3.1 that public chat templates use, in the
// environment Hugging Face sets up (ImmutableSandboxedEnvironment(trim_blocks=True,
// lstrip_blocks=True) with loop controls). This file holds the lexer and the recursive-descent
// parser that builds the tree of chat_template_tree.h; chat_template_render.cc walks it.
//
// Statements: text, {{ e }}, {# comment #}, whitespace control ({%- -%} {{- -}} {#- -#}, and
//   {%+ +%} to keep what lstrip/trim would drop), {% if %}{% elif %}{% else %}{% endif %},
//   {% for x[, y] in e [if c] %}...{% else %}...{% endfor %} with loop.index, index0, revindex,
//   revindex0, first, last, length, previtem, nextitem, {% break %} and {% continue %},
//   {% set x = e %} and {% set ns.attr = e %}, {% macro name(a, b=default) %}...{% endmacro %}
//   (called with positional or keyword arguments, recursion bounded; the body sees its arguments
//   and the template's top level). Scoped as in Jinja: a set inside a loop body or a macro lasts
//   for that iteration or call (namespace() carries state out of loops).
// Expressions: string (Python escapes), integer, float, true/false/none (either case), list, dict
//   and tuple literals; names, .attr, [i], [a:b:c], calls; + - * / // % ~; == != < <= > >=
//   (chained), in, not in; and, or, not; a if c else b; | filter; is [not] test.
// Values behave as in Python: str() of None, True, floats, lists; floor division and modulo; and
//   Jinja's Undefined prints as "", is false and iterates as empty, while using it as an operand
//   or looking inside it is an error.
// Filters: trim length count upper lower default/d string join list first last, and tojson as
//   transformers defines it (ensure_ascii, indent, separators, sort_keys).
//   Tests: defined undefined none string number integer float boolean true false mapping
//   sequence iterable even odd. Functions: raise_exception(msg), namespace(...), range(...),
//   strftime_now(format) (C strftime of the local time, from ChatTemplateOptions::clock).
//   Methods: str.strip lstrip rstrip startswith endswith split upper lower replace; dict.get
//   items keys values.
// Not supported: call blocks, macros' caller/varargs/kwargs, {% set %}...{% endset %}, {% raw %},
//   {% filter %}, include/extends/import, recursive loops, loop.cycle, tests with arguments, other
//   filters (map, selectattr, ...), the ** operator, string % formatting, case mapping beyond
//   ASCII, subscripts with commas, printing dict views (keys() is a list), HF's {% generation %},
//   and strftime_now's %f and %z/%Z as Python's naive datetime writes them (C's are used). Names
//   resolve when used: a loop that reads a variable which the template sets only later at top
//   level sees the caller's value, where Jinja sees it undefined.
#include "common/text/chat_template.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <exception>
#include <set>
#include <utility>

#include "common/text/chat_template_tree.h"
#include "common/text/unicode.h"

namespace fmoe {
namespace jinja {
namespace {

constexpr int kMaxExprDepth = 256;  // Deepest expression tree (long operator chains included).
constexpr int kMaxNesting = 64;     // Deepest nesting of brackets, and of blocks.

// ---- lexer ----

class SourceMap {
 public:
  explicit SourceMap(const std::string& src) : src_(src) {
    for (size_t i = 0; i < src.size(); ++i) {
      if (src[i] == '\n') line_starts_.push_back(i + 1);
    }
  }
  int Line(size_t pos) const {
    return static_cast<int>(std::upper_bound(line_starts_.begin(), line_starts_.end(), pos) -
                            line_starts_.begin());
  }
  // "chat template: line 3, column 8: <what>" (columns count characters from 1).
  [[noreturn]] void Fail(size_t pos, const std::string& what) const {
    const int line = Line(pos);
    const size_t start = line_starts_[line - 1];
    const size_t column = CharOffsets(std::string_view(src_).substr(start, pos - start)).size();
    Throw(ErrorCode::kInvalidArgument, "chat template: line " + std::to_string(line) + ", column " +
                                           std::to_string(column) + ": " + what);
  }

 private:
  const std::string& src_;
  std::vector<size_t> line_starts_ = {0};
};

enum class Tok { kText, kVarBegin, kVarEnd, kBlockBegin, kBlockEnd, kName, kLiteral, kOp, kEnd };

struct Token {
  Token(Tok type, size_t pos, std::string text = {}, Value value = {})
      : type(type), pos(pos), text(std::move(text)), value(std::move(value)) {}
  Tok type;
  size_t pos;        // Byte offset in the (newline-normalized) source.
  std::string text;  // kText: the text; kName, kOp: the spelling.
  Value value;       // kLiteral: a string or a number.
};

std::string Describe(const Token& t) {
  static constexpr const char* kNames[] = {"text",  "'{{'",  "'}}'",  "'{%'",           "'%}'",
                                           nullptr, nullptr, nullptr, "end of template"};
  if (t.type == Tok::kName || t.type == Tok::kOp) return "'" + t.text + "'";
  if (t.type == Tok::kLiteral) return t.value.type == Type::kString ? "a string" : "a number";
  return kNames[static_cast<int>(t.type)];
}

bool IsDigit(char c) { return c >= '0' && c <= '9'; }
bool IsNameChar(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; }

// Jinja's lexer with trim_blocks and lstrip_blocks: the text between tags, and the tokens in them.
class Lexer {
 public:
  Lexer(const std::string& src, const SourceMap& map) : src_(src), map_(map) {}

  std::vector<Token> Run() {
    size_t pos = 0;
    bool line_starting = true;  // The last tag ended its line (or no tag came yet).
    while (pos < src_.size()) {
      size_t tag = src_.find('{', pos);
      while (tag != std::string::npos && (tag + 1 == src_.size() || !IsTagOpen(src_[tag + 1]))) {
        tag = src_.find('{', tag + 1);
      }
      std::string text = src_.substr(pos, tag == std::string::npos ? tag : tag - pos);
      const char kind = tag == std::string::npos ? 0 : src_[tag + 1];
      const char sign = kind && tag + 2 < src_.size() ? src_[tag + 2] : 0;
      if (sign == '-') {  // Drop the whitespace before the tag.
        const std::vector<size_t> at = CharOffsets(text);
        size_t end = at.size() - 1;
        while (end > 0 && IsPySpace(CharAt(text, at[end - 1]))) --end;
        text.resize(at[end]);
      } else if (kind && kind != '{' && sign != '+') {
        // lstrip_blocks: drop the spaces and tabs between the line's start and the tag.
        size_t line_start = text.rfind('\n') + 1;  // npos + 1 is 0.
        if ((line_start > 0 || line_starting) &&
            text.find_first_not_of(" \t", line_start) == std::string::npos) {
          text.resize(line_start);
        }
      }
      if (!text.empty()) tokens_.push_back({Tok::kText, pos, std::move(text)});
      if (!kind) break;
      pos = tag + (sign == '-' || sign == '+' ? 3 : 2);
      if (kind == '#') {
        const size_t end = src_.find("#}", pos);
        if (end == std::string::npos) map_.Fail(tag, "the comment is not closed; expected '#}'");
        pos = AfterTag(end + 2, end > pos ? src_[end - 1] : 0, true);
      } else {
        tokens_.push_back({kind == '{' ? Tok::kVarBegin : Tok::kBlockBegin, tag});
        pos = LexTag(pos, tag, kind == '%');
      }
      line_starting = src_[pos - 1] == '\n';
    }
    tokens_.push_back({Tok::kEnd, src_.size()});
    return std::move(tokens_);
  }

 private:
  static bool IsTagOpen(char c) { return c == '{' || c == '%' || c == '#'; }

  size_t SkipSpace(size_t pos) const {
    while (pos < src_.size() && IsPySpace(CharAt(src_, pos))) {
      pos += CharLength(src_, pos);
    }
    return pos;
  }

  // After a tag's end at `pos`: with '-' the whitespace that follows goes, with '+' nothing, and
  // otherwise a block's or comment's newline (trim_blocks).
  size_t AfterTag(size_t pos, char sign, bool trim) const {
    if (sign == '-') return SkipSpace(pos);
    return pos + (sign != '+' && trim && pos < src_.size() && src_[pos] == '\n');
  }

  // The tokens of the tag opened at `open`, from `pos`; returns the position after the tag.
  size_t LexTag(size_t pos, size_t open, bool block) {
    const std::string_view end = block ? "%}" : "}}";
    std::string closers;  // Of the open brackets; inside them an end is two operators.
    while (true) {
      pos = SkipSpace(pos);
      if (pos >= src_.size()) {
        map_.Fail(open, "the tag is not closed; expected '" + std::string(end) + "'");
      }
      const std::string_view rest = std::string_view(src_).substr(pos);
      const char c = rest[0];
      const char sign = c == '-' || (block && c == '+') ? c : 0;
      if (closers.empty() && rest.substr(sign ? 1 : 0, 2) == end) {
        tokens_.push_back({block ? Tok::kBlockEnd : Tok::kVarEnd, pos});
        return AfterTag(pos + (sign ? 3 : 2), sign, block);
      }
      size_t len = 1;
      if (IsDigit(c)) {
        len = LexNumber(pos);
      } else if (c == '\'' || c == '"') {
        len = LexString(pos);
      } else if (IsNameChar(c)) {
        while (pos + len < src_.size() && IsNameChar(src_[pos + len])) ++len;
        tokens_.push_back({Tok::kName, pos, src_.substr(pos, len)});
      } else {
        for (std::string_view pair : {"//", "==", "!=", "<=", ">="}) {
          if (rest.substr(0, 2) == pair) len = 2;
        }
        if (len == 1 && std::string_view("+-*/%~<>=.,:|()[]{}").find(c) == std::string::npos) {
          map_.Fail(pos, "unexpected character '" + src_.substr(pos, CharLength(src_, pos)) + "'");
        }
        if (c == '(' || c == '[' || c == '{') closers += c == '(' ? ')' : c == '[' ? ']' : '}';
        if (c == ')' || c == ']' || c == '}') {
          if (closers.empty() || closers.back() != c) {
            map_.Fail(pos, "unexpected '" + std::string(1, c) + "'" +
                               (closers.empty()
                                    ? ""
                                    : "; expected '" + closers.substr(closers.size() - 1) + "'"));
          }
          closers.pop_back();
        }
        tokens_.push_back({Tok::kOp, pos, src_.substr(pos, len)});
      }
      pos += len;
    }
  }

  // 42, 1_000, 3.14, 1e3 (after '.' only an integer: x.0 is an item). Returns its length.
  size_t LexNumber(size_t start) {
    size_t pos = start;
    auto digits = [&] {
      while (pos < src_.size() &&
             (IsDigit(src_[pos]) || (src_[pos] == '_' && IsDigit(src_[pos - 1]) &&
                                     pos + 1 < src_.size() && IsDigit(src_[pos + 1])))) {
        ++pos;
      }
    };
    digits();
    const bool after_dot = !tokens_.empty() && tokens_.back().text == ".";
    bool is_float = false;
    if (!after_dot && pos + 1 < src_.size() && src_[pos] == '.' && IsDigit(src_[pos + 1])) {
      is_float = true;
      ++pos;
      digits();
    }
    if (!after_dot && pos < src_.size() && (src_[pos] | 0x20) == 'e') {
      size_t p =
          pos + 1 + (pos + 1 < src_.size() && (src_[pos + 1] == '+' || src_[pos + 1] == '-'));
      if (p < src_.size() && IsDigit(src_[p])) {
        is_float = true;
        pos = p;
        digits();
      }
    }
    std::string text = src_.substr(start, pos - start);
    text.erase(std::remove(text.begin(), text.end(), '_'), text.end());
    Value v = Scalar(is_float ? Type::kFloat : Type::kInt);
    const char* const last = text.data() + text.size();
    auto res = is_float ? std::from_chars(text.data(), last, v.f)
                        : std::from_chars(text.data(), last, v.i);
    if (res.ec != std::errc()) map_.Fail(start, "the number " + text + " is out of range");
    tokens_.push_back({Tok::kLiteral, start, "", v});
    return pos - start;
  }

  // A quoted string with Python's escapes (\n \t \\ \' \xHH \uHHHH \UHHHHHHHH, octal, ...).
  // Returns its length.
  size_t LexString(size_t start) {
    static constexpr std::string_view kEscapes = "\\\\''\"\"a\ab\bf\fn\nr\rt\tv\v";  // Pairs.
    const char quote = src_[start];
    std::string value;
    size_t pos = start + 1;
    while (true) {
      if (pos >= src_.size() || (src_[pos] == '\\' && pos + 1 == src_.size())) {
        map_.Fail(start, "the string is not closed");
      }
      const char c = src_[pos++];
      if (c == quote) break;
      if (c != '\\') {
        value += c;
        continue;
      }
      const char e = src_[pos++];
      const size_t simple = kEscapes.find(e);
      const bool octal = e >= '0' && e <= '7';
      if (e == '\n') continue;  // A backslash ending a line joins the lines.
      if (simple != std::string_view::npos && simple % 2 == 0) {
        value += kEscapes[simple + 1];
      } else if (octal || e == 'x' || e == 'u' || e == 'U') {
        const size_t digits = octal ? 3 : e == 'x' ? 2 : e == 'u' ? 4 : 8;
        size_t k = octal ? pos - 1 : pos, taken = 0;
        uint32_t cp = 0;
        for (; taken < digits && k < src_.size() &&
               std::isxdigit(static_cast<unsigned char>(src_[k]));
             ++taken, ++k) {
          const int digit = IsDigit(src_[k]) ? src_[k] - '0' : (src_[k] | 0x20) - 'a' + 10;
          if (octal && digit > 7) break;
          cp = cp * (octal ? 8 : 16) + digit;
        }
        if ((!octal && taken < digits) || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) {
          map_.Fail(pos - 2, "a bad \\" + std::string(1, e) + " escape");
        }
        AppendUtf8(cp, &value);
        pos = k;
      } else if (e == 'N') {
        map_.Fail(pos - 2, "\\N{...} escapes are not supported");
      } else {
        (value += '\\') += e;
      }
    }
    tokens_.push_back({Tok::kLiteral, start, "", String(std::move(value))});
    return pos - start;
  }

  const std::string& src_;
  const SourceMap& map_;
  std::vector<Token> tokens_;
};

const std::set<std::string, std::less<>> kFilters = {
    "count", "d",     "default", "first",  "join", "last", "length",
    "list",  "lower", "string",  "tojson", "trim", "upper"};
const std::set<std::string, std::less<>> kTests = {
    "boolean", "defined", "even", "false",    "float",  "integer", "iterable", "mapping",
    "none",    "number",  "odd",  "sequence", "string", "true",    "undefined"};

// ---- parser ----

class Parser {
 public:
  Parser(std::vector<Token> tokens, const SourceMap& map) : tokens_(std::move(tokens)), map_(map) {}

  std::vector<Stmt> ParseTemplate() {
    std::vector<Stmt> body;
    ParseBody(&body, {}, "", 0);
    return body;
  }

 private:
  class Nest {  // One level of nesting while it lives.
   public:
    Nest(Parser* p, const Token& at) : p_(p) {
      if (++p_->nesting_ > kMaxNesting) {
        p_->Fail(at, "nested more than " + std::to_string(kMaxNesting) + " deep");
      }
    }
    ~Nest() { --p_->nesting_; }

   private:
    Parser* p_;
  };

  [[noreturn]] void Fail(const Token& at, const std::string& what) const {
    map_.Fail(at.pos, what);
  }
  const Token& Peek(size_t ahead = 0) const {
    return tokens_[std::min(pos_ + ahead, tokens_.size() - 1)];
  }
  const Token& Next() {
    const Token& t = tokens_[pos_];
    pos_ = std::min(pos_ + 1, tokens_.size() - 1);
    return t;
  }
  bool Is(Tok type, std::string_view text, size_t ahead = 0) const {
    return Peek(ahead).type == type && Peek(ahead).text == text;
  }
  bool IsOp(std::string_view op, size_t ahead = 0) const { return Is(Tok::kOp, op, ahead); }
  bool IsName(std::string_view name, size_t ahead = 0) const { return Is(Tok::kName, name, ahead); }
  bool Skip(Tok type, std::string_view text) {
    if (!Is(type, text)) return false;
    Next();
    return true;
  }
  bool SkipOp(std::string_view op) { return Skip(Tok::kOp, op); }
  bool SkipName(std::string_view name) { return Skip(Tok::kName, name); }
  void Expect(bool found, const std::string& what) const {
    if (!found) Fail(Peek(), "expected " + what + ", found " + Describe(Peek()));
  }
  void ExpectOp(std::string_view op) { Expect(SkipOp(op), "'" + std::string(op) + "'"); }
  void ExpectEnd(Tok end) {
    Expect(Peek().type == end, end == Tok::kBlockEnd ? "'%}'" : "'}}'");
    Next();
  }
  std::string ExpectName(const std::string& what) {
    Expect(Peek().type == Tok::kName, what);
    return Next().text;
  }

  // Statements into `body` up to a {% tag %} named in `ends` (consumed through its name);
  // returns that name, or "" at the end of the template (an error when `ends` is not empty).
  // `opener` and `line` name the block being closed, for messages.
  std::string ParseBody(std::vector<Stmt>* body, const std::vector<std::string>& ends,
                        const std::string& opener, int line) {
    auto expected = [&] {
      std::string list;
      for (size_t k = 0; k < ends.size(); ++k) {
        list += (k == 0 ? "'" : k + 1 == ends.size() ? " or '" : ", '") + ends[k] + "'";
      }
      return "expected " + list + " to close the '" + opener + "' on line " + std::to_string(line);
    };
    while (true) {
      const Token& t = Next();
      Stmt s;
      s.line = map_.Line(t.pos);
      if (t.type == Tok::kEnd) {
        if (ends.empty()) return "";
        Fail(t, expected() + ", found end of template");
      } else if (t.type == Tok::kText) {
        s.text = t.text;
      } else if (t.type == Tok::kVarBegin) {
        s.kind = Stmt::Kind::kOutput;
        s.expr = ParseExpression(true);
        ExpectEnd(Tok::kVarEnd);
      } else {
        const Token& tag = Next();
        if (tag.type != Tok::kName) Fail(tag, "expected a tag name, found " + Describe(tag));
        if (std::find(ends.begin(), ends.end(), tag.text) != ends.end()) return tag.text;
        if (tag.text == "if") {
          ParseIf(&s, tag);
        } else if (tag.text == "for") {
          ParseFor(&s, tag);
        } else if (tag.text == "set") {
          s.kind = Stmt::Kind::kSet;
          s.targets.push_back(ExpectName("a variable name"));
          if (SkipOp(".")) s.targets.push_back(ExpectName("an attribute name"));
          Expect(SkipOp("="), "'=' ({% set %}...{% endset %} is not supported)");
          s.expr = ParseExpression(true);
          ExpectEnd(Tok::kBlockEnd);
        } else if (tag.text == "macro") {
          ParseMacro(&s, tag);
        } else if (tag.text == "break" || tag.text == "continue") {
          if (loops_ == 0) Fail(tag, "'" + tag.text + "' outside a for loop");
          s.kind = tag.text == "break" ? Stmt::Kind::kBreak : Stmt::Kind::kContinue;
          ExpectEnd(Tok::kBlockEnd);
        } else {
          const bool known =
              std::set<std::string>{"elif", "else", "endif", "endfor", "endmacro"}.count(tag.text);
          Fail(tag, (known ? "unexpected '" : "unknown tag '") + tag.text + "'" +
                        (ends.empty() ? "" : "; " + expected()));
        }
      }
      body->push_back(std::move(s));
    }
  }

  void ParseIf(Stmt* s, const Token& tag) {
    Nest nest(this, tag);
    s->kind = Stmt::Kind::kIf;
    std::string end = "elif";
    while (end == "elif" || end == "else") {
      s->conditions.push_back(end == "elif" ? ParseExpression(false) : nullptr);
      ExpectEnd(Tok::kBlockEnd);
      std::vector<std::string> ends = {"endif"};
      if (end == "elif") ends = {"elif", "else", "endif"};
      end = ParseBody(&s->branches.emplace_back(), ends, "if", s->line);
    }
    ExpectEnd(Tok::kBlockEnd);
  }

  void ParseFor(Stmt* s, const Token& tag) {
    Nest nest(this, tag);
    s->kind = Stmt::Kind::kFor;
    do {
      s->targets.push_back(ExpectName("a loop variable"));
    } while (SkipOp(","));
    Expect(SkipName("in"), "'in'");
    s->expr = ParseExpression(false);
    if (SkipName("if")) s->filter = ParseExpression(true);
    Expect(!IsName("recursive"), "'%}' (recursive loops are not supported)");
    ExpectEnd(Tok::kBlockEnd);
    ++loops_;
    const std::string end = ParseBody(&s->body, {"else", "endfor"}, "for", s->line);
    --loops_;
    if (end == "else") {
      ExpectEnd(Tok::kBlockEnd);
      ParseBody(&s->else_body, {"endfor"}, "for", s->line);
    }
    ExpectEnd(Tok::kBlockEnd);
  }

  // {% macro name(a, b=default) %}...{% endmacro %}: no caller, varargs or kwargs.
  void ParseMacro(Stmt* s, const Token& tag) {
    Nest nest(this, tag);
    s->kind = Stmt::Kind::kMacro;
    s->text = ExpectName("a macro name");
    ExpectOp("(");
    while (!SkipOp(")")) {
      if (!s->targets.empty()) ExpectOp(",");
      const Token& at = Peek();
      s->targets.push_back(ExpectName("a parameter name"));
      if (std::count(s->targets.begin(), s->targets.end(), s->targets.back()) > 1) {
        Fail(at, "duplicate parameter '" + s->targets.back() + "'");
      }
      if (SkipOp("=")) {
        s->conditions.push_back(ParseExpression(true));
      } else if (!s->conditions.empty() && s->conditions.back()) {
        Fail(at, "a parameter without a default follows one with a default");
      } else {
        s->conditions.push_back(nullptr);
      }
    }
    ExpectEnd(Tok::kBlockEnd);
    const int loops = std::exchange(loops_, 0);  // break and continue do not leave a macro.
    ParseBody(&s->body, {"endmacro"}, "macro", s->line);
    loops_ = loops;
    ExpectEnd(Tok::kBlockEnd);
  }

  // ---- expressions, loosest binding first (Jinja's grammar) ----

  template <class... Args>
  ExprPtr Node(Expr::Kind kind, const Token& at, Args&&... args) {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    e->line = map_.Line(at.pos);
    (e->args.push_back(std::forward<Args>(args)), ...);
    return Seal(std::move(e), at);
  }

  // Records how deep `e` is, once its args are final.
  ExprPtr Seal(ExprPtr e, const Token& at) {
    for (const ExprPtr& a : e->args) {
      if (a) e->depth = std::max(e->depth, a->depth + 1);
    }
    if (e->depth > kMaxExprDepth) {
      Fail(at, "the expression nests more than " + std::to_string(kMaxExprDepth) + " deep");
    }
    return e;
  }

  // with_if false: no `a if c else b` at the top (as Jinja parses if and for headers).
  ExprPtr ParseExpression(bool with_if) {
    Nest nest(this, Peek());
    ExprPtr e = ParseLogic(true);
    while (with_if && IsName("if")) {
      const Token& at = Next();
      ExprPtr condition = ParseLogic(true);
      ExprPtr otherwise = SkipName("else") ? ParseExpression(true) : nullptr;
      e = Node(Expr::Kind::kIf, at, std::move(e), std::move(condition), std::move(otherwise));
    }
    return e;
  }

  // `or` binds looser than `and`, which binds looser than `not`.
  ExprPtr ParseLogic(bool is_or) {
    ExprPtr e = is_or ? ParseLogic(false) : ParseNot();
    while (IsName(is_or ? "or" : "and")) {
      const Token& at = Next();
      ExprPtr right = is_or ? ParseLogic(false) : ParseNot();
      e = Node(is_or ? Expr::Kind::kOr : Expr::Kind::kAnd, at, std::move(e), std::move(right));
    }
    return e;
  }

  ExprPtr ParseNot() {
    if (!IsName("not")) return ParseCompare();
    const Token& at = Next();
    Nest nest(this, at);
    return Node(Expr::Kind::kNot, at, ParseNot());
  }

  ExprPtr ParseCompare() {
    const Token& at = Peek();
    ExprPtr e = Node(Expr::Kind::kCompare, at, ParseBinary(0));
    while (true) {
      const std::string& op = Peek().text;
      if (Peek().type == Tok::kOp && (op == "==" || op == "!=" || op[0] == '<' || op[0] == '>')) {
        e->ops.push_back(Next().text);
      } else if (SkipName("in")) {
        e->ops.push_back("in");
      } else if (IsName("not") && IsName("in", 1)) {
        Next();
        Next();
        e->ops.push_back("not in");
      } else {
        break;
      }
      e->args.push_back(ParseBinary(0));
    }
    return e->ops.empty() ? std::move(e->args[0]) : Seal(std::move(e), at);
  }

  // Left-associative operator levels: + -, then ~, then * / // %.
  ExprPtr ParseBinary(size_t level) {
    static const std::vector<std::vector<std::string_view>> kLevels = {
        {"+", "-"}, {"~"}, {"*", "/", "//", "%"}};
    if (level == kLevels.size()) return ParseUnary(true);
    ExprPtr e = ParseBinary(level + 1);
    const auto& ops = kLevels[level];
    while (Peek().type == Tok::kOp && std::find(ops.begin(), ops.end(), Peek().text) != ops.end()) {
      const Token& at = Next();
      ExprPtr right = ParseBinary(level + 1);
      e = Node(Expr::Kind::kBinary, at, std::move(e), std::move(right));
      e->name = at.text;
    }
    return e;
  }

  // Unary minus binds looser than filters and tests: -x|abs is abs(-x), as in Jinja.
  ExprPtr ParseUnary(bool with_filters) {
    const Token& at = Peek();
    ExprPtr e;
    if (IsOp("-") || IsOp("+")) {
      Next();
      Nest nest(this, at);
      e = Node(at.text == "-" ? Expr::Kind::kNeg : Expr::Kind::kPos, at, ParseUnary(false));
    } else {
      e = ParsePrimary();
    }
    e = ParsePostfix(std::move(e));
    return with_filters ? ParseFilters(std::move(e)) : std::move(e);
  }

  ExprPtr ParsePrimary() {
    const Token& t = Next();
    ExprPtr e = Node(Expr::Kind::kLiteral, t);
    if (t.type == Tok::kName) {
      if (t.text == "true" || t.text == "True" || t.text == "false" || t.text == "False") {
        e->value = Bool(t.text[0] == 't' || t.text[0] == 'T');
      } else if (t.text == "none" || t.text == "None") {
        e->value = None();
      } else {
        e->kind = Expr::Kind::kName;
        e->name = t.text;
      }
      return e;
    }
    if (t.type == Tok::kLiteral) {
      e->value = t.value;
      while (t.value.type == Type::kString && Peek().type == Tok::kLiteral &&
             Peek().value.type == Type::kString) {
        e->value = String(*e->value.s + *Next().value.s);  // 'a' 'b' is 'ab'.
      }
      return e;
    }
    if (t.type != Tok::kOp || (t.text != "(" && t.text != "[" && t.text != "{")) {
      Fail(t, "expected an expression, found " + Describe(t));
    }
    e->kind = t.text == "{" ? Expr::Kind::kDict : Expr::Kind::kList;
    const std::string close = t.text == "(" ? ")" : t.text == "[" ? "]" : "}";
    if (t.text == "(" && !IsOp(")")) {  // (x) is x; (x,) and (x, y) are tuples.
      ExprPtr first = ParseExpression(true);
      if (SkipOp(")")) return first;
      ExpectOp(",");
      e->args.push_back(std::move(first));
    }
    e->value.tuple = t.text == "(";
    while (!SkipOp(close)) {  // Items, each followed by ',' or the closing bracket.
      e->args.push_back(ParseExpression(true));
      if (e->kind == Expr::Kind::kDict) {
        ExpectOp(":");
        e->args.push_back(ParseExpression(true));
      }
      if (!SkipOp(",")) {
        ExpectOp(close);
        break;
      }
    }
    return Seal(std::move(e), t);
  }

  ExprPtr ParsePostfix(ExprPtr e) {
    while (true) {
      const Token& at = Peek();
      if (SkipOp(".")) {
        const Token& attr = Next();
        if (attr.type == Tok::kLiteral && attr.value.type == Type::kInt) {  // x.0 is x[0].
          ExprPtr index = Node(Expr::Kind::kLiteral, attr);
          index->value = attr.value;
          e = Node(Expr::Kind::kItem, at, std::move(e), std::move(index));
          continue;
        }
        if (attr.type != Tok::kName)
          Fail(attr, "expected an attribute name, found " + Describe(attr));
        e = Node(Expr::Kind::kAttr, at, std::move(e));
        e->name = attr.text;
      } else if (SkipOp("[")) {
        ExprPtr start, stop, step;
        if (!IsOp(":")) {
          start = ParseExpression(true);
          if (SkipOp("]")) {
            e = Node(Expr::Kind::kItem, at, std::move(e), std::move(start));
            continue;
          }
        }
        ExpectOp(":");
        if (!IsOp("]") && !IsOp(":")) stop = ParseExpression(true);
        if (SkipOp(":") && !IsOp("]")) step = ParseExpression(true);
        ExpectOp("]");
        e = Node(Expr::Kind::kSlice, at, std::move(e), std::move(start), std::move(stop),
                 std::move(step));
      } else if (IsOp("(")) {
        e = ParseCall(Expr::Kind::kCall, std::move(e), at, "");
      } else {
        return e;
      }
    }
  }

  // A call or filter of `target` (args[0]), with the arguments in parentheses when present.
  ExprPtr ParseCall(Expr::Kind kind, ExprPtr target, const Token& at, const std::string& name) {
    ExprPtr e = Node(kind, at, std::move(target));
    e->name = name;
    if (!SkipOp("(")) return e;
    while (!SkipOp(")")) {
      if (e->args.size() > 1) {
        ExpectOp(",");
        if (SkipOp(")")) break;
      }
      if (Peek().type == Tok::kName && IsOp("=", 1)) {
        e->kwargs.push_back(Next().text);
        Next();
      } else if (!e->kwargs.empty()) {
        Fail(Peek(), "a positional argument follows a keyword argument");
      }
      e->args.push_back(ParseExpression(true));
    }
    return Seal(std::move(e), at);
  }

  ExprPtr ParseFilters(ExprPtr e) {
    while (true) {
      const Token& at = Peek();
      if (SkipOp("|")) {
        const Token& name = Peek();
        const std::string filter = ExpectName("a filter name");
        if (!kFilters.count(filter)) Fail(name, "unknown filter '" + filter + "'");
        e = ParseCall(Expr::Kind::kFilter, std::move(e), at, filter);
      } else if (SkipName("is")) {
        const bool negated = SkipName("not");
        const Token& name = Peek();
        const std::string test = ExpectName("a test name");
        if (!kTests.count(test)) Fail(name, "unknown test '" + test + "'");
        // Jinja reads a value after the name as an argument (x is divisibleby 3); none of our
        // tests takes one, which is an error when the test runs.
        const Token& next = Peek();
        if (IsOp("(")) {
          e = ParseCall(Expr::Kind::kTest, std::move(e), at, test);
        } else if (next.type == Tok::kLiteral || IsOp("[") || IsOp("{") ||
                   (next.type == Tok::kName && !IsName("else") && !IsName("or") &&
                    !IsName("and"))) {
          Expect(!IsName("is"), "no second 'is' (tests do not chain)");
          ExprPtr argument = ParsePostfix(ParsePrimary());
          e = Node(Expr::Kind::kTest, at, std::move(e), std::move(argument));
        } else {
          e = Node(Expr::Kind::kTest, at, std::move(e));
        }
        e->name = test;
        if (negated) e = Node(Expr::Kind::kNot, at, std::move(e));
      } else if (IsOp("(")) {
        e = ParseCall(Expr::Kind::kCall, std::move(e), at, "");
      } else {
        return e;
      }
    }
  }

  std::vector<Token> tokens_;
  const SourceMap& map_;
  size_t pos_ = 0;
  int nesting_ = 0;
  int loops_ = 0;  // Enclosing for loops, where break and continue may appear.
};

// Jinja reads the source with its newlines as \n and without one final newline
// (keep_trailing_newline is off).
std::string NormalizeNewlines(std::string_view source) {
  std::string out;
  for (size_t i = 0; i < source.size(); ++i) {
    out += source[i] == '\r' ? '\n' : source[i];
    if (source[i] == '\r' && i + 1 < source.size() && source[i + 1] == '\n') ++i;
  }
  if (!out.empty() && out.back() == '\n') out.pop_back();
  return out;
}

}  // namespace
}  // namespace jinja

Result<ChatTemplate> ChatTemplate::Compile(std::string_view source,
                                           const ChatTemplateOptions& options) {
  if (!IsValidUtf8(source)) {
    return InvalidArgument("chat template: not valid UTF-8 at byte " +
                           std::to_string(FirstInvalidUtf8(source)));
  }
  try {
    const std::string src = jinja::NormalizeNewlines(source);
    const jinja::SourceMap map(src);
    auto program = std::make_shared<Program>();
    program->body = jinja::Parser(jinja::Lexer(src, map).Run(), map).ParseTemplate();
    program->options = options;
    return ChatTemplate(std::move(program));
  } catch (const jinja::Failure& failure) {
    return failure.status;
  } catch (const std::exception& e) {  // std::bad_alloc and the like; not expected.
    return Internal(std::string("chat template: ") + e.what());
  }
}

Result<std::string> RenderChatTemplate(std::string_view source,
                                       const std::vector<ChatMessage>& messages,
                                       const std::string& bos_token, const std::string& eos_token,
                                       bool add_generation_prompt) {
  FMOE_ASSIGN_OR_RETURN(ChatTemplate compiled, ChatTemplate::Compile(source));
  return compiled.Render(messages, bos_token, eos_token, add_generation_prompt);
}

}  // namespace fmoe
