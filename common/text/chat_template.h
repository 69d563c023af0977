// Chat templates of Hugging Face models: the Jinja2 subset that tokenizer_config.json's
// "chat_template" uses, rendered byte for byte as transformers' apply_chat_template renders it
// (trim_blocks, lstrip_blocks, break/continue, macros, raise_exception(), strftime_now(), tojson
// without HTML escaping).
// What is supported is listed at the top of chat_template.cc. Compile once; a ChatTemplate is
// immutable and Render may be called from any thread (each call has its own state). Every render
// is bounded by ChatTemplateOptions, so no template or input can hang it or exhaust memory.
#pragma once

#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "common/status.h"

namespace fmoe {

struct ChatMessage {
  std::string role;  // "system", "user", "assistant", ...
  std::string content;
};

struct ChatTemplateOptions {
  // The most bytes one render may produce; also the largest string an expression may build.
  // Default: 1 MiB
  size_t max_output_bytes = size_t{1} << 20;
  // The most iterations of all for loops together in one render (a loop's `if` filter counts
  // every item it looks at). Default: 100000
  size_t max_loop_iterations = 100000;
  // The most work in one render: one unit per expression evaluated plus one per byte that an
  // operator, filter or method copies, compares or searches. Default: 64 Mi units (well under a
  // second)
  size_t max_work = size_t{64} << 20;
  // The time strftime_now(format) formats (in the local time zone, as transformers'
  // datetime.now() does); tests fix it. Called from the rendering thread.
  // Default: null (std::chrono::system_clock::now)
  std::function<std::chrono::system_clock::time_point()> clock;
};

class ChatTemplate {
 public:
  // Parses `source` (the template text, as decoded from tokenizer_config.json). A syntax error is
  // kInvalidArgument naming the place and what was expected, e.g. "chat template: line 3,
  // column 8: expected an expression, found '}}'". Unknown filters and tests are syntax errors.
  static Result<ChatTemplate> Compile(std::string_view source,
                                      const ChatTemplateOptions& options = {});

  // Renders with the variables apply_chat_template passes: `messages` (a list of {role,
  // content}), bos_token, eos_token, add_generation_prompt, and tools and documents (none).
  // Errors, all but the limits kInvalidArgument:
  //   - raise_exception(msg) in the template: the message is exactly msg (e.g. "Conversation
  //     roles must alternate user/assistant/user/assistant/...");
  //   - another error while rendering: "chat template: line 4: 'dict object' has no attribute
  //     'x'" (Jinja's wording where it has one);
  //   - strings that are not valid UTF-8;
  //   - kResourceExhausted: a limit of ChatTemplateOptions was reached.
  Result<std::string> Render(const std::vector<ChatMessage>& messages, const std::string& bos_token,
                             const std::string& eos_token, bool add_generation_prompt) const;

  // Renders with any variables: the members of a JSON object (messages with more fields, tools,
  // ...). Object members keep their order (tojson writes them in that order).
  Result<std::string> Render(const nlohmann::ordered_json& variables) const;

 private:
  struct Program;
  explicit ChatTemplate(std::shared_ptr<const Program> program) : program_(std::move(program)) {}

  std::shared_ptr<const Program> program_;
};

// Compiles and renders in one step (tools and tests; a server compiles once and keeps the
// ChatTemplate).
Result<std::string> RenderChatTemplate(std::string_view source,
                                       const std::vector<ChatMessage>& messages,
                                       const std::string& bos_token, const std::string& eos_token,
                                       bool add_generation_prompt);

}  // namespace fmoe
