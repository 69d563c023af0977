// Structured output on the worker: compiles a request's SamplingParams.json_schema (or grammar)
// once and hands its Sampler a TokenMasker over the model's vocabulary. The vocabulary trie is
// built once per tokenizer (PrepareStructuredOutput, when the engine starts, so no request pays
// for it) and shared by all requests; both functions may be called from any thread.
#pragma once

#include <cstdint>
#include <span>

#include "common/status.h"
#include "common/text/tokenizer.h"
#include "gpu_worker/sampling/sampler.h"

namespace fmoe {

// Builds the tokenizer's TokenVocab now (71 ms at a 150K vocabulary), unless built already.
void PrepareStructuredOutput(const Tokenizer& tokenizer);

// Nothing when params.json_schema and params.grammar are empty. Otherwise compiles the one given
// (common/text/json_schema.h, grammar.h) and constrains `sampler`; the end tokens are eos_ids and
// params.stop_token_ids. With params.constrain_after not empty the constraint starts once its
// tokens are drawn one after another. kInvalidArgument naming what the compiler refused
// ("structured output: schema /properties/a: \"pattern\" is not supported"), a constrain_after that
// is not a token id, or when there is no tokenizer.

Status ConstrainSampler(Sampler& sampler, const SamplingParams& params, const Tokenizer* tokenizer,
                        std::span<const int32_t> eos_ids);

}  // namespace fmoe
