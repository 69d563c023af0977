// SentencePiece tokenizer of a tokenizer.model (Llama-2, Mistral, Mixtral, Phi-3.5-MoE style)
// through libsentencepiece, opened at run time (libfmoe_sentencepiece.so, sentencepiece_shim.h
// says why). Encode splits the text on the
// surface forms of the control and unknown pieces (<s>, </s>, <unk>), encodes each stretch
// between them with the model, and adds BOS (and EOS) as Llama does when asked. Decode writes
// each piece with U+2581 as a space, byte pieces as their byte and control pieces as their text
// (unless skipped), dropping the dummy-prefix space of the first piece when nothing was written
// before it, as SentencePiece does. Immutable after Load; Encode/Decode from any thread.
#pragma once

#include <memory>

#include "common/text/tokenizer.h"

namespace fmoe {

class SentencePieceTokenizer final : public Tokenizer {
 public:
  // kInvalidArgument "<path>: ..." when the file is not a SentencePiece model.
  static Result<std::unique_ptr<SentencePieceTokenizer>> Load(const std::string& path,
                                                              const TokenizerConfig& config);
  ~SentencePieceTokenizer() override;

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
  explicit SentencePieceTokenizer(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

}  // namespace fmoe
