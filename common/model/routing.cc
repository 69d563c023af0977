#include "common/model/routing.h"

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

namespace fmoe {

Status RoutingSpec::Validate() const {
  if (num_experts == 0) return InvalidArgument("routing: the number of experts is 0");
  if (top_k == 0 || top_k > num_experts) {
    return InvalidArgument("routing: top-k " + std::to_string(top_k) + " is not in [1, " +
                           std::to_string(num_experts) + "]");
  }
  if (groups != GroupScoring::kNone) {
    if (num_groups == 0 || num_experts % num_groups != 0) {
      return InvalidArgument("routing: n_group " + std::to_string(num_groups) +
                             " does not divide the " + std::to_string(num_experts) + " experts");
    }
    if (topk_groups == 0 || topk_groups > num_groups) {
      return InvalidArgument("routing: topk_group " + std::to_string(topk_groups) +
                             " is not in [1, " + std::to_string(num_groups) + "]");
    }
    if (groups == GroupScoring::kTopTwoSum && num_experts / num_groups < 2) {
      return InvalidArgument("routing: noaux_tc needs at least 2 experts per group, not " +
                             std::to_string(num_experts / num_groups));
    }
  }
  if (scoring == RouterScoring::kSparseMixer) {
    if (top_k != 2) {
      return InvalidArgument("routing: sparsemixer routes to 2 experts, not " +
                             std::to_string(top_k));
    }
    if (normalize_topk || groups != GroupScoring::kNone || correction_bias || scaling != 1.0f) {
      return InvalidArgument(
          "routing: sparsemixer takes no renormalisation, groups, correction bias or scaling");
    }
    if (!std::isfinite(jitter_eps) || jitter_eps < 0) {
      return InvalidArgument("routing: router_jitter_noise " + std::to_string(jitter_eps) +
                             " is not a number >= 0");
    }
  }
  if (scoring == RouterScoring::kSoftmaxTopK &&
      (groups != GroupScoring::kNone || correction_bias || scaling != 1.0f)) {
    return InvalidArgument(
        "routing: a softmax over the top-k logits takes no groups, correction bias or scaling");
  }
  if (!std::isfinite(scaling) || scaling <= 0) {
    return InvalidArgument("routing: routed_scaling_factor " + std::to_string(scaling) +
                           " is not a positive number");
  }
  return Status::Ok();
}

std::string RoutingSpec::Describe() const {
  if (scoring == RouterScoring::kSparseMixer) {
    return "sparsemixer (router_jitter_noise " + std::to_string(jitter_eps) + "), top-" +
           std::to_string(top_k) + " of " + std::to_string(num_experts) + ", not renormalised";
  }
  if (scoring == RouterScoring::kSoftmaxTopK) {
    return "top-" + std::to_string(top_k) + " of " + std::to_string(num_experts) +
           " logits, softmax over the chosen";
  }
  std::string s = scoring == RouterScoring::kSoftmax ? "softmax" : "sigmoid";
  if (correction_bias) s += " + correction bias";
  if (groups != GroupScoring::kNone) {
    s += ", best " + std::to_string(topk_groups) + " of " + std::to_string(num_groups) +
         " groups (" + (groups == GroupScoring::kMaxScore ? "max" : "top-2 sum") + ")";
  }
  s += ", top-" + std::to_string(top_k) + " of " + std::to_string(num_experts);
  s += normalize_topk ? ", renormalised" : ", not renormalised";
  if (scaling != 1.0f) s += ", scaled by " + std::to_string(scaling);
  return s;
}

namespace {

// softmax in float32, max-subtracted as torch computes it.
void Softmax(std::span<const float> logits, std::span<float> probs) {
  float max = -INFINITY;
  for (float v : logits) max = std::max(max, v);
  float sum = 0.0f;
  for (size_t e = 0; e < logits.size(); ++e) {
    probs[e] = std::exp(logits[e] - max);
    sum += probs[e];
  }
  for (float& p : probs) p /= sum;
}

// The K largest probabilities, by descending value, the lower index first among equals.
void TopK(std::span<const float> probs, std::span<int32_t> experts) {
  const size_t j = probs.size(), k = experts.size();
  std::vector<int32_t> order(j);
  std::iota(order.begin(), order.end(), 0);
  auto before = [&](int32_t a, int32_t b) {
    // NaN never ranks above a number: a broken router never silently wins.
    const float pa = probs[a], pb = probs[b];
    if (std::isnan(pa) != std::isnan(pb)) return std::isnan(pb);
    if (pa != pb) return pa > pb;
    return a < b;
  };
  std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(k), order.end(),
                    before);
  std::copy_n(order.begin(), k, experts.begin());
}

// Group-limited routing: zeroes the choice scores of every expert outside the best topk_groups
// groups.
void MaskGroups(const RoutingSpec& spec, std::span<float> choice) {
  const size_t n_groups = spec.num_groups, per = choice.size() / n_groups;
  std::vector<float> group_scores(n_groups);
  for (size_t g = 0; g < n_groups; ++g) {
    std::span<const float> members = choice.subspan(g * per, per);
    if (spec.groups == GroupScoring::kMaxScore) {
      group_scores[g] = *std::max_element(members.begin(), members.end());
    } else {
      std::vector<int32_t> two(2);
      TopK(members, two);
      group_scores[g] = members[static_cast<size_t>(two[0])] + members[static_cast<size_t>(two[1])];
    }
  }
  std::vector<int32_t> kept(spec.topk_groups);
  TopK(group_scores, kept);
  std::vector<bool> keep(n_groups, false);
  for (int32_t g : kept) keep[static_cast<size_t>(g)] = true;
  for (size_t g = 0; g < n_groups; ++g) {
    if (keep[g]) continue;
    std::fill_n(choice.begin() + static_cast<std::ptrdiff_t>(g * per), per, 0.0f);
  }
}

// transformers' sparsemixer in eval mode for one token (routing.h). Every step in float32, as
// torch computes it on float32 logits: the threshold mask, the masked softmax, the gather.
void SparseMixer(float jitter_eps, std::span<const float> logits, std::span<float> probs,
                 std::span<int32_t> experts, std::span<float> weights) {
  const size_t j = logits.size();
  Softmax(logits, probs);
  // The two largest logits, the first index among equals (torch's max): the top-2.
  TopK(logits, experts);
  const float limit = static_cast<float>(2.0 * static_cast<double>(jitter_eps));
  std::vector<float> masked(j);
  std::vector<float> gates(j);
  for (size_t round = 0; round < 2; ++round) {
    const size_t pick = static_cast<size_t>(experts[round]);
    const float top = logits[pick];
    for (size_t e = 0; e < j; ++e) {
      const float factor = std::max(std::fabs(logits[e]), top);
      const bool far = (top - logits[e]) / factor > limit;
      // The second round runs on the logits with the first expert removed.
      const bool removed = round == 1 && e == static_cast<size_t>(experts[0]);
      masked[e] = far || removed ? -INFINITY : logits[e];
    }
    Softmax(masked, gates);
    weights[round] = gates[pick];
  }
}

}  // namespace

