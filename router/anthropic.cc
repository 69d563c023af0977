#include "router/anthropic.h"

#include <string_view>
#include <utility>

#include "common/text/unicode.h"
#include "router/completion_request.h"

namespace fmoe {
namespace {

using Json = nlohmann::json;

HttpResponse Invalid(const std::string& message) {
  HttpResponse res;
  res.status = 400;
  res.body =
      Json{{"type", "error"}, {"error", {{"type", "invalid_request_error"}, {"message", message}}}}
          .dump();
  return res;
}

// A content value's text: a string, or text blocks (joined). `at` names it in errors.
bool TextOfBlocks(const Json& content, const std::string& at, std::string* out,
                  std::string* problem) {
  if (content.is_string()) {
    *out = content.get<std::string>();
    return true;
  }
  if (!content.is_array()) {
    *problem = at + " must be a string or an array of text blocks, not " + JsonTypeName(content);
    return false;
  }
  for (size_t k = 0; k < content.size(); ++k) {
    const Json& block = content[k];
    const std::string block_at = at + "[" + std::to_string(k) + "]";
    if (!block.is_object() || !block.contains("type") || block["type"] != "text" ||
        !block.contains("text") || !block["text"].is_string()) {
      *problem = block_at + " must be a text block {\"type\": \"text\", \"text\": ...}";
      return false;
    }
    *out += block["text"].get<std::string>();
  }
  return true;
}

// One Messages message as chat messages: a user message's tool_result blocks become tool
// messages (before its text), an assistant message's tool_use blocks its tool_calls.
bool ConvertMessage(const Json& m, size_t i, Json* out, std::string* problem) {
  const std::string at = "messages[" + std::to_string(i) + "]";
  if (!m.is_object()) {
    *problem = at + " must be an object {role, content}";
    return false;
  }
  auto role = m.find("role");
  if (role == m.end() || !role->is_string() || (*role != "user" && *role != "assistant")) {
    *problem = at + ".role must be \"user\" or \"assistant\"";
    return false;
  }
  auto content = m.find("content");
  if (content == m.end() || (!content->is_string() && !content->is_array())) {
    *problem = at + ".content must be a string or an array of blocks";
    return false;
  }
  const bool user = *role == "user";
  if (content->is_string()) {
    out->push_back({{"role", *role}, {"content", *content}});
    return true;
  }
  std::string text;
  Json calls = Json::array();
  for (size_t k = 0; k < content->size(); ++k) {
    const Json& block = (*content)[k];
    const std::string block_at = at + ".content[" + std::to_string(k) + "]";
    auto type = block.is_object() ? block.find("type") : block.end();
    if (!block.is_object() || type == block.end() || !type->is_string()) {
      *problem = block_at + " must be a block object with a string type";
      return false;
    }
    const std::string kind = type->get<std::string>();
    if (kind == "text") {
      auto t = block.find("text");
      if (t == block.end() || !t->is_string()) {
        *problem = block_at + ".text must be a string";
        return false;
      }
      text += t->get<std::string>();
    } else if (kind == "tool_use" && !user) {
      auto id = block.find("id");
      auto name = block.find("name");
      auto input = block.find("input");
      if (id == block.end() || !id->is_string() || name == block.end() || !name->is_string() ||
          (input != block.end() && !input->is_object())) {
        *problem = block_at + " must be {\"type\": \"tool_use\", \"id\", \"name\", \"input\": {}}";
        return false;
      }
      calls.push_back(
          {{"id", *id},
           {"type", "function"},
           {"function",
            {{"name", *name}, {"arguments", input != block.end() ? input->dump() : "{}"}}}});
    } else if (kind == "tool_result" && user) {
      auto id = block.find("tool_use_id");
      if (id == block.end() || !id->is_string()) {
        *problem = block_at + ".tool_use_id must be a string";
        return false;
      }
      std::string result;
      if (auto c = block.find("content"); c != block.end() && !c->is_null()) {
        if (!TextOfBlocks(*c, block_at + ".content", &result, problem)) return false;
      }
      out->push_back({{"role", "tool"}, {"tool_call_id", *id}, {"content", result}});
    } else if (kind == "thinking" || kind == "redacted_thinking") {
      // Earlier turns' thinking: not sent back to the model (templates drop past reasoning).
    } else {
      *problem = block_at + ": blocks of type \"" + ToValidUtf8(kind) + "\" are not supported" +
                 (user ? " in user messages (text, tool_result)"
                       : " in assistant messages (text, tool_use)");
      return false;
    }
  }
  if (!user) {
    Json msg = {{"role", "assistant"}, {"content", text}};
    if (!calls.empty()) msg["tool_calls"] = std::move(calls);
    out->push_back(std::move(msg));
  } else if (!text.empty() || out->empty() || out->back()["role"] != "tool") {
    out->push_back({{"role", "user"}, {"content", text}});
  }
  return true;
}

}  // namespace

Result<Json> MessagesToChat(const Json& body, HttpResponse* error) {
  auto fail = [&](const std::string& message) {
    *error = Invalid(message);
    return InvalidArgument(message);
  };
  if (!body.is_object()) return fail("the request body must be a JSON object");
  Json chat = Json::object();
  for (const char* key : {"model", "max_tokens"}) {
    if (!body.contains(key)) return fail(std::string(key) + ": field required");
  }
  chat["model"] = body["model"];
  chat["max_tokens"] = body["max_tokens"];
  for (const char* key : {"temperature", "top_p", "top_k", "stream"}) {
    if (body.contains(key)) chat[key] = body[key];
  }
  if (auto stream = body.find("stream"); stream != body.end() && stream->is_boolean() && *stream) {
    chat["stream_options"] = {{"include_usage", true}};
  }
  if (auto stops = body.find("stop_sequences"); stops != body.end() && !stops->is_null()) {
    chat["stop"] = *stops;
  }
  if (auto thinking = body.find("thinking"); thinking != body.end() && !thinking->is_null()) {
    auto type = thinking->is_object() ? thinking->find("type") : thinking->end();
    if (!thinking->is_object() || type == thinking->end() || *type != "disabled") {
      return fail(
          "thinking: extended thinking budgets are not supported by this server (models "
          "that think do so on their own; their thinking comes as thinking blocks)");
    }
  }
  Json messages = Json::array();
  if (auto system = body.find("system"); system != body.end() && !system->is_null()) {
    std::string text, problem;
    if (!TextOfBlocks(*system, "system", &text, &problem)) return fail(problem);
    messages.push_back({{"role", "system"}, {"content", text}});
  }
  auto list = body.find("messages");
  if (list == body.end() || !list->is_array() || list->empty()) {
    return fail("messages: must be a non-empty array of {role, content}");
  }
  for (size_t i = 0; i < list->size(); ++i) {
    std::string problem;
    if (!ConvertMessage((*list)[i], i, &messages, &problem)) return fail(problem);
  }
  chat["messages"] = std::move(messages);
  if (auto tools = body.find("tools"); tools != body.end() && !tools->is_null()) {
    if (!tools->is_array()) return fail("tools: must be an array");
    Json out = Json::array();
    for (size_t k = 0; k < tools->size(); ++k) {
      const Json& t = (*tools)[k];
      const std::string at = "tools[" + std::to_string(k) + "]";
      if (!t.is_object() || !t.contains("name") || !t["name"].is_string()) {
        return fail(at + " must be {\"name\", \"description\", \"input_schema\"}");
      }
      Json fn = {{"name", t["name"]}};
      if (t.contains("description")) fn["description"] = t["description"];
      if (t.contains("input_schema")) fn["parameters"] = t["input_schema"];
      out.push_back({{"type", "function"}, {"function", std::move(fn)}});
    }
    chat["tools"] = std::move(out);
  }
  if (auto choice = body.find("tool_choice"); choice != body.end() && !choice->is_null()) {
    const std::string type =
        choice->is_object() && choice->contains("type") && (*choice)["type"].is_string()
            ? (*choice)["type"].get<std::string>()
            : "";
    if (type == "auto" || type == "none") {
      chat["tool_choice"] = type;
    } else if (type == "any") {
      chat["tool_choice"] = "required";
    } else if (type == "tool" && choice->contains("name")) {
      chat["tool_choice"] = {{"type", "function"}, {"function", {{"name", (*choice)["name"]}}}};
    } else {
      return fail("tool_choice: must be {\"type\": \"auto\" | \"none\" | \"any\" | \"tool\"}");
    }
  }
  return chat;
}

HttpResponse MessagesError(const HttpResponse& openai_error) {
  const Json j = Json::parse(openai_error.body, nullptr, /*allow_exceptions=*/false);
  std::string message = "request failed";
  if (j.is_object() && j.contains("error") && j["error"].is_object()) {
    const Json& e = j["error"];
    if (e.contains("message") && e["message"].is_string()) message = e["message"];
    if (e.contains("param") && e["param"].is_string() && !e["param"].get<std::string>().empty() &&
        message.find(e["param"].get<std::string>()) == std::string::npos) {
      message = e["param"].get<std::string>() + ": " + message;
    }
  } else if (j.is_object() && j.contains("type") && j["type"] == "error") {
    return openai_error;  // Already in the Messages shape.
  }
  const int s = openai_error.status;
  const char* type = s == 401   ? "authentication_error"
                     : s == 403 ? "permission_error"
                     : s == 404 ? "not_found_error"
                     : s == 413 ? "request_too_large"
                     : s == 429 ? "rate_limit_error"
                     : s == 503 ? "overloaded_error"
                     : s >= 500 ? "api_error"
                                : "invalid_request_error";
  HttpResponse res = openai_error;
  res.body = Json{{"type", "error"}, {"error", {{"type", type}, {"message", message}}}}.dump();
  return res;
}

std::string MessagesStopReason(const std::string& finish_reason, bool stop_sequence) {
  if (finish_reason == "length") return "max_tokens";
  if (finish_reason == "tool_calls") return "tool_use";
  return stop_sequence ? "stop_sequence" : "end_turn";
}

}  // namespace fmoe
