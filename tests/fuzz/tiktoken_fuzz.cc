// libFuzzer target for the tiktoken.model reader (common/text/tiktoken_tokenizer.cc): the input's
// first byte picks the tokenizer_config.json special tokens (none; Kimi's, numbered from the
// file's N lines, with add_bos_token; one colliding with rank N-1; names that are prefixes of
// each other and of ordinary text), the rest is the file. Checked, besides ASan/UBSan/
// LeakSanitizer and exceptions escaping:
//   - a refused file is kInvalidArgument naming the file ("/fuzz/tiktoken.model: ...") or
//     tokenizer_config.json;
//   - a loaded one has N + 258 ids; every id's token maps back to it (or to the special token
//     spelled the same); a few fixed texts, the
//     file itself and the special names, encoded with and without special tokens, have ids
//     below the vocabulary size and decode to the text (Kimi's pattern covers every character);
//     streamed through TextStream the pieces are valid UTF-8 and concatenate to the decoding.
// A violation aborts with __builtin_trap. Seeds: tests/fuzz/make_tiktoken_corpus.cc.
#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "common/text/tiktoken_tokenizer.h"
#include "common/text/unicode.h"

namespace fmoe {
namespace {

constexpr char kPath[] = "/fuzz/tiktoken.model";
constexpr size_t kMaxTextBytes = 4096;

void Check(bool ok) {
  if (!ok) __builtin_trap();
}

// The lines the reader counts as tokens (empty ones, after a trailing '\r', are skipped).
int64_t CountLines(std::string_view text) {
  int64_t n = 0;
  for (size_t start = 0; start < text.size();) {
    size_t end = text.find('\n', start);
    if (end == std::string_view::npos) end = text.size();
    std::string_view line = text.substr(start, end - start);
    if (!line.empty() && line.back() == '\r') line.remove_suffix(1);
    n += !line.empty();
    start = end + 1;
  }
  return n;
}

TokenizerConfig ConfigFor(uint8_t mode, int64_t n) {
  TokenizerConfig config;
  auto add = [&](int64_t id, std::string content, bool special) {
    config.added_tokens.push_back({id, std::move(content), special});
  };
  switch (mode % 4) {
    case 0:
      break;
    case 1:  // Kimi's.
      add(n, "[BOS]", true);
      add(n + 1, "[EOS]", true);
      add(n + 2, "<|im_end|>", true);
      add(n + 17, "<|im_middle|>", true);
      config.bos_token = "[BOS]";
      config.eos_token = "[EOS]";
      config.add_bos_token = true;
      config.add_eos_token = true;
      break;
    case 2:  // Collides with the last rank.
      add(n > 0 ? n - 1 : 0, "[X]", true);
      break;
    case 3:  // Prefixes of each other, and text the file may hold as tokens.
      add(n, "<|a", true);
      add(n + 1, "<|a|>", false);
      add(n + 2, "e", true);
      add(n + 3, "\n\n", true);
      break;
  }
  return config;
}

void CheckRoundTrip(const TiktokenTokenizer& tok, std::string_view text) {
  if (!IsValidUtf8(text)) {
    Check(!tok.Encode(text, false).ok());
    return;
  }
  for (int how = 0; how < 3; ++how) {
    auto ids = how == 2 ? tok.EncodeOrdinary(text) : tok.Encode(text, how == 1);
    Check(ids.ok());
    for (int32_t id : *ids) Check(id >= 0 && static_cast<size_t>(id) < tok.vocab_size());
    std::string decoded = tok.Decode(*ids, false);
    if (how == 1) {
      std::string bos = tok.bos_id() ? tok.Decode(std::vector<int32_t>{*tok.bos_id()}, false) : "";
      std::string eos = tok.eos_id() ? tok.Decode(std::vector<int32_t>{*tok.eos_id()}, false) : "";
      Check(decoded == bos + std::string(text) + eos);
    } else {
      Check(decoded == text);
    }
    if (how != 0) continue;
    TextStream stream(tok, /*skip_special_tokens=*/true);
    std::string streamed;
    for (int32_t id : *ids) {
      std::string piece = stream.Push(id);
      Check(IsValidUtf8(piece));
      streamed += piece;
    }
    std::string rest = stream.Finish();
    Check(IsValidUtf8(rest));
    Check(streamed + rest == ToValidUtf8(tok.Decode(*ids, true)));
  }
}

void FuzzOne(std::string_view data) {
  if (data.empty()) return;
  const uint8_t mode = static_cast<uint8_t>(data[0]);
  const std::string_view file = data.substr(1);
  const int64_t n = CountLines(file);
  const TokenizerConfig config = ConfigFor(mode, n);
  auto tok = TiktokenTokenizer::Create(file, kPath, config);
  if (!tok.ok()) {
    const Status status = tok.status();
    Check(status.code() == ErrorCode::kInvalidArgument);
    const std::string& m = status.message();
    Check(m.starts_with(std::string(kPath) + ": ") ||
          m.starts_with("/fuzz/tokenizer_config.json: "));
    return;
  }
  Check(mode % 4 != 2);  // Rank N-1 always exists in a file that loads.
  const TiktokenTokenizer& t = **tok;
  Check(static_cast<int64_t>(t.vocab_size()) == n + 258);
  for (int32_t id = 0; static_cast<size_t>(id) < t.vocab_size(); ++id) {
    // A special token spelled as an ordinary one is the one TokenToId finds.
    std::optional<int32_t> back = t.TokenToId(t.IdToToken(id));
    Check(back == id || (id < n && back && *back >= n));
  }
  for (std::string_view text :
       {std::string_view(""), std::string_view("Hello world!  It's 12345 o'clock.\r\n\n"),
        std::string_view("中文字符 HelloWorld DON'T \t\t x"),
        std::string_view("[BOS]a<|im_end|><|a|>e\n\n<|a<|im_middle|>")}) {
    CheckRoundTrip(t, text);
  }
  CheckRoundTrip(t, file.substr(0, kMaxTextBytes));
}

}  // namespace
}  // namespace fmoe

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  fmoe::FuzzOne(std::string_view(reinterpret_cast<const char*>(data), size));
  return 0;
}
