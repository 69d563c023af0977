#include "common/wire/sampling_limits.h"

#include <cmath>
#include <cstdio>
#include <utility>

namespace fmoe {
namespace {

std::string Num(double v) {
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g", v);
  return buf;
}

bool Fail(SamplingProblem* problem, std::string field, std::string why) {
  if (problem != nullptr) {
    problem->message = field + ": " + std::move(why);
    problem->field = std::move(field);
  }
  return false;
}

// `value` in [lo, hi] (lo excluded when `lo_open`); NaN and infinities never are.
bool InRange(float value, float lo, float hi, bool lo_open) {
  return std::isfinite(value) && (lo_open ? value > lo : value >= lo) && value <= hi;
}

std::string Range(float lo, float hi, bool lo_open) {
  return std::string(lo_open ? "(" : "[") + Num(lo) + ", " + Num(hi) + "]";
}

}  // namespace

bool CheckSampling(const SamplingParams& p, uint32_t vocab_size, SamplingProblem* problem) {
  struct Bounded {
    const char* field;
    float value, lo, hi;
    bool lo_open;
  };
  const Bounded bounded[] = {
      {"temperature", p.temperature, 0.0f, kMaxTemperature, false},
      {"top_p", p.top_p, 0.0f, 1.0f, true},
      {"min_p", p.min_p, 0.0f, 1.0f, false},
      {"presence_penalty", p.presence_penalty, -kMaxPenalty, kMaxPenalty, false},
      {"frequency_penalty", p.frequency_penalty, -kMaxPenalty, kMaxPenalty, false},
      {"repetition_penalty", p.repetition_penalty, 0.0f, kMaxRepetitionPenalty, true},
  };
  for (const Bounded& b : bounded) {
    if (!InRange(b.value, b.lo, b.hi, b.lo_open)) {
      return Fail(problem, b.field, Num(b.value) + " is not in " + Range(b.lo, b.hi, b.lo_open));
    }
  }
  if (p.top_k < 0 || p.top_k > kMaxTopK) {
    return Fail(
        problem, "top_k",
        std::to_string(p.top_k) + " is not in [0, " + std::to_string(kMaxTopK) + "] (0: off)");
  }
  auto is_token = [vocab_size](int32_t id) {
    return id >= 0 && static_cast<uint32_t>(id) < vocab_size;
  };
  const std::string vocab = " of the vocabulary of " + std::to_string(vocab_size);
  for (int32_t id : p.stop_token_ids) {
    if (!is_token(id)) {
      return Fail(problem, "stop_token_ids", std::to_string(id) + " is not a token id" + vocab);
    }
  }
  for (const auto& [id, bias] : p.logit_bias) {
    if (!is_token(id)) {
      return Fail(problem, "logit_bias", std::to_string(id) + " is not a token id" + vocab);
    }
    if (!InRange(bias, -kMaxAbsLogitBias, kMaxAbsLogitBias, false)) {
      return Fail(problem, "logit_bias",
                  "token " + std::to_string(id) + ": " + Num(bias) + " is not in " +
                      Range(-kMaxAbsLogitBias, kMaxAbsLogitBias, false));
    }
  }
  if (p.min_tokens > p.max_tokens) {
    return Fail(
        problem, "min_tokens",
        std::to_string(p.min_tokens) + " is more than max_tokens " + std::to_string(p.max_tokens));
  }
  if (p.logprobs < -1 || p.logprobs > kMaxLogprobs) {
    return Fail(problem, "logprobs",
                std::to_string(p.logprobs) + " is not in [-1, " + std::to_string(kMaxLogprobs) +
                    "] (-1: none)");
  }
  if (!p.stop.empty()) {
    return Fail(problem, "stop",
                std::to_string(p.stop.size()) +
                    " stop strings: they are matched by the client (the router), not the worker");
  }
  return true;
}

Status ValidateSampling(const SamplingParams& params, uint32_t vocab_size) {
  SamplingProblem problem;
  if (CheckSampling(params, vocab_size, &problem)) return Status::Ok();
  return InvalidArgument("sampling." + problem.message);
}

}  // namespace fmoe
