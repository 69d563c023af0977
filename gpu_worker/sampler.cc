#include "gpu_worker/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

namespace fmoe {
namespace {

// Higher logit first, lower id on ties: a total order, so results never depend on sort details.
bool Better(const std::pair<float, int32_t>& a, const std::pair<float, int32_t>& b) {
  return a.first != b.first ? a.first > b.first : a.second < b.second;
}

float Clean(float logit) {
  return std::isnan(logit) ? -std::numeric_limits<float>::infinity() : logit;
}

std::string Num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", v);
  return buf;
}

}  // namespace

Status ValidateSampling(const SamplingParams& p, uint32_t vocab_size) {
  if (!std::isfinite(p.temperature) || p.temperature < 0.0f) {
    return InvalidArgument("sampling.temperature: " + Num(p.temperature) + " is not >= 0");
  }
  if (!(p.top_p > 0.0f && p.top_p <= 1.0f)) {
    return InvalidArgument("sampling.top_p: " + Num(p.top_p) + " is not in (0, 1]");
  }
  if (p.top_k < 0) return InvalidArgument("sampling.top_k: " + Num(p.top_k) + " is negative");
  if (p.max_tokens == 0) return InvalidArgument("sampling.max_tokens: must be at least 1");
  for (int32_t id : p.stop_token_ids) {
    if (id < 0 || static_cast<uint32_t>(id) >= vocab_size) {
      return InvalidArgument("sampling.stop_token_ids: " + std::to_string(id) +
                             " is not a token id (vocab " + std::to_string(vocab_size) + ")");
    }
  }
  return Status::Ok();
}

Sampler::Sampler(const SamplingParams& params) : params_(params), rng_(params.seed) {}

int32_t Sampler::Sample(std::span<const float> logits) {
  const int32_t n = static_cast<int32_t>(logits.size());
  if (n == 0) return -1;
  if (params_.temperature == 0.0f || params_.top_k == 1) {
    int32_t best = 0;
    for (int32_t i = 1; i < n; ++i) {
      if (Clean(logits[i]) > Clean(logits[best])) best = i;
    }
    return best;
  }
  candidates_.resize(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) candidates_[i] = {Clean(logits[i]), i};
  size_t keep = candidates_.size();
  if (params_.top_k > 0 && static_cast<size_t>(params_.top_k) < keep) {
    keep = static_cast<size_t>(params_.top_k);
  }
  // Best first where order matters (a top-k cut or a top-p walk); otherwise only the maximum.
  if (keep < candidates_.size() || params_.top_p < 1.0f) {
    std::partial_sort(candidates_.begin(), candidates_.begin() + static_cast<std::ptrdiff_t>(keep),
                      candidates_.end(), Better);
    candidates_.resize(keep);
  } else {
    std::iter_swap(candidates_.begin(),
                   std::min_element(candidates_.begin(), candidates_.end(), Better));
  }
  const double max_logit = candidates_[0].first;
  if (!std::isfinite(max_logit)) return candidates_[0].second;
  probs_.resize(keep);
  double total = 0.0;
  for (size_t i = 0; i < keep; ++i) {
    probs_[i] = std::exp((candidates_[i].first - max_logit) / params_.temperature);
    total += probs_[i];
  }
  if (params_.top_p < 1.0f) {
    double mass = 0.0;
    size_t cut = 0;
    while (cut < keep) {
      mass += probs_[cut] / total;
      ++cut;
      if (mass >= params_.top_p) break;
    }
    keep = cut;
    total = 0.0;
    for (size_t i = 0; i < keep; ++i) total += probs_[i];
  }
  // 53 random bits: the same draw on every platform (std distributions are not portable).
  const double u = static_cast<double>(rng_() >> 11) * 0x1.0p-53 * total;
  double acc = 0.0;
  for (size_t i = 0; i < keep; ++i) {
    acc += probs_[i];
    if (u < acc) return candidates_[i].second;
  }
  return candidates_[keep - 1].second;
}

}  // namespace fmoe
