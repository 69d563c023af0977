#include "router/completion_request.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <limits>
#include <set>
#include <span>

#include "common/json.h"
#include "common/process_util.h"
#include "common/text/unicode.h"
#include "common/wire/sampling_limits.h"
#include "router/structured_output.h"

namespace fmoe {
namespace {

using Json = nlohmann::json;

// Parameters this server does not implement: refused unless at their neutral value.
bool Unsupported(const std::string& key, const Json& v) {
  if (v.is_null()) return false;
  if (key == "best_of") return !(v.is_number_integer() && v.get<int64_t>() == 1);
  if (key == "suffix") return !(v.is_string() && v.get<std::string>().empty());
  if (key == "prompt_logprobs") return true;
  if (key == "use_beam_search" || key == "include_stop_str_in_output") {
    return !(v.is_boolean() && !v.get<bool>());
  }
  return false;
}

// (guided_json, guided_regex, guided_choice, guided_grammar and structured_outputs are
// structured output: structured_output.cc.)
constexpr const char* kUnsupported[] = {"best_of", "suffix", "prompt_logprobs", "use_beam_search",
                                        "include_stop_str_in_output"};

// A finite number parameter (absent or null: `def`), as a float: beyond float's range it is
// float's largest, which no range admits. Its range is CheckSampling's (after the parse). False
// with *error set when it is not a number.
bool ReadFloat(const Json& j, const char* key, float def, float* out, HttpResponse* error) {
  *out = def;
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return true;
  if (!it->is_number() || !std::isfinite(it->get<double>())) {
    *error = BadParam(key, std::string("'") + key + "' must be a number, not " + JsonTypeName(*it));
    return false;
  }
  constexpr double kMost = std::numeric_limits<float>::max();
  *out = static_cast<float>(std::clamp(it->get<double>(), -kMost, kMost));
  return true;
}

// An integer parameter that fits int32_t (absent or null: `def`); its range is CheckSampling's.
bool ReadInt32(const Json& j, const char* key, int32_t def, int32_t* out, HttpResponse* error) {
  *out = def;
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return true;
  if (!it->is_number_integer() || (it->is_number_unsigned() ? it->get<uint64_t>() > INT32_MAX
                                                            : it->get<int64_t>() < INT32_MIN ||
                                                                  it->get<int64_t>() > INT32_MAX)) {
    *error = BadParam(key, std::string("'") + key + "' must be an integer");
    return false;
  }
  *out = static_cast<int32_t>(it->get<int64_t>());
  return true;
}

// An integer parameter in [lo, hi].
bool ReadCount(const Json& j, const char* key, uint64_t lo, uint64_t hi, uint64_t def,
               uint64_t* out, HttpResponse* error) {
  *out = def;
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return true;
  if (!it->is_number_integer() || (!it->is_number_unsigned() && it->get<int64_t>() < 0) ||
      it->get<uint64_t>() < lo || it->get<uint64_t>() > hi) {
    *error = BadParam(key, std::string("'") + key + "' must be an integer from " +
                               std::to_string(lo) + " to " + std::to_string(hi));
    return false;
  }
  *out = it->get<uint64_t>();
  return true;
}

// An assistant message's tool_calls, as the templates take them: [{id, type: "function",
// function: {name, arguments}}], arguments an object (a client's JSON text is parsed, as vLLM
// does, since the templates iterate over it).
bool ReadToolCalls(const Json& calls, const std::string& at, nlohmann::ordered_json* out,
                   std::string* problem) {
  if (!calls.is_array() || calls.size() > kMaxToolCalls) {
    *problem = at + " must be an array of at most " + std::to_string(kMaxToolCalls) + " calls";
    return false;
  }
  *out = nlohmann::ordered_json::array();
  for (size_t k = 0; k < calls.size(); ++k) {
    const Json& call = calls[k];
    const std::string call_at = at + "[" + std::to_string(k) + "]";
    if (!call.is_object()) {
      *problem = call_at + " must be an object, not " + JsonTypeName(call);
      return false;
    }
    if (auto type = call.find("type");
        type != call.end() && !type->is_null() && *type != Json("function")) {
      *problem = call_at + ".type must be \"function\"";
      return false;
    }
    auto fn = call.find("function");
    if (fn == call.end() || !fn->is_object()) {
      *problem = call_at + ".function must be an object {name, arguments}";
      return false;
    }
    auto name = fn->find("name");
    if (name == fn->end() || !name->is_string() || name->get<std::string>().empty()) {
      *problem = call_at + ".function.name must be a non-empty string";
      return false;
    }
    nlohmann::ordered_json arguments = nlohmann::ordered_json::object();
    if (auto args = fn->find("arguments"); args != fn->end() && !args->is_null()) {
      if (!args->is_string() && JsonDepth(*args) > kMaxToolJsonDepth) {
        *problem =
            call_at + ".function.arguments nests deeper than " + std::to_string(kMaxToolJsonDepth);
        return false;
      }
      if (args->is_string()) {
        const Json parsed = Json::parse(args->get<std::string>(), nullptr, false);
        if (!parsed.is_discarded() && JsonDepth(parsed) > kMaxToolJsonDepth) {
          *problem = call_at + ".function.arguments nests deeper than " +
                     std::to_string(kMaxToolJsonDepth);
          return false;
        }
        arguments = nlohmann::ordered_json::parse(args->get<std::string>(), nullptr, false);
      } else {
        arguments = nlohmann::ordered_json::parse(args->dump(), nullptr, false);
      }
      if (arguments.is_discarded() || !arguments.is_object()) {
        *problem = call_at + ".function.arguments must be a JSON object (or its text)";
        return false;
      }
    }
    nlohmann::ordered_json c = nlohmann::ordered_json::object();
    if (auto id = call.find("id"); id != call.end() && !id->is_null()) {
      if (!id->is_string()) {
        *problem = call_at + ".id must be a string";
        return false;
      }
      c["id"] = id->get<std::string>();
    }
    c["type"] = "function";
    c["function"] = {{"name", name->get<std::string>()}, {"arguments", std::move(arguments)}};
    out->push_back(std::move(c));
  }
  return true;
}

// The chat messages' text: content as a string, or an array of {"type": "text", "text": ...}
// parts (joined), or null for an assistant turn without text. With `rendered`, also the messages
// as the template takes them with tools (role, content, an assistant's tool_calls, a tool
// message's tool_call_id and name); *with_tools says whether any message has those.
bool ReadMessages(const Json& messages, std::vector<ChatMessage>* out, HttpResponse* error,
                  nlohmann::ordered_json* rendered = nullptr, bool* with_tools = nullptr) {
  auto bad = [&](const std::string& message) {
    *error = BadParam("messages", message);
    return false;
  };
  if (!messages.is_array() || messages.empty()) {
    return bad("'messages' must be a non-empty array of {role, content} objects");
  }
  if (messages.size() > 4096) return bad("at most 4096 messages are allowed");
  for (size_t i = 0; i < messages.size(); ++i) {
    const Json& m = messages[i];
    const std::string at = "messages[" + std::to_string(i) + "]";
    if (!m.is_object()) return bad(at + " must be an object");
    auto role = m.find("role");
    if (role == m.end() || !role->is_string() || role->get<std::string>().empty()) {
      return bad(at + ".role must be a non-empty string");
    }
    ChatMessage msg;
    msg.role = role->get<std::string>();
    if (msg.role != "system" && msg.role != "user" && msg.role != "assistant" &&
        msg.role != "developer" && msg.role != "tool") {
      return bad(at + ".role '" + msg.role +
                 "' is not supported (system, developer, user, assistant or tool)");
    }
    if (msg.role == "developer") msg.role = "system";
    auto content = m.find("content");
    if (content == m.end() || content->is_null()) {
      if (msg.role != "assistant") return bad(at + ".content is required");
    } else if (content->is_string()) {
      msg.content = content->get<std::string>();
    } else if (content->is_array()) {
      for (size_t k = 0; k < content->size(); ++k) {
        const Json& part = (*content)[k];
        const std::string part_at = at + ".content[" + std::to_string(k) + "]";
        if (!part.is_object()) {
          return bad(part_at + " must be an object {\"type\": \"text\", \"text\": ...}, not " +
                     JsonTypeName(part));
        }
        auto type = part.find("type");
        if (type == part.end() || !type->is_string()) {
          return bad(part_at + ".type must be a string, not " +
                     (type == part.end() ? std::string("missing") : JsonTypeName(*type)));
        }
        if (type->get<std::string>() != "text") {
          return bad(part_at + ": only parts of type 'text' are supported");
        }
        auto text = part.find("text");
        if (text == part.end() || !text->is_string()) {
          return bad(part_at + ".text must be a string, not " +
                     (text == part.end() ? std::string("missing") : JsonTypeName(*text)));
        }
        msg.content += text->get<std::string>();
      }
    } else {
      return bad(at + ".content must be a string or an array of text parts");
    }
    if (auto it = m.find("function_call"); it != m.end() && !it->is_null()) {
      *error = BadParam("messages", at + ".function_call is not supported (use tool_calls)",
                        "unsupported_parameter");
      return false;
    }
    nlohmann::ordered_json r = {{"role", msg.role}, {"content", msg.content}};
    if (auto calls = m.find("tool_calls"); calls != m.end() && !calls->is_null()) {
      if (msg.role != "assistant") return bad(at + ".tool_calls is for assistant messages");
      std::string problem;
      nlohmann::ordered_json list;
      if (!ReadToolCalls(*calls, at + ".tool_calls", &list, &problem)) return bad(problem);
      r["tool_calls"] = std::move(list);
      if (with_tools != nullptr) *with_tools = true;
    }
    for (const char* key : {"tool_call_id", "name"}) {
      auto it = m.find(key);
      if (it == m.end() || it->is_null()) continue;
      if (!it->is_string()) return bad(at + "." + key + " must be a string");
      if (std::string_view(key) == "tool_call_id" && msg.role != "tool") {
        return bad(at + ".tool_call_id is for tool messages");
      }
      r[key] = it->get<std::string>();
    }
    if (msg.role == "tool" && with_tools != nullptr) *with_tools = true;
    if (rendered != nullptr) rendered->push_back(std::move(r));
    out->push_back(std::move(msg));
  }
  return true;
}

// logit_bias: {"<token id>": bias, ...} (the ids and biases checked by CheckSampling).
bool ReadLogitBias(const Json& j, SamplingParams* sampling, HttpResponse* error) {
  auto it = j.find("logit_bias");
  if (it == j.end() || it->is_null()) return true;
  if (!it->is_object()) {
    *error = BadParam("logit_bias", "'logit_bias' must be an object of token id -> bias");
    return false;
  }
  if (it->size() > kMaxLogitBias) {
    *error = BadParam("logit_bias",
                      "'logit_bias' may hold at most " + std::to_string(kMaxLogitBias) + " tokens");
    return false;
  }
  for (const auto& [key, value] : it->items()) {
    int64_t id = -1;
    const auto [end, ec] = std::from_chars(key.data(), key.data() + key.size(), id);
    if (ec != std::errc() || end != key.data() + key.size() || id < INT32_MIN || id > INT32_MAX) {
      *error = BadParam("logit_bias", "logit_bias key '" + ToValidUtf8(key).substr(0, 64) +
                                          "' is not a token id");
      return false;
    }
    if (!value.is_number() || !std::isfinite(value.get<double>())) {
      *error = BadParam("logit_bias", "logit_bias['" + ToValidUtf8(key) + "'] must be a number");
      return false;
    }
    constexpr double kMost = std::numeric_limits<float>::max();
    sampling->logit_bias.emplace_back(
        static_cast<int32_t>(id),
        static_cast<float>(std::clamp(value.get<double>(), -kMost, kMost)));
  }
  return true;
}

// A prompt given as token ids: a non-empty array of integers, or one such array alone in an
// array (a batch of one, as lm-eval sends). Null otherwise.
const Json* TokenIdArray(const Json& prompt) {
  if (!prompt.is_array() || prompt.empty()) return nullptr;
  const Json* ids = prompt.size() == 1 && prompt[0].is_array() ? &prompt[0] : &prompt;
  if (ids->empty() ||
      !std::all_of(ids->begin(), ids->end(), [](const Json& x) { return x.is_number_integer(); })) {
    return nullptr;
  }
  return ids;
}

}  // namespace

std::string JsonTypeName(const Json& j) {
  switch (j.type()) {
    case Json::value_t::null:
      return "null";
    case Json::value_t::boolean:
      return j.get<bool>() ? "true" : "false";
    case Json::value_t::number_integer:
      return "the integer " + std::to_string(j.get<int64_t>());
    case Json::value_t::number_unsigned:
      return "the integer " + std::to_string(j.get<uint64_t>());
    case Json::value_t::number_float:
      return "a number with a fraction or an exponent";
    case Json::value_t::string:
      return "a string";
    case Json::value_t::array:
      return "an array";
    case Json::value_t::object:
      return "an object";
    default:
      return "a value of another kind";
  }
}

std::string JsonText(const Json& j) {
  return j.dump(-1, ' ', false, Json::error_handler_t::replace);
}

bool ReadBool(const Json& j, const char* key, bool* out, HttpResponse* error) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return true;
  if (!it->is_boolean()) {
    *error = BadParam(key, std::string("'") + key + "' must be a boolean");
    return false;
  }
  *out = it->get<bool>();
  return true;
}

