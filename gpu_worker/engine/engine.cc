#include "gpu_worker/engine/engine.h"

#include <algorithm>
#include <chrono>
#include <exception>
#include <optional>
#include <string>

#include "common/clock.h"
#include "common/log.h"
#include "gpu_worker/sampling/structured_output.h"

namespace fmoe {

struct Engine::Sequence {
  uint64_t id = 0;
  std::vector<int32_t> prompt;
  std::vector<int32_t> output;
  SamplingParams sampling;
  Sampler sampler;
  std::unique_ptr<KvCache> kv;
  uint32_t iteration = 0;
  int64_t submitted_us = 0;
  int64_t admitted_us = -1;
  int64_t last_event_us = -1;
  bool cancelled = false;
  bool finished = false;
  // Handed to a Forward: the observer and the expert source may hold state for it from then on
  // (even when that Forward failed), which Retire ends.
  bool forwarded = false;
  // The prompt's logprobs (sampling.prompt_logprobs), from the prefill until the first event
  // carries them.
  std::optional<PromptLogprobs> prompt_logprobs;
  RequestUsage group_usage;  // The group's figures for this request (with a group).
  // After a preemption: the tokens to prefill again (the prompt and the output so far); the
  // last chunk's sample is the next output token. Empty before any preemption with output.
  std::vector<int32_t> resume;
  uint32_t cached_tokens = 0;  // Prompt tokens the first admission found in the prefix cache.
  bool restart = false;        // Preempted: the next plan restarts it on the other ranks.
  bool computed = false;       // A Forward ran it since it was (re)admitted.

  std::span<const int32_t> prefill_tokens() const {
    return resume.empty() ? std::span<const int32_t>(prompt) : std::span<const int32_t>(resume);
  }

