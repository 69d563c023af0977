// Malformed request bodies are the client's error, never the server's: valid requests of every
// JSON route (/v1/completions, /v1/chat/completions, /tokenize with a prompt or messages,
// /detokenize) are mutated field by field, nested fields included (every object member and
// array element replaced by each kind of JSON value: null, booleans, integers small, negative
// and past 64 bits, fractions, numbers past double's range, strings, arrays empty or of the
// wrong things, arrays nested a hundred thousand deep, objects; or removed), then at random
// several at once from a fixed seed; every answer must be below 500 and a 4xx must be the
// OpenAI error object. The routes run as the router runs them (RouterApi, Completions, a real
// WorkerLink) with a leader played by the test that answers every request. And a client that
// half-closes its socket after a whole request (raw socket, shutdown(SHUT_WR)) still gets its
// stream, and a whole answer it gets is a client cancel (499), never a 5xx.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <gtest/gtest.h>

#include "common/json.h"
#include "common/text/chat_template.h"
#include "common/text/tokenizer.h"
#include "router/api.h"
#include "router/completions.h"
#include "router/http_server.h"
#include "router/metrics.h"
#include "tests/router/link_fixture.h"

namespace fmoe {
namespace {

using namespace link_testing;
using Json = nlohmann::json;

// A group leader that answers every Generate with one token and a finish (and every Cancel
// with its cancelled event), except requests asking for exactly kHeldTokens tokens: those it
// holds for the test, which sends their tokens itself (Send).
constexpr uint32_t kHeldTokens = 77;

class AnsweringLeader {
 public:
  explicit AnsweringLeader(const std::string& endpoint) {
    wire::SocketOptions o;
    o.routing_id = "w/g0/0";
    auto socket = wire::WorkerSocket::Connect(context_, wire::Role::kDealer, endpoint, o);
    EXPECT_TRUE(socket.ok()) << socket.status().ToString();
    socket_ = std::move(socket).value();
    WorkerHello hello;
    hello.group = "g0";
    hello.model_name = "tiny";
    hello.instance_id = 7;
    hello.max_batch = 64;
    hello.free_slots = 64;
    EXPECT_TRUE(socket_->Send(hello).ok());
    thread_ = std::thread([this] { Loop(); });
  }
  ~AnsweringLeader() {
    stop_ = true;
    thread_.join();
  }

  // The held requests so far, and the Cancels received for them.
  std::vector<uint64_t> held() const {
    std::lock_guard<std::mutex> lock(mu_);
    return held_;
  }
  std::set<uint64_t> cancelled() const {
    std::lock_guard<std::mutex> lock(mu_);
    return cancelled_;
  }
  void Send(const TokenEvent& ev) {
    std::lock_guard<std::mutex> lock(mu_);
    outbox_.push_back(ev);
  }

 private:
  void Loop() {
    auto last_heartbeat = steady_clock::now();
    uint64_t seq = 0;
    while (!stop_) {
      std::vector<TokenEvent> out;
      {
        std::lock_guard<std::mutex> lock(mu_);
        out.swap(outbox_);
      }
      for (const TokenEvent& ev : out) EXPECT_TRUE(socket_->Send(ev).ok());
      if (steady_clock::now() - last_heartbeat > 500ms) {
        last_heartbeat = steady_clock::now();
        WorkerHeartbeat hb;
        hb.group = "g0";
        hb.instance_id = 7;
        hb.seq = ++seq;
        hb.free_slots = 64;
        EXPECT_TRUE(socket_->Send(hb).ok());
      }
      auto in = socket_->Receive(2);
      if (!in) continue;
      if (const auto* g = std::get_if<Generate>(&in->message)) {
        if (g->sampling.max_tokens == kHeldTokens) {
          std::lock_guard<std::mutex> lock(mu_);
          held_.push_back(g->request_id);
          continue;
        }
        // As a worker answers: logprobs when asked, the prompt's with echo.
        TokenEvent ev = Token(g->request_id, 300);
        const int32_t top = std::max(g->sampling.logprobs, 0);
        if (g->sampling.logprobs >= 0) {
          ev.logprob = -0.5f;
          for (int32_t k = 0; k < top; ++k) ev.top_logprobs.emplace_back(300 + k, -0.5f - k);
        }
        if (g->sampling.prompt_logprobs) {
          ev.prompt_top_n = static_cast<uint32_t>(top);
          for (size_t k = 0; k + 1 < g->token_ids.size(); ++k) {
            ev.prompt_logprobs.push_back(-1.0f);
            for (int32_t t = 0; t < top; ++t) ev.prompt_top.emplace_back(300 + t, -1.0f - t);
          }
        }
        EXPECT_TRUE(socket_->Send(ev).ok());
        EXPECT_TRUE(socket_->Send(Token(g->request_id, -1, FinishReason::kLength)).ok());
      } else if (const auto* c = std::get_if<fmoe::Cancel>(&in->message)) {
        {
          std::lock_guard<std::mutex> lock(mu_);
          cancelled_.insert(c->request_id);
        }
        EXPECT_TRUE(socket_->Send(Token(c->request_id, -1, FinishReason::kCancelled)).ok());
      }
    }
  }

