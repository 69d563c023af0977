// The OpenAI parameters, routes and headers of the router against a launched system (`fmoe
// launch`: map service, one worker with the shipped tiny model, router), over real HTTP: `n`
// (choice i with seed + i), batches of prompts, logprobs (completions and chat), echo (with
// logprobs: the prompt scored), the penalties, logit_bias, min_p, ignore_eos, min_tokens and
// stop_token_ids each changing the output as they should, the chat default of max_tokens,
// guided_choice / guided_regex / guided_grammar decoded under the mask and their bad texts
// refused, unsupported parameters refused by name, /tokenize, /detokenize and /tokenizer_info,
// X-Request-Id, CORS,
// the access log and the Prometheus text read by a real parser.

#include <algorithm>
#include <cmath>
#include <csignal>
#include <cstdlib>
#include <regex>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "common/json.h"
#include "tests/testing/http_call.h"
#include "tests/testing/process_harness.h"

namespace fmoe {
namespace {

using testing::FreeTcpPort;
using testing::WaitUntil;
using Json = nlohmann::json;
using Reply = testing::HttpReply;

constexpr int32_t kEos = 2;  // The tiny model's eos_token_id.

class RouterApiTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    cluster_ = new testing::LaunchedCluster("fmoe-router-api");
    http_ = FreeTcpPort();
    ASSERT_TRUE(cluster_->Start(
        cluster_->TinyManifest(http_, "    max_batch: 4\n    queue_limit: 64\n",
                               "  cors_allowed_origins: [\"https://app.example.com\"]\n"
                               "  responses_dir: responses\n",
                               5000),
        http_, 180000))
        << cluster_->LauncherLog();
  }
  static void TearDownTestSuite() { delete cluster_; }
  void TearDown() override {
    if (HasFailure()) std::cerr << cluster_->LogOf("router");
  }

  static Reply Call(const std::string& method, const std::string& path, const std::string& body,
                    const std::string& headers = "") {
    return testing::HttpCall(http_, method, path, body, "", headers);
  }
  // A completion (or chat) answer that must be 200; its JSON.
  static Json Ok(const std::string& path, const Json& body) {
    Reply r = Call("POST", path, body.dump());
    EXPECT_EQ(r.status, 200) << body.dump() << " -> " << r.body;
    Json j = Json::parse(r.body, nullptr, false);
    EXPECT_FALSE(j.is_discarded()) << r.body;
    return j;
  }
  static Json Completion(const Json& extra) {
    Json body = {
        {"model", "tiny-moe"}, {"prompt", "The city of"}, {"max_tokens", 12}, {"temperature", 0}};
    for (auto it = extra.begin(); it != extra.end(); ++it) body[it.key()] = it.value();
    return Ok("/v1/completions", body);
  }
  static std::string Text(const Json& answer, size_t i = 0) {
    return answer["choices"][i]["text"].get<std::string>();
  }
  static std::vector<std::string> DataEvents(const std::string& sse) {
    return testing::SseEvents(sse);
  }

  static testing::LaunchedCluster* cluster_;
  static int http_;
};

testing::LaunchedCluster* RouterApiTest::cluster_ = nullptr;
int RouterApiTest::http_ = 0;

TEST_F(RouterApiTest, NChoicesDrawWithSeedPlusTheirIndex) {
  Json many = Completion({{"n", 3}, {"seed", 40}, {"temperature", 1.5}});
  ASSERT_EQ(many["choices"].size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(many["choices"][i]["index"], i);
    Json one = Completion({{"seed", 40 + i}, {"temperature", 1.5}});
    EXPECT_EQ(Text(many, i), Text(one)) << "choice " << i << " is the request with seed 40 + " << i;
  }
  EXPECT_NE(Text(many, 0) + Text(many, 1), Text(many, 1) + Text(many, 0)) << "samples differ";
  EXPECT_GE(many["usage"]["completion_tokens"].get<int>(), 3);

  // Streamed: each choice's chunks carry its index and its own finish; one [DONE] at the end.
  Json body = {{"model", "tiny-moe"}, {"prompt", "The city of"},
               {"max_tokens", 6},     {"temperature", 1.5},
               {"seed", 40},          {"n", 2},
               {"stream", true}};
  Reply r = Call("POST", "/v1/completions", body.dump());
  ASSERT_EQ(r.status, 200);
  std::vector<std::string> events = DataEvents(r.body);
  ASSERT_FALSE(events.empty());
  EXPECT_EQ(events.back(), "[DONE]");
  EXPECT_EQ(std::count(events.begin(), events.end(), "[DONE]"), 1);
  std::string text[2];
  int finishes[2] = {0, 0};
  for (size_t e = 0; e + 1 < events.size(); ++e) {
    Json chunk = Json::parse(events[e]);
    const int i = chunk["choices"][0]["index"].get<int>();
    ASSERT_TRUE(i == 0 || i == 1);
    text[i] += chunk["choices"][0]["text"].get<std::string>();
    finishes[i] += !chunk["choices"][0]["finish_reason"].is_null();
  }
  EXPECT_EQ(finishes[0], 1);
  EXPECT_EQ(finishes[1], 1);
  Json whole = Completion({{"max_tokens", 6}, {"temperature", 1.5}, {"seed", 40}, {"n", 2}});
  EXPECT_EQ(text[0], Text(whole, 0));
  EXPECT_EQ(text[1], Text(whole, 1));
}

