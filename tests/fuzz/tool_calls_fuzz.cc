// libFuzzer target for the tool-call parsers (common/text/tool_calls.cc), which read model output:
// the input's first byte seeds how the rest is cut into pieces, the rest is the decoded text, run
// through every format. Checked, besides ASan/UBSan: the result does not depend on the cutting
// (whole, byte by byte and in the seeded pieces give the same content and calls), calls are
// indexed 0, 1, ... and at most kMaxCalls, every call's arguments are the JSON text of an object,
// and content, names and ids are valid UTF-8. A violation aborts with __builtin_trap.
// Seeds: tests/fuzz/make_tool_calls_corpus.cc.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "common/json.h"
#include "common/text/tool_calls.h"
#include "common/text/unicode.h"

namespace {

void Check(bool ok) {
  if (!ok) __builtin_trap();
}

fmoe::ParsedToolCalls Feed(fmoe::ToolCallFormat format, std::string_view text, uint32_t seed,
                           bool bytewise) {
  fmoe::ToolCallOptions options;
  options.id_seed = seed;
  fmoe::ToolCallStream stream(format, options);
  fmoe::ParsedToolCalls all;
  auto add = [&](fmoe::ToolCallStreamDelta d) {
    Check(fmoe::IsValidUtf8(d.content));
    all.content += d.content;
    for (fmoe::ToolCallDelta& c : d.tool_calls) {
      Check(c.index == all.calls.size());
      Check(!c.id.empty() && !c.name.empty());
      Check(fmoe::IsValidUtf8(c.id) && fmoe::IsValidUtf8(c.name));
      const nlohmann::json args = nlohmann::json::parse(c.arguments, nullptr, false);
      Check(!args.is_discarded() && args.is_object());
      all.calls.push_back({c.id, c.name, c.arguments});
    }
  };
  for (size_t at = 0; at < text.size();) {
    seed = seed * 1103515245u + 12345u;
    const size_t n = bytewise ? 1 : 1 + (seed >> 16) % 13;
    add(stream.Feed(text.substr(at, n)));
    at += n;
  }
  add(stream.Finish());
  Check(all.calls.size() <= fmoe::ToolCallStream::kMaxCalls);
  return all;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0 || size > 8192) return 0;
  const uint32_t seed = data[0];
  const std::string_view text(reinterpret_cast<const char*>(data + 1), size - 1);
  for (fmoe::ToolCallFormat format :
       {fmoe::ToolCallFormat::kNone, fmoe::ToolCallFormat::kHermes, fmoe::ToolCallFormat::kMistral,
        fmoe::ToolCallFormat::kDeepSeekV3, fmoe::ToolCallFormat::kKimiK2,
        fmoe::ToolCallFormat::kGlm45, fmoe::ToolCallFormat::kGptOss,
        fmoe::ToolCallFormat::kMiniMaxM2}) {
    fmoe::ToolCallOptions options;
    options.id_seed = seed;
    const fmoe::ParsedToolCalls whole = fmoe::ParseToolCalls(format, text, options);
    Check(fmoe::IsValidUtf8(whole.content));
    const fmoe::ParsedToolCalls cut = Feed(format, text, seed, false);
    Check(cut.content == whole.content && cut.calls == whole.calls);
    const fmoe::ParsedToolCalls bytes = Feed(format, text, seed, true);
    Check(bytes.content == whole.content && bytes.calls == whole.calls);
    if (format == fmoe::ToolCallFormat::kNone) Check(whole.calls.empty());
  }
  // tool_choice required / named (ToolCallOptions::Forced): the whole text is the JSON.
  for (auto forced :
       {fmoe::ToolCallOptions::Forced::kNamed, fmoe::ToolCallOptions::Forced::kList}) {
    fmoe::ToolCallOptions options;
    options.id_seed = seed;
    options.forced = forced;
    options.forced_name = "f";
    fmoe::ToolCallStream stream(fmoe::ToolCallFormat::kHermes, options);
    const fmoe::ToolCallStreamDelta early = stream.Feed(text);
    Check(early.empty());
    const fmoe::ToolCallStreamDelta d = stream.Finish();
    Check(fmoe::IsValidUtf8(d.content));
    Check(d.tool_calls.empty() || d.content.empty());
    for (const fmoe::ToolCallDelta& c : d.tool_calls) {
      const nlohmann::json args = nlohmann::json::parse(c.arguments, nullptr, false);
      Check(!args.is_discarded() && args.is_object() && !c.id.empty() && !c.name.empty());
    }
  }
  return 0;
}
