#include "router/responses.h"

#include <algorithm>
#include <vector>

#include <spdlog/spdlog.h>

#include "common/text/unicode.h"
#include "router/completion_request.h"
#include "router/response_db.h"

namespace fmoe {
namespace {

using Json = nlohmann::json;

// A content value's text: a string, or input_text / output_text / text parts (joined).
bool TextOfParts(const Json& content, const std::string& at, std::string* out,
                 std::string* problem) {
  if (content.is_string()) {
    *out = content.get<std::string>();
    return true;
  }
  if (!content.is_array()) {
    *problem = at + " must be a string or an array of text parts, not " + JsonTypeName(content);
    return false;
  }
  for (size_t k = 0; k < content.size(); ++k) {
    const Json& part = content[k];
    const std::string part_at = at + "[" + std::to_string(k) + "]";
    auto type = part.is_object() ? part.find("type") : part.end();
    auto text = part.is_object() ? part.find("text") : part.end();
    const std::string* kind =
        type != part.end() && type->is_string() ? &type->get_ref<const std::string&>() : nullptr;
    if (kind == nullptr || (*kind != "input_text" && *kind != "output_text" && *kind != "text")) {
      *problem = part_at + ": only input_text and output_text parts are supported";
      return false;
    }
    if (text == part.end() || !text->is_string()) {
      *problem = part_at + ".text must be a string";
      return false;
    }
    *out += text->get<std::string>();
  }
  return true;
}

// Input items as chat messages: messages as they are, function_call items as an assistant
// message's tool_calls (consecutive ones in one message), function_call_output as tool messages.
bool ConvertItems(const Json& input, Json* out, std::string* problem) {
  if (input.is_string()) {
    out->push_back({{"role", "user"}, {"content", input}});
    return true;
  }
  if (!input.is_array()) {
    *problem = "input must be a string or an array of items";
    return false;
  }
  for (size_t i = 0; i < input.size(); ++i) {
    const Json& item = input[i];
    const std::string at = "input[" + std::to_string(i) + "]";
    if (!item.is_object()) {
      *problem = at + " must be an object";
      return false;
    }
    auto type_it = item.find("type");
    const std::string type =
        type_it != item.end() && type_it->is_string() ? type_it->get<std::string>() : "message";
    if (type == "message") {
      auto role = item.find("role");
      if (role == item.end() || !role->is_string() ||
          (*role != "user" && *role != "assistant" && *role != "system" && *role != "developer")) {
        *problem = at + ".role must be user, assistant, system or developer";
        return false;
      }
      auto content = item.find("content");
      if (content == item.end()) {
        *problem = at + ".content is required";
        return false;
      }
      std::string text;
      if (!TextOfParts(*content, at + ".content", &text, problem)) return false;
      out->push_back({{"role", *role}, {"content", text}});
    } else if (type == "function_call") {
      auto call_id = item.find("call_id");
      auto name = item.find("name");
      auto arguments = item.find("arguments");
      if (call_id == item.end() || !call_id->is_string() || name == item.end() ||
          !name->is_string() || arguments == item.end() || !arguments->is_string()) {
        *problem = at +
                   " must be {\"type\": \"function_call\", \"call_id\", \"name\", "
                   "\"arguments\": JSON text}";
        return false;
      }
      Json call = {{"id", *call_id},
                   {"type", "function"},
                   {"function", {{"name", *name}, {"arguments", *arguments}}}};
      if (!out->empty() && out->back()["role"] == "assistant" &&
          out->back().contains("tool_calls")) {
        out->back()["tool_calls"].push_back(std::move(call));
      } else {
        out->push_back({{"role", "assistant"},
                        {"content", nullptr},
                        {"tool_calls", Json::array({std::move(call)})}});
      }
    } else if (type == "function_call_output") {
      auto call_id = item.find("call_id");
      auto output = item.find("output");
      if (call_id == item.end() || !call_id->is_string() || output == item.end()) {
        *problem = at + " must be {\"type\": \"function_call_output\", \"call_id\", \"output\"}";
        return false;
      }
      std::string text;
      if (!TextOfParts(*output, at + ".output", &text, problem)) return false;
      out->push_back({{"role", "tool"}, {"tool_call_id", *call_id}, {"content", text}});
    } else if (type == "reasoning") {
      // An earlier turn's reasoning: not sent back to the model (templates drop it).
    } else {
      *problem = at + ": items of type \"" + ToValidUtf8(type.substr(0, 64)) +
                 "\" are not supported (message, function_call, function_call_output)";
      return false;
    }
  }
  return true;
}

}  // namespace

ResponseStore::ResponseStore(size_t capacity) : capacity_(std::max<size_t>(1, capacity)) {}
ResponseStore::~ResponseStore() = default;

Status ResponseStore::Open(const std::string& dir) {
  FMOE_ASSIGN_OR_RETURN(std::unique_ptr<ResponseDb> db, ResponseDb::Open(dir));
  std::vector<std::string> skipped;
  FMOE_ASSIGN_OR_RETURN(std::vector<ResponseDb::Row> rows, db->Load(&skipped));
  for (const std::string& id : skipped) {
    spdlog::warn("responses {}: the stored response {} does not read back whole; skipped", dir,
                 ToValidUtf8(id.substr(0, 128)));
  }
  std::lock_guard<std::mutex> lock(mu_);
  // Oldest first: the newest ends at the front, as if put in that order.
  const size_t keep = std::min(rows.size(), capacity_);
  for (size_t i = 0; i + keep < rows.size(); ++i) Stored(db->Delete(rows[i].id));
  size_t loaded = 0;
  for (size_t i = rows.size() - keep; i < rows.size(); ++i) {
    Json conversation = Json::parse(rows[i].conversation, nullptr, /*allow_exceptions=*/false);
    if (conversation.is_discarded()) continue;  // Load checked it.
    if (auto it = index_.find(rows[i].id); it != index_.end()) {
      lru_.erase(it->second);
      index_.erase(it);
    }
    lru_.emplace_front(rows[i].id, std::move(conversation));
    index_[rows[i].id] = lru_.begin();
    clock_ = std::max(clock_, rows[i].last_use);
    ++loaded;
  }
  while (lru_.size() > capacity_) {
    index_.erase(lru_.back().first);
    lru_.pop_back();
  }
  spdlog::info("responses {}: {} stored responses loaded ({} older ones dropped, {} skipped)", dir,
               loaded, rows.size() - keep, skipped.size());
  db_ = std::move(db);
  return Status::Ok();
}

bool ResponseStore::persistent() const {
  std::lock_guard<std::mutex> lock(mu_);
  return db_ != nullptr;
}

uint64_t ResponseStore::refused_writes() const {
  std::lock_guard<std::mutex> lock(mu_);
  return refused_;
}

void ResponseStore::Stored(const Status& s) {
  if (s.ok()) return;
  if (refused_++ % 100 == 0) {
    spdlog::warn("responses: {} (kept in memory; {} writes refused so far)", s.message(), refused_);
  }
}

void ResponseStore::Put(const std::string& id, Json conversation) {
  std::lock_guard<std::mutex> lock(mu_);
  if (auto it = index_.find(id); it != index_.end()) {
    lru_.erase(it->second);
    index_.erase(it);
  }
  if (db_ != nullptr) Stored(db_->Put(id, ++clock_, JsonText(conversation)));
  lru_.emplace_front(id, std::move(conversation));
  index_[id] = lru_.begin();
  while (lru_.size() > capacity_) {
    if (db_ != nullptr) Stored(db_->Delete(lru_.back().first));
    index_.erase(lru_.back().first);
    lru_.pop_back();
  }
}

std::optional<Json> ResponseStore::Get(const std::string& id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = index_.find(id);
  if (it == index_.end()) return std::nullopt;
  lru_.splice(lru_.begin(), lru_, it->second);
  if (db_ != nullptr) Stored(db_->Touch(id, ++clock_));
  return it->second->second;
}

size_t ResponseStore::size() const {
  std::lock_guard<std::mutex> lock(mu_);
  return lru_.size();
}

Result<ResponsesRequest> ResponsesToChat(const Json& body, ResponseStore& store,
                                         HttpResponse* error) {
  auto fail = [&](const std::string& param, const std::string& message) {
    *error = BadParam(param, message);
    return InvalidArgument(message);
  };
  if (!body.is_object()) return fail("", "the request body must be a JSON object");
  ResponsesRequest out;
  Json& chat = out.chat;
  chat = Json::object();
  if (auto model = body.find("model"); model != body.end()) chat["model"] = *model;
  for (const char* key : {"temperature", "top_p", "stream"}) {
    if (auto it = body.find(key); it != body.end() && !it->is_null()) {
      chat[key] = *it;
      out.echo[key] = *it;
    }
  }
  if (auto it = body.find("max_output_tokens"); it != body.end() && !it->is_null()) {
    chat["max_tokens"] = *it;
    out.echo["max_output_tokens"] = *it;
  }
  if (auto it = body.find("store"); it != body.end() && !it->is_null()) {
    if (!it->is_boolean()) return fail("store", "'store' must be a boolean");
    out.store = it->get<bool>();
  }
  if (auto it = body.find("reasoning");
      it != body.end() && !it->is_null() && !(it->is_object() && it->empty())) {
    return fail("reasoning",
                "'reasoning' settings are not supported by this server (models that "
                "reason do so on their own; their reasoning comes as a reasoning "
                "item)");
  }
  if (auto text = body.find("text"); text != body.end() && !text->is_null()) {
    // text.format: structured output, as the chat completion's response_format.
    const Json* format =
        text->is_object() && text->contains("format") ? &(*text)["format"] : nullptr;
    const Json type =
        format != nullptr && format->is_object() ? format->value("type", Json()) : Json();
    if (!text->is_object() || (format != nullptr && !format->is_null() && type != "text" &&
                               type != "json_object" && type != "json_schema")) {
      return fail("text",
                  "text.format must be {\"type\": \"text\" | \"json_object\" | "
                  "\"json_schema\"}");
    }
    if (type == "json_object") chat["response_format"] = {{"type", "json_object"}};
    if (type == "json_schema") {
      if (!format->contains("schema")) return fail("text", "text.format.schema is missing");
      chat["response_format"] = {
          {"type", "json_schema"},
          {"json_schema",
           {{"name", format->value("name", Json("response"))}, {"schema", (*format)["schema"]}}}};
    }
  }
  // The conversation: a stored response's, then this request's input.
  Json messages = Json::array();
  if (auto prev = body.find("previous_response_id"); prev != body.end() && !prev->is_null()) {
    if (!prev->is_string()) {
      return fail("previous_response_id", "'previous_response_id' must be a string");
    }
    auto stored = store.Get(prev->get<std::string>());
    if (!stored) {
      *error = ApiError(404,
                        "no response with id '" + ToValidUtf8(prev->get<std::string>()) +
                            "' is kept by this router (it keeps the most recently used ones, "
                            "up to router.responses_capacity; store: false keeps none)",
                        "invalid_request_error", "previous_response_id", "not_found");
      return NotFound("previous_response_id");
    }
    messages = std::move(*stored);
    out.echo["previous_response_id"] = *prev;
  }
  auto input = body.find("input");
  if (input == body.end() || input->is_null()) return fail("input", "'input' is required");
  std::string problem;
  if (!ConvertItems(*input, &messages, &problem)) return fail("input", problem);
  out.conversation = messages;
  if (auto instructions = body.find("instructions");
      instructions != body.end() && !instructions->is_null()) {
    if (!instructions->is_string()) {
      return fail("instructions", "'instructions' must be a string");
    }
    messages.insert(messages.begin(), Json{{"role", "system"}, {"content", *instructions}});
    out.echo["instructions"] = *instructions;
  }
  chat["messages"] = std::move(messages);
  if (auto tools = body.find("tools"); tools != body.end() && !tools->is_null()) {
    if (!tools->is_array()) return fail("tools", "'tools' must be an array");
    Json list = Json::array();
    for (size_t k = 0; k < tools->size(); ++k) {
      const Json& t = (*tools)[k];
      const std::string at = "tools[" + std::to_string(k) + "]";
      auto type = t.is_object() ? t.find("type") : t.end();
      if (type == t.end() || *type != "function" || !t.contains("name") || !t["name"].is_string()) {
        return fail("tools", at + " must be a function tool {\"type\": \"function\", \"name\", "
                                  "\"parameters\"} (built-in tools are not supported)");
      }
      Json fn = {{"name", t["name"]}};
      if (t.contains("description")) fn["description"] = t["description"];
      if (t.contains("parameters")) fn["parameters"] = t["parameters"];
      list.push_back({{"type", "function"}, {"function", std::move(fn)}});
    }
    chat["tools"] = std::move(list);
    out.echo["tools"] = *tools;
  }
  if (auto choice = body.find("tool_choice"); choice != body.end() && !choice->is_null()) {
    if (*choice == "auto" || *choice == "none" || *choice == "required") {
      chat["tool_choice"] = *choice;
    } else if (choice->is_object() && choice->value("type", Json()) == "function" &&
               choice->contains("name")) {
      // {"type": "function", "name": f}: the chat completion's named function.
      chat["tool_choice"] = {{"type", "function"}, {"function", {{"name", (*choice)["name"]}}}};
    } else {
      return fail("tool_choice",
                  "tool_choice must be \"auto\", \"none\", \"required\" or "
                  "{\"type\": \"function\", \"name\": ..}");
    }
    out.echo["tool_choice"] = *choice;
  }
  if (auto s = chat.find("stream"); s != chat.end() && s->is_boolean() && s->get<bool>()) {
    chat["stream_options"] = {{"include_usage", true}};
  }
  return out;
}

}  // namespace fmoe
