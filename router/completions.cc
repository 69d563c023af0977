#include "router/completions.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <mutex>
#include <optional>
#include <string_view>
#include <utility>

#include <spdlog/spdlog.h>

#include "common/json.h"
#include "common/model/model_config.h"
#include "common/process_util.h"
#include "common/text/harmony.h"
#include "common/text/think_splitter.h"
#include "common/text/unicode.h"
#include "router/anthropic.h"
#include "router/responses.h"

namespace fmoe {
namespace {

using Json = nlohmann::json;
using SteadyClock = std::chrono::steady_clock;
using Ms = std::chrono::duration<double, std::milli>;

int64_t UnixSeconds() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

size_t CodePoints(std::string_view s) {
  return static_cast<size_t>(
      std::count_if(s.begin(), s.end(), [](char c) { return (c & 0xC0) != 0x80; }));
}

struct TokenLogprob {
  int32_t id = -1;
  float logprob = 0.0f;
  std::vector<std::pair<int32_t, float>> top{};
  bool prompt = false;  // A prompt token's (echo with logprobs).
  bool first = false;   // The prompt's first token: no logprob (null), as OpenAI and vLLM.
};

// A chat answer's text told apart: content, and reasoning (reasoning_content).
struct SplitText {
  std::string content;
  std::string reasoning;
};

// One choice of a request: its own token stream, text and stop strings.
struct Choice {
  // `harmony`: gpt-oss's chat answers, whose text keeps the special tokens for the splitter.
  // `think`: a reasoning model's chat answers, split at <think>/</think>. At most one of them.
  Choice(const Tokenizer& tokenizer, std::vector<std::string> stops, bool harmony,
         std::optional<ThinkStyle> think_style)
      : text(tokenizer, /*skip_special_tokens=*/!harmony), stop(std::move(stops)) {
    if (harmony) {
      channels = std::make_unique<HarmonySplitter>();
    } else if (think_style) {
      think = std::make_unique<ThinkSplitter>(*think_style);
    }
  }
  bool splits() const { return channels != nullptr || think != nullptr; }
  // REQUIRES: splits(). The next text of the answer, or its end (Finish).
  SplitText Split(std::string_view piece) {
    return channels != nullptr ? Parts(channels->Feed(piece)) : Parts(think->Feed(piece));
  }
  SplitText FinishSplit() {
    return channels != nullptr ? Parts(channels->Finish()) : Parts(think->Finish());
  }
  template <typename Pieces>
  static SplitText Parts(Pieces p) {
    return {std::move(p.content), std::move(p.reasoning)};
  }

  TextStream text;
  StopMatcher stop;
  std::unique_ptr<HarmonySplitter> channels;  // gpt-oss: analysis -> reasoning_content.
  std::unique_ptr<ThinkSplitter> think;       // <think>...</think> -> reasoning_content.
  std::unique_ptr<ToolCallStream> calls;      // Chat with tools: the answer's tool calls.
  std::vector<ToolCall> tool_calls;           // Whole answers: the calls so far.
  size_t calls_seen = 0;                      // Calls reported (finish_reason "tool_calls").
  std::string reasoning;                      // Whole answers: the reasoning so far.
  uint64_t link_id = 0;                       // 0 until submitted.
  bool finished = false;
  uint32_t tokens = 0;
  uint64_t hits = 0, misses = 0, bytes = 0;
  uint64_t host_runs = 0, host_us = 0, bytes_not_moved = 0;  // Hybrid execution.
  uint64_t disk_reads = 0;                                   // The host tier.
  uint32_t cached_tokens = 0;       // Prompt tokens the worker found in its prefix cache.
  std::string out;                  // Whole answers: the text so far.
  std::vector<TokenLogprob> probs;  // Not yet sent (streams) or all (whole answers).
  size_t text_chars = 0;            // Code points of the logprob tokens so far (text_offset).
  size_t prompt_chars = 0;          // The same over the prompt's tokens (echo with logprobs).
  bool echo_sent = false;           // Echo with logprobs: the prompt's entries were taken.
  size_t prompt = 0;                // The request's prompt this choice completes.
  bool role_sent = false;           // Chat streams: the first delta carries the role.
  double queue_ms = 0.0;
  SteadyClock::time_point first_token{}, last_token{};
};

// One request's rendering state; the link thread feeds it events of its choices.
class CompletionState {
 public:
  // `messages`: a Messages API request (router/anthropic.h): its answer shapes. `responses`
  // (with the store it goes to): a Responses API request (router/responses.h).
  CompletionState(const Tokenizer& tokenizer, WorkerLink& link, RouterMetrics* metrics,
                  const CompletionRequest& request, const CompletionsOptions& options,
                  bool messages = false, const ResponsesRequest* responses = nullptr,
                  ResponseStore* store = nullptr)
      : tokenizer_(tokenizer),
        link_(link),
        metrics_(metrics),
        messages_(messages),
        responses_(responses != nullptr),
        response_store_(store) {
    if (responses != nullptr) {
      conversation_ = responses->conversation;
      store_response_ = responses->store;
      echo_ = responses->echo;
    }
    chat_ = request.kind == RequestKind::kChat;
    harmony_ = chat_ && options.harmony_channels;
    // Structured output that constrains the answer from its first token leaves no thinking to
    // split off (a deepseek_r1-style prompt would otherwise make the whole answer reasoning);
    // one that starts after the end of thinking (constrain_after) constrains the content only.
    const bool constrained =
        !request.sampling.json_schema.empty() || !request.sampling.grammar.empty();
    if (chat_ && !harmony_ && options.think_style &&
        (!constrained || !request.sampling.constrain_after.empty())) {
      think_style_ = options.think_style;
      // The markers that are special tokens are decoded as their text (Decode).
      for (std::string_view marker : {kThinkStart, kThinkEnd}) {
        auto id = tokenizer.TokenToId(marker);
        if (id && tokenizer.IsSpecial(*id)) special_markers_.emplace_back(*id, marker);
      }
    }
    include_reasoning_ = request.include_reasoning;
    named_tool_ = request.tool_options.forced == ToolCallOptions::Forced::kNamed &&
                  !request.tool_choice_required;
    if (chat_ && request.tool_format != ToolCallFormat::kNone) {
      // A format's markers that are special tokens are decoded as their text, as the think
      // markers are (gpt-oss's text keeps every special token already).
      for (std::string_view marker : ToolCallMarkers(request.tool_format)) {
        auto id = tokenizer.TokenToId(marker);
        if (id && tokenizer.IsSpecial(*id)) special_markers_.emplace_back(*id, marker);
      }
    }
    route_ = messages_    ? "/v1/messages"
             : responses_ ? "/v1/responses"
             : chat_      ? "/v1/chat/completions"
                          : "/v1/completions";
    id_ = (messages_    ? "msg_"
           : responses_ ? "resp_"
           : chat_      ? "chatcmpl-"
                        : "cmpl-") +
          FingerprintHex(RandomId());
    stream_ = request.stream;
    include_usage_ = request.include_usage;
    for (const PromptInput& p : request.prompts) {
      prompt_tokens_ += static_cast<uint32_t>(p.ids.size());
    }
    prompts_ = request.prompts;  // Their text only with echo.
    logprobs_ = request.sampling.logprobs;
    prompt_logprobs_ = request.sampling.prompt_logprobs;
    min_tokens_ = request.sampling.min_tokens;
    created_ = UnixSeconds();
    for (size_t p = 0; p < request.prompts.size(); ++p) {
      for (uint32_t c = 0; c < request.n; ++c) {
        choices_.push_back(
            std::make_unique<Choice>(tokenizer, request.stop, harmony_, think_style_));
        choices_.back()->prompt = p;
        if (request.tool_format != ToolCallFormat::kNone) {
          ToolCallOptions tool_options = request.tool_options;
          tool_options.id_seed += choices_.size();  // Each choice its own ids.
          choices_.back()->calls =
              std::make_unique<ToolCallStream>(request.tool_format, std::move(tool_options));
        }
      }
    }
  }

