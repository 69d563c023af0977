// A model's generated text split into content and OpenAI tool calls, one parser per model
// family's format (vLLM's --tool-call-parser names): hermes, mistral, deepseek_v3, kimi_k2,
// glm45, gpt_oss, minimax_m2. Whole (ParseToolCalls) or streamed (ToolCallStream: Feed the text
// as it is decoded, special tokens kept, then Finish); the streamed deltas joined equal the whole
// parse, however the text is cut. A call is reported once it is complete and its arguments are
// checked (a JSON object, normalised by nlohmann::json), in one delta carrying its id, name and
// whole arguments; text that may still become a marker is held back until it cannot. A malformed
// call (bad JSON, no name, unterminated at Finish, over kMaxCallBytes) stays content, verbatim, as
// vLLM does; the markers of well-formed calls and sections never reach content, and whitespace
// after a call is dropped. Everything returned is valid UTF-8. One ToolCallStream per choice;
// not thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace fmoe {

enum class ToolCallFormat {
  // No tool calls: everything is content.
  kNone,
  // Qwen2.5/3(-MoE), Hermes: <tool_call>{"name": .., "arguments": {..}}</tool_call>; also
  // Qwen3-Coder's <tool_call><function=f><parameter=k>v</parameter>..</function></tool_call>
  // (its values are strings unless typed otherwise).
  kHermes,
  // [TOOL_CALLS][{"name": .., "arguments": {..}}, ..], or [TOOL_CALLS]f[ARGS]{..}.
  kMistral,
  // <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{..}\n```
  // <｜tool▁call▁end｜>..<｜tool▁calls▁end｜> (V3/R1), or V3.1's f<｜tool▁sep｜>{..} in the call.
  kDeepSeekV3,
  // <|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{..}
  // <|tool_call_end|>..<|tool_calls_section_end|>.
  kKimiK2,
  // GLM-4.5/4.6: <tool_call>f\n<arg_key>k</arg_key>\n<arg_value>v</arg_value>..</tool_call>; a
  // value that is JSON stays JSON, others are strings.
  kGlm45,
  // gpt-oss (harmony): a message whose header names `to=functions.f`, ended by <|call|>. Content is
  // the other messages verbatim (markers kept), for HarmonySplitter.
  kGptOss,
  // <minimax:tool_call><invoke name="f"><parameter name="k">v</parameter></invoke>..
  // </minimax:tool_call>; values are strings unless typed otherwise.
  kMiniMaxM2,
};

// "none", "hermes" (also "qwen3_coder"), "mistral", "deepseek_v3" (also "deepseek_v31",
// "deepseekv3"), "kimi_k2", "glm45" (also "glm4_moe"), "gpt_oss" (also "openai"), "minimax_m2".
// kInvalidArgument otherwise.
Result<ToolCallFormat> ParseToolCallFormat(std::string_view name);
std::string_view ToolCallFormatName(ToolCallFormat format);

// The default format of a config.json architecture: Qwen2Moe/Qwen3Moe -> hermes, Mixtral ->
// mistral, DeepseekV2/V3 -> deepseek_v3 (kimi_k2 when `kimi_tokenizer`: Kimi-K2 has DeepSeek-V3's
// architecture and a tiktoken.model), Glm4Moe -> glm45, GptOss -> gpt_oss, MiniMaxM2 ->
// minimax_m2; kNone for the others.
ToolCallFormat ToolCallFormatFor(std::string_view architecture, bool kimi_tokenizer = false);

// Every marker a format's calls are written with (section and call delimiters, and the ones
// inside a call: DeepSeek's tool separator, Mistral's [ARGS], Kimi's argument begin, GLM's argument
// tags, harmony's headers). A caller that decodes with special tokens skipped must keep these as
// text for the parser to see them.
std::vector<std::string_view> ToolCallMarkers(ToolCallFormat format);