TEST_F(RouterApiTest, CompletionLogprobsAreTheModelsAndGreedyPicksTheTopOne) {
  Json a = Completion({{"logprobs", 3}, {"max_tokens", 8}});
  const Json& lp = a["choices"][0]["logprobs"];
  ASSERT_TRUE(lp.is_object()) << a.dump();
  const size_t n = lp["tokens"].size();
  EXPECT_EQ(n, a["usage"]["completion_tokens"].get<size_t>());
  ASSERT_EQ(lp["token_logprobs"].size(), n);
  ASSERT_EQ(lp["top_logprobs"].size(), n);
  ASSERT_EQ(lp["text_offset"].size(), n);
  std::string joined;
  for (size_t i = 0; i < n; ++i) {
    joined += lp["tokens"][i].get<std::string>();
    const double chosen = lp["token_logprobs"][i].get<double>();
    EXPECT_LE(chosen, 0.0);
    const Json& top = lp["top_logprobs"][i];
    ASSERT_GE(top.size(), 1u);
    EXPECT_LE(top.size(), 3u);
    double best = -1e9;
    for (auto it = top.begin(); it != top.end(); ++it) best = std::max(best, it->get<double>());
    EXPECT_NEAR(chosen, best, 1e-5) << "greedy draws the likeliest token";
    if (i > 0) {
      EXPECT_GE(lp["text_offset"][i].get<int>(), lp["text_offset"][i - 1].get<int>());
    }
  }
  EXPECT_EQ(joined, Text(a)) << "the tokens spell the text";
  // Without logprobs the field is null and the text the same.
  Json plain = Completion({{"max_tokens", 8}});
  EXPECT_TRUE(plain["choices"][0]["logprobs"].is_null());
  EXPECT_EQ(Text(plain), Text(a));
}

TEST_F(RouterApiTest, ChatLogprobsCarryTokensBytesAndAlternatives) {
  Json body = {
      {"model", "tiny-moe"}, {"messages", {{{"role", "user"}, {"content", "Who made the earth?"}}}},
      {"max_tokens", 6},     {"temperature", 0},
      {"logprobs", true},    {"top_logprobs", 2}};
  Json a = Ok("/v1/chat/completions", body);
  const Json& content = a["choices"][0]["logprobs"]["content"];
  ASSERT_TRUE(content.is_array()) << a.dump();
  EXPECT_EQ(content.size(), a["usage"]["completion_tokens"].get<size_t>());
  for (const Json& t : content) {
    EXPECT_TRUE(t["token"].is_string());
    EXPECT_LE(t["logprob"].get<double>(), 0.0);
    EXPECT_TRUE(t["bytes"].is_array());
    EXPECT_EQ(t["top_logprobs"].size(), 2u);
    EXPECT_NEAR(t["logprob"].get<double>(), t["top_logprobs"][0]["logprob"].get<double>(), 1e-5);
  }
  body["top_logprobs"] = 2;
  body.erase("logprobs");
  EXPECT_EQ(Call("POST", "/v1/chat/completions", body.dump()).status, 400)
      << "top_logprobs without logprobs";
}

TEST_F(RouterApiTest, EchoPutsThePromptFirst) {
  Json a = Completion({{"echo", true}, {"max_tokens", 4}});
  Json b = Completion({{"max_tokens", 4}});
  EXPECT_EQ(Text(a), "The city of" + Text(b));
  Json body = {{"model", "tiny-moe"}, {"prompt", "The city of"},
               {"max_tokens", 4},     {"temperature", 0},
               {"echo", true},        {"stream", true}};
  Reply r = Call("POST", "/v1/completions", body.dump());
  std::vector<std::string> events = DataEvents(r.body);
  ASSERT_GE(events.size(), 2u);
  EXPECT_EQ(Json::parse(events[0])["choices"][0]["text"], "The city of");
}

// echo with logprobs scores a prompt (as lm-eval's loglikelihood does): prompt token k's top
// logprobs, from the prefill's row k - 1, are what the next-token logprobs of the prompt's first
// k tokens alone say, and the prompt's own tokens lead the answer's logprobs.
TEST_F(RouterApiTest, EchoWithLogprobsScoresThePromptAsThePrefixesPredictIt) {
  const std::vector<int> ids =
      Ok("/tokenize", {{"model", "tiny-moe"}, {"prompt", "The city of lights"}})["tokens"];
  ASSERT_GE(ids.size(), 4u);
  Json scored = Completion({{"prompt", ids}, {"echo", true}, {"logprobs", 20}, {"max_tokens", 1}});
  const Json& lp = scored["choices"][0]["logprobs"];
  ASSERT_EQ(lp["tokens"].size(), ids.size() + 1);
  EXPECT_TRUE(lp["token_logprobs"][0].is_null());
  EXPECT_TRUE(lp["top_logprobs"][0].is_null());
  for (size_t k = 1; k < ids.size(); ++k) {
    const std::vector<int> prefix(ids.begin(), ids.begin() + static_cast<ptrdiff_t>(k));
    Json next = Completion({{"prompt", prefix}, {"logprobs", 20}, {"max_tokens", 1}});
    const Json& expected = next["choices"][0]["logprobs"]["top_logprobs"][0];
    const Json& got = lp["top_logprobs"][k];
    // The prompt token's own entry is there too (vLLM's): one more when it is not a top one.
    ASSERT_TRUE(got.contains(lp["tokens"][k].get<std::string>())) << k;
    ASSERT_GE(got.size(), expected.size()) << k;
    ASSERT_LE(got.size(), expected.size() + 1) << k;
    for (auto it = expected.begin(); it != expected.end(); ++it) {
      ASSERT_TRUE(got.contains(it.key())) << k << " " << it.key();
      EXPECT_NEAR(got[it.key()].get<double>(), it.value().get<double>(), 1e-4) << k;
    }
    EXPECT_LE(lp["token_logprobs"][k].get<double>(), 0.0);
    if (got.contains(lp["tokens"][k].get<std::string>())) {
      EXPECT_NEAR(lp["token_logprobs"][k].get<double>(),
                  got[lp["tokens"][k].get<std::string>()].get<double>(), 1e-4);
    }
  }
  // The generated token's entry is the ordinary one.
  Json plain = Completion({{"prompt", ids}, {"logprobs", 20}, {"max_tokens", 1}});
  EXPECT_EQ(lp["tokens"][ids.size()], plain["choices"][0]["logprobs"]["tokens"][0]);
  EXPECT_NEAR(lp["token_logprobs"][ids.size()].get<double>(),
              plain["choices"][0]["logprobs"]["token_logprobs"][0].get<double>(), 1e-5);
}