  std::mutex mu;  // Held by Completions::Run while it submits, and by every event.
  std::shared_ptr<HttpResponder> responder;
  std::string model;
  std::vector<std::unique_ptr<Choice>>& choices() { return choices_; }
  const char* route() const { return route_; }
  bool stream() const { return stream_; }

  void Count(int status) {
    if (metrics_ != nullptr) metrics_->CountRequest(route_, status);
  }

  // REQUIRES: mu held. The stream's start: headers, then the echoed prompt of each choice.
  void BeginStream() {
    Count(200);
    responder->BeginStream(200, "text/event-stream");
    if (responses_) {
      Json r = ResponseObject("in_progress", Json::array(), 0);
      ResponsesEvent("response.created", {{"response", r}});
      ResponsesEvent("response.in_progress", {{"response", std::move(r)}});
      return;
    }
    if (messages_) {
      SendEvent("message_start",
                {{"type", "message_start"},
                 {"message",
                  {{"id", id_},
                   {"type", "message"},
                   {"role", "assistant"},
                   {"model", model},
                   {"content", Json::array()},
                   {"stop_reason", nullptr},
                   {"stop_sequence", nullptr},
                   {"usage", {{"input_tokens", prompt_tokens_}, {"output_tokens", 0}}}}}});
      return;
    }
    // With the prompt's logprobs, each choice's echo waits for its first event, which has them.
    if (prompt_logprobs_) return;
    for (size_t i = 0; i < choices_.size(); ++i) {
      const std::string& echo = Echo(*choices_[i]);
      if (!echo.empty()) Send(Chunk(i, echo, nullptr, false));
    }
  }

  // Any thread: the client left. Every choice still running is cancelled.
  void CancelAll() {
    std::lock_guard<std::mutex> lock(mu);
    for (const auto& c : choices_) {
      if (c->link_id != 0 && !c->finished) link_.Cancel(c->link_id);
    }
  }

  // REQUIRES: mu held. Ends the request with an error answer and cancels its other choices.
  void Abort(HttpResponse err) {
    if (done_) return;
    done_ = true;
    for (const auto& c : choices_) {
      if (c->link_id != 0 && !c->finished) link_.Cancel(c->link_id);
    }
    Count(err.status);
    if (messages_) err = MessagesError(err);
    if (stream_ && responder_streaming_) {
      if (messages_) {
        responder->Write("event: error\ndata: " + err.body + "\n\n");
      } else if (responses_) {
        const Json e = Json::parse(err.body, nullptr, /*allow_exceptions=*/false);
        Json data = {{"type", "error"},
                     {"code", nullptr},
                     {"message", "request failed"},
                     {"param", nullptr}};
        if (e.is_object() && e.contains("error") && e["error"].is_object()) {
          data["code"] = e["error"].value("code", Json(nullptr));
          data["message"] = e["error"].value("message", Json("request failed"));
        }
        ResponsesEvent("error", std::move(data));
      } else {
        responder->Write("data: " + err.body + "\n\n");
        responder->Write("data: [DONE]\n\n");
      }
      responder->End();
    } else {
      responder->Respond(std::move(err));
    }
  }
  void set_streaming() { responder_streaming_ = true; }

  // Link thread: one event of choice `i`. Nothing thrown here leaves.
  void OnEvent(size_t i, const TokenEvent& ev) {
    std::lock_guard<std::mutex> lock(mu);
    if (done_) return;
    try {
      Handle(i, ev);
    } catch (const std::exception& e) {
      spdlog::error("{} req={}: rendering failed: {}", id_, ev.request_id, e.what());
      Abort(ApiError(500, "internal error while rendering the answer", "server_error", "", ""));
    } catch (...) {
      spdlog::error("{} req={}: rendering failed", id_, ev.request_id);
      Abort(ApiError(500, "internal error while rendering the answer", "server_error", "", ""));
    }
  }

