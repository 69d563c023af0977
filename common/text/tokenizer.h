// Tokenizers of Hugging Face model directories: `tokenizer.json` with a byte-level BPE model
// (written by us: added/special tokens, normalizer, pre-tokenizer split, merges, post-processor,
// byte-level decoder), a SentencePiece `tokenizer.model` (through libsentencepiece) or Kimi's
// tiktoken `tiktoken.model` (ours). A loaded
// Tokenizer is immutable and safe to use from any thread; TextStream and StopMatcher belong to
// one request (one thread) each.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace fmoe {

// What DIR/tokenizer_config.json says; every field is optional (a JSON null counts as absent).
// Tokenizer::Load reads it and hands it to the tokenizer it builds.
struct TokenizerConfig {
  std::optional<std::string> bos_token;  // "bos_token": "<s>" or {"content": "<s>", ...}
  std::optional<std::string> eos_token;
  // When given, encoding with add_special_tokens puts BOS first / EOS last (or not), replacing
  // what the tokenizer.json post-processor (or the SentencePiece default: BOS only) does at
  // that end.
  std::optional<bool> add_bos_token;
  std::optional<bool> add_eos_token;
  std::string chat_template;  // Or DIR/chat_template.jinja; "" when neither.
  // "added_tokens_decoder": {"163584": {"content": "[BOS]", "special": true, ...}, ...}. Read
  // only for a tiktoken.model (a tokenizer.json lists its own added tokens).
  struct AddedToken {
    int64_t id = 0;
    std::string content;
    bool special = true;  // "special"; absent counts as true.
  };
  std::vector<AddedToken> added_tokens;
};

class Tokenizer {
 public:
  virtual ~Tokenizer() = default;

  // Loads DIR/tokenizer.json when present, else DIR/tokenizer.model (also when tokenizer.json
  // is SentencePiece-style, with byte_fallback or Metaspace, and tokenizer.model is there), else
  // DIR/tiktoken.model (Kimi's, with added_tokens_decoder's special tokens). Also reads
  // DIR/tokenizer_config.json when present (bos/eos tokens, add_bos_token/add_eos_token,
  // chat_template; else DIR/chat_template.jinja). Without bos/eos there, BOS is the
  // post-processor's leading token and EOS a special token named </s>, <|end_of_text|>,
  // <|endoftext|> or <eos> ([BOS] and [EOS] for tiktoken.model).
  // Errors name the file and the field: "tokenizer: /m/tokenizer.json: model.merges[12]: ...",
  // "tokenizer: /m/tiktoken.model: line 12: ..."
  static Result<std::unique_ptr<Tokenizer>> Load(const std::string& dir);

  // Text (must be valid UTF-8: kInvalidArgument otherwise) to ids. Special tokens written in
  // the text are recognised as such; add_special_tokens applies the post-processor (BOS).
  virtual Result<std::vector<int32_t>> Encode(std::string_view text,
                                              bool add_special_tokens) const = 0;
  // Ids to text. Out-of-range ids decode to nothing. May end in an incomplete UTF-8 sequence
  // when the ids split a character (byte-level BPE); use TextStream for streaming.
  virtual std::string Decode(std::span<const int32_t> ids, bool skip_special_tokens) const = 0;

  virtual size_t vocab_size() const = 0;
  virtual std::optional<int32_t> TokenToId(std::string_view token) const = 0;
  virtual std::string IdToToken(int32_t id) const = 0;  // "" when out of range.
  virtual bool IsSpecial(int32_t id) const = 0;
  virtual std::optional<int32_t> bos_id() const = 0;
  virtual std::optional<int32_t> eos_id() const = 0;
  // tokenizer_config.json's chat_template, "" when none.
  virtual const std::string& chat_template() const = 0;
};

// Incremental detokenization for streaming: Push(id) returns the text that became final with
// this token. Never splits a UTF-8 character (bytes of an incomplete character are held until
// it completes). Every piece is valid UTF-8: ill-formed bytes (a byte-level token that is not a
// whole character, a character cut by the end of generation) become U+FFFD, so the
// concatenation of all pieces plus Finish() equals ToValidUtf8(Decode(all ids)).
class TextStream {
 public:
  TextStream(const Tokenizer& tokenizer, bool skip_special_tokens);
  std::string Push(int32_t id);
  // Whatever is still held (an incomplete character at the end becomes U+FFFD).
  std::string Finish();

 private:
  const Tokenizer& tokenizer_;
  bool skip_special_;
  std::vector<int32_t> ids_;
  size_t prefix_ = 0;         // The window ids_[prefix_..] that Push decodes.
  size_t emitted_bytes_ = 0;  // Bytes of Decode(window) already returned.
};

// Stop strings over streamed text. Feed each piece of new text; Feed returns the text that is
// safe to emit now (text that might be the start of a stop string is held back). Once a stop
// string is found, stopped() is true and no text at or after it is ever emitted.
class StopMatcher {
 public:
  explicit StopMatcher(std::vector<std::string> stops);
  std::string Feed(std::string_view text);
  // The held-back text, when generation ends for another reason.
  std::string Flush();
  bool stopped() const { return stopped_; }
  // Which stop string matched ("" before).
  const std::string& matched() const { return matched_; }

 private:
  std::vector<std::string> stops_;
  std::string pending_;
  bool stopped_ = false;
  std::string matched_;
};

}  // namespace fmoe
