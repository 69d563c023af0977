// What a valid SamplingParams is, defined once. The router checks every request with it after
// parsing (a 400 naming the field, before anything is dispatched); the worker checks every
// Generate it receives (an error event), since a peer may send anything. The codec checks only
// structure (sizes, finite floats). The ranges are OpenAI's where OpenAI has one (temperature up
// to 2, penalties in [-2, 2], logit_bias in [-100, 100], at most 20 logprobs), vLLM's otherwise.
// Stop strings are matched by the client (the router, fmoe-generate), never by the worker: a
// Generate must leave SamplingParams::stop empty, and one that does not is refused.
// Torch-free and stateless: any thread.
#pragma once

#include <cstdint>
#include <string>

#include "common/status.h"
#include "common/wire/messages.h"

namespace fmoe {

inline constexpr float kMaxTemperature = 2.0f;         // temperature in [0, 2]
inline constexpr int32_t kMaxTopK = 1000000;           // top_k in [0, 1000000]; 0 = off
inline constexpr float kMaxPenalty = 2.0f;             // presence/frequency in [-2, 2]
inline constexpr float kMaxRepetitionPenalty = 10.0f;  // repetition_penalty in (0, 10]
inline constexpr float kMaxAbsLogitBias = 100.0f;      // each bias in [-100, 100]

// What is wrong with a SamplingParams: the field (its name in SamplingParams, which is also the
// OpenAI parameter's) and why, e.g. {"top_p", "top_p: 1.5 is not in (0, 1]"}.
struct SamplingProblem {
  std::string field;
  std::string message;  // Starts with the field's name.
};

// Checks `params` against the ranges above and the model's vocabulary (stop_token_ids and
// logit_bias ids below `vocab_size`), min_tokens <= max_tokens, and no stop strings. True when
// valid; else false with *problem set (when not null).
bool CheckSampling(const SamplingParams& params, uint32_t vocab_size, SamplingProblem* problem);

// The same as a Status: kInvalidArgument "sampling.<message>", e.g.
// "sampling.top_p: 1.5 is not in (0, 1]".
Status ValidateSampling(const SamplingParams& params, uint32_t vocab_size);

}  // namespace fmoe