 private:
  void Handle(size_t i, const TokenEvent& ev) {
    Choice& c = *choices_.at(i);
    if (c.finished) return;
    // The figures are the request's totals so far; an event without them (an error) keeps the
    // last ones.
    c.hits = std::max(c.hits, ev.expert_hits);
    c.misses = std::max(c.misses, ev.expert_misses);
    c.bytes = std::max(c.bytes, ev.bytes_moved);
    c.host_runs = std::max(c.host_runs, ev.expert_host_runs);
    c.host_us = std::max(c.host_us, ev.expert_host_us);
    c.bytes_not_moved = std::max(c.bytes_not_moved, ev.bytes_not_moved);
    c.disk_reads = std::max(c.disk_reads, ev.expert_disk_reads);
    c.cached_tokens = std::max(c.cached_tokens, ev.cached_tokens);
    const bool ends_well = ev.finish == FinishReason::kStop || ev.finish == FinishReason::kLength;
    if (prompt_logprobs_ && !c.echo_sent && (ev.token_id >= 0 || ends_well)) {
      if (!TakePromptLogprobs(c, ev)) {
        spdlog::error(
            "{} req={}: the worker's prompt logprobs ({} entries, {} x {} top) do not "
            "fit the prompt's {} tokens",
            id_, ev.request_id, ev.prompt_logprobs.size(), ev.prompt_top.size(), ev.prompt_top_n,
            prompts_[c.prompt].ids.size());
        Abort(ApiError(500, "the worker's prompt logprobs do not match the prompt", "server_error",
                       "", ""));
        return;
      }
      if (stream_) Send(Chunk(i, Echo(c), nullptr, true));
    }
    if (ev.token_id >= 0) {
      c.last_token = SteadyClock::now();
      if (c.tokens == 0) {
        c.first_token = c.last_token;
        c.queue_ms = std::max(0.0, Ms(c.first_token - arrived_).count() - ev.token_us / 1000.0);
      }
      ++c.tokens;
      if (logprobs_ >= 0) c.probs.push_back({ev.token_id, ev.logprob, ev.top_logprobs});
      // The stop token that ended the request counts (usage, logprobs) but is not text. Stop
      // strings are looked for in the text after the first min_tokens tokens'.
      if (!ev.stop_token) {
        std::string piece = Decode(c, ev.token_id);
        Emit(i, c.tokens <= min_tokens_ ? piece : c.stop.Feed(piece));
      }
    }
    if (c.stop.stopped()) {
      // The choice's text holds a stop string: it ends here with this token (counted, as vLLM
      // counts it) and its worker request is cancelled; what comes for it later is ignored.
      if (ev.finish == FinishReason::kNone) link_.Cancel(c.link_id);
      return End(i, FinishReason::kStop);
    }
    if (ev.finish == FinishReason::kNone) return;
    if (ev.finish == FinishReason::kStop || ev.finish == FinishReason::kLength) {
      return End(i, ev.finish);
    }
    // Cancelled (the client left) or failed.
    c.finished = true;
    if (ev.finish == FinishReason::kCancelled) {
      // Only the client cancels (it left, or half-closed before its answer began): a client
      // error, 499 as nginx counts it, which a half-closed client still receives.
      Abort(ApiError(499, "the request was cancelled: the client closed the connection",
                     "invalid_request_error", "", "client_closed_request"));
      return;
    }
    if (ev.too_long) {
      Abort(ApiError(400, ToValidUtf8(ev.error), "invalid_request_error", "max_tokens",
                     "context_length_exceeded"));
      return;
    }
    const bool unavailable = ev.error == kGroupLostError || ev.error == kTimeoutError ||
                             ev.error == kNoGroupError || ev.error == kStoppingError;
    const std::string message = ToValidUtf8(ev.error);
    Abort(unavailable ? ApiError(503, message, "service_unavailable", "",
                                 ev.error == kTimeoutError ? "timeout" : "unavailable")
                      : ApiError(500, message.empty() ? "generation failed" : message,
                                 "server_error", "", ""));
  }

  // REQUIRES: mu held. Choice `i` ended well (`reason`: kStop, by a stop string here or by the
  // worker, or kLength): the text still held back, its finish_reason, and the answer once every
  // choice has ended.
  void End(size_t i, FinishReason reason) {
    Choice& c = *choices_[i];
    if (!c.stop.stopped()) {
      std::string rest = c.text.Finish();
      Emit(i, c.tokens <= min_tokens_ ? rest : c.stop.Feed(rest));
      if (!c.stop.stopped()) Emit(i, c.stop.Flush());
    }
    if (c.splits() || c.calls != nullptr) Route(i, "", /*final=*/true);
    // A choice that called tools ends with "tool_calls" (vLLM's), else stop or length; a named
    // tool_choice's call ends with "stop", as OpenAI's does (Anthropic's forced tool still ends
    // with tool_use).
    const bool called = c.calls_seen > 0 && (!named_tool_ || messages_);
    const char* finish = called                                              ? "tool_calls"
                         : c.stop.stopped() || reason == FinishReason::kStop ? "stop"
                                                                             : "length";
    c.finished = true;
    ++finished_;
    CountGeneration(c);
    if (stream_ && !messages_ && !responses_) Send(Chunk(i, "", finish, true));
    finish_[i] = finish;
    if (c.stop.stopped()) stop_sequence_ = c.stop.matched();
    if (finished_ == choices_.size()) Complete();
  }

  // The text token `id` adds to choice c. A think marker that is a special token (skipped by
  // the TextStream, as every special token) is its text, after what the stream still held.
  std::string Decode(Choice& c, int32_t id) {
    for (const auto& [marker, text] : special_markers_) {
      if (id == marker) return c.text.Finish() + text;
    }
    return c.text.Push(id);
  }

  // Every choice is finished: the usage, then [DONE] or the whole answer.
  void Complete() {
    done_ = true;
    uint32_t completion = 0;
    for (const auto& c : choices_) completion += c->tokens;
    responder->NoteUsage(prompt_tokens_, completion);
    if (metrics_ != nullptr) {
      double queue_ms = 0.0;
      for (const auto& c : choices_) queue_ms = std::max(queue_ms, c->queue_ms);
      metrics_->CountFinished({route_, prompt_tokens_, completion,
                               Ms(SteadyClock::now() - arrived_).count(), queue_ms});
    }
    if (messages_) return CompleteMessages(completion);
    if (responses_) return CompleteResponses(completion);
    if (stream_) {
      if (include_usage_) {
        Json u = Envelope();
        u["choices"] = Json::array();
        u["usage"] = Usage();
        Send(u);
      }
      responder->Write("data: [DONE]\n\n");
      responder->End();
      return;
    }
    Json body = Envelope();
    Json choices = Json::array();
    for (size_t i = 0; i < choices_.size(); ++i) {
      Choice& c = *choices_[i];
      choices.push_back(ChoiceJson(i, Echo(c) + c.out, finish_[i], true));
    }
    body["choices"] = std::move(choices);
    body["usage"] = Usage();
    HttpResponse res;
    res.body = JsonText(body);
    Count(200);
    responder->Respond(std::move(res));
  }

  void CountGeneration(const Choice& c) {
    if (metrics_ == nullptr) return;
    const double ttft = c.tokens ? Ms(c.first_token - arrived_).count() : 0.0;
    const double tpot =
        c.tokens > 1 ? Ms(c.last_token - c.first_token).count() / (c.tokens - 1) : 0.0;
    metrics_->CountGeneration(ttft, tpot, c.tokens);
  }

