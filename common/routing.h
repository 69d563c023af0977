// Token-to-expert routing: from one token's router logits to the experts it uses and their
// weights, as each supported family computes it at inference. Torch-free, so the model runtime,
// the sanitizer build and the benchmarks share one definition.
//
// Every family today scores with a float32 softmax over all J experts, keeps the K largest
// probabilities (ties: the lower expert index first, as torch.topk on CPU), and either uses those
// probabilities as they are or renormalises them to sum to 1 (`normalize_topk`: Mixtral always;
// Qwen2-MoE, Qwen3-MoE and OLMoE by their `norm_topk_prob`). The experts are reported in
// descending weight order. Pure functions.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "common/status.h"

namespace fmoe {

enum class RouterScoring : uint8_t {
  kSoftmax,  // p = softmax(logits) in float32.
};

struct RoutingSpec {
  RouterScoring scoring = RouterScoring::kSoftmax;
  uint32_t num_experts = 0;    // J.
  uint32_t top_k = 0;          // K, 1 <= K <= J.
  bool normalize_topk = true;  // Divide the K weights by their sum.

  // kInvalidArgument naming the field when K or J is out of range.
  Status Validate() const;
  // e.g. "softmax, top-2 of 8, renormalised".
  std::string Describe() const;
};

// One token. `logits` and `probs` hold J values, `experts` and `weights` K. `probs` receives the
// scores over every expert (the gate distribution the expert maps record); `experts` and
// `weights` the chosen experts by descending weight. The spec must be valid and the spans of
// the right sizes (checked: kInvalidArgument).
Status RouteToken(const RoutingSpec& spec, std::span<const float> logits, std::span<float> probs,
                  std::span<int32_t> experts, std::span<float> weights);

// `rows` tokens laid out row-major: logits and probs [rows x J], experts and weights [rows x K].
Status RouteTokens(const RoutingSpec& spec, size_t rows, std::span<const float> logits,
                   std::span<float> probs, std::span<int32_t> experts, std::span<float> weights);

}  // namespace fmoe