// lm-eval's loglikelihood when the greedy next token is eos: the echoed prompt's entries and the
// generated eos, 6 for a 5-token prompt (the eos entry was lost before); echo with max_tokens 0
// scores the prompt alone with the same figures; logprobs 0 gives each token's own entry.
TEST_F(RouterApiTest, AStopTokenKeepsItsLogprobAndEchoScoresWithoutGenerating) {
  const std::vector<int> prompt = {1, 735, 266, 2908, 906};
  Json a = Completion({{"prompt", prompt},
                       {"max_tokens", 1},
                       {"echo", true},
                       {"logprobs", 1},
                       {"logit_bias", {{std::to_string(kEos), 100}}}});
  const Json& lp = a["choices"][0]["logprobs"];
  ASSERT_EQ(lp["tokens"].size(), 6u) << a.dump();
  ASSERT_EQ(lp["token_logprobs"].size(), 6u);
  EXPECT_EQ(a["usage"]["completion_tokens"], 1);
  EXPECT_EQ(a["choices"][0]["finish_reason"], "stop");
  // The model's own log-probability of eos (logit_bias is not in the reported figures).
  EXPECT_LE(lp["token_logprobs"][5].get<double>(), 0.0);
  Json scored =
      Completion({{"prompt", prompt}, {"max_tokens", 0}, {"echo", true}, {"logprobs", 1}});
  const Json& s = scored["choices"][0]["logprobs"];
  ASSERT_EQ(s["tokens"].size(), 5u) << scored.dump();
  EXPECT_EQ(scored["usage"]["completion_tokens"], 0);
  EXPECT_EQ(Text(scored), Text(a)) << "the prompt, echoed; the eos adds no text";
  for (size_t k = 1; k < 5; ++k) {
    EXPECT_NEAR(s["token_logprobs"][k].get<double>(), lp["token_logprobs"][k].get<double>(), 1e-5);
  }
  EXPECT_EQ(Call("POST", "/v1/completions",
                 Json({{"model", "tiny-moe"}, {"prompt", "x"}, {"max_tokens", 0}}).dump())
                .status,
            400)
      << "max_tokens 0 without echo";
  Json zero = Completion({{"max_tokens", 3}, {"logprobs", 0}});
  const Json& z = zero["choices"][0]["logprobs"];
  ASSERT_GE(z["tokens"].size(), 1u);
  ASSERT_EQ(z["top_logprobs"].size(), z["tokens"].size());
  for (size_t i = 0; i < z["tokens"].size(); ++i) {
    ASSERT_EQ(z["top_logprobs"][i].size(), 1u) << zero.dump();
    EXPECT_NEAR(z["top_logprobs"][i][z["tokens"][i].get<std::string>()].get<double>(),
                z["token_logprobs"][i].get<double>(), 1e-6);
  }
}

// A batch of prompts answers what each prompt alone answers: greedy, and sampled with n (choice
// c of every prompt draws with seed + c), with echo and the prompt's logprobs per prompt.
TEST_F(RouterApiTest, ABatchOfPromptsAnswersAsEachPromptAlone) {
  const std::vector<std::string> prompts = {"The city of", "In the beginning", "Once upon"};
  Json batch = Completion({{"prompt", prompts}, {"max_tokens", 6}});
  ASSERT_EQ(batch["choices"].size(), 3u);
  int prompt_tokens = 0;
  for (size_t p = 0; p < prompts.size(); ++p) {
    Json one = Completion({{"prompt", prompts[p]}, {"max_tokens", 6}});
    EXPECT_EQ(Text(batch, p), Text(one)) << p;
    prompt_tokens += one["usage"]["prompt_tokens"].get<int>();
  }
  EXPECT_EQ(batch["usage"]["prompt_tokens"], prompt_tokens);

  Json sampled = Completion({{"prompt", prompts},
                             {"n", 2},
                             {"seed", 9},
                             {"temperature", 1.3},
                             {"max_tokens", 6},
                             {"echo", true},
                             {"logprobs", 1}});
  ASSERT_EQ(sampled["choices"].size(), 6u);
  for (size_t i = 0; i < 6; ++i) {
    const size_t p = i / 2, c = i % 2;
    EXPECT_EQ(sampled["choices"][i]["index"], i);
    Json one = Completion({{"prompt", prompts[p]},
                           {"seed", 9 + c},
                           {"temperature", 1.3},
                           {"max_tokens", 6},
                           {"echo", true},
                           {"logprobs", 1}});
    EXPECT_EQ(Text(sampled, i), Text(one)) << i;
    EXPECT_EQ(sampled["choices"][i]["logprobs"]["tokens"], one["choices"][0]["logprobs"]["tokens"])
        << i;
  }
}