  // Prompt tokens served from the workers' prefix caches: per prompt the most any of its
  // choices found, never more than the prompts hold.
  uint32_t CachedTokens() const {
    std::map<size_t, uint32_t> per_prompt;
    for (const auto& c : choices_) {
      per_prompt[c->prompt] = std::max(per_prompt[c->prompt], c->cached_tokens);
    }
    uint64_t cached = 0;
    for (const auto& [prompt, n] : per_prompt) cached += n;
    return static_cast<uint32_t>(std::min<uint64_t>(cached, prompt_tokens_));
  }

  Json Usage() const {
    uint64_t hits = 0, misses = 0, bytes = 0, host_runs = 0, host_us = 0, bytes_not_moved = 0,
             disk_reads = 0;
    uint32_t completion = 0;
    for (const auto& c : choices_) {
      hits += c->hits;
      misses += c->misses;
      bytes += c->bytes;
      host_runs += c->host_runs;
      host_us += c->host_us;
      bytes_not_moved += c->bytes_not_moved;
      disk_reads += c->disk_reads;
      completion += c->tokens;
    }
    const uint64_t total = hits + misses;
    return {{"prompt_tokens", prompt_tokens_},
            {"completion_tokens", completion},
            {"total_tokens", prompt_tokens_ + completion},
            {"prompt_tokens_details", {{"cached_tokens", CachedTokens()}}},
            {"fmoe_experts",
             {{"hits", hits},
              {"misses", misses},
              {"hit_rate", total ? static_cast<double>(hits) / static_cast<double>(total) : 0.0},
              {"bytes_moved", bytes},
              {"host_runs", host_runs},
              {"host_ms", static_cast<double>(host_us) / 1e3},
              {"bytes_not_moved", bytes_not_moved},
              {"disk_reads", disk_reads}}}};
  }

  Json Envelope() const {
    return {{"id", id_},
            {"object",
             chat_ ? (stream_ ? "chat.completion.chunk" : "chat.completion") : "text_completion"},
            {"created", created_},
            {"model", model}};
  }

  // Choice c's first event: the prompt's entries lead its logprobs. False when the event's do
  // not fit the prompt (one per token after the first, top_n pairs each).
  bool TakePromptLogprobs(Choice& c, const TokenEvent& ev) {
    c.echo_sent = true;
    const std::vector<int32_t>& prompt_ids = prompts_[c.prompt].ids;
    const size_t n = prompt_ids.empty() ? 0 : prompt_ids.size() - 1;
    const size_t top_n = ev.prompt_top_n;
    if (ev.prompt_logprobs.size() != n || ev.prompt_top.size() != n * top_n ||
        top_n > static_cast<size_t>(std::max(logprobs_, 0))) {
      return false;
    }
    if (prompt_ids.empty()) return true;
    c.probs.push_back({.id = prompt_ids[0], .prompt = true, .first = true});
    for (size_t k = 0; k < n; ++k) {
      TokenLogprob t{.id = prompt_ids[k + 1], .logprob = ev.prompt_logprobs[k], .prompt = true};
      t.top.assign(ev.prompt_top.begin() + static_cast<ptrdiff_t>(k * top_n),
                   ev.prompt_top.begin() + static_cast<ptrdiff_t>((k + 1) * top_n));
      c.probs.push_back(std::move(t));
    }
    return true;
  }

  const std::string& Echo(const Choice& c) const { return prompts_[c.prompt].text; }

  std::string TokenText(int32_t id) const {
    return tokenizer_.Decode(std::span<const int32_t>(&id, 1), /*skip_special_tokens=*/false);
  }

  // The logprobs of choice `c`'s tokens not sent yet, in the route's shape; null when none were
  // asked for.
  Json Logprobs(Choice& c) {
    if (logprobs_ < 0) return nullptr;
    Json out;
    if (chat_) {
      Json content = Json::array();
      auto entry = [&](int32_t id, float logprob) {
        const std::string raw = TokenText(id);
        Json bytes = Json::array();
        for (char b : raw) bytes.push_back(static_cast<unsigned char>(b));
        return Json{{"token", ToValidUtf8(raw)}, {"logprob", logprob}, {"bytes", bytes}};
      };
      for (const TokenLogprob& t : c.probs) {
        Json e = entry(t.id, t.logprob);
        Json top = Json::array();
        for (const auto& [id, lp] : t.top) top.push_back(entry(id, lp));
        e["top_logprobs"] = std::move(top);
        content.push_back(std::move(e));
      }
      out = {{"content", std::move(content)}};
    } else {
      Json tokens = Json::array(), token_logprobs = Json::array(), top = Json::array(),
           offsets = Json::array();
      for (const TokenLogprob& t : c.probs) {
        const std::string text = ToValidUtf8(TokenText(t.id));
        tokens.push_back(text);
        if (t.first) {
          token_logprobs.push_back(nullptr);
          top.push_back(nullptr);
        } else {
          token_logprobs.push_back(t.logprob);
          // The token's own entry first, as vLLM's (so logprobs 0 gives it, and a sampled token
          // outside the top ones is still there).
          Json alternatives = Json::object();
          alternatives[text] = t.logprob;
          for (const auto& [id, lp] : t.top) {
            const std::string alt = ToValidUtf8(TokenText(id));
            if (!alternatives.contains(alt)) alternatives[alt] = lp;
          }
          top.push_back(std::move(alternatives));
        }
        // A prompt token's offset counts the prompt's token texts before it (as vLLM's, special
        // tokens included); a generated token's starts after the echoed prompt.
        if (t.prompt) {
          offsets.push_back(c.prompt_chars);
          c.prompt_chars += CodePoints(text);
        } else {
          offsets.push_back(CodePoints(Echo(c)) + c.text_chars);
          c.text_chars += CodePoints(text);
        }
      }
      out = {{"tokens", std::move(tokens)},
             {"token_logprobs", std::move(token_logprobs)},
             {"top_logprobs", std::move(top)},
             {"text_offset", std::move(offsets)}};
    }
    c.probs.clear();
    return out;
  }

