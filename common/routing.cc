#include "common/routing.h"

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
  return Status::Ok();
}

std::string RoutingSpec::Describe() const {
  std::string s = "softmax, top-" + std::to_string(top_k) + " of " + std::to_string(num_experts);
  s += normalize_topk ? ", renormalised" : ", not renormalised";
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

}  // namespace

Status RouteToken(const RoutingSpec& spec, std::span<const float> logits, std::span<float> probs,
                  std::span<int32_t> experts, std::span<float> weights) {
  FMOE_RETURN_IF_ERROR(spec.Validate());
  if (logits.size() != spec.num_experts || probs.size() != spec.num_experts ||
      experts.size() != spec.top_k || weights.size() != spec.top_k) {
    return InvalidArgument("routing: spans of " + std::to_string(logits.size()) + "/" +
                           std::to_string(probs.size()) + " scores and " +
                           std::to_string(experts.size()) + "/" + std::to_string(weights.size()) +
                           " choices for " + spec.Describe());
  }
  Softmax(logits, probs);
  TopK(probs, experts);
  float sum = 0.0f;
  for (size_t s = 0; s < experts.size(); ++s) {
    weights[s] = probs[static_cast<size_t>(experts[s])];
    sum += weights[s];
  }
  if (spec.normalize_topk) {
    for (float& w : weights) w /= sum;
  }
  return Status::Ok();
}

Status RouteTokens(const RoutingSpec& spec, size_t rows, std::span<const float> logits,
                   std::span<float> probs, std::span<int32_t> experts, std::span<float> weights) {
  FMOE_RETURN_IF_ERROR(spec.Validate());
  const size_t j = spec.num_experts, k = spec.top_k;
  if (logits.size() != rows * j || probs.size() != rows * j || experts.size() != rows * k ||
      weights.size() != rows * k) {
    return InvalidArgument("routing: spans do not hold " + std::to_string(rows) + " tokens for " +
                           spec.Describe());
  }
  for (size_t r = 0; r < rows; ++r) {
    FMOE_RETURN_IF_ERROR(RouteToken(spec, logits.subspan(r * j, j), probs.subspan(r * j, j),
                                    experts.subspan(r * k, k), weights.subspan(r * k, k)));
  }
  return Status::Ok();
}

}  // namespace fmoe