bool ReadModel(const Json& j, const CompletionsOptions& options, bool required,
               HttpResponse* error) {
  auto model = j.find("model");
  if (model == j.end() || model->is_null()) {
    if (!required) return true;
    *error = BadParam("model", "you must provide a model parameter", "missing_required");
    return false;
  }
  if (!model->is_string()) {
    *error = BadParam("model", "'model' must be a string");
    return false;
  }
  if (model->get<std::string>() != options.model_name) {
    *error = ApiError(404,
                      "the model '" + model->get<std::string>() +
                          "' does not exist; this server serves '" + options.model_name + "'",
                      "invalid_request_error", "model", "model_not_found");
    return false;
  }
  return true;
}

HttpResponse BadParam(const std::string& param, const std::string& message,
                      const std::string& code) {
  return ApiError(400, message, "invalid_request_error", param, code);
}

size_t JsonDepth(const Json& value) {
  size_t deepest = 0;
  std::vector<std::pair<const Json*, size_t>> todo = {{&value, 0}};
  while (!todo.empty()) {
    auto [v, depth] = todo.back();
    todo.pop_back();
    if (!v->is_structured()) continue;
    deepest = std::max(deepest, depth + 1);
    for (const Json& child : *v) todo.emplace_back(&child, depth + 1);
  }
  return deepest;
}