  // Choice `i`'s entry: a streamed delta (with the logprobs not sent yet) or the whole answer;
  // `reasoning` (gpt-oss's analysis channel, a reasoning model's thinking) as reasoning_content.
  Json ChoiceJson(size_t i, const std::string& text, const char* finish, bool with_logprobs,
                  const std::string& reasoning = "") {
    Choice& c = *choices_[i];
    Json choice = {{"index", i},
                   {"logprobs", with_logprobs ? Logprobs(c) : Json(nullptr)},
                   {"finish_reason", finish ? Json(finish) : Json(nullptr)}};
    if (!chat_) {
      choice["text"] = text;
    } else if (stream_) {
      Json delta = Json::object();
      if (!c.role_sent) delta["role"] = "assistant";
      if (!reasoning.empty()) delta["reasoning_content"] = reasoning;
      if (!text.empty() || (!c.role_sent && reasoning.empty())) delta["content"] = text;
      c.role_sent = true;
      choice["delta"] = std::move(delta);
    } else {
      choice["message"] = {{"role", "assistant"}, {"content", text}};
      if (!c.tool_calls.empty()) {
        Json list = Json::array();
        for (const ToolCall& t : c.tool_calls) {
          list.push_back({{"id", t.id},
                          {"type", "function"},
                          {"function", {{"name", t.name}, {"arguments", t.arguments}}}});
        }
        choice["message"]["tool_calls"] = std::move(list);
        if (text.empty()) choice["message"]["content"] = nullptr;  // OpenAI's, with calls only.
      }
      if (c.splits()) {
        choice["message"]["reasoning_content"] =
            c.reasoning.empty() || !include_reasoning_ ? Json(nullptr) : Json(c.reasoning);
      }
    }
    return choice;
  }

  Json Chunk(size_t i, const std::string& text, const char* finish, bool with_logprobs,
             const std::string& reasoning = "") {
    Json j = Envelope();
    j["choices"] = Json::array({ChoiceJson(i, text, finish, with_logprobs, reasoning)});
    return j;
  }

  void Send(const Json& event) { responder->Write("data: " + JsonText(event) + "\n\n"); }

  void Emit(size_t i, const std::string& piece) {
    if (piece.empty()) return;
    if (choices_[i]->splits() || choices_[i]->calls != nullptr) {
      Route(i, piece, /*final=*/false);
      return;
    }
    if (stream_ && messages_) {
      BlockDelta("text", piece);
    } else if (stream_ && responses_) {
      ItemDelta("message", piece);
    } else if (stream_) {
      Send(Chunk(i, piece, nullptr, true));
    } else {
      choices_[i]->out += piece;
    }
  }

  // A chat choice's text through its parsers (`final`: the answer ended, flush them): gpt-oss's
  // tool calls come out of the raw harmony text before its channels are split; a reasoning
  // model's out of the content once the thinking is split off (vLLM's order).
  void Route(size_t i, std::string_view piece, bool final) {
    Choice& c = *choices_[i];
    std::vector<ToolCallDelta> calls;
    auto parse = [&](std::string_view text) -> std::string {
      if (c.calls == nullptr) return std::string(text);
      ToolCallStreamDelta d = c.calls->Feed(text);
      if (final) {
        ToolCallStreamDelta rest = c.calls->Finish();
        d.content += rest.content;
        for (ToolCallDelta& t : rest.tool_calls) d.tool_calls.push_back(std::move(t));
      }
      for (ToolCallDelta& t : d.tool_calls) calls.push_back(std::move(t));
      return std::move(d.content);
    };
    SplitText out;
    if (c.channels != nullptr) {
      out = c.Split(parse(piece));
      if (final) {
        SplitText rest = c.FinishSplit();
        out.content += rest.content;
        out.reasoning += rest.reasoning;
      }
    } else if (c.think != nullptr) {
      out = c.Split(piece);
      if (final) {
        SplitText rest = c.FinishSplit();
        out.content += rest.content;
        out.reasoning += rest.reasoning;
      }
      out.content = parse(out.content);
    } else {
      out.content = parse(piece);
    }
    EmitPieces(i, std::move(out));
    EmitCalls(i, std::move(calls));
  }

  // Tool calls the parser reported: a streamed delta.tool_calls, or the whole answer's list.
  void EmitCalls(size_t i, std::vector<ToolCallDelta> calls) {
    if (calls.empty()) return;
    Choice& c = *choices_[i];
    c.calls_seen += calls.size();
    if (stream_ && responses_) {
      for (const ToolCallDelta& d : calls) {
        CloseItem();
        const std::string item_id = "fc_" + FingerprintHex(RandomId());
        const size_t index = output_.size();
        Json item = {{"type", "function_call"}, {"id", item_id},   {"call_id", d.id},
                     {"name", d.name},          {"arguments", ""}, {"status", "in_progress"}};
        ResponsesEvent("response.output_item.added", {{"output_index", index}, {"item", item}});
        ResponsesEvent("response.function_call_arguments.delta",
                       {{"item_id", item_id}, {"output_index", index}, {"delta", d.arguments}});
        ResponsesEvent("response.function_call_arguments.done",
                       {{"item_id", item_id}, {"output_index", index}, {"arguments", d.arguments}});
        item["arguments"] = d.arguments;
        item["status"] = "completed";
        ResponsesEvent("response.output_item.done", {{"output_index", index}, {"item", item}});
        output_.push_back(std::move(item));
        c.tool_calls.push_back({d.id, d.name, d.arguments});
      }
      return;
    }
    if (!stream_) {
      for (ToolCallDelta& d : calls) {
        c.tool_calls.push_back({std::move(d.id), std::move(d.name), std::move(d.arguments)});
      }
      return;
    }
    if (messages_) {
      for (const ToolCallDelta& d : calls) {
        CloseBlock();
        const int index = ++block_index_;
        SendEvent(
            "content_block_start",
            {{"type", "content_block_start"},
             {"index", index},
             {"content_block",
              {{"type", "tool_use"}, {"id", d.id}, {"name", d.name}, {"input", Json::object()}}}});
        SendEvent("content_block_delta",
                  {{"type", "content_block_delta"},
                   {"index", index},
                   {"delta", {{"type", "input_json_delta"}, {"partial_json", d.arguments}}}});
        SendEvent("content_block_stop", {{"type", "content_block_stop"}, {"index", index}});
      }
      return;
    }
    Json list = Json::array();
    for (const ToolCallDelta& d : calls) {
      list.push_back({{"index", d.index},
                      {"id", d.id},
                      {"type", "function"},
                      {"function", {{"name", d.name}, {"arguments", d.arguments}}}});
    }
    Json j = Envelope();
    Json delta = Json::object();
    if (!c.role_sent) {
      delta["role"] = "assistant";
      delta["content"] = nullptr;
      c.role_sent = true;
    }
    delta["tool_calls"] = std::move(list);
    j["choices"] = Json::array({{{"index", i},
                                 {"delta", std::move(delta)},
                                 {"logprobs", Logprobs(c)},
                                 {"finish_reason", nullptr}}});
    Send(j);
  }