  Sequence(Generate& request, std::span<const int32_t> eos_ids)
      : id(request.request_id),
        prompt(std::move(request.token_ids)),
        sampling(request.sampling),
        sampler(sampling, prompt, eos_ids) {}
};

namespace {

// What an exception says, for an error event.
std::string What(const std::exception_ptr& error) {
  try {
    std::rethrow_exception(error);
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "unknown exception";
  }
}

}  // namespace

// Steps with at least this many prompt tokens measure a prompt token's compute.
constexpr uint32_t kMeasurePromptTokens = 32;

Engine::Engine(EngineOptions options, MoeModel& model, ExpertSource& experts,
               const Tokenizer* tokenizer, ForwardObserver* observer, EventSink sink)
    : options_(std::move(options)),
      model_(model),
      experts_(experts),
      tokenizer_(tokenizer),
      observer_(observer),
      sink_(std::move(sink)),
      scheduler_(
          SchedulerOptions{options_.max_batch, options_.max_batched_tokens, options_.max_waiting}) {
  scheduler_.SetAdmitHook([this](uint64_t id, uint32_t) { return OnAdmit(id); });
  if (options_.chunk_overhead > 0 && options_.chunk_costs && options_.max_batched_tokens > 0) {
    scheduler_.SetChunkAdvisor([this](uint32_t chunk, uint32_t rest) {
      return ExpertAwareChunk(Costs(), chunk, rest, options_.chunk_overhead);
    });
  }
  PublishFigures();  // Heartbeats carry the pool from the start, before the first step.
}

uint32_t Engine::OnAdmit(uint64_t id) {
  auto it = sequences_.find(id);
  if (it == sequences_.end()) return 0;
  Sequence& seq = *it->second;
  if (!seq.kv) {
    try {
      seq.kv = model_.NewKvCache();
    } catch (...) {
      return 0;  // Step fails the request: it has no cache.
    }
  }
  seq.kv->Reset();
  seq.computed = false;
  // A request that reports its prompt's logprobs computes every prompt token (as vLLM does).
  if (seq.sampling.prompt_logprobs && seq.output.empty()) return 0;
  const auto cached = static_cast<uint32_t>(seq.kv->TakePrefix(seq.prefill_tokens()));
  if (seq.resume.empty()) seq.cached_tokens = cached;
  return cached;
}

void Engine::Preempt(Sequence& seq) {
  if (!seq.output.empty()) {
    seq.resume = seq.prompt;
    seq.resume.insert(seq.resume.end(), seq.output.begin(), seq.output.end());
  }
  seq.prompt_logprobs.reset();  // A prefill cut short: recomputed whole.
  if (seq.kv) seq.kv->Reset();
  scheduler_.Preempt(seq.id, static_cast<uint32_t>(seq.prefill_tokens().size()));
  seq.restart = seq.forwarded;
  if (grouped() && seq.forwarded) preempted_.push_back(seq.id);
  if (!seq.computed) {
    // Admitted this step and sent back before it ran: it only waits longer.
    spdlog::debug("req={}: waits for KV blocks", seq.id);
    return;
  }
  ++stats_.preemptions;
  const KvPoolFigures pool = model_.kv_figures();
  spdlog::info(
      "req={}: preempted (the KV pool is full; {} of {} blocks used); it resumes with {} "
      "tokens to prefill",
      seq.id, pool.used_blocks, pool.total_blocks, seq.prefill_tokens().size());
}

bool Engine::ReserveKv(const ScheduledWork& w, std::vector<uint64_t>* preempted) {
  Sequence& seq = *sequences_.at(w.id);
  while (!seq.kv->Reserve(w.tokens)) {
    // The newest running request gives its blocks up, this one last.
    const std::vector<uint64_t> running = scheduler_.RunningIds();
    if (running.empty()) return false;
    Sequence& victim = *sequences_.at(running.back());
    Preempt(victim);
    preempted->push_back(victim.id);
    if (victim.id == seq.id) return false;
  }
  return true;
}

Engine::~Engine() = default;

void Engine::Submit(Generate request) {
  active_.fetch_add(1, std::memory_order_relaxed);
  try {
    std::lock_guard<std::mutex> lock(mu_);
    inbox_.push_back({Command{false, std::move(request)}, SteadyNowUs()});
  } catch (...) {  // Not queued (std::bad_alloc): the caller answers the request.
    active_.fetch_sub(1, std::memory_order_relaxed);
    throw;
  }
  cv_.notify_one();
}

void Engine::Cancel(uint64_t request_id) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    Command c;
    c.cancel = true;
    c.request.request_id = request_id;
    inbox_.push_back({std::move(c), SteadyNowUs()});
  }
  cv_.notify_one();
}

void Engine::Wake() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    woken_ = true;
  }
  cv_.notify_one();
}

void Engine::WaitForWork(int timeout_ms) {
  std::unique_lock<std::mutex> lock(mu_);
  cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms),
               [this] { return !inbox_.empty() || woken_; });
  woken_ = false;
}

void Engine::Run(const std::function<bool()>& stop) {
  // Structured output's token vocabulary, built before the first request rather than in it.
  if (tokenizer_ != nullptr) PrepareStructuredOutput(*tokenizer_);
  last_plan_us_ = SteadyNowUs();
  while (!stop() && !group_failed_) {
    bool worked = false;
    try {
      worked = Step();
    } catch (...) {
      // Step converts what it expects to throw (Forward, sampling, KV allocation); anything else
      // ends the running requests, and the engine serves on.
      StepThrew(std::current_exception());
      continue;
    }
    if (worked) continue;
    if (grouped() && SteadyNowUs() - last_plan_us_ >= int64_t{options_.keepalive_ms} * 1000) {
      SendPlan(PlanKind::kIdle, {});
      continue;
    }
    WaitForWork(std::min(50, options_.keepalive_ms));
  }
  if (grouped() && !group_failed_) SendPlan(PlanKind::kStop, {});
}

std::string Engine::RunningIds() const {
  std::string ids;
  for (uint64_t id : scheduler_.RunningIds()) {
    if (!ids.empty()) ids += ',';
    ids += std::to_string(id);
  }
  return ids.empty() ? "none" : ids;
}

