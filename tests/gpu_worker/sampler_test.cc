#include "gpu_worker/sampling/sampler.h"

#include <cmath>
#include <limits>
#include <map>
#include <set>
#include <vector>

#include <gtest/gtest.h>

#include "common/text/json_schema.h"
#include "common/text/token_mask.h"
#include "gpu_worker/sampling/structured_output.h"

namespace fmoe {
namespace {

SamplingParams Params(float temperature, float top_p = 1.0f, int32_t top_k = 0, uint64_t seed = 7) {
  SamplingParams p;
  p.temperature = temperature;
  p.top_p = top_p;
  p.top_k = top_k;
  p.seed = seed;
  return p;
}

TEST(Sampler, GreedyTakesHighestLowestIdOnTies) {
  Sampler s(Params(0.0f));
  EXPECT_EQ(s.Sample(std::vector<float>{0.1f, 2.0f, -1.0f, 2.0f}), 1);
  EXPECT_EQ(s.Sample(std::vector<float>{3.0f}), 0);
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(s.Sample(std::vector<float>{nan, -5.0f, nan}), 1);
}

TEST(Sampler, TopKOneIsGreedy) {
  Sampler s(Params(1.5f, 1.0f, 1));
  for (int i = 0; i < 20; ++i) EXPECT_EQ(s.Sample(std::vector<float>{0.0f, 0.5f, 0.4f}), 1);
}

TEST(Sampler, SameSeedSameTokensDifferentSeedDiffers) {
  std::vector<float> logits(50);
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = static_cast<float>(std::sin(i * 1.7));
  auto run = [&](uint64_t seed) {
    Sampler s(Params(1.0f, 1.0f, 0, seed));
    std::vector<int32_t> out;
    for (int i = 0; i < 64; ++i) out.push_back(s.Sample(logits));
    return out;
  };
  EXPECT_EQ(run(1), run(1));
  EXPECT_NE(run(1), run(2));
}

TEST(Sampler, FrequenciesFollowTheSoftmax) {
  // logits log(1), log(2), log(3), log(4): probabilities 0.1 .. 0.4.
  std::vector<float> logits = {0.0f, std::log(2.0f), std::log(3.0f), std::log(4.0f)};
  Sampler s(Params(1.0f));
  std::map<int32_t, int> counts;
  const int n = 40000;
  for (int i = 0; i < n; ++i) ++counts[s.Sample(logits)];
  for (int t = 0; t < 4; ++t) EXPECT_NEAR(counts[t] / double(n), 0.1 * (t + 1), 0.01) << t;
}

TEST(Sampler, TemperatureSharpens) {
  std::vector<float> logits = {0.0f, 1.0f};
  Sampler cold(Params(0.1f)), hot(Params(10.0f));
  int cold_ones = 0, hot_ones = 0;
  for (int i = 0; i < 2000; ++i) {
    cold_ones += cold.Sample(logits);
    hot_ones += hot.Sample(logits);
  }
  EXPECT_GT(cold_ones, 1990);
  EXPECT_LT(hot_ones, 1200);
}

TEST(Sampler, TopKKeepsOnlyTheKHighest) {
  std::vector<float> logits = {5.0f, 4.9f, 4.8f, 0.0f, 4.95f};
  Sampler s(Params(5.0f, 1.0f, 2));
  for (int i = 0; i < 500; ++i) {
    int32_t t = s.Sample(logits);
    EXPECT_TRUE(t == 0 || t == 4) << t;
  }
}

TEST(Sampler, TopPKeepsTheSmallestNucleus) {
  // Probabilities 0.5, 0.3, 0.15, 0.05: top_p 0.75 keeps {0, 1}; 0.8 keeps {0, 1} too (0.8 is
  // reached exactly); 0.81 adds token 2.
  std::vector<float> logits = {std::log(0.5f), std::log(0.3f), std::log(0.15f), std::log(0.05f)};
  for (auto [top_p, allowed] : std::vector<std::pair<float, int>>{{0.75f, 2}, {0.81f, 3}}) {
    Sampler s(Params(1.0f, top_p));
    std::map<int32_t, int> counts;
    for (int i = 0; i < 3000; ++i) ++counts[s.Sample(logits)];
    EXPECT_EQ(static_cast<int>(counts.size()), allowed) << top_p;
    EXPECT_EQ(counts.count(3), 0u);
  }
  Sampler tiny(Params(1.0f, 0.01f));
  for (int i = 0; i < 100; ++i) EXPECT_EQ(tiny.Sample(logits), 0);
}

// ---- vLLM's logits processing ----

std::vector<float> SineLogits() {
  std::vector<float> logits(64);
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = static_cast<float>(std::sin(i * 1.7) * 3);
  return logits;
}

// Tokens of the sampler as it was before the logits processing came (same seed, same logits):
// neutral parameters must not change the draws or the generator's consumption.
TEST(Sampler, NeutralParametersKeepTheTokensOfBefore) {
  const std::vector<float> logits = SineLogits();
  struct Case {
    float temperature, top_p;
    int32_t top_k;
    std::vector<int32_t> tokens;
  } cases[] = {
      {0.8f, 1.0f, 0, {49, 38, 49, 1, 56, 1, 34, 23, 16, 23, 12, 34, 42, 38, 52, 60}},
      {1.0f, 0.9f, 0, {56, 16, 56, 49, 30, 49, 45, 38, 1, 38, 12, 27, 8, 16, 19, 41}},
      {0.7f, 0.95f, 20, {8, 27, 8, 49, 5, 49, 27, 23, 1, 23, 12, 34, 45, 27, 53, 19}},
      {1.3f, 1.0f, 5, {1, 1, 1, 12, 23, 12, 60, 49, 49, 49, 12, 60, 1, 1, 23, 23}},
  };
  const std::vector<int32_t> prompt = {1, 12, 23, 49};
  const std::vector<int32_t> eos = {49};
  for (const Case& c : cases) {
    SamplingParams p = Params(c.temperature, c.top_p, c.top_k, 42);
    for (int32_t logprobs : {-1, 0, 5}) {  // Logprobs are reported, never change the draw.
      p.logprobs = logprobs;
      Sampler s(p, prompt, eos);
      std::vector<int32_t> out;
      for (int i = 0; i < 16; ++i) out.push_back(s.Sample(logits));
      EXPECT_EQ(out, c.tokens) << c.temperature << " " << c.top_p << " " << c.top_k << " "
                               << logprobs;
    }
  }
}

TEST(Sampler, LogitBiasIsAddedBeforeGreedyAndSampling) {
  SamplingParams p = Params(0.0f);
  p.logit_bias = {{0, 5.0f}};
  Sampler greedy(p);
  EXPECT_EQ(greedy.Sample(std::vector<float>{1.0f, 2.0f, 3.0f}), 0);  // 6 beats 3.
  Sampler plain(Params(0.0f));
  EXPECT_EQ(plain.Sample(std::vector<float>{1.0f, 2.0f, 3.0f}), 2);

  // -100 bans a token, +100 forces one, under sampling too.
  p = Params(1.0f);
  p.logit_bias = {{1, -100.0f}};
  Sampler banned(p);
  p.logit_bias = {{3, 100.0f}};
  Sampler forced(p);
  const std::vector<float> logits = {0.0f, 2.0f, 0.5f, -1.0f};
  for (int i = 0; i < 1000; ++i) {
    EXPECT_NE(banned.Sample(logits), 1);
    EXPECT_EQ(forced.Sample(logits), 3);
  }
}

TEST(Sampler, MinTokensMasksEosAndStopIdsUntilReached) {
  // Token 2 (eos) then token 1 (a stop id) are the likeliest; both banned for 3 tokens.
  const std::vector<float> logits = {0.0f, 4.0f, 5.0f, 1.0f};
  const std::vector<int32_t> eos = {2};
  for (bool ignore_eos : {false, true}) {  // ignore_eos does not lift the mask (as in vLLM).
    SamplingParams p = Params(0.0f);
    p.min_tokens = 3;
    p.stop_token_ids = {1};
    p.ignore_eos = ignore_eos;
    Sampler s(p, {}, eos);
    EXPECT_EQ(s.Sample(logits), 3);
    EXPECT_EQ(s.Sample(logits), 3);
    EXPECT_EQ(s.Sample(logits), 3);
    EXPECT_EQ(s.generated(), 3u);
    EXPECT_EQ(s.Sample(logits), 2);
  }
  // Sampled: never an eos or stop id while below min_tokens.
  SamplingParams p = Params(1.0f);
  p.min_tokens = 50;
  p.stop_token_ids = {1};
  Sampler s(p, {}, eos);
  for (int i = 0; i < 50; ++i) {
    const int32_t t = s.Sample(logits);
    EXPECT_TRUE(t == 0 || t == 3) << t;
  }
  std::set<int32_t> after;
  for (int i = 0; i < 200; ++i) after.insert(s.Sample(logits));
  EXPECT_TRUE(after.count(2) && after.count(1));
}

TEST(Sampler, RepetitionPenaltyCoversThePromptAndTheOutput) {
  // Positive logits are divided: token 0 (in the prompt) drops from 2.0 to 1.0, under token 1.
  SamplingParams p = Params(0.0f);
  p.repetition_penalty = 2.0f;
  const std::vector<int32_t> prompt = {0, 0, 3};
  Sampler s(p, prompt);
  const std::vector<float> logits = {2.0f, 1.9f, -3.0f, -1.0f};
  EXPECT_EQ(s.Sample(logits), 1);
  // Now token 1 is in the output: 0.95 < 1.0.
  EXPECT_EQ(s.Sample(logits), 0);
  // Negative logits are multiplied: token 3 (-1.0, in the prompt) becomes -2.0, under token 2's
  // -1.5 (not seen).
  Sampler neg(p, prompt);
  EXPECT_EQ(neg.Sample(std::vector<float>{-9.0f, -9.0f, -1.5f, -1.0f}), 2);
  p.repetition_penalty = 1.0f;
  Sampler off(p, prompt);
  EXPECT_EQ(off.Sample(logits), 0);
}

TEST(Sampler, FrequencyAndPresencePenaltiesCountTheOutputOnly) {
  const std::vector<float> logits = {1.0f, 0.9f, 0.0f};
  const std::vector<int32_t> prompt = {0, 0, 0};  // Not counted by these two.
  SamplingParams p = Params(0.0f);
  p.frequency_penalty = 0.5f;
  Sampler freq(p, prompt);
  std::vector<int32_t> out;
  for (int i = 0; i < 4; ++i) out.push_back(freq.Sample(logits));
  // 1.0 | 0.5 < 0.9 | 0.5 > 0.4 | 0.0 < 0.4.
  EXPECT_EQ(out, (std::vector<int32_t>{0, 1, 0, 1}));

  p = Params(0.0f);
  p.presence_penalty = 0.5f;
  Sampler presence(p, prompt);
  out.clear();
  for (int i = 0; i < 4; ++i) out.push_back(presence.Sample(logits));
  // Once per token, whatever the count: 1.0 | 0.5 < 0.9 | 0.5 > 0.4 | 0.5 > 0.4.
  EXPECT_EQ(out, (std::vector<int32_t>{0, 1, 0, 0}));

  // Negative values reward repeats: with two equal tokens, the first one drawn takes over.
  p = Params(1.0f);
  p.frequency_penalty = -2.0f;
  Sampler reward(p);
  Sampler neutral(Params(1.0f));
  std::set<int32_t> rewarded, plain;
  for (int i = 0; i < 200; ++i) {
    const int32_t t = reward.Sample(std::vector<float>{0.0f, 0.0f});
    if (i >= 100) rewarded.insert(t);
    plain.insert(neutral.Sample(std::vector<float>{0.0f, 0.0f}));
  }
  EXPECT_EQ(rewarded.size(), 1u);
  EXPECT_EQ(plain.size(), 2u);
}

TEST(Sampler, MinPDropsTokensAfterTemperature) {
  // Probabilities 0.5, 0.3, 0.15, 0.05 at temperature 1.
  const std::vector<float> logits = {std::log(0.5f), std::log(0.3f), std::log(0.15f),
                                     std::log(0.05f)};
  auto drawn = [&](float temperature, float min_p) {
    SamplingParams p = Params(temperature);
    p.min_p = min_p;
    Sampler s(p);
    std::set<int32_t> seen;
    for (int i = 0; i < 3000; ++i) seen.insert(s.Sample(logits));
    return seen;
  };
  EXPECT_EQ(drawn(1.0f, 0.35f), (std::set<int32_t>{0, 1}));    // p >= 0.175.
  EXPECT_EQ(drawn(1.0f, 0.2f), (std::set<int32_t>{0, 1, 2}));  // p >= 0.1.
  EXPECT_EQ(drawn(1.0f, 0.0f), (std::set<int32_t>{0, 1, 2, 3}));
  // At temperature 2 token 3 is sqrt(0.1) = 0.32 of the likeliest: kept with min_p 0.2.
  EXPECT_EQ(drawn(2.0f, 0.2f), (std::set<int32_t>{0, 1, 2, 3}));
  EXPECT_EQ(drawn(1.0f, 1.0f), (std::set<int32_t>{0}));
}

TEST(Sampler, OrderOfOperations) {
  // logit_bias before repetition_penalty: token 0's 1.0 - 2 = -1.0, times 2 = -2.0, under token
  // 1's -1.7 (penalty first would give 0.5 - 2 = -1.5, over it).
  SamplingParams p = Params(0.0f);
  p.logit_bias = {{0, -2.0f}};
  p.repetition_penalty = 2.0f;
  Sampler bias_first(p, std::vector<int32_t>{0});
  EXPECT_EQ(bias_first.Sample(std::vector<float>{1.0f, -1.7f}), 1);

  // min_p before top_p, which sees the renormalised survivors: min_p 0.5 keeps {0.5, 0.3} ->
  // {0.625, 0.375}; top_p 0.6 then keeps token 0 alone. (top_p first would keep {0, 1}.)
  const std::vector<float> logits = {std::log(0.5f), std::log(0.3f), std::log(0.15f),
                                     std::log(0.05f)};
  p = Params(1.0f, 0.6f);
  p.min_p = 0.5f;
  Sampler nucleus(p);
  for (int i = 0; i < 500; ++i) EXPECT_EQ(nucleus.Sample(logits), 0);

  // min_p and top_k combine: min_p 0.2 keeps 3 tokens, top_k 2 the best two of them.
  p = Params(1.0f, 1.0f, 2);
  p.min_p = 0.2f;
  Sampler k(p);
  std::set<int32_t> seen;
  for (int i = 0; i < 2000; ++i) seen.insert(k.Sample(logits));
  EXPECT_EQ(seen, (std::set<int32_t>{0, 1}));

  // Penalties apply to the biased, unmasked logits, and greedy takes their argmax: token 2 gets
  // +3 then the presence penalty of its earlier draw.
  p = Params(0.0f);
  p.logit_bias = {{2, 3.0f}};
  p.presence_penalty = 2.0f;
  Sampler g(p);
  const std::vector<float> flat = {1.0f, 1.5f, 0.0f};
  EXPECT_EQ(g.Sample(flat), 2);  // 3.0 > 1.5.
  EXPECT_EQ(g.Sample(flat), 1);  // 1.0 < 1.5.
}

TEST(Sampler, LogprobsComeFromTheRawLogits) {
  const std::vector<float> logits = {std::log(0.3f), std::log(0.5f), std::log(0.05f),
                                     std::log(0.15f)};
  SamplingParams p = Params(0.0f);
  p.logprobs = 3;
  p.logit_bias = {{2, 100.0f}};  // Forces token 2; its reported logprob stays the raw one.
  Sampler s(p);
  EXPECT_EQ(s.Sample(logits), 2);
  EXPECT_NEAR(s.logprobs().token, std::log(0.05), 1e-5);
  ASSERT_EQ(s.logprobs().top.size(), 3u);
  const int32_t ids[] = {1, 0, 3};
  const double probs[] = {0.5, 0.3, 0.15};
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(s.logprobs().top[i].first, ids[i]);
    EXPECT_NEAR(s.logprobs().top[i].second, std::log(probs[i]), 1e-5);
  }