  // A split answer's text: the reasoning as reasoning_content (unless include_reasoning is
  // false), the rest as content.
  void EmitPieces(size_t i, SplitText p) {
    if (!include_reasoning_) p.reasoning.clear();
    if (p.content.empty() && p.reasoning.empty()) return;
    if (stream_ && messages_) {
      BlockDelta("thinking", p.reasoning);
      BlockDelta("text", p.content);
    } else if (stream_ && responses_) {
      ItemDelta("reasoning", p.reasoning);
      ItemDelta("message", p.content);
    } else if (stream_) {
      Send(Chunk(i, p.content, nullptr, true, p.reasoning));
    } else {
      choices_[i]->out += p.content;
      choices_[i]->reasoning += p.reasoning;
    }
  }

  // ---- Responses API (router/responses.h): one choice, output items ----
  void ResponsesEvent(const char* type, Json data) {
    data["type"] = type;
    data["sequence_number"] = sequence_++;
    responder->Write(std::string("event: ") + type + "\ndata: " + JsonText(data) + "\n\n");
  }
  // The response object: `status`, its output items so far, the tokens out.
  Json ResponseObject(const char* status, Json output, uint32_t completion) const {
    Json r = {{"id", id_},
              {"object", "response"},
              {"created_at", created_},
              {"status", status},
              {"model", model},
              {"output", std::move(output)},
              {"error", nullptr},
              {"incomplete_details", nullptr},
              {"instructions", nullptr},
              {"max_output_tokens", nullptr},
              {"previous_response_id", nullptr},
              {"temperature", nullptr},
              {"top_p", nullptr},
              {"tools", Json::array()},
              {"tool_choice", "auto"},
              {"parallel_tool_calls", true},
              {"text", {{"format", {{"type", "text"}}}}},
              {"store", store_response_},
              {"metadata", Json::object()},
              {"usage",
               {{"input_tokens", prompt_tokens_},
                {"input_tokens_details", {{"cached_tokens", CachedTokens()}}},
                {"output_tokens", completion},
                {"output_tokens_details", {{"reasoning_tokens", 0}}},
                {"total_tokens", prompt_tokens_ + completion}}}};
    for (auto it = echo_.begin(); it != echo_.end(); ++it) r[it.key()] = it.value();
    return r;
  }
  static Json MessageItem(const std::string& id, const std::string& text, const char* status) {
    return {
        {"type", "message"},
        {"id", id},
        {"status", status},
        {"role", "assistant"},
        {"content",
         Json::array({{{"type", "output_text"}, {"text", text}, {"annotations", Json::array()}}})}};
  }
  static Json ReasoningItem(const std::string& id, const std::string& text) {
    return {{"type", "reasoning"},
            {"id", id},
            {"summary", Json::array()},
            {"content", Json::array({{{"type", "reasoning_text"}, {"text", text}}})}};
  }
  // Streamed text of an item kind ("message" or "reasoning"): a new item when another is open.
  void ItemDelta(const char* kind, const std::string& text) {
    if (text.empty()) return;
    const bool message = std::string_view(kind) == "message";
    if (open_item_ != kind) {
      CloseItem();
      open_item_ = kind;
      item_id_ = (message ? "msg_" : "rs_") + FingerprintHex(RandomId());
      item_text_.clear();
      const size_t index = output_.size();
      if (message) {
        Json item = MessageItem(item_id_, "", "in_progress");
        item["content"] = Json::array();
        ResponsesEvent("response.output_item.added", {{"output_index", index}, {"item", item}});
        ResponsesEvent(
            "response.content_part.added",
            {{"item_id", item_id_},
             {"output_index", index},
             {"content_index", 0},
             {"part", {{"type", "output_text"}, {"text", ""}, {"annotations", Json::array()}}}});
      } else {
        Json item = ReasoningItem(item_id_, "");
        item["content"] = Json::array();
        ResponsesEvent("response.output_item.added", {{"output_index", index}, {"item", item}});
      }
    }
    item_text_ += text;
    ResponsesEvent(message ? "response.output_text.delta" : "response.reasoning_text.delta",
                   {{"item_id", item_id_},
                    {"output_index", output_.size()},
                    {"content_index", 0},
                    {"delta", text}});
  }
  void CloseItem() {
    if (open_item_.empty()) return;
    const size_t index = output_.size();
    if (open_item_ == "message") {
      ResponsesEvent("response.output_text.done", {{"item_id", item_id_},
                                                   {"output_index", index},
                                                   {"content_index", 0},
                                                   {"text", item_text_}});
      ResponsesEvent(
          "response.content_part.done",
          {{"item_id", item_id_},
           {"output_index", index},
           {"content_index", 0},
           {"part",
            {{"type", "output_text"}, {"text", item_text_}, {"annotations", Json::array()}}}});
      output_.push_back(MessageItem(item_id_, item_text_, "completed"));
    } else {
      ResponsesEvent("response.reasoning_text.done", {{"item_id", item_id_},
                                                      {"output_index", index},
                                                      {"content_index", 0},
                                                      {"text", item_text_}});
      output_.push_back(ReasoningItem(item_id_, item_text_));
    }
    ResponsesEvent("response.output_item.done",
                   {{"output_index", index}, {"item", output_.back()}});
    if (open_item_ == "message") answer_text_ += item_text_;
    open_item_.clear();
  }
  // The answer's end: the stream's last events or the whole response; the conversation kept.
  void CompleteResponses(uint32_t completion) {
    const Choice& c = *choices_[0];
    const bool incomplete = std::string_view(finish_[0]) == "length";
    Json output = Json::array();
    std::string text;
    if (stream_) {
      CloseItem();
      output = output_;
      text = answer_text_;
    } else {
      if (!c.reasoning.empty() && include_reasoning_) {
        output.push_back(ReasoningItem("rs_" + FingerprintHex(RandomId()), c.reasoning));
      }
      if (!c.out.empty()) {
        output.push_back(MessageItem("msg_" + FingerprintHex(RandomId()), c.out,
                                     incomplete ? "incomplete" : "completed"));
      }
      for (const ToolCall& t : c.tool_calls) {
        output.push_back({{"type", "function_call"},
                          {"id", "fc_" + FingerprintHex(RandomId())},
                          {"call_id", t.id},
                          {"name", t.name},
                          {"arguments", t.arguments},
                          {"status", "completed"}});
      }
      text = c.out;
    }
    Json r = ResponseObject(incomplete ? "incomplete" : "completed", std::move(output), completion);
    if (incomplete) r["incomplete_details"] = {{"reason", "max_output_tokens"}};
    if (store_response_ && response_store_ != nullptr) {
      Json answer = {{"role", "assistant"}, {"content", text}};
      if (!c.tool_calls.empty()) {
        Json calls = Json::array();
        for (const ToolCall& t : c.tool_calls) {
          calls.push_back({{"id", t.id},
                           {"type", "function"},
                           {"function", {{"name", t.name}, {"arguments", t.arguments}}}});
        }
        answer["tool_calls"] = std::move(calls);
      }
      conversation_.push_back(std::move(answer));
      response_store_->Put(id_, std::move(conversation_));
    }
    if (stream_) {
      ResponsesEvent(incomplete ? "response.incomplete" : "response.completed",
                     {{"response", std::move(r)}});
      responder->End();
      return;
    }
    HttpResponse res;
    res.body = JsonText(r);
    Count(200);
    responder->Respond(std::move(res));
  }

