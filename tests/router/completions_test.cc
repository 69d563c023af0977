// The completions route rendering what a worker sends, with a real WorkerLink and a leader
// played by the test: sampled output can be any sequence of byte-level tokens, so every kind of
// ill-formed UTF-8 is sent as token bytes (a lead byte followed by a space, lone continuation
// bytes, overlong forms, surrogates, code points above U+10FFFF, a character cut by max_tokens),
// in whole answers and streams, completions and chat, with logprobs and n. Every answer must be
// valid JSON (every stream event too) with U+FFFD in place of each ill-formed subpart, and an
// error text from the worker that is not UTF-8 must not break the error answer either.
#include "router/completions.h"

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "common/json.h"
#include "common/text/grammar.h"
#include "common/text/grammar_matcher.h"
#include "common/text/json_schema.h"
#include "common/text/tokenizer.h"
#include "common/text/unicode.h"
#include "router/structured_output.h"
#include "tests/router/link_fixture.h"

namespace fmoe {
namespace {

using namespace link_testing;
using Json = nlohmann::json;

const std::string kFffd = "\xEF\xBF\xBD";

// The payloads of a stream's "data: " events, in order.
std::vector<std::string> DataEvents(const std::string& sse) {
  std::vector<std::string> events;
  for (size_t at = 0; (at = sse.find("data: ", at)) != std::string::npos;) {
    const size_t end = sse.find("\n\n", at);
    if (end == std::string::npos) break;
    events.push_back(sse.substr(at + 6, end - at - 6));
    at = end;
  }
  return events;
}

// The leader answers request `id` with the model's output `text` (markers spelled out) as its
// tokens, then stop.
void AnswerWithText(FakeLeader& leader, const Tokenizer& tokenizer, uint64_t id,
                    const std::string& text) {
  auto ids = tokenizer.Encode(text, /*add_special_tokens=*/false);
  EXPECT_TRUE(ids.ok());
  for (size_t i = 0; ids.ok() && i < ids->size(); ++i) {
    TokenEvent ev = Token(id, (*ids)[i]);
    ev.index = static_cast<uint32_t>(i);
    leader.Send(ev);
  }
  leader.Send(Token(id, -1, FinishReason::kStop));
}

size_t CodePoints(const std::string& s) {
  return static_cast<size_t>(
      std::count_if(s.begin(), s.end(), [](char c) { return (c & 0xC0) != 0x80; }));
}

class CompletionsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto loaded = Tokenizer::Load(FMOE_SOURCE_DIR "/deploy/models/tiny-moe");
    ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
    tokenizer_ = std::move(*loaded);
    CompletionsOptions options;
    options.model_name = "tiny";
    options.context_length = 1024;
    auto compiled = ChatTemplate::Compile(tokenizer_->chat_template());
    ASSERT_TRUE(compiled.ok()) << compiled.status().ToString();
    template_.emplace(std::move(*compiled));
    options.chat_template = &*template_;
    completions_ = std::make_unique<Completions>(options, *tokenizer_, *link_);
    leader_ = std::make_unique<FakeLeader>(link_.endpoint(), "g0", 0, 1);
    ASSERT_TRUE(leader_->Join());
    ASSERT_TRUE(WaitUntil([&] { return link_.Alive("g0", 1); }));
  }

  int32_t ByteToken(unsigned char b) const {
    std::string token;
    ByteLevelEncode(std::string(1, static_cast<char>(b)), &token);
    auto id = tokenizer_->TokenToId(token);
    EXPECT_TRUE(id.has_value()) << int(b);
    return id.value_or(0);
  }

  // Sends `body` to `path`; the leader answers each Generate with `bytes` as byte tokens (with
  // logprobs when asked), then a finish. Returns the recorder once the answer is complete.
  std::shared_ptr<Recorder> Run(const std::string& path, const Json& body,
                                const std::vector<unsigned char>& bytes, uint32_t choices = 1) {
    auto rec = std::make_shared<Recorder>();
    HttpRequest req;
    req.method = "POST";
    req.path = req.target = path;
    req.body = body.dump();
    if (path == "/v1/chat/completions") {
      completions_->HandleChat(req, rec);
    } else {
      completions_->Handle(req, rec);
    }
    for (uint32_t c = 0; c < choices; ++c) {
      auto gen = leader_->Next<Generate>();
      EXPECT_TRUE(gen);
      if (!gen) return rec;
      for (size_t i = 0; i < bytes.size(); ++i) {
        TokenEvent ev = Token(gen->request_id, ByteToken(bytes[i]));
        ev.index = static_cast<uint32_t>(i);
        if (gen->sampling.logprobs >= 0) {
          ev.logprob = -0.5f;
          for (int k = 0; k < gen->sampling.logprobs; ++k) {
            ev.top_logprobs.emplace_back(ByteToken(static_cast<unsigned char>('a' + k)), -0.5f - k);
          }
        }
        if (gen->sampling.prompt_logprobs && i == 0) {
          // Prompt token k + 1 gets -1 - k/4, and the top ones 'a', 'b', ... below it.
          const size_t n = gen->token_ids.size() - 1 + prompt_logprob_skew;
          ev.prompt_top_n = static_cast<uint32_t>(gen->sampling.logprobs);
          for (size_t k = 0; k < n; ++k) {
            ev.prompt_logprobs.push_back(-1.0f - 0.25f * static_cast<float>(k));
            for (uint32_t t = 0; t < ev.prompt_top_n; ++t) {
              ev.prompt_top.emplace_back(ByteToken(static_cast<unsigned char>('a' + t)),
                                         -0.125f - static_cast<float>(t));
            }
          }
        }
        leader_->Send(ev);
      }
      leader_->Send(Token(gen->request_id, -1, FinishReason::kLength));
    }
    EXPECT_TRUE(WaitUntil([&] { return rec->done(); }));
    return rec;
  }

  int prompt_logprob_skew = 0;  // Prompt logprob entries sent beyond (or short of) the prompt's.
  std::unique_ptr<Tokenizer> tokenizer_;
  std::optional<ChatTemplate> template_;
  Link link_;
  std::unique_ptr<Completions> completions_;
  std::unique_ptr<FakeLeader> leader_;
};

struct Case {
  const char* what;
  std::vector<unsigned char> bytes;
  std::string text;
};

std::vector<Case> Cases() {
  const std::string r = kFffd;
  return {
      {"a lead byte followed by a space", {'a', 0xE4, ' ', 'b'}, "a" + r + " b"},
      {"a lone continuation byte", {0x80, 'x'}, r + "x"},
      {"continuation bytes in a row", {0x80, 0xBF, 0x80}, r + r + r},
      {"an overlong form", {0xC0, 0xAF}, r + r},
      {"an overlong three-byte form", {0xE0, 0x80, 0xAF}, r + r + r},
      {"a surrogate", {0xED, 0xA0, 0x80}, r + r + r},
      {"above U+10FFFF", {0xF4, 0x90, 0x80, 0x80}, r + r + r + r},
      {"bytes that never lead", {0xF8, 0xFE, 0xFF}, r + r + r},
      {"a character cut by the end", {'o', 'k', 0xF0, 0x9F, 0x98}, "ok" + r},
      {"a character cut by another", {0xE6, 0x97, 'z'}, r + "z"},
      {"whole characters around", {0xC3, 0xA9, 0x80, 0xC3, 0xA9}, "\xC3\xA9" + r + "\xC3\xA9"},
  };
}

TEST_F(CompletionsTest, WholeAnswersReplaceEveryKindOfInvalidUtf8) {
  for (const Case& c : Cases()) {
    SCOPED_TRACE(c.what);
    Json body = {{"model", "tiny"}, {"prompt", "x"}, {"max_tokens", 16}};
    auto rec = Run("/v1/completions", body, c.bytes);
    ASSERT_EQ(rec->status(), 200) << rec->body();
    Json j = Json::parse(rec->body(), nullptr, false);
    ASSERT_FALSE(j.is_discarded()) << rec->body();
    EXPECT_EQ(j["choices"][0]["text"], c.text);
    EXPECT_EQ(j["usage"]["completion_tokens"], c.bytes.size());
  }
}

TEST_F(CompletionsTest, StreamsReplaceEveryKindOfInvalidUtf8) {
  for (const Case& c : Cases()) {
    SCOPED_TRACE(c.what);
    for (const char* path : {"/v1/completions", "/v1/chat/completions"}) {
      const bool chat = std::string(path) == "/v1/chat/completions";
      Json body = {{"model", "tiny"}, {"max_tokens", 16}, {"stream", true}};
      if (chat) {
        body["messages"] = {{{"role", "user"}, {"content", "hi"}}};
      } else {
        body["prompt"] = "x";
      }
      auto rec = Run(path, body, c.bytes);
      ASSERT_EQ(rec->status(), 200);
      std::vector<std::string> events;
      std::string text;
      const std::string all = rec->body();
      for (size_t at = 0; (at = all.find("data: ", at)) != std::string::npos;) {
        const size_t end = all.find("\n\n", at);
        ASSERT_NE(end, std::string::npos);
        events.push_back(all.substr(at + 6, end - at - 6));
        at = end;
      }
      ASSERT_FALSE(events.empty());
      EXPECT_EQ(events.back(), "[DONE]");
      for (size_t e = 0; e + 1 < events.size(); ++e) {
        EXPECT_TRUE(IsValidUtf8(events[e]));
        Json chunk = Json::parse(events[e], nullptr, false);
        ASSERT_FALSE(chunk.is_discarded()) << events[e];
        const Json& choice = chunk["choices"][0];
        text += chat ? choice["delta"].value("content", "") : choice["text"].get<std::string>();
      }
      EXPECT_EQ(text, c.text) << path;
    }
  }
}

