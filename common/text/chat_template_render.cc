// Renders compiled chat templates (chat_template.h): values that behave as Python's and Jinja's
// (str(), repr(), json.dumps, floor division, Undefined), and the tree-walking Renderer. Each
// Render builds its own Renderer, so a compiled template renders from any number of threads.
// Every render is bounded: its output and every string it builds by max_output_bytes, its loops by
// max_loop_iterations, its work (expressions evaluated, bytes copied, compared or searched) by
// max_work, lists it builds by kMaxItems and value nesting by kMaxValueDepth.
#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <ctime>
#include <exception>
#include <optional>
#include <utility>

#include "common/json.h"
#include "common/text/chat_template.h"
#include "common/text/chat_template_tree.h"
#include "common/text/unicode.h"

namespace fmoe {
namespace jinja {
namespace {

constexpr int kMaxValueDepth = 128;    // Deepest nesting of lists and dicts in a value.
constexpr int64_t kMaxItems = 100000;  // Jinja's sandbox MAX_RANGE; also caps lists + and * build.
constexpr int kMaxCallDepth = 64;      // Deepest nesting of macro calls (recursion included).

// ---- values ----

int DepthAbove(int depth) {
  if (depth >= kMaxValueDepth) {
    Throw(ErrorCode::kInvalidArgument, "chat template: a value nests lists or dicts more than " +
                                           std::to_string(kMaxValueDepth) + " deep");
  }
  return depth + 1;
}

Value MakeList(List items, bool tuple = false) {
  Value v = Scalar(Type::kList);
  v.tuple = tuple;
  for (const Value& item : items) v.depth = std::max(v.depth, item.depth);
  v.depth = DepthAbove(v.depth);
  v.list = std::make_shared<const List>(std::move(items));
  return v;
}

Value MakeDict(Dict items, Type type = Type::kDict) {
  Value v = Scalar(type);
  for (const auto& [key, item] : items) v.depth = std::max(v.depth, item.depth);
  v.depth = DepthAbove(v.depth);
  v.dict = std::make_shared<Dict>(std::move(items));
  return v;
}

const Value* FindKey(const Dict& dict, std::string_view key) {
  for (const auto& [k, v] : dict) {
    if (k == key) return &v;
  }
  return nullptr;
}

void SetKey(Dict* dict, const std::string& key, Value value) {
  for (auto& [k, v] : *dict) {
    if (k == key) {
      v = std::move(value);
      return;
    }
  }
  dict->emplace_back(key, std::move(value));
}

bool IsNumber(const Value& v) {
  return v.type == Type::kBool || v.type == Type::kInt || v.type == Type::kFloat;
}
bool IsInt(const Value& v) { return v.type == Type::kBool || v.type == Type::kInt; }
double AsDouble(const Value& v) { return v.type == Type::kFloat ? v.f : static_cast<double>(v.i); }

std::string TypeName(const Value& v) {
  static constexpr const char* kNames[] = {"Undefined", "NoneType", "bool", "int",
                                           "float",     "str",      "list", "dict",
                                           "Namespace", "function"};
  return v.tuple ? "tuple" : kNames[static_cast<int>(v.type)];
}

// Jinja's Undefined for a missing attribute or element: "'dict object' has no attribute 'x'".
Value Missing(const Value& owner, const std::string& what) {
  return Undefined("'" + (owner.type == Type::kNone ? "None" : TypeName(owner) + " object") +
                   "' has no " + what);
}

bool Truthy(const Value& v) {
  if (IsInt(v)) return v.i != 0;
  if (v.type == Type::kFloat) return v.f != 0;
  if (v.type == Type::kString) return !v.s->empty();
  if (v.type == Type::kList) return !v.list->empty();
  if (v.type == Type::kDict) return !v.dict->empty();
  return v.type == Type::kNamespace || v.type == Type::kFunction;
}

// ---- Python text ----

// str.strip/lstrip/rstrip; `chars` null strips whitespace.
std::string Strip(std::string_view s, const std::string* chars, bool left, bool right) {
  auto drop = [&](size_t at, size_t length) {  // The character s[at, at + length).
    if (!chars) return IsPySpace(CharAt(s, at));
    return chars->find(s.substr(at, length)) != std::string::npos;
  };
  size_t begin = 0, end = s.size();
  while (left && begin < end && drop(begin, CharLength(s, begin))) begin += CharLength(s, begin);
  while (right && end > begin) {
    size_t last = end - 1;
    while (last > begin && (static_cast<unsigned char>(s[last]) & 0xc0) == 0x80) --last;
    if (!drop(last, end - last)) break;
    end = last;
  }
  return std::string(s.substr(begin, end - begin));
}

std::string ChangeCase(std::string s, bool upper) {  // ASCII letters only.
  for (char& c : s) {
    const auto u = static_cast<unsigned char>(c);
    c = static_cast<char>(upper ? std::toupper(u) : std::tolower(u));
  }
  return s;
}

// repr(float): the shortest text that reads back; fixed notation for exponents -4..15.
std::string PyFloat(double d) {
  if (std::isnan(d) || std::isinf(d)) return std::isnan(d) ? "nan" : d > 0 ? "inf" : "-inf";
  char buf[64];
  std::string sci(buf, std::to_chars(buf, buf + sizeof buf, d, std::chars_format::scientific).ptr);
  const size_t e = sci.find('e');  // sci is "-1.2345e+05".
  const int exp = std::atoi(sci.c_str() + e + 1);
  std::string out = sci[0] == '-' ? "-" : "", digits;
  for (size_t i = out.size(); i < e; ++i) {
    if (sci[i] != '.') digits += sci[i];
  }
  if (exp < -4 || exp >= 16) {
    std::snprintf(buf, sizeof buf, "e%c%02d", exp < 0 ? '-' : '+', std::abs(exp));
    return out + digits[0] + (digits.size() > 1 ? "." + digits.substr(1) : "") + buf;
  }
  if (exp < 0) return out + "0." + std::string(-exp - 1, '0') + digits;
  if (digits.size() <= static_cast<size_t>(exp) + 1) {
    return out + digits + std::string(exp + 1 - digits.size(), '0') + ".0";
  }
  return out + digits.substr(0, exp + 1) + "." + digits.substr(exp + 1);
}

// What Python's repr() escapes: controls, and the common invisible and separator characters.
bool IsPyUnprintable(char32_t c) {
  return c < 0x20 || (c >= 0x7f && c <= 0xa0) || c == 0xad || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200f) || (c >= 0x2028 && c <= 0x202f) ||
         (c >= 0x205f && c <= 0x206f) || c == 0x3000 || c == 0xfeff ||
         (c >= 0xe000 && c <= 0xf8ff) || (c >= 0xfff9 && c <= 0xfffb);
}

// repr(str): single quotes unless the text has ' and no ".
void AppendPyRepr(std::string_view s, std::string* out) {
  const bool dq = s.find('\'') != std::string_view::npos && s.find('"') == std::string_view::npos;
  const char quote = dq ? '"' : '\'';
  *out += quote;
  for (size_t i = 0, n; i < s.size(); i += n) {
    char32_t c;
    n = DecodeUtf8(s, i, &c);
    if (c == static_cast<char32_t>(quote) || c == '\\') {
      (*out += '\\') += static_cast<char>(c);
    } else if (c == '\n' || c == '\r' || c == '\t') {
      *out += c == '\n' ? "\\n" : c == '\r' ? "\\r" : "\\t";
    } else if (IsPyUnprintable(c)) {
      char buf[16];
      std::snprintf(buf, sizeof buf, c <= 0xff ? "\\x%02x" : "\\u%04x", static_cast<unsigned>(c));
      *out += buf;
    } else {
      out->append(s.substr(i, n));
    }
  }
  *out += quote;
}

// json.dumps(s, ensure_ascii=ascii): with ascii, what is not ASCII as \uXXXX (UTF-16 units).
void AppendJsonString(std::string_view s, bool ascii, std::string* out) {
  static constexpr std::string_view kEscapes = "\"\"\\\\\nn\rr\tt\bb\ff";  // Pairs: char, letter.
  auto hex = [out](unsigned unit) {                                        // unit <= 0xffff.
    char buf[16];
    std::snprintf(buf, sizeof buf, "\\u%04x", unit);
    *out += buf;
  };
  *out += '"';
  for (size_t i = 0, n; i < s.size(); i += n) {
    const char c = s[i];
    n = 1;
    const size_t k = kEscapes.find(c);
    if (k != std::string_view::npos && k % 2 == 0) {
      (*out += '\\') += kEscapes[k + 1];
    } else if (static_cast<unsigned char>(c) < 0x20) {
      hex(static_cast<unsigned char>(c));
    } else if (ascii && static_cast<unsigned char>(c) >= 0x80) {
      char32_t cp;
      n = DecodeUtf8(s, i, &cp);
      if (cp >= 0x10000) {
        hex(0xd800 + ((cp - 0x10000) >> 10));
        hex(0xdc00 + ((cp - 0x10000) & 0x3ff));
      } else {
        hex(cp);
      }
    } else {
      *out += c;
    }
  }
  *out += '"';
}

// ---- renderer ----

struct Scope {
  const Scope* parent = nullptr;
  Dict vars;

