// Byte-level BPE tokenizer of a Hugging Face tokenizer.json (GPT-2, Llama-3, Qwen2, OLMoE
// style). Encode runs the pipeline in Hugging Face's order: split the raw text on added tokens
// (leftmost longest; lstrip/rstrip/single_word), normalize each stretch between them (ICU),
// split again on normalized added tokens, pre-tokenize (PCRE2 regex splits, digits, the
// byte-level alphabet), BPE-merge each word (lowest merge rank first, leftmost on ties) and add
// the post-processor's special tokens. Decode concatenates each id's bytes, so any split of the
// ids decodes to pieces that concatenate to the whole.
// Immutable after Create; Encode/Decode from any thread. The per-word cache is sharded, each
// shard behind its own mutex, bounded (a full shard is cleared).
#pragma once

#include <memory>

#include "common/text/tokenizer.h"
#include "common/text/tokenizer_json.h"

namespace fmoe {

class BpeTokenizer final : public Tokenizer {
 public:
  // Errors name the field (no file: the caller prepends it).
  static Result<std::unique_ptr<BpeTokenizer>> Create(TokenizerJson spec,
                                                      const TokenizerConfig& config);
  ~BpeTokenizer() override;

  Result<std::vector<int32_t>> Encode(std::string_view text,
                                      bool add_special_tokens) const override;
  std::string Decode(std::span<const int32_t> ids, bool skip_special_tokens) const override;
  size_t vocab_size() const override;
  std::optional<int32_t> TokenToId(std::string_view token) const override;
  std::string IdToToken(int32_t id) const override;
  bool IsSpecial(int32_t id) const override;
  std::optional<int32_t> bos_id() const override;
  std::optional<int32_t> eos_id() const override;
  const std::string& chat_template() const override;

 private:
  struct State;
  explicit BpeTokenizer(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace fmoe