struct ToolCallOptions {
  // Seeds the generated call ids ("call_" and 24 alphanumerics; Mistral's templates require 9
  // alphanumerics). Give each request its own so that ids differ across turns. Kimi-K2's calls
  // keep the model's own id (functions.NAME:IDX). Default: 0.
  uint64_t id_seed = 0;
  // Tool name -> argument name -> the JSON-schema "type" the request's `tools` declare for it.
  // Read by the formats that write arguments as text (glm45: "string" keeps a value a string;
  // minimax_m2 and Qwen3-Coder: converted from a string by type). Default: empty.
  std::map<std::string, std::map<std::string, std::string, std::less<>>, std::less<>> arg_types;
  // tool_choice "required" or a named function, decoded under a JSON Schema (structured output)
  // as vLLM does it: the whole answer is JSON instead of the model's format, parsed at Finish
  // (Feed holds everything back). kNamed: the arguments object of `forced_name`; kList:
  // [{"name": .., "parameters": {..}}, ..]. An answer that is not such JSON (cut by max_tokens)
  // stays content. Default: kNone (the format's parser).
  enum class Forced { kNone, kNamed, kList };
  Forced forced = Forced::kNone;
  std::string forced_name;
};

struct ToolCall {
  std::string id;
  std::string name;
  std::string arguments;  // JSON text of an object.
  bool operator==(const ToolCall&) const = default;
};

struct ParsedToolCalls {
  std::string content;
  std::vector<ToolCall> calls;
};

ParsedToolCalls ParseToolCalls(ToolCallFormat format, std::string_view text,
                               const ToolCallOptions& options = {});

// One entry of a streamed chunk's `delta.tool_calls`. A call comes in one delta: index, id, name
// and its whole arguments (OpenAI clients concatenate `arguments` over a call's deltas).
struct ToolCallDelta {
  size_t index = 0;
  std::string id;
  std::string name;
  std::string arguments;
};

struct ToolCallStreamDelta {
  std::string content;
  std::vector<ToolCallDelta> tool_calls;
  bool empty() const { return content.empty() && tool_calls.empty(); }
};

struct ToolCallSpec;  // A format's markers and parser (tool_calls.cc).

class ToolCallStream {
 public:
  explicit ToolCallStream(ToolCallFormat format, ToolCallOptions options = {});

  // The next decoded text; returns what can be told apart so far.
  ToolCallStreamDelta Feed(std::string_view piece);
  // The end of the output: what is held back, as calls or content. Feed after Finish starts over.
  ToolCallStreamDelta Finish();

  size_t calls() const { return calls_; }

  // Calls past this many stay content.
  static constexpr size_t kMaxCalls = 128;
  // A call's text (markers included) longer than this is not a call.
  static constexpr size_t kMaxCallBytes = size_t{1} << 20;

 private:
  enum class Mode { kText, kCall };
  void Process(bool final, ToolCallStreamDelta* out);
  bool ProcessText(bool final, ToolCallStreamDelta* out);
  bool ProcessCall(bool final, ToolCallStreamDelta* out);
  void EmitContent(std::string_view text, ToolCallStreamDelta* out);
  void Reset();
  ToolCallStreamDelta FinishForced();

  const ToolCallSpec* spec_;
  ToolCallOptions options_;
  Mode mode_ = Mode::kText;
  bool in_section_ = false;  // Between a section's begin and end markers (deepseek, kimi).
  bool trim_ = false;        // Drop whitespace before the next content (after a call).
  size_t begin_len_ = 0;     // kCall: the begin marker's bytes at buf_[0].
  size_t scan_ = 0;          // kCall: where the search for the call's end resumes.
  int json_depth_ = 0;       // kCall, mistral: the arguments' JSON scanned up to scan_.
  bool json_in_string_ = false;
  bool json_escape_ = false;
  size_t json_start_ = 0;  // 0: not found yet.
  size_t calls_ = 0;
  std::string buf_;      // Not yet told apart.
  std::string pending_;  // Content held back for an incomplete UTF-8 character.
};

}  // namespace fmoe