  const Value* Find(std::string_view name) const {
    for (const Scope* s = this; s; s = s->parent) {
      if (const Value* v = FindKey(s->vars, name)) return v;
    }
    return nullptr;
  }
};

struct Args {
  List positional;
  Dict keywords;

  // The argument at `index`, or else the one named `name`; null when neither was given.
  const Value* Get(size_t index, std::string_view name) const {
    return index < positional.size() ? &positional[index] : FindKey(keywords, name);
  }
};

// One render: the output so far, and what it has spent of its limits. Single-threaded.
class Renderer {
 public:
  explicit Renderer(const ChatTemplateOptions& options) : options_(options) {}

  std::string Run(const std::vector<Stmt>& body, Dict globals) {
    Scope root{nullptr, std::move(globals)};
    root_ = &root;
    Exec(body, &root);
    return std::move(out_);
  }

 private:
  enum class Flow { kNext, kBreak, kContinue };

  [[noreturn]] void Error(const std::string& what) const {
    Throw(ErrorCode::kInvalidArgument,
          "chat template: line " + std::to_string(line_) + ": " + what);
  }
  [[noreturn]] void Exhausted(const std::string& what) const {
    Throw(ErrorCode::kResourceExhausted,
          "chat template: line " + std::to_string(line_) + ": " + what);
  }
  void Charge(size_t units) {
    if ((work_ += units) > options_.max_work) {
      Exhausted("the render needs more than max_work=" + std::to_string(options_.max_work));
    }
  }
  void CheckSize(size_t bytes) const {
    if (bytes > options_.max_output_bytes) {
      Exhausted("a string exceeds max_output_bytes=" + std::to_string(options_.max_output_bytes));
    }
  }
  void CheckItems(size_t count) const {
    if (count > static_cast<size_t>(kMaxItems)) {
      Exhausted("a list exceeds " + std::to_string(kMaxItems) + " items");
    }
  }
  Value NewString(std::string s) {
    CheckSize(s.size());
    Charge(s.size());
    return String(std::move(s));
  }
  void Emit(std::string_view s) {
    Charge(s.size());
    if (out_.size() + s.size() > options_.max_output_bytes) {
      Exhausted("the output exceeds max_output_bytes=" + std::to_string(options_.max_output_bytes));
    }
    out_ += s;
  }
  void CountIteration() {
    if (++iterations_ > options_.max_loop_iterations) {
      Exhausted("loops run more than max_loop_iterations=" +
                std::to_string(options_.max_loop_iterations) + " times");
    }
  }
  void FailIfUndefined(const Value& v) const {
    if (v.type == Type::kUndefined) Error(v.s ? *v.s : "a value is undefined");
  }

  // ---- statements ----

  Flow Exec(const std::vector<Stmt>& body, Scope* scope) {
    for (const Stmt& s : body) {
      line_ = s.line;
      if (s.kind == Stmt::Kind::kText) {
        Emit(s.text);
      } else if (s.kind == Stmt::Kind::kOutput) {
        Emit(ToText(Eval(*s.expr, scope)));
      } else if (s.kind == Stmt::Kind::kIf) {
        for (size_t k = 0; k < s.branches.size(); ++k) {
          if (s.conditions[k] && !Truthy(Eval(*s.conditions[k], scope))) continue;
          const Flow flow = Exec(s.branches[k], scope);
          if (flow != Flow::kNext) return flow;
          break;
        }
      } else if (s.kind == Stmt::Kind::kFor) {
        ExecFor(s, scope);
      } else if (s.kind == Stmt::Kind::kSet) {
        ExecSet(s, scope);
      } else if (s.kind == Stmt::Kind::kMacro) {
        Value macro = WithText(Type::kFunction, s.text);
        macro.macro = &s;
        SetKey(&scope->vars, s.text, std::move(macro));
      } else {
        return s.kind == Stmt::Kind::kBreak ? Flow::kBreak : Flow::kContinue;
      }
    }
    return Flow::kNext;
  }