Result<std::vector<int32_t>> TokenizeChat(const Json& messages, const CompletionsOptions& options,
                                          const Tokenizer& tokenizer, bool add_generation_prompt,
                                          HttpResponse* error, const nlohmann::ordered_json* tools,
                                          const nlohmann::ordered_json* template_kwargs) {
  std::vector<ChatMessage> chat;
  nlohmann::ordered_json rendered = nlohmann::ordered_json::array();
  bool with_tools = false;
  if (!ReadMessages(messages, &chat, error, &rendered, &with_tools)) {
    return InvalidArgument("messages");
  }
  if (options.chat_template == nullptr) {
    *error =
        BadParam("messages", "this model has no chat template; use /v1/completions with a prompt",
                 "no_chat_template");
    return InvalidArgument("messages");
  }
  // With tools, or tool calls and results in the history, the template gets them (its own
  // format for them); otherwise the plain messages.
  Result<std::string> text = std::string();
  if (with_tools || tools != nullptr || template_kwargs != nullptr) {
    nlohmann::ordered_json variables{
        {"messages", std::move(rendered)},
        {"tools", tools != nullptr ? *tools : nlohmann::ordered_json(nullptr)},
        {"documents", nullptr},
        {"bos_token", options.bos_token},
        {"eos_token", options.eos_token},
        {"add_generation_prompt", add_generation_prompt}};
    if (template_kwargs != nullptr) {
      for (auto it = template_kwargs->begin(); it != template_kwargs->end(); ++it) {
        variables[it.key()] = it.value();  // Checked by ReadTemplateKwargs: no reserved name.
      }
    }
    text = options.chat_template->Render(variables);
  } else {
    text = options.chat_template->Render(chat, options.bos_token, options.eos_token,
                                         add_generation_prompt);
  }
  if (!text.ok()) {
    *error = BadParam("messages", text.status().message());
    return InvalidArgument("messages");
  }
  // The template writes the special tokens itself (BOS included).
  auto ids = tokenizer.Encode(*text, /*add_special_tokens=*/false);
  if (!ids.ok()) {
    *error =
        BadParam("messages", "the conversation cannot be tokenized: " + ids.status().message());
    return InvalidArgument("messages");
  }
  return std::move(*ids);
}

bool Refuse(HttpResponse* error, HttpResponse response) {
  *error = std::move(response);
  return false;
}