void Engine::DropFinished() {
  std::erase_if(sequences_, [this](const auto& entry) {
    if (!entry.second->finished) return false;
    scheduler_.Remove(entry.first);
    return true;
  });
}

void Engine::StepThrew(const std::exception_ptr& error) {
  const std::string what = "the engine's iteration threw: " + What(error);
  spdlog::error("{}; failing the running requests req={}", what, RunningIds());
  if (grouped()) {
    // The other ranks may be anywhere in this iteration: the group cannot go on.
    GroupFailed(Internal(what));
    return;
  }
  for (uint64_t id : scheduler_.RunningIds()) {
    Sequence& seq = *sequences_.at(id);
    try {
      Finish(seq, FinishReason::kError, what);
    } catch (...) {
      seq.finished = true;
      spdlog::error("req={}: the error event could not be sent: {}", id,
                    What(std::current_exception()));
    }
  }
  DropFinished();
}

ExpertFigures Engine::group_figures() const {
  if (!grouped()) return options_.local_figures ? options_.local_figures() : ExpertFigures{};
  std::lock_guard<std::mutex> lock(figures_mu_);
  return group_figures_;
}

bool Engine::ShouldStream(uint32_t prompt_tokens, uint32_t decode_tokens) const {
  if (prompt_tokens == 0) return false;
  switch (options_.prefill_stream) {
    case StreamMode::kOff:
      return false;
    case StreamMode::kOn:
      return true;
    case StreamMode::kAuto:
      break;
  }
  return options_.chunk_costs && StreamSooner(Costs(), prompt_tokens, decode_tokens);
}

ChunkCosts Engine::Costs() const {
  ChunkCosts c = options_.chunk_costs();
  if (stats_.prompt_token_ns > 0) c.token_ns = stats_.prompt_token_ns;
  return c;
}

bool Engine::SendPlan(PlanKind kind, std::span<const SequenceInput> inputs, bool stream) {
  IterationPlan plan;
  plan.kind = kind;
  plan.stream = stream;
  plan.step = plan_step_++;
  plan.ended.swap(ended_);
  plan.preempted.swap(preempted_);
  for (const SequenceInput& in : inputs) {
    Sequence& seq = *sequences_.at(in.request_id);
    plan.sequences.push_back({in.request_id,
                              in.iteration,
                              {in.tokens.begin(), in.tokens.end()},
                              in.prefill,
                              seq.restart});
    seq.restart = false;
  }
  std::vector<uint8_t> bytes = EncodePlan(plan);
  last_plan_us_ = SteadyNowUs();
  if (Status s = options_.group->Broadcast(&bytes); !s.ok()) {
    GroupFailed(s);
    return false;
  }
  return true;
}

bool Engine::SumFigures(std::span<const SequenceInput> inputs,
                        std::span<const SequenceFailure> local, std::vector<std::string>* failed) {
  std::vector<RequestUsage> usage;
  for (const SequenceInput& in : inputs) usage.push_back(experts_.Usage(in.request_id));
  std::vector<int64_t> counters =
      PackFigures(usage, options_.local_figures ? options_.local_figures() : ExpertFigures{});
  const size_t failures_at = counters.size();
  const uint32_t world = options_.group->world_size();
  const uint32_t experts = model_.info().num_experts;
  std::vector<std::optional<RankFailure>> mine(inputs.size());
  for (const SequenceFailure& f : local) {
    if (f.sequence < mine.size()) mine[f.sequence] = RankFailure{0, f.layer, f.expert};
  }
  PackFailures(mine, options_.group->rank(), world, experts, &counters);
  const size_t split_at = counters.size();
  const KvPoolFigures pool = model_.kv_figures();
  PackSplit(pool.bytes, pool.expert_bytes, options_.group->rank(), world, &counters);
  if (Status s = options_.group->SumCounters(counters); !s.ok()) {
    GroupFailed(s);
    return false;
  }
  ExpertFigures totals;
  UnpackFigures(counters, usage, &totals);
  const std::vector<std::optional<RankFailure>> all =
      UnpackFailures(counters, failures_at, inputs.size(), world, experts);
  std::vector<KvFigures::RankSplit> splits;
  if (model_.kv_arena() != nullptr) splits = UnpackSplit(counters, split_at, world);
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (!all[i] || !(*failed)[i].empty()) continue;
    (*failed)[i] = "expert " + std::to_string(all[i]->expert) + " of MoE layer " +
                   std::to_string(all[i]->layer) + " could not be read on rank " +
                   std::to_string(all[i]->rank) + " (its log names the read's error)";
  }
  for (size_t i = 0; i < inputs.size(); ++i) {
    sequences_.at(inputs[i].request_id)->group_usage = usage[i];
  }
  std::lock_guard<std::mutex> lock(figures_mu_);
  group_figures_ = totals;
  rank_splits_ = std::move(splits);
  return true;
}