  // Greedy: the top-1 is the drawn token. Ties: the lower id first. 0 = the token's only.
  p = Params(0.0f);
  p.logprobs = 2;
  Sampler ties(p);
  EXPECT_EQ(ties.Sample(std::vector<float>{0.0f, 1.0f, 1.0f, 1.0f}), 1);
  ASSERT_EQ(ties.logprobs().top.size(), 2u);
  EXPECT_EQ(ties.logprobs().top[0].first, 1);
  EXPECT_EQ(ties.logprobs().top[1].first, 2);
  EXPECT_EQ(ties.logprobs().top[0].second, ties.logprobs().token);
  p.logprobs = 0;
  Sampler none(p);
  none.Sample(logits);
  EXPECT_TRUE(none.logprobs().top.empty());
  EXPECT_NEAR(none.logprobs().token, std::log(0.5), 1e-5);

  // More asked than the vocabulary has; -inf and NaN logits report kMinLogprob.
  const float inf = std::numeric_limits<float>::infinity();
  p.logprobs = 20;
  Sampler small(p);
  EXPECT_EQ(small.Sample(std::vector<float>{-inf, 0.0f, std::nanf("")}), 1);
  ASSERT_EQ(small.logprobs().top.size(), 3u);
  EXPECT_EQ(small.logprobs().top[0], (std::pair<int32_t, float>{1, 0.0f}));
  EXPECT_EQ(small.logprobs().top[1], (std::pair<int32_t, float>{0, kMinLogprob}));
  EXPECT_EQ(small.logprobs().top[2], (std::pair<int32_t, float>{2, kMinLogprob}));
}

// Structured output: a vocabulary of JSON pieces; token 7 is eos.
std::unique_ptr<TokenMasker> Constraint(const char* schema) {
  std::vector<std::string> bytes = {"{", "}", "\"a\"", ":", "1", "x", "{}", "<eos>", "\"b\""};
  std::vector<bool> special(bytes.size(), false);
  special[7] = true;
  auto grammar = CompileJsonSchema(schema);
  EXPECT_TRUE(grammar.ok());
  return std::make_unique<TokenMasker>(*grammar, std::make_shared<const TokenVocab>(bytes, special),
                                       std::vector<int32_t>{7});
}

TEST(Sampler, ConstraintMasksAfterProcessingGreedyAndSampled) {
  for (float temperature : {0.0f, 1.0f}) {
    SamplingParams p = Params(temperature);
    p.logprobs = 1;
    p.logit_bias = {{5, 50.0f}};  // "x" would win every step without the constraint.
    Sampler s(p);
    s.Constrain(Constraint(R"({"type":"object","properties":{"a":{"type":"integer"}},
                               "required":["a"]})"));
    const std::vector<float> logits = {0.0f, 0.5f, 0.1f, 0.2f, 0.3f, 9.0f, 1.0f, 2.0f, 0.0f};
    std::string text;
    std::vector<int32_t> drawn;
    for (int step = 0; step < 6; ++step) {
      const int32_t t = s.Sample(logits);
      ASSERT_GE(t, 0);
      drawn.push_back(t);
      // Logprobs stay the raw model's (vLLM's default), whatever the mask.
      EXPECT_NEAR(s.logprobs().token, logits[t] - std::log([&] {
                                        double sum = 0;
                                        for (float l : logits) sum += std::exp(l);
                                        return sum;
                                      }()),
                  1e-4);
      EXPECT_EQ(s.logprobs().top[0].first, 5);
      if (t == 7) break;
    }
    EXPECT_EQ(drawn, (std::vector<int32_t>{0, 2, 3, 4, 1, 7})) << temperature;
  }
}

// A reasoning model thinks freely and answers in the format: the constraint starts only once
// the token `after` (its end of thinking, here "x") has been drawn, and that token is free too.
TEST(Sampler, ConstraintAfterATokenLeavesWhatComesBeforeFree) {
  SamplingParams p = Params(0.0f);
  Sampler s(p);
  s.Constrain(Constraint(R"({"type":"object","properties":{"a":{"type":"integer"}},
                             "required":["a"]})"),
              /*after=*/{5});
  // "\"b\"" (8) wins while free: no JSON object starts with it.
  std::vector<float> logits = {0.0f, 0.5f, 0.1f, 0.2f, 0.3f, 1.0f, 1.0f, 2.0f, 9.0f};
  EXPECT_EQ(s.Sample(logits), 8);
  EXPECT_EQ(s.Sample(logits), 8);
  EXPECT_EQ(s.constraint(), nullptr);
  logits[5] = 20.0f;  // The end of thinking.
  EXPECT_EQ(s.Sample(logits), 5);
  ASSERT_NE(s.constraint(), nullptr);
  logits[5] = 1.0f;
  logits[8] = 0.0f;
  std::vector<int32_t> drawn;
  for (int step = 0; step < 6; ++step) {
    const int32_t t = s.Sample(logits);
    ASSERT_GE(t, 0);
    drawn.push_back(t);
    if (t == 7) break;
  }
  EXPECT_EQ(drawn, (std::vector<int32_t>{0, 2, 3, 4, 1, 7}));
}