TEST_F(CompletionsTest, LogprobTokensAndChoicesStayValidJson) {
  const std::vector<unsigned char> bytes = {0xE4, ' ', 0x80, 'a'};
  Json body = {{"model", "tiny"}, {"prompt", "x"}, {"max_tokens", 8},
               {"logprobs", 3},   {"n", 2},        {"seed", 5}};
  auto rec = Run("/v1/completions", body, bytes, 2);
  ASSERT_EQ(rec->status(), 200) << rec->body();
  Json j = Json::parse(rec->body(), nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << rec->body();
  ASSERT_EQ(j["choices"].size(), 2u);
  for (const Json& choice : j["choices"]) {
    EXPECT_EQ(choice["text"], kFffd + " " + kFffd + "a");
    const Json& lp = choice["logprobs"];
    ASSERT_EQ(lp["tokens"].size(), 4u);
    EXPECT_EQ(lp["tokens"][0], kFffd) << "a byte token alone is not a character";
    // The token's own entry (vLLM's) and the worker's 3 alternatives, which do not hold it here.
    EXPECT_EQ(lp["top_logprobs"][0].size(), 4u);
    EXPECT_TRUE(lp["top_logprobs"][0].contains(kFffd));
  }
  Json chat = {{"model", "tiny"},
               {"messages", {{{"role", "user"}, {"content", "hi"}}}},
               {"max_tokens", 8},
               {"logprobs", true},
               {"top_logprobs", 2}};
  rec = Run("/v1/chat/completions", chat, bytes);
  ASSERT_EQ(rec->status(), 200) << rec->body();
  j = Json::parse(rec->body(), nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << rec->body();
  const Json& content = j["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(content.size(), 4u);
  EXPECT_EQ(content[0]["bytes"], Json::array({0xE4})) << "the raw bytes let a client rebuild";
}

// echo with logprobs: the prompt's tokens lead the logprobs (the first with null), their offsets
// count the prompt's token texts, the generated tokens' start after the echoed prompt; a stream
// sends the echo with its logprobs once the first event brought them.
TEST_F(CompletionsTest, EchoWithLogprobsLeadsWithThePromptsTokens) {
  auto ids = tokenizer_->Encode("ab c", /*add_special_tokens=*/true);
  ASSERT_TRUE(ids.ok());
  const size_t t = ids->size();
  ASSERT_GE(t, 3u);
  Json body = {
      {"model", "tiny"}, {"prompt", "ab c"}, {"max_tokens", 8}, {"logprobs", 2}, {"echo", true}};
  auto rec = Run("/v1/completions", body, {'x', 'y'});
  ASSERT_EQ(rec->status(), 200) << rec->body();
  Json j = Json::parse(rec->body());
  const Json& choice = j["choices"][0];
  EXPECT_EQ(choice["text"], "ab cxy");
  const Json& lp = choice["logprobs"];
  ASSERT_EQ(lp["tokens"].size(), t + 2);
  EXPECT_TRUE(lp["token_logprobs"][0].is_null());
  EXPECT_TRUE(lp["top_logprobs"][0].is_null());
  size_t chars = 0;
  for (size_t k = 0; k < t; ++k) {
    EXPECT_EQ(lp["tokens"][k],
              ToValidUtf8(tokenizer_->Decode(std::span<const int32_t>(&(*ids)[k], 1), false)));
    EXPECT_EQ(lp["text_offset"][k], chars) << k;
    chars += CodePoints(lp["tokens"][k].get<std::string>());
    if (k == 0) continue;
    EXPECT_FLOAT_EQ(lp["token_logprobs"][k].get<float>(), -1.0f - 0.25f * (k - 1)) << k;
    EXPECT_EQ(lp["top_logprobs"][k].size(), 3u) << "the token's own entry and 2 alternatives";
    EXPECT_FLOAT_EQ(lp["top_logprobs"][k]["a"].get<float>(), -0.125f);
  }
  EXPECT_EQ(lp["tokens"][t], "x");
  EXPECT_EQ(lp["token_logprobs"][t], -0.5);
  EXPECT_EQ(lp["text_offset"][t], 4) << "after the echoed \"ab c\"";
  EXPECT_EQ(lp["text_offset"][t + 1], 5);

  body["stream"] = true;
  rec = Run("/v1/completions", body, {'x', 'y'});
  ASSERT_EQ(rec->status(), 200);
  std::vector<Json> events;
  for (const std::string& e : DataEvents(rec->body())) {
    if (e != "[DONE]") events.push_back(Json::parse(e));
  }
  ASSERT_GE(events.size(), 3u);
  EXPECT_EQ(events[0]["choices"][0]["text"], "ab c");
  EXPECT_EQ(events[0]["choices"][0]["logprobs"]["tokens"].size(), t);
  EXPECT_EQ(events[1]["choices"][0]["text"], "x");
  EXPECT_EQ(events[1]["choices"][0]["logprobs"]["tokens"], Json::array({"x"}));

  // A worker whose prompt logprobs do not fit the prompt gets a 500, not a wrong answer.
  body.erase("stream");
  prompt_logprob_skew = 1;
  rec = Run("/v1/completions", body, {'x'});
  EXPECT_EQ(rec->status(), 500) << rec->body();
  EXPECT_NE(rec->body().find("prompt logprobs do not match"), std::string::npos) << rec->body();
}

// A batch of prompts: prompt p's n choices are p * n .. p * n + n - 1, each submitted with its
// prompt's ids and seed + c (as the prompt alone would be), echoing its own prompt.
TEST_F(CompletionsTest, ABatchOfPromptsGivesEachItsChoices) {
  auto rec = std::make_shared<Recorder>();
  HttpRequest req;
  req.method = "POST";
  req.path = req.target = "/v1/completions";
  req.body = Json({{"model", "tiny"},
                   {"prompt", {"ab", "c d"}},
                   {"n", 2},
                   {"seed", 7},
                   {"echo", true},
                   {"max_tokens", 4}})
                 .dump();
  completions_->Handle(req, rec);
  const std::vector<std::string> prompts = {"ab", "c d"};
  for (size_t i = 0; i < 4; ++i) {
    auto gen = leader_->Next<Generate>();
    ASSERT_TRUE(gen) << i;
    auto ids = tokenizer_->Encode(prompts[i / 2], /*add_special_tokens=*/true);
    ASSERT_TRUE(ids.ok());
    EXPECT_EQ(gen->token_ids, *ids) << i;
    EXPECT_EQ(gen->sampling.seed, 7u + i % 2) << i;
    TokenEvent ev = Token(gen->request_id, ByteToken(static_cast<unsigned char>('w' + i)));
    leader_->Send(ev);
    leader_->Send(Token(gen->request_id, -1, FinishReason::kLength));
  }
  ASSERT_TRUE(WaitUntil([&] { return rec->done(); }));
  ASSERT_EQ(rec->status(), 200) << rec->body();
  Json j = Json::parse(rec->body());
  ASSERT_EQ(j["choices"].size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(j["choices"][i]["index"], i);
    EXPECT_EQ(j["choices"][i]["text"], prompts[i / 2] + std::string(1, static_cast<char>('w' + i)));
  }
  const size_t prompt_tokens =
      tokenizer_->Encode("ab", true)->size() + tokenizer_->Encode("c d", true)->size();
  EXPECT_EQ(j["usage"]["prompt_tokens"], prompt_tokens) << "each prompt once, whatever n";
  EXPECT_EQ(j["usage"]["completion_tokens"], 4);
}

TEST_F(CompletionsTest, AWorkerErrorThatIsNotUtf8StillAnswersValidJson) {
  auto rec = std::make_shared<Recorder>();
  HttpRequest req;
  req.method = "POST";
  req.path = req.target = "/v1/completions";
  req.body = Json({{"model", "tiny"}, {"prompt", "x"}}).dump();
  completions_->Handle(req, rec);
  auto gen = leader_->Next<Generate>();
  ASSERT_TRUE(gen);
  TokenEvent ev = Token(gen->request_id, -1, FinishReason::kError);
  ev.error = "tensor \xFF\xFE failed";
  leader_->Send(ev);
  ASSERT_TRUE(WaitUntil([&] { return rec->done(); }));
  EXPECT_EQ(rec->status(), 500);
  Json j = Json::parse(rec->body(), nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << rec->body();
  EXPECT_EQ(j["error"]["message"], "tensor " + kFffd + kFffd + " failed");
}

// gpt-oss's chat answers (harmony_channels): the text keeps the special tokens for the
// splitter, the analysis channel becomes reasoning_content and the final one content, in whole
// answers and streams, and no marker reaches the client. The tokenizer is the gpt-oss fixture's
// (its harmony markers are special tokens) with gpt-oss's <|constrain|> and <|call|>, which the
// fixture leaves out, added as special tokens; the template is a small harmony-shaped one.
class HarmonyCompletionsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::ifstream in(FMOE_SOURCE_DIR "/tests/fixtures/gpt-oss-ref/tokenizer.json");
    Json tok = Json::parse(in);
    for (const char* marker : {"<|constrain|>", "<|call|>"}) {
      Json t = tok["added_tokens"].back();
      t["id"] = t["id"].get<int>() + 1;
      t["content"] = marker;
      tok["added_tokens"].push_back(t);
    }
    const std::string dir = ::testing::TempDir() + "/harmony-" + std::to_string(::getpid());
    std::filesystem::create_directories(dir);
    std::ofstream(dir + "/tokenizer.json") << tok.dump();
    auto loaded = Tokenizer::Load(dir);
    std::error_code ec;
    std::filesystem::remove_all(dir, ec);  // Loaded: the file is no longer read.
    ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
    tokenizer_ = std::move(*loaded);
    CompletionsOptions options;
    options.model_name = "gpt-oss";
    options.context_length = 256;
    options.harmony_channels = true;
    options.tool_call_format = ToolCallFormat::kGptOss;
    auto compiled = ChatTemplate::Compile(
        "{% for m in messages %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>"
        "{% endfor %}<|start|>assistant");
    ASSERT_TRUE(compiled.ok()) << compiled.status().ToString();
    template_.emplace(std::move(*compiled));
    options.chat_template = &*template_;
    completions_ = std::make_unique<Completions>(options, *tokenizer_, *link_);
    leader_ = std::make_unique<FakeLeader>(link_.endpoint(), "g0", 0, 1);
    ASSERT_TRUE(leader_->Join());
    ASSERT_TRUE(WaitUntil([&] { return link_.Alive("g0", 1); }));
  }

  // The model's output `text` (special tokens spelled out) as the leader's tokens, then stop.
  std::shared_ptr<Recorder> Run(const Json& body, const std::string& text) {
    auto rec = std::make_shared<Recorder>();
    HttpRequest req;
    req.method = "POST";
    req.path = req.target = "/v1/chat/completions";
    req.body = body.dump();
    completions_->HandleChat(req, rec);
    auto gen = leader_->Next<Generate>();
    EXPECT_TRUE(gen);
    if (!gen) return rec;
    last_sampling_ = gen->sampling;
    last_prompt_ = gen->token_ids;
    AnswerWithText(*leader_, *tokenizer_, gen->request_id, text);
    EXPECT_TRUE(WaitUntil([&] { return rec->done(); }));
    return rec;
  }

  // A tool with a required string argument, and one without parameters.
  static Json WeatherTool() {
    return {{"type", "function"},
            {"function",
             {{"name", "get_weather"},
              {"parameters",
               {{"type", "object"},
                {"properties", {{"city", {{"type", "string"}}}}},
                {"required", {"city"}}}}}}};
  }
  static Json ClockTool() { return {{"type", "function"}, {"function", {{"name", "now"}}}}; }

  // An answer's one tool call (name and arguments concatenated over a stream's deltas), its
  // content and its finish_reason.
  struct Answered {
    std::string name, arguments, content, finish;
  };
  static Answered CallOf(const std::string& body, bool stream) {
    Answered a;
    if (stream) {
      for (const std::string& e : DataEvents(body)) {
        if (e == "[DONE]") continue;
        const Json j = Json::parse(e);
        if (j["choices"].empty()) continue;
        const Json& c = j["choices"][0];
        if (c["finish_reason"].is_string()) a.finish = c["finish_reason"];
        const Json& delta = c["delta"];
        if (delta.contains("content") && delta["content"].is_string()) {
          a.content += delta["content"].get<std::string>();
        }
        if (delta.contains("tool_calls")) {
          const Json& call = delta["tool_calls"][0];
          if (call["function"].contains("name")) a.name += call["function"]["name"];
          if (call["function"].contains("arguments")) {
            a.arguments += call["function"]["arguments"].get<std::string>();
          }
        }
      }
      return a;
    }
    const Json c = Json::parse(body)["choices"][0];
    a.finish = c["finish_reason"];
    if (c["message"]["content"].is_string()) a.content = c["message"]["content"];
    EXPECT_EQ(c["message"]["tool_calls"].size(), 1u) << c;
    if (c["message"]["tool_calls"].size() != 1) return a;
    a.name = c["message"]["tool_calls"][0]["function"]["name"];
    a.arguments = c["message"]["tool_calls"][0]["function"]["arguments"];
    return a;
  }

  std::unique_ptr<Tokenizer> tokenizer_;
  std::optional<ChatTemplate> template_;
  Link link_;
  std::unique_ptr<Completions> completions_;
  std::unique_ptr<FakeLeader> leader_;
  SamplingParams last_sampling_;  // The last request's, as the leader got it.
  std::vector<int32_t> last_prompt_;
};

const char kHarmonyAnswer[] =
    "<|channel|>analysis<|message|>The river starts high.<|end|><|start|>assistant"
    "<|channel|>final<|message|>The river starts in the hills.<|return|>";

TEST_F(HarmonyCompletionsTest, AnalysisIsReasoningContentInWholeAnswers) {
  const Json body = {{"model", "gpt-oss"},
                     {"messages", {{{"role", "user"}, {"content", "Where?"}}}},
                     {"max_tokens", 64}};
  auto rec = Run(body, kHarmonyAnswer);
  ASSERT_EQ(rec->status(), 200) << rec->body();
  const Json j = Json::parse(rec->body());
  const Json& message = j["choices"][0]["message"];
  EXPECT_EQ(message["content"], "The river starts in the hills.") << j.dump();
  EXPECT_EQ(message["reasoning_content"], "The river starts high.") << j.dump();
}

// Structured output on gpt-oss: the analysis channel stays free and the final channel's message
// is constrained: the constraint starts after the header <|channel|>final<|message|>. Without
// structured output nothing is armed.
TEST_F(HarmonyCompletionsTest, StructuredOutputConstrainsTheFinalChannelOnly) {
  std::vector<int32_t> header = {*tokenizer_->TokenToId("<|channel|>")};
  auto final_ids = tokenizer_->Encode("final", false);
  ASSERT_TRUE(final_ids.ok());
  header.insert(header.end(), final_ids->begin(), final_ids->end());
  header.push_back(*tokenizer_->TokenToId("<|message|>"));
  for (const Json& format :
       {Json{{"response_format", {{"type", "json_object"}}}},
        Json{{"response_format",
              {{"type", "json_schema"},
               {"json_schema",
                {{"name", "a"},
                 {"schema",
                  {{"type", "object"}, {"properties", {{"a", {{"type", "integer"}}}}}}}}}}}},
        Json{{"guided_regex", "[a-z]+"}}}) {
    SCOPED_TRACE(format.dump());
    Json body = {{"model", "gpt-oss"},
                 {"messages", {{{"role", "user"}, {"content", "Where?"}}}},
                 {"max_tokens", 64}};
    body.update(format);
    const bool regex = format.contains("guided_regex");
    auto rec = Run(body, regex ? "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant"
                                 "<|channel|>final<|message|>hills<|return|>"
                               : "<|channel|>analysis<|message|>Think.<|end|><|start|>assistant"
                                 "<|channel|>final<|message|>{\"a\": 1}<|return|>");
    ASSERT_EQ(rec->status(), 200) << rec->body();
    EXPECT_EQ(last_sampling_.constrain_after, header);
    EXPECT_TRUE(!last_sampling_.json_schema.empty() || !last_sampling_.grammar.empty());
    const Json message = Json::parse(rec->body())["choices"][0]["message"];
    EXPECT_EQ(message["reasoning_content"], "Think.") << message;
    EXPECT_EQ(message["content"], regex ? "hills" : "{\"a\": 1}") << message;
  }
  const Json plain = {{"model", "gpt-oss"},
                      {"messages", {{{"role", "user"}, {"content", "Where?"}}}},
                      {"max_tokens", 64}};
  ASSERT_EQ(Run(plain, kHarmonyAnswer)->status(), 200);
  EXPECT_TRUE(last_sampling_.constrain_after.empty());
}

// A forced call on gpt-oss: the call's header (as the chat template writes a past call) is
// prefilled after the generation prompt, the arguments are decoded under the function's
// parameters from the first token, and they come back as the call, whole or streamed. A named
// function and "required" with one tool force it; a name the header cannot carry and a function
// not in tools are refused.
TEST_F(HarmonyCompletionsTest, AForcedCallPrefillsItsHeaderAndDecodesTheArguments) {
  const Json weather = WeatherTool(), clock = ClockTool();
  const Json messages = {{{"role", "user"}, {"content", "Weather in Paris?"}}};
  // The header's ids, and the prompt without it (a tool_choice "auto" request's).
  auto recipient = tokenizer_->Encode(" to=functions.get_weather", false);
  auto kind = tokenizer_->Encode("commentary json", false);
  ASSERT_TRUE(recipient.ok() && kind.ok());
  std::vector<int32_t> header = recipient.value();
  header.push_back(tokenizer_->TokenToId("<|channel|>").value());
  header.insert(header.end(), kind.value().begin(), kind.value().end());
  header.push_back(tokenizer_->TokenToId("<|message|>").value());
  ASSERT_EQ(Run({{"model", "gpt-oss"},
                 {"messages", messages},
                 {"tools", {weather, clock}},
                 {"max_tokens", 64}},
                kHarmonyAnswer)
                ->status(),
            200);
  const std::vector<int32_t> plain = last_prompt_;
  std::vector<int32_t> want = plain;
  want.insert(want.end(), header.begin(), header.end());

  const Json named = {{"type", "function"}, {"function", {{"name", "get_weather"}}}};
  for (const auto& [tools, choice] :
       {std::pair{Json{weather, clock}, named}, std::pair{Json{weather}, Json("required")}}) {
    for (bool stream : {false, true}) {
      SCOPED_TRACE(choice.dump() + (stream ? " stream" : ""));
      Json body = {{"model", "gpt-oss"},
                   {"messages", messages},
                   {"tools", tools},
                   {"tool_choice", choice},
                   {"max_tokens", 64}};
      if (stream) body["stream"] = true;
      auto rec = Run(body, "{\"city\": \"Paris\"}<|call|>");
      ASSERT_EQ(rec->status(), 200) << rec->body();
      EXPECT_EQ(last_prompt_, want);
      EXPECT_TRUE(last_sampling_.constrain_after.empty());
      ASSERT_FALSE(last_sampling_.json_schema.empty());
      EXPECT_EQ(Json::parse(last_sampling_.json_schema)["required"], Json({"city"}));
      const Answered a = CallOf(rec->body(), stream);
      EXPECT_EQ(a.name, "get_weather");
      EXPECT_EQ(Json::parse(a.arguments), Json({{"city", "Paris"}}));
      EXPECT_EQ(a.content, "");
      // As OpenAI's: a named function's call ends with "stop", a required one's "tool_calls".
      EXPECT_EQ(a.finish, choice.is_string() ? "tool_calls" : "stop");
      EXPECT_EQ(rec->body().find("<|"), std::string::npos) << rec->body();
    }
  }

  Json spaced = weather;
  spaced["function"]["name"] = "get weather";
  for (const auto& [tools, choice, says] :
       {std::tuple{Json{weather, spaced}, Json("required"), std::string("whitespace")},
        std::tuple{Json{spaced}, Json("required"), std::string("whitespace")},
        std::tuple{Json{clock}, named, std::string("not in 'tools'")}}) {
    SCOPED_TRACE(says);
    auto rec = std::make_shared<Recorder>();
    HttpRequest req;
    req.method = "POST";
    req.path = req.target = "/v1/chat/completions";
    req.body = Json{
        {"model", "gpt-oss"},
        {"messages", messages},
        {"tools", tools},
        {"tool_choice",
         choice}}.dump();
    completions_->HandleChat(req, rec);
    ASSERT_TRUE(WaitUntil([&] { return rec->done(); }));
    EXPECT_EQ(rec->status(), 400);
    const Json error = Json::parse(rec->body())["error"];
    EXPECT_EQ(error["param"], "tool_choice") << error;
    EXPECT_NE(error["message"].get<std::string>().find(says), std::string::npos) << error;
  }
}

// "required" with several tools on gpt-oss: nothing is prefilled; the answer must open with a
// call to one of them, header and all, its markers the special tokens themselves (a structural
// tag with token_ids, which the worker compiles), the arguments under that tool's parameters,
// then <|call|>; it comes back as the call, whole or streamed.
TEST_F(HarmonyCompletionsTest, RequiredWithSeveralToolsOpensWithACallToOneOfThem) {
  const Json weather = WeatherTool(), clock = ClockTool();
  const Json messages = {{{"role", "user"}, {"content", "Weather in Paris?"}}};
  ASSERT_EQ(Run({{"model", "gpt-oss"}, {"messages", messages}, {"max_tokens", 64}}, kHarmonyAnswer)
                ->status(),
            200);
  const std::vector<int32_t> plain = last_prompt_;
  const std::string answer =
      " to=functions.get_weather<|channel|>commentary json<|message|>{\"city\": \"Paris\"}<|call|>";
  for (bool stream : {false, true}) {
    SCOPED_TRACE(stream ? "stream" : "whole");
    Json body = {{"model", "gpt-oss"},
                 {"messages", messages},
                 {"tools", {weather, clock}},
                 {"tool_choice", "required"},
                 {"max_tokens", 64}};
    if (stream) body["stream"] = true;
    auto rec = Run(body, answer);
    ASSERT_EQ(rec->status(), 200) << rec->body();
    EXPECT_EQ(last_prompt_, plain);
    EXPECT_TRUE(last_sampling_.json_schema.empty());
    ASSERT_EQ(last_sampling_.grammar_syntax, GrammarSyntax::kStructuralTag);
    const Json spec = Json::parse(last_sampling_.grammar);
    for (const char* marker : {"<|channel|>", "<|message|>", "<|call|>"}) {
      EXPECT_EQ(spec["token_ids"][marker], tokenizer_->TokenToId(marker).value()) << marker;
    }
    ASSERT_EQ(spec["structures"].size(), 2u);
    // What the worker runs: the call with the special tokens themselves, and nothing else.
    auto grammar = CompileStructuralTag(last_sampling_.grammar);
    ASSERT_TRUE(grammar.ok()) << grammar.status().message();
    const auto bytes = [&](const char* marker) {
      return TokenTerminalBytes(tokenizer_->TokenToId(marker).value());
    };
    const std::string worker_answer = " to=functions.get_weather" + bytes("<|channel|>") +
                                      "commentary json" + bytes("<|message|>") +
                                      "{\"city\": \"Paris\"}" + bytes("<|call|>");
    GrammarMatcher m(*grammar);
    EXPECT_TRUE(m.Accept(worker_answer) && m.complete());
    GrammarMatcher spelled(*grammar);
    EXPECT_FALSE(spelled.Accept(answer));
    const Answered a = CallOf(rec->body(), stream);
    EXPECT_EQ(a.name, "get_weather");
    EXPECT_EQ(Json::parse(a.arguments), Json({{"city", "Paris"}}));
    EXPECT_EQ(a.content, "");
    EXPECT_EQ(a.finish, "tool_calls");
    EXPECT_EQ(rec->body().find("<|"), std::string::npos) << rec->body();
  }
}

TEST_F(HarmonyCompletionsTest, StreamsCarryReasoningAndContentDeltasWithoutMarkers) {
  const Json body = {{"model", "gpt-oss"},
                     {"messages", {{{"role", "user"}, {"content", "Where?"}}}},
                     {"max_tokens", 64},
                     {"stream", true}};
  auto rec = Run(body, kHarmonyAnswer);
  ASSERT_EQ(rec->status(), 200);
  std::string content, reasoning;
  bool role = false;
  for (const std::string& e : DataEvents(rec->body())) {
    if (e == "[DONE]") continue;
    const Json j = Json::parse(e);
    ASSERT_EQ(j["choices"].size(), 1u) << e;
    const Json& delta = j["choices"][0]["delta"];
    if (delta.contains("role")) role = true;
    if (delta.contains("content")) content += delta["content"].get<std::string>();
    if (delta.contains("reasoning_content")) {
      reasoning += delta["reasoning_content"].get<std::string>();
    }
  }
  EXPECT_TRUE(role);
  EXPECT_EQ(content, "The river starts in the hills.");
  EXPECT_EQ(reasoning, "The river starts high.");
  EXPECT_EQ(rec->body().find("<|"), std::string::npos) << rec->body();
}

// Reasoning models' chat answers (think_style): the thinking between <think> and </think> is
// reasoning_content, the rest content, whole and streamed, in both styles. The tokenizer is the
// Qwen3 fixture's (<think> and </think> are added tokens, not special), or a copy of it where they
// are special: the markers must still reach the splitter while <|endoftext|> stays skipped.
class ThinkCompletionsTest : public ::testing::Test {
 protected:
  void Start(ThinkStyle style, bool special_markers) {
    std::string dir = FMOE_SOURCE_DIR "/tests/fixtures/qwen3-moe-ref";
    if (special_markers) {
      std::ifstream in(dir + "/tokenizer.json");
      Json tok = Json::parse(in);
      for (Json& t : tok["added_tokens"]) {
        if (t["content"] == "<think>" || t["content"] == "</think>") t["special"] = true;
      }
      dir = ::testing::TempDir() + "/think-special-" + std::to_string(::getpid());
      std::filesystem::create_directories(dir);
      std::ofstream(dir + "/tokenizer.json") << tok.dump();
    }
    auto loaded = Tokenizer::Load(dir);
    if (special_markers) {
      std::error_code ec;
      std::filesystem::remove_all(dir, ec);  // Loaded: the copy is no longer read.
    }
    ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
    tokenizer_ = std::move(*loaded);
    ASSERT_EQ(tokenizer_->IsSpecial(*tokenizer_->TokenToId("<think>")), special_markers);
    CompletionsOptions options;
    options.model_name = "qwen3";
    options.context_length = 256;
    options.think_style = style;
    auto compiled = ChatTemplate::Compile(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
        "{% endfor %}<|im_start|>assistant\n");
    ASSERT_TRUE(compiled.ok()) << compiled.status().ToString();
    template_.emplace(std::move(*compiled));
    options.chat_template = &*template_;
    completions_ = std::make_unique<Completions>(options, *tokenizer_, *link_);
    leader_ = std::make_unique<FakeLeader>(link_.endpoint(), "g0", 0, 1);
    ASSERT_TRUE(leader_->Join());
    ASSERT_TRUE(WaitUntil([&] { return link_.Alive("g0", 1); }));
  }

  // The model's output `text` (markers spelled out) as the leader's tokens, then stop.
  std::shared_ptr<Recorder> Run(Json body, const std::string& text) {
    body["model"] = "qwen3";
    body["messages"] = {{{"role", "user"}, {"content", "Why is the sky blue?"}}};
    body["max_tokens"] = 64;
    auto rec = std::make_shared<Recorder>();
    HttpRequest req;
    req.method = "POST";
    req.path = req.target = "/v1/chat/completions";
    req.body = body.dump();
    completions_->HandleChat(req, rec);
    if (rec->done()) return rec;  // Refused.
    auto gen = leader_->Next<Generate>();
    EXPECT_TRUE(gen);
    if (!gen) return rec;
    AnswerWithText(*leader_, *tokenizer_, gen->request_id, text);
    EXPECT_TRUE(WaitUntil([&] { return rec->done(); }));
    return rec;
  }

  // A whole answer's message.
  Json Message(const std::shared_ptr<Recorder>& rec) {
    EXPECT_EQ(rec->status(), 200) << rec->body();
    const Json j = Json::parse(rec->body(), nullptr, false);
    return j.is_discarded() ? Json() : j["choices"][0]["message"];
  }

  // A stream's deltas joined: {content, reasoning_content}.
  std::pair<std::string, std::string> Streamed(const std::shared_ptr<Recorder>& rec) {
    EXPECT_EQ(rec->status(), 200) << rec->body();
    std::string content, reasoning;
    for (const std::string& e : DataEvents(rec->body())) {
      if (e == "[DONE]") continue;
      const Json j = Json::parse(e);
      const Json& delta = j["choices"][0]["delta"];
      if (delta.contains("content")) content += delta["content"].get<std::string>();
      if (delta.contains("reasoning_content")) {
        reasoning += delta["reasoning_content"].get<std::string>();
      }
    }
    return {content, reasoning};
  }

  std::unique_ptr<Tokenizer> tokenizer_;
  std::optional<ChatTemplate> template_;
  Link link_;
  std::unique_ptr<Completions> completions_;
  std::unique_ptr<FakeLeader> leader_;
};

const char kQwen3Answer[] = "<think>\nShort light scatters more.\n</think>\n\nRayleigh scattering.";

// chat_template_kwargs reach the model's template: Qwen3's own template closes the thinking in
// the prompt when enable_thinking is false. Reserved names and bad shapes are refused by name.
TEST_F(ThinkCompletionsTest, ChatTemplateKwargsReachTheTemplate) {
  Start(ThinkStyle::kOpensThinking, false);
  std::ifstream in(FMOE_SOURCE_DIR "/tests/fixtures/qwen3-moe-ref/tokenizer_config.json");
  auto qwen3 = ChatTemplate::Compile(Json::parse(in)["chat_template"].get<std::string>());
  ASSERT_TRUE(qwen3.ok()) << qwen3.status().ToString();
  template_.emplace(std::move(*qwen3));
  auto prompt_of = [&](const Json& extra) {
    Json body = {{"model", "qwen3"},
                 {"messages", {{{"role", "user"}, {"content", "Why is the sky blue?"}}}},
                 {"max_tokens", 4}};
    for (auto it = extra.begin(); it != extra.end(); ++it) body[it.key()] = it.value();
    HttpRequest req;
    req.method = "POST";
    req.path = req.target = "/v1/chat/completions";
    req.body = body.dump();
    auto rec = std::make_shared<Recorder>();
    completions_->HandleChat(req, rec);
    if (rec->done()) return "refused " + std::to_string(rec->status()) + ": " + rec->body();
    auto gen = leader_->Next<Generate>();
    EXPECT_TRUE(gen);
    if (!gen) return std::string();
    AnswerWithText(*leader_, *tokenizer_, gen->request_id, "ok");
    EXPECT_TRUE(WaitUntil([&] { return rec->done(); }));
    return tokenizer_->Decode(gen->token_ids, false);
  };
  const std::string plain = prompt_of(Json::object());
  const std::string off = prompt_of({{"chat_template_kwargs", {{"enable_thinking", false}}}});
  const std::string on = prompt_of({{"chat_template_kwargs", {{"enable_thinking", true}}}});
  EXPECT_EQ(plain.find("<think>"), std::string::npos) << plain;
  EXPECT_EQ(on, plain);
  EXPECT_EQ(off, plain + "<think>\n\n</think>\n\n");
  for (const auto& [kwargs, message] : std::vector<std::pair<Json, std::string>>{
           {Json::array(), "'chat_template_kwargs' must be an object"},
           {{{"messages", Json::array()}}, "'chat_template_kwargs.messages' is set by the server"},
           {{{"add_generation_prompt", false}},
            "'chat_template_kwargs.add_generation_prompt' is set by the server"}}) {
    const std::string refused = prompt_of({{"chat_template_kwargs", kwargs}});
    EXPECT_EQ(refused.rfind("refused 400", 0), 0u) << refused;
    EXPECT_NE(refused.find(message), std::string::npos) << refused;
  }
}

// Structured output on a model that opens its thinking itself (qwen3): constrained after
// </think>, unless the prompt closed the thinking already (enable_thinking false), when the
// answer is constrained from its first token and is all content.
TEST_F(ThinkCompletionsTest, StructuredOutputStartsAfterTheThinkingUnlessThePromptClosedIt) {
  Start(ThinkStyle::kOpensThinking, /*special_markers=*/true);
  std::ifstream in(FMOE_SOURCE_DIR "/tests/fixtures/qwen3-moe-ref/tokenizer_config.json");
  auto qwen3 = ChatTemplate::Compile(Json::parse(in)["chat_template"].get<std::string>());
  ASSERT_TRUE(qwen3.ok()) << qwen3.status().ToString();
  template_.emplace(std::move(*qwen3));
  const int32_t end = *tokenizer_->TokenToId("</think>");
  auto constrain_after = [&](bool thinking, const std::string& answer, Json* message) {
    Json body = {{"model", "qwen3"},
                 {"messages", {{{"role", "user"}, {"content", "Why is the sky blue?"}}}},
                 {"max_tokens", 64},
                 {"response_format", {{"type", "json_object"}}},
                 {"chat_template_kwargs", {{"enable_thinking", thinking}}}};
    HttpRequest req;
    req.method = "POST";
    req.path = req.target = "/v1/chat/completions";
    req.body = body.dump();
    auto rec = std::make_shared<Recorder>();
    completions_->HandleChat(req, rec);
    auto gen = leader_->Next<Generate>();
    EXPECT_TRUE(gen);
    if (!gen) return std::vector<int32_t>{-2};
    AnswerWithText(*leader_, *tokenizer_, gen->request_id, answer);
    EXPECT_TRUE(WaitUntil([&] { return rec->done(); }));
    *message = Json::parse(rec->body())["choices"][0]["message"];
    return gen->sampling.constrain_after;
  };
  Json message;
  EXPECT_EQ(constrain_after(true, "<think>\nhm\n</think>\n\n{}", &message), std::vector{end});
  EXPECT_EQ(message["reasoning_content"], "\nhm\n") << message;
  EXPECT_EQ(message["content"], "\n\n{}") << message;
  EXPECT_TRUE(constrain_after(false, "{}", &message).empty());
  EXPECT_EQ(message["content"], "{}") << message;
}

TEST_F(ThinkCompletionsTest, Qwen3ThinkingIsReasoningContentInWholeAnswers) {
  Start(ThinkStyle::kOpensThinking, /*special_markers=*/false);
  const Json message = Message(Run(Json::object(), kQwen3Answer));
  EXPECT_EQ(message["reasoning_content"], "\nShort light scatters more.\n") << message;
  EXPECT_EQ(message["content"], "\n\nRayleigh scattering.") << message;
  // Thinking switched off: no markers, all content, no reasoning_content.
  const Json plain = Message(Run(Json::object(), "Rayleigh scattering."));
  EXPECT_EQ(plain["content"], "Rayleigh scattering.") << plain;
  EXPECT_TRUE(plain["reasoning_content"].is_null()) << plain;
}

TEST_F(ThinkCompletionsTest, Qwen3StreamsReasoningAndContentDeltasWithoutMarkers) {
  Start(ThinkStyle::kOpensThinking, /*special_markers=*/false);
  auto rec = Run({{"stream", true}}, kQwen3Answer);
  const auto [content, reasoning] = Streamed(rec);
  EXPECT_EQ(reasoning, "\nShort light scatters more.\n");
  EXPECT_EQ(content, "\n\nRayleigh scattering.");
  EXPECT_EQ(rec->body().find("think>"), std::string::npos) << rec->body();
}

TEST_F(ThinkCompletionsTest, DeepSeekR1StartsInsideTheThinkingWithSpecialMarkers) {
  // The prompt opened the thinking: only </think> comes; the markers are special tokens, and
  // the other special tokens (<|endoftext|> here) are still not shown.
  Start(ThinkStyle::kStartsThinking, /*special_markers=*/true);
  const std::string answer = "Blue is short.<|endoftext|></think>Rayleigh.";
  const Json message = Message(Run(Json::object(), answer));
  EXPECT_EQ(message["reasoning_content"], "Blue is short.") << message;
  EXPECT_EQ(message["content"], "Rayleigh.") << message;
  const auto [content, reasoning] = Streamed(Run({{"stream", true}}, answer));
  EXPECT_EQ(reasoning, "Blue is short.");
  EXPECT_EQ(content, "Rayleigh.");
  // Cut short before </think>: all of it is reasoning.
  const Json cut = Message(Run(Json::object(), "Blue is"));
  EXPECT_EQ(cut["reasoning_content"], "Blue is") << cut;
  EXPECT_EQ(cut["content"], "") << cut;
}

TEST_F(ThinkCompletionsTest, IncludeReasoningFalseDropsIt) {
  Start(ThinkStyle::kOpensThinking, /*special_markers=*/true);
  const Json message = Message(Run({{"include_reasoning", false}}, kQwen3Answer));
  EXPECT_TRUE(message["reasoning_content"].is_null()) << message;
  EXPECT_EQ(message["content"], "\n\nRayleigh scattering.") << message;
  auto rec = Run({{"include_reasoning", false}, {"stream", true}}, kQwen3Answer);
  const auto [content, reasoning] = Streamed(rec);
  EXPECT_EQ(reasoning, "");
  EXPECT_EQ(content, "\n\nRayleigh scattering.");
  EXPECT_EQ(rec->body().find("reasoning_content"), std::string::npos) << rec->body();
  // Not a boolean: refused by name.
  auto bad = Run({{"include_reasoning", "no"}}, kQwen3Answer);
  EXPECT_EQ(bad->status(), 400) << bad->body();
  EXPECT_NE(bad->body().find("include_reasoning"), std::string::npos) << bad->body();
}

// Tool calling in chat (tools, tool_choice): the request's tools and the history's calls and
// results go through the model's own template (Qwen3's here), and the answer is parsed into
// tool_calls in the model's format (hermes), whole and streamed, after the thinking is split
// off; finish_reason "tool_calls". What needs constrained decoding is refused by name.
class ToolCompletionsTest : public ::testing::Test {
 protected:
  void Start(ToolCallFormat format, bool think, ThinkStyle style = ThinkStyle::kOpensThinking) {
    auto loaded = Tokenizer::Load(FMOE_SOURCE_DIR "/tests/fixtures/qwen3-moe-ref");
    ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
    tokenizer_ = std::move(*loaded);
    CompletionsOptions options;
    options.model_name = "qwen3";
    options.context_length = 1024;
    options.tool_call_format = format;
    if (think) options.think_style = style;
    std::ifstream in(FMOE_SOURCE_DIR "/tests/fixtures/chat_templates/qwen3_30b_a3b.json");
    const Json fixture = Json::parse(in);
    auto compiled = ChatTemplate::Compile(fixture["template"].get<std::string>());
    ASSERT_TRUE(compiled.ok()) << compiled.status().ToString();
    template_.emplace(std::move(*compiled));
    options.chat_template = &*template_;
    completions_ = std::make_unique<Completions>(options, *tokenizer_, *link_);
    leader_ = std::make_unique<FakeLeader>(link_.endpoint(), "g0", 0, 1);
    ASSERT_TRUE(leader_->Join());
    ASSERT_TRUE(WaitUntil([&] { return link_.Alive("g0", 1); }));
  }

  static Json Tools() {
    return Json::array({{{"type", "function"},
                         {"function",
                          {{"name", "get_weather"},
                           {"description", "The weather in a city"},
                           {"parameters",
                            {{"type", "object"},
                             {"properties", {{"city", {{"type", "string"}}}}},
                             {"required", {"city"}}}}}}}});
  }

  // A chat request, answered by Answer.
  std::shared_ptr<Recorder> Run(Json body, const std::string& text, std::string* prompt = nullptr) {
    if (!body.contains("messages")) {
      body["messages"] = {{{"role", "user"}, {"content", "Weather in Paris?"}}};
    }
    body["max_tokens"] = 128;
    return Answer("/v1/chat/completions", std::move(body), text, prompt);
  }

  // A Messages API request (POST /v1/messages), answered as Run answers.
  std::shared_ptr<Recorder> RunMessages(Json body, const std::string& text,
                                        std::string* prompt = nullptr) {
    if (!body.contains("max_tokens")) body["max_tokens"] = 128;
    if (!body.contains("messages")) {
      body["messages"] = {{{"role", "user"}, {"content", "Weather in Paris?"}}};
    }
    return Answer("/v1/messages", std::move(body), text, prompt);
  }

  // Sends `body` to `path`; the leader answers with the model's output `text` as its tokens,
  // then stop. `prompt` receives the prompt the router rendered.
  std::shared_ptr<Recorder> Answer(const std::string& path, Json body, const std::string& text,
                                   std::string* prompt = nullptr) {
    body["model"] = "qwen3";
    auto rec = std::make_shared<Recorder>();
    HttpRequest req;
    req.method = "POST";
    req.path = req.target = path;
    req.body = body.dump();
    if (path == "/v1/messages") {
      completions_->HandleMessages(req, rec);
    } else if (path == "/v1/responses") {
      completions_->HandleResponses(req, rec);
    } else {
      completions_->HandleChat(req, rec);
    }
    if (rec->done()) return rec;  // Refused.
    auto gen = leader_->Next<Generate>();
    EXPECT_TRUE(gen);
    if (!gen) return rec;
    if (prompt != nullptr) *prompt = tokenizer_->Decode(gen->token_ids, false);
    last_schema_ = gen->sampling.json_schema;
    last_grammar_ = gen->sampling.grammar;
    last_syntax_ = gen->sampling.grammar_syntax;
    last_constrain_after_ = gen->sampling.constrain_after;
    AnswerWithText(*leader_, *tokenizer_, gen->request_id, text);
    EXPECT_TRUE(WaitUntil([&] { return rec->done(); }));
    return rec;
  }

  // A Messages stream's events: (event name, data).
  static std::vector<std::pair<std::string, Json>> Events(const std::string& sse) {
    std::vector<std::pair<std::string, Json>> out;
    for (size_t at = 0; (at = sse.find("event: ", at)) != std::string::npos;) {
      const size_t nl = sse.find('\n', at);
      const size_t data = sse.find("data: ", nl);
      const size_t end = sse.find("\n\n", data);
      if (nl == std::string::npos || data == std::string::npos || end == std::string::npos) break;
      out.emplace_back(sse.substr(at + 7, nl - at - 7),
                       Json::parse(sse.substr(data + 6, end - data - 6)));
      at = end;
    }
    return out;
  }

  std::unique_ptr<Tokenizer> tokenizer_;
  std::optional<ChatTemplate> template_;
  Link link_;
  std::unique_ptr<Completions> completions_;
  std::unique_ptr<FakeLeader> leader_;
  std::string last_schema_;   // The last request's sampling.json_schema.
  std::string last_grammar_;  // Its sampling.grammar and grammar_syntax.
  GrammarSyntax last_syntax_ = GrammarSyntax::kGbnf;
  std::vector<int32_t> last_constrain_after_;  // Its sampling.constrain_after.
};

const char kCallAnswer[] =
    "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": "
    "\"Paris\"}}\n</tool_call>";

TEST_F(ToolCompletionsTest, WholeAnswersCarryToolCalls) {
  Start(ToolCallFormat::kHermes, /*think=*/false);
  std::string prompt;
  auto rec = Run({{"tools", Tools()}}, kCallAnswer, &prompt);
  ASSERT_EQ(rec->status(), 200) << rec->body();
  EXPECT_NE(prompt.find("<tools>"), std::string::npos) << prompt;
  EXPECT_NE(prompt.find("\"get_weather\""), std::string::npos) << prompt;
  const Json choice = Json::parse(rec->body())["choices"][0];
  EXPECT_EQ(choice["finish_reason"], "tool_calls");
  const Json& message = choice["message"];
  EXPECT_EQ(message["content"], "Let me check.\n") << message;
  ASSERT_EQ(message["tool_calls"].size(), 1u) << message;
  const Json& call = message["tool_calls"][0];
  EXPECT_EQ(call["type"], "function");
  EXPECT_TRUE(call["id"].get<std::string>().starts_with("call_")) << call;
  EXPECT_EQ(call["function"]["name"], "get_weather");
  EXPECT_EQ(Json::parse(call["function"]["arguments"].get<std::string>()),
            Json({{"city", "Paris"}}));
  // Without a call the answer is plain content and stops as usual.
  rec = Run({{"tools", Tools()}}, "It is sunny.");
  const Json plain = Json::parse(rec->body())["choices"][0];
  EXPECT_EQ(plain["finish_reason"], "stop");
  EXPECT_EQ(plain["message"]["content"], "It is sunny.");
  EXPECT_FALSE(plain["message"].contains("tool_calls")) << plain;
}

TEST_F(ToolCompletionsTest, StreamsCarryToolCallDeltas) {
  Start(ToolCallFormat::kHermes, /*think=*/false);
  auto rec = Run({{"tools", Tools()}, {"stream", true}}, kCallAnswer);
  ASSERT_EQ(rec->status(), 200) << rec->body();
  std::string content, arguments, name, finish;
  size_t call_deltas = 0;
  for (const std::string& e : DataEvents(rec->body())) {
    if (e == "[DONE]") continue;
    const Json j = Json::parse(e);
    const Json& c = j["choices"][0];
    if (c["finish_reason"].is_string()) finish = c["finish_reason"];
    const Json& delta = c["delta"];
    if (delta.contains("content") && delta["content"].is_string()) content += delta["content"];
    if (!delta.contains("tool_calls")) continue;
    for (const Json& t : delta["tool_calls"]) {
      ++call_deltas;
      EXPECT_EQ(t["index"], 0);
      if (t["function"].contains("name")) name += t["function"]["name"].get<std::string>();
      arguments += t["function"]["arguments"].get<std::string>();
    }
  }
  EXPECT_EQ(content, "Let me check.\n");
  EXPECT_EQ(call_deltas, 1u);
  EXPECT_EQ(name, "get_weather");
  EXPECT_EQ(Json::parse(arguments), Json({{"city", "Paris"}}));
  EXPECT_EQ(finish, "tool_calls");
  EXPECT_EQ(rec->body().find("<tool_call>"), std::string::npos) << rec->body();
}

TEST_F(ToolCompletionsTest, ThinkingIsSplitOffBeforeCallsAreParsed) {
  Start(ToolCallFormat::kHermes, /*think=*/true);
  auto rec = Run({{"tools", Tools()}}, std::string("<think>Call it.</think>") + kCallAnswer);
  ASSERT_EQ(rec->status(), 200) << rec->body();
  const Json body = Json::parse(rec->body());
  const Json& message = body["choices"][0]["message"];
  EXPECT_EQ(message["reasoning_content"], "Call it.") << message;
  ASSERT_EQ(message["tool_calls"].size(), 1u) << message;
  EXPECT_EQ(message["tool_calls"][0]["function"]["name"], "get_weather");
}

TEST_F(ToolCompletionsTest, HistoryWithCallsAndResultsRendersThroughTheTemplate) {
  Start(ToolCallFormat::kHermes, /*think=*/false);
  const Json messages = {
      {{"role", "user"}, {"content", "Weather in Paris?"}},
      {{"role", "assistant"},
       {"content", nullptr},
       {"tool_calls",
        {{{"id", "call_1"},
          {"type", "function"},
          {"function", {{"name", "get_weather"}, {"arguments", "{\"city\": \"Paris\"}"}}}}}}},
      {{"role", "tool"}, {"tool_call_id", "call_1"}, {"content", "{\"temp\": 22}"}}};
  std::string prompt;
  auto rec = Run({{"tools", Tools()}, {"messages", messages}}, "It is 22.", &prompt);
  ASSERT_EQ(rec->status(), 200) << rec->body();
  EXPECT_NE(prompt.find("<tool_response>\n{\"temp\": 22}\n</tool_response>"), std::string::npos)
      << prompt;
  EXPECT_NE(prompt.find("{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}"),
            std::string::npos)
      << prompt;
}

TEST_F(ToolCompletionsTest, ToolChoiceNoneRequiredAndBadToolsAreHandledByName) {
  Start(ToolCallFormat::kHermes, /*think=*/false);
  // none: the tools are rendered, the answer is not parsed.
  auto rec = Run({{"tools", Tools()}, {"tool_choice", "none"}}, kCallAnswer);
  ASSERT_EQ(rec->status(), 200) << rec->body();
  const Json none = Json::parse(rec->body())["choices"][0];
  EXPECT_EQ(none["finish_reason"], "stop");
  EXPECT_NE(none["message"]["content"].get<std::string>().find("<tool_call>"), std::string::npos);
  for (const Json& choice :
       {Json("requird"), Json({{"type", "function"}, {"function", {{"name", "get_weathr"}}}}),
        Json({{"type", "function"}})}) {
    rec = Run({{"tools", Tools()}, {"tool_choice", choice}}, "");
    EXPECT_EQ(rec->status(), 400) << rec->body();
    EXPECT_EQ(Json::parse(rec->body())["error"]["param"], "tool_choice") << rec->body();
  }
  rec = Run({{"tools", Json::array({{{"type", "function"}, {"function", {{"name", 7}}}}})}}, "");
  EXPECT_EQ(rec->status(), 400) << rec->body();
  EXPECT_EQ(Json::parse(rec->body())["error"]["param"], "tools") << rec->body();
  rec = Run({{"tool_choice", "auto"}}, "");
  EXPECT_EQ(rec->status(), 400) << "tool_choice without tools: " << rec->body();
  const Json bad_call = {
      {{"role", "assistant"},
       {"tool_calls", {{{"function", {{"name", "f"}, {"arguments", "{oops"}}}}}}},
      {{"role", "user"}, {"content", "x"}}};
  rec = Run({{"messages", bad_call}}, "");
  EXPECT_EQ(rec->status(), 400) << rec->body();
  EXPECT_NE(rec->body().find("messages[0].tool_calls[0].function.arguments"), std::string::npos)
      << rec->body();
}

// ---- stop strings: matched by the router alone, which cancels the worker request ----

// The tokens of `text`, and how many of the first ones it takes for their text to hold `stop`
// after the first `skip` tokens' text (0: never).
struct StopTokens {
  std::vector<int32_t> ids;
  size_t through = 0;
};
StopTokens TokensTo(const Tokenizer& tokenizer, const std::string& text, const std::string& stop,
                    size_t skip = 0) {
  StopTokens out;
  auto ids = tokenizer.Encode(text, /*add_special_tokens=*/false);
  EXPECT_TRUE(ids.ok());
  if (!ids.ok()) return out;
  out.ids = *ids;
  const size_t from = tokenizer.Decode(std::span<const int32_t>(out.ids.data(), skip), true).size();
  for (size_t k = skip + 1; k <= out.ids.size() && out.through == 0; ++k) {
    const std::string prefix = tokenizer.Decode(std::span<const int32_t>(out.ids.data(), k), true);
    if (prefix.find(stop, from) != std::string::npos) out.through = k;
  }
  return out;
}

// Sends `ids` as request `id`'s tokens, from `from` up to (not including) `to`.
void SendTokens(FakeLeader& leader, uint64_t id, const std::vector<int32_t>& ids, size_t from,
                size_t to) {
  for (size_t i = from; i < to && i < ids.size(); ++i) {
    TokenEvent ev = Token(id, ids[i]);
    ev.index = static_cast<uint32_t>(i);
    leader.Send(ev);
  }
}

// The choice ends at the token that completes the stop string, before the worker says anything
// more: the text is cut before it, finish_reason is "stop", the usage counts the tokens through
// that one, the worker request gets a Cancel, and what the worker sends afterwards is ignored.
TEST_F(CompletionsTest, AStopStringEndsTheChoiceAndCancelsItsWorkerRequest) {
  const StopTokens t = TokensTo(*tokenizer_, "Sunny and warm, and dry.", " and");
  ASSERT_GT(t.through, 0u);
  ASSERT_LT(t.through, t.ids.size());
  for (bool stream : {false, true}) {
    SCOPED_TRACE(stream ? "stream" : "whole");
    auto rec = std::make_shared<Recorder>();
    HttpRequest req;
    req.method = "POST";
    req.path = req.target = "/v1/completions";
    req.body = Json({{"model", "tiny"},
                     {"prompt", "x"},
                     {"max_tokens", 1000},
                     {"stop", {" and", "never"}},
                     {"stream", stream},
                     {"stream_options", stream ? Json{{"include_usage", true}} : Json(nullptr)}})
                   .dump();
    completions_->Handle(req, rec);
    auto gen = leader_->Next<Generate>();
    ASSERT_TRUE(gen);
    EXPECT_TRUE(gen->sampling.stop.empty()) << "stop strings never go to the worker";
    SendTokens(*leader_, gen->request_id, t.ids, 0, t.through);
    // Done without a finish from the worker.
    ASSERT_TRUE(WaitUntil([&] { return rec->done(); })) << rec->body();
    auto cancel = leader_->Next<Cancel>();
    ASSERT_TRUE(cancel);
    EXPECT_EQ(cancel->request_id, gen->request_id);
    const std::string answer = rec->body();
    // What the worker had in flight, then its answer to the cancel: ignored.
    SendTokens(*leader_, gen->request_id, t.ids, t.through, t.ids.size());
    leader_->Send(Token(gen->request_id, -1, FinishReason::kCancelled));
    ASSERT_TRUE(leader_->Heartbeat());  // Everything sent before it was handled.
    EXPECT_EQ(rec->body(), answer);
    EXPECT_EQ(rec->status(), 200);
    std::string text;
    Json usage, finish;
    if (stream) {
      std::vector<std::string> events = DataEvents(answer);
      ASSERT_FALSE(events.empty());
      EXPECT_EQ(events.back(), "[DONE]");
      for (size_t e = 0; e + 1 < events.size(); ++e) {
        const Json chunk = Json::parse(events[e]);
        if (chunk.contains("usage") && chunk["usage"].is_object()) usage = chunk["usage"];
        if (chunk["choices"].empty()) continue;
        text += chunk["choices"][0]["text"].get<std::string>();
        if (!chunk["choices"][0]["finish_reason"].is_null()) {
          finish = chunk["choices"][0]["finish_reason"];
        }
      }
    } else {
      const Json j = Json::parse(answer);
      text = j["choices"][0]["text"];
      finish = j["choices"][0]["finish_reason"];
      usage = j["usage"];
    }
    EXPECT_EQ(text, "Sunny");
    EXPECT_EQ(finish, "stop");
    EXPECT_EQ(usage["completion_tokens"], t.through) << usage;
  }
}

// n > 1: each choice has its own stop; the one that meets it is cancelled alone, the other runs
// to its own end, and the usage adds the tokens each counted.
TEST_F(CompletionsTest, EachChoiceStopsOnItsOwn) {
  const StopTokens stops = TokensTo(*tokenizer_, "Rain and wind.", " and");
  const StopTokens runs = TokensTo(*tokenizer_, "Rain, then sun.", " and");
  ASSERT_GT(stops.through, 0u);
  ASSERT_EQ(runs.through, 0u);
  auto rec = std::make_shared<Recorder>();
  HttpRequest req;
  req.method = "POST";
  req.path = req.target = "/v1/completions";
  req.body =
      Json({{"model", "tiny"}, {"prompt", "x"}, {"max_tokens", 100}, {"n", 2}, {"stop", " and"}})
          .dump();
  completions_->Handle(req, rec);
  auto first = leader_->Next<Generate>();
  auto second = leader_->Next<Generate>();
  ASSERT_TRUE(first && second);
  SendTokens(*leader_, first->request_id, stops.ids, 0, stops.through);
  auto cancel = leader_->Next<Cancel>();
  ASSERT_TRUE(cancel);
  EXPECT_EQ(cancel->request_id, first->request_id);
  EXPECT_FALSE(rec->done()) << "the other choice still runs";
  SendTokens(*leader_, second->request_id, runs.ids, 0, runs.ids.size());
  leader_->Send(Token(second->request_id, -1, FinishReason::kLength));
  ASSERT_TRUE(WaitUntil([&] { return rec->done(); }));
  const Json j = Json::parse(rec->body());
  EXPECT_EQ(j["choices"][0]["text"], "Rain");
  EXPECT_EQ(j["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(j["choices"][1]["text"], "Rain, then sun.");
  EXPECT_EQ(j["choices"][1]["finish_reason"], "length");
  EXPECT_EQ(j["usage"]["completion_tokens"], stops.through + runs.ids.size());
}

// A stop string must lie wholly after the first min_tokens tokens' text: one that the first
// min_tokens tokens complete is not looked for (the next one is).
TEST_F(CompletionsTest, MinTokensHoldsOffStopStrings) {
  const std::string answer = "Snow and ice and fog.";
  const StopTokens first = TokensTo(*tokenizer_, answer, " and");
  ASSERT_GT(first.through, 0u);
  const StopTokens second = TokensTo(*tokenizer_, answer, " and", first.through);
  ASSERT_GT(second.through, first.through);
  auto rec = std::make_shared<Recorder>();
  HttpRequest req;
  req.method = "POST";
  req.path = req.target = "/v1/completions";
  req.body = Json({{"model", "tiny"},
                   {"prompt", "x"},
                   {"max_tokens", 100},
                   {"min_tokens", first.through},
                   {"stop", " and"}})
                 .dump();
  completions_->Handle(req, rec);
  auto gen = leader_->Next<Generate>();
  ASSERT_TRUE(gen);
  EXPECT_EQ(gen->sampling.min_tokens, first.through);
  SendTokens(*leader_, gen->request_id, first.ids, 0, second.through);
  ASSERT_TRUE(WaitUntil([&] { return rec->done(); }));
  auto cancel = leader_->Next<Cancel>();
  ASSERT_TRUE(cancel);
  const Json j = Json::parse(rec->body());
  EXPECT_EQ(j["choices"][0]["text"], "Snow and ice");
  EXPECT_EQ(j["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(j["usage"]["completion_tokens"], second.through);
}

// Chat streams end with the stop too, and the Messages API reports which stop sequence it was.
TEST_F(CompletionsTest, ChatAndMessagesStopAtTheRouter) {
  const StopTokens t = TokensTo(*tokenizer_, "Cold and grey.", " and");
  ASSERT_GT(t.through, 0u);
  for (const char* path : {"/v1/chat/completions", "/v1/messages"}) {
    SCOPED_TRACE(path);
    const bool messages = std::string(path) == "/v1/messages";
    auto rec = std::make_shared<Recorder>();
    HttpRequest req;
    req.method = "POST";
    req.path = req.target = path;
    Json body = {{"model", "tiny"},
                 {"messages", {{{"role", "user"}, {"content", "hi"}}}},
                 {"max_tokens", 100},
                 {"stream", true}};
    body[messages ? "stop_sequences" : "stop"] = Json::array({" and"});
    req.body = body.dump();
    if (messages) {
      completions_->HandleMessages(req, rec);
    } else {
      completions_->HandleChat(req, rec);
    }
    auto gen = leader_->Next<Generate>();
    ASSERT_TRUE(gen);
    EXPECT_TRUE(gen->sampling.stop.empty());
    SendTokens(*leader_, gen->request_id, t.ids, 0, t.through);
    ASSERT_TRUE(WaitUntil([&] { return rec->done(); })) << rec->body();
    auto cancel = leader_->Next<Cancel>();
    ASSERT_TRUE(cancel);
    EXPECT_EQ(cancel->request_id, gen->request_id);
    const std::string sse = rec->body();
    std::string text;
    for (const std::string& e : DataEvents(sse)) {
      if (e == "[DONE]") continue;
      const Json data = Json::parse(e);
      if (messages) {
        if (data["type"] == "content_block_delta" && data["delta"]["type"] == "text_delta") {
          text += data["delta"]["text"].get<std::string>();
        }
      } else if (!data["choices"].empty()) {
        text += data["choices"][0]["delta"].value("content", "");
      }
    }
    EXPECT_EQ(text, "Cold") << sse;
    if (messages) {
      EXPECT_NE(sse.find(R"("stop_reason":"stop_sequence")"), std::string::npos) << sse;
      EXPECT_NE(sse.find(R"("stop_sequence":" and")"), std::string::npos) << sse;
    } else {
      EXPECT_NE(sse.find(R"("finish_reason":"stop")"), std::string::npos) << sse;
      EXPECT_EQ(DataEvents(sse).back(), "[DONE]");
    }
  }
}

TEST(IgnoredFields, UnknownTopLevelFieldsAreListedKnownOnesNot) {
  auto tokenizer = Tokenizer::Load(FMOE_SOURCE_DIR "/deploy/models/tiny-moe");
  ASSERT_TRUE(tokenizer.ok());
  CompletionsOptions options;
  options.model_name = "tiny";
  options.context_length = 1024;
  HttpResponse error;
  auto parsed = ParseCompletionRequest(
      R"({"model": "tiny", "prompt": "x", "max_tokens": 2, "user": "u", "best_of": 1,
          "my_extension": true, "priority": 3})",
      options, **tokenizer, &error);
  ASSERT_TRUE(parsed.ok()) << error.body;
  EXPECT_EQ(parsed->ignored_fields, (std::vector<std::string>{"my_extension", "priority"}));
}

TEST_F(ToolCompletionsTest, AModelWithoutAFormatRefusesAutoButRendersNone) {
  Start(ToolCallFormat::kNone, /*think=*/false);
  auto rec = Run({{"tools", Tools()}}, "");
  EXPECT_EQ(rec->status(), 400) << rec->body();
  EXPECT_EQ(Json::parse(rec->body())["error"]["param"], "tools") << rec->body();
  rec = Run({{"tools", Tools()}, {"tool_choice", "none"}}, "Sunny.");
  EXPECT_EQ(rec->status(), 200) << rec->body();
}

// Anthropic's Messages API: the request as the chat it means (system, blocks, tools, results),
// the answer as content blocks with stop_reason and usage, and the streamed event sequence.
TEST_F(ToolCompletionsTest, MessagesAnswerWithContentBlocks) {
  Start(ToolCallFormat::kHermes, /*think=*/false);
  std::string prompt;
  auto rec = RunMessages({{"system", "Be brief."}}, "Sunny and 22.", &prompt);
  ASSERT_EQ(rec->status(), 200) << rec->body();
  EXPECT_NE(prompt.find("Be brief."), std::string::npos) << prompt;
  const Json m = Json::parse(rec->body());
  EXPECT_EQ(m["type"], "message");
  EXPECT_EQ(m["role"], "assistant");
  EXPECT_TRUE(m["id"].get<std::string>().starts_with("msg_")) << m;
  EXPECT_EQ(m["content"], Json::array({{{"type", "text"}, {"text", "Sunny and 22."}}})) << m;
  EXPECT_EQ(m["stop_reason"], "end_turn");
  EXPECT_TRUE(m["stop_sequence"].is_null());
  EXPECT_GT(m["usage"]["input_tokens"].get<int>(), 0);
  EXPECT_GT(m["usage"]["output_tokens"].get<int>(), 0);
  // A stop sequence.
  rec = RunMessages({{"stop_sequences", {" and"}}}, "Sunny and 22.");
  const Json s = Json::parse(rec->body());
  EXPECT_EQ(s["content"][0]["text"], "Sunny") << s;
  EXPECT_EQ(s["stop_reason"], "stop_sequence");
  EXPECT_EQ(s["stop_sequence"], " and");
}

TEST_F(ToolCompletionsTest, MessagesStreamTheEventSequence) {
  Start(ToolCallFormat::kHermes, /*think=*/true);
  auto rec = RunMessages(
      {{"stream", true},
       {"tools",
        {{{"name", "get_weather"}, {"input_schema", Tools()[0]["function"]["parameters"]}}}}},
      std::string("<think>Call it.</think>") + kCallAnswer);
  ASSERT_EQ(rec->status(), 200) << rec->body();
  std::vector<std::string> names;
  std::string thinking, text, json;
  std::vector<std::string> block_types;
  Json last_delta;
  for (const auto& [name, data] : Events(rec->body())) {
    names.push_back(name);
    EXPECT_EQ(data["type"], name);
    if (name == "content_block_start") block_types.push_back(data["content_block"]["type"]);
    if (name == "content_block_delta") {
      const Json& d = data["delta"];
      if (d["type"] == "thinking_delta") thinking += d["thinking"].get<std::string>();
      if (d["type"] == "text_delta") text += d["text"].get<std::string>();
      if (d["type"] == "input_json_delta") json += d["partial_json"].get<std::string>();
    }
    if (name == "message_delta") last_delta = data;
  }
  ASSERT_FALSE(names.empty()) << rec->body();
  EXPECT_EQ(names.front(), "message_start");
  EXPECT_EQ(names.back(), "message_stop");
  EXPECT_EQ(block_types, (std::vector<std::string>{"thinking", "text", "tool_use"}));
  EXPECT_EQ(thinking, "Call it.");
  EXPECT_EQ(text, "Let me check.\n");
  EXPECT_EQ(Json::parse(json), Json({{"city", "Paris"}}));
  EXPECT_EQ(last_delta["delta"]["stop_reason"], "tool_use") << last_delta;
  EXPECT_GT(last_delta["usage"]["output_tokens"].get<int>(), 0);
  EXPECT_EQ(rec->body().find("[DONE]"), std::string::npos);
}

TEST_F(ToolCompletionsTest, MessagesToolUseAndToolResults) {
  Start(ToolCallFormat::kHermes, /*think=*/false);
  const Json tools = {{{"name", "get_weather"},
                       {"description", "The weather in a city"},
                       {"input_schema", Tools()[0]["function"]["parameters"]}}};
  auto rec = RunMessages({{"tools", tools}}, kCallAnswer);
  ASSERT_EQ(rec->status(), 200) << rec->body();
  const Json m = Json::parse(rec->body());
  EXPECT_EQ(m["stop_reason"], "tool_use");
  ASSERT_EQ(m["content"].size(), 2u) << m;
  EXPECT_EQ(m["content"][1]["type"], "tool_use");
  EXPECT_EQ(m["content"][1]["name"], "get_weather");
  EXPECT_EQ(m["content"][1]["input"], Json({{"city", "Paris"}}));
  // The call and its result in the history reach the template.
  const Json history = {
      {{"role", "user"}, {"content", "Weather in Paris?"}},
      {{"role", "assistant"},
       {"content",
        {{{"type", "tool_use"},
          {"id", "t1"},
          {"name", "get_weather"},
          {"input", {{"city", "Paris"}}}}}}},
      {{"role", "user"},
       {"content", {{{"type", "tool_result"}, {"tool_use_id", "t1"}, {"content", "22 C"}}}}}};
  std::string prompt;
  rec = RunMessages({{"tools", tools}, {"messages", history}}, "It is 22.", &prompt);
  ASSERT_EQ(rec->status(), 200) << rec->body();
  EXPECT_NE(prompt.find("<tool_response>\n22 C\n</tool_response>"), std::string::npos) << prompt;
}

// Anthropic's tool_choice any / tool: the chat completion's "required" / named function.
TEST_F(ToolCompletionsTest, MessagesToolChoiceAnyAndToolDecodeUnderASchema) {
  Start(ToolCallFormat::kHermes, /*think=*/false);
  const Json params = Tools()[0]["function"]["parameters"];
  const Json tools = {{{"name", "get_weather"}, {"input_schema", params}}};
  auto rec = RunMessages({{"tools", tools}, {"tool_choice", {{"type", "any"}}}},
                         R"([{"name": "get_weather", "parameters": {"city": "Oslo"}}])");
  ASSERT_EQ(rec->status(), 200) << rec->body();
  Json m = Json::parse(rec->body());
  EXPECT_EQ(m["stop_reason"], "tool_use") << m;
  ASSERT_EQ(m["content"].size(), 1u) << m;
  EXPECT_EQ(m["content"][0]["input"], Json({{"city", "Oslo"}}));
  EXPECT_EQ(Json::parse(last_schema_)["type"], "array");
  rec =
      RunMessages({{"tools", tools}, {"tool_choice", {{"type", "tool"}, {"name", "get_weather"}}}},
                  R"({"city": "Rome"})");
  ASSERT_EQ(rec->status(), 200) << rec->body();
  m = Json::parse(rec->body());
  ASSERT_EQ(m["content"].size(), 1u) << m;
  EXPECT_EQ(m["content"][0]["name"], "get_weather");
  EXPECT_EQ(m["content"][0]["input"], Json({{"city", "Rome"}}));
  EXPECT_EQ(Json::parse(last_schema_), params);
}

TEST_F(ToolCompletionsTest, MessagesErrorsAreInTheMessagesShape) {
  Start(ToolCallFormat::kHermes, /*think=*/false);
  auto error_of = [](const std::shared_ptr<Recorder>& rec) {
    EXPECT_EQ(rec->status(), 400) << rec->body();
    const Json j = Json::parse(rec->body(), nullptr, false);
    EXPECT_EQ(j["type"], "error") << rec->body();
    EXPECT_EQ(j["error"]["type"], "invalid_request_error") << rec->body();
    return j["error"]["message"].get<std::string>();
  };
  Json no_max = {{"model", "qwen3"}, {"messages", {{{"role", "user"}, {"content", "x"}}}}};
  auto rec = std::make_shared<Recorder>();
  HttpRequest req;
  req.method = "POST";
  req.path = req.target = "/v1/messages";
  req.body = no_max.dump();
  completions_->HandleMessages(req, rec);
  ASSERT_TRUE(rec->done());
  EXPECT_NE(error_of(rec).find("max_tokens"), std::string::npos);
  const Json image = {
      {{"role", "user"}, {"content", {{{"type", "image"}, {"source", {{"type", "base64"}}}}}}}};
  EXPECT_NE(error_of(RunMessages({{"messages", image}}, "")).find("image"), std::string::npos);
  EXPECT_NE(error_of(RunMessages({{"tool_choice", {{"type", "all"}}}}, "")).find("tool_choice"),
            std::string::npos);
  EXPECT_NE(error_of(RunMessages({{"temperature", "hot"}}, "")).find("temperature"),
            std::string::npos);
}

// OpenAI's Responses API: input items as the chat they mean, the answer as output items
// (reasoning, message, function_call) with usage, the response.* event sequence, and
// previous_response_id continuing a kept conversation.
TEST_F(ToolCompletionsTest, ResponsesAnswerWithOutputItemsAndContinue) {
  Start(ToolCallFormat::kHermes, /*think=*/false);
  std::string prompt;
  auto rec = Answer(
      "/v1/responses",
      {{"input", "Weather in Paris?"}, {"instructions", "Be brief."}, {"max_output_tokens", 64}},
      "Sunny.", &prompt);
  ASSERT_EQ(rec->status(), 200) << rec->body();
  EXPECT_NE(prompt.find("Be brief."), std::string::npos) << prompt;
  const Json r = Json::parse(rec->body());
  EXPECT_EQ(r["object"], "response");
  EXPECT_EQ(r["status"], "completed");
  EXPECT_TRUE(r["id"].get<std::string>().starts_with("resp_")) << r;
  ASSERT_EQ(r["output"].size(), 1u) << r;
  EXPECT_EQ(r["output"][0]["type"], "message");
  EXPECT_EQ(r["output"][0]["content"][0]["type"], "output_text");
  EXPECT_EQ(r["output"][0]["content"][0]["text"], "Sunny.");
  EXPECT_EQ(r["instructions"], "Be brief.");
  EXPECT_EQ(r["usage"]["total_tokens"].get<int>(),
            r["usage"]["input_tokens"].get<int>() + r["usage"]["output_tokens"].get<int>());
  // The next turn continues the kept conversation (its instructions are not carried).
  rec = Answer(
      "/v1/responses",
      {{"input", "And tomorrow?"}, {"previous_response_id", r["id"]}, {"max_output_tokens", 64}},
      "Rain.", &prompt);
  ASSERT_EQ(rec->status(), 200) << rec->body();
  EXPECT_NE(prompt.find("Weather in Paris?"), std::string::npos) << prompt;
  EXPECT_NE(prompt.find("Sunny."), std::string::npos) << prompt;
  EXPECT_NE(prompt.find("And tomorrow?"), std::string::npos) << prompt;
  EXPECT_EQ(prompt.find("Be brief."), std::string::npos) << prompt;
  rec = Answer("/v1/responses", {{"input", "x"}, {"previous_response_id", "resp_nope"}}, "");
  EXPECT_EQ(rec->status(), 404) << rec->body();
  // Function tools, a call and its output in the input.
  const Json tools = {{{"type", "function"},
                       {"name", "get_weather"},
                       {"parameters", Tools()[0]["function"]["parameters"]}}};
  rec = Answer("/v1/responses", {{"input", "Weather in Paris?"}, {"tools", tools}}, kCallAnswer);
  const Json call = Json::parse(rec->body());
  ASSERT_EQ(call["output"].size(), 2u) << call;
  EXPECT_EQ(call["output"][1]["type"], "function_call");
  EXPECT_EQ(call["output"][1]["name"], "get_weather");
  EXPECT_EQ(Json::parse(call["output"][1]["arguments"].get<std::string>()),
            Json({{"city", "Paris"}}));
  const Json items = {
      {{"role", "user"}, {"content", "Weather in Paris?"}},
      {{"type", "function_call"},
       {"call_id", "call_1"},
       {"name", "get_weather"},
       {"arguments", "{\"city\": \"Paris\"}"}},
      {{"type", "function_call_output"}, {"call_id", "call_1"}, {"output", "22 C"}}};
  rec = Answer("/v1/responses", {{"input", items}, {"tools", tools}}, "It is 22.", &prompt);
  ASSERT_EQ(rec->status(), 200) << rec->body();
  EXPECT_NE(prompt.find("<tool_response>\n22 C\n</tool_response>"), std::string::npos) << prompt;
  // text.format json_schema / json_object: structured output, as response_format.
  const Json schema = Tools()[0]["function"]["parameters"];
  rec =
      Answer("/v1/responses",
             {{"input", "x"},
              {"text", {{"format", {{"type", "json_schema"}, {"name", "W"}, {"schema", schema}}}}}},
             R"({"city": "Paris"})");
  ASSERT_EQ(rec->status(), 200) << rec->body();
  EXPECT_EQ(Json::parse(last_schema_), schema);
  rec = Answer("/v1/responses", {{"input", "x"}, {"text", {{"format", {{"type", "json_object"}}}}}},
               "{}");
  ASSERT_EQ(rec->status(), 200) << rec->body();
  EXPECT_EQ(Json::parse(last_schema_), Json({{"type", "object"}}));
  rec = Answer("/v1/responses", {{"input", "x"}, {"text", {{"format", {{"type", "yaml"}}}}}}, "");
  EXPECT_EQ(rec->status(), 400) << rec->body();
  EXPECT_EQ(Json::parse(rec->body())["error"]["param"], "text") << rec->body();
  // tool_choice by name: the call comes back as a function_call item.
  rec = Answer("/v1/responses",
               {{"input", "x"},
                {"tools", tools},
                {"tool_choice", {{"type", "function"}, {"name", "get_weather"}}}},
               R"({"city": "Rome"})");
  ASSERT_EQ(rec->status(), 200) << rec->body();
  EXPECT_NE(rec->body().find(R"("type":"function_call")"), std::string::npos) << rec->body();
  EXPECT_EQ(Json::parse(last_schema_), schema);
}

TEST_F(ToolCompletionsTest, ResponsesStreamTheEventSequence) {
  Start(ToolCallFormat::kHermes, /*think=*/true);
  const Json tools = {{{"type", "function"},
                       {"name", "get_weather"},
                       {"parameters", Tools()[0]["function"]["parameters"]}}};
  auto rec =
      Answer("/v1/responses", {{"input", "Weather in Paris?"}, {"tools", tools}, {"stream", true}},
             std::string("<think>Call it.</think>") + kCallAnswer, nullptr);
  ASSERT_EQ(rec->status(), 200) << rec->body();
  std::vector<std::string> names, added;
  std::string reasoning, text, arguments;
  int64_t sequence = -1;
  Json completed;
  for (const auto& [name, data] : Events(rec->body())) {
    names.push_back(name);
    EXPECT_EQ(data["type"], name);
    EXPECT_EQ(data["sequence_number"].get<int64_t>(), sequence + 1) << name;
    sequence = data["sequence_number"];
    if (name == "response.output_item.added") added.push_back(data["item"]["type"]);
    if (name == "response.reasoning_text.delta") reasoning += data["delta"].get<std::string>();
    if (name == "response.output_text.delta") text += data["delta"].get<std::string>();
    if (name == "response.function_call_arguments.delta") arguments += data["delta"];
    if (name == "response.completed") completed = data["response"];
  }
  ASSERT_FALSE(names.empty()) << rec->body();
  EXPECT_EQ(names.front(), "response.created");
  EXPECT_EQ(names.back(), "response.completed");
  EXPECT_EQ(added, (std::vector<std::string>{"reasoning", "message", "function_call"}));
  EXPECT_EQ(reasoning, "Call it.");
  EXPECT_EQ(text, "Let me check.\n");
  EXPECT_EQ(Json::parse(arguments), Json({{"city", "Paris"}}));
  ASSERT_EQ(completed["output"].size(), 3u) << completed;
  EXPECT_EQ(completed["output"][1]["content"][0]["text"], "Let me check.\n");
  EXPECT_EQ(completed["status"], "completed");
}

// tool_choice required / named: the answer is decoded under vLLM's schema (which the matcher
// takes the answer under) and parsed back into tool_calls, whole and streamed; a named
// function's call finishes with "stop" (OpenAI's), required's with "tool_calls".
TEST_F(ToolCompletionsTest, ToolChoiceRequiredAndNamedDecodeUnderASchema) {
  Start(ToolCallFormat::kHermes, /*think=*/false);
  const Json named = {{"type", "function"}, {"function", {{"name", "get_weather"}}}};
  auto rec = Run({{"tools", Tools()}, {"tool_choice", named}}, R"({"city": "Paris"})");
  ASSERT_EQ(rec->status(), 200) << rec->body();
  EXPECT_EQ(Json::parse(last_schema_), Tools()[0]["function"]["parameters"]);
  Json choice = Json::parse(rec->body())["choices"][0];
  ASSERT_EQ(choice["message"]["tool_calls"].size(), 1u) << choice;
  EXPECT_EQ(choice["message"]["tool_calls"][0]["function"]["name"], "get_weather");
  EXPECT_EQ(
      Json::parse(choice["message"]["tool_calls"][0]["function"]["arguments"].get<std::string>()),
      Json({{"city", "Paris"}}));
  EXPECT_TRUE(choice["message"]["content"].is_null()) << choice;
  // A named function's call finishes with "stop", as OpenAI's does; "required" with tool_calls.
  EXPECT_EQ(choice["finish_reason"], "stop") << choice;
  rec = Run({{"tools", Tools()}, {"tool_choice", named}, {"stream", true}}, R"({"city": "Paris"})");
  ASSERT_EQ(rec->status(), 200) << rec->body();
  EXPECT_NE(rec->body().find(R"("finish_reason":"stop")"), std::string::npos) << rec->body();
  EXPECT_EQ(rec->body().find(R"("finish_reason":"tool_calls")"), std::string::npos) << rec->body();

  const std::string list = R"([{"name": "get_weather", "parameters": {"city": "Rome"}}, )"
                           R"({"name":"get_weather","parameters":{"city":"Oslo"}}])";
  rec = Run({{"tools", Tools()}, {"tool_choice", "required"}}, list);
  ASSERT_EQ(rec->status(), 200) << rec->body();
  auto grammar = CompileJsonSchema(last_schema_);
  ASSERT_TRUE(grammar.ok()) << grammar.status().message();
  GrammarMatcher matcher(*grammar);
  EXPECT_TRUE(matcher.Accept(list) && matcher.complete()) << last_schema_;
  GrammarMatcher wrong(*grammar);
  EXPECT_FALSE(wrong.Accept(R"([{"name": "get_time", "parameters": {}}])")) << last_schema_;
  choice = Json::parse(rec->body())["choices"][0];
  EXPECT_EQ(choice["finish_reason"], "tool_calls");
  ASSERT_EQ(choice["message"]["tool_calls"].size(), 2u) << choice;
  EXPECT_EQ(
      Json::parse(choice["message"]["tool_calls"][1]["function"]["arguments"].get<std::string>()),
      Json({{"city", "Oslo"}}));

  rec = Run({{"tools", Tools()}, {"tool_choice", "required"}, {"stream", true}}, list);
  ASSERT_EQ(rec->status(), 200) << rec->body();
  EXPECT_NE(rec->body().find(R"("tool_calls":[{"function":{"arguments":"{\"city\":\"Rome\"}")"),
            std::string::npos)
      << rec->body();
  EXPECT_NE(rec->body().find(R"("finish_reason":"tool_calls")"), std::string::npos) << rec->body();

  // A tool whose parameters the compiler refuses: 400 naming the tool and the keyword.
  Json tools = Tools();
  tools[0]["function"]["parameters"]["properties"]["city"]["pattern"] = "^[A-Z]";
  rec = Run({{"tools", tools}, {"tool_choice", "required"}}, "");
  ASSERT_EQ(rec->status(), 400) << rec->body();
  EXPECT_EQ(Json::parse(rec->body())["error"]["param"], "tools") << rec->body();
  EXPECT_NE(
      rec->body().find(R"(tools[0].function.parameters: schema /properties/city: \"pattern\")"),
      std::string::npos)
      << rec->body();
}

// A reasoning model whose prompt ends inside <think> (deepseek_r1 style) thinks first under a
// schema too: the worker is told to constrain only after </think> (vLLM with a reasoning
// parser), the thinking is reasoning_content and the constrained answer the content.
TEST_F(ToolCompletionsTest, StructuredOutputIsContentForReasoningModels) {
  Start(ToolCallFormat::kHermes, /*think=*/true, ThinkStyle::kStartsThinking);
  const int32_t end = *tokenizer_->TokenToId("</think>");
  for (const Json& body : {Json{{"response_format", {{"type", "json_object"}}}},
                           Json{{"guided_regex", "[a-z]+"}}, Json::object()}) {
    SCOPED_TRACE(body.dump());
    auto rec = Run(body, R"(thinking</think>{"a": 1})");
    ASSERT_EQ(rec->status(), 200) << rec->body();
    const Json message = Json::parse(rec->body())["choices"][0]["message"];
    EXPECT_EQ(message["reasoning_content"], "thinking") << message;
    EXPECT_EQ(message["content"], R"({"a": 1})") << message;
    EXPECT_EQ(last_constrain_after_, body.empty() ? std::vector<int32_t>{} : std::vector{end});
  }
}

// response_format json_object / json_schema, structured_outputs.json and guided_json send the
// schema to the worker, guided_regex / guided_choice / guided_grammar (and structured_outputs'
// regex / choice / grammar) the grammar; conflicts, bad schemas and grammars and the forms not
// implemented are 400s by name.
TEST_F(ToolCompletionsTest, StructuredOutputSchemasTravelOrAreRefusedByName) {
  Start(ToolCallFormat::kHermes, /*think=*/false);
  const Json schema = {
      {"type", "object"}, {"properties", {{"a", {{"type", "integer"}}}}}, {"required", {"a"}}};
  const std::vector<std::pair<Json, Json>> accepted = {
      {{{"response_format", {{"type", "json_object"}}}}, {{"type", "object"}}},
      {{{"response_format",
         {{"type", "json_schema"},
          {"json_schema", {{"name", "A"}, {"schema", schema}, {"strict", true}}}}}},
       schema},
      {{{"structured_outputs", {{"json", schema}}}}, schema},
      {{{"structured_outputs", {{"json", schema.dump()}}}}, schema},
      {{{"guided_json", schema}}, schema},
      {{{"response_format", {{"type", "text"}}}, {"structured_outputs", Json::object()}}, nullptr},
  };
  for (const auto& [fields, expected] : accepted) {
    auto rec = Run(fields, R"({"a": 1})");
    ASSERT_EQ(rec->status(), 200) << fields << rec->body();
    if (expected.is_null()) {
      EXPECT_TRUE(last_schema_.empty()) << fields;
    } else {
      EXPECT_EQ(Json::parse(last_schema_), expected) << fields;
    }
    EXPECT_EQ(Json::parse(rec->body())["choices"][0]["message"]["content"], R"({"a": 1})");
  }
  // Regexes, grammars and choices travel in sampling.grammar (a choice as its GBNF).
  const std::vector<std::tuple<Json, std::string, GrammarSyntax>> grammars = {
      {{{"guided_regex", "a+"}}, "a+", GrammarSyntax::kRegex},
      {{{"structured_outputs", {{"regex", "b?"}}}}, "b?", GrammarSyntax::kRegex},
      {{{"guided_grammar", "root ::= \"x\""}}, "root ::= \"x\"", GrammarSyntax::kGbnf},
      {{{"structured_outputs", {{"grammar", "root ::= [a-z]"}}}},
       "root ::= [a-z]",
       GrammarSyntax::kGbnf},
      {{{"guided_choice", {"a", "b\""}}}, "root ::= \"a\" | \"b\\\"\"\n", GrammarSyntax::kGbnf},
      {{{"structured_outputs", {{"choice", {"yes"}}}}}, "root ::= \"yes\"\n", GrammarSyntax::kGbnf},
      // A structural tag travels as its canonical spec: structures and triggers only, vLLM's
      // structure_schema as schema, from an object or its JSON text.
      {{{"response_format",
         {{"type", "structural_tag"},
          {"structures",
           {{{"begin", "<f>"}, {"structure_schema", {{"type", "integer"}}}, {"end", "</f>"}}}},
          {"triggers", {"<f"}}}}},
       R"({"structures":[{"begin":"<f>","end":"</f>","schema":{"type":"integer"}}],)"
       R"("triggers":["<f"]})",
       GrammarSyntax::kStructuralTag},
      {{{"structured_outputs",
         {{"structural_tag",
           R"({"triggers": ["<g"], "structures": [{"begin": "<g>", "schema": {}, "end": ""}]})"}}}},
       R"({"structures":[{"begin":"<g>","end":"","schema":{}}],"triggers":["<g"]})",
       GrammarSyntax::kStructuralTag},
      // xgrammar's format: triggered tags of json_schema content, the same spec.
      {{{"response_format",
         {{"type", "structural_tag"},
          {"format",
           {{"type", "triggered_tags"},
            {"triggers", {"<f"}},
            {"tags",
             {{{"type", "tag"},
               {"begin", "<f>"},
               {"content", {{"type", "json_schema"}, {"json_schema", {{"type", "integer"}}}}},
               {"end", "</f>"}}}},
            {"at_least_one", false},
            {"stop_after_first", false}}}}}},
       R"({"structures":[{"begin":"<f>","end":"</f>","schema":{"type":"integer"}}],)"
       R"("triggers":["<f"]})",
       GrammarSyntax::kStructuralTag},
      // Its at_least_one and stop_after_first travel when true.
      {{{"response_format",
         {{"type", "structural_tag"},
          {"format",
           {{"type", "triggered_tags"},
            {"triggers", {"<f"}},
            {"tags",
             {{{"begin", "<f>"},
               {"content", {{"type", "json_schema"}, {"json_schema", Json::object()}}},
               {"end", "</f>"}}}},
            {"at_least_one", true},
            {"stop_after_first", true}}}}}},
       R"({"at_least_one":true,"stop_after_first":true,"structures":[{"begin":"<f>","end":)"
       R"("</f>","schema":{}}],"triggers":["<f"]})",
       GrammarSyntax::kStructuralTag},
      {{{"structured_outputs",
         {{"structural_tag",
           R"({"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": )"
           R"(["<g"], "tags": [{"begin": "<g>", "content": {"type": "json_schema", )"
           R"("json_schema": {}}, "end": ["</g>"]}]}})"}}}},
       R"({"structures":[{"begin":"<g>","end":"</g>","schema":{}}],"triggers":["<g"]})",
       GrammarSyntax::kStructuralTag},
  };
  for (const auto& [fields, grammar, syntax] : grammars) {
    auto rec = Run(fields, "x");
    ASSERT_EQ(rec->status(), 200) << fields << rec->body();
    EXPECT_TRUE(last_schema_.empty()) << fields;
    EXPECT_EQ(last_grammar_, grammar) << fields;
    EXPECT_EQ(last_syntax_, syntax) << fields;
  }
  // A structural tag nested 100,000 deep (as JSON text): refused before anything copies it.
  const std::string deep_tag = R"({"triggers": ["<f"], "structures": )" + std::string(100000, '[') +
                               std::string(100000, ']') + "}";
  const std::vector<std::tuple<Json, std::string, std::string>> refused = {
      {{{"structured_outputs", {{"structural_tag", deep_tag}}}},
       "structured_outputs",
       "structured_outputs.structural_tag nests deeper than 64 schemas"},
      {{{"response_format", {{"type", "yaml"}}}}, "response_format", "must be \"text\""},
      {{{"response_format", {{"type", "json_schema"}, {"json_schema", {{"name", "A"}}}}}},
       "response_format",
       "schema' is missing"},
      {{{"response_format",
         {{"type", "json_schema"},
          {"json_schema", {{"schema", {{"type", "string"}, {"pattern", "a+"}}}}}}}},
       "response_format",
       "response_format.json_schema.schema: schema /: \"pattern\" is not supported"},
      {{{"response_format",
         {{"type", "json_schema"},
          {"json_schema",
           {{"schema", {{"$ref", "#/$defs/A"}, {"$defs", {{"A", {{"$ref", "#/$defs/A"}}}}}}}}}}}},
       "response_format",
       "$ref cycle"},
      {{{"response_format", {{"type", "json_object"}}}, {"guided_json", schema}},
       "guided_json",
       "only one of"},
      {{{"structured_outputs", {{"structural_tag", {{"format", {{"type", "any_text"}}}}}}}},
       "structured_outputs",
       "structured_outputs.structural_tag.format.type \"any_text\" is not supported: this "
       "server takes \"triggered_tags\""},
      {{{"structured_outputs", {{"structural_tag", {{"format", Json::object()}}}}}},
       "structured_outputs",
       "structured_outputs.structural_tag.format.type is missing"},
      {{{"structured_outputs", {{"structural_tag", {{"format", {{"type", 3}}}}}}}},
       "structured_outputs",
       "structured_outputs.structural_tag.format.type must be a string"},
      {{{"response_format",
         {{"type", "structural_tag"},
          {"format",
           {{"type", "triggered_tags"},
            {"triggers", {"<f"}},
            {"tags",
             {{{"begin", "<f>"},
               {"content", {{"type", "json_schema"}, {"json_schema", Json::object()}}},
               {"end", "</f>"}}}},
            {"stop_after_first", "yes"}}}}}},
       "response_format",
       "response_format.format.stop_after_first must be true or false"},
      {{{"response_format",
         {{"type", "structural_tag"},
          {"format",
           {{"type", "triggered_tags"},
            {"triggers", {"<f"}},
            {"tags", {{{"begin", "<f>"}, {"content", {{"type", "const_string"}}}, {"end", ""}}}},
            {"excludes", {"x"}}}}}}},
       "response_format",
       "response_format.format.excludes is not supported by this server"},
      {{{"response_format",
         {{"type", "structural_tag"},
          {"format",
           {{"type", "triggered_tags"},
            {"triggers", {"<f"}},
            {"tags",
             {{{"begin", "<f>"},
               {"content", {{"type", "const_string"}, {"value", "x"}}},
               {"end", ""}}}}}}}}},
       "response_format",
       "response_format.format.tags[0].content must be {\"type\": \"json_schema\", "
       "\"json_schema\": ...} (\"const_string\" is not supported)"},
      {{{"response_format",
         {{"type", "structural_tag"},
          {"format",
           {{"type", "triggered_tags"},
            {"triggers", {"<f"}},
            {"tags",
             {{{"begin", "<f>"},
               {"content",
                {{"type", "json_schema"}, {"json_schema", {{"type", "string"}, {"pattern", "a"}}}}},
               {"end", "</f>"}}}}}}}}},
       "response_format",
       "response_format.format.tags[0].content.json_schema: schema /: \"pattern\" is not "
       "supported"},
      {{{"response_format",
         {{"type", "structural_tag"},
          {"format",
           {{"type", "triggered_tags"},
            {"triggers", {"<fn", "<f"}},
            {"tags",
             {{{"begin", "<fn>"},
               {"content", {{"type", "json_schema"}, {"json_schema", Json::object()}}},
               {"end", ""}}}}}}}}},
       "response_format",
       "response_format.format.triggers[0]: contains triggers[1]"},
      {{{"structured_outputs", {{"structural_tag", "{}"}}}},
       "structured_outputs",
       "structured_outputs.structural_tag triggers: must be a non-empty array of strings"},
      {{{"response_format",
         {{"type", "structural_tag"},
          {"structures",
           {{{"begin", "<f>"},
             {"schema", {{"type", "string"}, {"pattern", "a"}}},
             {"end", "</f>"}}}},
          {"triggers", {"<f"}}}}},
       "response_format",
       "response_format structures[0].schema: schema /: \"pattern\" is not supported"},
      {{{"response_format",
         {{"type", "structural_tag"},
          {"structures", {{{"begin", "<h>"}, {"schema", Json::object()}, {"end", ""}}}},
          {"triggers", {"<f"}}}}},
       "response_format",
       "structures[0].begin: does not start with any of the triggers"},
      {{{"structured_outputs", {{"regex", "a("}}}},
       "structured_outputs",
       "structured_outputs.regex: regex at 2: missing )"},
      {{{"guided_choice", {"a", 2}}}, "guided_choice", "array of strings"},
      {{{"guided_grammar", "root ::= x"}},
       "guided_grammar",
       "guided_grammar: grammar line 1 col 10: no rule named x"},
      {{{"guided_regex", "a"}, {"guided_json", schema}}, "guided_regex", "only one of"},
      {{{"guided_regex", "a"}, {"structured_outputs", {{"choice", {"a"}}}}},
       "guided_regex",
       "only one of"},
      {{{"guided_json", "{not json"}}, "guided_json", "not JSON"},
      {{{"tools", Tools()},
        {"tool_choice", "required"},
        {"response_format", {{"type", "json_object"}}}},
       "response_format",
       "only one of"},
  };
  for (const auto& [fields, param, message] : refused) {
    auto rec = Run(fields, "");
    ASSERT_EQ(rec->status(), 400) << fields;
    EXPECT_EQ(Json::parse(rec->body())["error"]["param"], param) << rec->body();
    EXPECT_NE(Json::parse(rec->body())["error"]["message"].get<std::string>().find(message),
              std::string::npos)
        << rec->body();
  }
}

TEST(StructuredOutput, ReadsEachParameterIntoTheSchema) {
  for (const char* key : {"guided_json", "response_format"}) {
    const Json body = std::string(key) == "guided_json"
                          ? Json{{"guided_json", {{"type", "object"}}}}
                          : Json{{"response_format", {{"type", "json_object"}}}};
    CompletionRequest out;
    HttpResponse error;
    EXPECT_TRUE(ReadStructuredOutput(body, &out, &error)) << error.body;
    EXPECT_EQ(Json::parse(out.sampling.json_schema), Json({{"type", "object"}}));
    EXPECT_TRUE(out.sampling.constrain_after.empty());
  }
}

}  // namespace
}  // namespace fmoe
