#include "gpu_worker/sampling/sampler.h"

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

}  // namespace

Sampler::Sampler(const SamplingParams& params, std::span<const int32_t> prompt,
                 std::span<const int32_t> eos_ids)
    : params_(params), rng_(params.seed) {
  if (params_.min_tokens > 0) {
    masked_ids_.assign(eos_ids.begin(), eos_ids.end());
    masked_ids_.insert(masked_ids_.end(), params_.stop_token_ids.begin(),
                       params_.stop_token_ids.end());
  }
  if (params_.repetition_penalty != 1.0f) {
    for (int32_t id : prompt) seen_[id].in_prompt = true;
  }
  if (params_.logprobs > 0) logprobs_.top.reserve(static_cast<size_t>(params_.logprobs) + 1);
}

bool Sampler::penalized() const {
  return params_.repetition_penalty != 1.0f || params_.frequency_penalty != 0.0f ||
         params_.presence_penalty != 0.0f;
}

bool Sampler::Process(std::span<const float> logits) {
  const bool masking = generated_ < params_.min_tokens && !masked_ids_.empty() &&
                       (constraint_ == nullptr || !constraint_->complete());
  if (params_.logit_bias.empty() && !masking && !penalized() && constraint_ == nullptr) {
    return false;
  }
  const size_t n = logits.size();
  processed_.assign(logits.begin(), logits.end());
  for (const auto& [id, bias] : params_.logit_bias) {
    if (id >= 0 && static_cast<size_t>(id) < n) processed_[static_cast<size_t>(id)] += bias;
  }
  if (masking) {
    for (int32_t id : masked_ids_) {
      if (id >= 0 && static_cast<size_t>(id) < n) {
        processed_[static_cast<size_t>(id)] = -std::numeric_limits<float>::infinity();
      }
    }
  }
  if (penalized()) {
    const float rep = params_.repetition_penalty;
    for (const auto& [id, seen] : seen_) {
      if (id < 0 || static_cast<size_t>(id) >= n) continue;
      float& logit = processed_[static_cast<size_t>(id)];
      if (rep != 1.0f) logit = logit > 0.0f ? logit / rep : logit * rep;
      if (seen.output > 0) {
        logit -= params_.frequency_penalty * static_cast<float>(seen.output);
        logit -= params_.presence_penalty;
      }
    }
  }
  if (constraint_ != nullptr) {
    for (size_t i = 0; i < n; ++i) {
      if (!allowed_[i]) processed_[i] = -std::numeric_limits<float>::infinity();
    }
  }
  return true;
}

int32_t Sampler::Sample(std::span<const float> raw) {
  if (raw.empty()) return -1;
  if (constraint_ != nullptr && constraint_->Fill(raw.size(), &allowed_) == 0) return -1;
  const std::span<const float> logits = Process(raw) ? std::span<const float>(processed_) : raw;
  int32_t token = Draw(logits);
  if (constraint_ != nullptr) {
    // Every allowed logit -inf (or NaN): Draw's fallback may be a masked token; take the first
    // allowed one instead.
    if (!allowed_[static_cast<size_t>(token)]) {
      token =
          static_cast<int32_t>(std::find(allowed_.begin(), allowed_.end(), 1) - allowed_.begin());
    }
    if (!constraint_->Accept(token)) return -1;
  }
  if (pending_ != nullptr) {
    if (recent_.size() == pending_after_.size()) recent_.erase(recent_.begin());
    recent_.push_back(token);
    if (recent_ == pending_after_) constraint_ = std::move(pending_);
  }
  ++generated_;
  if (penalized()) ++seen_[token].output;
  if (params_.logprobs >= 0) ComputeLogprobs(raw, token);
  return token;
}

int32_t Sampler::Draw(std::span<const float> logits) {
  const int32_t n = static_cast<int32_t>(logits.size());
  if (params_.temperature == 0.0f || params_.top_k == 1) {
    int32_t best = 0;
    for (int32_t i = 1; i < n; ++i) {
      if (Clean(logits[i]) > Clean(logits[best])) best = i;
    }
    return best;
  }
  candidates_.resize(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) candidates_[i] = {Clean(logits[i]), i};
  if (params_.min_p > 0.0f) {
    // p / p_max = exp((logit - max) / temperature), as the draw below computes it.
    const double max = std::min_element(candidates_.begin(), candidates_.end(), Better)->first;
    if (std::isfinite(max)) {
      std::erase_if(candidates_, [&](const std::pair<float, int32_t>& c) {
        return std::exp((c.first - max) / params_.temperature) < params_.min_p;
      });
    }
  }
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

void Sampler::ComputeLogprobs(std::span<const float> logits, int32_t token) {
  const size_t n = logits.size();
  double max = -std::numeric_limits<double>::infinity();
  for (float l : logits) max = std::max<double>(max, Clean(l));
  double sum = 0.0;
  for (float l : logits) sum += std::exp(Clean(l) - max);
  const double log_total = max + std::log(sum);
  auto logprob = [&](size_t i) {
    const double v = Clean(logits[i]) - log_total;
    return std::isfinite(v) && v > kMinLogprob ? static_cast<float>(v) : kMinLogprob;
  };
  logprobs_.token = token >= 0 && static_cast<size_t>(token) < n ? logprob(token) : kMinLogprob;
  // The best params.logprobs by raw logit (the same order as by log-probability), kept sorted.
  std::vector<std::pair<int32_t, float>>& top = logprobs_.top;
  top.clear();
  const size_t want = static_cast<size_t>(params_.logprobs);
  if (want == 0) return;
  auto better = [&](size_t i, const std::pair<int32_t, float>& kept) {
    return Better({Clean(logits[i]), static_cast<int32_t>(i)},
                  {Clean(logits[static_cast<size_t>(kept.first)]), kept.first});
  };
  for (size_t i = 0; i < n; ++i) {
    if (top.size() == want && !better(i, top.back())) continue;
    auto at =
        std::find_if(top.begin(), top.end(), [&](const auto& kept) { return better(i, kept); });
    top.insert(at, {static_cast<int32_t>(i), 0.0f});
    if (top.size() > want) top.pop_back();
  }
  for (auto& [id, value] : top) value = logprob(static_cast<size_t>(id));
}

}  // namespace fmoe