// gpt-oss's final channel header is several tokens: the constraint starts only once they were
// drawn one after another ("x", ":", "x" here); a partial header, or its tokens apart, leave the
// output free.
TEST(Sampler, ConstraintAfterASequenceStartsOnlyAfterTheWholeSequence) {
  Sampler s(Params(0.0f));
  s.Constrain(Constraint(R"({"type":"object","properties":{"a":{"type":"integer"}},
                             "required":["a"]})"),
              /*after=*/{5, 3, 5});
  std::vector<float> logits(9, 0.0f);
  auto draw = [&](int32_t wanted) {
    std::fill(logits.begin(), logits.end(), 0.0f);
    logits[static_cast<size_t>(wanted)] = 10.0f;
    return s.Sample(logits);
  };
  // x : : x : 1 x : -- apart or cut short, never armed; 8 ("\"b\"") is free.
  for (int32_t t : {5, 3, 3, 5, 3, 4, 5, 3, 8}) {
    EXPECT_EQ(draw(t), t);
    EXPECT_EQ(s.constraint(), nullptr) << "after " << t;
  }
  EXPECT_EQ(draw(5), 5);
  EXPECT_EQ(draw(3), 3);
  EXPECT_EQ(draw(5), 5);  // x : x: armed.
  ASSERT_NE(s.constraint(), nullptr);
  EXPECT_EQ(draw(8), 0) << "\"b\" cannot start the object: the constraint takes \"{\"";
}