  // ---- Messages API (router/anthropic.h): one choice, content blocks ----
  void SendEvent(const char* type, const Json& data) {
    responder->Write(std::string("event: ") + type + "\ndata: " + JsonText(data) + "\n\n");
  }
  // Streamed text of a block kind ("text" or "thinking"): a new block when another is open.
  void BlockDelta(const char* kind, const std::string& text) {
    if (text.empty()) return;
    if (open_block_ != kind) {
      CloseBlock();
      open_block_ = kind;
      Json block = {{"type", kind}, {kind, ""}};
      if (open_block_ == "thinking") block["signature"] = "";
      SendEvent("content_block_start", {{"type", "content_block_start"},
                                        {"index", ++block_index_},
                                        {"content_block", std::move(block)}});
    }
    const bool thinking = open_block_ == "thinking";
    SendEvent("content_block_delta",
              {{"type", "content_block_delta"},
               {"index", block_index_},
               {"delta", {{"type", thinking ? "thinking_delta" : "text_delta"}, {kind, text}}}});
  }
  void CloseBlock() {
    if (open_block_.empty()) return;
    SendEvent("content_block_stop", {{"type", "content_block_stop"}, {"index", block_index_}});
    open_block_.clear();
  }
  // The answer's end: the stream's last events, or the whole message.
  void CompleteMessages(uint32_t completion) {
    const std::string stop_reason = MessagesStopReason(finish_[0], !stop_sequence_.empty());
    const Json stop_sequence = stop_sequence_.empty() ? Json(nullptr) : Json(stop_sequence_);
    if (stream_) {
      CloseBlock();
      SendEvent("message_delta",
                {{"type", "message_delta"},
                 {"delta", {{"stop_reason", stop_reason}, {"stop_sequence", stop_sequence}}},
                 {"usage", {{"output_tokens", completion}}}});
      SendEvent("message_stop", {{"type", "message_stop"}});
      responder->End();
      return;
    }
    const Choice& c = *choices_[0];
    Json content = Json::array();
    if (!c.reasoning.empty() && include_reasoning_) {
      content.push_back({{"type", "thinking"}, {"thinking", c.reasoning}, {"signature", ""}});
    }
    if (!c.out.empty()) content.push_back({{"type", "text"}, {"text", c.out}});
    for (const ToolCall& t : c.tool_calls) {
      Json input = Json::parse(t.arguments, nullptr, /*allow_exceptions=*/false);
      content.push_back({{"type", "tool_use"},
                         {"id", t.id},
                         {"name", t.name},
                         {"input", input.is_object() ? input : Json::object()}});
    }
    HttpResponse res;
    res.body = JsonText({{"id", id_},
                         {"type", "message"},
                         {"role", "assistant"},
                         {"model", model},
                         {"content", std::move(content)},
                         {"stop_reason", stop_reason},
                         {"stop_sequence", stop_sequence},
                         {"usage",
                          {{"input_tokens", prompt_tokens_},
                           {"output_tokens", completion},
                           {"cache_read_input_tokens", CachedTokens()}}}});
    Count(200);
    responder->Respond(std::move(res));
  }

