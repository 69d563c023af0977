// The OpenAI-compatible completions route against a launched system (`fmoe launch`: map
// service, one worker with the shipped tiny model, router), over real HTTP: whole and streamed
// completions, seeds and greedy decoding reproducible, token-id prompts, stop strings, usage
// with the expert figures, bad requests answered with their exact status and error, a client
// that disconnects cancels its request, and a full queue answers 429 while admitted requests
// complete.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <memory>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "common/http_client.h"
#include "common/json.h"
#include "tests/testing/http_call.h"
#include "tests/testing/process_harness.h"

namespace fmoe {
namespace {

using testing::BinDir;
using testing::Child;
using testing::FreeTcpPort;
using testing::WaitUntil;
using Json = nlohmann::json;
using namespace std::chrono_literals;

using Reply = testing::HttpReply;

constexpr const char* kKey = "test-key-0123456789";

Reply Call(int port, const std::string& method, const std::string& path,
           const std::string& body = "", const std::string& auth = std::string("Bearer ") + kKey) {
  return testing::HttpCall(port, method, path, body, auth);
}

Reply Post(int port, const Json& body) {
  return Call(port, "POST", "/v1/completions", body.dump());
}

std::vector<std::string> Events(const std::string& sse) { return testing::SseEvents(sse); }

class RouterTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    cluster_ = new testing::LaunchedCluster("fmoe-router");
    http_ = FreeTcpPort();
    ASSERT_TRUE(cluster_->Start(
        cluster_->TinyManifest(http_, "    max_batch: 1\n    queue_limit: 2\n",
                               std::string("  max_body_bytes: 65536\n  api_keys: [") + kKey + "]\n",
                               2000),
        http_, 90000))
        << cluster_->LauncherLog();
  }
  static void TearDownTestSuite() { delete cluster_; }
  void TearDown() override {
    if (HasFailure()) std::cerr << cluster_->LogOf("router");
  }

  static Json Completion(const Json& extra) {
    Json body = {{"model", "tiny-moe"},
                 {"prompt", "The LORD is my shepherd"},
                 {"max_tokens", 8},
                 {"temperature", 0}};
    for (auto it = extra.begin(); it != extra.end(); ++it) body[it.key()] = it.value();
    return body;
  }

  static int RunningAtRouter() {
    auto res = http::Get("127.0.0.1", http_, "/health", 1000);
    if (!res.ok()) return -1;
    Json j = Json::parse(res->body, nullptr, false);
    return j.is_discarded() ? -1 : j["groups"][0].value("running", -1);
  }

  static int QueuedAtRouter() {
    auto res = http::Get("127.0.0.1", http_, "/health", 1000);
    if (!res.ok()) return -1;
    Json j = Json::parse(res->body, nullptr, false);
    return j.is_discarded() ? -1 : j["groups"][0].value("queued", -1);
  }

  static testing::LaunchedCluster* cluster_;
  static int http_;
};

testing::LaunchedCluster* RouterTest::cluster_ = nullptr;
int RouterTest::http_ = 0;

TEST_F(RouterTest, CompletionWithUsageAndExpertFigures) {
  Reply r = Post(http_, Completion({}));
  ASSERT_EQ(r.status, 200) << r.body;
  Json j = Json::parse(r.body);
  EXPECT_EQ(j["object"], "text_completion");
  EXPECT_EQ(j["model"], "tiny-moe");
  EXPECT_EQ(j["id"].get<std::string>().rfind("cmpl-", 0), 0u);
  ASSERT_EQ(j["choices"].size(), 1u);
  EXPECT_FALSE(j["choices"][0]["text"].get<std::string>().empty());
  const std::string finish = j["choices"][0]["finish_reason"];
  EXPECT_TRUE(finish == "length" || finish == "stop") << finish;
  const Json& u = j["usage"];
  EXPECT_GT(u["prompt_tokens"].get<int>(), 3);
  EXPECT_LE(u["completion_tokens"].get<int>(), 8);
  EXPECT_EQ(u["total_tokens"], u["prompt_tokens"].get<int>() + u["completion_tokens"].get<int>());
  EXPECT_GT(u["fmoe_experts"]["hits"].get<int>() + u["fmoe_experts"]["misses"].get<int>(), 0);

  // A request the model ends (eos) at its first token reports the experts its prefill used; the
  // eos counts in the usage (as vLLM counts it) but is not text.
  Reply e = Post(http_, Completion({{"prompt", "Are these deductive arguments?"}}));
  ASSERT_EQ(e.status, 200) << e.body;
  const Json ej = Json::parse(e.body);
  ASSERT_EQ(ej["usage"]["completion_tokens"], 1) << e.body;
  EXPECT_EQ(ej["choices"][0]["text"], "");
  EXPECT_EQ(ej["choices"][0]["finish_reason"], "stop");
  EXPECT_GT(ej["usage"]["fmoe_experts"]["hits"].get<int>() +
                ej["usage"]["fmoe_experts"]["misses"].get<int>(),
            0)
      << e.body;

  Reply models = Call(http_, "GET", "/v1/models");
  ASSERT_EQ(models.status, 200);
  EXPECT_EQ(Json::parse(models.body)["data"][0]["id"], "tiny-moe");
}

TEST_F(RouterTest, GreedyAndSeededSamplingAreReproducible) {
  Reply a = Post(http_, Completion({}));
  Reply b = Post(http_, Completion({}));
  ASSERT_EQ(a.status, 200);
  EXPECT_EQ(Json::parse(a.body)["choices"][0]["text"], Json::parse(b.body)["choices"][0]["text"]);
  Json seeded = Completion({{"temperature", 0.9}, {"seed", 1234}, {"max_tokens", 12}});
  Reply c = Post(http_, seeded);
  Reply d = Post(http_, seeded);
  ASSERT_EQ(c.status, 200) << c.body;
  EXPECT_EQ(Json::parse(c.body)["choices"][0]["text"], Json::parse(d.body)["choices"][0]["text"]);
}

