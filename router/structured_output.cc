#include "router/structured_output.h"

#include <algorithm>
#include <initializer_list>
#include <optional>
#include <string_view>

#include <utility>

#include "common/text/grammar.h"
#include "common/text/json_schema.h"

namespace fmoe {
namespace {

using Json = nlohmann::json;

// The top-level parameter a field belongs to: "response_format.json_schema.schema" ->
// "response_format", "tools[0].function.parameters" -> "tools".
std::string ParamOf(const std::string& field) { return field.substr(0, field.find_first_of(".[")); }

// No schema or grammar constrains the output yet.
bool OnlyConstraint(const std::string& param, const CompletionRequest& out, HttpResponse* error) {
  if (out.sampling.json_schema.empty() && out.sampling.grammar.empty()) return true;
  return Refuse(error, BadParam(param,
                                "only one of response_format, structured_outputs, guided_json, "
                                "guided_regex, guided_choice, guided_grammar and a forced "
                                "tool_choice may constrain the output"));
}

// The schema, compiled here first; `field` names it in errors.
bool SetSchema(const Json& schema, const std::string& field, CompletionRequest* out,
               HttpResponse* error) {
  const std::string param = ParamOf(field);
  if (!OnlyConstraint(param, *out, error)) return false;
  if (!schema.is_object() && !schema.is_boolean()) {
    return Refuse(error, BadParam(param, field + " must be a JSON Schema object, not " +
                                             JsonTypeName(schema)));
  }
  // Deeper than the compiler takes anyway; bounded before the recursive dump.
  if (JsonDepth(schema) > 2 * kMaxSchemaDepth + 8) {
    return Refuse(error, BadParam(param, field + " nests deeper than " +
                                             std::to_string(kMaxSchemaDepth) + " schemas"));
  }
  std::string text = JsonText(schema);
  if (text.size() > kMaxSchemaBytes) {
    return Refuse(error, BadParam(param, field + " is larger than " +
                                             std::to_string(kMaxSchemaBytes) + " bytes"));
  }
  auto grammar = CompileJsonSchema(text);
  if (!grammar.ok()) {
    return Refuse(error,
                  BadParam(param, field + ": " + grammar.status().message(), "unsupported_schema"));
  }
  out->sampling.json_schema = std::move(text);
  return true;
}

// A schema given as an object or as its JSON text (vLLM takes both).
bool SetSchemaOrText(const Json& v, const std::string& field, CompletionRequest* out,
                     HttpResponse* error) {
  if (v.is_string()) {
    Json parsed = Json::parse(v.get<std::string>(), nullptr, /*allow_exceptions=*/false);
    if (parsed.is_discarded()) {
      return Refuse(error, BadParam(ParamOf(field), field + " is a string that is not JSON"));
    }
    return SetSchema(parsed, field, out, error);
  }
  return SetSchema(v, field, out, error);
}

// A tool's parameters moved to #/$defs/<base> of a larger schema: its local $refs ("#/...")
// rebased there. The depth is bounded by SetSchema's check before.
void RebaseRefs(Json& v, const std::string& base) {
  if (v.is_object()) {
    for (auto& [key, sub] : v.items()) {
      if (key == "$ref" && sub.is_string() && sub.get<std::string>().starts_with("#")) {
        sub = "#/$defs/" + base + sub.get<std::string>().substr(1);
      } else if (key != "enum" && key != "const") {
        RebaseRefs(sub, base);
      }
    }
  } else if (v.is_array()) {
    for (Json& e : v) RebaseRefs(e, base);
  }
}

const Json& AnyObject() {
  static const Json schema = {{"type", "object"}};
  return schema;
}

// Whether every member of `object` is one of `allowed`; else names the first other in *problem.
bool OnlyMembers(const Json& object, std::initializer_list<std::string_view> allowed,
                 const std::string& at, std::string* problem) {
  for (const auto& [key, value] : object.items()) {
    if (std::find(allowed.begin(), allowed.end(), key) != allowed.end()) continue;
    *problem = at + "." + key + " is not supported by this server";
    return false;
  }
  return true;
}

// xgrammar's structural tag `format` (what newer clients and vLLM send): a "triggered_tags"
// format whose tags each hold a "json_schema" content is the language of the structures and
// triggers form (free text; each trigger starts one of the tags: begin, a JSON value of the
// schema, end; free text again), and becomes that form, with its at_least_one and
// stop_after_first when true. Every other format or content type, an end that is not one
// string, and any member this translation does not read are refused by name.
bool TranslateTagFormat(const Json& format, const std::string& at, Json* canonical,
                        std::string* problem) {
  if (!format.is_object()) {
    *problem = at + " must be an object, not " + JsonTypeName(format);
    return false;
  }
  const Json type = format.value("type", Json());
  if (type != "triggered_tags") {
    const std::string what = type.is_string()
                                 ? "\"" + type.get<std::string>() + "\" is not supported"
                             : type.is_null() ? "is missing"
                                              : "must be a string";
    *problem = at + ".type " + what +
               ": this server takes \"triggered_tags\" (tags of json_schema content)";
    return false;
  }
  if (!OnlyMembers(format, {"type", "triggers", "tags", "at_least_one", "stop_after_first"}, at,
                   problem)) {
    return false;
  }
  std::vector<std::string> flags;
  for (const char* flag : {"at_least_one", "stop_after_first"}) {
    auto it = format.find(flag);
    if (it == format.end()) continue;
    if (!it->is_boolean()) {
      *problem = at + "." + flag + " must be true or false";
      return false;
    }
    if (it->get<bool>()) flags.emplace_back(flag);
  }
  auto tags = format.find("tags");
  if (tags == format.end() || !tags->is_array() || tags->empty()) {
    *problem = at + ".tags must be a non-empty array of tags";
    return false;
  }
  Json structures = Json::array();
  for (size_t i = 0; i < tags->size(); ++i) {
    const Json& tag = (*tags)[i];
    const std::string where = at + ".tags[" + std::to_string(i) + "]";
    if (!tag.is_object()) {
      *problem = where + " must be an object";
      return false;
    }
    if (!OnlyMembers(tag, {"type", "begin", "content", "end"}, where, problem)) return false;
    if (tag.contains("type") && tag["type"] != "tag") {
      *problem = where + ".type must be \"tag\"";
      return false;
    }
    if (!tag.value("begin", Json()).is_string()) {
      *problem = where + ".begin must be a string";
      return false;
    }
    Json end = tag.value("end", Json());
    if (end.is_array() && end.size() == 1) end = end[0];
    if (!end.is_string()) {
      *problem = where + ".end must be a string";
      return false;
    }
    const Json content = tag.value("content", Json());
    if (!content.is_object() || content.value("type", Json()) != "json_schema" ||
        !content.contains("json_schema")) {
      *problem = where + ".content must be {\"type\": \"json_schema\", \"json_schema\": ...}" +
                 (content.is_object() && content.value("type", Json()).is_string()
                      ? " (\"" + content["type"].get<std::string>() + "\" is not supported)"
                      : "");
      return false;
    }
    if (!OnlyMembers(content, {"type", "json_schema"}, where + ".content", problem)) return false;
    structures.push_back(
        {{"begin", tag.value("begin", Json())}, {"schema", content["json_schema"]}, {"end", end}});
  }
  *canonical = {{"structures", std::move(structures)},
                {"triggers", format.value("triggers", Json())}};
  for (const std::string& flag : flags) (*canonical)[flag] = true;
  return true;
}

// A structural tag ({"structures": [{"begin", "schema", "end"}, ...], "triggers": [...]}, or
// xgrammar's {"format": {"type": "triggered_tags", ...}}, as an object or as its JSON text),
// compiled here first and sent as its canonical spec.
bool SetStructuralTag(const Json& v, const std::string& field, CompletionRequest* out,
                      HttpResponse* error) {
  const std::string param = ParamOf(field);
  if (!OnlyConstraint(param, *out, error)) return false;
  // Nothing is copied or written out (recursive code) before the nesting is bounded.
  Json parsed;
  if (v.is_string()) {
    parsed = Json::parse(v.get<std::string>(), nullptr, /*allow_exceptions=*/false);
    if (parsed.is_discarded()) {
      return Refuse(error, BadParam(param, "'" + field + "' is a string that is not JSON"));
    }
  }
  const Json& spec = v.is_string() ? parsed : v;
  if (JsonDepth(spec) > 2 * kMaxSchemaDepth + 8) {
    return Refuse(error, BadParam(param, field + " nests deeper than " +
                                             std::to_string(kMaxSchemaDepth) + " schemas"));
  }
  if (!spec.is_object()) {
    return Refuse(error,
                  BadParam(param, "'" + field + "' must be an object, not " + JsonTypeName(spec)));
  }
  // The members the compiler reads; vLLM's name for a structure's schema is taken too.
  Json canonical;
  const bool translated = spec.contains("format");
  if (auto format = spec.find("format"); format != spec.end()) {
    std::string problem;
    if (!TranslateTagFormat(*format, field + ".format", &canonical, &problem)) {
      return Refuse(error, BadParam(param, problem, "unsupported_structural_tag"));
    }
  } else {
    canonical = {{"structures", spec.value("structures", Json())},
                 {"triggers", spec.value("triggers", Json())}};
  }
  if (canonical["structures"].is_array()) {
    for (Json& s : canonical["structures"]) {
      if (s.is_object() && !s.contains("schema") && s.contains("structure_schema")) {
        s["schema"] = std::move(s["structure_schema"]);
        s.erase("structure_schema");
      }
    }
  }
  std::string text = JsonText(canonical);
  if (text.size() > kMaxSchemaBytes) {
    return Refuse(error, BadParam(param, field + " is larger than " +
                                             std::to_string(kMaxSchemaBytes) + " bytes"));
  }
  auto grammar = CompileStructuralTag(text);
  if (!grammar.ok()) {
    // The compiler's message starts "structural tag ": it names the member after it.
    std::string what = grammar.status().message();
    if (what.starts_with("structural tag"))
      what = what.substr(std::string("structural tag").size());
    // A translated format's members by the names the client gave them.
    if (translated && what.starts_with(" structures[")) {
      what = ".format.tags[" + what.substr(std::string(" structures[").size());
      if (const size_t at = what.find("].schema"); at != std::string::npos) {
        what.replace(at, std::string("].schema").size(), "].content.json_schema");
      }
    } else if (translated && what.starts_with(" triggers")) {
      what = ".format." + what.substr(1);
    }
    return Refuse(error, BadParam(param, field + what, "unsupported_structural_tag"));
  }
  out->sampling.grammar = std::move(text);
  out->sampling.grammar_syntax = GrammarSyntax::kStructuralTag;
  return true;
}

bool ReadResponseFormat(const Json& j, CompletionRequest* out, HttpResponse* error) {
  auto rf = j.find("response_format");
  if (rf == j.end() || rf->is_null()) return true;
  if (!rf->is_object()) {
    return Refuse(error, BadParam("response_format",
                                  "'response_format' must be an object, not " + JsonTypeName(*rf)));
  }
  auto type = rf->find("type");
  if (type == rf->end() || !type->is_string()) {
    return Refuse(error,
                  BadParam("response_format",
                           "'response_format.type' must be a string, not " +
                               (type == rf->end() ? std::string("missing") : JsonTypeName(*type))));
  }
  const std::string& t = type->get_ref<const std::string&>();
  if (t == "text") return true;
  if (t == "json_object") return SetSchema(AnyObject(), "response_format", out, error);
  if (t == "json_schema") {
    auto js = rf->find("json_schema");
    if (js == rf->end() || !js->is_object()) {
      return Refuse(error, BadParam("response_format",
                                    "'response_format.json_schema' must be an object with a "
                                    "'schema'"));
    }
    if (auto name = js->find("name"); name != js->end() && !name->is_null() && !name->is_string()) {
      return Refuse(error, BadParam("response_format",
                                    "'response_format.json_schema.name' must be a "
                                    "string"));
    }
    auto schema = js->find("schema");
    if (schema == js->end() || schema->is_null()) {
      return Refuse(error,
                    BadParam("response_format", "'response_format.json_schema.schema' is missing"));
    }
    // "strict": decoding is always constrained to the schema, strict or not.
    return SetSchema(*schema, "response_format.json_schema.schema", out, error);
  }
  if (t == "structural_tag") return SetStructuralTag(*rf, "response_format", out, error);
  return Refuse(error, BadParam("response_format",
                                "'response_format.type' must be \"text\", \"json_object\", "
                                "\"json_schema\" or \"structural_tag\""));
}

// A regex, a grammar (GBNF) or a choice (a list of strings), compiled here first.
bool SetGrammar(const Json& v, const std::string& kind, const std::string& field,
                CompletionRequest* out, HttpResponse* error) {
  const std::string param = ParamOf(field);
  if (!OnlyConstraint(param, *out, error)) return false;
  Result<std::shared_ptr<const JsonGrammar>> grammar = InvalidArgument("");
  if (kind == "choice") {
    if (!v.is_array()) {
      return Refuse(error, BadParam(param, "'" + field + "' must be an array of strings, not " +
                                               JsonTypeName(v)));
    }
    std::vector<std::string> choices;
    for (const Json& c : v) {
      if (!c.is_string()) {
        return Refuse(error, BadParam(param, "'" + field + "' must be an array of strings, not " +
                                                 "one with a " + JsonTypeName(c)));
      }
      choices.push_back(c.get<std::string>());
    }
    grammar = CompileChoice(choices);
    if (grammar.ok()) out->sampling.grammar = ChoiceGrammar(choices);
    out->sampling.grammar_syntax = GrammarSyntax::kGbnf;
  } else {
    if (!v.is_string()) {
      return Refuse(error,
                    BadParam(param, "'" + field + "' must be a string, not " + JsonTypeName(v)));
    }
    const std::string& text = v.get_ref<const std::string&>();
    const bool regex = kind == "regex";
    grammar = regex ? CompileRegex(text) : CompileGrammar(text);
    if (grammar.ok()) out->sampling.grammar = text;
    out->sampling.grammar_syntax = regex ? GrammarSyntax::kRegex : GrammarSyntax::kGbnf;
  }
  if (!grammar.ok()) {
    out->sampling.grammar.clear();
    return Refuse(
        error, BadParam(param, field + ": " + grammar.status().message(), "unsupported_" + kind));
  }
  if (out->sampling.grammar.empty()) {  // An empty regex or grammar text: refused as such.
    return Refuse(error, BadParam(param, "'" + field + "' is empty"));
  }
  return true;
}

bool ReadVllmStructuredOutputs(const Json& j, CompletionRequest* out, HttpResponse* error) {
  auto so = j.find("structured_outputs");
  if (so != j.end() && !so->is_null()) {
    if (!so->is_object()) {
      return Refuse(error,
                    BadParam("structured_outputs", "'structured_outputs' must be an object"));
    }
    if (auto it = so->find("structural_tag"); it != so->end() && !it->is_null()) {
      if (!SetStructuralTag(*it, "structured_outputs.structural_tag", out, error)) return false;
    }
    for (const char* key : {"regex", "choice", "grammar"}) {
      if (auto it = so->find(key); it != so->end() && !it->is_null()) {
        if (!SetGrammar(*it, key, std::string("structured_outputs.") + key, out, error)) {
          return false;
        }
      }
    }
    if (auto it = so->find("json"); it != so->end() && !it->is_null()) {
      if (!SetSchemaOrText(*it, "structured_outputs.json", out, error)) return false;
    }
    if (auto it = so->find("json_object"); it != so->end() && !it->is_null()) {
      if (!it->is_boolean()) {
        return Refuse(error, BadParam("structured_outputs",
                                      "'structured_outputs.json_object' must be a boolean"));
      }
      if (it->get<bool>() &&
          !SetSchema(AnyObject(), "structured_outputs.json_object", out, error)) {
        return false;
      }
    }
  }
  if (auto g = j.find("guided_json"); g != j.end() && !g->is_null()) {
    if (!SetSchemaOrText(*g, "guided_json", out, error)) return false;
  }
  for (const char* key : {"regex", "choice", "grammar"}) {
    const std::string param = std::string("guided_") + key;
    if (auto g = j.find(param); g != j.end() && !g->is_null()) {
      if (!SetGrammar(*g, key, param, out, error)) return false;
    }
  }
  return true;
}

}  // namespace

bool ReadStructuredOutput(const Json& body, CompletionRequest* out, HttpResponse* error) {
  return ReadResponseFormat(body, out, error) && ReadVllmStructuredOutputs(body, out, error);
}

namespace {

// tools[k]'s parameters (any object when it has none), set as `into`'s schema, which compiles
// them alone so that an error names the tool; nullopt with *error set when they are refused.
std::optional<Json> ToolParameters(const nlohmann::ordered_json& tools, size_t k,
                                   CompletionRequest* into, HttpResponse* error) {
  const auto& fn = tools[k]["function"];
  Json params = AnyObject();
  if (auto p = fn.find("parameters"); p != fn.end() && p->is_object()) {
    params = Json::parse(p->dump());
  }
  if (!SetSchema(params, "tools[" + std::to_string(k) + "].function.parameters", into, error)) {
    return std::nullopt;
  }
  return params;
}

}  // namespace

bool ForceToolChoice(const std::string& named, const nlohmann::ordered_json& tools,
                     CompletionRequest* out, HttpResponse* error) {
  Json alternatives = Json::array();
  Json defs = Json::object();
  for (size_t k = 0; k < tools.size(); ++k) {
    const std::string name = tools[k]["function"]["name"].get<std::string>();
    if (!named.empty()) {
      if (name != named) continue;
      out->tool_options.forced = ToolCallOptions::Forced::kNamed;
      out->tool_options.forced_name = name;
      return ToolParameters(tools, k, out, error).has_value();
    }
    CompletionRequest probe;
    std::optional<Json> params = ToolParameters(tools, k, &probe, error);
    if (!params) return false;
    const std::string base = "fmoe_tool_" + std::to_string(k);
    RebaseRefs(*params, base);
    defs[base] = std::move(*params);
    alternatives.push_back(
        {{"type", "object"},
         {"properties",
          {{"name", {{"const", name}}}, {"parameters", {{"$ref", "#/$defs/" + base}}}}},
         {"required", {"name", "parameters"}}});
  }
  if (!named.empty()) {
    return Refuse(error, BadParam("tool_choice", "tool_choice names the function \"" + named +
                                                     "\", which is not in 'tools'"));
  }
  out->tool_options.forced = ToolCallOptions::Forced::kList;
  const Json list = {{"type", "array"},
                     {"minItems", 1},
                     {"items", {{"anyOf", alternatives}}},
                     {"$defs", std::move(defs)}};
  return SetSchema(list, "tool_choice", out, error);
}

bool ForceHarmonyCall(const nlohmann::ordered_json& tools, const Tokenizer& tokenizer,
                      CompletionRequest* out, HttpResponse* error) {
  if (!OnlyConstraint("tool_choice", *out, error)) return false;
  Json token_ids = Json::object();
  for (const char* marker : {"<|channel|>", "<|message|>", "<|call|>"}) {
    const std::optional<int32_t> id = tokenizer.TokenToId(marker);
    if (!id) {
      return Refuse(error, BadParam("tool_choice",
                                    std::string("this model's vocabulary has no ") + marker +
                                        " token; use \"auto\"",
                                    "unsupported_parameter"));
    }
    token_ids[marker] = *id;
  }
  Json structures = Json::array();
  for (size_t k = 0; k < tools.size(); ++k) {
    const std::string name = tools[k]["function"]["name"].get<std::string>();
    if (name.find("<|") != std::string::npos ||
        name.find_first_of(" \t\n\r") != std::string::npos) {
      return Refuse(error, BadParam("tool_choice", "the function \"" + ToValidUtf8(name) +
                                                       "\" cannot be forced in the gpt_oss "
                                                       "(harmony) format: its name holds "
                                                       "whitespace or \"<|\", which a call's "
                                                       "header cannot carry"));
    }
    CompletionRequest probe;
    std::optional<Json> params = ToolParameters(tools, k, &probe, error);
    if (!params) return false;
    structures.push_back(
        {{"begin", " to=functions." + name + "<|channel|>commentary json<|message|>"},
         {"schema", std::move(*params)},
         {"end", "<|call|>"}});
  }
  const Json spec = {{"triggers", {" to=functions."}},
                     {"structures", std::move(structures)},
                     {"at_least_one", true},
                     {"stop_after_first", true},
                     {"token_ids", std::move(token_ids)}};
  std::string text = JsonText(spec);
  if (text.size() > kMaxSchemaBytes) {
    return Refuse(error, BadParam("tool_choice", "the tools' parameters are larger than " +
                                                     std::to_string(kMaxSchemaBytes) + " bytes"));
  }
  auto grammar = CompileStructuralTag(text);
  if (!grammar.ok()) {
    return Refuse(error, BadParam("tool_choice", grammar.status().message(), "unsupported_schema"));
  }
  out->sampling.grammar = std::move(text);
  out->sampling.grammar_syntax = GrammarSyntax::kStructuralTag;
  return true;
}

}  // namespace fmoe