  const Tokenizer& tokenizer_;
  WorkerLink& link_;
  RouterMetrics* metrics_;
  bool messages_ = false;   // A Messages API request.
  bool responses_ = false;  // A Responses API request.
  ResponseStore* response_store_ = nullptr;
  Json conversation_;  // Responses: the request's chat messages (stored with the answer).
  bool store_response_ = true;
  Json echo_ = Json::object();   // Responses: the request's fields the response object echoes.
  Json output_ = Json::array();  // Responses streams: the output items done so far.
  std::string open_item_;        // Responses streams: the open item's kind ("" = none).
  std::string item_id_;
  std::string item_text_;
  std::string answer_text_;    // Responses streams: the message text of the answer.
  uint64_t sequence_ = 0;      // Responses streams: the events' sequence_number.
  std::string open_block_;     // Messages streams: the open block's kind ("" = none).
  int block_index_ = -1;       // Messages streams: the last block's index.
  std::string stop_sequence_;  // The stop string that ended the answer ("" = none).
  const char* route_ = "/v1/completions";
  std::string id_;
  int64_t created_ = 0;
  bool chat_ = false;
  bool harmony_ = false;  // gpt-oss chat: the answer's channels split (HarmonySplitter).
  std::optional<ThinkStyle> think_style_;  // Reasoning models' chat: split at <think>.
  std::vector<std::pair<int32_t, std::string>> special_markers_;  // (id, text), see Decode.
  bool include_reasoning_ = true;
  bool named_tool_ = false;  // tool_choice named a function: its call finishes with "stop".
  bool stream_ = false;
  bool include_usage_ = false;
  bool responder_streaming_ = false;
  bool done_ = false;  // Answered (or failed): later events are dropped.
  uint32_t prompt_tokens_ = 0;
  int32_t logprobs_ = -1;
  bool prompt_logprobs_ = false;
  uint32_t min_tokens_ = 0;
  std::vector<PromptInput> prompts_;  // The request's; their text is the echo (empty without).
  SteadyClock::time_point arrived_ = SteadyClock::now();
  std::vector<std::unique_ptr<Choice>> choices_;
  std::map<size_t, const char*> finish_;
  size_t finished_ = 0;
};

// A request must fit every KV pool it may be sent to, as it must fit the context: the router
// knows a `kv_cache_tokens` pool from the manifest (options.context_length), and a pool of one
// device budget (`memory`) only from its group's heartbeats (the most blocks it may hold).
CompletionsOptions FitToPools(const CompletionsOptions& base, const ClusterView& view) {
  CompletionsOptions options = base;
  for (const GroupView& g : view.groups) {
    constexpr uint64_t kBlockPositions = 16;  // A KvFigures block (kv_blocks.h kKvBlockTokens).
    // Compared in blocks: a heartbeat's count times 16 could overflow.
    if (!g.alive || g.kv.max_blocks == 0 ||
        g.kv.max_blocks >= options.context_length / kBlockPositions + 1) {
      continue;
    }
    const uint64_t positions = g.kv.max_blocks * kBlockPositions;
    if (positions >= options.context_length) continue;
    options.context_length = static_cast<uint32_t>(positions);
    options.context_limit = " (the KV pool of group " + g.name + " holds at most " +
                            std::to_string(positions) + " positions: memory)";
  }
  return options;
}

}  // namespace

Completions::Completions(CompletionsOptions options, const Tokenizer& tokenizer, WorkerLink& link,
                         RouterMetrics* metrics)
    : options_(std::move(options)),
      tokenizer_(tokenizer),
      link_(link),
      metrics_(metrics),
      responses_(options_.responses_capacity) {
  if (!options_.responses_dir.empty()) {
    if (Status s = responses_.Open(options_.responses_dir); !s.ok()) {
      spdlog::warn("responses: {}; stored responses are kept in memory only", s.message());
    }
  }
  if (metrics_ != nullptr) metrics_->SetResponseStore(&responses_);
}

void Completions::Handle(const HttpRequest& request, std::shared_ptr<HttpResponder> responder) {
  Run(RequestKind::kText, request, std::move(responder));
}

void Completions::HandleChat(const HttpRequest& request, std::shared_ptr<HttpResponder> responder) {
  Run(RequestKind::kChat, request, std::move(responder));
}

void Completions::HandleMessages(const HttpRequest& request,
                                 std::shared_ptr<HttpResponder> responder) {
  Run(RequestKind::kChat, request, std::move(responder), Dialect::kMessages);
}

void Completions::HandleResponses(const HttpRequest& request,
                                  std::shared_ptr<HttpResponder> responder) {
  Run(RequestKind::kChat, request, std::move(responder), Dialect::kResponses);
}

void Completions::Run(RequestKind kind, const HttpRequest& request,
                      std::shared_ptr<HttpResponder> responder, Dialect dialect) {
  HttpResponse error;
  const bool messages = dialect == Dialect::kMessages;
  const bool responses = dialect == Dialect::kResponses;
  const char* route = messages                     ? "/v1/messages"
                      : responses                  ? "/v1/responses"
                      : kind == RequestKind::kChat ? "/v1/chat/completions"
                                                   : "/v1/completions";
  auto refuse = [&](HttpResponse res) {
    if (metrics_ != nullptr) metrics_->CountRequest(route, res.status);
    responder->Respond(messages ? MessagesError(res) : std::move(res));
  };
  std::string body = request.body;
  std::optional<ResponsesRequest> translated;
  if (messages || responses) {
    const Json j = Json::parse(request.body, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) {
      return refuse(ApiError(400, "the request body is not valid JSON", "invalid_request_error", "",
                             "invalid_json"));
    }
    // The translation copies and writes the body out with recursive code: bound its nesting.
    if (JsonDepth(j) > 2 * kMaxToolJsonDepth) {
      return refuse(ApiError(
          400, "the request nests deeper than " + std::to_string(2 * kMaxToolJsonDepth) + " levels",
          "invalid_request_error", "", "invalid_value"));
    }
    if (messages) {
      auto chat = MessagesToChat(j, &error);
      if (!chat.ok()) return refuse(std::move(error));
      body = JsonText(*chat);
    } else {
      auto r = ResponsesToChat(j, responses_, &error);
      if (!r.ok()) return refuse(std::move(error));
      translated = std::move(*r);
      body = JsonText(translated->chat);
    }
  }
  const CompletionsOptions options = FitToPools(options_, *link_.View());
  auto parsed = ParseRequest(body, options, tokenizer_, kind, &error);
  if (!parsed.ok()) return refuse(std::move(error));
  if (!parsed->ignored_fields.empty()) {
    std::string names;
    for (const std::string& f : parsed->ignored_fields) names += (names.empty() ? "" : ", ") + f;
    spdlog::info("{}: fields this server does not know, ignored: {}", route, names);
  }
  auto state = std::make_shared<CompletionState>(tokenizer_, link_, metrics_, *parsed, options,
                                                 messages, translated ? &*translated : nullptr,
                                                 translated ? &responses_ : nullptr);
  state->responder = responder;
  state->model = options_.model_name;
  // Headers first for a stream, so the client sees it start; under the state's lock so no
  // event is written before them.
  std::lock_guard<std::mutex> lock(state->mu);
  auto& choices = state->choices();
  // Every choice admitted at once, or the request refused whole.
  std::vector<WorkerLink::Submission> submissions;
  for (size_t i = 0; i < choices.size(); ++i) {
    Generate g;
    g.token_ids = parsed->prompts[choices[i]->prompt].ids;
    g.sampling = parsed->sampling;
    // Independent samples, reproducible: choice c of each prompt draws with seed + c, as that
    // prompt alone would.
    g.sampling.seed = parsed->sampling.seed + i % parsed->n;
    submissions.push_back(
        {std::move(g), [state, i](const TokenEvent& ev) { state->OnEvent(i, ev); }});
  }
  auto ids = link_.SubmitAll(std::move(submissions), options_.request_timeout_ms);
  if (!ids.ok()) {
    if (ids.status().code() == ErrorCode::kResourceExhausted) {
      HttpResponse res = ApiError(429, ids.status().message() + "; retry later",
                                  "rate_limit_exceeded", "", "queue_full");
      res.headers.emplace_back("Retry-After", "1");
      state->Abort(std::move(res));
    } else {
      HttpResponse res =
          ApiError(503,
                   ids.status().message() == kNoGroupError ? link_.View()->UnavailableReason()
                                                           : ids.status().message(),
                   "service_unavailable", "", "unavailable");
      res.headers.emplace_back("Retry-After", "5");
      state->Abort(std::move(res));
    }
    return;
  }
  for (size_t i = 0; i < choices.size(); ++i) choices[i]->link_id = (*ids)[i];
  if (state->stream()) {
    state->set_streaming();
    state->BeginStream();
  }
  std::weak_ptr<CompletionState> weak = state;
  responder->OnClose([weak] {
    if (auto s = weak.lock()) s->CancelAll();
  });
}

}  // namespace fmoe
