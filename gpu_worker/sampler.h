// Token sampling from one sequence's logits: greedy, temperature, top-k, top-p, with a per-request
// seeded generator, so the same request and seed give the same tokens whatever else is batched.
// Torch-free: works on plain float spans. One Sampler per request, used by the engine thread.
#pragma once

#include <cstdint>
#include <random>
#include <span>
#include <utility>
#include <vector>

#include "common/messages.h"
#include "common/status.h"

namespace fmoe {

// Checks a request's sampling parameters against the model: kInvalidArgument naming the field,
// e.g. "sampling.top_p: 1.5 is not in (0, 1]".
Status ValidateSampling(const SamplingParams& params, uint32_t vocab_size);

class Sampler {
 public:
  explicit Sampler(const SamplingParams& params);
  // The next token. Greedy (temperature 0 or top_k 1) takes the highest logit, the lowest id on
  // ties. Otherwise: logits / temperature, keep the top_k highest (0 = all), then the smallest
  // set of highest-probability tokens whose mass reaches top_p, renormalise, draw. NaN logits
  // never win.
  int32_t Sample(std::span<const float> logits);

 private:
  SamplingParams params_;
  std::mt19937_64 rng_;
  std::vector<std::pair<float, int32_t>> candidates_;
  std::vector<double> probs_;
};

}  // namespace fmoe