// A request's choices are admitted together: n = 6 against this group's queue of 2 (max_batch
// 1) is one request, taken whole while the queue has room for one, never refused halfway
// through because its own first choices filled the queue.
TEST_F(RouterTest, ChoicesOfOneRequestAreAdmittedTogether) {
  for (int round = 0; round < 3; ++round) {
    Reply r = Post(http_, Completion({{"n", 6}, {"temperature", 1.0}, {"seed", round}}));
    ASSERT_EQ(r.status, 200) << r.body;
    const Json j = Json::parse(r.body);
    ASSERT_EQ(j["choices"].size(), 6u) << r.body;
    for (size_t i = 0; i < 6; ++i) EXPECT_EQ(j["choices"][i]["index"], i);
  }
}

TEST_F(RouterTest, StreamEqualsTheWholeAnswer) {
  Reply whole = Post(http_, Completion({{"max_tokens", 12}}));
  ASSERT_EQ(whole.status, 200);
  Reply s = Post(http_, Completion({{"max_tokens", 12},
                                    {"stream", true},
                                    {"stream_options", {{"include_usage", true}}}}));
  ASSERT_EQ(s.status, 200) << s.body;
  EXPECT_NE(s.head.find("text/event-stream"), std::string::npos) << s.head;
  auto events = Events(s.body);
  ASSERT_GE(events.size(), 3u) << s.body;
  EXPECT_EQ(events.back(), "[DONE]");
  std::string text;
  std::string finish;
  bool usage = false;
  for (size_t i = 0; i + 1 < events.size(); ++i) {
    Json e = Json::parse(events[i]);
    EXPECT_EQ(e["object"], "text_completion");
    if (e.contains("usage")) {
      usage = true;
      EXPECT_EQ(e["usage"]["completion_tokens"],
                Json::parse(whole.body)["usage"]["completion_tokens"]);
      continue;
    }
    text += e["choices"][0]["text"].get<std::string>();
    if (!e["choices"][0]["finish_reason"].is_null()) finish = e["choices"][0]["finish_reason"];
  }
  EXPECT_TRUE(usage);
  // std::string against Json made explicit: g++ 13's C++20 operator== finds it ambiguous.
  EXPECT_EQ(text, Json::parse(whole.body)["choices"][0]["text"].get<std::string>());
  EXPECT_EQ(finish, Json::parse(whole.body)["choices"][0]["finish_reason"].get<std::string>());
}

