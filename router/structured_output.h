// Structured output on the router: the request fields that constrain a completion to a JSON
// Schema (OpenAI's response_format json_object / json_schema, vLLM's structured_outputs.json and
// guided_json, tool_choice "required" or a named function) read into
// CompletionRequest.sampling.json_schema, and those that constrain it to a regex, a choice, a
// GBNF grammar or a structural tag (vLLM's structured_outputs.regex / choice / grammar /
// structural_tag, guided_regex / guided_choice / guided_grammar, response_format
// structural_tag) read into sampling.grammar; the worker compiles them and decodes under them
// (common/text/json_schema.h, grammar.h). They are compiled here too, so one the compiler
// refuses is a 400 naming the field and what is wrong, never an error event. Stateless.
#pragma once

#include <string>

#include "common/json.h"
#include "common/text/tokenizer.h"
#include "router/completion_request.h"

namespace fmoe {

// response_format, structured_outputs, guided_json, guided_regex, guided_choice and
// guided_grammar (a structural tag's xgrammar `format`: refused by name). At most one of them may
// constrain the output, and not beside a forced tool_choice.
bool ReadStructuredOutput(const nlohmann::json& body, CompletionRequest* out, HttpResponse* error);

// tool_choice "required" (`named` empty) or the function `named`: the answer is decoded under
// vLLM's schema (required: [{"name": one of the tools, "parameters": its parameters}, ...];
// named: the function's parameters) and parsed back into tool_calls (ToolCallOptions::Forced).
// `tools` as ReadTools keeps them. 400 naming tool_choice or tools[k].function.parameters.
bool ForceToolChoice(const std::string& named, const nlohmann::ordered_json& tools,
                     CompletionRequest* out, HttpResponse* error);

// tool_choice "required" with several tools on gpt-oss (harmony): the answer opens with a call
// to one of them as the model writes one after the generation prompt (<|start|>assistant):
// " to=functions.NAME<|channel|>commentary json<|message|>", the arguments under NAME's
// parameters, then <|call|>, each marker the special token itself (a structural tag with
// token_ids, grammar.h); the answer is parsed as any harmony call. 400 naming tool_choice (the
// vocabulary lacks a marker) or tools[k].function.parameters.
bool ForceHarmonyCall(const nlohmann::ordered_json& tools, const Tokenizer& tokenizer,
                      CompletionRequest* out, HttpResponse* error);

}  // namespace fmoe
