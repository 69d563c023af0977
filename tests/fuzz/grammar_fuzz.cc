// libFuzzer target for structured output's grammar, regex, choice and structural tag compilers and
// the matcher running them (common/text/grammar.cc, grammar_matcher.cc), which take vLLM's
// guided_grammar, guided_regex, guided_choice and structural_tag from HTTP bodies. The input is
// a selector byte (0: GBNF, 1: regex, 2: choice, its strings split at '\n', 3: a structural
// tag's JSON spec), the text, a NUL byte, then bytes. Checked,
// besides ASan/UBSan and the time limit (no exponential blowup, no hang on left recursion): a
// text either compiles or is refused with a message; a walk that picks each next byte among
// those the matcher accepts (the input's bytes choose) never gets stuck before the text is
// complete (unless the matcher's depth or stack bound narrowed the language), and a complete walk
// is accepted again by a fresh matcher; a choice's complete text is one of its strings. A violation
// aborts with __builtin_trap. Seeds: tests/fuzz/make_grammar_corpus.cc.
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "common/text/grammar.h"
#include "common/text/grammar_matcher.h"

namespace {

void Check(bool ok) {
  if (!ok) __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1 || size > 16384) return 0;
  const std::string_view input(reinterpret_cast<const char*>(data) + 1, size - 1);
  const size_t nul = input.find('\0');
  const std::string_view text = input.substr(0, nul);
  const std::string_view bytes = nul == std::string_view::npos ? "" : input.substr(nul + 1);
  std::vector<std::string> choices;
  fmoe::Result<std::shared_ptr<const fmoe::JsonGrammar>> grammar = fmoe::InvalidArgument("unset");
  switch (data[0] % 4) {
    case 0:
      grammar = fmoe::CompileGrammar(text);
      break;
    case 1:
      grammar = fmoe::CompileRegex(text);
      break;
    case 3:
      grammar = fmoe::CompileStructuralTag(text);
      break;
    default:
      for (size_t at = 0; at <= text.size();) {
        const size_t end = std::min(text.find('\n', at), text.size());
        choices.emplace_back(text.substr(at, end - at));
        at = end + 1;
      }
      grammar = fmoe::CompileChoice(choices);
      break;
  }
  if (!grammar.ok()) {
    Check(!grammar.status().message().empty());
    return 0;
  }
  fmoe::GrammarMatcher candidate(*grammar);
  const bool whole = candidate.Accept(bytes) && candidate.complete();
  if (!choices.empty() && whole) {
    Check(std::find(choices.begin(), choices.end(), bytes) != choices.end());
  }
  // A walk through accepted bytes, chosen by the input's bytes.
  fmoe::GrammarStepper stepper(*grammar);
  fmoe::MatchState state = stepper.Initial(), next;
  std::string walk;
  std::vector<uint8_t> options;
  for (size_t i = 0; i < bytes.size() && i < 256; ++i) {
    options.clear();
    for (int b = 0; b < 256; ++b) {
      if (stepper.Step(state, static_cast<uint8_t>(b), &next)) {
        options.push_back(static_cast<uint8_t>(b));
      }
    }
    const bool complete = stepper.Complete(state);
    // Never stuck after a start, unless a bound narrowed the language (recursion as deep as the
    // matcher keeps, or as many open parses).
    size_t deepest = 0;
    for (size_t k = 0; k < state.ends.size(); ++k) {
      deepest = std::max<size_t>(deepest, state.ends[k] - (k == 0 ? 0 : state.ends[k - 1]));
    }
    const bool narrowed =
        deepest + 4 >= fmoe::kMaxMatchDepth || state.ends.size() >= fmoe::kMaxStacks;
    Check(complete || !options.empty() || walk.empty() || narrowed);
    if (options.empty()) break;
    const uint8_t pick = options[static_cast<uint8_t>(bytes[i]) % options.size()];
    Check(stepper.Step(state, pick, &next));
    std::swap(state, next);
    walk += static_cast<char>(pick);
  }
  if (stepper.Complete(state)) {
    fmoe::GrammarMatcher again(*grammar);
    Check(again.Accept(walk) && again.complete());
    if (!choices.empty()) {
      Check(std::find(choices.begin(), choices.end(), walk) != choices.end());
    }
  }
  return 0;
}
