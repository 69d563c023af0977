// The worker's engine loop: schedule -> forward -> sample/emit (DESIGN section 14). The scheduler
// (gpu_worker/core/scheduler.h) owns the waiting and running queues and picks each step's work
// within max_batched_tokens: one decode token per running request first, then chunks of the
// prompts still being prefilled, then newly admitted requests (up to max_batch). One Forward runs
// the step; each request whose prompt is wholly in its KV then samples one token and reports it.
// A request's tokens do not depend on what else is in the batch, nor on how its prompt was cut
// (see model.h and sampler.h).
//
// Threads: Submit/Cancel/active from any thread (they only enqueue); Step/Run on the one engine
// thread that owns the model, the KV caches and the expert source. Events go to the sink on
// the engine thread, in order.
//
// Expert parallelism (DESIGN section 7): with a group of several ranks, the engine runs on the
// leader. Before each Forward it broadcasts the iteration's plan (gpu_worker/core/group_plan.h) to
// the other ranks, which run the same Forward (gpu_worker/engine/follower.h); after it, the ranks
// sum their expert figures, so events and heartbeats carry the group's. While idle it broadcasts a
// keep-alive plan every keepalive_ms, and a stop plan when Run returns. A failed collective
// breaks the group: the engine stops serving (no further events) and calls on_group_failure once;
// the worker then tells the router and exits, and the launcher restarts the group.
//
// A request's life:
//   WAITING --(a batch slot and budget are free: Step admits, oldest first)--> RUNNING (prompt)
//   RUNNING (prompt) --(its last chunk ran; first token sampled)--> RUNNING (decode)
//   RUNNING --(stop token, max_tokens, context full)--> finished (stop / length);
//     a stop token is reported like any token, with TokenEvent::stop_token (not in the text)
//   RUNNING --(the KV pool cannot hold the step's work: the newest running request first)-->
//     WAITING (preempted: its blocks freed; prefilled again over its prompt and output, then it
//     samples its next token as if never interrupted)
//   WAITING or RUNNING --(Cancel)--> finished (cancelled); a running one leaves at the next Step.
//     Stop strings end a request this way: the router matches them in the text it renders and
//     cancels the request (the engine never detokenizes; a Generate with stop strings is refused)
//   any --(invalid request or runtime error)--> finished (error)
//
// Sampling (sampler.h): each request's Sampler knows its prompt and the model's eos ids. With
// sampling.ignore_eos the eos ids do not end a request (stop_token_ids still do). While fewer
// than min_tokens tokens were generated, the sampler cannot draw eos or stop ids. With
// sampling.logprobs >= 0 each token event carries the token's raw log-probability and the top
// ones. Every Generate is checked with ValidateSampling (common/wire/sampling_limits.h).
//
// Errors: nothing a request does takes the worker down. An expert that could not be read (a host
// tier's disk read failed, after its retry) fails only the step's requests whose tokens picked it
// (ForwardResult::failed): they end with an error event naming the layer, the expert and the read
// error, their KV dropped; the step's other requests sample and report as usual. In a group the
// ranks add their failures to the figures they sum after the Forward, so every rank ends the same
// requests (the leader names a follower's failure by rank, layer and expert; that rank's log has
// the read's error), and the group goes on. An exception from Forward (c10::Error,
// std::bad_alloc) fails the batch like a failed Forward (in a group it breaks the group); one
// from sampling fails its request; anything else thrown out of Step is caught by Run, which
// fails the running requests and serves on (a group breaks instead).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/status.h"
#include "common/text/tokenizer.h"
#include "common/wire/messages.h"
#include "gpu_worker/core/chunk_planner.h"
#include "gpu_worker/core/group_plan.h"
#include "gpu_worker/core/request_executor.h"
#include "gpu_worker/core/scheduler.h"
#include "gpu_worker/group/expert_group.h"
#include "gpu_worker/model/model.h"
#include "gpu_worker/sampling/sampler.h"

