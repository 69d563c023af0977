// Token sampling from one sequence's logits with vLLM's logits processing (logit_bias, min_tokens,
// repetition/frequency/presence penalties, temperature, min_p, top_k, top_p) and a per-request
// seeded generator, so the same request and seed give the same tokens whatever else is batched.
// Torch-free: works on plain float spans. One Sampler per request, used by the engine thread;
// it remembers the request's prompt and the tokens it drew (for the penalties and min_tokens).
#pragma once

#include <cstdint>
#include <memory>
#include <random>
#include <span>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common/status.h"
#include "common/text/token_mask.h"
#include "common/wire/messages.h"
#include "common/wire/sampling_limits.h"  // ValidateSampling: what Sampler may be given.

namespace fmoe {

// Log-probabilities of one step, from the model's raw logits (log_softmax before any
// processing, as vLLM reports by default). Non-finite results (a -inf or NaN logit) are reported
// as kMinLogprob, so they stay finite on the wire.
struct TokenLogprobs {
  float token = 0.0f;                            // The drawn token's.
  std::vector<std::pair<int32_t, float>> top{};  // params.logprobs likeliest, lower id on ties.
};
inline constexpr float kMinLogprob = -9999.0f;

class Sampler {
 public:
  // `prompt`: the request's prompt tokens (repetition_penalty covers them; read here, not kept).
  // `eos_ids`: the model's eos tokens, which min_tokens masks with stop_token_ids whether or not
  // ignore_eos is set (as vLLM does).
  explicit Sampler(const SamplingParams& params, std::span<const int32_t> prompt = {},
                   std::span<const int32_t> eos_ids = {});

  // The next token; it counts as generated (for the penalties and min_tokens) from then on.
  // Processing, in vLLM's order: logit_bias added; while fewer than min_tokens tokens were drawn,
  // eos and stop_token_ids set to -inf; repetition_penalty over tokens of the prompt or the
  // output (a positive logit divided, another multiplied); frequency_penalty x count and
  // presence_penalty subtracted for tokens of the output. Greedy (temperature 0 or top_k 1) then
  // takes the highest processed logit, the lowest id on ties. Otherwise: / temperature, drop the
  // tokens with probability < min_p x the likeliest's, keep the top_k highest (0 = all), then
  // the smallest set of highest-probability tokens whose mass reaches top_p, renormalise, draw.
  // NaN logits never win. With every parameter neutral the logits are used as they are.
  // Cost per call: O(vocab) plus O(distinct tokens of the prompt and output) with penalties.
  // With a constraint (structured output), the tokens it does not allow are set to -inf last,
  // after the penalties (min_tokens' eos mask is skipped once the constrained text is complete,
  // when only the end tokens are left); the drawn token advances it. Returns -1 when the
  // constraint allows no token at all (the request cannot go on).
  int32_t Sample(std::span<const float> logits);

  // Structured output: from now on only tokens `constraint` allows are drawn; with `after` not
  // empty, only once its tokens have been drawn one after another (they and what came before are
  // free: a reasoning model's thinking, up to its end-of-thinking token or gpt-oss's final
  // channel header).
  void Constrain(std::unique_ptr<TokenMasker> constraint, std::vector<int32_t> after = {}) {
    if (!after.empty()) {
      pending_ = std::move(constraint);
      pending_after_ = std::move(after);
      recent_.clear();
    } else {
      constraint_ = std::move(constraint);
    }
  }
  // The constraint in force (null before `after` was drawn).
  const TokenMasker* constraint() const { return constraint_.get(); }

  // The last Sample's log-probabilities; meaningful only when params.logprobs >= 0.
  const TokenLogprobs& logprobs() const { return logprobs_; }
  // Tokens drawn so far.
  uint32_t generated() const { return generated_; }

 private:
  struct Seen {
    uint32_t output = 0;     // Times drawn.
    bool in_prompt = false;  // Also in the prompt (repetition_penalty).
  };
  bool penalized() const;
  // The processed logits in processed_, or false when processing would change nothing.
  bool Process(std::span<const float> logits);
  int32_t Draw(std::span<const float> logits);
  void ComputeLogprobs(std::span<const float> logits, int32_t token);

  SamplingParams params_;
  std::mt19937_64 rng_;
  std::vector<int32_t> masked_ids_;         // eos and stop_token_ids, while below min_tokens.
  std::unordered_map<int32_t, Seen> seen_;  // Only with a penalty.
  uint32_t generated_ = 0;
  std::vector<float> processed_;
  std::vector<std::pair<float, int32_t>> candidates_;
  std::vector<double> probs_;
  TokenLogprobs logprobs_;
  std::unique_ptr<TokenMasker> constraint_;  // Structured output; null: none.
  std::unique_ptr<TokenMasker> pending_;     // Structured output once pending_after_ is drawn.
  std::vector<int32_t> pending_after_;
  std::vector<int32_t> recent_;   // While pending: the last tokens drawn (pending_after_'s size).
  std::vector<uint8_t> allowed_;  // constraint_'s mask of this step.
};

}  // namespace fmoe