TEST_F(RouterTest, TokenIdPromptsAndStopStrings) {
  Reply ids = Post(http_, Completion({{"prompt", {1, 200, 300, 400}}}));
  ASSERT_EQ(ids.status, 200) << ids.body;
  EXPECT_EQ(Json::parse(ids.body)["usage"]["prompt_tokens"], 4);
  // The same ids as the one prompt of a batch (what lm-eval sends): the same answer.
  Reply one_of_batch =
      Post(http_, Completion({{"prompt", Json::array({Json::array({1, 200, 300, 400})})}}));
  ASSERT_EQ(one_of_batch.status, 200) << one_of_batch.body;
  EXPECT_EQ(Json::parse(one_of_batch.body)["choices"][0]["text"],
            Json::parse(ids.body)["choices"][0]["text"]);

  Reply whole = Post(http_, Completion({{"max_tokens", 16}}));
  const std::string text = Json::parse(whole.body)["choices"][0]["text"];
  ASSERT_GE(text.size(), 6u) << text;
  // Stop at a piece from the middle of the greedy text: the answer ends right before it.
  const std::string stop = text.substr(text.size() / 2, 3);
  Reply stopped = Post(http_, Completion({{"max_tokens", 16}, {"stop", {stop}}}));
  ASSERT_EQ(stopped.status, 200) << stopped.body;
  Json j = Json::parse(stopped.body);
  EXPECT_EQ(j["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(j["choices"][0]["text"].get<std::string>(), text.substr(0, text.find(stop)));
}

// The router owns stop strings: a choice whose text meets one ends there and its worker request
// is cancelled, so a 1000-token request that meets its stop early answers at once, counts only
// the tokens through the stop, and frees the group's one slot right away (1000 tokens take
// seconds).
// The group's expert uses (hits + misses, cumulative), as its heartbeats report them, once two
// heartbeats in a row have reported the same figure: the worker computes nothing more.
int64_t SettledExpertUses(int port) {
  int64_t value = -1, previous = -1, last_silence = -1;
  const bool settled = WaitUntil(
      [&] {
        const Json health = Json::parse(Call(port, "GET", "/health").body, nullptr, false);
        if (health.is_discarded() || !health["groups"][0]["last_heartbeat_ms"].is_number()) {
          return false;
        }
        const int64_t silence = health["groups"][0]["last_heartbeat_ms"].get<int64_t>();
        const bool new_heartbeat = last_silence >= 0 && silence < last_silence;
        last_silence = silence;
        if (!new_heartbeat) return false;
        const std::string m = Call(port, "GET", "/metrics").body;
        int64_t uses = 0;
        for (const std::string series :
             {"fmoe_expert_hits_total{group=\"g0\"} ", "fmoe_expert_misses_total{group=\"g0\"} "}) {
          const size_t at = m.find("\n" + series);
          if (at == std::string::npos) return false;
          uses += static_cast<int64_t>(std::stod(m.substr(at + 1 + series.size())));
        }
        const bool same = uses == previous;
        previous = uses;
        value = uses;
        return same;
      },
      60000, 10);
  return settled ? value : -1;
}

TEST_F(RouterTest, AStopStringCancelsTheWorkerRequest) {
  Reply whole = Post(http_, Completion({{"max_tokens", 16}, {"ignore_eos", true}}));
  ASSERT_EQ(whole.status, 200) << whole.body;
  const std::string text = Json::parse(whole.body)["choices"][0]["text"];
  ASSERT_GE(text.size(), 6u) << text;
  const std::string stop = text.substr(3, 3);
  for (bool stream : {false, true}) {
    SCOPED_TRACE(stream ? "stream" : "whole");
    Json body = Completion({{"max_tokens", 1000}, {"ignore_eos", true}, {"stop", {stop}}});
    if (stream) {
      body["stream"] = true;
      body["stream_options"] = {{"include_usage", true}};
    }
    ASSERT_TRUE(WaitUntil([&] { return RunningAtRouter() == 0; }, 30000, 5));
    const int64_t before = SettledExpertUses(http_);
    ASSERT_GE(before, 0);
    Reply stopped = Post(http_, body);
    ASSERT_EQ(stopped.status, 200) << stopped.body;
    Json usage;
    std::string got, finish;
    if (stream) {
      for (const std::string& e : Events(stopped.body)) {
        if (e == "[DONE]") continue;
        const Json chunk = Json::parse(e);
        if (chunk["usage"].is_object()) usage = chunk["usage"];
        if (chunk["choices"].empty()) continue;
        got += chunk["choices"][0]["text"].get<std::string>();
        if (chunk["choices"][0]["finish_reason"].is_string()) {
          finish = chunk["choices"][0]["finish_reason"];
        }
      }
    } else {
      const Json j = Json::parse(stopped.body);
      got = j["choices"][0]["text"];
      finish = j["choices"][0]["finish_reason"];
      usage = j["usage"];
    }
    EXPECT_EQ(finish, "stop");
    EXPECT_EQ(got, text.substr(0, text.find(stop)));
    // At most the 16 tokens whose text holds the stop, counted through the one completing it.
    EXPECT_GE(usage["completion_tokens"].get<int>(), 1) << usage;
    EXPECT_LE(usage["completion_tokens"].get<int>(), 16) << usage;
    // The worker confirmed the cancel (the slot is free) and made far fewer than the 1000
    // tokens: the tiny model's decode step uses at most 16 experts (8 layers, top-2), so a run
    // to the end would add some 16,000 expert uses, not a few hundred.
    EXPECT_TRUE(WaitUntil([&] { return RunningAtRouter() == 0; }, 30000, 5));
    const int64_t after = SettledExpertUses(http_);
    ASSERT_GE(after, before);
    EXPECT_LT(after - before, 2000) << "the worker went on generating after the stop";
  }
}

TEST_F(RouterTest, BadRequestsGetTheirStatusAndError) {
  struct Case {
    std::string method, path, body;
    int status;
    std::string code;   // error.code ("" = null)
    std::string param;  // error.param ("" = null)
  };
  const Json ok = Completion({});
  auto with = [&](const Json& extra) { return Completion(extra).dump(); };
  Json no_model = ok;
  no_model.erase("model");
  Json no_prompt = ok;
  no_prompt.erase("prompt");
  const std::vector<Case> cases = {
      {"POST", "/v1/completions", "{not json", 400, "invalid_json", ""},
      {"POST", "/v1/completions", "[1,2]", 400, "invalid_json", ""},
      {"POST", "/v1/completions", "", 400, "invalid_json", ""},
      {"POST", "/v1/completions", no_model.dump(), 400, "missing_required", "model"},
      {"POST", "/v1/completions", with({{"model", 7}}), 400, "invalid_value", "model"},
      {"POST", "/v1/completions", with({{"model", "gpt-9"}}), 404, "model_not_found", "model"},
      {"POST", "/v1/completions", no_prompt.dump(), 400, "missing_required", "prompt"},
      {"POST", "/v1/completions", with({{"prompt", 5}}), 400, "invalid_value", "prompt"},
      {"POST", "/v1/completions", with({{"prompt", {"a", 1}}}), 400, "invalid_value", "prompt"},
      {"POST", "/v1/completions", with({{"prompt", Json::array({Json::array()})}}), 400,
       "invalid_value", "prompt"},
      {"POST", "/v1/completions", with({{"prompt", {1, 999999}}}), 400, "invalid_value", "prompt"},
      {"POST", "/v1/completions", with({{"prompt", Json::array()}}), 400, "invalid_value",
       "prompt"},
      {"POST", "/v1/completions", with({{"max_tokens", 0}}), 400, "invalid_value", "max_tokens"},
      {"POST", "/v1/completions", with({{"max_tokens", "8"}}), 400, "invalid_value", "max_tokens"},
      {"POST", "/v1/completions", with({{"max_tokens", 100000}}), 400, "context_length_exceeded",
       "max_tokens"},
      {"POST", "/v1/completions", with({{"temperature", 3}}), 400, "invalid_value", "temperature"},
      {"POST", "/v1/completions", with({{"temperature", "hot"}}), 400, "invalid_value",
       "temperature"},
      {"POST", "/v1/completions", with({{"top_p", 0}}), 400, "invalid_value", "top_p"},
      {"POST", "/v1/completions", with({{"top_k", -5}}), 400, "invalid_value", "top_k"},
      {"POST", "/v1/completions", with({{"seed", 1.5}}), 400, "invalid_value", "seed"},
      {"POST", "/v1/completions", with({{"stop", 3}}), 400, "invalid_value", "stop"},
      {"POST", "/v1/completions", with({{"stop", {""}}}), 400, "invalid_value", "stop"},
      {"POST", "/v1/completions", with({{"stream", "yes"}}), 400, "invalid_value", "stream"},
      {"POST", "/v1/completions", with({{"stream_options", {{"include_usage", true}}}}), 400,
       "invalid_value", "stream_options"},
      {"POST", "/v1/completions", with({{"n", 17}}), 400, "invalid_value", "n"},
      {"POST", "/v1/completions", with({{"n", 0}}), 400, "invalid_value", "n"},
      {"POST", "/v1/completions", with({{"best_of", 3}}), 400, "unsupported_parameter", "best_of"},
      {"POST", "/v1/completions", with({{"logprobs", 21}}), 400, "invalid_value", "logprobs"},
      {"POST", "/v1/completions", with({{"suffix", "end"}}), 400, "unsupported_parameter",
       "suffix"},
      {"POST", "/v1/completions", with({{"presence_penalty", 2.5}}), 400, "invalid_value",
       "presence_penalty"},
      {"POST", "/v1/completions", with({{"repetition_penalty", 0}}), 400, "invalid_value",
       "repetition_penalty"},
      {"POST", "/v1/completions", with({{"min_p", -0.1}}), 400, "invalid_value", "min_p"},
      {"POST", "/v1/completions", with({{"logit_bias", {{"5", 101}}}}), 400, "invalid_value",
       "logit_bias"},
      {"POST", "/v1/completions", with({{"logit_bias", {{"abc", 1}}}}), 400, "invalid_value",
       "logit_bias"},
      {"POST", "/v1/completions", with({{"stop_token_ids", {5000}}}), 400, "invalid_value",
       "stop_token_ids"},
      {"POST", "/v1/completions", with({{"ignore_eos", "yes"}}), 400, "invalid_value",
       "ignore_eos"},
      {"GET", "/v1/completions", "", 405, "method_not_allowed", ""},
      {"POST", "/v1/models", "", 405, "method_not_allowed", ""},
      {"GET", "/v1/nothing", "", 404, "not_found", ""},
      {"POST", "/v1/completions", std::string(70000, ' '), 413, "body_too_large", ""},
  };
  for (const Case& c : cases) {
    Reply r = Call(http_, c.method, c.path, c.body);
    SCOPED_TRACE(c.method + " " + c.path + " " + c.body.substr(0, 80));
    EXPECT_EQ(r.status, c.status) << r.body;
    Json j = Json::parse(r.body, nullptr, false);
    ASSERT_FALSE(j.is_discarded()) << r.body;
    ASSERT_TRUE(j.contains("error")) << r.body;
    EXPECT_TRUE(j["error"]["message"].is_string());
    EXPECT_TRUE(j["error"]["type"].is_string());
    EXPECT_EQ(j["error"]["code"], c.code.empty() ? Json(nullptr) : Json(c.code)) << r.body;
    if (!c.param.empty()) {
      EXPECT_EQ(j["error"]["param"], Json(c.param)) << r.body;
    }
  }
  // The system still serves.
  EXPECT_EQ(Post(http_, ok).status, 200);
}

TEST_F(RouterTest, ChatCompletionsThroughTheModelsTemplate) {
  const Json body = {{"model", "tiny-moe"},
                     {"messages",
                      {{{"role", "system"}, {"content", "You answer briefly."}},
                       {{"role", "user"}, {"content", "Who made the heaven and the earth?"}}}},
                     {"max_tokens", 10},
                     {"temperature", 0}};
  Reply whole = Call(http_, "POST", "/v1/chat/completions", body.dump());
  ASSERT_EQ(whole.status, 200) << whole.body;
  Json j = Json::parse(whole.body);
  EXPECT_EQ(j["object"], "chat.completion");
  EXPECT_EQ(j["id"].get<std::string>().rfind("chatcmpl-", 0), 0u);
  EXPECT_EQ(j["choices"][0]["message"]["role"], "assistant");
  const std::string content = j["choices"][0]["message"]["content"];
  EXPECT_FALSE(content.empty());
  // The template renders "<s>You answer briefly.\n\nUser: ...\nAssistant:": far more tokens
  // than the user's words alone.
  EXPECT_GT(j["usage"]["prompt_tokens"].get<int>(), 12);

  Json streamed = body;
  streamed["stream"] = true;
  Reply s = Call(http_, "POST", "/v1/chat/completions", streamed.dump());
  ASSERT_EQ(s.status, 200) << s.body;
  auto events = Events(s.body);
  ASSERT_GE(events.size(), 2u);
  EXPECT_EQ(events.back(), "[DONE]");
  std::string text;
  for (size_t i = 0; i + 1 < events.size(); ++i) {
    Json e = Json::parse(events[i]);
    EXPECT_EQ(e["object"], "chat.completion.chunk");
    const Json& delta = e["choices"][0]["delta"];
    if (i == 0) {
      EXPECT_EQ(delta["role"], "assistant") << events[i];
    }
    if (delta.contains("content")) text += delta["content"].get<std::string>();
  }
  EXPECT_EQ(text, content);

  struct Case {
    Json patch;
    std::string code, param;
  };
  const std::vector<Case> cases = {
      {{{"messages", nullptr}}, "missing_required", "messages"},
      {{{"messages", "hello"}}, "invalid_value", "messages"},
      {{{"messages", Json::array()}}, "invalid_value", "messages"},
      {{{"messages", {{{"role", "tool"}, {"tool_call_id", 7}, {"content", "x"}}}}},
       "invalid_value",
       "messages"},
      {{{"messages", {{{"role", "user"}}}}}, "invalid_value", "messages"},
      {{{"messages", {{{"role", "user"}, {"content", {{{"type", "image_url"}}}}}}}},
       "invalid_value",
       "messages"},
      {{{"tools", {{{"type", "function"}}}}}, "invalid_value", "tools"},
      {{{"tools", {{{"type", "function"}, {"function", {{"name", "f"}}}}}},
        {"tool_choice", {{"type", "function"}, {"function", {{"name", "g"}}}}}},
       "invalid_value",
       "tool_choice"},
      {{{"response_format",
         {{"type", "json_schema"},
          {"json_schema", {{"schema", {{"type", "integer"}, {"minimum", 0}}}}}}}},
       "unsupported_schema",
       "response_format"},
      {{{"n", 17}}, "invalid_value", "n"},
      {{{"logprobs", 2}}, "invalid_value", "logprobs"},
      {{{"top_logprobs", 2}}, "invalid_value", "top_logprobs"},
      {{{"logprobs", true}, {"top_logprobs", 21}}, "invalid_value", "top_logprobs"},
      {{{"echo", true}}, "unsupported_parameter", "echo"},
  };
  for (const Case& c : cases) {
    Json b = body;
    for (auto it = c.patch.begin(); it != c.patch.end(); ++it) b[it.key()] = it.value();
    Reply r = Call(http_, "POST", "/v1/chat/completions", b.dump());
    SCOPED_TRACE(c.patch.dump());
    EXPECT_EQ(r.status, 400) << r.body;
    Json e = Json::parse(r.body, nullptr, false);
    ASSERT_FALSE(e.is_discarded()) << r.body;
    EXPECT_EQ(e["error"]["code"], Json(c.code)) << r.body;
    EXPECT_EQ(e["error"]["param"], Json(c.param)) << r.body;
  }
  EXPECT_EQ(Call(http_, "GET", "/v1/chat/completions").status, 405);
}

TEST_F(RouterTest, ApiKeysGuardEverythingButHealth) {
  EXPECT_EQ(Call(http_, "GET", "/health", "", "").status, 200);
  for (const std::string& auth :
       {std::string(""), std::string("Bearer wrong-key-0123456789"),
        std::string("Bearer test-key-012345678"), std::string("Basic dGVzdA=="),
        std::string("Bearer test-key-0123456789x")}) {
    SCOPED_TRACE(auth);
    Reply r = Call(http_, "POST", "/v1/completions", Completion({}).dump(), auth);
    EXPECT_EQ(r.status, 401) << r.body;
    EXPECT_NE(r.head.find("WWW-Authenticate: Bearer"), std::string::npos) << r.head;
    EXPECT_EQ(Json::parse(r.body)["error"]["code"], "invalid_api_key");
    EXPECT_EQ(Call(http_, "GET", "/v1/models", "", auth).status, 401);
    EXPECT_EQ(Call(http_, "GET", "/metrics", "", auth).status, 401);
  }
}

TEST_F(RouterTest, MetricsCountRequestsLatencyAndExperts) {
  ASSERT_EQ(Post(http_, Completion({{"max_tokens", 6}})).status, 200);
  ASSERT_EQ(Post(http_, Completion({{"n", 17}})).status, 400);
  Reply m;
  auto value = [&](const std::string& series) -> double {
    const size_t at = m.body.find("\n" + series + " ");
    if (at == std::string::npos) return -1;
    return std::stod(m.body.substr(at + series.size() + 2));
  };
  // The expert figures come with the worker's heartbeats and the match latencies with the map
  // service's answers to the router's pings: wait for them to arrive, not for a time.
  ASSERT_TRUE(WaitUntil(
      [&] {
        m = Call(http_, "GET", "/metrics");
        return m.status == 200 && value("fmoe_expert_hits_total{group=\"g0\"}") > 0 &&
               value("fmoe_map_service_match_latency_seconds_count") > 0;
      },
      30000))
      << m.status << " " << m.body;
  EXPECT_NE(m.head.find("text/plain; version=0.0.4"), std::string::npos) << m.head;
  EXPECT_GE(value("fmoe_requests_total{route=\"/v1/completions\",status=\"200\"}"), 1) << m.body;
  EXPECT_GE(value("fmoe_requests_total{route=\"/v1/completions\",status=\"400\"}"), 1);
  EXPECT_GE(value("fmoe_time_to_first_token_seconds_count"), 1);
  EXPECT_GE(value("fmoe_time_per_output_token_seconds_count"), 1);
  EXPECT_GE(value("fmoe_generation_tokens_total"), 6);
  EXPECT_GT(value("fmoe_expert_hits_total{group=\"g0\"}"), 0);
  EXPECT_EQ(value("fmoe_group_alive{group=\"g0\"}"), 1);
  EXPECT_EQ(value("fmoe_queue_depth{group=\"g0\"}"), 0);
  EXPECT_EQ(value("fmoe_map_service_up"), 1);
  EXPECT_GT(value("fmoe_map_service_match_latency_seconds_count"), 0);
  // The model's expert shape (deploy/models/tiny-moe: 8 layers, 8 experts, top-2, bfloat16
  // experts of 3 x 128 x 256 parameters, no shared expert).
  EXPECT_NE(m.body.find("\nfmoe_model_info{architecture=\"MixtralForCausalLM\",fingerprint=\""),
            std::string::npos);
  EXPECT_EQ(value("fmoe_model_moe_layers"), 8);
  EXPECT_EQ(value("fmoe_model_routed_experts"), 8);
  EXPECT_EQ(value("fmoe_model_experts_per_token"), 2);
  EXPECT_EQ(value("fmoe_model_routed_expert_bytes"), 3 * 128 * 256 * 2);
  EXPECT_EQ(value("fmoe_model_shared_expert_bytes"), 0);
}

// A client check script of tests/integration run with the virtual environment deploy/test.sh
// prepares (.venv in the source tree) as `script BASE_URL KEY tiny-moe`. Not `installed` when
// `module` does not import there (PyPI was unreachable): `log` then says so.
struct ClientRun {
  bool installed = false;
  int code = -1;
  std::string log;
};
ClientRun RunClientCheck(const std::string& module, const std::string& script,
                         const std::string& base_url, int timeout_ms) {
  const std::string python = std::string(FMOE_SOURCE_DIR) + "/.venv/bin/python";
  ClientRun run;
  if (testing::RunCommand({python, "-c", "import " + module}, 60000).first != 0) {
    run.log = "SKIPPED: the Python module " + module + " is not installed in " + python +
              " (deploy/test.sh installs it from PyPI; PyPI may be unreachable)";
    return run;
  }
  run.installed = true;
  std::tie(run.code, run.log) =
      testing::RunCommand({python, std::string(FMOE_SOURCE_DIR) + "/tests/integration/" + script,
                           base_url, kKey, "tiny-moe"},
                          timeout_ms);
  return run;
}

// The official `openai` Python client.
TEST_F(RouterTest, OfficialOpenAIClient) {
  const ClientRun r = RunClientCheck("openai", "openai_client_check.py",
                                     "http://127.0.0.1:" + std::to_string(http_) + "/v1", 120000);
  if (!r.installed) GTEST_SKIP() << r.log;
  EXPECT_EQ(r.code, 0) << r.log;
  EXPECT_NE(r.log.find("all checks passed"), std::string::npos) << r.log;
}

// The official `anthropic` Python client on POST /v1/messages.
TEST_F(RouterTest, OfficialAnthropicClient) {
  const ClientRun r = RunClientCheck("anthropic", "anthropic_client_check.py",
                                     "http://127.0.0.1:" + std::to_string(http_), 120000);
  if (!r.installed) GTEST_SKIP() << r.log;
  EXPECT_EQ(r.code, 0) << r.log;
  EXPECT_NE(r.log.find("all checks passed"), std::string::npos) << r.log;
}

// LangChain's ChatOpenAI (langchain-openai): invoke, stream, bind_tools and
// with_structured_output.
TEST_F(RouterTest, LangChainClient) {
  const ClientRun r = RunClientCheck("langchain_openai", "langchain_client_check.py",
                                     "http://127.0.0.1:" + std::to_string(http_) + "/v1", 180000);
  if (!r.installed) GTEST_SKIP() << r.log;
  EXPECT_EQ(r.code, 0) << r.log;
  EXPECT_NE(r.log.find("all checks passed"), std::string::npos) << r.log;
}

// lm-evaluation-harness's local-completions model with its remote tokenizer (/tokenizer_info,
// /tokenize, /detokenize): a multiple-choice task from a local file scored by loglikelihood,
// each request's score equal to the continuation's logprobs the router reports directly.
TEST_F(RouterTest, LmEvaluationHarness) {
  const ClientRun r = RunClientCheck("lm_eval, tenacity", "lm_eval_check.py",
                                     "http://127.0.0.1:" + std::to_string(http_) + "/v1", 300000);
  if (!r.installed) GTEST_SKIP() << r.log;
  EXPECT_EQ(r.code, 0) << r.log;
  EXPECT_NE(r.log.find("all checks passed"), std::string::npos) << r.log;
}

TEST_F(RouterTest, ADisconnectingClientCancelsItsRequest) {
  testing::AsyncCall call(
      http_, "POST", "/v1/completions",
      Completion({{"max_tokens", 1000}, {"stream", true}, {"prompt", "And God said"}}).dump(),
      std::string("Bearer ") + kKey);
  ASSERT_TRUE(call.WaitForEvents(1, 60000)) << call.Received();
  EXPECT_EQ(RunningAtRouter(), 1);
  call.Leave();  // Closes the connection.
  // Cancelled: its slot is free well before 1000 tokens could have been generated (the router
  // notices at its next write, one token later, however slow the machine).
  EXPECT_TRUE(WaitUntil([] { return RunningAtRouter() == 0; }, 15000, 20));
  EXPECT_EQ(Post(http_, Completion({})).status, 200);
}

TEST_F(RouterTest, AFullQueueAnswers429WhileAdmittedRequestsComplete) {
  // max_batch 1 and queue_limit 2: one runs, two wait, the rest are refused at once. States, not
  // timing: a long stream runs (it has produced a token), two requests are seen queued, then
  // every further request is refused; the stream is left (cancelled) and the queued complete.
  testing::AsyncCall running(
      http_, "POST", "/v1/completions",
      Completion({{"max_tokens", 1000}, {"stream", true}, {"prompt", "And God said"}}).dump(),
      std::string("Bearer ") + kKey);
  ASSERT_TRUE(running.WaitForEvents(1, 60000)) << running.Received();
  std::vector<std::unique_ptr<testing::AsyncCall>> queued;
  for (int i = 0; i < 2; ++i) {
    queued.push_back(std::make_unique<testing::AsyncCall>(
        http_, "POST", "/v1/completions",
        Completion({{"max_tokens", 48}, {"prompt", "In the beginning"}}).dump(),
        std::string("Bearer ") + kKey));
  }
  ASSERT_TRUE(WaitUntil([] { return QueuedAtRouter() == 2; }, 30000)) << QueuedAtRouter();
  for (int i = 0; i < 3; ++i) {
    // The 429 carries Retry-After and the error object.
    const Reply r = Post(http_, Completion({{"max_tokens", 48}}));
    EXPECT_EQ(r.status, 429) << r.body;
    EXPECT_NE(r.head.find("Retry-After: 1"), std::string::npos) << r.head;
    EXPECT_EQ(Json::parse(r.body, nullptr, false)["error"]["code"], "queue_full") << r.body;
  }
  running.Leave();
  for (auto& call : queued) {
    const Reply r = call->Finish();
    EXPECT_EQ(r.status, 200) << r.body;
  }
  EXPECT_TRUE(WaitUntil([] { return RunningAtRouter() == 0 && QueuedAtRouter() == 0; }, 30000));
}

// Two worker groups: requests spread over both; when one group's leader dies, its request that
// had started ends with an error, its queued one runs on the other group, and new requests keep
// being served by the group that is alive.
TEST(RouterGroupsTest, ALostGroupsQueuedRequestsMoveToTheOther) {
  const std::string dir = testing::MakeTempDir("fmoe-router-groups");
  const int http = FreeTcpPort();
  const std::string manifest = dir + "/manifest.yaml";
  testing::WriteFile(manifest,
                     "model:\n  name: tiny-moe\n  path: " + std::string(FMOE_SOURCE_DIR) +
                         "/deploy/models/tiny-moe\n"
                         "map_service:\n  endpoint: tcp://127.0.0.1:" +
                         std::to_string(FreeTcpPort()) + "\n  data_dir: " + dir +
                         "/maps\n"
                         "worker_groups:\n"
                         "  - name: a\n    max_batch: 1\n    workers:\n      - device: cpu\n"
                         "  - name: b\n    max_batch: 1\n    workers:\n      - device: cpu\n"
                         "router:\n  listen: 127.0.0.1:" +
                         std::to_string(http) +
                         "\n  worker_endpoint: tcp://127.0.0.1:" + std::to_string(FreeTcpPort()) +
                         "\nheartbeat:\n  interval_ms: 100\n  timeout_ms: 3000\n"
                         "launcher:\n  run_dir: " +
                         dir +
                         "/run\n  ready_timeout_s: 60\n  restart:\n    initial_backoff_ms: 5000\n"
                         "    max_backoff_ms: 5000\n");
  Child launcher({BinDir() + "/fmoe", "launch", manifest}, dir + "/launcher.log");
  auto health = [&]() {
    auto res = http::Get("127.0.0.1", http, "/health", 1000);
    return res.ok() ? Json::parse(res->body, nullptr, false) : Json();
  };
  ASSERT_TRUE(WaitUntil(
      [&] {
        Json h = health();
        return h.is_object() && h["groups"][0]["alive"] == true && h["groups"][1]["alive"] == true;
      },
      90000))
      << launcher.Log();
  // One long streamed request runs on each group (least-loaded dispatch, max_batch 1): wait
  // until both have produced a token, so group a's has started when a dies, however slow the
  // machine. Then one whole request waits in each group's queue.
  Json stream_body = {{"model", "tiny-moe"},
                      {"prompt", "And God said"},
                      {"max_tokens", 1000},
                      {"temperature", 0},
                      {"stream", true}};
  std::vector<std::unique_ptr<testing::AsyncCall>> running;
  for (int i = 0; i < 2; ++i) {
    running.push_back(
        std::make_unique<testing::AsyncCall>(http, "POST", "/v1/completions", stream_body.dump()));
    ASSERT_TRUE(running.back()->WaitForEvents(1, 120000)) << health().dump();
  }
  const Json queued_body = {
      {"model", "tiny-moe"}, {"prompt", "And God said"}, {"max_tokens", 16}, {"temperature", 0}};
  std::vector<std::unique_ptr<testing::AsyncCall>> queued;
  for (int i = 0; i < 2; ++i) {
    queued.push_back(
        std::make_unique<testing::AsyncCall>(http, "POST", "/v1/completions", queued_body.dump()));
  }
  ASSERT_TRUE(WaitUntil(
      [&] {
        Json h = health();
        return h.is_object() && h["groups"][0]["running"] == 1 && h["groups"][1]["running"] == 1 &&
               h["groups"][0]["queued"] == 1 && h["groups"][1]["queued"] == 1;
      },
      30000))
      << health().dump();
  // Kill group a's leader, once the launcher too counts it started (a process that dies while
  // it starts up stops the launch: the router may see the group alive a moment before).
  ASSERT_TRUE(WaitUntil(
      [&] {
        const Json st = Json::parse(testing::ReadFile(dir + "/run/launcher.json"), nullptr, false);
        if (!st.is_object() || st.value("phase", "") != "running") return false;
        for (const auto& p : st["processes"]) {
          if (p["name"] == "worker-a-0" && p["state"] == "running") return true;
        }
        return false;
      },
      60000, 20));
  Json state = Json::parse(testing::ReadFile(dir + "/run/launcher.json"));
  int64_t pid = 0;
  for (const auto& p : state["processes"]) {
    if (p["name"] == "worker-a-0") pid = p["pid"].get<int64_t>();
  }
  ASSERT_GT(pid, 0) << state.dump();
  kill(static_cast<pid_t>(pid), SIGKILL);
  // Group a's started request ends with the error (an event, as its stream had begun); the
  // other stream, on b, is left (cancelled) so that b gets to the queued requests.
  auto lost_on = [&](size_t i) {
    return running[i]->WaitForEnd(0) &&
           running[i]->Received().find("worker group lost") != std::string::npos;
  };
  ASSERT_TRUE(WaitUntil([&] { return lost_on(0) || lost_on(1); }, 60000, 20))
      << running[0]->Received() << running[1]->Received() << health().dump();
  const size_t on_a = lost_on(0) ? 0 : 1;
  running[1 - on_a]->Leave();
  const Reply lost = running[on_a]->Finish();
  EXPECT_EQ(lost.status, 200) << lost.body;
  const auto events = Events(lost.body);
  ASSERT_GE(events.size(), 3u) << lost.body;
  EXPECT_EQ(events.back(), "[DONE]") << lost.body;
  const Json error = Json::parse(events[events.size() - 2], nullptr, false);
  EXPECT_EQ(error["error"]["message"], "worker group lost") << lost.body;
  // Both queued requests are answered by group b, a's moved to the front of b's queue.
  for (auto& call : queued) {
    const Reply r = call->Finish();
    EXPECT_EQ(r.status, 200) << r.body;
  }
  // Group b still serves.
  EXPECT_EQ(Call(http, "POST", "/v1/completions",
                 Json{{"model", "tiny-moe"}, {"prompt", "x"}, {"max_tokens", 2}}.dump(), "")
                .status,
            200);
  launcher.Signal(SIGTERM);
  launcher.Wait(30000);
  std::error_code ec;
  if (!::testing::Test::HasFailure()) std::filesystem::remove_all(dir, ec);
}

// The per-request timeout (router.request_timeout_s, 1 s here): a request still generating at
// its deadline is cancelled at its leader and answered 503 "timeout" (an error event and
// [DONE] on a stream), and its slot is free again.
TEST(RouterTimeoutTest, ARequestPastItsDeadlineIsCancelledAndAnswered503) {
  const std::string dir = testing::MakeTempDir("fmoe-router-timeout");
  const int http = FreeTcpPort();
  const std::string manifest = dir + "/manifest.yaml";
  testing::WriteFile(manifest, "model:\n  name: tiny-moe\n  path: " + std::string(FMOE_SOURCE_DIR) +
                                   "/deploy/models/tiny-moe\n"
                                   "map_service:\n  endpoint: tcp://127.0.0.1:" +
                                   std::to_string(FreeTcpPort()) + "\n  data_dir: " + dir +
                                   "/maps\n"
                                   "worker_groups:\n  - name: g0\n    max_batch: 1\n"
                                   "    workers:\n      - device: cpu\n"
                                   "router:\n  listen: 127.0.0.1:" +
                                   std::to_string(http) + "\n  worker_endpoint: tcp://127.0.0.1:" +
                                   std::to_string(FreeTcpPort()) +
                                   "\n  request_timeout_s: 1\n"
                                   "heartbeat:\n  interval_ms: 100\n  timeout_ms: 2000\n"
                                   "launcher:\n  run_dir: " +
                                   dir + "/run\n  ready_timeout_s: 60\n");
  Child launcher({BinDir() + "/fmoe", "launch", manifest}, dir + "/launcher.log");
  auto health = [&]() {
    auto res = http::Get("127.0.0.1", http, "/health", 1000);
    return res.ok() ? Json::parse(res->body, nullptr, false) : Json();
  };
  ASSERT_TRUE(WaitUntil(
      [&] {
        Json h = health();
        return h.is_object() && h["status"] == "ok";
      },
      90000))
      << launcher.Log();
  // 1000 tokens take several seconds on any CPU this runs on.
  Json body = {
      {"model", "tiny-moe"}, {"prompt", "And God said"}, {"max_tokens", 1000}, {"temperature", 0}};
  const auto t0 = std::chrono::steady_clock::now();
  Reply r = Call(http, "POST", "/v1/completions", body.dump(), "");
  const auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_EQ(r.status, 503) << r.body;
  EXPECT_EQ(Json::parse(r.body)["error"]["code"], "timeout") << r.body;
  EXPECT_LT(took, 5s);
  EXPECT_TRUE(WaitUntil([&] { return health()["groups"][0]["running"] == 0; }, 5000, 20));

  body["stream"] = true;
  Reply s = Call(http, "POST", "/v1/completions", body.dump(), "");
  ASSERT_EQ(s.status, 200);
  auto events = Events(s.body);
  ASSERT_GE(events.size(), 2u) << s.body;
  EXPECT_EQ(events.back(), "[DONE]");
  EXPECT_EQ(Json::parse(events[events.size() - 2])["error"]["code"], "timeout") << s.body;
  // The slot serves the next request: a short one completes within the deadline (tried again
  // while a machine busy with other work makes even it late; a slot left taken never would).
  EXPECT_TRUE(WaitUntil([&] { return health()["groups"][0]["running"] == 0; }, 5000, 20));
  body.erase("stream");
  body["max_tokens"] = 2;
  EXPECT_TRUE(WaitUntil(
      [&] { return Call(http, "POST", "/v1/completions", body.dump(), "").status == 200; }, 60000,
      100));
  launcher.Signal(SIGTERM);
  launcher.Wait(30000);
  std::error_code ec;
  if (!::testing::Test::HasFailure()) std::filesystem::remove_all(dir, ec);
}

// One device budget (`memory`): the router learns the pool's most positions from the group's
// heartbeats and holds requests to it as to the context. A chat without max_tokens gets the
// rest of the pool (not the model's 1024, which the worker would refuse), and a request that
// could never fit is a 400 from the router naming the pool.
TEST(RouterMemoryBudget, RequestsFitThePoolTheHeartbeatsReport) {
  testing::LaunchedCluster cluster("fmoe-router-memory");
  const int http = FreeTcpPort();
  // About 20 pages of 0.39 MB (an expert, or 3 blocks of 16 positions): the pool may hold at
  // most 18 of them, 864 positions, under the tiny model's context of 1024.
  ASSERT_TRUE(cluster.Start(cluster.TinyManifest(http, "    memory: {device_gb: 0.008}\n",
                                                 std::string("  api_keys: [") + kKey + "]\n", 2000),
                            http, 90000))
      << cluster.LauncherLog();
  uint64_t positions = 0;
  ASSERT_TRUE(WaitUntil(
      [&] {
        const Json j = Json::parse(Call(http, "GET", "/health").body, nullptr, false);
        if (j.is_discarded()) return false;
        const Json& kv = j["groups"][0]["kv_cache"];
        positions = kv.is_object() ? kv.value("max_blocks", uint64_t{0}) * 16 : 0;
        return positions > 0;
      },
      60000, 50))
      << cluster.LogOf("router");
  ASSERT_LT(positions, 1024u) << "the pool must be smaller than the context for this test";

  std::string words;
  for (int i = 0; i < 300; ++i) words += "a b ";
  const Json chat = {{"model", "tiny-moe"},
                     {"temperature", 0},
                     {"ignore_eos", true},
                     {"messages", {{{"role", "user"}, {"content", words}}}}};
  Reply r = Call(http, "POST", "/v1/chat/completions", chat.dump());
  ASSERT_EQ(r.status, 200) << r.body;
  const Json j = Json::parse(r.body);
  EXPECT_EQ(j["usage"]["total_tokens"], positions) << r.body;
  EXPECT_EQ(j["choices"][0]["finish_reason"], "length");

  const Json too_long = {{"model", "tiny-moe"},
                         {"prompt", "The LORD is my shepherd"},
                         {"max_tokens", positions},
                         {"temperature", 0}};
  Reply refused = Post(http, too_long);
  EXPECT_EQ(refused.status, 400) << refused.body;
  EXPECT_NE(refused.body.find("context_length_exceeded"), std::string::npos) << refused.body;
  EXPECT_NE(refused.body.find("the KV pool of group g0 holds at most " + std::to_string(positions)),
            std::string::npos)
      << refused.body;
}

}  // namespace
}  // namespace fmoe