TEST_F(RouterApiTest, LogitBiasMinPAndPenaltiesChangeTheOutputAsTheyShould) {
  const Json greedy = Completion({{"max_tokens", 24}});
  // A bias of +100 makes one token win every step.
  const Json biased = Completion({{"max_tokens", 6}, {"logit_bias", {{"300", 100}}}});
  EXPECT_EQ(biased["usage"]["completion_tokens"], 6);
  EXPECT_EQ(Text(biased),
            Ok("/detokenize", {{"tokens", std::vector<int>(6, 300)}})["prompt"].get<std::string>());
  // min_p = 1 keeps only the likeliest token: sampling at any temperature is greedy.
  const Json min_p =
      Completion({{"max_tokens", 24}, {"temperature", 1.8}, {"seed", 3}, {"min_p", 1.0}});
  EXPECT_EQ(Text(min_p), Text(greedy));
  const Json hot = Completion({{"max_tokens", 24}, {"temperature", 1.8}, {"seed", 3}});
  EXPECT_NE(Text(hot), Text(greedy)) << "without min_p the same seed samples otherwise";
  // Penalties change greedy output that repeats itself.
  const Json tokens =
      Completion({{"max_tokens", 24}, {"logprobs", 0}})["choices"][0]["logprobs"]["tokens"];
  std::set<std::string> distinct;
  for (const Json& t : tokens) distinct.insert(t.get<std::string>());
  ASSERT_LT(distinct.size(), tokens.size()) << "greedy output repeats tokens: " << Text(greedy);
  for (const char* penalty : {"frequency_penalty", "presence_penalty"}) {
    const Json p = Completion({{"max_tokens", 24}, {penalty, 2.0}});
    EXPECT_NE(Text(p), Text(greedy)) << penalty;
  }
  const Json rep = Completion({{"max_tokens", 24}, {"repetition_penalty", 3.0}});
  EXPECT_NE(Text(rep), Text(greedy)) << "repetition_penalty";
  // Neutral values leave the output as it was.
  const Json neutral = Completion({{"max_tokens", 24},
                                   {"frequency_penalty", 0},
                                   {"presence_penalty", 0},
                                   {"repetition_penalty", 1},
                                   {"min_p", 0},
                                   {"logit_bias", Json::object()}});
  EXPECT_EQ(Text(neutral), Text(greedy));
}

