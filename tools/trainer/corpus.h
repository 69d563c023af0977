// Training text for fmoe-train: reads train.txt / val.txt (documents separated by a line holding
// only "</s>", as tools/trainer/prepare_corpus.sh writes them), tokenizes each document as
// <s> text </s>, caches the ids, and serves fixed windows in a seeded, deterministic order.
// Torch-free; one thread owns each object.
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "common/status.h"
#include "common/text/tokenizer.h"

namespace fmoe::trainer {

// The documents of `path`, split at lines "</s>"; empty documents dropped.
Result<std::vector<std::string>> ReadDocuments(const std::string& path);

// <s> doc </s> for every document, concatenated.
Result<std::vector<int32_t>> TokenizeDocuments(const Tokenizer& tokenizer,
                                               const std::vector<std::string>& docs);

// Token caches: a small header (magic, count) and int32 ids.
Status WriteTokens(const std::string& path, std::span<const int32_t> tokens);
Result<std::vector<int32_t>> ReadTokens(const std::string& path);

// `count` windows of seq_len + 1 tokens spread evenly over `stream` (window i starts at
// floor(i * available / count) * seq_len), back to back. count 0 or more than available: all.
std::vector<int32_t> SpreadWindows(std::span<const int32_t> stream, uint32_t seq_len,
                                   uint32_t count);

// The order training windows are visited in: the stream cut into (n - 1) / seq_len windows at
// stride seq_len, each epoch a Fisher-Yates permutation seeded by (seed, epoch). Sample g of
// the run is a pure function of (seed, g), so a resumed run sees the same data.
class WindowOrder {
 public:
  WindowOrder(size_t stream_tokens, uint32_t seq_len, uint64_t seed);
  size_t windows() const { return windows_; }
  // Start offset (in tokens) of the run's g-th window.
  size_t Start(uint64_t g);

 private:
  size_t windows_;
  uint32_t seq_len_;
  uint64_t seed_;
  uint64_t epoch_ = UINT64_MAX;
  std::vector<uint32_t> perm_;
};

}  // namespace fmoe::trainer
