// Reasoning models' output split at <think>/</think> as a chat answer shows it (vLLM's
// `deepseek_r1` and `qwen3` reasoning parsers): the thinking is the answer's `reasoning_content`,
// the rest its `content`, the markers in neither. Two styles, chosen per model by ThinkStyleFor:
//   kStartsThinking (deepseek_r1; also MiniMax-M2): the chat template ends the prompt with
//     <think>, so the output starts inside the thinking; all before the first </think> is
//     reasoning, an output without </think> is all reasoning.
//   kOpensThinking (qwen3; also GLM-4.5, Kimi-K2-Thinking): the model writes <think> itself;
//     text before it is content, an output without <think> (enable_thinking false) all content.
// States: kBefore (kOpensThinking only) -<think>-> kThinking -</think>-> kAfter. While thinking a
// repeated <think> is dropped; after </think> everything is content, markers included (as vLLM).
// Input is bytes (never trusted to be UTF-8); the markers are ASCII, so valid input gives valid
// pieces. Streaming: what is returned never changes later, and a suffix that may still become a
// marker is held back until it cannot, so the split never depends on how the text was cut.
// One per choice; not thread-safe.
#pragma once

#include <optional>
#include <string>
#include <string_view>

namespace fmoe {

class ChatTemplate;
class Tokenizer;

enum class ThinkStyle {
  kStartsThinking,  // vLLM's deepseek_r1: the prompt ends inside <think>.
  kOpensThinking,   // vLLM's qwen3: the model opens <think> itself.
};

const char* ThinkStyleName(ThinkStyle style);  // "deepseek_r1", "qwen3"

inline constexpr std::string_view kThinkStart = "<think>";
inline constexpr std::string_view kThinkEnd = "</think>";

class ThinkSplitter {
 public:
  struct Pieces {
    std::string content;
    std::string reasoning;
  };
  explicit ThinkSplitter(ThinkStyle style);
  // The next decoded text; returns what can be told apart so far.
  Pieces Feed(std::string_view text);
  // The end of the output: whatever is held back, as text of the current state.
  Pieces Finish();

 private:
  enum class State { kBefore, kThinking, kAfter };
  State state_;
  std::string buf_;  // Held back: a proper prefix of a marker the current state looks for.
};

// The style of a model's chat answers, or none when its thinking is not split out: the tokenizer
// must have <think> and </think> as tokens and the chat template must mention </think>.
// kStartsThinking when the template's generation prompt (one user message, rendered with
// `bos`/`eos`) ends inside <think> (its last <think> after its last </think>), kOpensThinking
// otherwise.
std::optional<ThinkStyle> ThinkStyleFor(const Tokenizer& tokenizer,
                                        const ChatTemplate& chat_template, const std::string& bos,
                                        const std::string& eos);
// The same decision from what it reads: whether both markers are tokens, the template source and
// its rendered generation prompt.
std::optional<ThinkStyle> ThinkStyleFor(bool has_markers, std::string_view template_source,
                                        std::string_view generation_prompt);

}  // namespace fmoe
