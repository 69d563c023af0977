// The values and the syntax tree of chat templates, shared by the parser (chat_template.cc) and
// the renderer (chat_template_render.cc) and used nowhere else; the API is chat_template.h. A
// compiled Program is immutable; the Values a render builds belong to that render.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/status.h"
#include "common/text/chat_template.h"
#include "common/text/unicode.h"

namespace fmoe {
namespace jinja {

// Errors travel through the parser and the renderer as a thrown Failure up to
// ChatTemplate::Compile or Render, which return its Status; nothing is thrown past them.
struct Failure {
  Status status;
};

[[noreturn]] inline void Throw(ErrorCode code, std::string message) {
  throw Failure{Status(code, std::move(message))};
}

// ---- values ----

struct Value;
struct Stmt;
using List = std::vector<Value>;
using Dict = std::vector<std::pair<std::string, Value>>;  // In insertion order, as Python's dict.

enum class Type {
  kUndefined,  // Jinja's Undefined; s says why ("'x' is undefined").
  kNone,
  kBool,       // i: 0 or 1.
  kInt,        // i.
  kFloat,      // f.
  kString,     // s.
  kList,       // list; a tuple when `tuple` is set (it prints as (a, b)).
  kDict,       // dict, never changed once built.
  kNamespace,  // dict: the attributes, which {% set ns.attr = ... %} changes.
  kFunction,   // s: the name (raise_exception, namespace, range, strftime_now, or a macro's).
};

struct Value {
  Type type = Type::kUndefined;
  bool tuple = false;
  int depth = 0;  // kList, kDict, kNamespace: how deep lists and dicts nest in it (1 when flat).
  int64_t i = 0;
  double f = 0;
  std::shared_ptr<const std::string> s;
  std::shared_ptr<const List> list;
  std::shared_ptr<Dict> dict;
  const Stmt* macro = nullptr;  // kFunction: the {% macro %} (in the Program), or null.
};

inline Value Scalar(Type type, int64_t i = 0, double f = 0) {
  Value v;
  v.type = type;
  v.i = i;
  v.f = f;
  return v;
}
inline Value None() { return Scalar(Type::kNone); }
inline Value Bool(bool b) { return Scalar(Type::kBool, b); }
inline Value Int(int64_t i) { return Scalar(Type::kInt, i); }
inline Value Float(double f) { return Scalar(Type::kFloat, 0, f); }
inline Value WithText(Type type, std::string s) {
  Value v = Scalar(type);
  v.s = std::make_shared<const std::string>(std::move(s));
  return v;
}
inline Value String(std::string s) { return WithText(Type::kString, std::move(s)); }
inline Value Undefined(std::string why) { return WithText(Type::kUndefined, std::move(why)); }

// ---- text ----

// str.isspace().
inline bool IsPySpace(char32_t c) {
  return (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x20) || c == 0x85 || c == 0xa0 ||
         c == 0x1680 || (c >= 0x2000 && c <= 0x200a) || c == 0x2028 || c == 0x2029 || c == 0x202f ||
         c == 0x205f || c == 0x3000;
}

// Byte offsets of the characters of `s` (valid UTF-8: both the template and the inputs are
// checked), then s.size().
inline std::vector<size_t> CharOffsets(std::string_view s) {
  std::vector<size_t> offsets;
  for (size_t i = 0; i < s.size(); ++i) {
    if ((static_cast<unsigned char>(s[i]) & 0xc0) != 0x80) offsets.push_back(i);
  }
  offsets.push_back(s.size());
  return offsets;
}

inline char32_t CharAt(std::string_view s, size_t i) {
  char32_t c;
  DecodeUtf8(s, i, &c);
  return c;
}
inline size_t CharLength(std::string_view s, size_t i) {
  char32_t c;
  return DecodeUtf8(s, i, &c);
}

// ---- syntax tree ----

struct Expr;
using ExprPtr = std::unique_ptr<Expr>;

struct Expr {
  enum class Kind {
    kLiteral,  // value
    kName,     // name
    kList,     // args: the items; a tuple when `value.tuple` is set
    kDict,     // args: key, value, key, value, ...
    kAttr,     // args[0].name
    kItem,     // args[0][args[1]]
    kSlice,    // args[0][args[1]:args[2]:args[3]], each bound may be null
    kCall,     // args[0](args[1..]); the last kwargs.size() args are keyword arguments
    kFilter,   // args[0] | name(args[1..]), arguments as for kCall
    kTest,     // args[0] is name (args[1..]: arguments, which no test takes)
    kNeg,      // -args[0]
    kPos,      // +args[0]
    kNot,      // not args[0]
    kAnd,      // args[0] and args[1]
    kOr,       // args[0] or args[1]
    kIf,       // args[0] if args[1] else args[2] (may be null)
    kBinary,   // args[0] name args[1], name one of + - * / // % ~
    kCompare,  // args[0] ops[0] args[1] ops[1] args[2] ...
  };
  Kind kind = Kind::kLiteral;
  int line = 0;   // In the template, for messages.
  int depth = 1;  // Of this tree (the parser bounds it).
  Value value;
  std::string name;
  std::vector<ExprPtr> args;
  std::vector<std::string> kwargs;
  std::vector<std::string> ops;
};

struct Stmt {
  enum class Kind { kText, kOutput, kIf, kFor, kSet, kBreak, kContinue, kMacro };
  Kind kind = Kind::kText;
  int line = 0;
  std::string text;                  // kText; kMacro: the name.
  ExprPtr expr;                      // kOutput: the value; kFor: the sequence; kSet: the value.
  ExprPtr filter;                    // kFor: the condition after the sequence, or null.
  std::vector<std::string> targets;  // kFor: loop variables; kSet: {name} or {namespace, attr};
                                     // kMacro: the parameters.
  std::vector<ExprPtr> conditions;   // kIf: one per branch, null for else; kMacro: the
                                     // parameters' defaults, null where there is none.
  std::vector<std::vector<Stmt>> branches;  // kIf.
  std::vector<Stmt> body, else_body;        // kFor; kMacro: body.
};

}  // namespace jinja

struct ChatTemplate::Program {
  std::vector<jinja::Stmt> body;
  ChatTemplateOptions options;
};

}  // namespace fmoe
