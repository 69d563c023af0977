#include "tools/trainer/corpus.h"

#include <algorithm>
#include <cstdio>
#include <fstream>

namespace fmoe::trainer {
namespace {

constexpr char kSeparator[] = "</s>";
constexpr uint64_t kTokensMagic = 0x31534e4b4f54454dULL;  // "METOKNS1"

}  // namespace

Result<std::vector<std::string>> ReadDocuments(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return NotFound("trainer: cannot read " + path);
  std::vector<std::string> docs;
  std::string doc, line;
  auto flush = [&] {
    while (!doc.empty() && doc.back() == '\n') doc.pop_back();
    if (!doc.empty()) docs.push_back(std::move(doc));
    doc.clear();
  };
  while (std::getline(in, line)) {
    if (line == kSeparator) {
      flush();
      continue;
    }
    doc += line;
    doc += '\n';
  }
  if (in.bad()) return IoError("trainer: error reading " + path);
  flush();
  if (docs.empty()) return InvalidArgument("trainer: " + path + " holds no document");
  return docs;
}

Result<std::vector<int32_t>> TokenizeDocuments(const Tokenizer& tokenizer,
                                               const std::vector<std::string>& docs) {
  const auto bos = tokenizer.bos_id();
  const auto eos = tokenizer.eos_id();
  if (!bos || !eos) return FailedPrecondition("trainer: tokenizer has no <s> or </s> token");
  std::vector<int32_t> out;
  for (size_t i = 0; i < docs.size(); ++i) {
    auto ids = tokenizer.Encode(docs[i], /*add_special_tokens=*/false);
    if (!ids.ok()) return ids.status().WithContext("trainer: document " + std::to_string(i));
    out.push_back(*bos);
    out.insert(out.end(), ids->begin(), ids->end());
    out.push_back(*eos);
  }
  return out;
}

Status WriteTokens(const std::string& path, std::span<const int32_t> tokens) {
  const std::string tmp = path + ".tmp";
  std::FILE* f = std::fopen(tmp.c_str(), "wb");
  if (f == nullptr) return IoError("trainer: cannot write " + tmp);
  const uint64_t header[2] = {kTokensMagic, tokens.size()};
  bool ok = std::fwrite(header, sizeof(header), 1, f) == 1 &&
            std::fwrite(tokens.data(), sizeof(int32_t), tokens.size(), f) == tokens.size();
  ok = (std::fclose(f) == 0) && ok;
  if (!ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
    return IoError("trainer: writing " + path + " failed");
  }
  return Status::Ok();
}

Result<std::vector<int32_t>> ReadTokens(const std::string& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) return NotFound("trainer: no token cache " + path);
  uint64_t header[2] = {0, 0};
  std::vector<int32_t> tokens;
  bool ok = std::fread(header, sizeof(header), 1, f) == 1 && header[0] == kTokensMagic &&
            header[1] < (uint64_t(1) << 34);
  if (ok) {
    tokens.resize(header[1]);
    ok = std::fread(tokens.data(), sizeof(int32_t), tokens.size(), f) == tokens.size();
  }
  std::fclose(f);
  if (!ok) return DataLoss("trainer: token cache " + path + " is truncated or not ours");
  return tokens;
}

std::vector<int32_t> SpreadWindows(std::span<const int32_t> stream, uint32_t seq_len,
                                   uint32_t count) {
  std::vector<int32_t> out;
  if (stream.size() < size_t(seq_len) + 1) return out;
  const size_t available = (stream.size() - 1) / seq_len;
  const size_t n = (count == 0 || count > available) ? available : count;
  out.reserve(n * (seq_len + 1));
  for (size_t i = 0; i < n; ++i) {
    const size_t start = (i * available / n) * seq_len;
    out.insert(out.end(), stream.begin() + long(start), stream.begin() + long(start + seq_len + 1));
  }
  return out;
}

WindowOrder::WindowOrder(size_t stream_tokens, uint32_t seq_len, uint64_t seed)
    : windows_(stream_tokens > seq_len ? (stream_tokens - 1) / seq_len : 0),
      seq_len_(seq_len),
      seed_(seed) {}

size_t WindowOrder::Start(uint64_t g) {
  const uint64_t epoch = g / windows_;
  if (epoch != epoch_) {
    perm_.resize(windows_);
    for (size_t i = 0; i < windows_; ++i) perm_[i] = uint32_t(i);
    std::mt19937_64 rng(seed_ * 0x9E3779B97F4A7C15ULL + epoch);
    for (size_t i = windows_ - 1; i > 0; --i) {  // Fisher-Yates; rng() % n is portable.
      std::swap(perm_[i], perm_[rng() % (i + 1)]);
    }
    epoch_ = epoch;
  }
  return size_t(perm_[g % windows_]) * seq_len_;
}

}  // namespace fmoe::trainer