KvFigures Engine::kv_figures() const {
  std::lock_guard<std::mutex> lock(figures_mu_);
  return kv_figures_;
}

EngineFigures Engine::engine_figures() const {
  std::lock_guard<std::mutex> lock(figures_mu_);
  return engine_figures_;
}

void Engine::PublishFigures() {
  const KvPoolFigures f = model_.kv_figures();
  std::lock_guard<std::mutex> lock(figures_mu_);
  const bool shared = model_.kv_arena() != nullptr;
  kv_figures_ = {f.total_blocks,
                 f.used_blocks,
                 f.blocks.prefix_queries,
                 f.blocks.prefix_hit_tokens,
                 stats_.preemptions,
                 shared ? f.max_blocks : 0,
                 shared ? f.bytes : 0,
                 shared ? f.expert_bytes : 0,
                 shared ? rank_splits_ : std::vector<KvFigures::RankSplit>{}};
  engine_figures_ = {stats_.prompt_chunks, stats_.chunks_grown,
                     static_cast<uint64_t>(std::max(0.0, stats_.prompt_token_ns)),
                     stats_.streamed_iterations};
}

void Engine::GroupFailed(const Status& why) {
  if (group_failed_.exchange(true)) return;
  spdlog::error("{}; {} running and {} waiting requests are left to the router", why.message(),
                scheduler_.running(), scheduler_.waiting());
  if (options_.on_group_failure) options_.on_group_failure(why);
}

void Engine::DrainInbox() {
  std::deque<std::pair<Command, int64_t>> commands;
  {
    std::lock_guard<std::mutex> lock(mu_);
    commands.swap(inbox_);
  }
  for (auto& [command, at_us] : commands) {
    if (!command.cancel) {
      Admit(std::move(command.request), at_us);
      continue;
    }
    const uint64_t id = command.request.request_id;
    auto it = sequences_.find(id);
    if (it == sequences_.end()) continue;
    if (scheduler_.IsWaiting(id)) {
      Finish(*it->second, FinishReason::kCancelled);
    } else {
      it->second->cancelled = true;  // It leaves at the next Step.
    }
  }
  DropFinished();
}

