#include "common/text/harmony.h"

#include <algorithm>
#include <array>

namespace fmoe {
namespace {

constexpr std::string_view kMessage = "<|message|>";
constexpr std::string_view kChannel = "<|channel|>";
// What ends a message's body (<|start|> only if a model skips the end).
constexpr std::array<std::string_view, 4> kBodyEnds = {"<|end|>", "<|return|>", "<|call|>",
                                                       "<|start|>"};
// Every marker, removed from header text that turns out to be content.
constexpr std::array<std::string_view, 7> kMarkers = {"<|start|>",    "<|channel|>", "<|message|>",
                                                      "<|end|>",      "<|return|>",  "<|call|>",
                                                      "<|constrain|>"};

// The length of the longest suffix of `text` that is a proper prefix of a marker.
size_t HeldBack(std::string_view text) {
  size_t best = 0;
  for (std::string_view m : kMarkers) {
    for (size_t n = std::min(text.size(), m.size() - 1); n > best; --n) {
      if (text.substr(text.size() - n) == m.substr(0, n)) {
        best = n;
        break;
      }
    }
  }
  return best;
}

std::string WithoutMarkers(std::string_view text) {
  std::string out(text);
  for (std::string_view m : kMarkers) {
    for (size_t at = out.find(m); at != std::string::npos; at = out.find(m, at)) {
      out.erase(at, m.size());
    }
  }
  return out;
}

// The channel a header names: the word after <|channel|> (up to a space or a marker).
std::string ChannelOf(std::string_view header) {
  const size_t at = header.rfind(kChannel);
  if (at == std::string_view::npos) return "";
  std::string_view rest = header.substr(at + kChannel.size());
  const size_t end = rest.find_first_of(" <\t\n");
  return std::string(rest.substr(0, end));
}

}  // namespace

void HarmonySplitter::Route(std::string_view text, Pieces* out) const {
  (reasoning_ ? out->reasoning : out->content).append(text);
}

HarmonySplitter::Pieces HarmonySplitter::Feed(std::string_view text) {
  Pieces out;
  buf_.append(text);
  while (!buf_.empty()) {
    if (state_ == State::kHeader) {
      // A header is <|message|> within its first kMaxHeaderBytes; the decision waits until the
      // bytes that settle it are in, so it never depends on how the text was cut.
      const size_t at = buf_.find(kMessage);
      if (at != std::string::npos && at <= kMaxHeaderBytes) {
        reasoning_ = ChannelOf(std::string_view(buf_).substr(0, at)) == "analysis";
        buf_.erase(0, at + kMessage.size());
        state_ = State::kBody;
        continue;
      }
      if (buf_.size() <= kMaxHeaderBytes + kMessage.size()) break;
      // No header after all: the text is a content message's body (read as bodies are).
      reasoning_ = false;
      state_ = State::kBody;
      continue;
    }
    size_t end = std::string::npos, end_len = 0;
    for (std::string_view m : kBodyEnds) {
      const size_t at = buf_.find(m);
      if (at < end) {
        end = at;
        end_len = m.size();
      }
    }
    if (end != std::string::npos) {
      Route(std::string_view(buf_).substr(0, end), &out);
      buf_.erase(0, end + end_len);  // The next message's header follows.
      state_ = State::kHeader;
      continue;
    }
    const size_t keep = HeldBack(buf_);
    Route(std::string_view(buf_).substr(0, buf_.size() - keep), &out);
    buf_.erase(0, buf_.size() - keep);
    break;
  }
  return out;
}

HarmonySplitter::Pieces HarmonySplitter::Finish() {
  Pieces out;
  if (state_ == State::kBody) {
    Route(buf_, &out);
  } else {
    out.content = WithoutMarkers(buf_);
  }
  buf_.clear();
  state_ = State::kHeader;
  return out;
}

}  // namespace fmoe
