// libFuzzer target for the cluster key file's parser (common/wire/curve_key.cc): outside input
// read by every process at start. Checked, besides ASan/UBSan/LeakSanitizer: a rejected file
// comes with a non-empty message; an accepted one holds two 40-character keys, and formatting it
// parses back to the same key. A violation aborts with __builtin_trap. Seeds:
// tests/fuzz/make_curve_key_corpus.cc.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "common/wire/curve_key.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace fmoe::wire;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto key = ParseCurveKeyFile(text);
  if (!key.ok()) {
    if (key.status().message().empty()) __builtin_trap();
    return 0;
  }
  if (key->public_key.size() != 40 || key->secret_key.size() != 40) __builtin_trap();
  auto again = ParseCurveKeyFile(FormatCurveKeyFile(*key));
  if (!again.ok() || !(*again == *key)) __builtin_trap();
  return 0;
}
