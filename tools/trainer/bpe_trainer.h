// Trains a byte-level BPE vocabulary from text and writes it as a Hugging Face tokenizer.json
// (the same format BpeTokenizer reads and the `tokenizers` library loads): GPT-2 style
// pre-tokenizer split, byte-level alphabet of 256 symbols, merges learnt by pair frequency
// (ties broken by the pair's symbols, so a run is deterministic), special tokens first.
// Single-threaded; no state outside a call.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace fmoe {

struct BpeTrainerOptions {
  uint32_t vocab_size = 4096;  // Including the 256 byte symbols and the specials. Default: 4096
  uint32_t min_frequency = 2;  // Pairs seen fewer times are never merged. Default: 2
  // Added first, in order, with ids 0..n-1. Default: <unk>, <s>, </s>, <pad>
  std::vector<std::string> special_tokens = {"<unk>", "<s>", "</s>", "<pad>"};
  std::string bos_token = "<s>";  // Added by the post-processor ("" for none). Default: <s>
  // Must be one of the specials. tokenizer.json has no field for it: Tokenizer::Load finds
  // "</s>" (or <|endoftext|>, ...) by name; any other name needs a tokenizer_config.json.
  std::string eos_token = "</s>";  // Default: </s>
};

class BpeTrainer {
 public:
  explicit BpeTrainer(BpeTrainerOptions options);
  // Counts the pre-tokenized words of one document. Any number of calls, before Train. Special
  // tokens written in the text are cut out (the tokenizer never sees them inside a word).
  // kInvalidArgument when the text is not UTF-8.
  Status Add(std::string_view text);
  // Learns the merges. `progress` (may be empty) gets (merges done, merges wanted).
  Status Train(const std::function<void(size_t, size_t)>& progress = {});
  // Writes tokenizer.json (and nothing else) at `path`. After Train().
  Status Save(const std::string& path) const;

 private:
  struct Impl;
  std::shared_ptr<Impl> impl_;
};

}  // namespace fmoe