namespace {

// The readers of ParseRequest, one per parameter or group of parameters, in the order it calls
// them. Each fills its part of the request, or sets *error and returns false.

// The top level: a JSON object without parameters this server does not support.
bool ReadBody(const std::string& body, Json* j, HttpResponse* error) {
  *j = Json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (j->is_discarded()) {
    return Refuse(error, ApiError(400, "the request body is not valid JSON",
                                  "invalid_request_error", "", "invalid_json"));
  }
  if (!j->is_object()) {
    return Refuse(error, ApiError(400, "the request body must be a JSON object",
                                  "invalid_request_error", "", "invalid_json"));
  }
  for (const char* key : kUnsupported) {
    auto it = j->find(key);
    if (it != j->end() && Unsupported(key, *it)) {
      return Refuse(error,
                    BadParam(key, std::string("'") + key + "' is not supported by this server",
                             "unsupported_parameter"));
    }
  }
  return true;
}

// tools: [{"type": "function", "function": {name, description?, parameters?, strict?}}], kept
// for the template as given; each tool's argument types (parameters.properties.*.type) go to
// the parser. tool_choice: "none" (tools rendered, the answer not parsed), "auto" (the default
// with tools: the answer parsed into calls in the model's format), "required" and a named
// function ({"type": "function", "function": {"name": ..}}): the answer decoded under a JSON
// Schema and parsed back into calls (structured_output.h). gpt-oss (harmony) opens a call with a
// header naming the function, so there a named function (or "required" with one tool) is forced
// by prefilling the header and decoding the arguments under the function's parameters:
// *harmony_call is the function's name then (ReadChatPrompt appends the header); "required"
// with several tools sets *harmony_any: ReadChatPrompt constrains the answer to open with a call
// to one of them, header and all (ForceHarmonyCall).
bool ReadTools(const Json& j, const CompletionsOptions& options, CompletionRequest* out,
               nlohmann::ordered_json* tools, std::string* harmony_call, bool* harmony_any,
               HttpResponse* error) {
  auto list = j.find("tools");
  const bool have = list != j.end() && !list->is_null() && !(list->is_array() && list->empty());
  if (have) {
    if (!list->is_array() || list->size() > kMaxTools) {
      return Refuse(error, BadParam("tools", "'tools' must be an array of at most " +
                                                 std::to_string(kMaxTools) + " tools"));
    }
    *tools = nlohmann::ordered_json::array();
    for (size_t k = 0; k < list->size(); ++k) {
      const Json& tool = (*list)[k];
      const std::string at = "tools[" + std::to_string(k) + "]";
      if (JsonDepth(tool) > kMaxToolJsonDepth) {
        return Refuse(error, BadParam("tools", at + " nests deeper than " +
                                                   std::to_string(kMaxToolJsonDepth)));
      }
      auto type = tool.is_object() ? tool.find("type") : tool.end();
      if (!tool.is_object() || type == tool.end() || *type != Json("function")) {
        return Refuse(error, BadParam("tools", at + " must be {\"type\": \"function\", "
                                                    "\"function\": {...}}"));
      }
      auto fn = tool.find("function");
      if (fn == tool.end() || !fn->is_object()) {
        return Refuse(error, BadParam("tools", at + ".function must be an object"));
      }
      auto name = fn->find("name");
      if (name == fn->end() || !name->is_string() || name->get<std::string>().empty() ||
          name->get<std::string>().size() > 64) {
        return Refuse(error,
                      BadParam("tools", at + ".function.name must be a string of 1 to 64 bytes"));
      }
      if (auto d = fn->find("description"); d != fn->end() && !d->is_null() && !d->is_string()) {
        return Refuse(error, BadParam("tools", at + ".function.description must be a string"));
      }
      auto params = fn->find("parameters");
      if (params != fn->end() && !params->is_null() && !params->is_object()) {
        return Refuse(error, BadParam("tools", at + ".function.parameters must be an object"));
      }
      if (params != fn->end() && params->is_object()) {
        if (auto props = params->find("properties"); props != params->end() && props->is_object()) {
          auto& types = out->tool_options.arg_types[name->get<std::string>()];
          for (auto it = props->begin(); it != props->end(); ++it) {
            if (it->is_object()) {
              if (auto t = it->find("type"); t != it->end() && t->is_string()) {
                types[it.key()] = t->get<std::string>();
              }
            }
          }
        }
      }
      tools->push_back(nlohmann::ordered_json::parse(tool.dump()));
    }
  }
  for (const char* legacy : {"functions", "function_call"}) {
    if (auto it = j.find(legacy); it != j.end() && !it->is_null()) {
      return Refuse(error,
                    BadParam(legacy, std::string("'") + legacy + "' is not supported (use tools)",
                             "unsupported_parameter"));
    }
  }
  std::string choice = have ? "auto" : "none";
  std::string named;
  if (auto tc = j.find("tool_choice"); tc != j.end() && !tc->is_null()) {
    if (tc->is_string()) {
      choice = tc->get<std::string>();
      if (choice != "none" && choice != "auto" && choice != "required") {
        return Refuse(error, BadParam("tool_choice",
                                      "'tool_choice' must be \"none\", \"auto\", "
                                      "\"required\" or a named function"));
      }
    } else if (tc->is_object()) {
      choice = "named";
      const Json* fn = tc->contains("function") ? &tc->at("function") : nullptr;
      const Json* name =
          fn != nullptr && fn->is_object() && fn->contains("name") ? &fn->at("name") : nullptr;
      if (tc->value("type", Json()) != Json("function") || name == nullptr || !name->is_string() ||
          name->get<std::string>().empty()) {
        return Refuse(error, BadParam("tool_choice",
                                      "a named tool_choice must be {\"type\": \"function\", "
                                      "\"function\": {\"name\": ..}}"));
      }
      named = name->get<std::string>();
    } else {
      return Refuse(error, BadParam("tool_choice", "'tool_choice' must be a string or an object"));
    }
  }
  if (choice == "none") return true;
  if (!have) return Refuse(error, BadParam("tool_choice", "'tool_choice' needs 'tools'"));
  if (choice == "required" || choice == "named") {
    if (options.harmony_channels || options.tool_call_format == ToolCallFormat::kGptOss) {
      if (named.empty() && tools->size() > 1) {
        out->tool_format = ToolCallFormat::kGptOss;
        out->tool_options.id_seed = RandomId();
        out->tool_choice_required = true;
        *harmony_any = true;
        return true;
      }
      if (named.empty()) {
        named = (*tools)[0]["function"]["name"].get<std::string>();
        out->tool_choice_required = true;
      }
      // (A special token in the name is refused where the header is encoded.)
      if (std::any_of(named.begin(), named.end(),
                      [](char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; })) {
        return Refuse(error, BadParam("tool_choice",
                                      "the function \"" + ToValidUtf8(named) +
                                          "\" cannot be forced in the gpt_oss (harmony) format: "
                                          "its name holds whitespace, which a call's header "
                                          "cannot carry"));
      }
      out->tool_format = ToolCallFormat::kGptOss;
      out->tool_options.id_seed = RandomId();
      *harmony_call = named;
      return ForceToolChoice(named, *tools, out, error);
    }
    // The answer is JSON whatever the model's format; the format's stream only names the ids.
    out->tool_format = options.tool_call_format == ToolCallFormat::kNone ? ToolCallFormat::kHermes
                                                                         : options.tool_call_format;
    out->tool_options.id_seed = RandomId();
    return ForceToolChoice(named, *tools, out, error);
  }
  if (options.tool_call_format == ToolCallFormat::kNone) {
    return Refuse(error, BadParam("tools",
                                  "this model has no tool-call format this server can parse; "
                                  "tool_choice \"none\" renders the tools without parsing",
                                  "unsupported_parameter"));
  }
  out->tool_format = options.tool_call_format;
  out->tool_options.id_seed = RandomId();
  return true;
}

// Chat: the conversation (tools included) through the chat template; no echo.
// chat_template_kwargs (vLLM's): more variables for the model's chat template, e.g.
// {"enable_thinking": false} for Qwen3. An object of at most 64 names, none of the variables the
// server sets itself (messages, tools, documents, bos_token, eos_token, add_generation_prompt),
// values nested at most 16 deep.
bool ReadTemplateKwargs(const Json& j, nlohmann::ordered_json* kwargs, HttpResponse* error) {
  auto k = j.find("chat_template_kwargs");
  if (k == j.end() || k->is_null()) return true;
  if (!k->is_object()) {
    return Refuse(error,
                  BadParam("chat_template_kwargs",
                           "'chat_template_kwargs' must be an object, not " + JsonTypeName(*k)));
  }
  if (k->size() > 64) {
    return Refuse(error, BadParam("chat_template_kwargs", "'chat_template_kwargs' has " +
                                                              std::to_string(k->size()) +
                                                              " entries; at most 64"));
  }
  for (auto it = k->begin(); it != k->end(); ++it) {
    for (const char* reserved :
         {"messages", "tools", "documents", "bos_token", "eos_token", "add_generation_prompt"}) {
      if (it.key() == reserved) {
        return Refuse(error, BadParam("chat_template_kwargs",
                                      "'chat_template_kwargs." + it.key() +
                                          "' is set by the server (use the request's own field)"));
      }
    }
    if (JsonDepth(it.value()) > 16) {
      return Refuse(error, BadParam("chat_template_kwargs", "'chat_template_kwargs." + it.key() +
                                                                "' nests deeper than 16"));
    }
  }
  *kwargs = nlohmann::ordered_json::parse(k->dump());
  return true;
}

// A forced harmony call: after the generation prompt's "<|start|>assistant", the header the chat
// template writes for a past call, " to=functions.NAME<|channel|>commentary json<|message|>", so
// that the answer is the call's arguments (ended by <|call|>). The name's text must encode
// without special tokens.
bool AppendHarmonyCallHeader(const Tokenizer& tokenizer, const std::string& name,
                             std::vector<int32_t>* ids, HttpResponse* error) {
  const std::optional<int32_t> channel = tokenizer.TokenToId("<|channel|>");
  const std::optional<int32_t> message = tokenizer.TokenToId("<|message|>");
  auto recipient = tokenizer.Encode(" to=functions." + name, /*add_special_tokens=*/false);
  auto kind = tokenizer.Encode("commentary json", /*add_special_tokens=*/false);
  if (!channel || !message || !recipient.ok() || !kind.ok()) {
    return Refuse(error, BadParam("tool_choice",
                                  "this model's vocabulary has no harmony call header "
                                  "(<|channel|>, <|message|>); use \"auto\"",
                                  "unsupported_parameter"));
  }
  if (std::any_of(recipient->begin(), recipient->end(),
                  [&](int32_t id) { return tokenizer.IsSpecial(id); })) {
    return Refuse(error, BadParam("tool_choice", "the function \"" + ToValidUtf8(name) +
                                                     "\" cannot be forced: its name holds a "
                                                     "special token"));
  }
  ids->insert(ids->end(), recipient->begin(), recipient->end());
  ids->push_back(*channel);
  ids->insert(ids->end(), kind->begin(), kind->end());
  ids->push_back(*message);
  return true;
}

bool ReadChatPrompt(const Json& j, const CompletionsOptions& options, const Tokenizer& tokenizer,
                    CompletionRequest* out, HttpResponse* error) {
  nlohmann::ordered_json tools;
  std::string harmony_call;
  bool harmony_any = false;
  if (!ReadTools(j, options, out, &tools, &harmony_call, &harmony_any, error)) return false;
  if (harmony_any && !ForceHarmonyCall(tools, tokenizer, out, error)) return false;
  nlohmann::ordered_json template_kwargs;
  if (!ReadTemplateKwargs(j, &template_kwargs, error)) return false;
  // vLLM's include_reasoning: absent or null means true, accepted whether or not the model's
  // reasoning is split out.
  if (!ReadBool(j, "include_reasoning", &out->include_reasoning, error)) return false;
  if (auto e = j.find("echo"); e != j.end() && !e->is_null() && !(e->is_boolean() && !*e)) {
    return Refuse(error, BadParam("echo", "'echo' is not supported by chat completions",
                                  "unsupported_parameter"));
  }
  auto messages = j.find("messages");
  if (messages == j.end() || messages->is_null()) {
    return Refuse(error, BadParam("messages", "you must provide messages", "missing_required"));
  }
  auto ids = TokenizeChat(*messages, options, tokenizer, /*add_generation_prompt=*/true, error,
                          tools.is_array() ? &tools : nullptr,
                          template_kwargs.is_object() ? &template_kwargs : nullptr);
  if (!ids.ok()) return false;
  if (!harmony_call.empty() && !AppendHarmonyCallHeader(tokenizer, harmony_call, &*ids, error)) {
    return false;
  }
  out->prompts.push_back({std::move(*ids), ""});
  return true;
}

// Completions: one prompt (a string or an array of ids) or a batch of them (not mixed).
bool ReadTextPrompts(const Json& j, const Tokenizer& tokenizer, uint32_t vocab,
                     CompletionRequest* out, HttpResponse* error) {
  auto prompt = j.find("prompt");
  if (prompt == j.end() || prompt->is_null()) {
    return Refuse(error, BadParam("prompt", "you must provide a prompt", "missing_required"));
  }
  std::vector<const Json*> items;
  if (prompt->is_string() || TokenIdArray(*prompt) != nullptr) {
    items.push_back(&*prompt);
  } else if (prompt->is_array() && !prompt->empty() &&
             (std::all_of(prompt->begin(), prompt->end(),
                          [](const Json& x) { return x.is_string(); }) ||
              std::all_of(prompt->begin(), prompt->end(),
                          [](const Json& x) { return x.is_array(); }))) {
    if (prompt->size() > kMaxPrompts) {
      return Refuse(error,
                    BadParam("prompt", "a batch may hold at most " + std::to_string(kMaxPrompts) +
                                           " prompts, not " + std::to_string(prompt->size())));
    }
    for (const Json& x : *prompt) items.push_back(&x);
  } else {
    return Refuse(error, BadParam("prompt",
                                  "'prompt' must be a string, an array of token ids, or an array "
                                  "of either (not mixed)"));
  }
  for (size_t p = 0; p < items.size(); ++p) {
    const Json& item = *items[p];
    const std::string which =
        items.size() == 1 ? std::string("the prompt") : "prompt " + std::to_string(p);
    PromptInput& in = out->prompts.emplace_back();
    if (item.is_string()) {
      auto ids = tokenizer.Encode(item.get<std::string>(), /*add_special_tokens=*/true);
      if (!ids.ok()) {
        return Refuse(
            error, BadParam("prompt", which + " cannot be tokenized: " + ids.status().message()));
      }
      in.ids = std::move(*ids);
      in.text = item.get<std::string>();
      continue;
    }
    const Json* id_list = item.is_array() ? TokenIdArray(item) : nullptr;
    if (id_list == nullptr || (item.size() == 1 && item[0].is_array() && items.size() > 1)) {
      return Refuse(error,
                    BadParam("prompt", which + " must be a string or an array of token ids"));
    }
    for (const Json& x : *id_list) {
      const int64_t id = x.get<int64_t>();
      if (id < 0 || id >= static_cast<int64_t>(vocab)) {
        return Refuse(
            error, BadParam("prompt", which + ": token " + std::to_string(id) +
                                          " is not in the vocabulary of " + std::to_string(vocab)));
      }
      in.ids.push_back(static_cast<int32_t>(id));
    }
    in.text = ToValidUtf8(tokenizer.Decode(in.ids, false));
  }
  return true;
}

// max_tokens (max_completion_tokens in chat) against the context: every prompt non-empty, the
// longest one's length in *prompt_len, the completion's budget in *max_new and the request's
// max_tokens.
bool ReadMaxTokens(const Json& j, const CompletionsOptions& options, bool chat,
                   CompletionRequest* out, uint64_t* prompt_len, uint64_t* max_new,
                   HttpResponse* error) {
  *prompt_len = 0;
  for (size_t p = 0; p < out->prompts.size(); ++p) {
    if (out->prompts[p].ids.empty()) {
      return Refuse(error,
                    BadParam("prompt", (out->prompts.size() == 1 ? std::string("the prompt")
                                                                 : "prompt " + std::to_string(p)) +
                                           " is empty"));
    }
    *prompt_len = std::max<uint64_t>(*prompt_len, out->prompts[p].ids.size());
  }
  const uint64_t len = *prompt_len;
  auto context_error = [&](uint64_t completion) {
    return ApiError(400,
                    "this model's maximum context length is " +
                        std::to_string(options.context_length) + " tokens" + options.context_limit +
                        "; the request needs " + std::to_string(len + completion) + " (" +
                        std::to_string(len) + " in the prompt, " + std::to_string(completion) +
                        " for the completion)",
                    "invalid_request_error", "max_tokens", "context_length_exceeded");
  };
  if (len >= options.context_length) return Refuse(error, context_error(1));
  auto max_tokens = j.find("max_tokens");
  if (auto mct = j.find("max_completion_tokens"); chat && mct != j.end() && !mct->is_null()) {
    max_tokens = mct;  // The newer name in the chat API.
  }
  // Without max_tokens: OpenAI's 16 for completions, the rest of the context for chat (vLLM).
  *max_new = chat ? options.context_length - len : options.default_max_tokens;
  // Completions' echo with max_tokens 0 scores the prompt and generates nothing (OpenAI, vLLM).
  const auto echo = j.find("echo");
  const bool scoring = !chat && echo != j.end() && echo->is_boolean() && echo->get<bool>();
  if (max_tokens != j.end() && !max_tokens->is_null()) {
    // JSON integers that are not negative parse as unsigned, the others as signed.
    const int64_t least = scoring ? 0 : 1;
    if (!max_tokens->is_number_integer() ||
        (max_tokens->is_number_unsigned()
             ? max_tokens->get<uint64_t>() < static_cast<uint64_t>(least)
             : max_tokens->get<int64_t>() < least)) {
      return Refuse(error, BadParam("max_tokens", scoring ? "'max_tokens' must be an integer of "
                                                            "at least 0"
                                                          : "'max_tokens' must be an integer of "
                                                            "at least 1 (0 only with 'echo')"));
    }
    *max_new = max_tokens->get<uint64_t>();
    // Compared without a sum that could wrap around for values near 2^64.
    if (*max_new > options.context_length || len > options.context_length - *max_new) {
      return Refuse(error, context_error(*max_new));
    }
  } else if (len + *max_new > options.context_length) {
    *max_new = options.context_length - len;  // The default shrinks to fit.
  }
  out->sampling.max_tokens = static_cast<uint32_t>(*max_new);
  return true;
}

// temperature, top_p, top_k, min_p, the penalties, logit_bias and seed: their JSON types and
// OpenAI's spellings here, their ranges CheckSampling's.
bool ReadSampling(const Json& j, SamplingParams* s, HttpResponse* error) {
  if (!ReadFloat(j, "temperature", 1.0f, &s->temperature, error)) return false;
  if (!ReadFloat(j, "top_p", 1.0f, &s->top_p, error)) return false;
  // A positive value below float's range (1e-50) rounds to 0, which is refused: keep the
  // smallest normal float instead (the top token only, as asked). (0 only from a number here.)
  if (s->top_p == 0.0f && j.at("top_p").get<double>() > 0.0) {
    s->top_p = std::numeric_limits<float>::min();
  }
  if (!ReadInt32(j, "top_k", 0, &s->top_k, error)) return false;
  if (s->top_k == -1) s->top_k = 0;  // vLLM's "off".
  if (!ReadFloat(j, "min_p", 0.0f, &s->min_p, error) ||
      !ReadFloat(j, "presence_penalty", 0.0f, &s->presence_penalty, error) ||
      !ReadFloat(j, "frequency_penalty", 0.0f, &s->frequency_penalty, error) ||
      !ReadFloat(j, "repetition_penalty", 1.0f, &s->repetition_penalty, error)) {
    return false;
  }
  if (!ReadLogitBias(j, s, error)) return false;
  if (auto sd = j.find("seed"); sd != j.end() && !sd->is_null()) {
    if (!sd->is_number_integer())
      return Refuse(error, BadParam("seed", "'seed' must be an integer"));
    s->seed =
        sd->is_number_unsigned() ? sd->get<uint64_t>() : static_cast<uint64_t>(sd->get<int64_t>());
  } else {
    s->seed = RandomId();
  }
  return true;
}

// n, against the batch's prompts.
bool ReadChoices(const Json& j, CompletionRequest* out, HttpResponse* error) {
  uint64_t count = 1;
  if (!ReadCount(j, "n", 1, kMaxChoices, 1, &count, error)) return false;
  out->n = static_cast<uint32_t>(count);
  if (out->prompts.size() * count > kMaxPrompts) {
    return Refuse(error, BadParam("n", std::to_string(out->prompts.size()) + " prompts with 'n' " +
                                           std::to_string(count) + " make " +
                                           std::to_string(out->prompts.size() * count) +
                                           " choices; at most " + std::to_string(kMaxPrompts)));
  }
  return true;
}

// ignore_eos, min_tokens and stop_token_ids (their ranges CheckSampling's).
bool ReadStopConditions(const Json& j, SamplingParams* s, HttpResponse* error) {
  if (!ReadBool(j, "ignore_eos", &s->ignore_eos, error)) return false;
  uint64_t count = 0;
  if (!ReadCount(j, "min_tokens", 0, UINT32_MAX, 0, &count, error)) return false;
  s->min_tokens = static_cast<uint32_t>(count);
  if (auto st = j.find("stop_token_ids"); st != j.end() && !st->is_null()) {
    if (!st->is_array() || st->size() > 64) {
      return Refuse(error, BadParam("stop_token_ids",
                                    "'stop_token_ids' must be an array of at most 64 token ids"));
    }
    for (const Json& x : *st) {
      if (!x.is_number_integer() ||
          (x.is_number_unsigned() ? x.get<uint64_t>() > INT32_MAX
                                  : x.get<int64_t>() < INT32_MIN || x.get<int64_t>() > INT32_MAX)) {
        return Refuse(error, BadParam("stop_token_ids", "stop_token_ids holds " + JsonTypeName(x) +
                                                            ", not a token id"));
      }
      s->stop_token_ids.push_back(x.get<int32_t>());
    }
  }
  return true;
}

// logprobs: completions take an integer (the top N) and echo; chat a boolean plus top_logprobs.
bool ReadLogprobs(const Json& j, bool chat, CompletionRequest* out, HttpResponse* error) {
  SamplingParams& s = out->sampling;
  if (chat) {
    bool logprobs = false;
    if (!ReadBool(j, "logprobs", &logprobs, error)) return false;
    uint64_t top = 0;
    if (!ReadCount(j, "top_logprobs", 0, INT32_MAX, 0, &top, error)) return false;
    if (auto t = j.find("top_logprobs"); t != j.end() && !t->is_null() && !logprobs) {
      return Refuse(error, BadParam("top_logprobs", "'top_logprobs' needs 'logprobs': true"));
    }
    s.logprobs = logprobs ? static_cast<int32_t>(top) : -1;
    return true;
  }
  if (auto lp = j.find("logprobs"); lp != j.end() && !lp->is_null()) {
    if (lp->is_boolean()) {
      return Refuse(error, BadParam("logprobs", "'logprobs' must be an integer from 0 to " +
                                                    std::to_string(kMaxLogprobs)));
    }
    uint64_t top = 0;
    if (!ReadCount(j, "logprobs", 0, INT32_MAX, 0, &top, error)) return false;
    s.logprobs = static_cast<int32_t>(top);
  }
  if (!ReadBool(j, "echo", &out->echo, error)) return false;
  s.prompt_logprobs = out->echo && s.logprobs >= 0;
  if (!out->echo) {
    for (PromptInput& p : out->prompts) p.text.clear();
  }
  return true;
}

// echo with logprobs: the prompt's logprobs come back in one event, 4 bytes per token and 8 per
// alternative, under the worker channel's frame limit with room to spare. After CheckSampling
// (logprobs in range).
bool CheckPromptLogprobs(uint64_t prompt_len, const SamplingParams& s, HttpResponse* error) {
  if (!s.prompt_logprobs) return true;
  const uint64_t per_token = 4 + 8 * static_cast<uint64_t>(s.logprobs);
  const uint64_t most = kMaxPromptLogprobBytes / per_token;
  if (prompt_len <= most) return true;
  return Refuse(error, BadParam("echo", "the prompt's " + std::to_string(prompt_len) +
                                            " tokens are too many for their logprobs (at most " +
                                            std::to_string(most) + " with 'logprobs' " +
                                            std::to_string(s.logprobs) + ")"));
}

// The parsed sampling parameters against the one definition of valid ones
// (common/wire/sampling_limits.h): a 400 naming the client's parameter.
bool CheckSamplingParams(const SamplingParams& s, bool chat, uint32_t vocab, HttpResponse* error) {
  SamplingProblem problem;
  if (CheckSampling(s, vocab, &problem)) return true;
  // Chat asks for the top N logprobs with top_logprobs (logprobs is its boolean).
  if (chat && problem.field == "logprobs") {
    return Refuse(error, BadParam("top_logprobs", "top_" + problem.message));
  }
  return Refuse(error, BadParam(problem.field, problem.message));
}

// stop: a string or up to 16 strings of 1 to 256 bytes. Matched by the router (never sent to a
// worker).
bool ReadStopStrings(const Json& j, CompletionRequest* out, HttpResponse* error) {
  auto st = j.find("stop");
  if (st == j.end() || st->is_null()) return true;
  std::vector<std::string> stops;
  if (st->is_string()) {
    stops.push_back(st->get<std::string>());
  } else if (st->is_array() &&
             std::all_of(st->begin(), st->end(), [](const Json& x) { return x.is_string(); })) {
    for (const Json& x : *st) stops.push_back(x.get<std::string>());
  } else {
    return Refuse(error, BadParam("stop", "'stop' must be a string or an array of strings"));
  }
  if (stops.size() > 16)
    return Refuse(error, BadParam("stop", "at most 16 stop strings are allowed"));
  for (const auto& text : stops) {
    if (text.empty() || text.size() > 256) {
      return Refuse(error, BadParam("stop", "each stop string must have 1 to 256 bytes"));
    }
  }
  out->stop = std::move(stops);
  return true;
}

// stream and stream_options.
bool ReadStream(const Json& j, CompletionRequest* out, HttpResponse* error) {
  if (!ReadBool(j, "stream", &out->stream, error)) return false;
  auto so = j.find("stream_options");
  if (so == j.end() || so->is_null()) return true;
  if (!out->stream) {
    return Refuse(error,
                  BadParam("stream_options", "'stream_options' is only allowed with stream"));
  }
  if (!so->is_object()) {
    return Refuse(error, BadParam("stream_options", "'stream_options' must be an object"));
  }
  if (auto u = so->find("include_usage"); u != so->end() && !u->is_null()) {
    if (!u->is_boolean()) {
      return Refuse(error, BadParam("stream_options", "'include_usage' must be a boolean"));
    }
    out->include_usage = u->get<bool>();
  }
  if (auto c = so->find("continuous_usage_stats"); c != so->end() && !c->is_null()) {
    if (!c->is_boolean()) {
      return Refuse(error,
                    BadParam("stream_options", "'continuous_usage_stats' must be a boolean"));
    }
    if (c->get<bool>()) {
      return Refuse(error, BadParam("stream_options",
                                    "'continuous_usage_stats' is not supported by this server "
                                    "(the usage comes in the last chunk with include_usage)",
                                    "unsupported_parameter"));
    }
  }
  return true;
}

}  // namespace