void Engine::Admit(Generate request, int64_t submitted_us) {
  const ModelInfo& info = model_.info();
  const std::string req = "req=" + std::to_string(request.request_id) + ": ";
  if (sequences_.contains(request.request_id)) {
    return Fail(request.request_id, req + "a request with this id is already queued or running");
  }
  if (scheduler_.waiting() >= options_.max_waiting) {
    return Fail(request.request_id, req + "the worker's queue is full (" +
                                        std::to_string(options_.max_waiting) + " waiting)");
  }
  if (request.token_ids.empty()) return Fail(request.request_id, req + "the prompt is empty");
  for (size_t i = 0; i < request.token_ids.size(); ++i) {
    const int32_t id = request.token_ids[i];
    if (id < 0 || static_cast<uint32_t>(id) >= info.vocab_size) {
      return Fail(request.request_id, req + "prompt token " + std::to_string(i) + " (" +
                                          std::to_string(id) + ") is not in the vocabulary of " +
                                          std::to_string(info.vocab_size));
    }
  }
  if (info.max_position_embeddings > 0 &&
      request.token_ids.size() >= info.max_position_embeddings) {
    return Fail(request.request_id,
                req + "the prompt's " + std::to_string(request.token_ids.size()) +
                    " tokens leave no room in the model's context of " +
                    std::to_string(info.max_position_embeddings),
                /*too_long=*/true);
  }
  if (Status s = ValidateSampling(request.sampling, info.vocab_size); !s.ok()) {
    return Fail(request.request_id, req + s.message());
  }
  if (const uint64_t pool = model_.kv_capacity_tokens();
      pool > 0 && request.token_ids.size() + uint64_t{request.sampling.max_tokens} > pool) {
    return Fail(request.request_id,
                req + "the prompt's " + std::to_string(request.token_ids.size()) +
                    " tokens plus max_tokens " + std::to_string(request.sampling.max_tokens) +
                    " exceed the KV pool's " + std::to_string(pool) + " positions" +
                    (model_.kv_arena() != nullptr ? " (memory: its most with borrowed pages)"
                                                  : " (kv_cache_tokens)"),
                /*too_long=*/true);
  }
  auto seq = std::make_unique<Sequence>(request, options_.eos_token_ids);
  seq->submitted_us = submitted_us;
  if (Status s = ConstrainSampler(seq->sampler, seq->sampling, tokenizer_, options_.eos_token_ids);
      !s.ok()) {
    return Fail(request.request_id, req + s.message());
  }
  // LongRoPE picks its factors by the sequence's length at each Forward: a prompt that crosses
  // the original context runs whole, as it would without a budget, so its tokens do not depend
  // on how it was cut. A shorter one is never cut across the original context, so a preempted
  // sequence that crossed it while decoding is prefilled again as it first ran: the positions
  // before it with the short factors, the rest with the long ones.
  const uint32_t original = info.longrope ? info.longrope->original_max_position_embeddings : 0;
  const bool chunkable = original == 0 || seq->prompt.size() <= original;
  if (!scheduler_.Add(seq->id, static_cast<uint32_t>(seq->prompt.size()), chunkable, original)) {
    return Fail(request.request_id, req + "the scheduler refused the request");
  }
  sequences_.emplace(seq->id, std::move(seq));
}

void Engine::AppendPromptLogprobs(Sequence& seq, PromptLogprobs chunk) {
  if (!seq.prompt_logprobs) {
    seq.prompt_logprobs = std::move(chunk);
    return;
  }
  PromptLogprobs& all = *seq.prompt_logprobs;
  all.logprob.insert(all.logprob.end(), chunk.logprob.begin(), chunk.logprob.end());
  all.top.insert(all.top.end(), chunk.top.begin(), chunk.top.end());
}

void Engine::Fail(uint64_t request_id, const std::string& error, bool too_long) {
  spdlog::warn("{}", error);
  TokenEvent ev;
  ev.request_id = request_id;
  ev.finish = FinishReason::kError;
  ev.error = error;
  ev.too_long = too_long;
  ++stats_.requests_failed;
  active_.fetch_sub(1, std::memory_order_relaxed);
  sink_(ev);
}

void Engine::Emit(Sequence& seq, int32_t token, FinishReason finish, bool stop_token) {
  const int64_t now = SteadyNowUs();
  TokenEvent ev;
  ev.request_id = seq.id;
  ev.token_id = token;
  ev.index = static_cast<uint32_t>(seq.output.empty() ? 0 : seq.output.size() - 1);
  ev.finish = finish;
  ev.stop_token = stop_token;
  if (seq.last_event_us < 0) {
    ev.cached_tokens = seq.cached_tokens;
    ev.queue_us = static_cast<uint64_t>(std::max<int64_t>(0, seq.admitted_us - seq.submitted_us));
    ev.token_us = static_cast<uint64_t>(std::max<int64_t>(0, now - seq.admitted_us));
  } else {
    ev.token_us = static_cast<uint64_t>(now - seq.last_event_us);
  }
  seq.last_event_us = now;
  const RequestUsage usage = grouped() ? seq.group_usage : experts_.Usage(seq.id);
  ev.expert_hits = usage.hits;
  ev.expert_misses = usage.misses;
  ev.bytes_moved = usage.bytes_moved;
  ev.expert_host_runs = usage.host_runs;
  ev.expert_host_us = static_cast<uint64_t>(std::max<int64_t>(0, usage.host_ns / 1000));
  ev.bytes_not_moved = usage.bytes_not_moved;
  ev.expert_disk_reads = usage.disk_reads;
  if (seq.sampling.logprobs >= 0) {
    ev.logprob = seq.sampler.logprobs().token;
    ev.top_logprobs = seq.sampler.logprobs().top;
  }
  TakePromptLogprobs(seq, &ev);
  sink_(ev);
}