  void Bind(const std::vector<std::string>& targets, const Value& item, Scope* scope) {
    if (targets.size() == 1) return SetKey(&scope->vars, targets[0], item);
    if (item.type != Type::kList || item.list->size() != targets.size()) {
      Error("cannot unpack " + TypeName(item) + " into " + std::to_string(targets.size()) +
            " loop variables");
    }
    for (size_t k = 0; k < targets.size(); ++k) SetKey(&scope->vars, targets[k], (*item.list)[k]);
  }

  void ExecFor(const Stmt& s, Scope* scope) {
    List items = Items(Eval(*s.expr, scope));
    if (s.filter) {
      List kept;
      for (Value& item : items) {
        CountIteration();
        Scope probe{scope, {}};
        Bind(s.targets, item, &probe);
        if (Truthy(Eval(*s.filter, &probe))) kept.push_back(std::move(item));
      }
      items = std::move(kept);
    }
    if (items.empty()) Exec(s.else_body, scope);
    const int64_t n = static_cast<int64_t>(items.size());
    for (int64_t k = 0; k < n; ++k) {
      CountIteration();
      Dict loop = {{"index", Int(k + 1)},    {"index0", Int(k)},
                   {"revindex", Int(n - k)}, {"revindex0", Int(n - k - 1)},
                   {"first", Bool(k == 0)},  {"last", Bool(k == n - 1)},
                   {"length", Int(n)},       {"depth", Int(1)},
                   {"depth0", Int(0)}};
      if (k > 0) loop.emplace_back("previtem", items[k - 1]);
      if (k + 1 < n) loop.emplace_back("nextitem", items[k + 1]);
      Scope inner{scope, {}};
      Bind(s.targets, items[k], &inner);
      SetKey(&inner.vars, "loop", MakeDict(std::move(loop)));
      if (Exec(s.body, &inner) == Flow::kBreak) break;
    }
  }

  void ExecSet(const Stmt& s, Scope* scope) {
    Value value = Eval(*s.expr, scope);
    if (s.targets.size() == 1) return SetKey(&scope->vars, s.targets[0], std::move(value));
    const Value* ns = scope->Find(s.targets[0]);
    if (!ns || ns->type != Type::kNamespace)
      Error("cannot assign attribute on non-namespace object");
    CheckNoNamespace(value);
    SetKey(ns->dict.get(), s.targets[1], std::move(value));
  }

  // A namespace inside a namespace could make a cycle; no chat template needs one.
  void CheckNoNamespace(const Value& v) {
    Charge(1);
    if (v.type == Type::kNamespace) Error("a namespace attribute cannot hold a namespace");
    if (v.type == Type::kList) {
      for (const Value& item : *v.list) CheckNoNamespace(item);
    } else if (v.type == Type::kDict) {
      for (const auto& [key, item] : *v.dict) CheckNoNamespace(item);
    }
  }

  // ---- expressions ----

  Value Eval(const Expr& e, Scope* scope) {
    Charge(1);
    line_ = e.line;
    using K = Expr::Kind;
    auto arg = [&](size_t k) { return Eval(*e.args[k], scope); };
    switch (e.kind) {
      case K::kLiteral:
        return e.value;
      case K::kName:
        if (const Value* v = scope->Find(e.name)) return *v;
        if (e.name == "raise_exception" || e.name == "namespace" || e.name == "range" ||
            e.name == "strftime_now") {
          return WithText(Type::kFunction, e.name);
        }
        return Undefined("'" + e.name + "' is undefined");
      case K::kList: {
        List items;
        for (size_t k = 0; k < e.args.size(); ++k) items.push_back(arg(k));
        return MakeList(std::move(items), e.value.tuple);
      }
      case K::kDict: {
        Dict items;
        for (size_t k = 0; k + 1 < e.args.size(); k += 2) {
          Value key = arg(k);
          if (key.type != Type::kString) Error("dict keys must be strings");
          SetKey(&items, *key.s, arg(k + 1));
        }
        return MakeDict(std::move(items));
      }
      case K::kAttr:
        return GetAttr(arg(0), e.name);
      case K::kItem: {
        Value object = arg(0);
        return GetItem(object, arg(1));
      }
      case K::kSlice:
        return EvalSlice(e, scope);
      case K::kCall:
        return EvalCall(e, scope);
      case K::kFilter: {
        Value operand = arg(0);
        return Filter(e.name, operand, EvalArgs(e, scope));
      }
      case K::kTest:
        if (e.args.size() > 1) Error("the test '" + e.name + "' takes no arguments");
        return Bool(Test(e.name, arg(0)));
      case K::kNeg:
      case K::kPos: {
        Value v = arg(0);
        FailIfUndefined(v);
        if (!IsNumber(v)) {
          Error(std::string("bad operand type for unary ") + (e.kind == K::kNeg ? "-" : "+") +
                ": '" + TypeName(v) + "'");
        }
        if (v.type == Type::kFloat) return Float(e.kind == K::kNeg ? -v.f : v.f);
        if (e.kind == K::kNeg && v.i == INT64_MIN) Error("integer overflow");
        return Int(e.kind == K::kNeg ? -v.i : v.i);
      }
      case K::kNot:
        return Bool(!Truthy(arg(0)));
      case K::kAnd:
      case K::kOr: {
        Value left = arg(0);
        return Truthy(left) == (e.kind == K::kAnd) ? arg(1) : left;
      }
      case K::kIf:
        if (Truthy(arg(1))) return arg(0);
        return e.args[2] ? arg(2) : Undefined("the inline if-expression was false and has no else");
      case K::kBinary: {
        Value left = arg(0);
        return Binary(e.name, left, arg(1));
      }
      case K::kCompare: {
        Value left = arg(0);
        for (size_t k = 0; k < e.ops.size(); ++k) {
          Value right = arg(k + 1);
          if (!Compare(e.ops[k], left, right)) return Bool(false);
          left = std::move(right);
        }
        return Bool(true);
      }
    }
    return Undefined("");
  }

  Args EvalArgs(const Expr& e, Scope* scope) {
    Args args;
    const size_t first_keyword = e.args.size() - e.kwargs.size();
    for (size_t k = 1; k < e.args.size(); ++k) {
      Value v = Eval(*e.args[k], scope);
      if (k < first_keyword) {
        args.positional.push_back(std::move(v));
      } else {
        SetKey(&args.keywords, e.kwargs[k - first_keyword], std::move(v));
      }
    }
    line_ = e.line;
    return args;
  }

