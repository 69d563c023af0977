#include "common/text/regex.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

namespace fmoe {
namespace {

constexpr size_t kJitStackStart = 32 * 1024;
constexpr size_t kJitStackMax = 1024 * 1024;

std::string ErrorText(int code) {
  PCRE2_UCHAR buf[256];
  int n = pcre2_get_error_message(code, buf, sizeof(buf));
  if (n < 0) return "PCRE2 error " + std::to_string(code);
  return std::string(reinterpret_cast<const char*>(buf), static_cast<size_t>(n));
}

// One per thread: a match context whose JIT stack may grow to kJitStackMax (the default 32 KB
// is small for long runs of one character class).
struct ThreadMatchContext {
  pcre2_match_context* context = nullptr;
  pcre2_jit_stack* stack = nullptr;

  ThreadMatchContext() {
    context = pcre2_match_context_create(nullptr);
    stack = pcre2_jit_stack_create(kJitStackStart, kJitStackMax, nullptr);
    if (context != nullptr && stack != nullptr) pcre2_jit_stack_assign(context, nullptr, stack);
  }
  ~ThreadMatchContext() {
    if (stack != nullptr) pcre2_jit_stack_free(stack);
    if (context != nullptr) pcre2_match_context_free(context);
  }
  ThreadMatchContext(const ThreadMatchContext&) = delete;
  ThreadMatchContext& operator=(const ThreadMatchContext&) = delete;
};

pcre2_match_context* ThreadContext() {
  thread_local ThreadMatchContext ctx;
  return ctx.context;
}

struct MatchDataDeleter {
  void operator()(pcre2_match_data* d) const { pcre2_match_data_free(d); }
};

}  // namespace

struct Regex::Code {
  std::string pattern;
  pcre2_code* code = nullptr;

  Code() = default;
  Code(const Code&) = delete;
  Code& operator=(const Code&) = delete;
  ~Code() {
    if (code != nullptr) pcre2_code_free(code);
  }
};

Result<Regex> Regex::Compile(std::string_view pattern) {
  auto code = std::make_shared<Code>();
  code->pattern = std::string(pattern);
  int err = 0;
  PCRE2_SIZE offset = 0;
  code->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                             PCRE2_UTF | PCRE2_UCP, &err, &offset, nullptr);
  if (code->code == nullptr) {
    return InvalidArgument("regex /" + code->pattern + "/ does not compile at offset " +
                           std::to_string(offset) + ": " + ErrorText(err));
  }
  // JIT is an optimisation: without it (or when it fails) the interpreter runs the same pattern.
  (void)pcre2_jit_compile(code->code, PCRE2_JIT_COMPLETE);
  return Regex(std::move(code));
}

const std::string& Regex::pattern() const { return code_->pattern; }

Status Regex::FindAll(std::string_view text,
                      std::vector<std::pair<size_t, size_t>>* matches) const {
  return ForEachMatch(text,
                      [matches](size_t begin, size_t end) { matches->emplace_back(begin, end); });
}

Status Regex::ForEachMatch(std::string_view text,
                           const std::function<void(size_t, size_t)>& fn) const {
  std::unique_ptr<pcre2_match_data, MatchDataDeleter> data(
      pcre2_match_data_create_from_pattern(code_->code, nullptr));
  if (data == nullptr) return ResourceExhausted("regex: out of memory for match data");
  pcre2_match_context* context = ThreadContext();
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t start = 0;
  while (start <= text.size()) {
    int rc = pcre2_match(code_->code, subject, text.size(), start, PCRE2_NO_UTF_CHECK, data.get(),
                         context);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc < 0) {
      return ResourceExhausted("regex /" + code_->pattern + "/: " + ErrorText(rc) + " at byte " +
                               std::to_string(start));
    }
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(data.get());
    size_t begin = ov[0];
    size_t end = ov[1];
    if (end < begin) end = begin;  // \K in a lookahead can do this; treat it as empty.
    fn(begin, end);
    if (end > begin) {
      start = end;
      continue;
    }
    // Empty match: resume after the next character.
    if (begin >= text.size()) break;
    size_t next = begin + 1;
    while (next < text.size() && (static_cast<unsigned char>(text[next]) & 0xC0) == 0x80) ++next;
    start = next;
  }
  return Status::Ok();
}

}  // namespace fmoe
