// Token-to-expert routing: from one token's router logits to the experts it uses and their
// weights, as each supported family computes it at inference. Torch-free, so the model runtime,
// the sanitizer build and the benchmarks share one definition.
//
// A router scores every expert from its logit: a float32 softmax over all J (Mixtral, Qwen,
// OLMoE, DeepSeek-V2) or an element-wise sigmoid (DeepSeek-V3). The choice score is the score,
// plus a per-expert correction bias where the layer has one (DeepSeek-V3's
// e_score_correction_bias). With groups (DeepSeek's n_group / topk_group) the J experts form G
// equal groups, each group is scored from its choice scores (kMaxScore: its best expert,
// DeepSeek-V2's group_limited_greedy; kTopTwoSum: its two best summed, DeepSeek-V3's noaux_tc),
// the topk_group best groups stay and every other expert's choice score becomes 0 (as
// transformers' masked_fill: 0, not -inf). The K largest choice scores are picked (ties: the
// lower index first, as torch.topk on CPU); their weights are the uncorrected scores, optionally
// renormalised to sum to 1 (`normalize_topk`; DeepSeek adds 1e-20 to the sum), then multiplied by
// `scaling` (DeepSeek's routed_scaling_factor). The experts are reported by descending choice
// score. Phi-3.5-MoE's sparsemixer (kSparseMixer, top-2 only) is transformers' eval-mode
// `sparsemixer`: the first expert is the largest logit; its weight is the softmax over the logits
// with every logit s masked to -inf where (max - s) / max(|s|, max) > 2 jitter_eps; the second is
// the largest logit once the first is removed, weighted by the softmax over the logits without the
// first, masked the same way against the second's logit (jitter_eps: router_jitter_noise, a
// threshold at inference, not noise). Its weights are not renormalised; its `probs` are the plain
// softmax of the logits. gpt-oss (kSoftmaxTopK) picks the K largest logits and weighs them by a
// softmax over those K only. Pure functions.
#pragma once

#include <cstdint>
#include <span>
#include <string>

#include "common/status.h"

namespace fmoe {

enum class RouterScoring : uint8_t {
  kSoftmax,  // s = softmax(logits) in float32.
  kSigmoid,  // s = sigmoid(logits) in float32, each expert on its own (DeepSeek-V3).
  // Phi-3.5-MoE's sparsemixer at inference (above): top-2 of the logits, each weight a masked
  // softmax. Needs K = 2, no renormalisation, no groups, bias or scaling.
  kSparseMixer,
  // gpt-oss: the top-K of the logits (the router's bias already added), their weights a float32
  // softmax over those K logits alone. `probs` is the softmax over all J. No groups, correction
  // bias or scaling; `normalize_topk` is not read (the weights sum to 1).
  kSoftmaxTopK,
};

// How a group of experts is scored for group-limited routing.
enum class GroupScoring : uint8_t {
  kNone,       // No groups: every expert competes.
  kMaxScore,   // The group's largest choice score (DeepSeek-V2 "group_limited_greedy").
  kTopTwoSum,  // The sum of its two largest choice scores (DeepSeek-V3 "noaux_tc").
};

struct RoutingSpec {
  RouterScoring scoring = RouterScoring::kSoftmax;
  uint32_t num_experts = 0;    // J.
  uint32_t top_k = 0;          // K, 1 <= K <= J.
  bool normalize_topk = true;  // Divide the K weights by their sum.
  GroupScoring groups = GroupScoring::kNone;
  uint32_t num_groups = 1;       // G: divides J (kTopTwoSum: J / G >= 2). Default: 1
  uint32_t topk_groups = 1;      // Groups kept, 1 <= topk_groups <= G. Default: 1
  float scaling = 1.0f;          // The weights' final factor (routed_scaling_factor). Default: 1
  bool correction_bias = false;  // Each call passes J biases added to the choice scores.
  // kSparseMixer's mask threshold (router_jitter_noise), >= 0. Default: 0.01
  float jitter_eps = 0.01f;

  // kInvalidArgument naming the field when K, J or the groups are out of range.
  Status Validate() const;
  // e.g. "softmax, top-2 of 8, renormalised".
  std::string Describe() const;
};

// One token. `logits` and `probs` hold J values, `experts` and `weights` K, `bias` J values when
// spec.correction_bias (else empty). `probs` receives the gate distribution the expert maps record:
// the softmax probabilities (sparsemixer too), or with sigmoid scoring the (uncorrected) sigmoid
// scores divided by their sum, so that it is a distribution over the J experts ordered as the
// scores are. `experts` and `weights` receive the chosen experts by descending choice score. The
// spec must be valid and the spans of the right sizes (checked: kInvalidArgument).
Status RouteToken(const RoutingSpec& spec, std::span<const float> logits, std::span<float> probs,
                  std::span<int32_t> experts, std::span<float> weights,
                  std::span<const float> bias = {});

// `rows` tokens laid out row-major: logits and probs [rows x J], experts and weights [rows x K];
// `bias` (J values) is the layer's, shared by every row.
Status RouteTokens(const RoutingSpec& spec, size_t rows, std::span<const float> logits,
                   std::span<float> probs, std::span<int32_t> experts, std::span<float> weights,
                   std::span<const float> bias = {});

}  // namespace fmoe
