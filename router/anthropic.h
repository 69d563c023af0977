// Anthropic's Messages API (POST /v1/messages), as coding agents and the `anthropic` client send
// it to local servers: the request is translated into the chat completion it means (system,
// messages with text, tool_use and tool_result blocks, tools, tool_choice, stop_sequences,
// sampling), which ParseRequest then validates like any chat request; answers are written in the
// Messages shapes by Completions (content blocks, stop_reason, the streamed event sequence).
// Stateless and thread-safe.
#pragma once

#include <string>

#include "common/json.h"
#include "common/status.h"
#include "router/http_server.h"

namespace fmoe {

// The chat completion body `body` (a Messages request) means. On error, *error holds a 400 in
// the Messages error shape naming what is wrong. Refused: blocks other than text, tool_use and
// tool_result (images, documents), extended thinking, tool_choice "any" or a named tool (they
// need constrained decoding).
Result<nlohmann::json> MessagesToChat(const nlohmann::json& body, HttpResponse* error);

// An error answer (the OpenAI shape our routes write) rewritten in the Messages shape:
// {"type": "error", "error": {"type": ..., "message": ...}}, the type from the status.
HttpResponse MessagesError(const HttpResponse& openai_error);

// The Messages stop_reason for a chat finish_reason ("stop" with a matched stop sequence:
// "stop_sequence").
std::string MessagesStopReason(const std::string& finish_reason, bool stop_sequence);

}  // namespace fmoe
