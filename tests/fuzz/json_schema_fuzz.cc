// libFuzzer target for structured output's schema compiler and matcher (common/text/
// json_schema.cc, grammar_matcher.cc), which take schemas from HTTP bodies. The input is a schema
// (JSON text), a NUL byte, then bytes. Checked, besides ASan/UBSan and the time limit (no
// exponential blowup): a schema either compiles or is refused with a message; the bytes, fed
// to the matcher, are accepted only as a prefix the matcher can still complete, and a complete
// text is JSON; a walk that picks each next byte among those the matcher accepts (the input's
// bytes choose) never gets stuck before the text is complete. A violation aborts with
// __builtin_trap. Seeds: tests/fuzz/make_json_schema_corpus.cc.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/json.h"
#include "common/text/grammar_matcher.h"
#include "common/text/json_schema.h"

namespace {

void Check(bool ok) {
  if (!ok) __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size > 16384) return 0;
  const std::string_view input(reinterpret_cast<const char*>(data), size);
  const size_t nul = input.find('\0');
  const std::string_view schema = input.substr(0, nul);
  const std::string_view bytes = nul == std::string_view::npos ? "" : input.substr(nul + 1);
  auto grammar = fmoe::CompileJsonSchema(schema);
  if (!grammar.ok()) {
    Check(!grammar.status().message().empty());
    return 0;
  }
  // The bytes as a candidate text.
  fmoe::GrammarMatcher matcher(*grammar);
  if (matcher.Accept(bytes) && matcher.complete()) {
    Check(!nlohmann::json::parse(bytes, nullptr, false).is_discarded());
  }
  // A walk through accepted bytes, chosen by the input's bytes.
  fmoe::GrammarStepper stepper(*grammar);
  fmoe::MatchState state = stepper.Initial(), next;
  std::string text;
  std::vector<uint8_t> options;
  for (size_t i = 0; i < bytes.size() && i < 512; ++i) {
    options.clear();
    for (int b = 0; b < 256; ++b) {
      if (stepper.Step(state, static_cast<uint8_t>(b), &next)) {
        options.push_back(static_cast<uint8_t>(b));
      }
    }
    const bool complete = stepper.Complete(state);
    Check(complete || !options.empty());  // Never stuck.
    if (options.empty()) break;
    const uint8_t pick = options[static_cast<uint8_t>(bytes[i]) % options.size()];
    Check(stepper.Step(state, pick, &next));
    std::swap(state, next);
    text += static_cast<char>(pick);
  }
  if (stepper.Complete(state)) {
    Check(!nlohmann::json::parse(text, nullptr, false).is_discarded());
  }
  return 0;
}
