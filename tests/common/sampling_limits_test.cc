// The one definition of a valid SamplingParams (common/wire/sampling_limits.h), which the router
// checks after parsing a request and the worker on every Generate: each range at and past its
// ends, NaN and infinities, token ids against the vocabulary, min_tokens against max_tokens, the
// stop strings a worker never takes, and the field each problem names.
#include "common/wire/sampling_limits.h"

#include <limits>
#include <string>

#include <gtest/gtest.h>

namespace fmoe {
namespace {

SamplingParams Params(float temperature, float top_p = 1.0f, int32_t top_k = 0) {
  SamplingParams p;
  p.temperature = temperature;
  p.top_p = top_p;
  p.top_k = top_k;
  return p;
}

TEST(SamplingLimits, ChecksTheDrawParameters) {
  EXPECT_TRUE(ValidateSampling(Params(0.7f, 0.9f, 40), 100).ok());
  EXPECT_TRUE(ValidateSampling(Params(0.0f, 1e-30f, 0), 100).ok());
  EXPECT_TRUE(ValidateSampling(Params(kMaxTemperature, 1.0f, kMaxTopK), 100).ok());
  struct Case {
    SamplingParams p;
    const char* message;
  } cases[] = {
      {Params(-1.0f), "sampling.temperature: -1 is not in [0, 2]"},
      {Params(2.5f), "sampling.temperature: 2.5 is not in [0, 2]"},
      {Params(std::numeric_limits<float>::infinity()),
       "sampling.temperature: inf is not in [0, 2]"},
      {Params(1.0f, 0.0f), "sampling.top_p: 0 is not in (0, 1]"},
      {Params(1.0f, 1.5f), "sampling.top_p: 1.5 is not in (0, 1]"},
      {Params(1.0f, 1.0f, -3), "sampling.top_k: -3 is not in [0, 1000000] (0: off)"},
      {Params(1.0f, 1.0f, kMaxTopK + 1), "sampling.top_k: 1000001 is not in [0, 1000000] (0: off)"},
  };
  for (const auto& c : cases) {
    Status s = ValidateSampling(c.p, 100);
    EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument);
    EXPECT_EQ(s.message(), c.message);
  }
  SamplingParams p;
  p.max_tokens = 0;  // The prompt is only scored (completions' echo with max_tokens 0).
  EXPECT_TRUE(ValidateSampling(p, 100).ok());
  p.max_tokens = 4;
  p.stop_token_ids = {3, 100};
  EXPECT_EQ(ValidateSampling(p, 100).message(),
            "sampling.stop_token_ids: 100 is not a token id of the vocabulary of 100");
}

TEST(SamplingLimits, ChecksTheLogitsProcessingParameters) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  struct Case {
    void (*set)(SamplingParams&);
    const char* field;
    const char* message;
  } cases[] = {
      {[](SamplingParams& p) {
         p.logit_bias = {{5, 1.0f}, {100, 1.0f}};
       },
       "logit_bias", "logit_bias: 100 is not a token id of the vocabulary of 100"},
      {[](SamplingParams& p) {
         p.logit_bias = {{-1, 1.0f}};
       },
       "logit_bias", "logit_bias: -1 is not a token id of the vocabulary of 100"},
      {[](SamplingParams& p) {
         p.logit_bias = {{7, 100.5f}};
       },
       "logit_bias", "logit_bias: token 7: 100.5 is not in [-100, 100]"},
      {[](SamplingParams& p) { p.min_tokens = 17; }, "min_tokens",
       "min_tokens: 17 is more than max_tokens 16"},
      {[](SamplingParams& p) { p.presence_penalty = 2.5f; }, "presence_penalty",
       "presence_penalty: 2.5 is not in [-2, 2]"},
      {[](SamplingParams& p) { p.frequency_penalty = -3.0f; }, "frequency_penalty",
       "frequency_penalty: -3 is not in [-2, 2]"},
      {[](SamplingParams& p) { p.repetition_penalty = 0.0f; }, "repetition_penalty",
       "repetition_penalty: 0 is not in (0, 10]"},
      {[](SamplingParams& p) { p.repetition_penalty = 10.5f; }, "repetition_penalty",
       "repetition_penalty: 10.5 is not in (0, 10]"},
      {[](SamplingParams& p) { p.repetition_penalty = std::numeric_limits<float>::infinity(); },
       "repetition_penalty", "repetition_penalty: inf is not in (0, 10]"},
      {[](SamplingParams& p) { p.min_p = 1.5f; }, "min_p", "min_p: 1.5 is not in [0, 1]"},
      {[](SamplingParams& p) { p.min_p = -0.1f; }, "min_p", "min_p: -0.1 is not in [0, 1]"},
      {[](SamplingParams& p) { p.logprobs = 21; }, "logprobs",
       "logprobs: 21 is not in [-1, 20] (-1: none)"},
      {[](SamplingParams& p) { p.logprobs = -2; }, "logprobs",
       "logprobs: -2 is not in [-1, 20] (-1: none)"},
      {[](SamplingParams& p) {
         p.stop = {"\n", "###"};
       },
       "stop", "stop: 2 stop strings: they are matched by the client (the router), not the worker"},
  };
  for (const Case& c : cases) {
    SamplingParams p;
    c.set(p);
    SamplingProblem problem;
    EXPECT_FALSE(CheckSampling(p, 100, &problem)) << c.message;
    EXPECT_EQ(problem.field, c.field);
    EXPECT_EQ(problem.message, c.message);
    EXPECT_FALSE(CheckSampling(p, 100, nullptr));
    Status s = ValidateSampling(p, 100);
    EXPECT_EQ(s.code(), ErrorCode::kInvalidArgument) << c.message;
    EXPECT_EQ(s.message(), std::string("sampling.") + c.message);
  }
  SamplingParams p;
  p.presence_penalty = nan;
  EXPECT_EQ(ValidateSampling(p, 100).message(), "sampling.presence_penalty: nan is not in [-2, 2]");
  p = SamplingParams{};
  p.top_p = nan;
  EXPECT_EQ(ValidateSampling(p, 100).message(), "sampling.top_p: nan is not in (0, 1]");
  // Every end of every range is in.
  p = SamplingParams{};
  p.logit_bias = {{0, -100.0f}, {99, 100.0f}};
  p.stop_token_ids = {0, 99};
  p.min_tokens = 16;
  p.presence_penalty = -2.0f;
  p.frequency_penalty = 2.0f;
  p.repetition_penalty = 0.01f;
  p.min_p = 1.0f;
  p.logprobs = 20;
  EXPECT_TRUE(ValidateSampling(p, 100).ok());
  p.logprobs = -1;
  p.repetition_penalty = kMaxRepetitionPenalty;
  p.presence_penalty = 2.0f;
  p.frequency_penalty = -2.0f;
  p.min_p = 0.0f;
  EXPECT_TRUE(ValidateSampling(p, 100).ok());
}

}  // namespace
}  // namespace fmoe
