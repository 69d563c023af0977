// Regular expressions for the tokenizers' pre-tokenizer splits: PCRE2 (the only file that
// includes pcre2.h), patterns compiled in UTF + UCP mode (\p{L}, \s and \w are Unicode-aware),
// JIT-compiled when the library supports it. A compiled Regex is immutable and safe to use from
// any thread (each thread gets its own match context and JIT stack).
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "common/status.h"

namespace fmoe {

class Regex {
 public:
  // kInvalidArgument naming the offset and PCRE2's reason when the pattern does not compile.
  static Result<Regex> Compile(std::string_view pattern);

  // Appends the [start, end) byte offsets of every match in `text`, left to right and not
  // overlapping; after an empty match the search resumes one character later. `text` must be
  // valid UTF-8 (not checked again). kResourceExhausted when PCRE2 gives up (match limits).
  Status FindAll(std::string_view text, std::vector<std::pair<size_t, size_t>>* matches) const;
  // The same matches, handed to `fn(start, end)` one at a time (nothing is collected).
  Status ForEachMatch(std::string_view text, const std::function<void(size_t, size_t)>& fn) const;

  const std::string& pattern() const;

 private:
  struct Code;
  explicit Regex(std::shared_ptr<const Code> code) : code_(std::move(code)) {}
  std::shared_ptr<const Code> code_;
};

}  // namespace fmoe