Status RouteToken(const RoutingSpec& spec, std::span<const float> logits, std::span<float> probs,
                  std::span<int32_t> experts, std::span<float> weights,
                  std::span<const float> bias) {
  FMOE_RETURN_IF_ERROR(spec.Validate());
  const size_t j = spec.num_experts;
  if (logits.size() != j || probs.size() != j || experts.size() != spec.top_k ||
      weights.size() != spec.top_k || bias.size() != (spec.correction_bias ? j : 0)) {
    return InvalidArgument("routing: spans of " + std::to_string(logits.size()) + "/" +
                           std::to_string(probs.size()) + " scores, " +
                           std::to_string(bias.size()) + " biases and " +
                           std::to_string(experts.size()) + "/" + std::to_string(weights.size()) +
                           " choices for " + spec.Describe());
  }
  if (spec.scoring == RouterScoring::kSparseMixer) {
    SparseMixer(spec.jitter_eps, logits, probs, experts, weights);
    return Status::Ok();
  }
  if (spec.scoring == RouterScoring::kSoftmaxTopK) {
    Softmax(logits, probs);
    TopK(logits, experts);
    std::vector<float> chosen(experts.size());
    for (size_t s = 0; s < experts.size(); ++s) chosen[s] = logits[static_cast<size_t>(experts[s])];
    Softmax(chosen, weights);
    return Status::Ok();
  }
  if (spec.scoring == RouterScoring::kSoftmax && !spec.correction_bias &&
      spec.groups == GroupScoring::kNone) {
    // The common case: the probabilities are the choice scores.
    Softmax(logits, probs);
    TopK(probs, experts);
  } else {
    std::vector<float> scores(j);
    if (spec.scoring == RouterScoring::kSoftmax) {
      Softmax(logits, scores);
    } else {
      for (size_t e = 0; e < j; ++e) scores[e] = 1.0f / (1.0f + std::exp(-logits[e]));
    }
    std::vector<float> choice = scores;
    if (spec.correction_bias) {
      for (size_t e = 0; e < j; ++e) choice[e] += bias[e];
    }
    if (spec.groups != GroupScoring::kNone) MaskGroups(spec, choice);
    TopK(choice, experts);
    if (spec.scoring == RouterScoring::kSoftmax) {
      std::copy(scores.begin(), scores.end(), probs.begin());
    } else {
      float total = 0.0f;
      for (float v : scores) total += v;
      for (size_t e = 0; e < j; ++e) probs[e] = scores[e] / total;
    }
    // The weights come from the uncorrected scores.
    float sum = 0.0f;
    for (size_t s = 0; s < experts.size(); ++s) {
      weights[s] = scores[static_cast<size_t>(experts[s])];
      sum += weights[s];
    }
    if (spec.normalize_topk) {
      for (float& w : weights) w /= sum + 1e-20f;
    }
    for (float& w : weights) w *= spec.scaling;
    return Status::Ok();
  }
  float sum = 0.0f;
  for (size_t s = 0; s < experts.size(); ++s) {
    weights[s] = probs[static_cast<size_t>(experts[s])];
    sum += weights[s];
  }
  if (spec.normalize_topk) {
    for (float& w : weights) w /= sum;
  }
  if (spec.scaling != 1.0f) {
    for (float& w : weights) w *= spec.scaling;
  }
  return Status::Ok();
}

Status RouteTokens(const RoutingSpec& spec, size_t rows, std::span<const float> logits,
                   std::span<float> probs, std::span<int32_t> experts, std::span<float> weights,
                   std::span<const float> bias) {
  FMOE_RETURN_IF_ERROR(spec.Validate());
  const size_t j = spec.num_experts, k = spec.top_k;
  if (logits.size() != rows * j || probs.size() != rows * j || experts.size() != rows * k ||
      weights.size() != rows * k) {
    return InvalidArgument("routing: spans do not hold " + std::to_string(rows) + " tokens for " +
                           spec.Describe());
  }
  for (size_t r = 0; r < rows; ++r) {
    FMOE_RETURN_IF_ERROR(RouteToken(spec, logits.subspan(r * j, j), probs.subspan(r * j, j),
                                    experts.subspan(r * k, k), weights.subspan(r * k, k), bias));
  }
  return Status::Ok();
}

}  // namespace fmoe