void Engine::TakePromptLogprobs(Sequence& seq, TokenEvent* ev) {
  if (!seq.prompt_logprobs) return;
  ev->prompt_logprobs = std::move(seq.prompt_logprobs->logprob);
  ev->prompt_top_n = seq.prompt_logprobs->top_n;
  ev->prompt_top = std::move(seq.prompt_logprobs->top);
  seq.prompt_logprobs.reset();
}

void Engine::Retire(Sequence& seq, FinishReason reason) {
  seq.finished = true;
  if (reason == FinishReason::kError) {
    ++stats_.requests_failed;
  } else {
    ++stats_.requests_finished;
  }
  active_.fetch_sub(1, std::memory_order_relaxed);
  if (seq.forwarded) {
    if (observer_ != nullptr) observer_->OnRequestEnd(seq.id);
    experts_.OnRequestEnd(seq.id);
    if (grouped()) ended_.push_back(seq.id);
  }
}

void Engine::Finish(Sequence& seq, FinishReason reason, std::string error) {
  if (seq.finished) return;
  // The request's expert figures, before Retire ends its usage in the cache.
  const RequestUsage usage = grouped() ? seq.group_usage : experts_.Usage(seq.id);
  Retire(seq, reason);
  TokenEvent ev;
  ev.request_id = seq.id;
  ev.finish = reason;
  ev.error = std::move(error);
  ev.index = static_cast<uint32_t>(seq.output.size());
  ev.expert_hits = usage.hits;
  ev.expert_misses = usage.misses;
  ev.bytes_moved = usage.bytes_moved;
  ev.expert_host_runs = usage.host_runs;
  ev.expert_host_us = static_cast<uint64_t>(std::max<int64_t>(0, usage.host_ns / 1000));
  ev.bytes_not_moved = usage.bytes_not_moved;
  ev.expert_disk_reads = usage.disk_reads;
  if (reason != FinishReason::kError && reason != FinishReason::kCancelled) {
    TakePromptLogprobs(seq, &ev);  // A stop token drawn first: this is the first event.
  }
  if (seq.last_event_us < 0) ev.cached_tokens = seq.cached_tokens;
  sink_(ev);
}

void Engine::SampleAndEmit(Sequence& seq, std::span<const float> logits, uint32_t max_positions) {
  const int32_t token = seq.sampler.Sample(logits);
  if (token < 0) {  // Structured output with no token left (sampler.h): done, or stuck.
    const bool done = seq.sampler.constraint() != nullptr && seq.sampler.constraint()->complete();
    return Finish(seq, done ? FinishReason::kStop : FinishReason::kError,
                  done ? "" : "structured output: no token continues the output");
  }
  const auto& stop_ids = seq.sampling.stop_token_ids;
  const auto& eos_ids = options_.eos_token_ids;
  // While output.size() < min_tokens the sampler cannot draw these.
  if (std::find(stop_ids.begin(), stop_ids.end(), token) != stop_ids.end() ||
      (!seq.sampling.ignore_eos &&
       std::find(eos_ids.begin(), eos_ids.end(), token) != eos_ids.end())) {
    // Reported (its logprobs, the usage) as vLLM reports it; its text is not part of the
    // completion (TokenEvent::stop_token).
    seq.output.push_back(token);
    Emit(seq, token, FinishReason::kStop, /*stop_token=*/true);
    Retire(seq, FinishReason::kStop);
    return;
  }
  seq.output.push_back(token);
  // Stop strings are the router's: it cancels the request when its text has one.
  FinishReason finish = FinishReason::kNone;
  if (seq.output.size() >= seq.sampling.max_tokens ||
      (max_positions > 0 && seq.kv->length() + 1 > static_cast<int64_t>(max_positions))) {
    finish = FinishReason::kLength;
  }
  Emit(seq, token, finish);
  if (finish != FinishReason::kNone) Retire(seq, finish);
}

