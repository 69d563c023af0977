// libFuzzer target for the chat template compiler and renderer (common/text/chat_template*.cc):
// the input is a template source, as tokenizer_config.json carries one. It is compiled, and a
// compiled one rendered twice with variables that reach the usual paths (a system, user,
// assistant and tool conversation with reasoning and tool calls, tools, add_generation_prompt,
// bos/eos, gpt-oss's kwargs), with small limits. Checked, besides ASan/UBSan/LeakSanitizer and
// exceptions escaping: a failure is kInvalidArgument or kResourceExhausted with a message; a
// render's output stays within max_output_bytes; the same render twice gives the same result
// (the clock is fixed). A violation aborts with __builtin_trap. Seeds: make_template_corpus.cc.
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "common/json.h"
#include "common/text/chat_template.h"

namespace fmoe {
namespace {

void Check(bool ok) {
  if (!ok) __builtin_trap();
}

const nlohmann::ordered_json& Variables() {
  static const nlohmann::ordered_json* v =
      new nlohmann::ordered_json(nlohmann::ordered_json::parse(R"({
    "messages": [
      {"role": "system", "content": "Be brief."},
      {"role": "user", "content": "Weather in Paris? \u00e9\ud83d\ude42"},
      {"role": "assistant", "content": "", "reasoning_content": "Call the tool.",
       "thinking": "Call the tool.",
       "tool_calls": [{"id": "c1", "type": "function",
                       "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
      {"role": "tool", "tool_call_id": "c1", "content": "{\"temp\": 21}"},
      {"role": "assistant", "content": "21 C.", "reasoning_content": "Done."},
      {"role": "user", "content": [{"type": "text", "text": "Thanks"}]}
    ],
    "tools": [{"type": "function", "function": {"name": "get_weather", "description": "Weather.",
               "parameters": {"type": "object", "properties": {"city": {"type": "string",
               "enum": ["Paris", "Rome"]}, "days": {"type": ["integer", "null"], "default": 1}},
               "required": ["city"]}}}],
    "add_generation_prompt": true,
    "bos_token": "<s>",
    "eos_token": "</s>",
    "reasoning_effort": "low",
    "model_identity": "a test model",
    "builtin_tools": ["browser"],
    "enable_thinking": true
  })"));
  return *v;
}

bool Expected(const Status& s) {
  return (s.code() == ErrorCode::kInvalidArgument || s.code() == ErrorCode::kResourceExhausted) &&
         !s.message().empty();
}

}  // namespace
}  // namespace fmoe

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace fmoe;
  const std::string_view source(reinterpret_cast<const char*>(data), size);
  ChatTemplateOptions options;
  options.max_output_bytes = 64 << 10;
  options.max_loop_iterations = 2000;
  options.max_work = 1 << 20;
  options.clock = [] {
    return std::chrono::system_clock::time_point(std::chrono::hours(24 * 20000));
  };
  Result<ChatTemplate> t = ChatTemplate::Compile(source, options);
  if (!t.ok()) {
    Check(Expected(t.status()));
    return 0;
  }
  Result<std::string> a = t->Render(Variables());
  Result<std::string> b = t->Render(Variables());
  Check(a.ok() == b.ok());
  if (a.ok()) {
    Check(a->size() <= options.max_output_bytes);
    Check(*a == *b);
  } else {
    Check(Expected(a.status()));
    Check(a.status().message() == b.status().message());
  }
  return 0;
}
