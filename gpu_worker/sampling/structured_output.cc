#include "gpu_worker/sampling/structured_output.h"

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/text/grammar.h"
#include "common/text/json_schema.h"
#include "common/text/token_mask.h"

namespace fmoe {
namespace {

// A few tokens' text and the vocabulary's size: tells a tokenizer from another one that a freed
// one's address was reused for (tests load several models in one process).
std::string Fingerprint(const Tokenizer& tokenizer) {
  const size_t n = tokenizer.vocab_size();
  std::string out = std::to_string(n);
  for (size_t k = 0; k < 16 && n > 0; ++k) {
    out += '|';
    out += tokenizer.IdToToken(static_cast<int32_t>(k * n / 16));
  }
  return out;
}

std::shared_ptr<const TokenVocab> VocabOf(const Tokenizer& tokenizer) {
  struct Entry {
    std::string fingerprint;
    std::shared_ptr<const TokenVocab> vocab;
  };
  static std::mutex mu;
  static std::map<const Tokenizer*, Entry> vocabs;  // GUARDED_BY(mu)
  const std::string fingerprint = Fingerprint(tokenizer);
  std::lock_guard<std::mutex> lock(mu);
  Entry& entry = vocabs[&tokenizer];
  if (entry.vocab == nullptr || entry.fingerprint != fingerprint) {
    entry = {fingerprint, TokenVocab::FromTokenizer(tokenizer)};
  }
  return entry.vocab;
}

}  // namespace

void PrepareStructuredOutput(const Tokenizer& tokenizer) { (void)VocabOf(tokenizer); }

Status ConstrainSampler(Sampler& sampler, const SamplingParams& params, const Tokenizer* tokenizer,
                        std::span<const int32_t> eos_ids) {
  if (params.json_schema.empty() && params.grammar.empty()) return Status::Ok();
  if (tokenizer == nullptr) {
    return InvalidArgument("structured output needs the model's tokenizer");
  }
  if (!params.json_schema.empty() && !params.grammar.empty()) {
    return InvalidArgument("structured output: a schema and a grammar both given");
  }
  auto grammar = !params.json_schema.empty() ? CompileJsonSchema(params.json_schema)
                 : params.grammar_syntax == GrammarSyntax::kRegex ? CompileRegex(params.grammar)
                 : params.grammar_syntax == GrammarSyntax::kStructuralTag
                     ? CompileStructuralTag(params.grammar)
                     : CompileGrammar(params.grammar);
  if (!grammar.ok()) return InvalidArgument("structured output: " + grammar.status().message());
  for (const int32_t id : (*grammar)->tokens) {
    if (static_cast<size_t>(id) >= tokenizer->vocab_size()) {
      return InvalidArgument("structured output: the grammar's token <[" + std::to_string(id) +
                             "]> is not in the vocabulary (" +
                             std::to_string(tokenizer->vocab_size()) + " tokens)");
    }
  }
  for (const int32_t id : params.constrain_after) {
    if (id < 0 || static_cast<size_t>(id) >= tokenizer->vocab_size()) {
      return InvalidArgument("structured output: constrain_after " + std::to_string(id) +
                             " is not a token id (vocab " +
                             std::to_string(tokenizer->vocab_size()) + ")");
    }
  }
  std::vector<int32_t> ends(eos_ids.begin(), eos_ids.end());
  ends.insert(ends.end(), params.stop_token_ids.begin(), params.stop_token_ids.end());
  sampler.Constrain(
      std::make_unique<TokenMasker>(*std::move(grammar), VocabOf(*tokenizer), std::move(ends)),
      params.constrain_after);
  return Status::Ok();
}

}  // namespace fmoe