// The stop token that ends a completion (eos, stop_token_ids) counts in the usage and the
// logprobs as vLLM counts it, but its text is not in the answer.
TEST_F(RouterApiTest, EosStopTokensMinTokensAndIgnoreEos) {
  const Json eos_first = {{"max_tokens", 10}, {"logit_bias", {{std::to_string(kEos), 100}}}};
  Json a = Completion(eos_first);
  EXPECT_EQ(a["usage"]["completion_tokens"], 1);
  EXPECT_EQ(Text(a), "");
  EXPECT_EQ(a["choices"][0]["finish_reason"], "stop");
  Json extra = eos_first;
  extra["ignore_eos"] = true;
  a = Completion(extra);
  EXPECT_EQ(a["usage"]["completion_tokens"], 10) << "eos does not end it";
  EXPECT_EQ(a["choices"][0]["finish_reason"], "length");
  extra = eos_first;
  extra["min_tokens"] = 4;
  a = Completion(extra);
  EXPECT_EQ(a["usage"]["completion_tokens"], 5) << "eos is masked for the first 4 tokens";
  EXPECT_EQ(a["choices"][0]["finish_reason"], "stop");
  // stop_token_ids: a token forced by logit_bias ends the completion at once.
  a = Completion({{"max_tokens", 10}, {"logit_bias", {{"300", 100}}}, {"stop_token_ids", {300}}});
  EXPECT_EQ(a["usage"]["completion_tokens"], 1);
  EXPECT_EQ(Text(a), "");
  EXPECT_EQ(a["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(
      Call("POST", "/v1/completions",
           Json({{"model", "tiny-moe"}, {"prompt", "x"}, {"max_tokens", 2}, {"min_tokens", 3}})
               .dump())
          .status,
      400)
      << "min_tokens above max_tokens";
}

TEST_F(RouterApiTest, ChatWithoutMaxTokensMayUseTheRestOfTheContext) {
  // A conversation that leaves about 40 tokens of the 1024-token context (measured with
  // /tokenize), so the whole rest is generated quickly even on a busy machine.
  auto rendered = [&](int words) {
    std::string text;
    for (int i = 0; i < words; ++i) text += "a ";
    Json messages = {{{"role", "user"}, {"content", text}}};
    return std::make_pair(messages, Ok("/tokenize", {{"messages", messages}})["count"].get<int>());
  };
  int words = 900;
  auto [messages, count] = rendered(words);
  for (int i = 0; i < 4 && (count > 1000 || count < 960); ++i) {
    words += 984 - count;
    std::tie(messages, count) = rendered(words);
  }
  ASSERT_LT(count, 1024);
  Json body = {
      {"model", "tiny-moe"}, {"messages", messages}, {"temperature", 0}, {"ignore_eos", true}};
  Json a = Ok("/v1/chat/completions", body);
  EXPECT_EQ(a["choices"][0]["finish_reason"], "length");
  EXPECT_EQ(a["usage"]["prompt_tokens"], count);
  EXPECT_EQ(a["usage"]["completion_tokens"], 1024 - count) << "the rest of the context";
  // Completions keep OpenAI's 16.
  Json text = {{"model", "tiny-moe"}, {"prompt", "The city of"}, {"ignore_eos", true}};
  EXPECT_EQ(Ok("/v1/completions", text)["usage"]["completion_tokens"], 16);
}

// Prefix caching: the second request with the same prompt finds its full 16-token KV blocks
// cached (usage.prompt_tokens_details.cached_tokens, as OpenAI reports it) and gives the same
// text; the leader's heartbeats carry the hits and the pool into /metrics.
TEST_F(RouterApiTest, PrefixCachingSharesAPromptsBlocks) {
  std::string prompt = "A prefix shared by two requests:";
  for (int i = 0; i < 12; ++i) prompt += " the river ran north past stone " + std::to_string(i);
  Json a = Completion({{"prompt", prompt}});
  const int n = a["usage"]["prompt_tokens"].get<int>();
  ASSERT_GT(n, 33);
  EXPECT_EQ(a["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
  Json b = Completion({{"prompt", prompt}});
  EXPECT_EQ(b["usage"]["prompt_tokens_details"]["cached_tokens"], (n - 1) / 16 * 16);
  EXPECT_EQ(Text(b), Text(a));
  // Chat reports it the same way.
  Json chat = {{"model", "tiny-moe"},
               {"messages", {{{"role", "user"}, {"content", prompt}}}},
               {"max_tokens", 4},
               {"temperature", 0}};
  Ok("/v1/chat/completions", chat);
  Json again = Ok("/v1/chat/completions", chat);
  EXPECT_GE(again["usage"]["prompt_tokens_details"]["cached_tokens"].get<int>(), 16);
  auto metric = [&](const std::string& name) -> double {
    Reply r = Call("GET", "/metrics", "");
    const std::string key = name + "{group=\"g0\"} ";
    const size_t at = r.body.find(key);
    if (at == std::string::npos) return -1;
    return std::stod(r.body.substr(at + key.size()));
  };
  EXPECT_TRUE(
      WaitUntil([&] { return metric("fmoe_prefix_cache_hits_total") >= (n - 1) / 16 * 16; }, 60000))
      << Call("GET", "/metrics", "").body;
  EXPECT_GT(metric("fmoe_prefix_cache_queries_total"), metric("fmoe_prefix_cache_hits_total"));
  EXPECT_EQ(metric("fmoe_kv_blocks"), 4096 / 16);  // max_batch 4 x the 1024-token context.
  // The engine's prompt chunks: each of the four prompts ran in one chunk at least (a heartbeat
  // after the last may still be on its way); none grown past a budget (none is set), and a
  // prompt token's compute measured.
  EXPECT_TRUE(WaitUntil([&] { return metric("fmoe_prompt_chunks_total") >= 4; }, 60000))
      << Call("GET", "/metrics", "").body;
  EXPECT_EQ(metric("fmoe_prompt_chunks_grown_total"), 0);
  EXPECT_GT(metric("fmoe_prompt_token_seconds"), 0);
  Json health = Json::parse(Call("GET", "/health", "").body, nullptr, false);
  ASSERT_TRUE(health.is_object());
  EXPECT_GE(health["groups"][0]["prompt_chunks"]["run"].get<int>(), 4);
  EXPECT_EQ(health["groups"][0]["prompt_chunks"]["grown"], 0);
  EXPECT_EQ(health["groups"][0]["kv_cache"]["blocks"], 256);
  EXPECT_GT(health["groups"][0]["kv_cache"]["prefix_cache_hit_rate"].get<double>(), 0.0);
  Reply r = Call("GET", "/metrics", "");
  EXPECT_NE(r.body.find("vllm:kv_cache_usage_perc{model_name=\"tiny-moe\"} "), std::string::npos);
  EXPECT_NE(r.body.find("vllm:prefix_cache_hits_total{model_name=\"tiny-moe\"} "),
            std::string::npos);
}

TEST_F(RouterApiTest, UnsupportedParametersAreRefusedByName) {
  const std::vector<std::pair<std::string, Json>> cases = {
      {"best_of", 2},
      {"suffix", "x"},
      {"prompt_logprobs", 1},
      {"include_stop_str_in_output", true},
      {"structured_outputs", {{"structural_tag", {{"format", {{"type", "any_text"}}}}}}},
      {"guided_json", {{"type", "string"}, {"pattern", "a+"}}}};
  for (const auto& [key, value] : cases) {
    Json body = {{"model", "tiny-moe"}, {"prompt", "x"}, {key, value}};
    Reply r = Call("POST", "/v1/completions", body.dump());
    EXPECT_EQ(r.status, 400) << key;
    EXPECT_EQ(Json::parse(r.body)["error"]["param"], key) << r.body;
  }
  for (const auto& [key, value] :
       std::vector<std::pair<std::string, Json>>{{"tools", Json::array({{{"type", "function"}}})},
                                                 {"response_format", {{"type", "json_schema"}}}}) {
    Json body = {
        {"model", "tiny-moe"}, {"messages", {{{"role", "user"}, {"content", "x"}}}}, {key, value}};
    Reply r = Call("POST", "/v1/chat/completions", body.dump());
    EXPECT_EQ(r.status, 400) << key;
    EXPECT_EQ(Json::parse(r.body)["error"]["param"], key) << r.body;
  }
  Json body = {{"model", "tiny-moe"}, {"prompt", "x"}, {"n", 17}};
  EXPECT_EQ(Json::parse(Call("POST", "/v1/completions", body.dump()).body)["error"]["param"], "n");
  body = {{"model", "tiny-moe"},
          {"prompt", "x"},
          {"stream", true},
          {"stream_options", {{"include_usage", true}, {"continuous_usage_stats", true}}}};
  Reply r = Call("POST", "/v1/completions", body.dump());
  EXPECT_EQ(r.status, 400);
  EXPECT_NE(r.body.find("continuous_usage_stats"), std::string::npos) << r.body;
  // Their neutral values are accepted.
  body = {{"model", "tiny-moe"},
          {"prompt", "x"},
          {"max_tokens", 1},
          {"include_stop_str_in_output", false},
          {"structured_outputs", Json::object()}};
  EXPECT_EQ(Call("POST", "/v1/completions", body.dump()).status, 200);
}

// guided_choice, guided_regex and guided_grammar (and structured_outputs' choice / regex /
// grammar), decoded by the tiny model under the token mask: every answer matches, whole and
// streamed, in chat and completions, and ends with "stop" once nothing more may follow.
TEST_F(RouterApiTest, GuidedChoiceRegexAndGrammarConstrainTheOutput) {
  const std::vector<std::string> choices = {"Paris", "London", "New York"};
  for (const Json& extra :
       {Json{{"guided_choice", choices}}, Json{{"structured_outputs", {{"choice", choices}}}}}) {
    for (double temperature : {0.0, 1.0}) {
      Json patch = extra;
      patch["temperature"] = temperature;
      patch["max_tokens"] = 16;
      Json a = Completion(patch);
      SCOPED_TRACE(a.dump());
      EXPECT_NE(std::find(choices.begin(), choices.end(), Text(a)), choices.end());
      EXPECT_EQ(a["choices"][0]["finish_reason"], "stop");
    }
  }
  const std::string regex = R"(\d{3}-[a-z]{2,4}(, \d)?)";
  const std::regex re(regex);
  for (uint64_t seed = 0; seed < 4; ++seed) {
    Json a = Completion(
        {{"guided_regex", regex}, {"temperature", 1.0}, {"seed", seed}, {"max_tokens", 20}});
    EXPECT_TRUE(std::regex_match(Text(a), re)) << a.dump();
    EXPECT_EQ(a["choices"][0]["finish_reason"], "stop") << a.dump();
  }
  const std::string grammar = R"(root ::= "[" item ("," item){0,2} "]"
item ::= "\"" [a-z]{1,5} "\"" | [0-9]{1,3}
)";
  const std::regex grammar_re(R"(\[("[a-z]{1,5}"|[0-9]{1,3})(,("[a-z]{1,5}"|[0-9]{1,3})){0,2}\])");
  for (uint64_t seed = 0; seed < 4; ++seed) {
    Json chat = Ok("/v1/chat/completions",
                   {{"model", "tiny-moe"},
                    {"messages", {{{"role", "user"}, {"content", "A list, please."}}}},
                    {"structured_outputs", {{"grammar", grammar}}},
                    {"temperature", 1.0},
                    {"seed", seed},
                    {"max_tokens", 40}});
    const std::string content = chat["choices"][0]["message"]["content"].get<std::string>();
    EXPECT_TRUE(std::regex_match(content, grammar_re)) << chat.dump();
    EXPECT_EQ(chat["choices"][0]["finish_reason"], "stop") << chat.dump();
  }
  // Streamed: the deltas add up to a match.
  Json body = {{"model", "tiny-moe"},
               {"prompt", "The city of"},
               {"max_tokens", 20},
               {"temperature", 1.0},
               {"seed", 5},
               {"stream", true},
               {"guided_grammar", grammar}};
  Reply r = Call("POST", "/v1/completions", body.dump());
  ASSERT_EQ(r.status, 200) << r.body;
  std::string text, finish;
  for (const std::string& e : DataEvents(r.body)) {
    if (e == "[DONE]") continue;
    Json j = Json::parse(e);
    text += j["choices"][0]["text"].get<std::string>();
    if (!j["choices"][0]["finish_reason"].is_null()) finish = j["choices"][0]["finish_reason"];
  }
  EXPECT_TRUE(std::regex_match(text, grammar_re)) << r.body;
  EXPECT_EQ(finish, "stop");
}

// What the grammar, regex and choice compilers refuse: a 400 naming the parameter and the
// problem, never a hang or a 500.
TEST_F(RouterApiTest, BadGrammarsRegexesAndChoicesAre400s) {
  struct Case {
    Json patch;
    std::string param, says;
  };
  const std::vector<Case> cases = {
      {{{"guided_grammar", R"(root ::= root "a" | "b")"}}, "guided_grammar", "left-recursive"},
      {{{"guided_grammar", R"(item ::= "a")"}}, "guided_grammar", "no rule named root"},
      {{{"guided_grammar", R"(root ::= "a" undefined)"}},
       "guided_grammar",
       "line 1 col 14: no rule named undefined"},
      {{{"guided_grammar", R"(root ::= "a"{100000})"}}, "guided_grammar", "above 1000"},
      {{{"guided_regex", "a(?=b)"}}, "guided_regex", "lookaround is not supported"},
      {{{"guided_regex", R"((a)\1)"}}, "guided_regex", "backreferences are not supported"},
      {{{"guided_regex", 7}}, "guided_regex", "must be a string"},
      {{{"structured_outputs", {{"regex", "[a-"}}}}, "structured_outputs", "unterminated"},
      {{{"guided_choice", Json::array()}}, "guided_choice", "no strings"},
      {{{"guided_choice", {"a", 1}}}, "guided_choice", "array of strings"},
      {{{"guided_regex", "a+"}, {"guided_json", {{"type", "object"}}}},
       "guided_regex",
       "only one of"},
      {{{"guided_regex", "a+"}, {"response_format", {{"type", "json_object"}}}},
       "guided_regex",
       "only one of"},
  };
  for (const Case& c : cases) {
    Json b = {{"model", "tiny-moe"}, {"prompt", "x"}};
    for (auto it = c.patch.begin(); it != c.patch.end(); ++it) b[it.key()] = it.value();
    SCOPED_TRACE(b.dump());
    Reply r = Call("POST", "/v1/completions", b.dump());
    EXPECT_EQ(r.status, 400) << r.body;
    Json e = Json::parse(r.body, nullptr, false);
    ASSERT_FALSE(e.is_discarded()) << r.body;
    EXPECT_EQ(e["error"]["param"], c.param) << r.body;
    EXPECT_NE(e["error"]["message"].get<std::string>().find(c.says), std::string::npos) << r.body;
  }
}

TEST_F(RouterApiTest, TokenizeAndDetokenize) {
  Json t = Ok("/tokenize", {{"model", "tiny-moe"}, {"prompt", "In the beginning"}});
  ASSERT_GT(t["count"].get<int>(), 1);
  EXPECT_EQ(t["count"], t["tokens"].size());
  EXPECT_EQ(t["max_model_len"], 1024);
  EXPECT_EQ(t["tokens"][0], 1) << "BOS with add_special_tokens (the default)";
  Json d = Ok("/detokenize", {{"tokens", t["tokens"]}});
  EXPECT_NE(d["prompt"].get<std::string>().find("In the beginning"), std::string::npos);
  Json chat = Ok("/tokenize", {{"messages", {{{"role", "user"}, {"content", "Hi"}}}},
                               {"return_token_strs", true}});
  EXPECT_EQ(chat["token_strs"].size(), chat["tokens"].size());
  // Bytes that are not UTF-8 come back as U+FFFD.
  Json bytes = Ok("/tokenize", {{"prompt", "\xC3\xA9"}, {"add_special_tokens", false}});
  ASSERT_GE(bytes["tokens"].size(), 1u);
  if (bytes["tokens"].size() == 2) {
    Json half = Ok("/detokenize", {{"tokens", {bytes["tokens"][0]}}});
    EXPECT_EQ(half["prompt"], "\xEF\xBF\xBD");
  }
  EXPECT_EQ(Call("POST", "/detokenize", R"({"tokens": [99999]})").status, 400);
  EXPECT_EQ(Call("POST", "/tokenize", R"({"model": "other", "prompt": "x"})").status, 404);
  EXPECT_EQ(Call("GET", "/tokenize", "").status, 405);
  // vLLM's /tokenizer_info, as lm-evaluation-harness's remote tokenizer reads it.
  Reply info = Call("GET", "/tokenizer_info", "");
  ASSERT_EQ(info.status, 200) << info.body;
  const Json i = Json::parse(info.body);
  EXPECT_EQ(i["bos_token"], "<s>");
  EXPECT_EQ(i["eos_token"], "</s>");
  EXPECT_EQ(i["pad_token"], "<pad>");
  EXPECT_EQ(i["model_max_length"], 1024);
  EXPECT_EQ(i["vocab_size"], 4096);
  EXPECT_NE(i["chat_template"].get<std::string>().find("add_generation_prompt"), std::string::npos);
  EXPECT_EQ(Ok("/tokenize", {{"prompt", "</s>"}, {"add_special_tokens", false}})["tokens"],
            Json({2}));  // The eos text names the eos token.
  EXPECT_EQ(Call("POST", "/tokenizer_info", "{}").status, 405);
}

// openai's models.retrieve, vLLM's /version and /ping.
TEST_F(RouterApiTest, ModelRetrieveVersionAndPing) {
  Reply r = Call("GET", "/v1/models/tiny-moe", "");
  ASSERT_EQ(r.status, 200) << r.body;
  Json m = Json::parse(r.body);
  EXPECT_EQ(m["id"], "tiny-moe");
  EXPECT_EQ(m["object"], "model");
  EXPECT_EQ(m, Json::parse(Call("GET", "/v1/models", "").body)["data"][0]);
  r = Call("GET", "/v1/models/gpt-4o", "");
  EXPECT_EQ(r.status, 404);
  EXPECT_EQ(Json::parse(r.body)["error"]["code"], "model_not_found") << r.body;
  EXPECT_EQ(Call("POST", "/v1/models/tiny-moe", "{}").status, 405);
  r = Call("GET", "/version", "");
  ASSERT_EQ(r.status, 200);
  EXPECT_TRUE(Json::parse(r.body)["version"].is_string()) << r.body;
  EXPECT_EQ(Call("GET", "/ping", "").status, 200);
  EXPECT_EQ(Call("POST", "/ping", "").status, 200);
}

TEST_F(RouterApiTest, RequestIdsCorsAndTheAccessLog) {
  Reply r = Call("GET", "/v1/models", "", "X-Request-Id: my-trace-42\r\n");
  EXPECT_NE(r.head.find("X-Request-Id: my-trace-42"), std::string::npos) << r.head;
  r = Call("GET", "/v1/models", "");
  EXPECT_NE(r.head.find("X-Request-Id: "), std::string::npos) << "generated when absent";
  r = Call("GET", "/v1/models", "", "X-Request-Id: has space\r\n");
  EXPECT_EQ(r.head.find("X-Request-Id: has space"), std::string::npos) << "replaced when unusable";
  // CORS: an allowed origin gets its header; another gets none; a preflight gets 204.
  r = Call("GET", "/v1/models", "", "Origin: https://app.example.com\r\n");
  EXPECT_NE(r.head.find("Access-Control-Allow-Origin: https://app.example.com"), std::string::npos)
      << r.head;
  r = Call("GET", "/v1/models", "", "Origin: https://evil.example.com\r\n");
  EXPECT_EQ(r.head.find("Access-Control-Allow-Origin"), std::string::npos) << r.head;
  r = Call("OPTIONS", "/v1/completions", "",
           "Origin: https://app.example.com\r\nAccess-Control-Request-Method: POST\r\n");
  EXPECT_EQ(r.status, 204) << r.head;
  EXPECT_NE(r.head.find("Access-Control-Allow-Methods"), std::string::npos) << r.head;
  // Every request leaves an access log line with its id, status and tokens.
  Json body = {
      {"model", "tiny-moe"}, {"prompt", "The city of"}, {"max_tokens", 3}, {"temperature", 0}};
  r = Call("POST", "/v1/completions", body.dump(), "X-Request-Id: access-log-check\r\n");
  ASSERT_EQ(r.status, 200);
  const int prompt = Json::parse(r.body)["usage"]["prompt_tokens"].get<int>();
  const std::string line = "POST /v1/completions 200 tokens=" + std::to_string(prompt) + "/3 ";
  ASSERT_TRUE(WaitUntil(
      [&] {
        const std::string log = testing::ReadFile(cluster_->dir() + "/run/logs/router.log");
        const size_t at = log.find("id=access-log-check");
        return at != std::string::npos && log.rfind(line, at) != std::string::npos;
      },
      10000))
      << testing::ReadFile(cluster_->dir() + "/run/logs/router.log");
}

TEST_F(RouterApiTest, MetricsFollowPrometheusConventions) {
  Completion({{"max_tokens", 3}});
  Reply r = Call("GET", "/metrics", "");
  ASSERT_EQ(r.status, 200);
  const std::string path = cluster_->dir() + "/metrics.txt";
  testing::WriteFile(path, r.body);
  // A real parser (prometheus_client, Debian's python3-prometheus-client) and the lint rules
  // of promtool check metrics.
  const std::string cmd = "/usr/bin/python3 " + std::string(FMOE_SOURCE_DIR) +
                          "/tests/integration/metrics_check.py " + path + " > " + cluster_->dir() +
                          "/metrics_check.log 2>&1";
  const int rc = std::system(cmd.c_str());
  EXPECT_EQ(rc, 0) << testing::ReadFile(cluster_->dir() + "/metrics_check.log") << "\n" << r.body;
  for (const char* name :
       {"fmoe_e2e_request_latency_seconds_bucket", "fmoe_request_queue_time_seconds_count",
        "fmoe_request_prompt_tokens_sum", "fmoe_prompt_tokens_total",
        "fmoe_expert_moved_bytes_total", "fmoe_expert_host_runs_total",
        "fmoe_expert_host_seconds_total", "fmoe_expert_not_moved_bytes_total",
        // The Responses API's store (this suite's router keeps it on disk).
        "\nfmoe_responses_stored ", "\nfmoe_responses_persistent 1\n",
        "\nfmoe_responses_store_errors_total 0\n"}) {
    EXPECT_NE(r.body.find(name), std::string::npos) << name;
  }
  // vLLM's names, with its model_name label, for the dashboards built for it.
  for (const char* name :
       {"vllm:num_requests_running{model_name=\"tiny-moe\"} ",
        "vllm:num_requests_waiting{model_name=\"tiny-moe\"} ",
        "vllm:generation_tokens_total{model_name=\"tiny-moe\"} ",
        "vllm:time_to_first_token_seconds_bucket{model_name=\"tiny-moe\",le=\"+Inf\"} ",
        "vllm:e2e_request_latency_seconds_count{model_name=\"tiny-moe\"} "}) {
    EXPECT_NE(r.body.find(name), std::string::npos) << name;
  }
  for (const char* gone : {"fmoe_expert_hit_rate", "fmoe_tokens_per_second"}) {
    EXPECT_EQ(r.body.find(gone), std::string::npos) << gone << " is derived: a query divides";
  }
}

// The last test of the suite (it kills the router): with router.responses_dir, a stored response
// continues by previous_response_id after the router is killed with SIGKILL and the launcher
// restarts it; the continued request carries the earlier turn (more input tokens than the same
// input alone).
TEST_F(RouterApiTest, StoredResponsesContinueAfterTheRouterIsKilled) {
  const Json first = Ok("/v1/responses", {{"model", "tiny-moe"},
                                          {"input", "Tell me about the city."},
                                          {"max_output_tokens", 8},
                                          {"temperature", 0}});
  const std::string id = first.value("id", "");
  ASSERT_FALSE(id.empty()) << first.dump();
  const Json alone = Ok(
      "/v1/responses",
      {{"model", "tiny-moe"}, {"input", "And then?"}, {"max_output_tokens", 4}, {"store", false}});
  const int alone_tokens = alone["usage"]["input_tokens"].get<int>();
  // The router's pid and restarts in the launcher's status file.
  const auto router = [&]() -> std::pair<int, int> {
    const Json state =
        Json::parse(testing::ReadFile(cluster_->dir() + "/run/launcher.json"), nullptr, false);
    if (state.is_discarded() || !state.contains("processes")) return {-1, -1};
    for (const auto& p : state["processes"]) {
      if (p.value("name", "") == "router" && p.value("state", "") == "running") {
        return {p.value("pid", -1), p.value("restarts", 0)};
      }
    }
    return {-1, -1};
  };
  const auto [pid, restarts] = router();
  ASSERT_GT(pid, 0) << testing::ReadFile(cluster_->dir() + "/run/launcher.json");
  ASSERT_EQ(kill(pid, SIGKILL), 0);
  ASSERT_TRUE(WaitUntil(
      [&] {
        const auto [now, count] = router();
        return now > 0 && now != pid && count > restarts &&
               Call("GET", "/health", "").status == 200;
      },
      60000))
      << testing::ReadFile(cluster_->dir() + "/run/launcher.json");
  // Ready for requests again (the groups have reconnected).
  ASSERT_TRUE(WaitUntil(
      [&] {
        return Call("POST", "/v1/completions",
                    Json{{"model", "tiny-moe"}, {"prompt", "x"}, {"max_tokens", 1}}.dump())
                   .status == 200;
      },
      60000));
  const Json next = Ok("/v1/responses", {{"model", "tiny-moe"},
                                         {"input", "And then?"},
                                         {"previous_response_id", id},
                                         {"max_output_tokens", 4}});
  EXPECT_EQ(next.value("previous_response_id", ""), id) << next.dump();
  EXPECT_GT(next["usage"]["input_tokens"].get<int>(), alone_tokens) << next.dump();
  EXPECT_NE(cluster_->LogOf("router").find("stored responses loaded"), std::string::npos);
  EXPECT_EQ(
      Call(
          "POST", "/v1/responses",
          Json{{"model", "tiny-moe"}, {"input", "x"}, {"previous_response_id", "resp_nope"}}.dump())
          .status,
      404);
}

}  // namespace
}  // namespace fmoe