namespace {

std::vector<std::string> IgnoredFields(const Json& body, bool chat) {
  // Read above, refused unless neutral (kUnsupported), or taken without changing the output
  // (OpenAI's user, store, metadata, service_tier, parallel_tool_calls; the client's name for
  // the request).
  static const std::set<std::string, std::less<>> kKnown = {"model",
                                                            "prompt",
                                                            "messages",
                                                            "max_tokens",
                                                            "max_completion_tokens",
                                                            "temperature",
                                                            "top_p",
                                                            "top_k",
                                                            "min_p",
                                                            "seed",
                                                            "n",
                                                            "stop",
                                                            "stop_token_ids",
                                                            "presence_penalty",
                                                            "frequency_penalty",
                                                            "repetition_penalty",
                                                            "logit_bias",
                                                            "logprobs",
                                                            "top_logprobs",
                                                            "echo",
                                                            "min_tokens",
                                                            "ignore_eos",
                                                            "stream",
                                                            "stream_options",
                                                            "response_format",
                                                            "structured_outputs",
                                                            "guided_json",
                                                            "guided_regex",
                                                            "guided_choice",
                                                            "guided_grammar",
                                                            "tools",
                                                            "tool_choice",
                                                            "functions",
                                                            "function_call",
                                                            "include_reasoning",
                                                            "chat_template_kwargs",
                                                            "user",
                                                            "store",
                                                            "metadata",
                                                            "service_tier",
                                                            "parallel_tool_calls"};
  std::vector<std::string> out;
  if (!body.is_object()) return out;
  for (auto it = body.begin(); it != body.end(); ++it) {
    if (kKnown.contains(it.key()) && (chat || it.key() != "chat_template_kwargs")) continue;
    if (std::find(std::begin(kUnsupported), std::end(kUnsupported), it.key()) !=
        std::end(kUnsupported)) {
      continue;
    }
    if (!chat && (it.key() == "messages" || it.key() == "tools")) continue;
    out.push_back(ToValidUtf8(it.key().substr(0, 64)));
    if (out.size() == 16) break;
  }
  return out;
}

// A reasoning model's chat with structured output (a schema, a grammar, a forced tool call):
// it thinks first and only its answer is constrained (as vLLM does with a reasoning parser), so
// the constraint starts after its end-of-thinking token, unless the prompt closed the thinking
// already (Qwen3 with enable_thinking false ends the prompt with <think>, </think> and blank
// lines): then it applies from the first token.
void ConstrainAfterThinking(const Tokenizer& tokenizer, CompletionRequest* out) {
  SamplingParams& s = out->sampling;
  if ((s.json_schema.empty() && s.grammar.empty()) || out->prompts.size() != 1) return;
  const std::optional<int32_t> end = tokenizer.TokenToId(kThinkEnd);
  if (!end) return;
  const std::vector<int32_t>& ids = out->prompts[0].ids;
  const auto last_end = std::find(ids.rbegin(), ids.rend(), *end);
  if (last_end != ids.rend()) {
    const auto after = static_cast<size_t>(last_end.base() - ids.begin());
    const std::string tail = tokenizer.Decode(std::span<const int32_t>(ids).subspan(after),
                                              /*skip_special_tokens=*/false);
    if (std::all_of(tail.begin(), tail.end(),
                    [](char c) { return c == ' ' || c == '\n' || c == '\r' || c == '\t'; })) {
      return;
    }
  }
  s.constrain_after = {*end};
}

// gpt-oss's chat with structured output: its analysis channel stays free and the answer, the
// final channel's message, is constrained (as vLLM's harmony reasoning parser has it): the
// constraint starts once the model has written the final channel's header,
// <|channel|>final<|message|>. A vocabulary without harmony's markers leaves the request as it is.
void ConstrainTheFinalChannel(const Tokenizer& tokenizer, CompletionRequest* out) {
  SamplingParams& s = out->sampling;
  if (s.json_schema.empty() && s.grammar.empty()) return;
  const std::optional<int32_t> channel = tokenizer.TokenToId("<|channel|>");
  const std::optional<int32_t> message = tokenizer.TokenToId("<|message|>");
  if (!channel || !message) return;
  auto final_ids = tokenizer.Encode("final", /*add_special_tokens=*/false);
  if (!final_ids.ok() || final_ids->empty() || final_ids->size() + 2 > kMaxConstrainAfter) {
    return;
  }
  s.constrain_after = {*channel};
  s.constrain_after.insert(s.constrain_after.end(), final_ids->begin(), final_ids->end());
  s.constrain_after.push_back(*message);
}

}  // namespace

