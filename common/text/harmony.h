// gpt-oss's harmony output, split into its channels as a chat answer shows them: the model writes
// messages "[<|start|>assistant]<|channel|>NAME[ to=...][<|constrain|>...]<|message|>BODY" ended
// by <|end|>, <|return|> or <|call|>; the `analysis` channel's bodies are the answer's
// `reasoning_content`, every other channel's (`final`, `commentary`) its `content` (as vLLM's
// gpt-oss reasoning parser does; tool calls are not parsed out of `commentary` here). The markers
// never reach either. Streaming: text is fed as it is decoded (special tokens kept), and what is
// returned never changes later; a suffix that may still become a marker is held back until it
// cannot. Text outside any message (a model that writes no header) is content. One per choice.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace fmoe {

class HarmonySplitter {
 public:
  struct Pieces {
    std::string content;
    std::string reasoning;
  };
  // The next decoded text; returns what can be told apart so far.
  Pieces Feed(std::string_view text);
  // The end of the output: whatever is held back, as text of the current message.
  Pieces Finish();

  // Text with no <|message|> starting within its first this many bytes is not a header: it is
  // the body of a content message.
  static constexpr size_t kMaxHeaderBytes = 512;

 private:
  enum class State { kHeader, kBody };
  void Route(std::string_view text, Pieces* out) const;
  State state_ = State::kHeader;
  bool reasoning_ = false;  // The current message is the analysis channel.
  std::string buf_;         // Not yet told apart.
};

}  // namespace fmoe