  wire::Context context_;
  std::unique_ptr<wire::WorkerSocket> socket_;
  std::atomic<bool> stop_{false};
  mutable std::mutex mu_;
  std::vector<uint64_t> held_;      // GUARDED_BY(mu_)
  std::set<uint64_t> cancelled_;    // GUARDED_BY(mu_)
  std::vector<TokenEvent> outbox_;  // GUARDED_BY(mu_)
  std::thread thread_;
};

// A JSON value written as text, so that values nlohmann would not write (numbers past double's
// range, nesting that its recursive writer could not take) can be sent.
struct RawValue {
  std::string what;
  std::string text;
};

std::vector<RawValue> Replacements() {
  std::string deep(100000, '[');
  deep += std::string(100000, ']');
  return {
      {"null", "null"},
      {"true", "true"},
      {"false", "false"},
      {"zero", "0"},
      {"one", "1"},
      {"seven", "7"},
      {"a negative integer", "-1"},
      {"int64 min", "-9223372036854775808"},
      {"uint64 max", "18446744073709551615"},
      {"an integer past 64 bits", "123456789012345678901234567890"},
      {"a fraction", "0.5"},
      {"a negative fraction", "-2.5"},
      {"a huge double", "1.7e308"},
      {"a number past double's range", "1e400"},
      {"a denormal", "4e-320"},
      {"an empty string", "\"\""},
      {"a string", "\"text\""},
      {"a string of digits", "\"12\""},
      {"an empty array", "[]"},
      {"an array of null", "[null]"},
      {"an array of objects", "[{\"type\": 7}]"},
      {"an array of arrays", "[[\"a\", 1], [true]]"},
      {"an array of huge integers", "[18446744073709551615, -9223372036854775808]"},
      {"an array nested 100000 deep", deep},
      {"an empty object", "{}"},
      {"an object with a wrong type", "{\"type\": 7, \"text\": null}"},
      {"an object with null type", "{\"type\": null}"},
      {"a nested object", "{\"a\": {\"b\": [1, {\"c\": null}]}}"},
  };
}

// Every path to a value inside `j` (object members and array elements, nested), as JSON
// pointers; the root ("") included.
void Paths(const Json& j, const Json::json_pointer& at, std::vector<Json::json_pointer>* out) {
  out->push_back(at);
  if (j.is_object()) {
    for (auto it = j.begin(); it != j.end(); ++it) Paths(it.value(), at / it.key(), out);
  } else if (j.is_array()) {
    for (size_t i = 0; i < j.size(); ++i) Paths(j[i], at / i, out);
  }
}

const std::string kMark = "\x01MUTATION\x01";

// `base` with the values at `paths` replaced by `values` (a null value: the member or element
// removed), as body text.
std::string Mutate(Json base, const std::vector<Json::json_pointer>& paths,
                   const std::vector<const RawValue*>& values) {
  std::vector<std::string> texts;
  for (size_t i = 0; i < paths.size(); ++i) {
    if (!base.contains(paths[i])) continue;  // Removed with an earlier mutation's parent.
    if (values[i] == nullptr) {
      if (paths[i].empty()) return "";
      Json& parent = base[paths[i].parent_pointer()];
      if (parent.is_object()) {
        parent.erase(paths[i].back());
      } else {
        parent.erase(static_cast<size_t>(std::stoul(paths[i].back())));
      }
      continue;
    }
    base[paths[i]] = kMark + std::to_string(texts.size()) + kMark;
    texts.push_back(values[i]->text);
  }
  std::string body = base.dump();
  for (size_t i = 0; i < texts.size(); ++i) {
    Json quoted = kMark + std::to_string(i) + kMark;
    const std::string q = quoted.dump();
    const size_t at = body.find(q);
    if (at != std::string::npos) body.replace(at, q.size(), texts[i]);
  }
  return body;
}

struct Route {
  std::string path;
  Json body;
};

std::vector<Route> ValidRequests() {
  return {
      {"/v1/completions",
       {{"model", "tiny"},
        {"prompt", "The city of"},
        {"max_tokens", 3},
        {"temperature", 0.5},
        {"top_p", 0.9},
        {"top_k", 5},
        {"min_p", 0.1},
        {"seed", 3},
        {"n", 2},
        {"stop", {"\n", "x"}},
        {"stop_token_ids", {2}},
        {"logprobs", 2},
        {"echo", false},
        {"presence_penalty", 0.1},
        {"frequency_penalty", 0.1},
        {"repetition_penalty", 1.1},
        {"logit_bias", {{"5", 1.5}}},
        {"min_tokens", 1},
        {"ignore_eos", false},
        {"stream", true},
        {"stream_options", {{"include_usage", true}}},
        {"best_of", 1},
        {"suffix", ""},
        {"user", "u"}}},
      {"/v1/completions",
       {{"model", "tiny"}, {"prompt", {{1, 2, 3}, {4, 5}}}, {"max_tokens", 2}, {"echo", true}}},
      {"/v1/completions", {{"model", "tiny"}, {"prompt", {"a b", "c"}}, {"max_tokens", 2}}},
      {"/v1/chat/completions",
       {{"model", "tiny"},
        {"messages",
         {{{"role", "system"}, {"content", "Be brief."}},
          {{"role", "user"}, {"content", {{{"type", "text"}, {"text", "Hi"}}}}},
          {{"role", "assistant"}, {"content", "Hello."}},
          {{"role", "user"}, {"content", "And?"}}}},
        {"max_tokens", 3},
        {"max_completion_tokens", 3},
        {"logprobs", true},
        {"top_logprobs", 2},
        {"response_format", {{"type", "text"}}},
        {"tools", Json::array()},
        {"tool_choice", "none"},
        {"stream", false},
        {"n", 1},
        {"seed", 1},
        {"stop", "x"},
        {"temperature", 1}}},
      {"/v1/chat/completions",
       {{"model", "tiny"},
        {"messages",
         {{{"role", "user"}, {"content", "Weather?"}},
          {{"role", "assistant"},
           {"content", nullptr},
           {"tool_calls",
            {{{"id", "c1"},
              {"type", "function"},
              {"function", {{"name", "get_weather"}, {"arguments", "{\"city\": \"Paris\"}"}}}}}}},
          {{"role", "tool"}, {"tool_call_id", "c1"}, {"content", "22 C"}}}},
        {"tools",
         {{{"type", "function"},
           {"function",
            {{"name", "get_weather"},
             {"description", "Weather"},
             {"parameters",
              {{"type", "object"}, {"properties", {{"city", {{"type", "string"}}}}}}}}}}}},
        {"tool_choice", "none"},
        {"max_tokens", 2}}},
      {"/v1/messages",
       {{"model", "tiny"},
        {"max_tokens", 2},
        {"system", {{{"type", "text"}, {"text", "Be brief."}}}},
        {"messages",
         {{{"role", "user"}, {"content", "Weather?"}},
          {{"role", "assistant"},
           {"content",
            {{{"type", "text"}, {"text", "Checking."}},
             {{"type", "tool_use"},
              {"id", "t1"},
              {"name", "get_weather"},
              {"input", {{"city", "Paris"}}}}}}},
          {{"role", "user"},
           {"content", {{{"type", "tool_result"}, {"tool_use_id", "t1"}, {"content", "22 C"}}}}}}},
        {"tools",
         {{{"name", "get_weather"},
           {"description", "Weather"},
           {"input_schema", {{"type", "object"}}}}}},
        {"tool_choice", {{"type", "none"}}},
        {"stop_sequences", {"\n\n"}},
        {"temperature", 0.5},
        {"top_p", 0.9},
        {"top_k", 5},
        {"stream", false}}},
      {"/v1/responses",
       {{"model", "tiny"},
        {"instructions", "Be brief."},
        {"input",
         {{{"role", "user"}, {"content", {{{"type", "input_text"}, {"text", "Weather?"}}}}},
          {{"type", "function_call"},
           {"call_id", "c1"},
           {"name", "get_weather"},
           {"arguments", "{\"city\": \"Paris\"}"}},
          {{"type", "function_call_output"}, {"call_id", "c1"}, {"output", "22 C"}}}},
        {"tools",
         {{{"type", "function"}, {"name", "get_weather"}, {"parameters", {{"type", "object"}}}}}},
        {"tool_choice", "none"},
        {"max_output_tokens", 2},
        {"temperature", 0.5},
        {"top_p", 0.9},
        {"store", false},
        {"stream", false}}},
      {"/tokenize",
       {{"model", "tiny"},
        {"prompt", "hello"},
        {"add_special_tokens", true},
        {"return_token_strs", true}}},
      {"/tokenize",
       {{"messages", {{{"role", "user"}, {"content", {{{"type", "text"}, {"text", "Hi"}}}}}}},
        {"add_generation_prompt", true}}},
      {"/detokenize", {{"model", "tiny"}, {"tokens", {1, 5, 300}}}},
  };
}

class RequestMutationTest : public ::testing::Test {
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
    completions_ = std::make_unique<Completions>(options, *tokenizer_, *link_, &metrics_);
    api_ = std::make_unique<RouterApi>(RouterApiOptions{"tiny", 1024, {}, {}}, *link_,
                                       completions_.get(), &metrics_);
    leader_ = std::make_unique<AnsweringLeader>(link_.endpoint());
    ASSERT_TRUE(WaitUntil([&] { return link_.Alive("g0", 7); }));
  }