bool Engine::Step() {
  if (group_failed_) return false;
  DrainInbox();
  for (uint64_t id : scheduler_.RunningIds()) {
    Sequence& seq = *sequences_.at(id);
    if (seq.cancelled) Finish(seq, FinishReason::kCancelled);
  }
  DropFinished();

  // Schedule: the step's work, and each request's part of the Forward.
  const std::vector<ScheduledWork> work = scheduler_.Schedule();
  if (work.empty()) {
    model_.ReturnIdleKv();  // One device budget: an idle pool's borrowed pages go back.
    PublishFigures();
    return false;
  }
  const int64_t now = SteadyNowUs();
  std::vector<ScheduledWork> ran;
  std::vector<SequenceInput> inputs;
  ran.reserve(work.size());
  inputs.reserve(work.size());
  // The KV blocks of the step's work, in its order (decodes first, oldest first): what cannot
  // get its blocks preempts the newest running request, or waits itself.
  std::vector<uint64_t> preempted;
  for (const ScheduledWork& w : work) {
    if (std::find(preempted.begin(), preempted.end(), w.id) != preempted.end()) continue;
    Sequence& seq = *sequences_.at(w.id);
    if (w.admitted && seq.admitted_us < 0) seq.admitted_us = now;
    if (!seq.kv) {
      Finish(seq, FinishReason::kError,
             "req=" + std::to_string(seq.id) + ": no KV cache could be allocated");
      continue;
    }
    if (!ReserveKv(w, &preempted)) continue;
  }
  for (const ScheduledWork& w : work) {
    if (std::find(preempted.begin(), preempted.end(), w.id) != preempted.end()) continue;
    Sequence& seq = *sequences_.at(w.id);
    if (seq.finished) continue;
    SequenceInput in;
    in.request_id = seq.id;
    in.iteration = seq.iteration;
    in.kv = seq.kv.get();
    in.prefill = w.prefill;
    if (w.prefill) {
      const std::span<const int32_t> tokens = seq.prefill_tokens();
      in.tokens = tokens.subspan(w.first, w.tokens);
      in.no_logits = !w.samples;
      if (seq.sampling.prompt_logprobs && seq.resume.empty()) {
        in.prompt_logprobs = seq.sampling.logprobs;
        if (!w.samples) in.next_token = tokens[w.first + w.tokens];
      }
      stats_.prefill_tokens += w.tokens;
    } else {
      in.tokens = std::span<const int32_t>(&seq.output.back(), 1);
      ++stats_.decode_tokens;
    }
    seq.forwarded = true;
    seq.computed = true;
    inputs.push_back(in);
    ran.push_back(w);
  }
  DropFinished();
  if (inputs.empty()) return true;

  // Forward.
  uint32_t step_tokens = 0, prompt_tokens = 0;
  for (const ScheduledWork& w : ran) {
    step_tokens += w.tokens;
    prompt_tokens += w.prefill ? w.tokens : 0;
  }
  const bool stream =
      ShouldStream(prompt_tokens, step_tokens - prompt_tokens) && experts_.StreamNextIteration();
  stats_.streamed_iterations += stream ? 1 : 0;
  if (grouped() && !SendPlan(PlanKind::kIteration, inputs, stream)) return false;
  ForwardResult result;
  // A prompt token's compute, for expert-aware chunks and the heartbeat's figures: measured on
  // steps with enough prompt tokens that their compute dominates, the expert cache's stall taken
  // out.
  const bool measure = prompt_tokens >= std::min(kMeasurePromptTokens,
                                                 std::max(options_.max_batched_tokens / 2, 1u));
  const uint64_t stall_before =
      measure && options_.local_figures ? options_.local_figures().stall_us : 0;
  const int64_t t0 = SteadyNowUs();
  Status s;
  try {
    s = model_.Forward(inputs, experts_, observer_, &result);
  } catch (...) {  // c10::Error, std::bad_alloc, or an observer's: the batch fails, not the worker.
    s = Internal("the forward pass threw: " + What(std::current_exception()));
  }
  const int64_t forward_us = SteadyNowUs() - t0;
  stats_.forward_us += static_cast<uint64_t>(forward_us);
  ++stats_.iterations;
  if (measure && s.ok()) {
    const uint64_t stall_us =
        options_.local_figures ? options_.local_figures().stall_us - stall_before : 0;
    const double compute_ns = 1000.0 * static_cast<double>(std::max<int64_t>(
                                           forward_us - static_cast<int64_t>(stall_us), 1));
    const double per_token = compute_ns / step_tokens;
    stats_.prompt_token_ns =
        stats_.prompt_token_ns <= 0 ? per_token : 0.8 * stats_.prompt_token_ns + 0.2 * per_token;
  }
  if (!s.ok() && grouped()) {
    // The other ranks may have finished this Forward or not: the group cannot go on.
    GroupFailed(s);
    return false;
  }
  // Per sequence: why it failed (an expert its tokens picked could not be read), empty if not.
  std::vector<std::string> failed(inputs.size());
  if (s.ok()) {
    for (const SequenceFailure& f : result.failed) {
      if (f.sequence < failed.size()) failed[f.sequence] = f.error.message();
    }
  }
  if (grouped() && !SumFigures(inputs, result.failed, &failed)) return false;
  if (!s.ok()) {
    // The step's KV caches are unusable; the requests that waited are untouched.
    spdlog::error("iteration failed for req={}: {}", RunningIds(), s.message());
    for (const SequenceInput& in : inputs) {
      Finish(*sequences_.at(in.request_id), FinishReason::kError, s.message());
    }
    DropFinished();
    return true;
  }
  scheduler_.Completed(ran);
  for (const ScheduledWork& w : ran) {
    if (!w.prefill) continue;
    ++stats_.prompt_chunks;
    if (w.grown) ++stats_.chunks_grown;
  }
  // The sequences an unreadable expert failed end here (their KV goes with them); the others
  // computed as if it had been read.
  for (size_t i = 0; i < inputs.size(); ++i) {
    if (failed[i].empty()) continue;
    spdlog::error("req={}: {}", inputs[i].request_id, failed[i]);
    Finish(*sequences_.at(inputs[i].request_id), FinishReason::kError, failed[i]);
  }

  // Sample and emit: the requests whose prompt is wholly in their KV draw a token.
  const uint32_t max_positions = model_.info().max_position_embeddings;
  for (size_t i = 0; i < inputs.size(); ++i) {
    Sequence& seq = *sequences_.at(inputs[i].request_id);
    if (seq.finished) continue;  // Failed above.
    if (inputs[i].prompt_logprobs >= 0 && i < result.prompt_logprobs.size()) {
      AppendPromptLogprobs(seq, std::move(result.prompt_logprobs[i]));
    }
    ++seq.iteration;
    if (!ran[i].samples) continue;
    try {
      if (seq.sampling.max_tokens == 0) {  // Scoring only: the prompt's logprobs, no token.
        Finish(seq, FinishReason::kLength);
        continue;
      }
      SampleAndEmit(seq, result.logits[i], max_positions);
    } catch (...) {
      Finish(seq, FinishReason::kError,
             "req=" + std::to_string(seq.id) +
                 ": sampling or reporting a token threw: " + What(std::current_exception()));
    }
  }
  DropFinished();
  // One device budget: pages the finished requests freed go back to the expert cache.
  model_.ReturnIdleKv();
  PublishFigures();
  return true;
}

}  // namespace fmoe