  Value EvalCall(const Expr& e, Scope* scope) {
    const Expr& callee = *e.args[0];
    Value function;
    if (callee.kind == Expr::Kind::kAttr) {  // A method: "a".strip(), message.get("x").
      Value object = Eval(*callee.args[0], scope);
      if (object.type == Type::kString || object.type == Type::kDict) {
        if (std::optional<Value> r = CallMethod(object, callee.name, EvalArgs(e, scope))) return *r;
      }
      function = GetAttr(object, callee.name);
    } else {
      function = Eval(callee, scope);
    }
    FailIfUndefined(function);
    if (function.type != Type::kFunction)
      Error("'" + TypeName(function) + "' object is not callable");
    const Args args = EvalArgs(e, scope);
    const std::string& name = *function.s;
    if (function.macro) {
      Value result = CallMacro(*function.macro, args);
      line_ = e.line;
      return result;
    }
    if (name == "strftime_now") return StrftimeNow(StringArg(args.Get(0, "format"), "format"));
    if (name == "raise_exception") {
      const Value* message = args.Get(0, "message");
      Throw(ErrorCode::kInvalidArgument, message ? ToText(*message) : "");
    }
    if (name == "namespace") {
      Dict attrs;
      if (const Value* init = args.Get(0, "")) {
        if (init->type != Type::kDict) Error("namespace() takes a dict or keyword arguments");
        attrs = *init->dict;
      }
      for (const auto& [key, value] : args.keywords) SetKey(&attrs, key, value);
      for (const auto& [key, value] : attrs) CheckNoNamespace(value);
      return MakeDict(std::move(attrs), Type::kNamespace);
    }
    int64_t bounds[3] = {0, 0, 1};  // range(stop) or range(start, stop[, step]).
    const size_t n = args.positional.size();
    if (n < 1 || n > 3) Error("range expected 1 to 3 arguments, got " + std::to_string(n));
    for (size_t k = 0; k < n; ++k) {
      if (!IsInt(args.positional[k])) Error("range() arguments must be integers");
      bounds[n == 1 ? 1 : k] = args.positional[k].i;
    }
    const auto [start, stop, step] = bounds;
    if (step == 0) Error("range() arg 3 must not be zero");
    const long double count = std::ceil((static_cast<long double>(stop) - start) / step);
    if (count > kMaxItems)
      Error("Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
    List items;
    for (int64_t k = 0; k < count; ++k) items.push_back(Int(start + k * step));
    return MakeList(std::move(items));
  }

  // The macro's output: its body rendered in a scope of its own above the template's top level,
  // with its parameters bound as Jinja binds them.
  Value CallMacro(const Stmt& macro, const Args& args) {
    const std::string& name = macro.text;
    const size_t n = macro.targets.size();
    if (args.positional.size() > n) {
      Error("macro '" + name + "' takes not more than " + std::to_string(n) + " argument(s)");
    }
    for (const auto& [key, value] : args.keywords) {
      const size_t k =
          std::find(macro.targets.begin(), macro.targets.end(), key) - macro.targets.begin();
      if (k == n) Error("macro '" + name + "' takes no keyword argument '" + key + "'");
      if (k < args.positional.size()) {
        Error("macro '" + name + "' got multiple values for argument '" + key + "'");
      }
    }
    if (call_depth_ >= kMaxCallDepth) {
      Exhausted("macro calls nest more than " + std::to_string(kMaxCallDepth) + " deep");
    }
    Scope frame{root_, {}};
    for (size_t k = 0; k < n; ++k) {
      const std::string& param = macro.targets[k];
      const Value* given = args.Get(k, param);
      Value value = given                 ? *given
                    : macro.conditions[k] ? Eval(*macro.conditions[k], &frame)
                                          : Undefined("parameter '" + param + "' was not provided");
      SetKey(&frame.vars, param, std::move(value));
    }
    ++call_depth_;
    std::string outer = std::move(out_);
    out_.clear();
    Exec(macro.body, &frame);
    --call_depth_;
    return String(std::exchange(out_, std::move(outer)));
  }

  // datetime.now().strftime(format) with the options' clock, through C's strftime as CPython's
  // is on Linux.
  Value StrftimeNow(const std::string& format) {
    CheckSize(format.size());
    Charge(format.size());
    const auto now = options_.clock ? options_.clock() : std::chrono::system_clock::now();
    const std::time_t t = std::chrono::system_clock::to_time_t(now);
    std::tm local{};
    if (!localtime_r(&t, &local)) Error("strftime_now: the time is out of range");
    // Each directive writes at most a few dozen bytes; an empty result is empty output only when
    // the buffer was large enough, so the buffer grows once.
    for (size_t size = format.size() * 8 + 64;; size *= 64) {
      std::string out(size, '\0');
      const size_t written = std::strftime(out.data(), out.size(), format.c_str(), &local);
      if (written > 0 || size > format.size() * 64) {
        out.resize(written);
        if (!IsValidUtf8(out)) Error("strftime_now: the result is not valid UTF-8");
        return NewString(std::move(out));
      }
    }
  }

  std::string StringArg(const Value* v, const std::string& what) {
    if (!v || v->type != Type::kString) Error(what + " must be a string");
    return *v->s;
  }

  // The `chars` argument of strip() and trim: null for whitespace.
  std::optional<std::string> CharsArg(const Args& args) {
    const Value* chars = args.Get(0, "chars");
    if (!chars || chars->type == Type::kNone) return std::nullopt;
    return StringArg(chars, "chars");
  }

  // String and dict methods; nullopt when `object` has no method `name`.
  std::optional<Value> CallMethod(const Value& object, const std::string& name, const Args& args) {
    if (object.type == Type::kDict) {
      if (name == "get") {
        const Value* key = args.Get(0, "key");
        const Value* found =
            key && key->type == Type::kString ? FindKey(*object.dict, *key->s) : nullptr;
        const Value* fallback = args.Get(1, "default");
        return found ? *found : fallback ? *fallback : None();
      }
      if (name != "items" && name != "keys" && name != "values") return std::nullopt;
      List items;
      for (const auto& [key, value] : *object.dict) {
        items.push_back(name == "items"  ? MakeList({String(key), value}, true)
                        : name == "keys" ? String(key)
                                         : value);
      }
      return MakeList(std::move(items));
    }
    const std::string& s = *object.s;
    Charge(s.size());
    if (name == "strip" || name == "lstrip" || name == "rstrip") {
      std::optional<std::string> chars = CharsArg(args);
      return NewString(Strip(s, chars ? &*chars : nullptr, name[0] != 'r', name[0] != 'l'));
    }
    if (name == "startswith" || name == "endswith") {
      const Value* arg = args.Get(0, "prefix");
      for (const Value& c :
           arg && arg->type == Type::kList ? *arg->list : List{arg ? *arg : Value()}) {
        const std::string affix = StringArg(&c, name + "() argument");
        if (name == "startswith" ? s.starts_with(affix) : s.ends_with(affix)) return Bool(true);
      }
      return Bool(false);
    }
    if (name == "upper" || name == "lower") return NewString(ChangeCase(s, name == "upper"));
    if (name == "split") return Split(s, args);
    if (name == "replace") {
      const std::string from = StringArg(args.Get(0, "old"), "replace() old");
      const std::string to = StringArg(args.Get(1, "new"), "replace() new");
      const Value* count = args.Get(2, "count");
      if (from.empty()) Error("replace() with an empty old string is not supported");
      std::string out;
      size_t pos = 0;
      for (int64_t left = count && IsInt(*count) ? count->i : -1; left != 0; --left) {
        const size_t hit = s.find(from, pos);
        if (hit == std::string::npos) break;
        out.append(s, pos, hit - pos).append(to);
        CheckSize(out.size());
        pos = hit + from.size();
      }
      return NewString(out + s.substr(pos));
    }
    return std::nullopt;
  }

  // str.split(sep=None, maxsplit=-1).
  Value Split(const std::string& s, const Args& args) {
    const Value* sep = args.Get(0, "sep");
    const Value* max_value = args.Get(1, "maxsplit");
    int64_t splits = max_value && IsInt(*max_value) ? max_value->i : -1;
    List parts;
    if (sep && sep->type != Type::kNone) {
      const std::string delimiter = StringArg(sep, "split() separator");
      if (delimiter.empty()) Error("empty separator");
      size_t pos = 0;
      for (size_t hit; splits-- != 0 && (hit = s.find(delimiter, pos)) != std::string::npos;) {
        parts.push_back(String(s.substr(pos, hit - pos)));
        pos = hit + delimiter.size();
      }
      parts.push_back(String(s.substr(pos)));
      return MakeList(std::move(parts));
    }
    const std::vector<size_t> at = CharOffsets(s);  // Runs of whitespace separate.
    auto space = [&](size_t k) { return IsPySpace(CharAt(s, at[k])); };
    for (size_t k = 0, end; k + 1 < at.size(); k = end) {
      while (k + 1 < at.size() && space(k)) ++k;
      if (k + 1 == at.size()) break;
      for (end = k; end + 1 < at.size() && (splits == 0 || !space(end));) ++end;
      --splits;
      parts.push_back(String(s.substr(at[k], at[end] - at[k])));
    }
    return MakeList(std::move(parts));
  }

  Value Filter(const std::string& name, const Value& v, const Args& args) {
    if (name == "default" || name == "d") {
      const Value* fallback = args.Get(0, "default_value");
      const Value* boolean = args.Get(1, "boolean");
      const bool replace =
          v.type == Type::kUndefined || (boolean && Truthy(*boolean) && !Truthy(v));
      return replace ? (fallback ? *fallback : String("")) : v;
    }
    if (name == "length" || name == "count") {
      if (v.type == Type::kUndefined) return Int(0);
      if (v.type == Type::kString) {
        Charge(v.s->size());
        return Int(std::count_if(v.s->begin(), v.s->end(), [](char c) {
          return (static_cast<unsigned char>(c) & 0xc0) != 0x80;  // Characters, not bytes.
        }));
      }
      if (v.type == Type::kList) return Int(static_cast<int64_t>(v.list->size()));
      if (v.type == Type::kDict) return Int(static_cast<int64_t>(v.dict->size()));
      Error("object of type '" + TypeName(v) + "' has no len()");
    }
    if (name == "tojson") {
      // transformers' tojson(x, ensure_ascii=False, indent=None, separators=None,
      // sort_keys=False): json.dumps with those.
      JsonStyle style;
      const Value* ascii = args.Get(0, "ensure_ascii");
      const Value* indent = args.Get(1, "indent");
      const Value* separators = args.Get(2, "separators");
      const Value* sort_keys = args.Get(3, "sort_keys");
      style.ascii = ascii && Truthy(*ascii);
      style.sort_keys = sort_keys && Truthy(*sort_keys);
      if (indent && indent->type != Type::kNone) {
        if (!IsInt(*indent)) Error("tojson indent must be an integer");
        style.indent = std::clamp<int64_t>(indent->i, 0, 64);
      }
      style.item_separator = style.indent < 0 ? ", " : ",";
      if (separators && separators->type != Type::kNone) {
        if (separators->type != Type::kList || separators->list->size() != 2 ||
            (*separators->list)[0].type != Type::kString ||
            (*separators->list)[1].type != Type::kString) {
          Error("tojson separators must be a pair of strings");
        }
        style.item_separator = *(*separators->list)[0].s;
        style.key_separator = *(*separators->list)[1].s;
      }
      std::string out;
      AppendJson(v, style, 0, &out);
      return NewString(std::move(out));
    }
    if (name == "join" || name == "list" || name == "first" || name == "last") {
      List items = Items(v);
      if (name == "list") return MakeList(std::move(items));
      if (name != "join") {
        if (items.empty()) return Undefined("No " + name + " item, sequence was empty.");
        return name == "first" ? items.front() : items.back();
      }
      const Value* separator = args.Get(0, "d");
      const std::string sep = separator ? ToText(*separator) : "";
      std::string out;
      for (size_t k = 0; k < items.size(); ++k) {
        out += (k ? sep : "") + ToText(items[k]);
        CheckSize(out.size());
      }
      return NewString(std::move(out));
    }
    std::string text = ToText(v);  // string, trim, upper, lower.
    if (name == "trim") {
      std::optional<std::string> chars = CharsArg(args);
      return NewString(Strip(text, chars ? &*chars : nullptr, true, true));
    }
    return NewString(name == "string" ? std::move(text)
                                      : ChangeCase(std::move(text), name == "upper"));
  }

  bool Test(const std::string& name, const Value& v) {
    const Type t = v.type;
    if (name == "defined" || name == "undefined")
      return (t == Type::kUndefined) == (name == "undefined");
    if (name == "none") return t == Type::kNone;
    if (name == "string") return t == Type::kString;
    if (name == "number") return IsNumber(v);
    if (name == "integer") return t == Type::kInt;
    if (name == "float") return t == Type::kFloat;
    if (name == "boolean") return t == Type::kBool;
    if (name == "true" || name == "false") return t == Type::kBool && v.i == (name == "true");
    if (name == "mapping") return t == Type::kDict;
    if (name == "even" || name == "odd") return Equal(Binary("%", v, Int(2)), Int(name == "odd"));
    // sequence, iterable: what has a length or can be looped over (Undefined too, in Jinja).
    return t == Type::kString || t == Type::kList || t == Type::kDict || t == Type::kUndefined;
  }

  // ---- operators ----

  Value Binary(const std::string& op, const Value& a, const Value& b) {
    if (op == "~") return NewString(ToText(a) + ToText(b));
    FailIfUndefined(a);
    FailIfUndefined(b);
    if (op == "+" && a.type == Type::kString && b.type == Type::kString) {
      CheckSize(a.s->size() + b.s->size());
      return NewString(*a.s + *b.s);
    }
    if (op == "+" && a.type == Type::kList && b.type == Type::kList) {
      if (a.tuple != b.tuple) Error("can only concatenate " + TypeName(a) + " to " + TypeName(a));
      CheckItems(a.list->size() + b.list->size());
      List items = *a.list;
      items.insert(items.end(), b.list->begin(), b.list->end());
      Charge(items.size());
      return MakeList(std::move(items), a.tuple);
    }
    const bool a_seq = a.type == Type::kString || a.type == Type::kList;
    const bool b_seq = b.type == Type::kString || b.type == Type::kList;
    if (op == "*" && a_seq != b_seq && IsInt(a_seq ? b : a)) {
      return Repeat(a_seq ? a : b, static_cast<uint64_t>(std::max<int64_t>(0, (a_seq ? b : a).i)));
    }
    if (!IsNumber(a) || !IsNumber(b)) {
      Error("unsupported operand type(s) for " + op + ": '" + TypeName(a) + "' and '" +
            TypeName(b) + "'");
    }
    if (IsInt(a) && IsInt(b) && op != "/") return IntArithmetic(op, a.i, b.i);
    const double x = AsDouble(a), y = AsDouble(b);
    if (op == "+") return Float(x + y);
    if (op == "-") return Float(x - y);
    if (op == "*") return Float(x * y);
    if (y == 0) Error(op == "/" ? "division by zero" : "float modulo or floor division by zero");
    if (op == "/") return Float(x / y);
    double mod = std::fmod(x, y);  // Python's: the result takes the divisor's sign.
    if (mod != 0 && (y < 0) != (mod < 0)) mod += y;
    return Float(op == "%" ? mod : std::floor(x / y));
  }

  Value Repeat(const Value& seq, uint64_t times) {  // "ab" * 3, [1] * 3.
    const bool text = seq.type == Type::kString;
    const uint64_t unit = text ? seq.s->size() : seq.list->size();
    const uint64_t limit = text ? options_.max_output_bytes : kMaxItems;
    if (unit != 0 && times > limit / unit) text ? CheckSize(limit + 1) : CheckItems(limit + 1);
    Charge(unit * times);
    if (text) {
      std::string out;
      for (uint64_t k = 0; k < times; ++k) out += *seq.s;
      return NewString(std::move(out));
    }
    List items;
    for (uint64_t k = 0; k < times; ++k)
      items.insert(items.end(), seq.list->begin(), seq.list->end());
    return MakeList(std::move(items), seq.tuple);
  }

  Value IntArithmetic(const std::string& op, int64_t x, int64_t y) {
    int64_t r = 0;
    bool overflow = false;
    if (op == "+") {
      overflow = __builtin_add_overflow(x, y, &r);
    } else if (op == "-") {
      overflow = __builtin_sub_overflow(x, y, &r);
    } else if (op == "*") {
      overflow = __builtin_mul_overflow(x, y, &r);
    } else {  // Python's floor division and modulo.
      if (y == 0) Error("integer division or modulo by zero");
      overflow = x == INT64_MIN && y == -1;
      int64_t q = overflow ? 0 : x / y, m = overflow ? 0 : x % y;
      if (m != 0 && (m < 0) != (y < 0)) {
        --q;
        m += y;
      }
      overflow &= op == "//";
      r = op == "//" ? q : m;
    }
    if (overflow) Error("integer overflow in '" + op + "'");
    return Int(r);
  }

  bool Compare(const std::string& op, const Value& a, const Value& b) {
    if (op == "==" || op == "!=") return Equal(a, b) == (op == "==");
    if (op == "in" || op == "not in") return Contains(b, a) == (op == "in");
    if (op == "<") return Less(a, b);
    if (op == ">") return Less(b, a);
    return !Less(op == "<=" ? b : a, op == "<=" ? a : b);
  }

  bool Equal(const Value& a, const Value& b) {
    if (IsNumber(a) && IsNumber(b)) {
      return IsInt(a) && IsInt(b) ? a.i == b.i : AsDouble(a) == AsDouble(b);
    }
    if (a.type != b.type) return false;
    if (a.type == Type::kString) {
      Charge(std::min(a.s->size(), b.s->size()));
      return *a.s == *b.s;
    }
    if (a.type == Type::kList) {
      const List &x = *a.list, &y = *b.list;
      if (x.size() != y.size() || a.tuple != b.tuple) return false;
      for (size_t k = 0; k < x.size(); ++k) {
        if (!Equal(x[k], y[k])) return false;
      }
      return true;
    }
    if (a.type == Type::kDict) {
      if (a.dict->size() != b.dict->size()) return false;
      for (const auto& [key, value] : *a.dict) {
        const Value* other = FindKey(*b.dict, key);
        if (!other || !Equal(value, *other)) return false;
      }
      return true;
    }
    if (a.type == Type::kNamespace) return a.dict == b.dict;
    return a.type != Type::kFunction || *a.s == *b.s;  // Undefined == Undefined, None == None.
  }

  bool Less(const Value& a, const Value& b) {
    FailIfUndefined(a);
    FailIfUndefined(b);
    if (IsNumber(a) && IsNumber(b))
      return IsInt(a) && IsInt(b) ? a.i < b.i : AsDouble(a) < AsDouble(b);
    if (a.type == Type::kString && b.type == Type::kString) {
      Charge(std::min(a.s->size(), b.s->size()));
      return *a.s < *b.s;  // UTF-8 byte order is code point order.
    }
    if (a.type == Type::kList && b.type == Type::kList && a.tuple == b.tuple) {
      const List &x = *a.list, &y = *b.list;
      for (size_t k = 0; k < x.size() && k < y.size(); ++k) {
        if (!Equal(x[k], y[k])) return Less(x[k], y[k]);
      }
      return x.size() < y.size();
    }
    Error("'<' not supported between instances of '" + TypeName(a) + "' and '" + TypeName(b) + "'");
  }

  bool Contains(const Value& container, const Value& needle) {  // needle in container
    if (container.type == Type::kUndefined) return false;
    if (container.type == Type::kDict) {
      if ((needle.type == Type::kList && !needle.tuple) || needle.type == Type::kDict) {
        Error("unhashable type: '" + TypeName(needle) + "'");
      }
      return needle.type == Type::kString && FindKey(*container.dict, *needle.s);
    }
    if (container.type == Type::kList) {
      return std::any_of(container.list->begin(), container.list->end(),
                         [&](const Value& item) { return Equal(item, needle); });
    }
    if (container.type != Type::kString) {
      Error("argument of type '" + TypeName(container) + "' is not iterable");
    }
    if (needle.type != Type::kString) {
      Error("'in <string>' requires string as left operand, not " + TypeName(needle));
    }
    Charge(container.s->size());
    return container.s->find(*needle.s) != std::string::npos;
  }

  // What a for loop visits: list items, a string's characters, a dict's keys.
  List Items(const Value& v) {
    if (v.type == Type::kUndefined) return {};
    if (v.type == Type::kList) return *v.list;
    List items;
    if (v.type == Type::kDict) {
      for (const auto& [key, value] : *v.dict) items.push_back(String(key));
      return items;
    }
    if (v.type != Type::kString) Error("'" + TypeName(v) + "' object is not iterable");
    const std::vector<size_t> at = CharOffsets(*v.s);
    if (at.size() - 1 > options_.max_loop_iterations) {
      Exhausted("a string longer than max_loop_iterations characters is iterated");
    }
    Charge(v.s->size());
    for (size_t k = 0; k + 1 < at.size(); ++k)
      items.push_back(String(v.s->substr(at[k], at[k + 1] - at[k])));
    return items;
  }

  Value GetAttr(const Value& object, const std::string& name) {
    FailIfUndefined(object);
    if (object.type == Type::kDict || object.type == Type::kNamespace) {
      if (const Value* v = FindKey(*object.dict, name)) return *v;
    }
    return Missing(object, "attribute '" + name + "'");
  }

  Value GetItem(const Value& object, const Value& key) {
    FailIfUndefined(object);
    if (key.type == Type::kString) return GetAttr(object, *key.s);
    if (IsInt(key) && (object.type == Type::kList || object.type == Type::kString)) {
      const bool list = object.type == Type::kList;
      if (!list) Charge(object.s->size());
      const std::vector<size_t> at = list ? std::vector<size_t>{} : CharOffsets(*object.s);
      const int64_t n = list ? object.list->size() : at.size() - 1;
      const int64_t k = key.i < 0 ? key.i + n : key.i;
      if (k >= 0 && k < n)
        return list ? (*object.list)[k] : String(object.s->substr(at[k], at[k + 1] - at[k]));
    }
    return Missing(object, "element " + ToText(key));
  }

  // Slices go straight to Python in Jinja: only lists, tuples and strings take them.
  Value EvalSlice(const Expr& e, Scope* scope) {
    Value object = Eval(*e.args[0], scope);
    std::optional<int64_t> bounds[3];
    for (int k = 0; k < 3; ++k) {
      if (!e.args[k + 1]) continue;
      Value v = Eval(*e.args[k + 1], scope);
      if (IsInt(v)) bounds[k] = v.i;
      if (!IsInt(v) && v.type != Type::kNone) Error("slice indices must be integers or None");
    }
    FailIfUndefined(object);
    const bool list = object.type == Type::kList;
    if (object.type == Type::kDict) Error("unhashable type: 'slice'");
    if (!list && object.type != Type::kString)
      Error("'" + TypeName(object) + "' object is not subscriptable");
    if (!list) Charge(object.s->size());
    const std::vector<size_t> at = list ? std::vector<size_t>{} : CharOffsets(*object.s);
    const int64_t n = list ? object.list->size() : at.size() - 1;
    int64_t step = bounds[2].value_or(1);
    if (step == 0) Error("slice step cannot be zero");
    step = std::clamp<int64_t>(step, -n - 1, n + 1);  // Visits the same items, never overflows.
    auto adjust = [&](std::optional<int64_t> v, int64_t fallback) {  // Python's slice.indices().
      if (!v) return fallback;
      if (*v < 0) return *v < -n ? (step < 0 ? -1 : 0) : *v + n;
      return *v >= n ? (step < 0 ? n - 1 : n) : *v;
    };
    const int64_t begin = adjust(bounds[0], step < 0 ? n - 1 : 0);
    const int64_t end = adjust(bounds[1], step < 0 ? -1 : n);
    List items;
    std::string text;
    for (int64_t k = begin; step > 0 ? k < end : k > end; k += step) {
      if (list) items.push_back((*object.list)[k]);
      if (!list) text.append(*object.s, at[k], at[k + 1] - at[k]);
    }
    Charge(items.size() + text.size());
    return list ? MakeList(std::move(items), object.tuple) : String(std::move(text));
  }

  // ---- text ----

  std::string ToText(const Value& v) {  // str(v), as Jinja prints it.
    switch (v.type) {
      case Type::kUndefined:
        return "";
      case Type::kNone:
        return "None";
      case Type::kBool:
        return v.i ? "True" : "False";
      case Type::kInt:
        return std::to_string(v.i);
      case Type::kFloat:
        return PyFloat(v.f);
      case Type::kString:
        return *v.s;
      case Type::kFunction:
        return "<function " + *v.s + ">";
      default: {
        std::string out;
        AppendRepr(v, &out);
        Charge(out.size());
        return out;
      }
    }
  }

  void AppendRepr(const Value& v, std::string* out) {  // repr(v).
    if (v.type == Type::kString) {
      AppendPyRepr(*v.s, out);
    } else if (v.type == Type::kUndefined) {
      *out += "Undefined";
    } else if (v.type == Type::kList) {
      *out += v.tuple ? '(' : '[';
      for (size_t k = 0; k < v.list->size(); ++k) {
        *out += k ? ", " : "";
        AppendRepr((*v.list)[k], out);
        CheckSize(out->size());
      }
      *out += v.tuple ? (v.list->size() == 1 ? ",)" : ")") : "]";
    } else if (v.type == Type::kDict || v.type == Type::kNamespace) {
      *out += v.type == Type::kNamespace ? "<Namespace {" : "{";
      for (size_t k = 0; k < v.dict->size(); ++k) {
        *out += k ? ", " : "";
        AppendPyRepr((*v.dict)[k].first, out);
        *out += ": ";
        AppendRepr((*v.dict)[k].second, out);
        CheckSize(out->size());
      }
      *out += v.type == Type::kNamespace ? "}>" : "}";
    } else {
      *out += ToText(v);
    }
  }

  struct JsonStyle {
    bool ascii = false;
    bool sort_keys = false;
    int64_t indent = -1;  // None.
    std::string item_separator = ", ";
    std::string key_separator = ": ";
  };

  // json.dumps(v, ensure_ascii=, indent=, separators=, sort_keys=) as `style` says.
  void AppendJson(const Value& v, const JsonStyle& style, int64_t level, std::string* out) {
    const int64_t indent = style.indent;
    if (v.type == Type::kNone || v.type == Type::kBool) {
      *out += v.type == Type::kNone ? "null" : v.i ? "true" : "false";
    } else if (v.type == Type::kInt) {
      *out += std::to_string(v.i);
    } else if (v.type == Type::kFloat) {
      *out += std::isnan(v.f)   ? "NaN"
              : std::isinf(v.f) ? (v.f > 0 ? "Infinity" : "-Infinity")
                                : PyFloat(v.f);
    } else if (v.type == Type::kString) {
      AppendJsonString(*v.s, style.ascii, out);
    } else if (v.type == Type::kList || v.type == Type::kDict) {
      const bool list = v.type == Type::kList;
      const size_t n = list ? v.list->size() : v.dict->size();
      std::vector<size_t> order(n);  // Of the dict's keys: as inserted, or sorted.
      for (size_t k = 0; k < n; ++k) order[k] = k;
      if (!list && style.sort_keys) {
        Charge(n * 8);
        std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
          return (*v.dict)[a].first < (*v.dict)[b].first;  // Code point order.
        });
      }
      *out += list ? '[' : '{';
      for (size_t k = 0; k < n; ++k) {
        if (k > 0) *out += style.item_separator;
        if (indent >= 0) out->append("\n").append((level + 1) * indent, ' ');
        if (!list) AppendJsonString((*v.dict)[order[k]].first, style.ascii, out);
        if (!list) *out += style.key_separator;
        AppendJson(list ? (*v.list)[k] : (*v.dict)[order[k]].second, style, level + 1, out);
        CheckSize(out->size());
      }
      if (indent >= 0 && n > 0) out->append("\n").append(level * indent, ' ');
      *out += list ? ']' : '}';
    } else {
      Error("Object of type " + TypeName(v) + " is not JSON serializable");
    }
  }

