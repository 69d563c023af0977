// libFuzzer target for the <think> splitter (common/text/think_splitter.cc), which reads model
// output: the input's first byte picks the style (low bit) and seeds how the rest is cut into
// pieces, the rest is the decoded text. Checked, besides ASan/UBSan: the result does not depend on
// the cutting (fed whole, byte by byte and in the seeded pieces, content and reasoning come out
// the same); nothing is lost but the markers (the output is no longer than the input); valid UTF-8
// in gives valid UTF-8 pieces out. A violation aborts with __builtin_trap.
// Seeds: tests/fuzz/make_think_corpus.cc.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "common/text/think_splitter.h"
#include "common/text/unicode.h"

namespace {

using fmoe::ThinkSplitter;

void Check(bool ok) {
  if (!ok) __builtin_trap();
}

// `text` fed in pieces (single bytes or seeded lengths up to 13), then finished; joined.
ThinkSplitter::Pieces Feed(fmoe::ThinkStyle style, std::string_view text, uint32_t seed,
                           bool bytewise) {
  ThinkSplitter s(style);
  ThinkSplitter::Pieces all;
  auto add = [&](const ThinkSplitter::Pieces& p) {
    all.content += p.content;
    all.reasoning += p.reasoning;
  };
  for (size_t at = 0; at < text.size();) {
    seed = seed * 1103515245u + 12345u;
    const size_t n = bytewise ? 1 : 1 + (seed >> 16) % 13;
    add(s.Feed(text.substr(at, n)));
    at += n;
  }
  add(s.Finish());
  return all;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0 || size > 8192) return 0;
  const uint32_t seed = data[0] >> 1;
  const fmoe::ThinkStyle style =
      (data[0] & 1) ? fmoe::ThinkStyle::kStartsThinking : fmoe::ThinkStyle::kOpensThinking;
  const std::string_view text(reinterpret_cast<const char*>(data + 1), size - 1);
  const bool utf8 = fmoe::IsValidUtf8(text);
  ThinkSplitter once(style);
  ThinkSplitter::Pieces whole = once.Feed(text);
  ThinkSplitter::Pieces rest = once.Finish();
  whole.content += rest.content;
  whole.reasoning += rest.reasoning;
  Check(whole.content.size() + whole.reasoning.size() <= text.size());
  if (utf8) {
    // The markers are ASCII: what is left of valid text is valid, in each part.
    Check(fmoe::IsValidUtf8(whole.content) && fmoe::IsValidUtf8(whole.reasoning));
  }
  const ThinkSplitter::Pieces cut = Feed(style, text, seed, false);
  Check(cut.content == whole.content && cut.reasoning == whole.reasoning);
  const ThinkSplitter::Pieces bytes = Feed(style, text, seed, true);
  Check(bytes.content == whole.content && bytes.reasoning == whole.reasoning);
  return 0;
}