namespace fmoe {

struct EngineOptions {
  uint32_t max_batch = 8;  // Requests running at once. Default: 8
  // Tokens per step (decode tokens plus prompt chunks); 0 = whole prompts at once; else at least
  // max_batch (SchedulerOptions::Check). Default: 0
  uint32_t max_batched_tokens = 0;
  // Requests waiting for a slot; more are refused with an error event. Default: 1024
  uint32_t max_waiting = 1024;
  // Token ids that end generation besides a request's own (the model's eos). Default: none
  std::vector<int32_t> eos_token_ids;
  // The expert-parallel group; null or one rank = this rank runs alone. Default: none
  ExpertGroup* group = nullptr;
  // While idle, a keep-alive plan goes to the other ranks this often. Default: 1000
  int keepalive_ms = 1000;
  // This rank's expert-cache totals (summed across the group each iteration). Default: none
  std::function<ExpertFigures()> local_figures;
  // Called once, on the engine thread, when the group breaks. Default: none
  std::function<void(const Status&)> on_group_failure;
  // Expert-aware prefill chunks (core/chunk_planner.h): with a token budget, a prompt chunk the
  // budget would cut grows while cutting the prompt at its size would cost more than (1 +
  // chunk_overhead) x the prompt's prefill whole; 0 = the budget's chunks. Default: 0
  double chunk_overhead = 0;
  // The model's and the expert cache's side of the estimate (experts, top_k, MoE layers, the
  // cache's miss fraction, an expert's load time), engine thread; a prompt token's compute is
  // the engine's own measure once it has one (EngineStats::prompt_token_ns), the figure's
  // token_ns before. Empty or unknown figures: the budget's chunks. Default: none
  std::function<ChunkCosts()> chunk_costs;
  // Streaming a prefill's experts (core/chunk_planner.h StreamMode): off; auto, an iteration
  // with prompt tokens streams when StreamSooner says so on chunk_costs (with the measured
  // prompt token compute); on, every iteration with prompt tokens. The expert source must have
  // a stream buffer (ExpertSource::StreamNextIteration), else nothing streams. Default: off
  StreamMode prefill_stream = StreamMode::kOff;
};

struct EngineStats {
  uint64_t iterations = 0;
  uint64_t prefill_tokens = 0;
  uint64_t decode_tokens = 0;
  uint64_t requests_finished = 0;
  uint64_t requests_failed = 0;
  uint64_t forward_us = 0;     // Time inside Forward.
  uint64_t preemptions = 0;    // Running requests whose KV blocks were taken back (KV pool full).
  uint64_t prompt_chunks = 0;  // Prompt chunks run (a prompt the budget does not cut is one).
  // Expert-aware chunks (EngineOptions::chunk_overhead): of the prompt chunks run, those the
  // advisor grew past the budget's.
  uint64_t chunks_grown = 0;
  // A prompt token's measured compute (ns, moving average over steps of at least 32 prompt
  // tokens, or half the token budget if less, the expert cache's stall taken out); 0 until
  // measured.
  double prompt_token_ns = 0;
  // Iterations whose missing experts were streamed (EngineOptions::prefill_stream).
  uint64_t streamed_iterations = 0;
};

class Engine final : public RequestExecutor {
 public:
  using EventSink = std::function<void(const TokenEvent&)>;

  // `tokenizer` may be null: structured output then fails the request. `observer` may be null.
  Engine(EngineOptions options, MoeModel& model, ExpertSource& experts, const Tokenizer* tokenizer,
         ForwardObserver* observer, EventSink sink);
  ~Engine();

  // Any thread.
  void Submit(Generate request) override;
  void Cancel(uint64_t request_id) override;
  // Waiting plus running requests.
  uint32_t active() const override { return active_.load(std::memory_order_relaxed); }
  // Wakes Run() from WaitForWork without work (e.g. to stop).
  void Wake();

  // Engine thread. One iteration; false when there was nothing to run.
  bool Step();
  // Steps until stop() is true, sleeping while idle (checks stop at least every 50 ms).
  void Run(const std::function<bool()>& stop);
  const EngineStats& stats() const { return stats_; }
  // The group's expert-cache totals as of the last iteration (this rank's alone without a
  // group); any thread.
  ExpertFigures group_figures() const;
  bool group_failed() const { return group_failed_.load(); }
  // The KV pool's figures as of the last step; any thread.
  KvFigures kv_figures() const;
  // The prompt chunks' figures (stats' prompt_chunks, chunks_grown, prompt_token_ns) as of the
  // last step. Any thread.
  EngineFigures engine_figures() const;

 private:
  struct Sequence;
  struct Command {
    bool cancel = false;
    Generate request;
  };