  const ChatTemplateOptions& options_;
  std::string out_;
  size_t iterations_ = 0;
  size_t work_ = 0;
  int line_ = 0;                 // Of what is being rendered, for messages.
  const Scope* root_ = nullptr;  // The template's top level, above every macro call's scope.
  int call_depth_ = 0;           // Macro calls in progress.
};

Value FromJson(const nlohmann::ordered_json& j, int depth) {
  using T = nlohmann::json::value_t;
  auto utf8 = [](const std::string& s) {
    if (!IsValidUtf8(s))
      Throw(ErrorCode::kInvalidArgument, "chat template: an input string is not valid UTF-8");
    return s;
  };
  if (depth > kMaxValueDepth) DepthAbove(depth);  // Fails before recursing deeper.
  if (j.is_null()) return None();
  if (j.is_boolean()) return Bool(j.get<bool>());
  if (j.type() == T::number_integer) return Int(j.get<int64_t>());
  if (j.type() == T::number_unsigned && j.get<uint64_t>() <= static_cast<uint64_t>(INT64_MAX)) {
    return Int(j.get<int64_t>());
  }
  if (j.is_number()) return Float(j.get<double>());
  if (j.is_string()) return String(utf8(j.get<std::string>()));
  if (j.is_array()) {
    List items;
    for (const auto& item : j) items.push_back(FromJson(item, depth + 1));
    return MakeList(std::move(items));
  }
  if (!j.is_object())
    Throw(ErrorCode::kInvalidArgument, "chat template: an input value is not plain JSON");
  Dict items;
  for (const auto& [key, item] : j.items()) SetKey(&items, utf8(key), FromJson(item, depth + 1));
  return MakeDict(std::move(items));
}

// The variables apply_chat_template passes (tools and documents are None when not given).
Dict ChatVariables(const std::vector<ChatMessage>& messages, const std::string& bos_token,
                   const std::string& eos_token, bool add_generation_prompt) {
  auto text = [](const std::string& s, const char* what) {
    if (!IsValidUtf8(s)) {
      Throw(ErrorCode::kInvalidArgument,
            std::string("chat template: ") + what + " is not valid UTF-8");
    }
    return String(s);
  };
  List list;
  for (const ChatMessage& m : messages) {
    list.push_back(MakeDict({{"role", text(m.role, "a message role")},
                             {"content", text(m.content, "a message content")}}));
  }
  return Dict{{"messages", MakeList(std::move(list))},
              {"bos_token", text(bos_token, "bos_token")},
              {"eos_token", text(eos_token, "eos_token")},
              {"add_generation_prompt", Bool(add_generation_prompt)},
              {"tools", None()},
              {"documents", None()}};
}

// Renders `body` with the variables that make_variables() returns (it may throw a Failure too).
template <class MakeVariables>
Result<std::string> Render(const std::vector<Stmt>& body, const ChatTemplateOptions& options,
                           const MakeVariables& make_variables) {
  try {
    return Renderer(options).Run(body, make_variables());
  } catch (const Failure& failure) {
    return failure.status;
  } catch (const std::exception& e) {  // std::bad_alloc and the like; not expected.
    return Internal(std::string("chat template: ") + e.what());
  }
}

}  // namespace
}  // namespace jinja

Result<std::string> ChatTemplate::Render(const std::vector<ChatMessage>& messages,
                                         const std::string& bos_token, const std::string& eos_token,
                                         bool add_generation_prompt) const {
  return jinja::Render(program_->body, program_->options, [&] {
    return jinja::ChatVariables(messages, bos_token, eos_token, add_generation_prompt);
  });
}

Result<std::string> ChatTemplate::Render(const nlohmann::ordered_json& variables) const {
  if (!variables.is_object()) {
    return InvalidArgument("chat template: variables must be a JSON object");
  }
  return jinja::Render(program_->body, program_->options, [&] {
    jinja::Dict globals;
    for (const auto& [key, value] : variables.items()) {
      jinja::SetKey(&globals, key, jinja::FromJson(value, 1));
    }
    return globals;
  });
}

}  // namespace fmoe
