// libFuzzer target for gpt-oss's channel splitter (common/text/harmony.cc), which reads model
// output: the input's first byte seeds how the rest is cut into pieces, the rest is the decoded
// text. Checked, besides ASan/UBSan: the result does not depend on the cutting (fed whole, byte
// by byte and in the seeded pieces, content and reasoning come out the same), and fed byte by
// byte nothing returned ever holds a whole marker. A violation aborts with __builtin_trap.
// Seeds: tests/fuzz/make_harmony_corpus.cc.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "common/text/harmony.h"

namespace {

void Check(bool ok) {
  if (!ok) __builtin_trap();
}

fmoe::HarmonySplitter::Pieces Feed(std::string_view text, uint32_t seed, bool bytewise) {
  fmoe::HarmonySplitter s;
  fmoe::HarmonySplitter::Pieces all;
  for (size_t at = 0; at < text.size();) {
    seed = seed * 1103515245u + 12345u;
    const size_t n = bytewise ? 1 : 1 + (seed >> 16) % 13;
    fmoe::HarmonySplitter::Pieces p = s.Feed(text.substr(at, n));
    if (bytewise) {
      for (const char* m : {"<|end|>", "<|message|>", "<|channel|>", "<|return|>"}) {
        Check(p.content.find(m) == std::string::npos || text.find(m) != std::string_view::npos);
      }
    }
    all.content += p.content;
    all.reasoning += p.reasoning;
    at += n;
  }
  fmoe::HarmonySplitter::Pieces p = s.Finish();
  all.content += p.content;
  all.reasoning += p.reasoning;
  return all;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0 || size > 8192) return 0;
  const uint32_t seed = data[0];
  const std::string_view text(reinterpret_cast<const char*>(data + 1), size - 1);
  const fmoe::HarmonySplitter::Pieces whole = Feed(text, seed, false);
  fmoe::HarmonySplitter once;
  fmoe::HarmonySplitter::Pieces a = once.Feed(text);
  fmoe::HarmonySplitter::Pieces b = once.Finish();
  Check(a.content + b.content == whole.content);
  Check(a.reasoning + b.reasoning == whole.reasoning);
  const fmoe::HarmonySplitter::Pieces bytes = Feed(text, seed, true);
  Check(bytes.content == whole.content && bytes.reasoning == whole.reasoning);
  return 0;
}