  void DrainInbox();
  // The scheduler's admit hook: the request's KV cache (made on first admission, emptied on
  // later ones) takes the cached prefix of what it prefills; returns its length.
  uint32_t OnAdmit(uint64_t id);
  // Blocks for one piece of the step's work; while the pool lacks them the newest running
  // request is preempted (appended to `preempted`), this one last. false when it was.
  bool ReserveKv(const ScheduledWork& w, std::vector<uint64_t>* preempted);
  // The request's KV blocks go back to the pool; it waits at the front of the queue to be
  // prefilled again (its prompt and output so far), keeping its sampler state.
  void Preempt(Sequence& seq);
  void Admit(Generate request, int64_t submitted_us);
  // Marks a sequence finished (counters, observer); Finish also sends its final event.
  void Retire(Sequence& seq, FinishReason reason);
  void Finish(Sequence& seq, FinishReason reason, std::string error = {});
  // `too_long`: the request exceeds the context or the KV pool (the router answers 400).
  void Fail(uint64_t request_id, const std::string& error, bool too_long = false);
  void Emit(Sequence& seq, int32_t token, FinishReason finish, bool stop_token = false);
  // Moves the prompt's logprobs, if the prefill computed them and no event carried them yet,
  // into `ev`.
  void TakePromptLogprobs(Sequence& seq, TokenEvent* ev);
  // Samples the sequence's next token from its logits and reports it (or its end).
  void SampleAndEmit(Sequence& seq, std::span<const float> logits, uint32_t max_positions);
  // Run's boundary: something thrown out of Step ends the running requests with error events
  // (or, in a group, breaks the group), logged with their ids.
  void StepThrew(const std::exception_ptr& error);
  std::string RunningIds() const;  // "1,5,7" for logs; "none".
  // Sequences marked finished leave the scheduler and the engine.
  void DropFinished();
  // A prompt chunk's prompt logprobs join the ones of the chunks before it.
  static void AppendPromptLogprobs(Sequence& seq, PromptLogprobs chunk);
  void WaitForWork(int timeout_ms);
  bool grouped() const { return options_.group != nullptr && options_.group->world_size() > 1; }
  // Broadcasts a plan (with the requests ended since the last one); false when the group broke.
  bool SendPlan(PlanKind kind, std::span<const SequenceInput> inputs, bool stream = false);
  // Whether the step's Forward streams its missing experts (EngineOptions::prefill_stream).
  bool ShouldStream(uint32_t prompt_tokens, uint32_t decode_tokens) const;
  // options_.chunk_costs() (set), with the engine's measured prompt-token compute once it has one.
  ChunkCosts Costs() const;
  // Sums the step's requests' figures and the cache totals across the group, and the ranks'
  // per-sequence expert failures: `failed` (per input, empty for none, this rank's messages)
  // gains every other rank's. false when the group broke.
  bool SumFigures(std::span<const SequenceInput> inputs, std::span<const SequenceFailure> local,
                  std::vector<std::string>* failed);
  void GroupFailed(const Status& why);

  EngineOptions options_;
  MoeModel& model_;
  ExpertSource& experts_;
  const Tokenizer* tokenizer_;
  ForwardObserver* observer_;
  EventSink sink_;
  EngineStats stats_;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::pair<Command, int64_t>> inbox_;  // GUARDED_BY(mu_); with submit time (us).
  bool woken_ = false;                             // GUARDED_BY(mu_)
  std::atomic<uint32_t> active_{0};
  std::atomic<bool> group_failed_{false};
  mutable std::mutex figures_mu_;
  ExpertFigures group_figures_;  // GUARDED_BY(figures_mu_)
  KvFigures kv_figures_;         // GUARDED_BY(figures_mu_)
  // One device budget in a group: every rank's split at the last iteration's sum.
  std::vector<KvFigures::RankSplit> rank_splits_;  // GUARDED_BY(figures_mu_)
  EngineFigures engine_figures_;                   // GUARDED_BY(figures_mu_)
  // The pool's figures into kv_figures_, the prompt chunks' into engine_figures_ (engine
  // thread).
  void PublishFigures();

  // Engine thread only.
  Scheduler scheduler_;
  std::unordered_map<uint64_t, std::unique_ptr<Sequence>> sequences_;  // Waiting and running.
  std::vector<uint64_t> ended_;      // Left the batch since the last plan.
  std::vector<uint64_t> preempted_;  // Preempted since the last plan.
  uint64_t plan_step_ = 0;
  int64_t last_plan_us_ = 0;
};

}  // namespace fmoe