  // One request through the router's routes, waited for; its status and body.
  std::pair<int, std::string> Call(const std::string& path, const std::string& body) {
    auto rec = std::make_shared<Recorder>();
    HttpRequest req;
    req.method = "POST";
    req.path = req.target = path;
    req.body = body;
    req.remote = "127.0.0.1:1";
    api_->Handle(req, rec);
    EXPECT_TRUE(WaitUntil([&] { return rec->done(); })) << path << " " << body.substr(0, 300);
    return {rec->status(), rec->body()};
  }

  // No 5xx, and a 4xx is the OpenAI error object with a message.
  void ExpectClientAnswer(const std::string& path, const std::string& body,
                          const std::string& what) {
    auto [status, answer] = Call(path, body);
    ASSERT_GT(status, 0) << what;
    EXPECT_LT(status, 500) << path << " with " << what << ": " << body.substr(0, 300) << " -> "
                           << answer;
    if (status >= 400 && status < 500) {
      Json err = Json::parse(answer, nullptr, false);
      EXPECT_TRUE(err.is_object() && err.contains("error") && err["error"]["message"].is_string() &&
                  !err["error"]["message"].get<std::string>().empty())
          << what << ": " << answer;
    }
    ++statuses_[status];
  }

  std::unique_ptr<Tokenizer> tokenizer_;
  std::optional<ChatTemplate> template_;
  Link link_;
  RouterMetrics metrics_;
  std::unique_ptr<Completions> completions_;
  std::unique_ptr<RouterApi> api_;
  std::unique_ptr<AnsweringLeader> leader_;
  std::map<int, int> statuses_;
};

TEST_F(RequestMutationTest, TheValidRequestsAreServed) {
  for (const Route& r : ValidRequests()) {
    auto [status, answer] = Call(r.path, r.body.dump());
    EXPECT_EQ(status, 200) << r.path << " " << r.body.dump() << " -> " << answer;
  }
}

TEST_F(RequestMutationTest, EveryFieldOfEveryRouteMutatedIntoEveryTypeIsNever5xx) {
  const std::vector<RawValue> values = Replacements();
  size_t sent = 0;
  for (const Route& r : ValidRequests()) {
    std::vector<Json::json_pointer> paths;
    Paths(r.body, Json::json_pointer(), &paths);
    for (const auto& path : paths) {
      SCOPED_TRACE(r.path + " " + path.to_string());
      for (const RawValue& v : values) {
        ExpectClientAnswer(r.path, Mutate(r.body, {path}, {&v}), path.to_string() + " = " + v.what);
        ++sent;
      }
      if (!path.empty()) {
        ExpectClientAnswer(r.path, Mutate(r.body, {path}, {nullptr}),
                           path.to_string() + " removed");
        ++sent;
      }
      if (HasFatalFailure()) return;
    }
  }
  EXPECT_GT(sent, 2000u);
  EXPECT_GT(statuses_[200], 100) << "many mutations are still valid and served";
  EXPECT_GT(statuses_[400], 1000);
  // Nothing was counted as a server error either.
  const std::string text = metrics_.Render(*link_->View());
  EXPECT_EQ(text.find("status=\"5"), std::string::npos) << text;
}

TEST_F(RequestMutationTest, SeveralFieldsMutatedAtOnceFromAFixedSeedAreNever5xx) {
  const std::vector<RawValue> values = Replacements();
  const std::vector<Route> routes = ValidRequests();
  std::mt19937_64 rng(20261127);
  for (int i = 0; i < 1500; ++i) {
    const Route& r = routes[rng() % routes.size()];
    std::vector<Json::json_pointer> all;
    Paths(r.body, Json::json_pointer(), &all);
    std::vector<Json::json_pointer> paths;
    std::vector<const RawValue*> chosen;
    const size_t k = 2 + rng() % 3;
    for (size_t m = 0; m < k; ++m) {
      paths.push_back(all[1 + rng() % (all.size() - 1)]);
      const size_t pick = rng() % (values.size() + 1);
      chosen.push_back(pick == values.size() ? nullptr : &values[pick]);
    }
    const std::string body = Mutate(r.body, paths, chosen);
    ExpectClientAnswer(r.path, body, "mutation " + std::to_string(i));
    if (HasFatalFailure()) return;
  }
}

// A raw TCP client.
class RawClient {
 public:
  explicit RawClient(uint16_t port) {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_port = htons(port);
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(connect(fd_, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
    timeval tv{0, 50000};
    setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  }
  ~RawClient() { close(fd_); }
  void Send(const std::string& bytes) {
    ASSERT_EQ(send(fd_, bytes.data(), bytes.size(), MSG_NOSIGNAL),
              static_cast<ssize_t>(bytes.size()));
  }
  void HalfClose() { ASSERT_EQ(shutdown(fd_, SHUT_WR), 0); }
  // Reads until `done(all received)` or the server closes or kWait passes; true if done.
  bool ReadUntil(const std::function<bool(const std::string&)>& done) {
    const auto end = steady_clock::now() + kWait;
    while (!done(in_)) {
      if (steady_clock::now() >= end) return false;
      char buf[4096];
      const ssize_t n = recv(fd_, buf, sizeof(buf), 0);
      if (n > 0) in_.append(buf, static_cast<size_t>(n));
      if (n == 0) return done(in_);
    }
    return true;
  }
  const std::string& received() const { return in_; }

 private:
  int fd_ = -1;
  std::string in_;
};

std::string Post(const std::string& path, const Json& body) {
  const std::string text = body.dump();
  return "POST " + path +
         " HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: " +
         std::to_string(text.size()) + "\r\n\r\n" + text;
}

class HalfCloseTest : public RequestMutationTest {
 protected:
  void SetUp() override {
    RequestMutationTest::SetUp();
    HttpServerOptions o;
    o.port = 0;
    o.threads = 2;
    server_ = std::make_unique<HttpServer>(
        o, AsyncHttpHandler([this](const HttpRequest& r, std::shared_ptr<HttpResponder> out) {
          api_->Handle(r, std::move(out));
        }));
    ASSERT_TRUE(server_->Start().ok());
    run_ = std::thread([this] { server_->Run(); });
  }
  void TearDown() override {
    server_->Stop(100);
    run_.join();
  }
  // The request the leader holds next.
  std::optional<uint64_t> NextHeld(size_t before) {
    if (!WaitUntil([&] { return leader_->held().size() > before; })) return std::nullopt;
    return leader_->held()[before];
  }

  std::unique_ptr<HttpServer> server_;
  std::thread run_;
};

// A stream asked for, then the client's write side shut: the stream is served to its end
// (token by token, each read before the next is sent, so the half-close has long been seen).
TEST_F(HalfCloseTest, AHalfClosedClientGetsItsWholeStream) {
  RawClient client(server_->port());
  client.Send(Post("/v1/completions", {{"model", "tiny"},
                                       {"prompt", "The city of"},
                                       {"max_tokens", kHeldTokens},
                                       {"stream", true}}));
  client.HalfClose();
  auto id = NextHeld(0);
  ASSERT_TRUE(id);
  const auto letter = tokenizer_->TokenToId("a");
  ASSERT_TRUE(letter.has_value());
  for (int i = 0; i < 12; ++i) {
    TokenEvent ev = Token(*id, *letter);
    ev.index = static_cast<uint32_t>(i);
    leader_->Send(ev);
    const size_t want = static_cast<size_t>(i + 1);
    ASSERT_TRUE(client.ReadUntil([&](const std::string& s) {
      size_t n = 0;
      for (size_t at = 0; (at = s.find("\"text\"", at)) != std::string::npos; ++at) ++n;
      return n >= want;
    })) << "token "
        << i << " not received: " << client.received();
  }
  leader_->Send(Token(*id, -1, FinishReason::kLength));
  ASSERT_TRUE(client.ReadUntil([](const std::string& s) {
    return s.find("data: [DONE]") != std::string::npos &&
           s.find("\r\n0\r\n\r\n") != std::string::npos;
  })) << client.received();
  EXPECT_EQ(client.received().rfind("HTTP/1.1 200", 0), 0u) << client.received();
  EXPECT_NE(client.received().find("\"finish_reason\":\"length\""), std::string::npos);
  EXPECT_TRUE(leader_->cancelled().empty()) << "a half-close is not a cancel";
  const std::string text = metrics_.Render(*link_->View());
  EXPECT_EQ(text.find("status=\"5"), std::string::npos) << text;
}

// A whole answer asked for, then the client's write side shut: nothing has been written yet, so
// the server cannot tell it from a client that left; the request is cancelled as the client's
// (499, counted so), and the half-closed client receives that answer.
TEST_F(HalfCloseTest, AHalfCloseBeforeAWholeAnswerIsAClientCancelNever5xx) {
  RawClient client(server_->port());
  client.Send(Post("/v1/completions",
                   {{"model", "tiny"}, {"prompt", "The city of"}, {"max_tokens", kHeldTokens}}));
  client.HalfClose();
  ASSERT_TRUE(client.ReadUntil([](const std::string& s) {
    const size_t head = s.find("\r\n\r\n");
    return head != std::string::npos && s.find('}', head) != std::string::npos;
  })) << client.received();
  EXPECT_EQ(client.received().rfind("HTTP/1.1 499", 0), 0u) << client.received();
  EXPECT_NE(client.received().find("client_closed_request"), std::string::npos);
  // Its work was cancelled: where it reached the leader, the leader was told.
  for (uint64_t id : leader_->held()) {
    EXPECT_TRUE(WaitUntil([&] { return leader_->cancelled().count(id) > 0; })) << id;
  }
  const std::string text = metrics_.Render(*link_->View());
  EXPECT_EQ(text.find("status=\"5"), std::string::npos) << text;
  EXPECT_NE(text.find("status=\"499\""), std::string::npos) << text;
}

}  // namespace
}  // namespace fmoe
