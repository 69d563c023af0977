#include "common/text/tool_calls.h"

#include <algorithm>
#include <array>
#include <optional>
#include <utility>

#include "common/json.h"
#include "common/text/unicode.h"

namespace fmoe {
namespace {

using OrderedJson = nlohmann::ordered_json;  // Keeps the model's key order.

// Deeper JSON than this is not a call's arguments (and would recurse in nlohmann's parser).
constexpr int kMaxCallJsonDepth = 64;
// A name (or Kimi's call id) longer than this is not one.
constexpr size_t kMaxNameBytes = 256;
// Mistral's text between [TOOL_CALLS] and the arguments, harmony's header before <|message|>.
constexpr size_t kMaxHeaderBytes = 512;

// A call's text as the stream found it: `text` from its begin marker to where its body ends (its
// end marker excluded); the begin marker is text[0, begin_len).
struct Block {
  std::string_view text;
  size_t begin_len = 0;
  std::string_view body() const { return text.substr(begin_len); }
};

struct RawCall {
  std::string id;  // Empty: generated.
  std::string name;
  std::string arguments;
};

using ParseFn = bool (*)(const Block& block, const ToolCallOptions& options,
                         std::vector<RawCall>* out);

bool IsSpace(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f'; }

std::string_view Trim(std::string_view s) {
  while (!s.empty() && IsSpace(s.front())) s.remove_prefix(1);
  while (!s.empty() && IsSpace(s.back())) s.remove_suffix(1);
  return s;
}

bool StartsWith(std::string_view s, std::string_view prefix) {
  return s.substr(0, prefix.size()) == prefix;
}

// A function name: 1..kMaxNameBytes bytes, no whitespace, control characters, quotes or brackets.
bool ValidName(std::string_view name) {
  if (name.empty() || name.size() > kMaxNameBytes) return false;
  for (char c : name) {
    const auto u = static_cast<unsigned char>(c);
    if (u <= 0x20 || u == 0x7f) return false;
    if (std::string_view("\"'`<>{}[]").find(c) != std::string_view::npos) return false;
  }
  return true;
}

// False when `text` nests brackets deeper than kMaxCallJsonDepth (outside strings).
bool JsonDepthOk(std::string_view text) {
  int depth = 0;
  bool in_string = false, escape = false;
  for (char c : text) {
    if (in_string) {
      if (escape) {
        escape = false;
      } else if (c == '\\') {
        escape = true;
      } else if (c == '"') {
        in_string = false;
      }
    } else if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      if (++depth > kMaxCallJsonDepth) return false;
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
  return true;
}

// The JSON value `text` holds (whitespace around it allowed), or nullopt.
std::optional<OrderedJson> ParseJson(std::string_view text) {
  text = Trim(text);
  if (text.empty() || !JsonDepthOk(text)) return std::nullopt;
  try {
    OrderedJson j =
        OrderedJson::parse(text.begin(), text.end(), nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) return std::nullopt;
    return j;
  } catch (const nlohmann::json::exception&) {
    return std::nullopt;
  }
}

std::string Dump(const OrderedJson& j) {
  return j.dump(-1, ' ', /*ensure_ascii=*/false, OrderedJson::error_handler_t::replace);
}

// Arguments given as an object, or as a string holding one's JSON (null: none).
std::optional<std::string> ArgumentsOf(const OrderedJson& value) {
  if (value.is_null()) return std::string("{}");
  if (value.is_object()) return Dump(value);
  if (value.is_string()) {
    std::optional<OrderedJson> inner = ParseJson(value.get_ref<const std::string&>());
    if (inner && inner->is_object()) return Dump(*inner);
  }
  return std::nullopt;
}

// Arguments written as JSON text of an object.
bool ParseArguments(std::string_view text, std::string* out) {
  std::optional<OrderedJson> j = ParseJson(text);
  if (!j || !j->is_object()) return false;
  *out = Dump(*j);
  return true;
}

// {"name": "f", "arguments": {...}} (hermes, mistral's list form); "parameters" is taken for
// "arguments" as some fine-tunes write it.
bool CallFromObject(const OrderedJson& j, std::vector<RawCall>* out) {
  if (!j.is_object()) return false;
  auto name = j.find("name");
  if (name == j.end() || !name->is_string()) return false;
  RawCall call;
  call.name = name->get<std::string>();
  if (!ValidName(call.name)) return false;
  auto args = j.find("arguments");
  if (args == j.end()) args = j.find("parameters");
  std::optional<std::string> text = args == j.end() ? std::string("{}") : ArgumentsOf(*args);
  if (!text) return false;
  call.arguments = std::move(*text);
  out->push_back(std::move(call));
  return true;
}

std::string ToLower(std::string_view s) {
  std::string out(s);
  for (char& c : out) {
    if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  }
  return out;
}

// The JSON-schema type the request declares for `tool`'s argument `arg` ("" when none).
std::string_view ArgType(const ToolCallOptions& options, std::string_view tool,
                         std::string_view arg) {
  auto t = options.arg_types.find(tool);
  if (t == options.arg_types.end()) return "";
  auto a = t->second.find(arg);
  return a == t->second.end() ? std::string_view() : std::string_view(a->second);
}

// ---- the formats' parsers ----

// <tool_call>{"name": "f", "arguments": {...}}</tool_call>
bool ParseQwenCoder(std::string_view body, const ToolCallOptions& options,
                    std::vector<RawCall>* out);

// <tool_call>{"name": "f", "arguments": {...}}</tool_call>, or Qwen3-Coder's XML between the
// same markers (vLLM's qwen3_coder): <function=f><parameter=k>\nv\n</parameter></function>.
bool ParseHermes(const Block& block, const ToolCallOptions& options, std::vector<RawCall>* out) {
  std::string_view body = Trim(block.body());
  if (StartsWith(body, "<function=")) return ParseQwenCoder(body, options, out);
  std::optional<OrderedJson> j = ParseJson(body);
  return j && CallFromObject(*j, out);
}

// [TOOL_CALLS][{"name": "f", "arguments": {...}}, ...] (a lone object too), or the v11+ tokenizers'
// [TOOL_CALLS]f[ARGS]{...}, [TOOL_CALLS]f[CALL_ID]id[ARGS]{...} and [TOOL_CALLS]f{...}.
bool ParseMistral(const Block& block, const ToolCallOptions&, std::vector<RawCall>* out) {
  std::string_view body = Trim(block.body());
  if (body.empty()) return false;
  if (body[0] == '{' || body[0] == '[') {
    std::optional<OrderedJson> j = ParseJson(body);
    if (!j) return false;
    if (j->is_object()) return CallFromObject(*j, out);
    if (!j->is_array() || j->empty()) return false;
    for (const OrderedJson& item : *j) {
      if (!CallFromObject(item, out)) return false;
    }
    return true;
  }
  const size_t end = body.find_first_of("[{");
  if (end == std::string_view::npos) return false;
  RawCall call;
  call.name = std::string(Trim(body.substr(0, end)));
  if (!ValidName(call.name)) return false;
  std::string_view rest = body.substr(end);
  if (StartsWith(rest, "[CALL_ID]")) {
    const size_t args = rest.find("[ARGS]");
    if (args == std::string_view::npos) return false;
    rest = rest.substr(args);
  }
  if (StartsWith(rest, "[ARGS]")) rest.remove_prefix(std::string_view("[ARGS]").size());
  if (!ParseArguments(rest, &call.arguments)) return false;
  out->push_back(std::move(call));
  return true;
}

// V3/R1: function<｜tool▁sep｜>NAME\n```json\n{...}\n```; V3.1: NAME<｜tool▁sep｜>{...}.
bool ParseDeepSeek(const Block& block, const ToolCallOptions&, std::vector<RawCall>* out) {
  constexpr std::string_view kSep = "<｜tool▁sep｜>";
  std::string_view body = block.body();
  const size_t sep = body.find(kSep);
  if (sep == std::string_view::npos) return false;
  std::string_view before = Trim(body.substr(0, sep));
  std::string_view after = body.substr(sep + kSep.size());
  RawCall call;
  std::string_view args;
  const size_t nl = after.find('\n');
  if (nl != std::string_view::npos && StartsWith(Trim(after.substr(nl)), "```")) {
    call.name = std::string(Trim(after.substr(0, nl)));
    args = Trim(after.substr(nl));
    const size_t open_end = args.find('\n');  // The rest of the "```json" line.
    if (open_end == std::string_view::npos) return false;
    args = Trim(args.substr(open_end));
    if (args.size() < 3 || args.substr(args.size() - 3) != "```") return false;
    args.remove_suffix(3);
  } else {
    call.name = std::string(before);
    args = after;
  }
  if (!ValidName(call.name) || !ParseArguments(args, &call.arguments)) return false;
  out->push_back(std::move(call));
  return true;
}

// functions.NAME:IDX<|tool_call_argument_begin|>{...}; the call's id is functions.NAME:IDX.
bool ParseKimi(const Block& block, const ToolCallOptions&, std::vector<RawCall>* out) {
  constexpr std::string_view kArgs = "<|tool_call_argument_begin|>";
  std::string_view body = block.body();
  const size_t at = body.find(kArgs);
  if (at == std::string_view::npos) return false;
  std::string_view id = Trim(body.substr(0, at));
  const size_t colon = id.rfind(':');
  if (colon == std::string_view::npos || colon + 1 == id.size() || !ValidName(id)) return false;
  for (char c : id.substr(colon + 1)) {
    if (c < '0' || c > '9') return false;
  }
  std::string_view name = id.substr(0, colon);
  if (StartsWith(name, "functions.")) name.remove_prefix(std::string_view("functions.").size());
  RawCall call;
  call.id = std::string(id);
  call.name = std::string(name);
  if (!ValidName(call.name) || !ParseArguments(body.substr(at + kArgs.size()), &call.arguments)) {
    return false;
  }
  out->push_back(std::move(call));
  return true;
}

// NAME\n<arg_key>k</arg_key>\n<arg_value>v</arg_value>... A value is JSON when it parses as JSON
// (and the tool does not declare the argument a string), else a string (vLLM's glm4_moe).
bool ParseGlm(const Block& block, const ToolCallOptions& options, std::vector<RawCall>* out) {
  constexpr std::string_view kKey = "<arg_key>", kKeyEnd = "</arg_key>";
  constexpr std::string_view kValue = "<arg_value>", kValueEnd = "</arg_value>";
  std::string_view body = block.body();
  const size_t name_end = std::min(body.find('\n'), body.find(kKey));
  RawCall call;
  call.name = std::string(Trim(body.substr(0, name_end)));
  if (!ValidName(call.name)) return false;
  OrderedJson args = OrderedJson::object();
  for (size_t at = body.find(kKey); at != std::string_view::npos; at = body.find(kKey, at)) {
    const size_t key_end = body.find(kKeyEnd, at);
    if (key_end == std::string_view::npos) return false;
    const size_t value = body.find(kValue, key_end);
    if (value == std::string_view::npos) return false;
    if (!Trim(body.substr(key_end + kKeyEnd.size(), value - key_end - kKeyEnd.size())).empty()) {
      return false;
    }
    const size_t value_end = body.find(kValueEnd, value);
    if (value_end == std::string_view::npos) return false;
    const std::string key =
        ToValidUtf8(Trim(body.substr(at + kKey.size(), key_end - at - kKey.size())));
    std::string_view text =
        Trim(body.substr(value + kValue.size(), value_end - value - kValue.size()));
    std::optional<OrderedJson> j;
    if (ArgType(options, call.name, key) != "string") j = ParseJson(text);
    args[key] = j ? std::move(*j) : OrderedJson(ToValidUtf8(text));
    at = value_end + kValueEnd.size();
  }
  call.arguments = Dump(args);
  out->push_back(std::move(call));
  return true;
}

// An argument written as text (MiniMax-M2, Qwen3-Coder), by the type the tool declares (none: a
// string), as vLLM converts them.
OrderedJson TypedValue(std::string_view text, std::string_view type) {
  if (ToLower(text) == "null") return OrderedJson(nullptr);
  const std::string t = ToLower(type.empty() ? "string" : type);
  if (t == "string" || t == "str" || t == "text") return OrderedJson(ToValidUtf8(text));
  if (t == "boolean" || t == "bool") {
    const std::string v = ToLower(text);
    return OrderedJson(v == "true" || v == "1");
  }
  std::optional<OrderedJson> j = ParseJson(text);
  if (j) {
    const bool fits = (t == "integer" || t == "int")    ? j->is_number_integer()
                      : (t == "number" || t == "float") ? j->is_number()
                      : (t == "object")                 ? j->is_object()
                      : (t == "array")                  ? j->is_array()
                                                        : true;
    if (fits) return std::move(*j);
  }
  return OrderedJson(ToValidUtf8(text));
}

// <function=NAME><parameter=K>\nV\n</parameter>...</function>; one newline around a value is
// dropped, and a parameter may end where the next begins.
bool ParseQwenCoder(std::string_view body, const ToolCallOptions& options,
                    std::vector<RawCall>* out) {
  constexpr std::string_view kFunction = "<function=", kFunctionEnd = "</function>";
  constexpr std::string_view kParam = "<parameter=", kParamEnd = "</parameter>";
  const size_t gt = body.find('>');
  const size_t end = body.rfind(kFunctionEnd);
  if (!StartsWith(body, kFunction) || gt == std::string_view::npos ||
      end == std::string_view::npos || end < gt ||
      !Trim(body.substr(end + kFunctionEnd.size())).empty()) {
    return false;
  }
  RawCall call;
  call.name = std::string(Trim(body.substr(kFunction.size(), gt - kFunction.size())));
  if (!ValidName(call.name)) return false;
  std::string_view inner = body.substr(gt + 1, end - gt - 1);
  OrderedJson args = OrderedJson::object();
  for (size_t p = inner.find(kParam); p != std::string_view::npos; p = inner.find(kParam, p)) {
    const size_t start = p + kParam.size();
    const size_t close = inner.find(kParamEnd, start);
    const size_t stop = std::min({close, inner.find(kParam, start), inner.size()});
    std::string_view param = inner.substr(start, stop - start);
    p = stop == close ? close + kParamEnd.size() : stop;
    const size_t p_gt = param.find('>');
    if (p_gt == std::string_view::npos) return false;
    const std::string key = ToValidUtf8(Trim(param.substr(0, p_gt)));
    std::string_view value = param.substr(p_gt + 1);
    if (StartsWith(value, "\n")) value.remove_prefix(1);
    if (!value.empty() && value.back() == '\n') value.remove_suffix(1);
    args[key] = TypedValue(value, ArgType(options, call.name, key));
  }
  call.arguments = Dump(args);
  out->push_back(std::move(call));
  return true;
}

// A quoted (or bare) name="..." attribute's value: the text up to '>' without quotes.
std::string_view AttributeName(std::string_view s) {
  s = Trim(s);
  if (s.size() >= 2 && (s.front() == '"' || s.front() == '\'') && s.back() == s.front()) {
    s = s.substr(1, s.size() - 2);
  }
  return s;
}

// <invoke name="f"><parameter name="k">v</parameter>...</invoke>..., each invoke a call.
bool ParseMiniMax(const Block& block, const ToolCallOptions& options, std::vector<RawCall>* out) {
  constexpr std::string_view kInvoke = "<invoke name=", kInvokeEnd = "</invoke>";
  constexpr std::string_view kParam = "<parameter name=", kParamEnd = "</parameter>";
  std::string_view body = block.body();
  std::vector<RawCall> calls;
  for (size_t at = body.find(kInvoke); at != std::string_view::npos; at = body.find(kInvoke, at)) {
    const size_t end = body.find(kInvokeEnd, at);
    if (end == std::string_view::npos) return false;
    std::string_view invoke = body.substr(at + kInvoke.size(), end - at - kInvoke.size());
    at = end + kInvokeEnd.size();
    const size_t gt = invoke.find('>');
    if (gt == std::string_view::npos) return false;
    RawCall call;
    call.name = std::string(AttributeName(invoke.substr(0, gt)));
    if (!ValidName(call.name)) return false;
    OrderedJson args = OrderedJson::object();
    for (size_t p = invoke.find(kParam); p != std::string_view::npos; p = invoke.find(kParam, p)) {
      const size_t p_end = invoke.find(kParamEnd, p);
      if (p_end == std::string_view::npos) return false;
      std::string_view param = invoke.substr(p + kParam.size(), p_end - p - kParam.size());
      p = p_end + kParamEnd.size();
      const size_t p_gt = param.find('>');
      if (p_gt == std::string_view::npos) return false;
      const std::string key = ToValidUtf8(AttributeName(param.substr(0, p_gt)));
      args[key] = TypedValue(Trim(param.substr(p_gt + 1)), ArgType(options, call.name, key));
    }
    call.arguments = Dump(args);
    calls.push_back(std::move(call));
  }
  if (calls.empty()) return false;
  for (RawCall& c : calls) out->push_back(std::move(c));
  return true;
}

constexpr std::string_view kHarmonyMessage = "<|message|>";
constexpr std::string_view kHarmonyRecipient = "to=functions.";
// What ends a harmony message.
const std::vector<std::string_view> kHarmonyEnds = {"<|call|>", "<|end|>", "<|return|>"};

// A harmony message [<|start|>assistant][ to=functions.NAME]<|channel|>commentary[ to=functions.
// NAME][ <|constrain|>json]<|message|>{...}; its body must be a JSON object.
bool ParseHarmony(const Block& block, const ToolCallOptions&, std::vector<RawCall>* out) {
  const size_t msg = block.text.find(kHarmonyMessage, block.begin_len);
  if (msg == std::string_view::npos) return false;
  std::string_view header = block.text.substr(0, msg);
  const size_t to = header.find(kHarmonyRecipient);
  if (to == std::string_view::npos) return false;
  std::string_view name = header.substr(to + kHarmonyRecipient.size());
  name = name.substr(0, std::min(name.find_first_of(" \t\n\r<"), name.size()));
  RawCall call;
  call.name = std::string(name);
  if (!ValidName(call.name) ||
      !ParseArguments(block.text.substr(msg + kHarmonyMessage.size()), &call.arguments)) {
    return false;
  }
  out->push_back(std::move(call));
  return true;
}

bool ParseNothing(const Block&, const ToolCallOptions&, std::vector<RawCall>*) { return false; }

}  // namespace

// A format: the markers that open and close a section of calls (deepseek, kimi) and a call, and
// the call's parser. Mistral's calls end with their JSON and harmony's with the message, found by
// ToolCallStream itself.
struct ToolCallSpec {
  ToolCallFormat format;
  std::string_view name;
  std::vector<std::string_view> section_begins;
  std::vector<std::string_view> section_ends;
  std::vector<std::string_view> call_begins;
  std::vector<std::string_view> call_ends;
  bool accept_unterminated;  // At Finish, a call without its end is parsed all the same.
  ParseFn parse;
  // What ProcessText looks for: section begins and call begins, in a section its end and calls.
  std::vector<std::string_view> text_markers = {};
  std::vector<std::string_view> section_markers = {};
};

namespace {

const std::vector<ToolCallSpec>& Specs() {
  static const std::vector<ToolCallSpec> specs = [] {
    std::vector<ToolCallSpec> all = {
        {ToolCallFormat::kNone, "none", {}, {}, {}, {}, false, ParseNothing},
        // vLLM's hermes parser also takes a last <tool_call> without </tool_call>.
        {ToolCallFormat::kHermes,
         "hermes",
         {},
         {},
         {"<tool_call>"},
         {"</tool_call>"},
         true,
         ParseHermes},
        {ToolCallFormat::kMistral, "mistral", {}, {}, {"[TOOL_CALLS]"}, {}, false, ParseMistral},
        {ToolCallFormat::kDeepSeekV3,
         "deepseek_v3",
         {"<｜tool▁calls▁begin｜>"},
         {"<｜tool▁calls▁end｜>"},
         {"<｜tool▁call▁begin｜>"},
         {"<｜tool▁call▁end｜>"},
         false,
         ParseDeepSeek},
        {ToolCallFormat::kKimiK2,
         "kimi_k2",
         {"<|tool_calls_section_begin|>", "<|tool_call_section_begin|>"},
         {"<|tool_calls_section_end|>", "<|tool_call_section_end|>"},
         {"<|tool_call_begin|>"},
         {"<|tool_call_end|>"},
         false,
         ParseKimi},
        {ToolCallFormat::kGlm45,
         "glm45",
         {},
         {},
         {"<tool_call>"},
         {"</tool_call>"},
         false,
         ParseGlm},
        // <|call|> is a stop token, so the text may end without it.
        {ToolCallFormat::kGptOss,
         "gpt_oss",
         {},
         {},
         {"<|start|>", "<|channel|>"},
         {},
         true,
         ParseHarmony},
        {ToolCallFormat::kMiniMaxM2,
         "minimax_m2",
         {},
         {},
         {"<minimax:tool_call>"},
         {"</minimax:tool_call>"},
         false,
         ParseMiniMax},
    };
    for (ToolCallSpec& s : all) {
      s.text_markers = s.section_begins;
      s.text_markers.insert(s.text_markers.end(), s.call_begins.begin(), s.call_begins.end());
      s.section_markers = s.section_ends;
      s.section_markers.insert(s.section_markers.end(), s.call_begins.begin(), s.call_begins.end());
    }
    return all;
  }();
  return specs;
}

const ToolCallSpec& SpecOf(ToolCallFormat format) {
  for (const ToolCallSpec& s : Specs()) {
    if (s.format == format) return s;
  }
  return Specs()[0];
}

}  // namespace

std::vector<std::string_view> ToolCallMarkers(ToolCallFormat format) {
  const ToolCallSpec& spec = SpecOf(format);
  std::vector<std::string_view> out;
  for (const auto* list :
       {&spec.section_begins, &spec.section_ends, &spec.call_begins, &spec.call_ends}) {
    out.insert(out.end(), list->begin(), list->end());
  }
  switch (format) {
    case ToolCallFormat::kMistral:
      out.insert(out.end(), {"[ARGS]", "[CALL_ID]"});
      break;
    case ToolCallFormat::kDeepSeekV3:
      out.push_back("<｜tool▁sep｜>");
      break;
    case ToolCallFormat::kKimiK2:
      out.push_back("<|tool_call_argument_begin|>");
      break;
    case ToolCallFormat::kGlm45:
      out.insert(out.end(), {"<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"});
      break;
    case ToolCallFormat::kGptOss:
      out.insert(out.end(), {"<|message|>", "<|constrain|>", "<|call|>", "<|end|>", "<|return|>"});
      break;
    default:
      break;
  }
  return out;
}

namespace {

// The length of the longest suffix of `text` that is a proper prefix of one of `markers`.
size_t HeldBack(std::string_view text, const std::vector<std::string_view>& markers) {
  size_t best = 0;
  for (std::string_view m : markers) {
    for (size_t n = std::min(text.size(), m.size() - 1); n > best; --n) {
      if (text.substr(text.size() - n) == m.substr(0, n)) {
        best = n;
        break;
      }
    }
  }
  return best;
}

// The first of `markers` in text[from, limit): its offset (npos: none) and length.
std::pair<size_t, size_t> FindFirst(std::string_view text, size_t from, size_t limit,
                                    const std::vector<std::string_view>& markers) {
  std::pair<size_t, size_t> best = {std::string_view::npos, 0};
  text = text.substr(0, std::min(limit, text.size()));
  for (std::string_view m : markers) {
    const size_t at = text.find(m, std::min(from, text.size()));
    if (at < best.first ||
        (at == best.first && at != std::string_view::npos && m.size() > best.second)) {
      best = {at, m.size()};
    }
  }
  return best;
}

size_t MaxLength(const std::vector<std::string_view>& markers) {
  size_t n = 0;
  for (std::string_view m : markers) n = std::max(n, m.size());
  return n;
}

uint64_t SplitMix64(uint64_t* state) {
  uint64_t z = (*state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// "call_" and 24 alphanumerics, or Mistral's 9 alphanumerics; the same for the same seed and index.
std::string MakeId(ToolCallFormat format, uint64_t seed, size_t index) {
  constexpr std::string_view kAlphabet =
      "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
  uint64_t state = seed ^ (0xD1B54A32D192ED03ull * (index + 1));
  const bool mistral = format == ToolCallFormat::kMistral;
  std::string id = mistral ? "" : "call_";
  const size_t n = mistral ? 9 : 24;
  for (size_t i = 0; i < n; ++i) id += kAlphabet[SplitMix64(&state) % kAlphabet.size()];
  return id;
}

}  // namespace

Result<ToolCallFormat> ParseToolCallFormat(std::string_view name) {
  for (const ToolCallSpec& s : Specs()) {
    if (s.name == name) return s.format;
  }
  if (name == "deepseek_v31" || name == "deepseekv3" || name == "deepseekv31") {
    return ToolCallFormat::kDeepSeekV3;
  }
  if (name == "glm4_moe") return ToolCallFormat::kGlm45;
  if (name == "qwen3_coder") return ToolCallFormat::kHermes;
  if (name == "openai") return ToolCallFormat::kGptOss;
  return InvalidArgument("tool call parser \"" + ToValidUtf8(name.substr(0, 64)) +
                         "\" is not one of none, hermes, mistral, deepseek_v3, kimi_k2, glm45, "
                         "gpt_oss, minimax_m2");
}

std::string_view ToolCallFormatName(ToolCallFormat format) { return SpecOf(format).name; }

ToolCallFormat ToolCallFormatFor(std::string_view architecture, bool kimi_tokenizer) {
  struct Entry {
    std::string_view architecture;
    ToolCallFormat format;
  };
  static constexpr std::array<Entry, 8> kTable = {{
      {"Qwen2MoeForCausalLM", ToolCallFormat::kHermes},
      {"Qwen3MoeForCausalLM", ToolCallFormat::kHermes},
      {"MixtralForCausalLM", ToolCallFormat::kMistral},
      {"DeepseekV2ForCausalLM", ToolCallFormat::kDeepSeekV3},
      {"DeepseekV3ForCausalLM", ToolCallFormat::kDeepSeekV3},
      {"Glm4MoeForCausalLM", ToolCallFormat::kGlm45},
      {"GptOssForCausalLM", ToolCallFormat::kGptOss},
      {"MiniMaxM2ForCausalLM", ToolCallFormat::kMiniMaxM2},
  }};
  for (const Entry& e : kTable) {
    if (e.architecture != architecture) continue;
    if (e.format == ToolCallFormat::kDeepSeekV3 && kimi_tokenizer) return ToolCallFormat::kKimiK2;
    return e.format;
  }
  return ToolCallFormat::kNone;
}

ParsedToolCalls ParseToolCalls(ToolCallFormat format, std::string_view text,
                               const ToolCallOptions& options) {
  ToolCallStream stream(format, options);
  ParsedToolCalls out;
  for (ToolCallStreamDelta d : {stream.Feed(text), stream.Finish()}) {
    out.content += d.content;
    for (ToolCallDelta& c : d.tool_calls) {
      out.calls.push_back({std::move(c.id), std::move(c.name), std::move(c.arguments)});
    }
  }
  return out;
}

ToolCallStream::ToolCallStream(ToolCallFormat format, ToolCallOptions options)
    : spec_(&SpecOf(format)), options_(std::move(options)) {
  Reset();
}

void ToolCallStream::Reset() {
  // Harmony's output may open with a header (the prompt ends in <|start|>assistant).
  mode_ = spec_->format == ToolCallFormat::kGptOss ? Mode::kCall : Mode::kText;
  in_section_ = false;
  trim_ = false;
  begin_len_ = 0;
  scan_ = 0;
  json_depth_ = 0;
  json_in_string_ = json_escape_ = false;
  json_start_ = 0;
  buf_.clear();
  pending_.clear();
}

ToolCallStreamDelta ToolCallStream::Feed(std::string_view piece) {
  ToolCallStreamDelta out;
  buf_.append(piece);
  if (options_.forced == ToolCallOptions::Forced::kNone) Process(/*final=*/false, &out);
  return out;
}

ToolCallStreamDelta ToolCallStream::FinishForced() {
  ToolCallStreamDelta out;
  std::vector<RawCall> calls;
  std::string_view text = buf_;
  if (spec_->format == ToolCallFormat::kGptOss) {
    // A harmony call's arguments end with <|call|> where it is not a stop token.
    for (std::string_view end : kHarmonyEnds) {
      if (text.ends_with(end)) {
        text.remove_suffix(end.size());
        break;
      }
    }
  }
  if (std::optional<OrderedJson> j = ParseJson(text)) {
    if (options_.forced == ToolCallOptions::Forced::kNamed && j->is_object()) {
      calls.push_back({"", options_.forced_name, Dump(*j)});
    } else if (options_.forced == ToolCallOptions::Forced::kList && j->is_array()) {
      for (const OrderedJson& c : *j) {
        auto name = c.is_object() ? c.find("name") : c.end();
        auto params = c.is_object() ? c.find("parameters") : c.end();
        if (name == c.end() || !name->is_string() || name->get<std::string>().empty() ||
            params == c.end() || !params->is_object() || calls.size() == kMaxCalls) {
          calls.clear();
          break;
        }
        calls.push_back({"", name->get<std::string>(), Dump(*params)});
      }
    }
  }
  if (calls.empty()) {
    out.content = ToValidUtf8(buf_);
  } else {
    for (RawCall& c : calls) {
      ToolCallDelta d;
      d.index = calls_++;
      d.id = MakeId(spec_->format, options_.id_seed, d.index);
      d.name = ToValidUtf8(c.name);
      d.arguments = std::move(c.arguments);
      out.tool_calls.push_back(std::move(d));
    }
  }
  Reset();
  return out;
}

ToolCallStreamDelta ToolCallStream::Finish() {
  if (options_.forced != ToolCallOptions::Forced::kNone) return FinishForced();
  ToolCallStreamDelta out;
  Process(/*final=*/true, &out);
  out.content += ToValidUtf8(pending_);
  Reset();
  return out;
}

void ToolCallStream::EmitContent(std::string_view text, ToolCallStreamDelta* out) {
  if (text.empty()) return;
  pending_.append(text);
  const size_t n = pending_.size() - IncompleteUtf8Tail(pending_);
  out->content += ToValidUtf8(std::string_view(pending_).substr(0, n));
  pending_.erase(0, n);
}

void ToolCallStream::Process(bool final, ToolCallStreamDelta* out) {
  while (mode_ == Mode::kText ? ProcessText(final, out) : ProcessCall(final, out)) {
  }
}

// Content up to the next marker; returns false when it needs more text.
bool ToolCallStream::ProcessText(bool final, ToolCallStreamDelta* out) {
  if (trim_) {
    const size_t k =
        std::find_if(buf_.begin(), buf_.end(), [](char c) { return !IsSpace(c); }) - buf_.begin();
    buf_.erase(0, k);
    if (buf_.empty()) return false;
    trim_ = false;
  }
  if (buf_.empty()) return false;
  const std::vector<std::string_view>& opens =
      in_section_ ? spec_->section_ends : spec_->section_begins;
  const std::vector<std::string_view>& markers =
      in_section_ ? spec_->section_markers : spec_->text_markers;
  const auto [at, len] = FindFirst(buf_, 0, buf_.size(), markers);
  if (at == std::string::npos) {
    const size_t keep = final ? 0 : HeldBack(buf_, markers);
    EmitContent(std::string_view(buf_).substr(0, buf_.size() - keep), out);
    buf_.erase(0, buf_.size() - keep);
    return false;
  }
  EmitContent(std::string_view(buf_).substr(0, at), out);
  const std::string_view marker = std::string_view(buf_).substr(at, len);
  const bool section = std::find(opens.begin(), opens.end(), marker) != opens.end();
  if (section) {
    buf_.erase(0, at + len);
    in_section_ = !in_section_;
    trim_ = true;
    return true;
  }
  buf_.erase(0, at);
  mode_ = Mode::kCall;
  begin_len_ = len;
  scan_ = len;
  json_depth_ = 0;
  json_in_string_ = json_escape_ = false;
  json_start_ = 0;
  return true;
}

namespace {

// Where a call's text ends, as far as the text so far tells.
struct CallEnd {
  enum Kind {
    kNeedMore,
    kBlock,    // A call's text: buf[0, body_end) parsed, buf[0, block_end) consumed.
    kNotCall,  // Its begin marker is content; the text after it is read again.
    kPassOn,   // Harmony: a message to no function; buf[0, block_end) is content.
  } kind = kNeedMore;
  size_t body_end = 0;
  size_t block_end = 0;
  bool unterminated = false;
};

}  // namespace

bool ToolCallStream::ProcessCall(bool final, ToolCallStreamDelta* out) {
  const std::string_view buf = buf_;
  const size_t window = std::min(buf.size(), kMaxCallBytes);
  const bool over = buf.size() >= kMaxCallBytes;  // No end within kMaxCallBytes: not a call.
  CallEnd end;
  // The end among `ends` (those in `kept` are not consumed), searched from scan_ on.
  auto find_end = [&](const std::vector<std::string_view>& ends,
                      const std::vector<std::string_view>& kept, size_t from_min) {
    const size_t overlap = std::max(MaxLength(ends), MaxLength(kept));
    const size_t from = std::max(from_min, scan_ >= overlap ? scan_ - overlap : 0);
    const auto [at, len] = FindFirst(buf, from, window, ends);
    const auto [kept_at, kept_len] = FindFirst(buf, from, window, kept);
    if (at != std::string_view::npos && at <= kept_at)
      return CallEnd{CallEnd::kBlock, at, at + len};
    if (kept_at != std::string_view::npos) return CallEnd{CallEnd::kBlock, kept_at, kept_at};
    scan_ = window;
    if (final && !over && spec_->accept_unterminated) {
      return CallEnd{CallEnd::kBlock, buf.size(), buf.size(), true};
    }
    return CallEnd{final || over ? CallEnd::kNotCall : CallEnd::kNeedMore};
  };

  if (spec_->format == ToolCallFormat::kMistral) {
    if (json_start_ == 0) {
      // Skip to the arguments: [ or { right away, or NAME[CALL_ID]ID[ARGS] / NAME[ARGS] / NAME.
      const size_t limit = std::min(buf.size(), begin_len_ + kMaxHeaderBytes);
      size_t p = begin_len_;
      while (p < limit && IsSpace(buf[p])) ++p;
      auto need_more = [&] {
        return CallEnd{final || buf.size() >= begin_len_ + kMaxHeaderBytes ? CallEnd::kNotCall
                                                                           : CallEnd::kNeedMore};
      };
      auto is_name = [](char c) {
        return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
               c == '_' || c == '-' || c == '.';
      };
      // kBlock: found `tag` at p; kNeedMore: a prefix of it; kNotCall: something else.
      auto tag_at = [&](std::string_view tag) {
        const std::string_view rest = buf.substr(p, std::min(tag.size(), limit - p));
        if (rest == tag) return CallEnd::kBlock;
        return StartsWith(tag, rest) ? CallEnd::kNeedMore : CallEnd::kNotCall;
      };
      CallEnd::Kind state = CallEnd::kBlock;
      if (p == limit) {
        end = need_more();
      } else if (buf[p] == '{' || (buf[p] == '[' && tag_at("[ARGS]") == CallEnd::kNotCall &&
                                   tag_at("[CALL_ID]") == CallEnd::kNotCall)) {
        json_start_ = p;
      } else if (buf[p] == '[') {
        end = tag_at("[ARGS]") == CallEnd::kBlock || tag_at("[CALL_ID]") == CallEnd::kBlock
                  ? CallEnd{CallEnd::kNotCall}
                  : need_more();
      } else if (!is_name(buf[p])) {
        end = CallEnd{CallEnd::kNotCall};
      } else {
        while (p < limit && is_name(buf[p])) ++p;
        if (p < limit && buf[p] == '[') {
          const CallEnd::Kind id_tag = tag_at("[CALL_ID]");
          if (id_tag == CallEnd::kBlock) {
            p += std::string_view("[CALL_ID]").size();
            while (p < limit && is_name(buf[p])) ++p;
            state = p == limit ? CallEnd::kNeedMore : tag_at("[ARGS]");
          } else {
            state = tag_at("[ARGS]");
            if (state == CallEnd::kNotCall && id_tag == CallEnd::kNeedMore) {
              state = CallEnd::kNeedMore;
            }
          }
          if (state == CallEnd::kBlock) {
            p += std::string_view("[ARGS]").size();
            while (p < limit && IsSpace(buf[p])) ++p;
            if (p < limit && buf[p] != '{') state = CallEnd::kNotCall;
          }
        }
        if (state == CallEnd::kNotCall) {
          end = CallEnd{CallEnd::kNotCall};
        } else if (p == limit || state == CallEnd::kNeedMore) {
          end = need_more();
        } else if (buf[p] == '{') {
          json_start_ = p;
        } else {
          end = CallEnd{CallEnd::kNotCall};
        }
      }
      if (json_start_ != 0) scan_ = json_start_;
    }
    if (json_start_ != 0) {
      // The arguments' JSON ends where its brackets balance (strings skipped).
      end = CallEnd{CallEnd::kNeedMore};
      for (; scan_ < window; ++scan_) {
        const char c = buf[scan_];
        if (json_in_string_) {
          if (json_escape_) {
            json_escape_ = false;
          } else if (c == '\\') {
            json_escape_ = true;
          } else if (c == '"') {
            json_in_string_ = false;
          }
        } else if (c == '"') {
          json_in_string_ = true;
        } else if (c == '{' || c == '[') {
          if (++json_depth_ > kMaxCallJsonDepth) {
            end = CallEnd{CallEnd::kNotCall};
            break;
          }
        } else if ((c == '}' || c == ']') && --json_depth_ == 0) {
          end = CallEnd{CallEnd::kBlock, scan_ + 1, scan_ + 1};
          break;
        }
      }
      if (end.kind == CallEnd::kNeedMore && (final || over)) end = CallEnd{CallEnd::kNotCall};
    }
  } else if (spec_->format == ToolCallFormat::kGptOss) {
    static const std::vector<std::string_view> kNext = {"<|start|>", "<|channel|>"};
    if (json_start_ == 0) {
      // The header: <|message|> within kMaxHeaderBytes, no message end before it.
      const size_t limit = begin_len_ + kMaxHeaderBytes + kHarmonyMessage.size();
      const size_t msg = FindFirst(buf, begin_len_, limit, {kHarmonyMessage}).first;
      const size_t stop = FindFirst(buf, begin_len_, limit, kHarmonyEnds).first;
      if (stop < msg) {
        end = CallEnd{CallEnd::kNotCall};
      } else if (msg == std::string_view::npos) {
        end = CallEnd{final || buf.size() >= limit ? CallEnd::kNotCall : CallEnd::kNeedMore};
      } else if (buf.substr(0, msg).find(kHarmonyRecipient) == std::string_view::npos) {
        end = CallEnd{CallEnd::kPassOn, 0, msg + kHarmonyMessage.size()};
      } else {
        json_start_ = msg + kHarmonyMessage.size();
        scan_ = json_start_;
      }
    }
    if (json_start_ != 0) end = find_end(kHarmonyEnds, kNext, json_start_);
  } else {
    end = find_end(spec_->call_ends, {}, begin_len_);
  }

  switch (end.kind) {
    case CallEnd::kNeedMore:
      return false;
    case CallEnd::kNotCall:
      EmitContent(buf.substr(0, begin_len_), out);
      buf_.erase(0, begin_len_);
      mode_ = Mode::kText;
      return true;
    case CallEnd::kPassOn:
      EmitContent(buf.substr(0, end.block_end), out);
      buf_.erase(0, end.block_end);
      mode_ = Mode::kText;
      return true;
    case CallEnd::kBlock:
      break;
  }
  std::vector<RawCall> calls;
  const Block block{buf.substr(0, end.body_end), begin_len_};
  const bool ok =
      spec_->parse(block, options_, &calls) && !calls.empty() && calls_ + calls.size() <= kMaxCalls;
  mode_ = Mode::kText;
  if (!ok && end.unterminated) {  // Read again as text after the begin marker.
    EmitContent(buf.substr(0, begin_len_), out);
    buf_.erase(0, begin_len_);
    return true;
  }
  if (!ok) {
    EmitContent(buf.substr(0, end.block_end), out);
  } else {
    for (RawCall& c : calls) {
      ToolCallDelta d;
      d.index = calls_++;
      d.id = c.id.empty() ? MakeId(spec_->format, options_.id_seed, d.index) : ToValidUtf8(c.id);
      d.name = ToValidUtf8(c.name);
      d.arguments = std::move(c.arguments);
      out->tool_calls.push_back(std::move(d));
    }
    trim_ = true;
  }
  buf_.erase(0, end.block_end);
  return true;
}

}  // namespace fmoe