Result<CompletionRequest> ParseRequest(const std::string& body, const CompletionsOptions& options,
                                       const Tokenizer& tokenizer, RequestKind kind,
                                       HttpResponse* error) {
  const bool chat = kind == RequestKind::kChat;
  const uint32_t vocab = static_cast<uint32_t>(tokenizer.vocab_size());
  Json j;
  CompletionRequest out;
  out.kind = kind;
  uint64_t prompt_len = 0;  // The longest prompt's: the context checks are its.
  uint64_t max_new = 0;
  const bool ok = ReadBody(body, &j, error) && ReadModel(j, options, /*required=*/true, error) &&
                  (chat ? ReadChatPrompt(j, options, tokenizer, &out, error)
                        : ReadTextPrompts(j, tokenizer, vocab, &out, error)) &&
                  ReadMaxTokens(j, options, chat, &out, &prompt_len, &max_new, error) &&
                  ReadSampling(j, &out.sampling, error) && ReadChoices(j, &out, error) &&
                  ReadStopConditions(j, &out.sampling, error) &&
                  ReadLogprobs(j, chat, &out, error) && ReadStopStrings(j, &out, error) &&
                  ReadStream(j, &out, error) && ReadStructuredOutput(j, &out, error) &&
                  CheckSamplingParams(out.sampling, chat, vocab, error) &&
                  CheckPromptLogprobs(prompt_len, out.sampling, error);
  if (!ok) return InvalidArgument(error->body);
  if (chat && options.harmony_channels) {
    // A forced call's arguments follow the prefilled header: constrained from the first token.
    if (out.tool_options.forced == ToolCallOptions::Forced::kNone) {
      ConstrainTheFinalChannel(tokenizer, &out);
    }
  } else if (chat && options.think_style) {
    ConstrainAfterThinking(tokenizer, &out);
  }
  out.ignored_fields = IgnoredFields(j, chat);
  return out;
}

}  // namespace fmoe
