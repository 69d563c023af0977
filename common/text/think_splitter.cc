#include "common/text/think_splitter.h"

#include <algorithm>
#include <vector>

#include "common/text/chat_template.h"
#include "common/text/tokenizer.h"

namespace fmoe {
namespace {

// The length of the longest suffix of `text` that is a proper prefix of `marker`.
size_t HeldBack(std::string_view text, std::string_view marker) {
  for (size_t n = std::min(text.size(), marker.size() - 1); n > 0; --n) {
    if (text.substr(text.size() - n) == marker.substr(0, n)) return n;
  }
  return 0;
}

}  // namespace

const char* ThinkStyleName(ThinkStyle style) {
  return style == ThinkStyle::kStartsThinking ? "deepseek_r1" : "qwen3";
}

ThinkSplitter::ThinkSplitter(ThinkStyle style)
    : state_(style == ThinkStyle::kStartsThinking ? State::kThinking : State::kBefore) {}

ThinkSplitter::Pieces ThinkSplitter::Feed(std::string_view text) {
  Pieces out;
  if (state_ == State::kAfter) {
    out.content.append(text);
    return out;
  }
  buf_.append(text);
  while (state_ != State::kAfter) {
    std::string_view rest(buf_);
    if (state_ == State::kBefore) {
      const size_t at = rest.find(kThinkStart);
      if (at == std::string_view::npos) {
        const size_t keep = HeldBack(rest, kThinkStart);
        out.content.append(rest.substr(0, rest.size() - keep));
        buf_.erase(0, rest.size() - keep);
        return out;
      }
      out.content.append(rest.substr(0, at));
      buf_.erase(0, at + kThinkStart.size());
      state_ = State::kThinking;
      continue;
    }
    // Thinking: the earliest marker (they cannot start at the same byte) ends this stretch.
    const size_t start = rest.find(kThinkStart);
    const size_t end = rest.find(kThinkEnd);
    if (start == std::string_view::npos && end == std::string_view::npos) {
      const size_t keep = std::max(HeldBack(rest, kThinkStart), HeldBack(rest, kThinkEnd));
      out.reasoning.append(rest.substr(0, rest.size() - keep));
      buf_.erase(0, rest.size() - keep);
      return out;
    }
    if (start < end) {  // A repeated <think>: dropped.
      out.reasoning.append(rest.substr(0, start));
      buf_.erase(0, start + kThinkStart.size());
      continue;
    }
    out.reasoning.append(rest.substr(0, end));
    buf_.erase(0, end + kThinkEnd.size());
    state_ = State::kAfter;
  }
  out.content.append(buf_);
  buf_.clear();
  return out;
}

ThinkSplitter::Pieces ThinkSplitter::Finish() {
  Pieces out;
  (state_ == State::kThinking ? out.reasoning : out.content) = std::move(buf_);
  buf_.clear();
  return out;
}

std::optional<ThinkStyle> ThinkStyleFor(bool has_markers, std::string_view template_source,
                                        std::string_view generation_prompt) {
  if (!has_markers || template_source.find(kThinkEnd) == std::string_view::npos) {
    return std::nullopt;
  }
  const size_t start = generation_prompt.rfind(kThinkStart);
  const size_t end = generation_prompt.rfind(kThinkEnd);
  const bool inside =
      start != std::string_view::npos && (end == std::string_view::npos || end < start);
  return inside ? ThinkStyle::kStartsThinking : ThinkStyle::kOpensThinking;
}

std::optional<ThinkStyle> ThinkStyleFor(const Tokenizer& tokenizer,
                                        const ChatTemplate& chat_template, const std::string& bos,
                                        const std::string& eos) {
  const bool has_markers =
      tokenizer.TokenToId(kThinkStart).has_value() && tokenizer.TokenToId(kThinkEnd).has_value();
  if (!has_markers) return std::nullopt;
  auto prompt = chat_template.Render({{"user", "Hi"}}, bos, eos, /*add_generation_prompt=*/true);
  return ThinkStyleFor(has_markers, tokenizer.chat_template(), prompt.ok() ? *prompt : "");
}

}  // namespace fmoe
