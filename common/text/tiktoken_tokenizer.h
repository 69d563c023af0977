// Tokenizer of a tiktoken.model (Kimi-K2: moonshotai's TikTokenTokenizer, tokenization_kimi.py):
// one line per token, its bytes in base64, a space and its rank, which is its id. The special
// tokens follow the N ranks: ids N..N+257 (Kimi's 256 reserved plus 2), named by
// tokenizer_config.json's added_tokens_decoder, "<|reserved_token_ID|>" where it names none.
// Encode works as Kimi's encode: the text in chunks of 400,000 characters, each cut where a run
// of whitespace or of non-whitespace passes 25,000; in each piece the special tokens written in
// it (leftmost, longest), the text between them split by Kimi's pattern, each split merged as
// tiktoken does (the split itself when it is a token, else its bytes, merging the adjacent pair
// whose bytes have the lowest rank). Decode writes each id's bytes. Immutable after Create;
// Encode/Decode from any thread.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "common/text/tokenizer.h"

namespace fmoe {

class TiktokenTokenizer final : public Tokenizer {
 public:
  // The tokenizer of a tiktoken.model's `text`; `path` names the file in errors
  // ("<path>: line 12: ..."). Every line is checked (empty lines are skipped, as tiktoken
  // does), the ranks must be 0..N-1, every single byte must be a token, and the ids of
  // config.added_tokens must be N..N+257 (errors name the tokenizer_config.json beside `path`).
  // add_bos_token/add_eos_token (default: neither, as Kimi) apply with add_special_tokens.
  static Result<std::unique_ptr<TiktokenTokenizer>> Create(std::string_view text,
                                                           const std::string& path,
                                                           const TokenizerConfig& config);
  ~TiktokenTokenizer() override;

  Result<std::vector<int32_t>> Encode(std::string_view text,
                                      bool add_special_tokens) const override;
  // tiktoken's encode_ordinary (Kimi's encode with allow_special_tokens=False): special tokens
  // written in the text are encoded as text.
  Result<std::vector<int32_t>> EncodeOrdinary(std::string_view text) const;
  std::string Decode(std::span<const int32_t> ids, bool skip_special_tokens) const override;
  size_t vocab_size() const override;
  // Tokens are spelled in GPT-2's byte-level alphabet, as Kimi's get_vocab does; special tokens
  // as their text.
  std::optional<int32_t> TokenToId(std::string_view token) const override;
  std::string IdToToken(int32_t id) const override;
  bool IsSpecial(int32_t id) const override;
  std::optional<int32_t> bos_id() const override;
  std::optional<int32_t> eos_id() const override;
  const std::string& chat_template() const override;

 private:
  struct State;
  explicit TiktokenTokenizer(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace fmoe