TEST(Sampler, ConstraintWithNothingAllowedReturnsMinusOne) {
  Sampler s(Params(0.0f));
  s.Constrain(Constraint(R"({"type":"array"})"));  // No token starts an array.
  EXPECT_EQ(s.Sample(std::vector<float>(9, 0.0f)), -1);
  EXPECT_FALSE(s.constraint()->complete());
  // Complete, and no end token to draw (the engine then stops the request).
  Sampler done(Params(0.0f));
  done.Constrain(std::make_unique<TokenMasker>(
      AnyJsonObjectGrammar(),
      std::make_shared<const TokenVocab>(std::vector<std::string>{"{}", "x"},
                                         std::vector<bool>{false, false}),
      std::vector<int32_t>{}));
  EXPECT_EQ(done.Sample(std::vector<float>{0.0f, 5.0f}), 0);
  EXPECT_EQ(done.Sample(std::vector<float>{0.0f, 5.0f}), -1);
  EXPECT_TRUE(done.constraint()->complete());
}

TEST(Sampler, ConstraintCompleteLiftsMinTokensForEos) {
  SamplingParams p = Params(0.0f);
  p.min_tokens = 5;
  p.max_tokens = 10;
  const int32_t eos[] = {7};
  Sampler s(p, {}, eos);
  s.Constrain(Constraint(R"({"type":"object","properties":{"a":{}}})"));
  EXPECT_EQ(s.Sample(std::vector<float>(9, 0.0f)), 0);  // "{" before "{}" on ties.
  EXPECT_EQ(s.Sample(std::vector<float>{0, 1, 0, 0, 0, 0, 0, 0, 0}), 1);
  EXPECT_EQ(s.Sample(std::vector<float>(9, 0.0f)), 7);
}

TEST(Sampler, ConstrainSamplerRefusesBadSchemasByPath) {
  SamplingParams p;
  p.json_schema = R"({"type":"object","properties":{"a":{"type":"string","pattern":"x"}}})";
  Sampler s(p);
  Status st = ConstrainSampler(s, p, nullptr, {});
  EXPECT_NE(st.message().find("tokenizer"), std::string::npos) << st.message();
  p.json_schema.clear();
  EXPECT_TRUE(ConstrainSampler(s, p, nullptr, {}).ok());
  EXPECT_EQ(s.constraint(), nullptr);
}

}  // namespace
}  // namespace fmoe
