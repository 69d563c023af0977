#include "gpu_worker/sampling/structured_output.h"

#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "common/text/json_schema.h"
#include "common/text/token_mask.h"

namespace fmoe {
namespace {

std::shared_ptr<const TokenVocab> VocabOf(const Tokenizer& tokenizer) {
  static std::mutex mu;
  static std::map<const Tokenizer*, std::shared_ptr<const TokenVocab>> vocabs;  // GUARDED_BY(mu)
  std::lock_guard<std::mutex> lock(mu);
  auto& vocab = vocabs[&tokenizer];
  if (vocab == nullptr) vocab = TokenVocab::FromTokenizer(tokenizer);
  return vocab;
}

}  // namespace

Status ConstrainSampler(Sampler& sampler, const SamplingParams& params, const Tokenizer* tokenizer,
                        std::span<const int32_t> eos_ids) {
  if (params.json_schema.empty()) return Status::Ok();
  if (tokenizer == nullptr) {
    return InvalidArgument("structured output needs the model's tokenizer");
  }
  auto grammar = CompileJsonSchema(params.json_schema);
  if (!grammar.ok()) return InvalidArgument("structured output: " + grammar.status().message());
  std::vector<int32_t> ends(eos_ids.begin(), eos_ids.end());
  ends.insert(ends.end(), params.stop_token_ids.begin(), params.stop_token_ids.end());
  sampler.Constrain(
      std::make_unique<TokenMasker>(*std::move(grammar), VocabOf(*tokenizer), std::move(ends)));
  return Status::Ok();
}

}  // namespace fmoe
